"""One job per out_dir at a time (a lock naming the holder), and resuming from an older checkpoint never deletes
the newer results unless the user removed them first."""

import fcntl
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from agentrl.checkpoint import Checkpointer
from agentrl.cli import main
from agentrl.errors import UserError
from agentrl.jobs.run import LOCK_FILE, job_checkpointer, lock_run, open_run, unlock_run

HOLD = """
import sys, time
from agentrl.jobs.run import lock_run
lock_run(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def lock_is_free(out) -> bool:
    """Whether another open file description can take the flock (also true only if this process holds none)."""
    fd = os.open(out / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def holder(tmp_path):
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    yield out, child
    child.kill()
    child.wait()


def test_a_second_job_on_a_busy_out_dir_stops_naming_the_holder(holder, capsys):
    out, child = holder
    with pytest.raises(UserError, match=rf"out_dir={out}: another agentrl job is running there \(pid {child.pid}, "):
        lock_run(out)
    assert main(["ppo", "--config", "quickstart", f"out_dir={out}", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"agentrl: error: out_dir={out}: another agentrl job is running there (pid {child.pid}")
    child.kill()
    child.wait()  # the kernel drops a dead process's lock, kill -9 included
    lock_run(out)
    lock_run(out)  # the same process again (a second job after the first): no deadlock with itself
    assert not lock_is_free(out)
    unlock_run(out)
    assert lock_is_free(out)


def test_the_job_frees_its_out_dir_when_it_ends(tmp_path):
    out = tmp_path / "run"
    assert open_run(out, None, {}) is None
    assert not lock_is_free(out)
    settings = SimpleNamespace(checkpoint_every=1, keep_checkpoints=1, max_nonfinite_steps=0)
    with pytest.raises(RuntimeError), job_checkpointer(out, settings, dict).signals():  # the job fails: freed too
        raise RuntimeError("the job failed")
    assert lock_is_free(out)


def test_an_out_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="out_dir=.*file: is a file"):
        lock_run(tmp_path / "file")


def test_resuming_an_older_checkpoint_keeps_the_newer_ones_unless_they_are_removed(tmp_path):
    out = tmp_path / "run"
    checkpointer = Checkpointer(out / "checkpoints", every=1, keep=5)
    for step in (1, 2, 3):
        checkpointer.save(step)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    older = out / "checkpoints" / "step-000002"
    with pytest.raises(UserError, match=r"resume=.*step-000002: .* holds newer checkpoints \(step-000003\); resuming "
                                        r"from step 2 would delete them"):
        open_run(out, str(older), {})
    assert (out / "checkpoints" / "step-000003").is_dir() and lock_is_free(out)  # nothing touched, lock released
    assert open_run(out, "auto", {}) is not None  # the newest: fine
    unlock_run(out)
    # a corrupted newer checkpoint is not a result worth keeping: resume=auto already skips it
    (out / "checkpoints" / "step-000003" / "manifest.json").unlink()
    assert open_run(out, str(older), {}) is not None
    unlock_run(out)
