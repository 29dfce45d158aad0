"""One ablation row: run a job config with overrides, print sampled and greedy held-out accuracy as one JSON line.

    python benchmarks/ablate.py --name "KL off" --config quickstart env.eval_tasks=100 ppo.init_kl_coef=0

docs/sampled-accuracy.md's table was made with this script (the exact override lists are given there).
Also reports, from metrics.jsonl, training-time accuracy and value explained variance over the last 10 steps.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", default="quickstart")
    parser.add_argument("--algo", default=None, help="ppo, grpo or dpo (default: the config's)")
    parser.add_argument("--out", default=None, help="where to append the JSON line (besides stdout)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    run_dir = tempfile.mkdtemp(prefix="ablate-")
    overrides = [f"out_dir={run_dir}", "progress=false", *args.overrides]
    started = time.time()
    if args.algo == "dpo" or args.config == "dpo":
        from agentrl.jobs.dpo import load_dpo_job, run_dpo_job

        summary = run_dpo_job(load_dpo_job(args.config, overrides))
    else:
        from agentrl.jobs.ppo import load_job, run_job

        summary = run_job(load_job(args.config, ([f"algo={args.algo}"] if args.algo else []) + overrides))
    row = {"name": args.name, "config": args.config, "overrides": args.overrides,
           "sampled": summary["after_sampled"]["accuracy"], "greedy": summary["after"]["accuracy"],
           "sampled_before": summary["before_sampled"]["accuracy"], "greedy_before": summary["before"]["accuracy"],
           "train_seconds": summary["train_seconds"], "wall_seconds": round(time.time() - started, 1)}
    metrics = Path(run_dir) / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        tail = rows[-10:]
        for key, name in (("env/accuracy", "train_acc_last10"), ("ppo/val/var_explained", "var_explained_last10")):
            values = [r[key] for r in tail if r.get(key) is not None]
            if values:
                row[name] = round(sum(values) / len(values), 3)
    line = json.dumps(row)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
