"""Truncated importance sampling (algos/losses.tis_weights) and its place in the PPO and GRPO losses."""

import math

import pytest
import torch

from agentrl.algos.group import grpo_loss
from agentrl.algos.losses import ppo_policy_loss, tis_weights
from agentrl.trainers.grpo import GRPOConfig
from agentrl.trainers.ppo import PPOConfig


def test_weights_are_the_truncated_ratio_of_trainer_to_sampler():
    trainer = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.3)]])
    sampler = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.1)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, stats = tis_weights(trainer, sampler, mask, clip=1.5)
    assert torch.allclose(w, torch.tensor([[1.5, 0.5, 1.5]]))  # ratios 2, 0.5, 3: the first and last truncated
    assert stats["weight_mean"].item() == pytest.approx(1.0) and stats["clipfrac"].item() == pytest.approx(0.5)
    assert not w.requires_grad


def test_weights_scale_each_tokens_policy_loss():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    w = torch.tensor([[0.5, 1.0, 2.0, 9.0], [1.5, 0.1, 9.0, 9.0]])
    plain, _ = ppo_policy_loss(logp, old, adv, mask, 0.2)
    same, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, torch.ones(2, 4))
    weighted, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, w)
    ratio = (logp - old).exp()
    per_token = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    by_hand = sum(w[i, t] * per_token[i, t] for i in range(2) for t in range(4) if mask[i, t]) / mask.sum()
    assert torch.equal(plain, same) and weighted.item() == pytest.approx(by_hand.item(), rel=1e-6)

    seq_adv = torch.tensor([1.0, -2.0])
    plain, _ = grpo_loss(logp, old, seq_adv, mask, 0.2)
    weighted, _ = grpo_loss(logp, old, seq_adv, mask, 0.2, tis_weights=w)
    per_token = -torch.min(ratio * seq_adv[:, None], ratio.clamp(0.8, 1.2) * seq_adv[:, None])
    by_hand = sum(w[i, t] * per_token[i, t] for i in range(2) for t in range(4) if mask[i, t]) / mask.sum()
    assert weighted.item() == pytest.approx(by_hand.item(), rel=1e-6) and plain.item() != weighted.item()


def test_tis_clip_is_off_by_default_and_must_be_positive():
    assert PPOConfig().tis_clip is None and GRPOConfig().tis_clip is None
    for cls in (PPOConfig, GRPOConfig):
        with pytest.raises(ValueError, match="tis_clip must be > 0"):
            cls(tis_clip=0.0)
