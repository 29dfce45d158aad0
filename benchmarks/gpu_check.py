"""The GPU check behind benchmarks/gpu_check.sh: a few PPO steps of the quickstart per case, each in its own process
(so peak memory and accelerate's process-wide state are the case's own), results as one JSON.

Cases: float32 weights (baseline); bfloat16 weights; float32 weights with bf16 mixed precision and gradient
checkpointing; vLLM rollouts vs hf rollouts at bfloat16 (when vLLM imports); 2 processes with torchrun (when 2
GPUs exist). Each case records rollout and update seconds per step, sampled tokens per rollout second, peak GPU
memory, the logprob mismatch and the training accuracy. Nothing is downloaded: the model is the embedded one
(built here, head_dim 32 for vLLM's kernels) or `--model DIR`, a local model directory.

    python benchmarks/gpu_check.py --out DIR [--model DIR] [--steps 8] [--dry-run]

--dry-run runs every case that this machine can run, on CPU, with 2 steps of 8 episodes: the Python parts of
the check (configs, overrides, the per-case child process, the JSON) are exercised without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cases(n_gpus: int, has_vllm: bool, dry_run: bool) -> dict[str, list[str]]:
    """Case name -> config overrides of `agentrl ppo --config quickstart`."""
    out = {
        "fp32": ["model.dtype=float32"],
        "bf16_weights": ["model.dtype=bfloat16", "ppo.logprob_mismatch_threshold=null"],
        "bf16_mixed_gradient_checkpointing": ["model.dtype=float32", "ppo.mixed_precision=bf16",
                                              "model.gradient_checkpointing=true",
                                              "ppo.logprob_mismatch_threshold=null"],
        "hf_rollout_bf16": ["model.dtype=bfloat16", "rollout.backend=hf", "ppo.logprob_mismatch_threshold=null"],
    }
    if has_vllm:
        out["vllm_rollout_bf16"] = ["model.dtype=bfloat16", "rollout.backend=vllm", "ppo.tis_clip=2.0",
                                    "ppo.logprob_mismatch_threshold=null"]
        if dry_run:
            out["vllm_rollout_bf16"].append("rollout.vllm_enforce_eager=true")
    if n_gpus >= 2:
        out["ddp_2_processes"] = ["model.dtype=float32"]
    return out


def run_case(name: str, overrides: list[str], out: Path) -> dict:
    """One case, in this process: the PPO job, then peak memory and the per-step figures from its metrics."""
    import torch

    from agentrl.jobs.ppo import load_job, run_job

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    summary = run_job(load_job("quickstart", overrides + [f"out_dir={out / name}"]))
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    mean = lambda key: sum(r.get(key) or 0.0 for r in rows) / max(len(rows), 1)  # noqa: E731
    tokens = mean("env/mean_response_length")  # sampled tokens per episode
    batch = summary["config"]["ppo"]["batch_size"]
    result = {
        "overrides": overrides, "steps": len(rows), "wall_seconds": round(time.time() - started, 1),
        "rollout_seconds_per_step": round(mean("time/rollout"), 3),
        "update_seconds_per_step": round(mean("time/ppo/total"), 3),
        # sampled tokens (loss-mask 1) per second of rollout: the throughput vLLM is for
        "sampled_tokens_per_rollout_second": round(tokens * batch / max(mean("time/rollout"), 1e-9), 1),
        "logprob_mismatch_mean": round(mean("rollout/logprob_mismatch_mean"), 5),
        "logprob_mismatch_max": round(max((r.get("rollout/logprob_mismatch_max") or 0.0) for r in rows), 5),
        "train_accuracy_first_last": [rows[0]["env/accuracy"], rows[-1]["env/accuracy"]],
        "eval_greedy_accuracy_before_after": [summary["before"]["accuracy"], summary["after"]["accuracy"]],
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
    }
    if "time/weight_sync" in rows[0]:
        result["weight_sync_seconds_per_step"] = round(mean("time/weight_sync"), 3)
        result["vllm_startup_seconds"] = summary.get("vllm_startup_seconds")
        result["tis_weight_mean"] = round(mean("tis/weight_mean"), 4)
    return result


# The real-model job of `make demo-real` (SFT, then PPO from the SFT model) on larger instruct models, each with
# its shipped config; the GPU machine reaches no hub, so each is a local directory given on the command line.
REAL_MODELS = {"qwen2.5-0.5b": "real-qwen2.5-0.5b", "qwen3-0.6b": "real-qwen3-0.6b"}


def run_real(name: str, model_dir: str, out: Path, env: dict, dry_run: bool) -> dict:
    """`agentrl sft` then `agentrl ppo` with configs/<REAL_MODELS[name]>.yaml; both summaries and wall times."""
    config, run_dir = REAL_MODELS[name], out / f"real-{name}"
    small = ["sft.steps=2", "steps=1", "env.eval_tasks=8", "ppo.batch_size=4", "ppo.mini_batch_size=4"] if dry_run else []
    result = {"model_dir": model_dir, "config": config}
    for job, extra in (("sft", [f"model.base={model_dir}", f"out_dir={run_dir / 'sft'}"]),
                       ("ppo", [f"model.base={run_dir / 'sft' / 'model'}", f"out_dir={run_dir / 'ppo'}"])):
        extra.append(f"retention_base={model_dir}")
        started = time.time()
        with (out / f"real-{name}-{job}.log").open("w") as f:
            code = subprocess.call([sys.executable, "-m", "agentrl.cli", job, "--config", config, "progress=false",
                                    *small, *extra], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        result[job] = {"exit_code": code, "seconds": round(time.time() - started, 1)}
        summary = run_dir / job / "summary.json"
        if code == 0 and summary.exists():
            data = json.loads(summary.read_text())
            result[job].update({k: data.get(k) for k in ("before", "before_sampled", "after", "after_sampled",
                                                          "retention", "train_seconds")})
        if code:
            break
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json, per-case runs and logs")
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded model)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 steps of 8 episodes: check the script itself")
    for name in REAL_MODELS:
        parser.add_argument(f"--{name}", default=None, metavar="DIR",
                            help=f"a local {name} instruct model directory: run the real-model job on it")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--overrides", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.case:
        result = run_case(args.case, args.overrides, out)
        (out / f"{args.case}.json").write_text(json.dumps(result, indent=2))
        return 0

    import importlib.util

    import torch

    n_gpus = torch.cuda.device_count()
    if not n_gpus and not args.dry_run:
        print("gpu_check: no CUDA GPU here; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    has_vllm = importlib.util.find_spec("vllm") is not None
    common = [f"steps={2 if args.dry_run else args.steps}", "checkpoint_every=0", "progress=false",
              "samples_per_step=0"]
    # Embedded model: head_dim 32 (hidden 64, 2 heads), which vLLM's attention kernels accept; built once.
    common += [f"model.base={args.model}"] if args.model else [
        "model.builder.num_heads=2", f"model.base_dir={out / 'base-model-hd32'}"]
    if args.dry_run:
        common += ["ppo.batch_size=8", "ppo.mini_batch_size=8", "env.eval_tasks=16"]
    report = {"machine": {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": n_gpus,
                          "gpu_names": [torch.cuda.get_device_name(i) for i in range(n_gpus)],
                          "vllm": has_vllm, "dry_run": args.dry_run}, "cases": {}}
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name, overrides in cases(n_gpus, has_vllm, args.dry_run).items():
        log = out / f"{name}.log"
        started = time.time()
        if name == "ddp_2_processes":  # the job itself under torchrun: one process per GPU
            cmd = ["torchrun", "--nproc_per_node", "2", "-m", "agentrl.cli", "ppo", "--config", "quickstart",
                   *common, *overrides, f"out_dir={out / name}"]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--case", name,
                   "--overrides", *common, *overrides]
        with log.open("w") as f:
            code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        result = {"exit_code": code, "seconds": round(time.time() - started, 1), "log": str(log)}
        if (out / f"{name}.json").exists():
            result.update(json.loads((out / f"{name}.json").read_text()))
        elif name == "ddp_2_processes" and code == 0:
            rows = (out / name / "metrics.jsonl").read_text().splitlines()
            result.update({"metrics_rows": len(rows), "summary": json.loads((out / name / "summary.json").read_text())})
        report["cases"][name] = result
        print(f"{name}: exit {code}, {result['seconds']} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    for name in REAL_MODELS:
        model_dir = getattr(args, name.replace(".", "_").replace("-", "_"))
        if model_dir:
            started = time.time()
            report.setdefault("real_models", {})[name] = result = run_real(name, model_dir, out, env, args.dry_run)
            print(f"real model {name}: {round(time.time() - started, 1)} s", flush=True)
            (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    cases_run = report["cases"]
    if "vllm_rollout_bf16" in cases_run and "hf_rollout_bf16" in cases_run:
        a, b = cases_run["vllm_rollout_bf16"], cases_run["hf_rollout_bf16"]
        if "rollout_seconds_per_step" in a and "rollout_seconds_per_step" in b:
            report["vllm_rollout_speedup"] = round(b["rollout_seconds_per_step"] / max(a["rollout_seconds_per_step"], 1e-9), 2)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    real_failed = any(job.get("exit_code") for r in report.get("real_models", {}).values()
                      for job in (r.get("sft", {}), r.get("ppo", {})))
    return int(any(c["exit_code"] for c in cases_run.values()) or real_failed)


if __name__ == "__main__":
    sys.exit(main())
