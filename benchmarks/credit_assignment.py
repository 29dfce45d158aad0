"""Turn-level credit assignment against today's trajectory-level methods (issue #27): steps and time to a held-out
target on multi-turn tasks, several seeds a side. Writes one JSON file per run and the table of docs/credit-assignment.md.

    OMP_NUM_THREADS=1 python benchmarks/credit_assignment.py --out runs/credit          # the whole grid, in turn
    OMP_NUM_THREADS=1 python benchmarks/credit_assignment.py --out runs/credit --table  # the table from what ran

Each run is a real training run of the task's shipped config (agentrl's JobConfig, overrides below) with, every
--eval-every steps, a sampled (T=1, the training temperature) and a greedy evaluation on --eval-tasks held-out
tasks at a fixed seed; the RNG streams of training are saved and restored around it, so evaluating changes no training step.
A run's steps to target: the first evaluated step whose held-out accuracy (--metric: sampled or greedy) reaches
the target of its task.
Wall and CPU seconds (resource.getrusage) are those of training up to that step, evaluation left out; the load average
is recorded at the start and end of each run, as the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

# (task, method) -> (config, overrides). "trajectory": today's method; "turn": the turn-level one.
GRID = {
    ("textarena", "trajectory"): ("textarena", []),
    ("textarena", "turn"): ("textarena", ["grpo.step_advantage_weight=1.0"]),
    ("multistep", "trajectory"): ("multistep-ppo", []),
    ("multistep", "turn"): ("multistep-ppo", ["ppo.gae_level=turn"]),
    # A control: token-level GAE whose lam no longer fades the final score over a turn's ~40 tokens.
    ("multistep", "token-lam1"): ("multistep-ppo", ["ppo.lam=1.0"]),
}
ALGO = {"textarena": "GRPO (+ GiGPO step advantages)", "multistep": "PPO (+ turn-level GAE)"}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_one(task: str, method: str, seed: int, steps: int, eval_every: int, eval_tasks: int, out: Path,
            extra: list[str]) -> dict:
    import numpy as np
    import torch

    from agentrl.jobs.common import add_lora, prepare_run, rollout_sampling
    from agentrl.jobs.evaluate import evaluate
    from agentrl.jobs.ppo import load_job, make_trainer

    config_name, overrides = GRID[(task, method)]
    algo = "grpo" if config_name == "textarena" else "ppo"
    overrides = overrides + [f"{algo}.seed={seed}", f"steps={steps}", "progress=false", "checkpoint_every=0",
                             f"out_dir={out}/{task}-{method}-{seed}"] + extra
    config = load_job(config_name, overrides)
    algo_config = config.ppo if config.algo == "ppo" else config.grpo
    run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, False, config.sft)
    held_out = run.eval_tasks[:eval_tasks]
    train_tasks = run.train_tasks(config.env, config.env.train_tasks, algo_config.seed)
    torch.manual_seed(algo_config.seed)
    model = add_lora(run.model, config.model)
    trainer = make_trainer(config, model, run.tokenizer, len(train_tasks), run.eval_tasks)
    curve, evaluating = [], [0.0, 0.0]  # wall and CPU seconds spent evaluating, left out of the run's times
    started_wall, started_cpu = time.time(), cpu_seconds()

    def held_out_accuracy(step: int) -> None:
        t0, c0 = time.time(), cpu_seconds()
        rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        kw = {**run.eval_kwargs(), "temperature": algo_config.temperature}
        m = evaluate(trainer.policy, run.tokenizer, run.env_factory, held_out, greedy=False, **kw)
        g = evaluate(trainer.policy, run.tokenizer, run.env_factory, held_out, greedy=True, **kw)
        torch.set_rng_state(rng[0]), random.setstate(rng[1]), np.random.set_state(rng[2])
        evaluating[0] += time.time() - t0
        evaluating[1] += cpu_seconds() - c0
        curve.append({"step": step, "accuracy": m["accuracy"], "greedy": g["accuracy"],
                      "wall_s": round(time.time() - started_wall - evaluating[0], 1),
                      "cpu_s": round(cpu_seconds() - started_cpu - evaluating[1], 1)})
        print(f"[{task} {method} seed {seed}] step {step}: held-out accuracy sampled {m['accuracy']:.3f} "
              f"greedy {g['accuracy']:.3f}", flush=True)

    def callback(step: int, stats: dict) -> None:
        if step % eval_every == 0 or step == steps:
            held_out_accuracy(step)

    load = os.getloadavg()[0]
    held_out_accuracy(0)
    trainer.train(run.env_factory, train_tasks, steps=steps, sampling=rollout_sampling(config.rollout,
                                                                                   algo_config.temperature),
                  metrics_path=str(Path(config.out_dir) / "metrics.jsonl"), progress=False, callback=callback)
    return {"task": task, "method": method, "seed": seed, "algo": config.algo, "config": config_name,
            "overrides": overrides, "eval_tasks": len(held_out), "curve": curve,
            "load_start": round(load, 2), "load_end": round(os.getloadavg()[0], 2)}


def dynamic_sampling(steps: int, out: Path, extra: list[str]) -> dict:
    """configs/grpo.yaml (make demo-grpo's) with grpo.dynamic_sampling on, `steps` steps: the logged fraction of
    groups dropped, the zero-variance fraction the update saw, and the episodes each update trained on."""
    from agentrl.jobs.common import add_lora, prepare_run, rollout_sampling
    from agentrl.jobs.ppo import load_job, make_trainer

    config = load_job("grpo", ["grpo.dynamic_sampling=true", f"steps={steps}", "progress=false",
                               "checkpoint_every=0", f"out_dir={out}/dynamic-sampling"] + extra)
    run = prepare_run(config.model, config.env, config.rollout, config.eval_seed, False, config.sft)
    train_tasks = run.train_tasks(config.env, config.env.train_tasks, config.grpo.seed)
    import torch

    torch.manual_seed(config.grpo.seed)
    trainer = make_trainer(config, add_lora(run.model, config.model), run.tokenizer, len(train_tasks), run.eval_tasks)
    started = time.time()
    history = trainer.train(run.env_factory, train_tasks, steps=steps, progress=False,
                            sampling=rollout_sampling(config.rollout, config.grpo.temperature),
                            metrics_path=str(Path(config.out_dir) / "metrics.jsonl"))
    keys = ("grpo/dropped_groups", "grpo/sampling_rounds", "grpo/uninformative_groups_used",
            "grpo/zero_variance_groups")
    return {"steps": steps, "wall_s": round(time.time() - started, 1), "per_step": [
        {k: h.get(k) for k in keys + ("env/accuracy",)} for h in history],
        "mean": {k: round(sum(h[k] for h in history) / len(history), 3) for k in keys},
        "episodes_per_update": config.grpo.tasks_per_step * config.grpo.num_generations}


def steps_to(curve: list[dict], target: float, metric: str = "accuracy") -> dict | None:
    """The first evaluated point at or above target (None: never reached)."""
    return next((p for p in curve if p[metric] >= target), None)


def table(out: Path, targets: dict[str, float], metric: str = "accuracy") -> str:
    rows = [r for r in (json.loads(p.read_text()) for p in sorted(out.glob("*.json"))) if "task" in r]
    lines = ["| task | method | target | seeds reached | steps to target (per seed) | mean steps | "
             "mean wall s | mean CPU s | start / final acc (mean) | load avg |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for task in ("textarena", "multistep"):
        for method in ("trajectory", "turn", "token-lam1"):
            runs = sorted((r for r in rows if r["task"] == task and r["method"] == method), key=lambda r: r["seed"])
            if not runs:
                continue
            target = targets[task]
            hits = [steps_to(r["curve"], target, metric) for r in runs]
            # A seed that never reached the target counts as the run's length (a lower bound, marked ">").
            per_seed = [str(h["step"]) if h else f">{r['curve'][-1]['step']}" for h, r in zip(hits, runs)]
            n = [h["step"] if h else r["curve"][-1]["step"] for h, r in zip(hits, runs)]
            wall = [h["wall_s"] if h else r["curve"][-1]["wall_s"] for h, r in zip(hits, runs)]
            cpu = [h["cpu_s"] if h else r["curve"][-1]["cpu_s"] for h, r in zip(hits, runs)]
            first = sum(r["curve"][0][metric] for r in runs) / len(runs)
            last = sum(r["curve"][-1][metric] for r in runs) / len(runs)
            loads = [r["load_start"] for r in runs] + [r["load_end"] for r in runs]
            name = {"trajectory": f"{ALGO[task].split(' ')[0]} trajectory (today)", "turn": ALGO[task],
                    "token-lam1": "PPO token-level GAE, lam 1 (control)"}[method]
            lines.append(f"| {task} | {name} | {target:.2f} | {sum(h is not None for h in hits)}/{len(runs)} | "
                         f"{', '.join(per_seed)} | {sum(n) / len(n):.1f} | {sum(wall) / len(wall):.0f} | "
                         f"{sum(cpu) / len(cpu):.0f} | {first:.3f} / {last:.3f} | "
                         f"{min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/credit")
    p.add_argument("--tasks", default="textarena,multistep")
    p.add_argument("--methods", default="trajectory,turn")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--target-textarena", type=float, default=0.5)
    p.add_argument("--target-multistep", type=float, default=0.5)
    p.add_argument("--metric", choices=("sampled", "greedy"), default="sampled", help="held-out accuracy of the target")
    p.add_argument("--dynamic-sampling", type=int, default=0, metavar="STEPS",
                   help="instead of the grid: configs/grpo.yaml with dynamic sampling for STEPS steps")
    p.add_argument("--table", action="store_true", help="only print the table of the runs in --out")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    targets = {"textarena": args.target_textarena, "multistep": args.target_multistep}
    if args.dynamic_sampling:
        result = dynamic_sampling(args.dynamic_sampling, out, args.overrides)
        (out / "dynamic-sampling.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result["mean"]), result["wall_s"], "s")
        return 0
    if not args.table:
        for seed in (int(s) for s in args.seeds.split(",")):  # seed by seed: a cut grid stays balanced
            for task in args.tasks.split(","):
                for method in args.methods.split(","):
                    path = out / f"{task}-{method}-{seed}.json"
                    if path.exists():
                        continue
                    result = run_one(task, method, seed, args.steps, args.eval_every, args.eval_tasks, out,
                                     args.overrides)
                    result["command"] = " ".join(["python", *sys.argv])
                    path.write_text(json.dumps(result, indent=1))
    print(table(out, targets, "accuracy" if args.metric == "sampled" else "greedy"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
