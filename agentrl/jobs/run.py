"""Running a job in an out_dir: one job per out_dir at a time (a lock), the decision to start fresh or resume
(and from which checkpoint), and evaluations stored beside the checkpoints so that a resumed run does not redo
them. agentrl.checkpoint writes and reads the checkpoints themselves."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from agentrl.checkpoint import (MANIFEST, Checkpointer, CheckpointError, checkpoints, fsync_path, read_checkpoint, resolve_resume,
                                say, verify)
from agentrl.distributed import broadcast_from_main, is_main_process, wait_for_everyone
from agentrl.errors import UserError

RUN_CONTROL_KEYS = ("resume", "progress", "checkpoint_every", "keep_checkpoints", "max_nonfinite_steps", "out_dir")
EXTENDABLE_KEYS = ("steps", "iterative.rounds")  # may grow when resuming, to train further


def run_config(config: dict) -> dict:
    """The job config without the keys that only steer the run (they may change between resumes)."""
    return {k: v for k, v in config.items() if k not in RUN_CONTROL_KEYS}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


LOCK_FILE = ".agentrl.lock"
_RUN_LOCKS: dict[Path, int] = {}  # out_dir (resolved) -> descriptor of the lock file this process holds


def lock_run(out_dir: str | Path) -> None:
    """Hold out_dir/.agentrl.lock with flock until the job ends (Checkpointer.signals() releases it) or the
    process does (the kernel releases it, even after kill -9). A second job on the same out_dir would delete
    the first one's checkpoints and interleave its metrics rows; it stops here instead, naming the holder.
    Several processes: the main one holds it for the job and tells the others if it could not."""
    problem = _lock(Path(out_dir)) if is_main_process() else None
    problem = broadcast_from_main(problem)  # every rank stops, none waits at a barrier for a main that left
    if problem:
        raise UserError(problem)


def _lock(out_dir: Path) -> str | None:
    """Take the lock in this process; what prevents it, or None."""
    out = out_dir.resolve()
    if out in _RUN_LOCKS:  # this process runs another job there (the first has ended: jobs run one at a time)
        return None
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except (FileExistsError, NotADirectoryError):
        return f"out_dir={out_dir}: is a file (or under one), not a directory"
    except OSError as e:
        return f"out_dir={out_dir}: cannot write there ({e.strerror})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 300).decode(errors="replace").strip() or "a process that has not written its pid yet"
        os.close(fd)
        return (f"out_dir={out_dir}: another agentrl job is running there ({holder}); wait for it to end, or give "
                f"this one another out_dir")
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _RUN_LOCKS[out] = fd
    return None


def unlock_run(out_dir: str | Path) -> None:
    """Release lock_run's lock (closing the descriptor releases the flock); nothing if this process holds none.
    The file stays: removing it could race with a process that has just opened it."""
    fd = _RUN_LOCKS.pop(Path(out_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def open_run(out_dir: str | Path, resume: str | None, config: dict) -> dict | None:
    """Lock out_dir for this job (lock_run), then the state to resume from (None: a fresh start; without
    `resume` it clears old checkpoints and stored evaluations).
    A checkpoint written under a different config is an error naming the keys that differ; one older than a
    valid checkpoint of out_dir is an error too, since resuming from it would discard the newer results."""
    lock_run(out_dir)
    try:
        return _state_to_resume(Path(out_dir), resume, config)
    except BaseException:
        unlock_run(out_dir)  # no job runs: the next one (in this process or another) may
        raise


def job_checkpointer(out_dir: str | Path, config, job_state: Callable[[], dict]) -> Checkpointer:
    """The job's Checkpointer in out_dir/checkpoints, from its config's checkpoint_every, keep_checkpoints and
    max_nonfinite_steps; when its signals() block ends, however it ends, out_dir's lock (open_run) is freed."""
    return Checkpointer(Path(out_dir) / "checkpoints", config.checkpoint_every, config.keep_checkpoints,
                        config.max_nonfinite_steps, job_state=job_state, on_close=lambda: unlock_run(out_dir))


def _state_to_resume(out_dir: Path, resume: str | None, config: dict) -> dict | None:
    root = out_dir / "checkpoints"
    path = resolve_resume(resume, out_dir)
    if path is not None:
        step = json.loads((path / MANIFEST).read_text())["step"]
        newer = [p for s, p in checkpoints(root) if s > step and p.resolve() != path.resolve() and verify(p) is None]
        if newer:
            raise UserError(
                f"resume={resume}: {root} holds newer checkpoints ({', '.join(p.name for p in newer)}); resuming "
                f"from step {step} would delete them and cut metrics.jsonl and samples.jsonl back to step {step}. "
                f"Continue from the newest (resume=auto), or delete the newer checkpoints first if discarding them "
                f"is what you want")
    if path is None:
        if root.exists() and not resume and is_main_process():  # resume=auto without one keeps stored evaluations
            if checkpoints(root):
                say(f"fresh start: removing the old checkpoints in {root} (resume=auto continues a run instead)")
            _clear_checkpoints(root)
        wait_for_everyone()
        return None
    now = _flatten(config)
    if isinstance(now.get("steps"), int) and now["steps"] < step:  # before anything is evaluated or rewritten
        raise UserError(f"resume={resume or 'auto'}: steps={now['steps']}, but {path.name} is at step {step}; "
                        f"give steps > {step} to train further, or start fresh in another out_dir")
    state = read_checkpoint(path)
    saved = _flatten(((state.get("job") or {}).get("config")) or {})
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in EXTENDABLE_KEYS)
    if differ:
        raise CheckpointError(f"resume from {path}: the config differs from the checkpoint's in "
                              + ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in differ[:5])
                              + "; resume with the same config, or start fresh in another out_dir")
    return state


def _clear_checkpoints(root: Path) -> None:
    """Delete what jobs write under `root` (step-N checkpoints, stored evaluations, a crashed write's leftovers);
    anything else a user put there stays."""
    ours = re.compile(r"^(step-\d+|eval-.+\.(json|tmp)|\.(tmp|old)-step-\d+.*)$")
    for path in root.iterdir():
        if not ours.match(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def cached_eval(out_dir: str | Path, name: str, config: dict, compute: Callable[[], dict]) -> dict:
    """An evaluation stored in out_dir/checkpoints/eval-<name>.json for this config, or computed and stored,
    so a resumed run does not redo it.

    Several processes: the main process decides whether the stored one holds (and tells the others, so all
    recompute or none does); `compute` runs on every process (each evaluates its share of the tasks, see
    jobs/evaluate.py); the main process stores the result, and every process returns the main one's.
    """
    path = Path(out_dir) / "checkpoints" / f"eval-{name}.json"
    stored = broadcast_from_main(_stored_eval(path, config) if is_main_process() else None)
    if stored is not None:
        return stored
    result = compute()
    if is_main_process():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": config, "result": result}))
        fsync_path(tmp)
        os.replace(tmp, path)
    return broadcast_from_main(result)


def _stored_eval(path: Path, config: dict) -> dict | None:
    """The result stored at `path` for this config; None if there is none (or a torn write)."""
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        if stored.get("config") == json.loads(json.dumps(config)):
            return stored["result"]
    except ValueError:
        pass  # a torn write: compute it again
    return None
