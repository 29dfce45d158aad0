"""Do two seeded runs agree? Compares every metrics*.jsonl row and the flattened summary.json of two run
directories, timing fields and paths aside; prints each difference and exits 1 if there is one.

    python benchmarks/same_run.py runs/before/quickstart runs/after/quickstart [--ignore tools/failure_rate ...]

For a change meant to preserve behaviour: run the same seeded job before and after it, one thread each
(OMP_NUM_THREADS=1), and compare.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Substrings of keys that measure time, memory or where the run was written: they differ between any two runs.
VARYING = ("time/", "seconds", "elapsed", "per_second", "timestamp", "wall", "throughput", "rss", "mem/", "_dir")


def flatten(value, prefix: str = "") -> dict:
    if not isinstance(value, dict):
        return {prefix.rstrip("."): value}
    out = {}
    for key, item in value.items():
        out.update(flatten(item, f"{prefix}{key}."))
    return out


def differences(a: dict, b: dict, where: str, ignore: tuple[str, ...]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [f"{where} {k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys
            if not any(v in k for v in VARYING + ignore) and a.get(k) != b.get(k)]


def compare(run_a: Path, run_b: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    found = []
    names = sorted({p.name for p in run_a.glob("metrics*.jsonl")} | {p.name for p in run_b.glob("metrics*.jsonl")})
    for name in names:
        if not (run_a / name).exists() or not (run_b / name).exists():
            found.append(f"{name}: only in {run_a if (run_a / name).exists() else run_b}")
            continue
        rows_a = [json.loads(line) for line in (run_a / name).read_text().splitlines() if line.strip()]
        rows_b = [json.loads(line) for line in (run_b / name).read_text().splitlines() if line.strip()]
        if len(rows_a) != len(rows_b):
            found.append(f"{name}: {len(rows_a)} rows vs {len(rows_b)}")
        for i, (row_a, row_b) in enumerate(zip(rows_a, rows_b)):
            found += differences(flatten(row_a), flatten(row_b), f"{name} row {i + 1}", ignore)
    summary_a, summary_b = run_a / "summary.json", run_b / "summary.json"
    if summary_a.exists() and summary_b.exists():
        found += differences(flatten(json.loads(summary_a.read_text())), flatten(json.loads(summary_b.read_text())),
                             "summary.json", ignore)
    elif summary_a.exists() or summary_b.exists():
        found.append(f"summary.json: only in {run_a if summary_a.exists() else run_b}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--ignore", nargs="*", default=[], help="key substrings to leave out as well")
    args = parser.parse_args()
    for run in (args.run_a, args.run_b):
        if not run.is_dir():
            parser.error(f"{run}: not a run directory")
    found = compare(args.run_a, args.run_b, tuple(args.ignore))
    for line in found[:50]:
        print(line)
    print(f"{len(found)} differences" + (" (first 50 shown)" if len(found) > 50 else ""))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
