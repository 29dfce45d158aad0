"""Jobs: what each `agentrl` command runs (one module per command). A job loads its config, builds the
trainer and the environment, evaluates before and after, and writes its results; nothing below imports it."""
