"""SFT end to end on tiny models: the trainer (LoRA, merged on save), the job (held-out tasks never enter
SFT, its model trains with PPO and PPO-ptx), the embedded model's cache, and one-line CLI errors."""

import json
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.cli import main
from agentrl.envs.calculator import calculator_demonstration, calculator_tasks
from agentrl.trainers.sft import SFTConfig, SFTTrainer

UNITS = ["env.name=examples.units_env:UnitsEnv", "env.tasks=examples.units_env:units_tasks",
         "env.demonstrations=examples.units_env:units_demonstrations"]
SMALL = ["env.train_tasks=100", "env.eval_tasks=30", "rollout.max_new_tokens=24", "progress=false"]


def calculator_rows(n: int) -> list[dict]:
    rng = random.Random(0)
    return [{"segments": calculator_demonstration(t, True, rng)} for t in calculator_tasks(n, split="train")]


def test_sft_learns_and_a_lora_model_is_saved_merged(tiny_base, tmp_path):
    from agentrl import SFTConfig as ExportedConfig, SFTTrainer as Exported
    from peft import LoraConfig, get_peft_model

    assert (Exported, ExportedConfig) == (SFTTrainer, SFTConfig)
    tok = AutoTokenizer.from_pretrained(tiny_base)
    config = SFTConfig(steps=30, batch_size=16, learning_rate=1e-2, warmup_steps=0, logging_steps=1, progress=False)
    trainer = SFTTrainer(AutoModelForCausalLM.from_pretrained(tiny_base), config, calculator_rows(64), tok)
    history = trainer.train(str(tmp_path / "metrics.jsonl"))
    assert history[-1]["loss"] < 0.8 * min(h["loss"] for h in history[:3])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 30

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]))
    trainer = SFTTrainer(model, SFTConfig(steps=3, batch_size=16, learning_rate=1e-2, progress=False),
                         calculator_rows(64), tok)
    trainer.train()
    ids = torch.tensor([tok("Question: What is 12 * 3?\n")["input_ids"]])
    with torch.no_grad():
        adapted = model.eval()(ids).logits
    trainer.save_model(str(tmp_path / "model"))
    assert not (tmp_path / "model" / "adapter_config.json").exists()  # a plain model, the adapter merged in
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, adapted, atol=1e-4, rtol=1e-4)


def test_sft_job_never_sees_held_out_tasks_and_its_model_trains_with_ppo_ptx(tmp_path, monkeypatch):
    import examples.units_env as units
    from agentrl.jobs.common import EnvSection

    seen, demonstrate = [], units.units_demonstrations

    def recording(task, rng):
        seen.append(task["question"])
        return demonstrate(task, rng)

    monkeypatch.setattr(units, "units_demonstrations", recording)
    sft = tmp_path / "sft"
    assert main(["sft", "--config", "quickstart", *UNITS, *SMALL, f"out_dir={sft}", "sft.steps=10", "sft.batch_size=16",
                 "model.builder.hidden_size=32", "model.builder.intermediate_size=64"]) == 0
    held_out = {t["question"] for t in units.units_tasks(30, seed=0, split="eval")}
    assert len(seen) == 160 and not held_out & set(seen)
    summary = json.loads((sft / "summary.json").read_text())
    assert summary["demonstrations"] == 160 and summary["eval_tasks"] == 30 and "accuracy" in summary["after"]
    meta = json.loads((sft / "model" / "agentrl_base.json").read_text())
    assert meta["source"].startswith("demonstrations:") and meta["sft"]["steps"] == 10
    tok = AutoTokenizer.from_pretrained(sft / "model")  # the tokenizer learned the environment's words
    assert len(tok("How many metres is 5 km?", add_special_tokens=False)["input_ids"]) < 12
    assert EnvSection().demonstrations is None

    ppo = tmp_path / "ppo"
    assert main(["ppo", "--config", "quickstart", *UNITS, *SMALL, f"model.base={sft / 'model'}", f"out_dir={ppo}",
                 "steps=2", "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.ppo_epochs=1",
                 "ppo.ptx_coef=0.5", "ppo.ptx_data=env"]) == 0
    rows = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    assert all(r["ppo/loss/ptx"] > 0 for r in rows) and len(seen) > 160  # PPO-ptx drew demonstrations too
    assert not held_out & set(seen)


