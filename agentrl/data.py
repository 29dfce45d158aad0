"""Reading task files: JSONL with errors that name the file, the row and the problem."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from agentrl.errors import UserError


def split_of(key: str, eval_fraction: float = 0.2) -> str:
    """Deterministic train/eval split by a task's text, so training and held-out tasks never overlap."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "eval" if bucket < eval_fraction else "train"


def read_task_split(path: str | Path, split: str) -> list[dict]:
    """Rows of a task JSONL for `split`: by their own "split" field when they have one, else by `split_of`."""
    rows = read_jsonl(path)
    return [r for r in rows if r.get("split", split_of(json.dumps(r, sort_keys=True))) == split]


def jsonl_rows(path: str | Path) -> list[tuple[str, object]]:
    """(where, value) for each non-blank line, `where` being "file:line"; a line that is not JSON gets a
    UserError as its value, so a caller can skip and count it or raise it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file does not exist")
    rows = []
    # Lines split on bytes (\n, \r\n) and decoded one by one: a line that is not UTF-8 is named like a line that
    # is not JSON, and a U+2028 inside a JSON string does not split its line.
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff" if lineno == 1 else "")
        except UnicodeDecodeError as e:
            rows.append((f"{path}:{lineno}", UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the "
                                                       f"line is {raw[e.start:e.start + 1]!r})")))
            continue
        if line.strip():
            rows.append((f"{path}:{lineno}", parse_json_line(line, f"{path}:{lineno}")))
    return rows


def parse_json_line(line: str, where: str) -> object:
    """The JSON value of one line, or a UserError naming `where` when it is not JSON, or is JSON that Python
    cannot hold (nested past the recursion limit, an integer over 4,300 digits) or no tokenizer can take (a
    string with a lone surrogate, which UTF-8 cannot encode)."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        return UserError(f"{where}: not valid JSON ({e.msg})")
    except RecursionError:
        return UserError(f"{where}: JSON nested too deep to read")
    except ValueError as e:  # int_max_str_digits
        return UserError(f"{where}: a number Python will not read ({str(e).split(';')[0]})")
    if "\\ud" in line.lower():  # a cheap test first: lone surrogates come only from \u escapes
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            return UserError(f"{where}: a string holds a lone surrogate ({e.object[e.start:e.end]!r}), which is "
                             f"not text")
        except RecursionError:
            return UserError(f"{where}: JSON nested too deep to read")
    return value


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL file of objects; the first bad line is an error naming file and line."""
    rows = []
    for where, row in jsonl_rows(path):
        if isinstance(row, UserError):
            raise row
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
