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
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss. All inputs (B, T); mask 1 on action tokens.

    ratio = exp(logp - old_logp); loss = masked_mean(max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps))), each
    token's term times `tis_weights` when given (truncated importance sampling, see `tis_weights`).
    Returns (loss, stats) with stats `ratio` (mean), `clipfrac`, `approxkl` (0.5 E[(logp-old)^2], TRL's),
    `policykl` (E[old - logp]) and `k3kl` ((r-1) - log r, non-negative).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.max(pg_losses, pg_losses_clipped)
    if tis_weights is not None:
        per_token = per_token * tis_weights
    loss = masked_mean(per_token, mask)
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


def tis_weights(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling weights for a sampler that is not the trainer (a vLLM engine).

    w = min(pi_trainer(y) / pi_sampler(y), C) per token, detached: the policy-gradient term of each token is
    multiplied by w, correcting for the sampler's numerics differing from the trainer's (Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl).
    trainer_logprobs: the trainer's at the rollout's weights; sampler_logprobs: the sampler's; all (B, T).
    Returns (weights (B, T), stats `weight_mean` and `clipfrac`, the share of tokens truncated at C).
    """
    ratio = torch.exp(trainer_logprobs.detach().float() - sampler_logprobs.float())
    weights = ratio.clamp(max=clip)
    stats = {"weight_mean": masked_mean(weights, mask), "clipfrac": masked_mean((ratio > clip).float(), mask)}
    return weights, stats
