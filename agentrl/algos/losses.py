"""PPO's clipped surrogate losses (Schulman et al. 2017, arXiv:1707.06347), as TRL 0.11 computes them."""

from __future__ import annotations

import torch

from agentrl.algos.advantages import masked_mean


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss. All inputs (B, T); mask 1 on action tokens.

    ratio = exp(logp - old_logp); loss = masked_mean(max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps))).
    Returns (loss, stats) with stats `ratio` (mean), `clipfrac`, `approxkl` (0.5 E[(logp-old)^2], TRL's),
    `policykl` (E[old - logp]) and `k3kl` ((r-1) - log r, non-negative).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(pg_losses, pg_losses_clipped), mask)
    with torch.no_grad():
        stats = {
            "ratio": masked_mean(ratio, mask),
            "clipfrac": masked_mean((pg_losses_clipped > pg_losses).float(), mask),
            "approxkl": 0.5 * masked_mean(log_ratio.square(), mask),
            "policykl": masked_mean(-log_ratio, mask),
            "k3kl": masked_mean((ratio - 1.0) - log_ratio, mask),
        }
    return loss, stats


def ppo_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss. All inputs (B, T).

    v_clip = clip(v, v_old - c, v_old + c); loss = 0.5 masked_mean(max((v - R)^2, (v_clip - R)^2)).
    Returns (loss, stats) with `clipfrac`, the fraction of tokens where the clipped term was larger.
    """
    values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (values - returns).square()
    vf_losses2 = (values_clipped - returns).square()
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), mask)}
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the categorical distribution. logits: (B, T, V) -> (B, T)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
