"""Atomic saving, checkpoints that survive a crash, and exact resume.

save_atomically / write_json / write_jsonl: a crash or a full disk never leaves half a model, adapter or
summary behind; every trainer, the embedded-model builder and the jobs write through them.

A checkpoint is a directory `<out_dir>/checkpoints/step-000040/` holding
    tensors.safetensors   every tensor of the state (trainable weights, optimizer moments, torch RNG states)
    state.json            everything else, with {"__tensor__": key} where a tensor sat
    manifest.json         the step, and the size and sha256 of each file above; written last
It is written into a temporary sibling, each file fsynced, then renamed into place, so a crash leaves either
the whole checkpoint or none. A checkpoint whose manifest is missing or whose files do not match it (a
partial copy, a disk error, a hand-truncated file) is skipped, with a message, and the previous one used.
No pickle: the nested state is split into JSON and safetensors here (`pack` / `unpack`), since JSON alone
loses tuples and integer keys (optimizer states have both) and torch.save would need trusted files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from agentrl.distributed import broadcast_from_main, is_main_process, wait_for_everyone
from agentrl.errors import SignalExit, UserError


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


def finite_or_none(obj: Any) -> Any:
    """`obj` with every NaN/Infinity float (at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def strict_json(obj: Any, **kwargs) -> str:
    """json.dumps that writes null for a non-finite float: JSON has no NaN or Infinity, and strict parsers
    (JSON.parse, jq, Go, Rust) reject the `NaN` Python writes by default. allow_nan=False catches any left."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def write_json(path: str | Path, data: dict) -> None:
    write_text_atomically(path, strict_json(data, indent=2) + "\n")


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    write_text_atomically(path, "".join(strict_json(r) + "\n" for r in rows))


FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, corrupted, or does not fit the run resuming from it."""


class NonFiniteError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient."""


# --- nested state <-> (JSON, tensors) ------------------------------------------------------------------

def pack(obj: Any, tensors: dict[str, torch.Tensor], path: str = "s") -> Any:
    """A JSON-able skeleton of `obj`; its tensors go into `tensors` under their path."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: pack(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {"__items__": [[pack(k, tensors, f"{path}.k{i}"), pack(v, tensors, f"{path}.{i}")]
                              for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {"__tuple__": [pack(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} (at {path})")


def unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [unpack(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return np.array(obj["__ndarray__"], dtype=obj["dtype"])
    if "__tuple__" in obj:
        return tuple(unpack(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {unpack(k, tensors): unpack(v, tensors) for k, v in obj["__items__"]}
    return {k: unpack(v, tensors) for k, v in obj.items()}


# --- RNGs ------------------------------------------------------------------------------------------------

def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict:
    """python, numpy, torch (CPU and every CUDA device) and any named torch.Generator."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
             "generators": {k: g.get_state() for k, g in (generators or {}).items()}}
    return state


def set_rng_state(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for k, g in (generators or {}).items():
        g.set_state(state["generators"][k])


# --- model weights ---------------------------------------------------------------------------------------

def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters training changes (LoRA + value head under LoRA; every weight in full fine-tuning)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(tensors):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise CheckpointError(f"the checkpoint does not fit this model: missing {missing[:3]}, unexpected "
                              f"{extra[:3]} (a different model, LoRA setting or target_modules?)")
    for n, p in params.items():
        p.copy_(tensors[n].to(p.device, p.dtype))


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Refuse to write a checkpoint with NaN/inf in floating tensors (weights, optimizer moments)."""
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise NonFiniteError(f"refusing to write {what}: non-finite values in {bad[:3]}")


# --- files -----------------------------------------------------------------------------------------------

def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def truncate_to(path: str | Path, size: int) -> None:
    """Cut a log back to `size` bytes: the rows a checkpoint had seen (later rows are written again)."""
    path = Path(path)
    if size == 0:
        path.write_text("")
        return
    have = path.stat().st_size if path.exists() else 0
    if have < size:
        raise CheckpointError(f"{path} has {have} bytes but the checkpoint saw {size}; it was truncated or "
                              f"replaced since, so the resumed run cannot continue it")
    with path.open("r+b") as f:
        f.truncate(size)


def file_size(path: str | Path | None) -> int:
    """The size of a log after fsync (0 when there is none): how far it got, for the checkpoint."""
    if path is None or not Path(path).exists():
        return 0
    fsync_path(path)
    return Path(path).stat().st_size


def write_checkpoint(directory: str | Path, state: dict, step: int) -> Path:
    """Write `state` (nested dicts/lists/tuples of tensors and JSON values) atomically to `directory`."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = pack(state, tensors)
    check_finite({k: v for k, v in tensors.items() if ".optimizer." in k or ".model." in k}, f"checkpoint {directory}")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{directory.name}-", dir=directory.parent))
    try:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / "tensors.safetensors"))
        (tmp / "state.json").write_text(json.dumps(skeleton))
        files = {}
        for name in ("tensors.safetensors", "state.json"):
            fsync_path(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=2))
        fsync_path(tmp / MANIFEST)
        fsync_path(tmp)
        if directory.exists():  # the same step written again (a resumed run): swap the new one in
            old = directory.with_name(f".old-{directory.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
        fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def verify(directory: str | Path) -> str | None:
    """None if the checkpoint is complete and matches its manifest, else what is wrong."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest.json (the write did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest.json ({e})"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, this agentrl reads {FORMAT}"
    for name, meta in manifest.get("files", {}).items():
        path = directory / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its sha256 checksum"
    return None


def read_checkpoint(directory: str | Path) -> dict:
    """The state written by write_checkpoint; CheckpointError if it is incomplete or corrupted."""
    from safetensors.torch import load_file

    directory = Path(directory)
    problem = verify(directory)
    if problem:
        raise CheckpointError(f"checkpoint {directory} is unusable: {problem}")
    tensors = load_file(str(directory / "tensors.safetensors"))
    return unpack(json.loads((directory / "state.json").read_text()), tensors)


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step-N directory under `root`, oldest first (valid or not)."""
    root = Path(root)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))] if root.is_dir() else []
    return sorted(found)


def latest_valid(root: str | Path, log: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint under `root` that verifies; each one skipped is reported through `log`."""
    log = log or _say
    for _, path in reversed(checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        log(f"checkpoint {path} is incomplete or corrupted ({problem}); using the previous one")
    return None


def resolve_resume(resume: str | None, out_dir: str | Path) -> Path | None:
    """`resume` = None (fresh start), "auto" (latest valid checkpoint of out_dir, or fresh) or a path: a
    checkpoint directory, or a directory of them (its latest valid one)."""
    if resume is None or resume == "":
        return None
    if resume == "auto":
        found = latest_valid(Path(out_dir) / "checkpoints")
        _say(f"resuming from {found}" if found else f"no checkpoint in {Path(out_dir) / 'checkpoints'}; starting fresh")
        return found
    path = Path(resume)
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        problem = verify(path)
        if problem:
            raise CheckpointError(f"resume={resume}: {problem}")
        return path
    for root in (path / "checkpoints", path):
        found = latest_valid(root)
        if found:
            _say(f"resuming from {found}")
            return found
    raise CheckpointError(f"resume={resume}: no valid checkpoint there")


def _say(message: str) -> None:
    if is_main_process():
        print(f"agentrl: {message}", file=sys.stderr, flush=True)


# --- the training loops' side ------------------------------------------------------------------------------

class Checkpointer:
    """What the training loops call after each step: checkpoints every `every` steps, after the last step
    and on SIGTERM/SIGINT (then exits cleanly), keeps the newest `keep`, and stops the run when
    `max_nonfinite_steps` steps in a row skipped an update for a non-finite loss or gradient.

    job_state: returns the job's own state (round, pairs, ...) stored beside the trainer's.
    """

    def __init__(self, root: str | Path, every: int = 10, keep: int = 2, max_nonfinite_steps: int = 3,
                 job_state: Callable[[], dict] | None = None):
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.root, self.every, self.keep = Path(root), every, keep
        self.max_nonfinite_steps, self.job_state = max_nonfinite_steps, job_state
        self.nonfinite_streak = 0
        self.step_offset = 0  # added to the trainer's step (iterative DPO: the steps of earlier rounds)
        self.last_saved: Path | None = None
        self.signal: int | None = None
        self.in_loop = False

    def save(self, step: int, trainer_state: dict | None = None) -> Path | None:
        """Write checkpoint `step-N` with the trainer's and the job's state; drop old and stale ones.

        Several processes: every rank calls it (the trainer's state is gathered collectively before), the main
        process writes, and the others wait until it has."""
        if not self.every:
            return None
        if not is_main_process():
            wait_for_everyone()
            self.last_saved = self.root / f"step-{step:06d}"
            return None
        state = {"trainer": trainer_state, "job": self.job_state() if self.job_state else None,
                 "nonfinite_streak": self.nonfinite_streak}
        if trainer_state is None:
            state["rng"] = rng_state()
        for p in [*self.root.glob(".tmp-*"), *self.root.glob(".old-*")]:  # left by a crash during a write
            shutil.rmtree(p, ignore_errors=True)
        path = write_checkpoint(self.root / f"step-{step:06d}", state, step)
        self.last_saved = path
        found = checkpoints(self.root)
        for s, p in found:
            if s > step:  # from a timeline abandoned by resuming an older checkpoint
                shutil.rmtree(p, ignore_errors=True)
        kept = [p for s, p in found if s <= step]
        for p in kept[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)
        wait_for_everyone()
        return path

    def restore(self, state: dict) -> None:
        self.nonfinite_streak = state.get("nonfinite_streak", 0)

    def after_step(self, trainer, step: int, stats: dict, last: bool) -> None:
        """Non-finite streak check, then a checkpoint when due; after a signal, exit once it is written."""
        step += self.step_offset
        if stats.get("train/skipped_nonfinite", 0):
            self.nonfinite_streak += 1
            if self.max_nonfinite_steps and self.nonfinite_streak >= self.max_nonfinite_steps:
                raise NonFiniteError(
                    f"step {step}: a non-finite loss or gradient in {self.nonfinite_streak} steps in a row "
                    f"(max_nonfinite_steps={self.max_nonfinite_steps}); the updates were skipped. Last good "
                    f"checkpoint: {self.last_saved or latest_valid(self.root) or 'none'}")
        else:
            self.nonfinite_streak = 0
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            # A signal that reached one rank stops every rank after this step (the others would wait forever).
            asked = accelerator.reduce(torch.tensor(float(self.signal is not None), device=accelerator.device), "sum")
            if asked.item() and self.signal is None:
                self.signal = signal.SIGTERM
        if self.every and (step % self.every == 0 or last or self.signal is not None):
            self.save(step, trainer.state_dict())
        if self.signal is not None:
            name = signal.Signals(self.signal).name
            _say(f"{name}: checkpoint {self.last_saved} written at step {step}; exiting (resume=auto continues)")
            raise SystemExit(0)

    @contextmanager
    def signals(self):
        """SIGTERM/SIGINT inside `loop()` ask for a checkpoint at the end of the current step; elsewhere
        (set-up, evaluation) they exit at once, since everything done so far is already saved."""
        def handler(signum, frame):
            if self.in_loop and self.every:
                self.signal = signum
            else:
                raise SignalExit(128 + signum)

        try:
            previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread: signals stay as they are
            previous = {}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            unlock_run(self.root.parent)  # the job is over: out_dir is free for the next one

    @contextmanager
    def loop(self):
        self.in_loop = True
        try:
            yield
        finally:
            self.in_loop = False


# --- jobs: what a run resumes from --------------------------------------------------------------------------

RUN_CONTROL_KEYS = ("resume", "progress", "checkpoint_every", "keep_checkpoints", "max_nonfinite_steps", "out_dir")
EXTENDABLE_KEYS = ("steps", "iterative.rounds")  # may grow when resuming, to train further


NAME_KEYS = ("exp_name",)  # names for trackers only; PPOConfig's defaults to the script's name, as in TRL


def run_config(config: dict) -> dict:
    """The job config without the keys that only steer or name the run (they may change between resumes)."""
    return {k: {n: x for n, x in v.items() if n not in NAME_KEYS} if isinstance(v, dict) else v
            for k, v in config.items() if k not in RUN_CONTROL_KEYS}


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
                _say(f"fresh start: removing the old checkpoints in {root} (resume=auto continues a run instead)")
            shutil.rmtree(root)
        wait_for_everyone()
        return None
    state = read_checkpoint(path)
    saved = _flatten(((state.get("job") or {}).get("config")) or {})
    now = _flatten(config)
    differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k) and k not in EXTENDABLE_KEYS)
    if differ:
        raise CheckpointError(f"resume from {path}: the config differs from the checkpoint's in "
                              + ", ".join(f"{k} ({saved.get(k)!r} -> {now.get(k)!r})" for k in differ[:5])
                              + "; resume with the same config, or start fresh in another out_dir")
    return state


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
