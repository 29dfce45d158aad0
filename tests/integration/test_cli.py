"""The command line end to end on the tiny test model: eval, ppo (LoRA and full fine-tuning), bad configs."""

import json

import pytest
import torch

from agentrl.cli import main

TINY_JOB = ["steps=2", "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.ppo_epochs=1", "env.train_tasks=64",
            "env.eval_tasks=16", "rollout.max_new_tokens=16", "progress=false"]


def test_eval_prints_and_writes_metrics(tiny_base, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", tiny_base, "--env", "agentrl.envs:CalculatorEnv", "--tasks", "12", "--seed", "1",
                 "--max-new-tokens", "16", "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())
    for key in ("accuracy", "tool_call_rate", "mean_score", "format_error_rate", "mean_turns"):
        assert key in metrics and key in capsys.readouterr().out or key in metrics
    assert metrics["tasks"] == 12 and metrics["decoding"] == "greedy"


def test_ppo_job_writes_summary_adapter_and_metrics(tiny_base, tmp_path):
    out = tmp_path / "run"
    assert main(["ppo", "--config", "quickstart", f"model.base={tiny_base}", f"out_dir={out}", *TINY_JOB]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("before", "after", "ppo_steps", "eval_tasks", "wall_seconds", "base_model_dir", "adapter_dir"):
        assert key in summary
    for key in ("accuracy", "tool_call_rate", "mean_score", "format_error_rate"):
        assert key in summary["before"] and key in summary["after"]
    assert summary["ppo_steps"] == 2 and summary["eval_tasks"] == 16
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "adapter" / "adapter_config.json").exists()
    # the saved adapter evaluates through the CLI
    assert main(["eval", "--model", tiny_base, "--adapter", str(out / "adapter"), "--tasks", "4",
                 "--max-new-tokens", "8"]) == 0


def test_full_finetuning_job_saves_a_loadable_model(tiny_base, tmp_path):
    out = tmp_path / "full"
    assert main(["ppo", "--config", "quickstart", f"model.base={tiny_base}", "model.lora=false", f"out_dir={out}",
                 *TINY_JOB]) == 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "model")
    AutoTokenizer.from_pretrained(out / "model")


def test_user_environment_from_the_command_line(tiny_base, tmp_path):
    out = tmp_path / "echo"
    assert main(["ppo", "--config", "quickstart", f"model.base={tiny_base}", f"out_dir={out}",
                 "env.name=examples.echo_env:EchoEnv", "env.tasks=examples.echo_env:echo_tasks", *TINY_JOB]) == 0
    assert json.loads((out / "summary.json").read_text())["after"]["mean_turns"] == 1.0


def test_bad_config_key_is_named(capsys):
    assert main(["ppo", "--config", "quickstart", "ppo.clip_range=0.1"]) == 2
    assert "did you mean 'cliprange'" in capsys.readouterr().err


def test_nan_weights_never_reach_a_checkpoint(tiny_base, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl import PPOConfig, PPOTrainer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2), model, None, AutoTokenizer.from_pretrained(tiny_base))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "previous.txt").write_text("kept")
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        trainer.save_pretrained(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "previous.txt").read_text() == "kept"  # the old checkpoint is untouched


def test_tool_using_example_environment_trains_from_the_command_line(tiny_base, tmp_path):
    out = tmp_path / "units"
    assert main(["ppo", "--config", "quickstart", f"model.base={tiny_base}", f"out_dir={out}",
                 "env.name=examples.units_env:UnitsEnv", "env.tasks=examples.units_env:units_tasks", *TINY_JOB]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"]["tasks"] == 16


def test_units_example_tool_is_a_real_tool():
    from examples.units_env import UnitsEnv

    env = UnitsEnv()
    env.reset({"question": "How many metres is 3 km?", "answer": "3000"})
    assert env.step('Action: convert({"value": 3, "unit": "km"})\n').observation == "Observation: 3000\n"
    assert env.step("Answer: 3000").reward == 1.0
    env.reset({"question": "How many metres is 3 km?", "answer": "3000"})
    assert "KeyError" in env.step('Action: convert({"value": 3, "unit": "mile"})\n').observation


@pytest.mark.parametrize("config", ["chat", "search"])
def test_chat_and_search_demos_run_end_to_end(config, tmp_path):
    """The demo configs on a briefly trained embedded model of their own corpus: build, evaluate, PPO, save."""
    out = tmp_path / config
    assert main(["ppo", "--config", config, f"model.base_dir={tmp_path / 'base'}", "model.builder.steps=30",
                 "model.builder.batch_size=32", "model.builder.warmup_steps=5", f"out_dir={out}", *TINY_JOB]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"]["tasks"] == 16 and summary["steps"] == 2
    assert (out / "adapter" / "adapter_config.json").exists()
