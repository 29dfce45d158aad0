"""Every bad setting is one line, `agentrl: error: <key>: <what>`, exit 2: ranges, NaN/inf, a key written twice
in YAML, and an `algo` that contradicts the command. All fail while the config loads, before any model."""

import math
from types import SimpleNamespace

import pytest

from agentrl.cli import _training_job, main
from agentrl.config import ConfigError, _load_yaml, load_config
from agentrl.jobs.common import CONFIG_DIR
from agentrl.jobs.dpo import DPOJobConfig
from agentrl.jobs.ppo import JobConfig, load_job
from agentrl.trainers.dpo import DPOConfig
from agentrl.trainers.grpo import GRPOConfig


def error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("command, override, message", [
    ("dpo", "dpo.beta=-1", "dpo.beta: must be a finite number > 0, got -1.0"),
    ("dpo", "dpo.beta=0", "dpo.beta: must be a finite number > 0, got 0.0"),
    ("ppo", "ppo.cliprange=nan", "ppo.cliprange: must be a finite number, got nan"),
    ("ppo", "ppo.learning_rate=.inf", "ppo.learning_rate: must be a finite number, got inf"),
    ("ppo", "ppo.learning_rate=-1e-4", "ppo.learning_rate: must be > 0, got -0.0001"),
    ("ppo", "ppo.temperature=0", "ppo.temperature: must be > 0, got 0.0"),
    ("grpo", "grpo.temperature=nan", "grpo.temperature: must be a finite number, got nan"),
    ("ppo", "rollout.top_p=2", "rollout.top_p: must be in (0, 1], got 2.0"),
    ("ppo", "rollout.top_p=0", "rollout.top_p: must be in (0, 1], got 0.0"),
    ("ppo", "rollout.max_new_tokens=0", "rollout.max_new_tokens: must be >= 1, got 0"),
    ("ppo", "keep_checkpoints=0", "keep_checkpoints: must be >= 1, got 0"),
    ("ppo", "sample_every=0", "sample_every: must be >= 1, got 0"),
    ("ppo", "model.lora_r=0", "model.lora_r: must be >= 1, got 0"),
    ("ppo", "steps=-1", "steps: must be >= 0, got -1"),
    ("dpo", "iterative.temperature=-1", "iterative.temperature: must be > 0, got -1.0"),
    ("grpo", "algo=ppo", "algo: 'ppo' (from an override) contradicts the command, which runs 'grpo'; drop algo, or "
                         "run `agentrl ppo ...`"),
])
def test_a_bad_setting_is_one_line_naming_the_key(capsys, command, override, message):
    config = {"ppo": "quickstart", "grpo": "grpo", "dpo": "dpo"}[command]
    line = error_line(capsys, [command, "--config", config, override])
    assert line == f"agentrl: error: {message}"  # an override's key, without the config file it is not in


def test_an_algo_in_the_file_that_contradicts_the_command(capsys):
    line = error_line(capsys, ["ppo", "--config", "grpo"])
    assert line.endswith(f"algo: 'grpo' (from {CONFIG_DIR / 'grpo.yaml'}) contradicts the command, which runs 'ppo'; "
                         f"drop algo, or run `agentrl grpo ...`"), line
    # the command still sets it where nothing else does (chat.yaml has no algo: key), and agreeing is fine
    assert _training_job(SimpleNamespace(config="chat", overrides=[]), "grpo").algo == "grpo"
    assert _training_job(SimpleNamespace(config="grpo", overrides=["algo=grpo"]), "grpo").algo == "grpo"


def test_a_bad_value_in_the_file_names_the_file(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("rollout:\n  top_p: 1.5\n")
    assert error_line(capsys, ["ppo", "--config", str(config)]) == \
        f"agentrl: error: {config}: rollout.top_p: must be in (0, 1], got 1.5"


def test_a_key_written_twice_names_the_file_line_and_key(tmp_path, capsys):
    config = tmp_path / "twice.yaml"
    config.write_text("steps: 3\nppo:\n  learning_rate: 1e-4\n  batch_size: 8\n  learning_rate: 1e-3\n")
    line = error_line(capsys, ["ppo", "--config", str(config)])
    assert line == (f"agentrl: error: {config}:5: key 'learning_rate' is written twice (first on line 3); "
                    f"YAML would silently keep the last")
    with pytest.raises(ConfigError, match="override 'model.target_modules={a: 1, a: 2}': line 1: key 'a' is written"):
        load_job("quickstart", ["model.target_modules={a: 1, a: 2}"])


def test_merge_keys_are_not_duplicates():
    assert _load_yaml("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n")["b"] == {"x": 3, "y": 2}


def test_valid_values_load_unchanged():
    config = load_job("quickstart", ["rollout.top_p=1", "rollout.top_p=0.9", "ppo.learning_rate=1e-4", "steps=0",
                                     "model.lora_r=1", "ppo.temperature=0.7"])
    assert (config.rollout.top_p, config.ppo.learning_rate, config.steps, config.model.lora_r) == (0.9, 1e-4, 0, 1)
    assert load_config(DPOJobConfig, None, ["dpo.beta=0.5"]).dpo.beta == 0.5


def test_the_dataclasses_refuse_nonsense_when_built_directly():
    with pytest.raises(ValueError, match="beta: must be a finite number > 0"):
        DPOConfig(beta=math.nan)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(label_smoothing=0.7)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        GRPOConfig(beta=-0.1)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        GRPOConfig(temperature=math.nan)
    assert JobConfig().algo == "ppo"


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "m", "--temperature", "nan"], "argument --temperature: must be a finite number > 0, got nan"),
    (["eval", "--model", "m", "--temperature", "0"], "argument --temperature: must be a finite number > 0, got 0"),
    (["eval", "--model", "m", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["preferences", "--model", "m", "--out", "x", "--samples", "-2"], "argument --samples: must be an integer >= 1"),
    (["compare", "--a", "m", "--b", "m", "--tasks", "0"], "argument --tasks: must be an integer >= 1, got 0"),
])
def test_command_line_options_are_checked_too(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
