"""The job behind `agentrl reward-model`: a Bradley-Terry reward model from a pairs file (trainers/reward.py)."""

from __future__ import annotations

from agentrl.config import load_config
from agentrl.jobs.common import resolve_config_path
from agentrl.trainers.reward import RewardModelConfig, train_reward_model


def load_reward_config(path: str | None, overrides: list[str] | None = None) -> RewardModelConfig:
    return load_config(RewardModelConfig, resolve_config_path(path) if path else None, overrides)


def run_reward_model_job(config: RewardModelConfig) -> dict:
    """Train, report held-out pairwise accuracy, save to `config.out_dir`; returns the saved metadata."""
    return train_reward_model(config)
