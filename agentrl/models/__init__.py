"""Models: the embedded tiny model (config + tokenizer) and the policy-with-value-head wrapper."""
