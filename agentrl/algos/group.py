"""Critic-free advantages and the GRPO objective.

GRPO: Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300); Dr. GRPO: Liu et al. 2025 (arXiv:2503.20783);
RLOO: Ahmadian et al. 2024 (arXiv:2402.14740).
"""

from __future__ import annotations

import torch

from agentrl.algos.advantages import masked_mean


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    if scores.dim() != 1 or group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"scores must be 1-D with a length divisible by group_size={group_size}, "
                         f"got shape {tuple(scores.shape)}")
    return scores.float().view(-1, group_size)


def group_advantages(scores: torch.Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-4, valid: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantages. scores: (N,) holding N / group_size consecutive groups -> (N,).

    A_i = (s_i - mean(group)) / (std(group) + eps); `normalize_std=False` is Dr. GRPO (no std division).
    A group whose scores are all equal (or a group of one) gets advantage 0: it carries no signal.
    The std is the unbiased one, as TRL's GRPOTrainer computes it.
    valid: (N,) bool, False for episodes left out (they failed for reasons outside the policy): they get
    advantage 0 and do not enter their group's mean or std; a group with fewer than two valid episodes gets 0.
    """
    g = _groups(scores, group_size)
    if valid is None:
        centered = g - g.mean(dim=1, keepdim=True)
        if normalize_std and group_size > 1:
            std = g.std(dim=1, keepdim=True)
            centered = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
        return centered.view(-1)
    v = valid.view(-1, group_size).to(g.dtype)
    n = v.sum(dim=1, keepdim=True)
    mean = (g * v).sum(dim=1, keepdim=True) / n.clamp(min=1)
    centered = (g - mean) * v
    if normalize_std:
        std = ((centered ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        centered = torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))
    return torch.where(n > 1, centered, torch.zeros_like(centered)).view(-1)


def rloo_advantages(scores: torch.Tensor, group_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A_i = s_i - mean_{j != i} s_j within each group. scores (N,) -> (N,); a group of one gets 0.
    valid: (N,) bool as in group_advantages: left-out episodes get 0 and are no one's baseline."""
    g = _groups(scores, group_size)
    v = torch.ones_like(g) if valid is None else valid.view(-1, group_size).to(g.dtype)
    n = v.sum(dim=1, keepdim=True)
    others = (n - v).clamp(min=1)  # the valid episodes besides i
    leave_one_out = ((g * v).sum(dim=1, keepdim=True) - g * v) / others
    out = (g - leave_one_out) * v
    return torch.where(n > 1, out, torch.zeros_like(out)).view(-1)


def turn_returns(turn_rewards: list[float], gamma: float = 1.0) -> list[float]:
    """R_t = sum_{k >= t} gamma^(k-t) r_k: what followed each turn's action, its own reward included."""
    out, running = [], 0.0
    for r in reversed(turn_rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


def anchor_state_advantages(group_ids: list, state_keys: list[list], returns: list[list[float]],
                            normalize_std: bool = True, eps: float = 1e-4) -> list[list[float]]:
    """Step-level advantages of GiGPO (Feng et al. 2025, arXiv:2505.10978): the turns taken from the same state
    (same group, same key) by different episodes form a step group, and each turn's return is compared within
    it: A_t = (R_t - mean) / (std + eps) (unbiased std; `normalize_std=False`: R_t - mean). A turn whose state
    no other episode of its group reached gets 0 (nothing to compare with), as does a step group of equal returns.

    group_ids[i]: episode i's group; state_keys[i][t], returns[i][t]: the state before its turn t (hashable)
    and that turn's return. Returns A[i][t], the same shape as returns.
    """
    members: dict[tuple, list[float]] = {}
    for g, keys, rets in zip(group_ids, state_keys, returns):
        for key, ret in zip(keys, rets):
            members.setdefault((g, key), []).append(ret)
    moments = {}
    for k, rets in members.items():
        n = len(rets)
        mean = sum(rets) / n
        std = (sum((x - mean) ** 2 for x in rets) / (n - 1)) ** 0.5 if n > 1 else 0.0
        moments[k] = (n, mean, std)
    out = []
    for g, keys, rets in zip(group_ids, state_keys, returns):
        row = []
        for key, ret in zip(keys, rets):
            n, mean, std = moments[(g, key)]
            if n < 2 or std == 0:
                row.append(0.0)
            else:
                row.append((ret - mean) / (std + eps) if normalize_std else ret - mean)
        out.append(row)
    return out


def zero_variance_fraction(scores: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose scores are all equal (no learning signal)."""
    g = _groups(scores, group_size)
    return float((g.max(dim=1).values - g.min(dim=1).values).abs().lt(1e-8).float().mean())


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
              ref_logprobs: torch.Tensor | None = None, aggregation: str = "token_mean",
              tis_weights: torch.Tensor | None = None):
    """Clipped ratio objective with per-sequence advantages broadcast to every completion token.

    logprobs, old_logprobs, mask, ref_logprobs: (B, T); advantages: (B,), or (B, T) for per-token ones.
    per-token loss = -min(r A, clip(r, 1-eps, 1+eps_high) A) * w + beta * k3(ref, logp), w = `tis_weights`
    (B, T) when given (truncated importance sampling, algos/losses.tis_weights), else 1.
    aggregation "token_mean": mean over all tokens of the batch (long answers weigh more, DAPO's choice);
    "sequence_mean": mean over each sequence's tokens, then over sequences (the original GRPO).
    Returns (loss, stats) with stats `clipfrac`, `kl` (mean k3, 0 when beta is 0), `ratio`.
    """
    if aggregation not in ("token_mean", "sequence_mean"):
        raise ValueError(f"aggregation must be 'token_mean' or 'sequence_mean', got {aggregation!r}")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T) per token, or (B,) per sequence
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.min(unclipped, clipped)
    if tis_weights is not None:
        per_token = per_token * tis_weights
    kl = torch.zeros_like(per_token)
    if beta:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1.0
        per_token = per_token + beta * kl
    if aggregation == "token_mean":
        loss = masked_mean(per_token, mask)
    else:
        loss = masked_mean(per_token, mask, dim=1).mean()
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped < unclipped).float(), mask),
                 "kl": masked_mean(kl, mask), "ratio": masked_mean(ratio, mask)}
    return loss, stats
