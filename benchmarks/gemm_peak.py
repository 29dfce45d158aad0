"""One-thread GEMM throughput in fp32 and bf16 (the machine's peak for FLOP/s figures), by process CPU time.

    OMP_NUM_THREADS=1 python benchmarks/gemm_peak.py
"""

import json
import time

import torch


def gflops(dtype: torch.dtype, n: int = 1024, reps: int = 20) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for _ in range(reps):
            a @ b
        best = min(best, time.process_time() - started)
    return 2 * n**3 * reps / best / 1e9


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps({"threads": torch.get_num_threads(), "fp32_gflops": round(gflops(torch.float32), 1),
                      "bf16_gflops": round(gflops(torch.bfloat16), 1)}))
