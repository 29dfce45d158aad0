"""Exact resume: a job killed with SIGKILL at a random moment and resumed with resume=auto ends with the same
metrics rows, summary and adapter as the uninterrupted run; SIGTERM checkpoints and exits cleanly; an injected
NaN skips its update and never reaches a checkpoint."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.checkpoint import read_checkpoint
from agentrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["env.train_tasks=64", "env.eval_tasks=8", "rollout.max_new_tokens=16", "progress=false", "checkpoint_every=1"]
JOBS = {
    "ppo": ["ppo", "--config", "quickstart", "steps=4", "ppo.batch_size=8", "ppo.mini_batch_size=4",
            "ppo.ppo_epochs=1"],
    "grpo": ["grpo", "--config", "grpo", "env.name=agentrl.envs:CalculatorEnv", "env.tasks=agentrl.envs:calculator_tasks",
             "steps=4", "grpo.tasks_per_step=2", "grpo.num_generations=4", "grpo.mini_batch_size=4"],
    "dpo": ["dpo", "--config", "dpo", "iterative.rounds=2", "iterative.tasks_per_round=32", "iterative.samples=4",
            "dpo.per_device_train_batch_size=1", "dpo.num_train_epochs=1", "dpo.logging_steps=1"],
}


def _rows(out: Path) -> dict[str, list[dict]]:
    """Every metrics*.jsonl / pairs*.jsonl / samples.jsonl row, timing fields dropped (wall clock differs between runs)."""
    return {p.name: [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "elapsed"))}
                     for line in p.read_text().splitlines()]
            for pattern in ("metrics*.jsonl", "pairs*.jsonl", "samples.jsonl") for p in sorted(out.glob(pattern))}


def _summary(out: Path) -> dict:
    s = json.loads((out / "summary.json").read_text())
    for key in ("train_seconds", "wall_seconds", "adapter_dir"):
        s.pop(key)
    s["config"].pop("out_dir")
    return s


def _kill_when(cmd: list[str], out: Path, rows: int, delay: float, sig: int) -> int:
    """Start the job in a subprocess, send `sig` `delay` s after its metrics files hold `rows` rows."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", *cmd], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        if sum(len(p.read_text().splitlines()) for p in out.glob("metrics*.jsonl")) >= rows:
            time.sleep(delay)
            proc.send_signal(sig)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _interrupted_equals_uninterrupted(job: str, base: str, tmp_path: Path, signals: list[int]) -> list:
    """Reference run; then the same job interrupted by each of `signals` at a random moment (after a random
    number of metrics rows, plus a random delay into the next step) and resumed with resume=auto each time."""
    cmd = [*JOBS[job], f"model.base={base}", *SMALL]
    ref, run = tmp_path / "reference", tmp_path / "run"
    assert main([*cmd, f"out_dir={ref}"]) == 0
    n = sum(len(v) for k, v in _rows(ref).items() if k.startswith("metrics"))
    rng, at, results = random.Random(), 0, []
    for sig in signals:
        at, delay = rng.randint(at + 1, n - len(signals) + len(results) + 1), rng.uniform(0.0, 0.3) * (sig == signal.SIGKILL)
        code, err = _kill_when([*cmd, f"out_dir={run}", "resume=auto"], run, at, delay, sig)
        print(f"{job}: signal {sig} {delay:.2f} s after row {at} of {n} -> exit {code}")
        results.append((code, err))
    assert main([*cmd, f"out_dir={run}", "resume=auto"]) == 0
    assert _rows(run) == _rows(ref)
    assert _summary(run) == _summary(ref)
    for f in (ref / "adapter").iterdir():
        assert f.read_bytes() == (run / "adapter" / f.name).read_bytes(), f.name
    return results


