"""Kill a job with SIGKILL at random moments, resume it with resume=auto, and compare with an uninterrupted run.

    python benchmarks/resume_kill.py --job ppo  --config quickstart --out /tmp/rk --kills 2 --seed 1 -- steps=6 ...
    python benchmarks/resume_kill.py --job grpo --config grpo ...
    python benchmarks/resume_kill.py --job dpo  --config dpo ...

The uninterrupted run goes to OUT/reference; the killed one to OUT/killed. Each kill lands at a uniform random
moment of the run (import, set-up, evaluation, a rollout, an update, a checkpoint write, the final evaluation).
Compared: every metrics*.jsonl, pairs*.jsonl and samples.jsonl row, summary.json, and the saved adapter's files, byte for
byte, except timing fields (time/*, elapsed, train_seconds, wall_seconds) and the out_dir-dependent paths
(out_dir, adapter_dir). Exit status 0 when everything matches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TIMING = ("time/", "elapsed")
SUMMARY_SKIP = ("train_seconds", "wall_seconds", "adapter_dir")


def command(job: str, config: str, out: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli", job, "--config", config, f"out_dir={out}", "progress=false",
            *overrides]


def clean_row(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def clean_summary(summary: dict) -> dict:
    summary = {k: v for k, v in summary.items() if k not in SUMMARY_SKIP}
    summary["config"] = {k: v for k, v in summary["config"].items() if k != "out_dir"}
    return summary


def compare(a: Path, b: Path) -> list[str]:
    problems = []
    for pattern in ("metrics*.jsonl", "pairs*.jsonl", "samples.jsonl"):
        names = sorted(p.name for p in a.glob(pattern))
        if names != sorted(p.name for p in b.glob(pattern)):
            problems.append(f"{pattern}: {names} vs {sorted(p.name for p in b.glob(pattern))}")
            continue
        for name in names:
            ra = [json.loads(x) for x in (a / name).read_text().splitlines()]
            rb = [json.loads(x) for x in (b / name).read_text().splitlines()]
            if len(ra) != len(rb):
                problems.append(f"{name}: {len(ra)} rows vs {len(rb)}")
            for i, (x, y) in enumerate(zip(ra, rb)):
                if clean_row(x) != clean_row(y):
                    diff = [k for k in clean_row(x) if clean_row(x).get(k) != clean_row(y).get(k)]
                    problems.append(f"{name} row {i}: differs in {diff[:5]}")
                    break
    sa, sb = (clean_summary(json.loads((d / "summary.json").read_text())) for d in (a, b))
    if sa != sb:
        problems.append(f"summary.json differs in {[k for k in sa if sa[k] != sb.get(k)]}")
    for adapter in ("adapter", "model"):
        if (a / adapter).exists():
            for f in sorted((a / adapter).iterdir()):
                if f.read_bytes() != (b / adapter / f.name).read_bytes():
                    problems.append(f"{adapter}/{f.name} differs")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=["ppo", "grpo", "dpo"], required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse-reference", action="store_true", help="keep OUT/reference if it is complete")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out, rng = Path(args.out), random.Random(args.seed)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    ref, killed = out / "reference", out / "killed"
    duration_file = out / "reference.seconds"
    if not (args.reuse_reference and (ref / "summary.json").exists() and duration_file.exists()):
        shutil.rmtree(ref, ignore_errors=True)
        t0 = time.time()
        subprocess.run(command(args.job, args.config, ref, args.overrides), env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        duration_file.parent.mkdir(parents=True, exist_ok=True)
        duration_file.write_text(str(time.time() - t0))
    duration = float(duration_file.read_text())
    shutil.rmtree(killed, ignore_errors=True)
    log = []
    for k in range(args.kills):
        at = rng.uniform(0.0, duration)
        proc = subprocess.Popen(command(args.job, args.config, killed, [*args.overrides, "resume=auto"]), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            proc.wait(timeout=at)
            log.append(f"kill {k + 1}: the run finished before {at:.1f} s (rc {proc.returncode})")
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            steps = sorted(p.name for p in (killed / "checkpoints").glob("step-*")) if (killed / "checkpoints").exists() else []
            log.append(f"kill {k + 1}: SIGKILL at {at:.1f} s of ~{duration:.1f} s; checkpoints then: {steps}")
        proc.stderr.close()
    t0 = time.time()
    final = subprocess.run(command(args.job, args.config, killed, [*args.overrides, "resume=auto"]), env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    messages = [line for line in final.stderr.splitlines() if line.startswith("agentrl:")]
    log.append(f"resumed to the end in {time.time() - t0:.1f} s (rc {final.returncode}): {messages}")
    if final.returncode:
        print("\n".join(log), "\n", final.stderr[-3000:])
        return 1
    problems = compare(ref, killed)
    print("\n".join(log))
    print("IDENTICAL (metrics, pairs, summary, adapter)" if not problems else "DIFFERENT:\n  " + "\n  ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
