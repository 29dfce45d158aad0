"""Two processes (gloo, CPU) against one: the same update, and a short 2-process PPO job that learns.

The two-process side runs under `torchrun`, as users launch it; the one-process side runs in the test itself.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentrl.checkpoint import read_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ["torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def accelerate_launch(config: str = "multi_cpu") -> list[str]:
    """`accelerate launch` with a shipped config (2 processes), on a free port (others may hold 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["accelerate.commands.launch", "--config_file", f"configs/accelerate/{config}.yaml",
            "--main_process_port", str(port)]


def launch(launcher: list[str], args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", *launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def two_process_updates(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    launch(TORCHRUN, [str(Path(dist_worker.__file__)), str(out)])
    return out


@pytest.fixture(scope="module")
def fsdp_updates(tmp_path_factory):
    """The same updates under FSDP (full shard, one unit per decoder layer), on CPU with gloo."""
    out = tmp_path_factory.mktemp("fsdp")
    done = launch(accelerate_launch("fsdp"), [str(Path(dist_worker.__file__)), str(out)])
    assert done.stdout.count("dist_worker: trained under FSDP") == 2, done.stdout[-2000:]
    return out


def one_process_greedy(base: str, n: int) -> dict:
    """Greedy metrics of the base model on the first n held-out calculator tasks (seed 0), in this process."""
    from agentrl.envs import CalculatorEnv, calculator_tasks
    from agentrl.jobs.evaluate import evaluate, load_policy

    model, tok = load_policy(base)
    return evaluate(model, tok, CalculatorEnv, calculator_tasks(n, 0, "eval"))


def assert_same_update(split: dict, single: dict, before: dict) -> None:
    assert set(split) == set(single)
    moved = max((single[n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-3  # the update did something, so agreeing is not trivial
    worst = max((split[n] - single[n]).abs().max().item() for n in single)
    assert worst < 1e-5, worst


@pytest.mark.slow
@pytest.mark.parametrize("updates", ["two_process_updates", "fsdp_updates"])
def test_ppo_step_split_over_two_processes_equals_one(updates, request):
    tok = dist_worker.tokenizer()
    rows = dist_worker.ppo_rows(tok)
    single = dist_worker.ppo_update(rows)  # 64 rows, one process
    split = load_file(str(request.getfixturevalue(updates) / "ppo.safetensors"))  # 32 + 32 rows, two processes
    stats = [k for k in single if k.startswith("stats.")]
    for k in stats:  # global statistics, not rank 0's
        assert split.pop(k).item() == pytest.approx(single.pop(k).item(), abs=1e-5), k
    from agentrl import AutoModelForCausalLMWithValueHead

    before = {n: p.detach() for n, p in AutoModelForCausalLMWithValueHead(
        dist_worker.tiny_model(tok), v_head_init_std=0.1).named_parameters()}
    assert_same_update(split, single, {n: before[n] for n in single})


@pytest.mark.slow
@pytest.mark.parametrize("updates", ["two_process_updates", "fsdp_updates"])
def test_grpo_update_split_over_two_processes_equals_one(updates, request):
    tok = dist_worker.tokenizer()
    single = dist_worker.grpo_update(dist_worker.grpo_episodes(tok))
    split = load_file(str(request.getfixturevalue(updates) / "grpo.safetensors"))
    assert split.pop("stats.grpo/mean_scores").item() == pytest.approx(single.pop("stats.grpo/mean_scores").item())
    before = dict(dist_worker.tiny_model(tok).named_parameters())
    assert_same_update(split, single, {n: before[n].detach() for n in single})


@pytest.mark.slow
def test_two_process_ppo_job_learns_writes_once_and_resumes(embedded_base, tmp_path):
    """`accelerate launch --config_file configs/accelerate/multi_cpu.yaml -m agentrl.cli ppo` (the equivalence
    tests above use torchrun), stopped after 4 steps and resumed to 8: one summary per launch, one metrics row
    per step, and the tool-call rate rises. (By hand, a run resumed like this ends with the same metrics,
    samples and adapter bytes as an uninterrupted one; README "Scaling up".)"""
    out = tmp_path / "run"
    args = ["-m", "agentrl.cli", "ppo", "--config", "quickstart", f"model.base={embedded_base}", f"out_dir={out}",
            "ppo.batch_size=32", "ppo.mini_batch_size=16", "env.eval_tasks=16", "progress=false", "checkpoint_every=4"]
    first = launch(accelerate_launch(), [*args, "steps=4"])
    done = launch(accelerate_launch(), [*args, "steps=8", "resume=auto"])
    for run in (first, done):
        assert run.stdout.count("world size 2 (MULTI_CPU)") == 1
        assert run.stdout.count("held-out tasks") == 1  # one summary printed
    assert "resuming from" in done.stderr and "step-000004" in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["episodes"] == 8 * 64
    rates = [r["env/tool_call_rate"] for r in rows]  # over both ranks' 64 episodes a step
    assert sum(rates[-2:]) / 2 > sum(rates[:2]) / 2 + 0.15, rates
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000004", "step-000008"]
    # Each process evaluated its 8 of the 16 held-out tasks; greedy, that is what one process gets.
    assert summary["before"] == one_process_greedy(embedded_base, 16)


@pytest.mark.slow
def test_fsdp_ppo_job_runs_saves_and_resumes(embedded_base, tmp_path):
    """`agentrl ppo` under configs/accelerate/fsdp.yaml on CPU (gloo): 2 steps, then resumed to 3. Rollouts and
    evaluations run on every process with the parameters gathered; the checkpoint and adapter hold whole
    tensors. (By hand: these runs end with the same metrics and adapter bytes as the same runs under DDP,
    README "Scaling up".)"""
    out = tmp_path / "run"
    args = ["-m", "agentrl.cli", "ppo", "--config", "quickstart", f"model.base={embedded_base}", f"out_dir={out}",
            "ppo.batch_size=8", "ppo.mini_batch_size=4", "env.eval_tasks=8", "progress=false", "checkpoint_every=2"]
    first = launch(accelerate_launch("fsdp"), [*args, "steps=2"])
    done = launch(accelerate_launch("fsdp"), [*args, "steps=3", "resume=auto"])
    for run in (first, done):
        assert run.stdout.count("world size 2 (FSDP)") == 1
        assert run.stdout.count("held-out tasks") == 1
    assert "resuming from" in done.stderr and "step-000002" in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["before"] == one_process_greedy(embedded_base, 8)
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    trained = read_checkpoint(out / "checkpoints" / "step-000003")["trainer"]["model"]
    lora_b = [k for k in adapter if "lora_B" in k]
    assert lora_b and all(adapter[k].abs().max() > 0 for k in lora_b)  # whole, trained tensors
    assert any("norm" in k for k in adapter)  # the norm gains (modules_to_save) are saved too
    # The adapter is the checkpoint's trained weights, gathered from both shards.
    for name, tensor in trained.items():
        if "lora_B" in name and "q_proj" in name:
            key = next(k for k in adapter if k.endswith(name.split("base_model.model.", 1)[1].replace(".default", "")))
            assert torch.equal(adapter[key], tensor)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install 'agentrl[deepspeed]')")
def test_deepspeed_zero2_and_zero3_ppo_jobs_run_on_cpu_and_agree(embedded_base, tmp_path):
    """`agentrl ppo` under configs/accelerate/zero2.yaml and zero3.yaml on CPU (DeepSpeed finds no GPU and uses
    gloo): both run to a summary, and their adapters agree (by hand, both equal the DDP run's: README)."""
    adapters = {}
    for stage in ("zero2", "zero3"):
        out = tmp_path / stage
        done = launch(accelerate_launch(stage), ["-m", "agentrl.cli", "ppo", "--config", "quickstart",
                                                 f"model.base={embedded_base}", f"out_dir={out}", "steps=2",
                                                 "ppo.batch_size=8", "ppo.mini_batch_size=4", "env.eval_tasks=8",
                                                 "progress=false"])
        assert done.stdout.count("world size 2 (DEEPSPEED)") == 1 and done.stdout.count("held-out tasks") == 1
        adapters[stage] = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in adapters["zero3"].items() if "lora_B" in k)
    assert max((adapters["zero2"][k] - adapters["zero3"][k]).abs().max().item() for k in adapters["zero2"]) < 1e-5
