"""Direct preference losses (Rafailov et al. 2023, arXiv:2305.18290) and relatives, per example."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0):
    """Per-example preference losses. All inputs (B,): sequence logprobs summed over completion tokens.

    h = (logp(c) - logp(r)) - (ref(c) - ref(r))
      sigmoid: -(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h)   (eps > 0: conservative DPO)
      ipo:     (h - 1 / (2 beta))^2                                       (Azar et al. 2023)
      hinge:   relu(1 - beta h)                                           (SLiC, Zhao et al. 2023)
    Returns (losses, chosen_rewards, rejected_rewards), each (B,), rewards = beta (logp - ref), detached.
    """
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {DPO_LOSS_TYPES}")
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Reward-model loss -logsigmoid(s_c - s_r), per example. Inputs (B,)."""
    return -F.logsigmoid(chosen_scores - rejected_scores)
