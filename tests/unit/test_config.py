
import pytest

from agentrl.config import ConfigError, load_config
from agentrl.jobs.common import CONFIG_DIR
from agentrl.jobs.ppo import JobConfig, load_job
from agentrl.trainers.ppo import PPOConfig


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    from agentrl.jobs.dpo import DPOJobConfig
    from agentrl.trainers.reward import RewardModelConfig

    cls = {"dpo": DPOJobConfig, "real-dpo": DPOJobConfig, "reward-model": RewardModelConfig}.get(path.stem, JobConfig)
    config = load_config(cls, path)
    if cls is JobConfig:
        assert config.ppo.batch_size % config.ppo.backward_batch_size == 0
        assert config.algo in ("ppo", "grpo")


def test_overrides_and_errors(tmp_path):
    config = load_job("quickstart", ["steps=3", "ppo.learning_rate=1e-4", "model.target_modules=[q_proj, v_proj]"])
    assert config.steps == 3 and config.ppo.learning_rate == 1e-4 and config.model.target_modules == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        load_job("quickstart", ["ppo.learnin_rate=1"])
    with pytest.raises(ConfigError, match="ppo.batch_size: expected an integer"):
        load_job("quickstart", ["ppo.batch_size=big"])
    with pytest.raises(ConfigError, match="kl_penalty"):
        load_job("quickstart", ["ppo.kl_penalty=wrong"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("ppo:\n  cliprange: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: ppo.cliprange: expected a number"):
        load_config(JobConfig, bad)


def test_ppo_config_has_trl_defaults():
    c = PPOConfig()
    assert (c.learning_rate, c.batch_size, c.mini_batch_size, c.ppo_epochs, c.init_kl_coef, c.target, c.horizon) == \
        (1.41e-5, 128, 128, 4, 0.2, 6.0, 10000.0)
    assert (c.gamma, c.lam, c.cliprange, c.cliprange_value, c.vf_coef, c.adap_kl_ctrl, c.kl_penalty) == \
        (1.0, 0.95, 0.2, 0.2, 0.1, True, "kl")
    assert (c.ratio_threshold, c.target_kl, c.early_stopping, c.max_grad_norm) == (10.0, 1.0, False, None)
    with pytest.raises(ValueError, match="multiple"):
        PPOConfig(batch_size=10, mini_batch_size=4)