@pytest.mark.slow
@pytest.mark.parametrize("job", ["ppo", "grpo", "dpo"])
def test_killed_at_random_moments_then_resumed_equals_the_uninterrupted_run(job, tiny_base, tmp_path):
    if job == "ppo":  # SIGTERM: a checkpoint at the end of the step and a clean exit; then SIGKILL
        (code, err), _ = _interrupted_equals_uninterrupted(job, tiny_base, tmp_path, [signal.SIGTERM, signal.SIGKILL])
        assert code == 128 + signal.SIGTERM and "SIGTERM: checkpoint" in err, err[-2000:]
    else:
        _interrupted_equals_uninterrupted(job, tiny_base, tmp_path, [signal.SIGKILL])


def test_injected_nan_skips_the_update_and_stops_the_run(tiny_base, tmp_path, monkeypatch, capsys):
    import agentrl.trainers.ppo as ppo

    calls = {"n": 0}
    real = ppo.ppo_policy_loss

    def poisoned(*args, **kwargs):  # a NaN loss from the second PPO step on (2 mini-batches per step)
        calls["n"] += 1
        loss, stats = real(*args, **kwargs)
        return (loss * float("nan"), stats) if calls["n"] > 2 else (loss, stats)

    monkeypatch.setattr(ppo, "ppo_policy_loss", poisoned)
    out = tmp_path / "nan"
    assert main([*JOBS["ppo"], f"model.base={tiny_base}", *SMALL, f"out_dir={out}", "max_nonfinite_steps=2"]) == 1
    assert re.search(r"agentrl: step 3: .*2 steps in a row.*step-000002", capsys.readouterr().err)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 2.0, 2.0]
    one, two = (read_checkpoint(out / "checkpoints" / f"step-00000{i}")["trainer"] for i in (1, 2))
    for name, w in two["model"].items():
        assert torch.isfinite(w).all() and torch.equal(w, one["model"][name]), name  # the update was skipped
    assert not (out / "checkpoints" / "step-000003").exists()
    assert rows[0]["rollout/logprob_mismatch_max"] < 1e-4  # recomputed logprobs match the sampler's


def test_trainer_api_save_and_load_checkpoint_continue_exactly(tiny_base, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl import DPOTrainer
    from agentrl.checkpoint import Checkpointer
    from agentrl.trainers.dpo import DPOConfig

    rows = [{"prompt": f"Question: What is {i} + {i}?\n", "chosen": f"Answer: {2 * i}", "rejected": f"Answer: {i}"}
            for i in range(6)]

    def trainer():
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        args = DPOConfig(max_steps=4, per_device_train_batch_size=2, logging_steps=1, learning_rate=1e-2,
                         progress=False)
        return DPOTrainer(model=model, args=args, train_dataset=rows, tokenizer=AutoTokenizer.from_pretrained(tiny_base))

    a = trainer()
    history = a.train(metrics_path=str(tmp_path / "a.jsonl"), checkpointer=Checkpointer(tmp_path / "ck", every=2))
    b = trainer()
    b.load_checkpoint(str(tmp_path / "ck" / "step-000002"))
    later = b.train()
    drop = lambda rs: [{k: v for k, v in r.items() if k != "elapsed"} for r in rs]  # noqa: E731
    assert drop(later) == drop(history) and len(later) == 4
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def test_anneal_lr_falls_by_step_and_a_resumed_run_keeps_the_schedule(tiny_base, tmp_path):
    import shutil

    cmd = [*JOBS["ppo"], f"model.base={tiny_base}", *SMALL, "checkpoint_every=2", "ppo.anneal_lr=true",
           "ppo.learning_rate=0.004"]
    ref, run = tmp_path / "reference", tmp_path / "run"
    assert main([*cmd, f"out_dir={ref}"]) == 0
    rows = _rows(ref)["metrics.jsonl"]
    assert [r["ppo/learning_rate"] for r in rows] == pytest.approx([0.004, 0.003, 0.002, 0.001])
    shutil.copytree(ref, run)  # as if the run had stopped after its checkpoint at step 2
    shutil.rmtree(run / "checkpoints" / "step-000004")
    (run / "summary.json").unlink()
    assert main([*cmd, f"out_dir={run}", "resume=auto"]) == 0
    assert _rows(run) == _rows(ref)
