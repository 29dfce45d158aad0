"""Pure RL maths on tensors: advantages, losses, KL estimators and controllers.

Everything here imports torch and nothing else of agentrl, so it can be read, tested and reused alone.
"""

from agentrl.algos.advantages import gae, masked_mean, masked_var, turn_gae, whiten
from agentrl.algos.dpo import bradley_terry_loss, dpo_loss
from agentrl.algos.group import (anchor_state_advantages, group_advantages, grpo_loss, rloo_advantages, turn_returns,
                                 zero_variance_fraction)
from agentrl.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty, kl_shaped_rewards
from agentrl.algos.losses import entropy_from_logits, ppo_policy_loss, ppo_value_loss

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "anchor_state_advantages",
    "bradley_terry_loss",
    "dpo_loss",
    "entropy_from_logits",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_penalty",
    "kl_shaped_rewards",
    "masked_mean",
    "masked_var",
    "ppo_policy_loss",
    "ppo_value_loss",
    "rloo_advantages",
    "turn_gae",
    "turn_returns",
    "whiten",
    "zero_variance_fraction",
]
