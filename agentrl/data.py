"""Reading task files: JSONL with errors that name the file, the row and the problem."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def split_of(key: str, eval_fraction: float = 0.2) -> str:
    """Deterministic train/eval split by a task's text, so training and held-out tasks never overlap."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if bucket < eval_fraction else "train"


def read_task_split(path: str | Path, split: str) -> list[dict]:
    """Rows of a task JSONL for `split`: by their own "split" field when they have one, else by `split_of`."""
    rows = read_jsonl(path)
    return [r for r in rows if r.get("split", split_of(json.dumps(r, sort_keys=True))) == split]


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
