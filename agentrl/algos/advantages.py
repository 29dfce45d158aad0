"""Masked statistics and generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438)."""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1. `x`, `mask`: same shape. Empty mask gives 0."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over mask-1 positions (Bessel-corrected, as TRL 0.11 does)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
           moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Normalise `x` to unit variance over mask-1 positions; with `shift_mean`, also to mean 0.

    x, mask: (B, T). Positions with mask 0 are returned as 0 so they can never leak into a loss.
    moments: (mean, unbiased variance) to use instead of x's own, e.g. those of the global batch of
    several processes.
    """
    mean, var = moments if moments is not None else (masked_mean(x, mask), masked_var(x, mask))
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the mask-1 positions of each row.

    rewards, values, mask: (B, T); mask is 1 on tokens the policy sampled, 0 on prompt, tool-observation
    and padding tokens. The recursion skips mask-0 positions entirely, so the result equals GAE run on
    the sequence with those positions removed (an observation between two turns is not a time step:
    `V_{t+1}` is the value at the next *action* token). The value after the last action token is 0.

        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next

    Returns (advantages, returns), both (B, T), 0 where mask is 0; returns = advantages + values.
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards.to(values.dtype), values
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = adv_t * m
        # Only an action token moves the "next" pointers; masked positions are transparent.
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv_t, next_adv)
    returns = (advantages + values) * mask
    return advantages, returns
