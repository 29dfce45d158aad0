"""Rollouts: batched sampling with the KV cache and the multi-turn environment loop."""

from agentrl.rollout.engine import Episode, episode_metrics, rollout
from agentrl.rollout.sampling import Sample, SamplingParams, sample_batch

__all__ = ["Episode", "Sample", "SamplingParams", "episode_metrics", "rollout", "sample_batch"]