def test_ppo_ptx_from_a_jsonl_file(tiny_base, tmp_path):
    from peft import LoraConfig, get_peft_model

    from agentrl import PPOConfig, PPOTrainer

    with pytest.raises(ValueError, match="ptx_data"):
        PPOConfig(ptx_coef=1.0)
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in calculator_rows(8)))
    tok = AutoTokenizer.from_pretrained(tiny_base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base), LoraConfig(r=4, target_modules=["q_proj"]))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=2, ppo_epochs=1, ptx_coef=1.0, ptx_data=str(data)),
                         model, None, tok)
    queries = [torch.tensor(tok("Question: What is 1 + 2?\n")["input_ids"])] * 2
    stats = trainer.step(queries, [torch.tensor(tok("Answer: 3", add_special_tokens=False)["input_ids"])] * 2, [1.0, 0.0])
    assert stats["ppo/loss/ptx"] > 0


def test_the_embedded_cache_is_keyed_on_the_demonstrations(tmp_path):
    from agentrl.jobs.base_model import build_from_demonstrations
    from agentrl.models.tiny import BaseModelConfig

    config, sft = BaseModelConfig(hidden_size=16, intermediate_size=32), SFTConfig(steps=2, batch_size=4, progress=False)
    rows_a = calculator_rows(8)
    rows_b = [{"segments": [[f"Say {w}:\n", False], [w, True]]} for w in ("alpha", "beta", "gamma", "delta")]

    def build(rows):
        out = build_from_demonstrations(tmp_path / "model", rows, config, sft)
        return json.loads((out / "agentrl_base.json").read_text())["source"], os.path.getmtime(out / "model.safetensors")

    (source_a, built_a), (again_a, reused) = build(rows_a), build(rows_a)
    assert (again_a, reused) == (source_a, built_a)  # same demonstrations: reused
    source_b, _ = build(rows_b)
    assert source_b != source_a  # another environment's demonstrations: rebuilt, never handed over
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tok.convert_ids_to_tokens(tok("gamma", add_special_tokens=False)["input_ids"]) == ["gamma"]


def last_line(capsys) -> str:
    """The error line; nothing else but progress bars on stderr (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n")
    return err.splitlines()[-1]


def test_a_users_mistake_is_one_line_and_exit_code_2(tiny_base, tmp_path, capsys):
    bad = tmp_path / "demos.jsonl"
    bad.write_text('{"segments": [["Q\\n", false], ["A", true]]}\n{"messages": [{"role": "user", "content": 1}]}\n')
    assert main(["sft", "--config", "quickstart", f"sft.data={bad}", f"model.base={tiny_base}", f"out_dir={tmp_path}",
                 "progress=false"]) == 2
    assert last_line(capsys) == f"agentrl: error: {bad}:2: field 'messages' item 0 needs a string 'content'"
    assert main(["ppo", "--config", "quickstart", "env.name=no_such_module:Env", f"out_dir={tmp_path}"]) == 2
    assert last_line(capsys).startswith("agentrl: error: env.name: cannot load 'no_such_module:Env'")
    assert main(["eval", "--model", str(tmp_path / "missing")]) == 2
    assert last_line(capsys).startswith(f"agentrl: error: {tmp_path / 'missing'}: no such model directory or file")
    with pytest.raises(ValueError, match="env.name"):  # --debug: the traceback
        main(["ppo", "--debug", "--config", "quickstart", "env.name=no_such_module:Env", f"out_dir={tmp_path}"])


@pytest.mark.slow
def test_units_example_sft_then_ppo_shortened(tmp_path):
    """The README's two commands, shortened: SFT learns the demonstrations' mix (tool or guess), then PPO
    makes the tool the greedy choice."""
    sft, ppo = tmp_path / "sft", tmp_path / "ppo"
    short = ["env.eval_tasks=64", "progress=false"]
    assert main(["sft", "--config", "quickstart", *UNITS, *short, f"out_dir={sft}", "sft.steps=200",
                 "sft.batch_size=32", "sft.warmup_steps=20"]) == 0
    assert main(["ppo", "--config", "quickstart", *UNITS, *short, f"model.base={sft / 'model'}", f"out_dir={ppo}",
                 "steps=8", "ppo.batch_size=32", "ppo.mini_batch_size=16"]) == 0
    summary = json.loads((ppo / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert 0.05 < summary["before_sampled"]["tool_call_rate"] < 0.8  # SFT learned both ways of answering
    assert before["format_error_rate"] < 0.2
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.2
