"""Achieved FLOP/s of the 26 M PPO step against this machine's measured GEMM peak, one thread.

    python benchmarks/peers/flops.py --from runs/peers.json [--models-dir runs/peers-models] [--peers-dir .venv-peers]

1. The peak: torch.matmul of square fp32 and bf16 matrices (sizes 256..2048, best of a few runs each), one thread.
2. The work: one PPO step of each side (agentrl; TRL 0.11.4) counted by torch's FlopCounterMode (matmuls and
   attention: what the hardware must do, not what the Python around it costs), in the same worker scripts as run.py.
3. Achieved = counted FLOPs / the median CPU s/step of the side-by-side run (--from, run.py's JSON: with one
   thread, CPU time is what the step would take alone on the core; the wall clock of a shared machine is not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402
import run  # noqa: E402


def gemm_peak(dtype, sizes=(256, 512, 1024, 2048), repeats: int = 30) -> dict:
    """Best GFLOP/s of an n x n @ n x n matmul over sizes and repeats (2 n^3 FLOPs each). Short timings (about
    0.1 GFLOP) and the best of many: on a shared machine most timings are cut by other processes."""
    import torch

    best = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.matmul(a, b)  # warm-up
        inner = max(1, int(1e8 / (2 * n ** 3)))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(inner):
                torch.matmul(a, b)
            times.append((time.perf_counter() - t) / inner)
        best[n] = 2 * n ** 3 / min(times) / 1e9
    return {"gflops": max(best.values()), "by_size": {k: round(v, 2) for k, v in best.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models-dir", default="runs/peers-models")
    parser.add_argument("--peers-dir", default=".venv-peers")
    parser.add_argument("--model", default="26m")
    parser.add_argument("--from", dest="source", default=None, help="run.py's JSON: the median CPU s/step")
    parser.add_argument("--counted", default=None, help="an earlier --json of this script: reuse its FLOP counts")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common.one_thread()
    import torch

    models_dir = Path(args.models_dir).resolve()
    run.prepare(models_dir, [args.model])
    peaks = {"float32": gemm_peak(torch.float32), "bfloat16": gemm_peak(torch.bfloat16)}
    print(f"GEMM peak, one thread: fp32 {peaks['float32']['gflops']:.1f} GFLOP/s {peaks['float32']['by_size']}, "
          f"bf16 {peaks['bfloat16']['gflops']:.1f} GFLOP/s {peaks['bfloat16']['by_size']}", flush=True)
    timed = {}
    for row in json.loads(Path(args.source).read_text())["rows"] if args.source else []:
        if row["task"] == "ppo" and row["model"] == run.MODELS[args.model]:
            timed = {"agentrl": row["agentrl"]["cpu_s_per_step"], "peer": row["peer"]["cpu_s_per_step"]}
    out = {"peaks": peaks, "sides": {}, "load_average": os.getloadavg()}
    for side, python in (("agentrl", sys.executable), ("peer", str(Path(args.peers_dir).resolve() / "trl011/bin/python"))):
        if args.counted:
            r = json.loads(Path(args.counted).read_text())["sides"][side]
        else:  # one step, counted: no warm-up and no timed step (the time comes from the side-by-side run)
            r = run.worker(side, "ppo", models_dir / args.model, run.workload_path(models_dir, args.model), 0, 0,
                           python, extra=["--count-flops"])
        out["sides"][side] = {"library": r["library"], "flops_per_step": r["flops_per_step"]}
        print(f"{r['library']}: {r['flops_per_step'] / 1e9:.1f} GFLOP a PPO step", flush=True)
        if side not in timed:
            continue
        seconds = timed[side]
        achieved = r["flops_per_step"] / seconds / 1e9
        out["sides"][side].update(cpu_s_per_step=seconds, gflops=achieved, of_fp32_peak=achieved / peaks["float32"]["gflops"],
                                  of_bf16_peak=achieved / peaks["bfloat16"]["gflops"])
        print(f"  at {seconds:.2f} CPU s/step -> "
              f"{achieved:.2f} GFLOP/s = {100 * achieved / peaks['float32']['gflops']:.0f}% of the fp32 peak, "
              f"{100 * achieved / peaks['bfloat16']['gflops']:.0f}% of the bf16 peak", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
