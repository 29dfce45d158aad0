"""Atomic saving: a crash or a full disk never leaves half a model, adapter or summary behind.

Every trainer, the embedded-model builder and the jobs write through these helpers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def save_atomically(out_dir: str | Path, write: Callable[[str], object]) -> None:
    """Call `write(tmp)` on a temporary sibling directory, then swap it into place as `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(str(tmp))
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write a file next to `path`, then rename it over `path` (a rename is atomic on one filesystem)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path: str | Path, data: dict) -> None:
    write_text_atomically(path, json.dumps(data, indent=2) + "\n")


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in rows))
