"""Settings given to a trainer in code (not through a config file) are checked as the config's are: a bad value is
one UserError (a ValueError) naming the field, before anything trains."""

import math

import pytest

from agentrl.errors import UserError
from agentrl.trainers.dpo import DPOConfig, DPOTrainer
from agentrl.trainers.grpo import GRPOConfig
from agentrl.trainers.ppo import PPOConfig


@pytest.mark.parametrize("field, value", [("beta", -1.0), ("beta", math.nan), ("learning_rate", 0.0),
                                          ("label_smoothing", 0.7)])
def test_dpo_trainer_keyword_overrides_are_validated(field, value):
    # Before: DPOTrainer(beta=-1) set the field after DPOConfig's check, and trained the preferences reversed.
    with pytest.raises(UserError, match=rf"^{field}: must"):
        DPOTrainer(model=object(), tokenizer=object(), train_dataset=[], **{field: value})


def test_dpo_config_built_in_code_is_validated():
    with pytest.raises(UserError, match="^beta: must be a finite number > 0, got -1"):
        DPOConfig(beta=-1)


@pytest.mark.parametrize("field, value", [("cliprange", math.nan), ("cliprange", -0.2), ("cliprange_value", 0.0),
                                          ("learning_rate", -1e-5), ("learning_rate", math.inf),
                                          ("init_kl_coef", -0.1), ("vf_coef", math.nan), ("lam", 1.5),
                                          ("gamma", -0.1), ("temperature", 0.0)])
def test_ppo_config_built_in_code_is_validated(field, value):
    with pytest.raises(UserError, match=rf"^{field}: must"):
        PPOConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("epsilon", math.nan), ("epsilon", -0.2), ("epsilon_high", 0.0),
                                          ("beta", -1.0), ("learning_rate", math.nan)])
def test_grpo_config_built_in_code_is_validated(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        GRPOConfig(**{field: value})


def test_defaults_still_pass():
    PPOConfig(), GRPOConfig(), DPOConfig()
