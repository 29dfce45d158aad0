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


def turn_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn_ends: torch.Tensor | None = None,
    gamma: float = 1.0, lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns rather than tokens, spread back over each turn's tokens (turn-level PPO).

    rewards, values, mask: (B, T) as in `gae`. turn_ends: (B, T), 1 at each turn's last sampled token (None: the
    last mask-1 position of each run of them, i.e. the token before each observation). Turn k of a row is its
    mask-1 positions after turn end k-1 up to turn end k. Per turn:

        r_k = sum of the turn's token rewards (its score and its KL-shaped terms, undiscounted within the turn)
        V_k = the value at the turn's first mask-1 position: the position that predicts its first token, whose
              hidden state is the last token before it (the observation the environment returned, or the prompt)
        delta_k = r_k + gamma * V_{k+1} - V_k (V after the last turn is 0),   A_k = delta_k + gamma * lam * A_{k+1}

    Every token of turn k gets A_k and the return A_k + V_k. With one token per turn this is `gae`; with one
    turn it is `gae(gamma=1, lam=1)` at the turn's first token, given to all of its tokens.
    Returns (advantages, returns), both (B, T), 0 where mask is 0.
    """
    mask = mask.to(values.dtype)
    rewards = rewards.to(values.dtype) * mask
    on = mask > 0
    if turn_ends is None:  # a mask-1 position whose next position is mask 0 (or the row's end)
        after = torch.cat([on[:, 1:], torch.zeros_like(on[:, :1])], dim=1)
        ends = on & ~after
    else:
        ends = (turn_ends > 0) & on
    ends_l = ends.long()
    turn_id = ends_l.cumsum(1) - ends_l  # (B, T): turns ended strictly before each position
    # A turn starts at a mask-1 position when the previous mask-1 position of its row ended a turn (or none was).
    starts = torch.zeros_like(on)
    prev_end = torch.ones_like(on[:, 0])
    for t in range(on.shape[1]):
        starts[:, t] = on[:, t] & prev_end
        prev_end = torch.where(on[:, t], ends[:, t], prev_end)
    B, K = values.shape[0], int(turn_id[on].max()) + 1 if on.any() else 0
    idx = turn_id.clamp(max=max(K - 1, 0))
    turn_rewards = values.new_zeros(B, K).scatter_add_(1, idx, rewards) if K else values.new_zeros(B, 0)
    turn_values = values.new_zeros(B, K)
    rows, cols = starts.nonzero(as_tuple=True)
    turn_values[rows, turn_id[rows, cols]] = values[rows, cols]
    # Turns a row does not have hold r = V = 0 and sit after its last turn, so they add nothing below.
    turn_adv = torch.zeros_like(turn_values)
    next_value, next_adv = values.new_zeros(B), values.new_zeros(B)
    for k in reversed(range(K)):
        delta = turn_rewards[:, k] + gamma * next_value - turn_values[:, k]
        next_adv = delta + gamma * lam * next_adv
        turn_adv[:, k], next_value = next_adv, turn_values[:, k]
    if K == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    advantages = turn_adv.gather(1, idx) * mask
    returns = (turn_adv + turn_values).gather(1, idx) * mask
    return advantages, returns
