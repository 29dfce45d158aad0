"""Models: the embedded tiny base model and the policy-with-value-head wrapper."""
