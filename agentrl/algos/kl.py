"""KL estimators and the KL-coefficient controllers of TRL 0.11 (Ziegler et al. 2019, arXiv:1909.08593)."""

from __future__ import annotations

import torch

KL_PENALTIES = ("kl", "abs", "mse", "full")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: str = "kl",
    logits: torch.Tensor | None = None,
    ref_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between policy and reference. logprobs, ref_logprobs: (B, T).

    "kl": logp - ref (k1), "abs": |logp - ref|, "mse": 0.5 (logp - ref)^2,
    "full": exact KL(pi || ref) over the vocabulary; needs `logits` and `ref_logits` of shape (B, T, V).
    """
    if kind == "kl":
        return logprobs - ref_logprobs
    if kind == "abs":
        return (logprobs - ref_logprobs).abs()
    if kind == "mse":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kl_penalty='full' needs the full logits of the policy and the reference")
        logp, ref_logp = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
        return (logp.exp() * (logp - ref_logp)).sum(-1)
    raise ValueError(f"unknown kl_penalty {kind!r}; choose one of {KL_PENALTIES}")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative KL(pi || ref) estimator `exp(ref - logp) - (ref - logp) - 1` (Schulman's k3)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0



def kl_shaped_rewards(token_scores: torch.Tensor, kl: torch.Tensor, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO rewards (Ziegler et al. 2019): -kl_coef * KL at every token, plus the scores.

    token_scores (B, T): each turn's (or episode's) score at its last sampled token, 0 elsewhere; kl (B, T), 0
    where the policy did not sample. Returns (rewards, non_score_rewards), each (B, T).
    """
    non_score_rewards = -kl_coef * kl
    return non_score_rewards + token_scores, non_score_rewards


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards `target` (Ziegler et al. 2019, sec. 2.2).

    err = clip(kl / target - 1, -0.2, 0.2);  value *= 1 + err * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
