"""agentrl: reinforcement learning for tool-using LLM agents on transformers + peft + accelerate.

The classic TRL 0.11 names are exported here; they are imported lazily so that `agentrl.algos`
(pure maths) and `agentrl.envs` stay cheap to import.
"""

__version__ = "0.1.0"

_LAZY = {
    "DPOConfig": "agentrl.trainers.dpo",
    "DPOTrainer": "agentrl.trainers.dpo",
    "GRPOConfig": "agentrl.trainers.grpo",
    "GRPOTrainer": "agentrl.trainers.grpo",
    "PPOConfig": "agentrl.trl_compat",
    "PPOTrainer": "agentrl.trl_compat",
    "SFTConfig": "agentrl.trainers.sft",
    "SFTTrainer": "agentrl.trainers.sft",
    "AutoModelForCausalLMWithValueHead": "agentrl.models.value_head",
    "AutoModelForSeq2SeqLMWithValueHead": "agentrl.models.value_head",
    "create_reference_model": "agentrl.models.value_head",
    "set_seed": "agentrl.core",
    "CalculatorEnv": "agentrl.envs",
    "StepResult": "agentrl.envs",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
