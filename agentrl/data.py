"""Reading task files: JSONL with errors that name the file, the row and the problem."""

from __future__ import annotations

import json
from pathlib import Path


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
