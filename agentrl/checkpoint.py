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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from agentrl.distributed import is_main_process, wait_for_everyone
from agentrl.errors import SignalExit


# A directory holding one of these is a model, adapter or checkpoint that agentrl (or save_pretrained) wrote,
# which a new save may replace; anything else at the path is the user's and is never deleted.
REPLACEABLE_MARKS = ("config.json", "adapter_config.json", "agentrl_base.json", "manifest.json")


def check_replaceable(out_dir: str | Path, what: str | None = None) -> None:
    """Raise UserError unless `out_dir` is free for save_atomically: absent, an empty directory, or a directory
    with one of REPLACEABLE_MARKS. Jobs call it before training, so a wrong path costs no training time."""
    from agentrl.errors import UserError

    out_dir = Path(out_dir)
    if not os.path.lexists(out_dir):
        return
    if out_dir.is_dir() and not out_dir.is_symlink():
        if not any(out_dir.iterdir()) or any((out_dir / mark).is_file() for mark in REPLACEABLE_MARKS):
            return
        found = "a directory with none of " + ", ".join(REPLACEABLE_MARKS)
    else:
        found = "a symlink" if out_dir.is_symlink() else "a file"
    raise UserError(f"{what or out_dir}: {out_dir} exists and is {found}, not a model agentrl wrote; agentrl "
                    f"replaces only its own saves there. Give another path, or move it away first")


def save_atomically(out_dir: str | Path, write: Callable[[str], object]) -> None:
    """Call `write(tmp)` on a temporary sibling directory, then swap it into place as `out_dir`. An existing
    `out_dir` is replaced only if check_replaceable allows it (a file or a user's directory is never lost)."""
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(str(tmp))
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            if old.is_dir() and not old.is_symlink():  # left by a save that crashed between the two renames
                shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """Write a file next to `path`, then rename it over `path` (a rename is atomic on one filesystem). A path
    that cannot be written (a directory, a read-only place, a full disk) is a UserError naming it, with nothing
    left behind."""
    from agentrl.errors import UserError

    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give a file path")
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # it may not exist, or be unwritable like its directory
        why = (f"a part of {path.parent} is a file, not a directory"
               if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e)
        raise UserError(f"{path}: cannot write it ({why})") from None


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
    """Training cannot go on: too many steps in a row had a non-finite loss or gradient, or the model's outputs
    are no longer finite."""


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
    log = log or say
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
        say(f"resuming from {found}" if found else f"no checkpoint in {Path(out_dir) / 'checkpoints'}; starting fresh")
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
            say(f"resuming from {found}")
            return found
    raise CheckpointError(f"resume={resume}: no valid checkpoint there")


def say(message: str) -> None:
    if is_main_process():
        print(f"agentrl: {message}", file=sys.stderr, flush=True)


# --- the training loops' side ------------------------------------------------------------------------------

EXIT_GRACE_SECONDS = 10.0


def _exit_unless_stopped(seconds: float, status: int):
    """After a second stop signal: unless the returned event is set within `seconds` (Checkpointer.signals()
    sets it when the SignalExit leaves its block), end the process with `status`. The SignalExit raised in the
    main thread can be swallowed by user code there (an `except BaseException` around a hang), and nothing else
    could then stop the run short of SIGKILL. posix._exit, not os._exit: the CLI turns os._exit into SystemExit
    while a job runs (cli._os_exit_raises)."""
    import posix
    import threading

    stopped = threading.Event()

    def stop_later():
        if stopped.wait(seconds):
            return
        os.write(2, f"agentrl: still running {seconds:g} s after the second signal (user code caught it?): "
                    f"exiting now; status {status}\n".encode())
        posix._exit(status)

    threading.Thread(target=stop_later, name="agentrl-exit", daemon=True).start()
    return stopped


class Checkpointer:
    """What the training loops call after each step: checkpoints every `every` steps, after the last step
    and on SIGTERM/SIGINT (then exits cleanly), keeps the newest `keep`, and stops the run when
    `max_nonfinite_steps` steps in a row skipped an update for a non-finite loss or gradient.

    job_state: returns the job's own state (round, pairs, ...) stored beside the trainer's.
    on_close: called when `signals()` ends, however it ends (the jobs release their out_dir's lock there).
    """

    def __init__(self, root: str | Path, every: int = 10, keep: int = 2, max_nonfinite_steps: int = 3,
                 job_state: Callable[[], dict] | None = None, on_close: Callable[[], None] | None = None):
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep}")
        self.root, self.every, self.keep = Path(root), every, keep
        self.max_nonfinite_steps, self.job_state, self.on_close = max_nonfinite_steps, job_state, on_close
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
            say(f"{name}: checkpoint {self.last_saved} written at step {step}; exiting with status "
                f"{128 + self.signal} (resume=auto continues)")
            # Not 0: the job did not finish (no summary.json), and `agentrl ppo ... && next-step` must stop.
            raise SignalExit(128 + self.signal)

    @contextmanager
    def signals(self):
        """SIGTERM/SIGINT inside `loop()` ask for a checkpoint at the end of the current step; elsewhere
        (set-up, evaluation) they exit at once, since everything done so far is already saved."""
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.in_loop and self.every and self.signal is None:
                self.signal = signum
                return
            if self.signal is not None:  # a second signal: the step has not ended (a hang with no deadline?)
                what = (f"a second {name} before the step ended (a step with no deadline that hangs?): exiting "
                        f"without a checkpoint of this step (resume=auto continues from the newest one)")
            else:
                what = f"{name} outside a training step: exiting (what finished is saved)"
            if is_main_process():  # os.write, not print: the handler may interrupt a print to stderr
                os.write(2, f"agentrl: {what}; status {128 + signum}\n".encode())
            if self.signal is not None:
                watchdogs.append(_exit_unless_stopped(EXIT_GRACE_SECONDS, 128 + signum))
            raise SignalExit(128 + signum)

        watchdogs = []
        try:
            previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread: signals stay as they are
            previous = {}
        try:
            yield self
        finally:
            for stopped in watchdogs:  # the SignalExit got out of the job's code: the caller exits (or decides)
                stopped.set()
            for s, h in previous.items():
                signal.signal(s, h)
            if self.on_close is not None:
                self.on_close()

    @contextmanager
    def loop(self):
        self.in_loop = True
        try:
            yield
        finally:
            self.in_loop = False
