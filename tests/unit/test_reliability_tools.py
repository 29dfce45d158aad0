"""A tool cannot take the run down: exits and interrupts become observations, hung calls are abandoned without
starving later calls, and the process still exits (and obeys SIGTERM) while a tool hangs."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentrl.envs.threads import CallThreads
from agentrl.envs.tools import ToolCall, ToolEnv, ToolRunner

RELEASE = threading.Event()  # set at the end of the module, so the hung tools' threads end


def exits(code: int) -> str:
    """Exit the interpreter.

    Args:
        code: the exit status
    """
    sys.exit(code)


def interrupts(x: str) -> str:
    """Raise KeyboardInterrupt.

    Args:
        x: anything
    """
    raise KeyboardInterrupt


def hangs(x: str) -> str:
    """Block until the test module ends.

    Args:
        x: anything
    """
    RELEASE.wait()
    return "released"


def echo(x: str) -> str:
    """Echo.

    Args:
        x: what to echo
    """
    return x


def unserialisable(x: str) -> dict:
    """Return something JSON cannot hold.

    Args:
        x: anything
    """
    cycle = {}
    cycle["self"] = cycle
    return cycle


@pytest.fixture(scope="module", autouse=True)
def release_hung_tools():
    yield
    RELEASE.set()


@pytest.mark.parametrize("call, raised", [(ToolCall("exits", {"code": 0}), "SystemExit"),
                                          (ToolCall("exits", {"code": 3}), "SystemExit"),
                                          (ToolCall("interrupts", {"x": ""}), "KeyboardInterrupt")])
def test_exit_and_interrupt_in_a_tool_are_failed_calls(call, raised):
    text, ok = ToolRunner([exits, interrupts])(call)
    assert not ok and text.startswith(f"Error: {call.name} raised {raised}")


def test_hung_calls_do_not_starve_later_calls():
    runner = ToolRunner([hangs, echo], timeout=0.05)
    for _ in range(40):  # more than the 32 workers the shared pool used to have
        assert runner(ToolCall("hangs", {"x": ""})) == ("Error: hangs timed out after 0.05 s", False)
    started = time.monotonic()
    assert runner(ToolCall("echo", {"x": "still here"})) == ("still here", True)
    assert time.monotonic() - started < 0.05


def test_a_result_json_cannot_hold_is_a_failed_call():
    text, ok = ToolRunner([unserialisable])(ToolCall("unserialisable", {"x": ""}))
    assert not ok and text.startswith("Error: unserialisable returned a dict that is not JSON")


@pytest.mark.parametrize("kwargs, message", [({"timeout": 0}, "timeout must be"), ({"timeout": float("nan")}, "timeout"),
                                             ({"timeout": "5"}, "timeout"), ({"max_observation_chars": 0}, "max_obs"),
                                             ({"isolation": "fork"}, "isolation must be")])
def test_bad_runner_settings_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToolEnv([echo], check=lambda task, answer: True, **kwargs)


CHILD = textwrap.dedent("""
    import signal, sys, threading
    from agentrl.envs.tools import ToolCall, ToolRunner

    def hangs(x: str) -> str:
        \"\"\"Never returns.

        Args:
            x: anything
        \"\"\"
        threading.Event().wait()

    runner = ToolRunner([hangs], timeout=0.1)
    if sys.argv[1] == "term":  # what Checkpointer.signals does outside the training loop
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        print("ready", flush=True)
        while True:
            runner(ToolCall("hangs", {"x": ""}))
    print(runner(ToolCall("hangs", {"x": ""})), flush=True)
""")


def test_the_process_exits_while_a_tool_hangs():
    done = subprocess.run([sys.executable, "-c", CHILD, "end"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "timed out" in done.stdout


def test_sigterm_ends_the_process_while_tools_hang():
    child = subprocess.Popen([sys.executable, "-c", CHILD, "term"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # a few hung calls abandoned
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=20) == 128 + signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def hard_exit(code: int) -> str:
    """Leave the interpreter without cleanup.

    Args:
        code: the exit status
    """
    import os

    os._exit(code)


def counts(x: str) -> dict:
    """Return a structure.

    Args:
        x: anything
    """
    return {"x": x, "n": [1, 2]}


def test_process_isolation_survives_os_exit_hangs_and_exceptions():
    runner = ToolRunner([hard_exit, hangs, exits, counts, echo], timeout=0.5, isolation="process")
    assert runner(ToolCall("hard_exit", {"code": 7})) == ("Error: hard_exit ended its process (exit status 7) "
                                                          "without returning", False)
    started = time.monotonic()
    assert runner(ToolCall("hangs", {"x": ""})) == ("Error: hangs timed out after 0.5 s", False)
    assert time.monotonic() - started < 5  # killed at the deadline
    assert runner(ToolCall("exits", {"code": 0})) == ("Error: exits raised SystemExit: 0", False)
    assert runner(ToolCall("counts", {"x": "a"})) == ('{"x": "a", "n": [1, 2]}', True)
    assert runner(ToolCall("echo", {"x": "é" * 600}))[0].endswith(" ...[truncated]")
    # the same observations as in this process, for tools that behave
    assert ToolRunner([counts]).__call__(ToolCall("counts", {"x": "a"})) == runner(ToolCall("counts", {"x": "a"}))
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process'"):
        ToolRunner([echo], isolation="subprocess")


def test_many_hung_calls_warn_and_name_the_remedy(monkeypatch):

    threads = CallThreads()
    monkeypatch.setattr(threads, "WARN_AT", 3)
    with pytest.warns(UserWarning, match=r"3 tool threads started: .*isolation='process'"):
        for _ in range(3):
            assert threads.run(hangs, {"x": ""}, 0.01) == ("timeout", None)


def starts_sleeper(marker: str, hang: bool) -> str:
    """Start a background process, then hang or return.

    Args:
        marker: a word the process's command line carries
        hang: whether to hang after starting it
    """
    import subprocess
    import sys
    import time

    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(307)", marker])
    while hang:
        time.sleep(1)
    return "started"


def test_processes_a_forked_call_started_end_with_the_call(tmp_path):
    import subprocess

    runner = ToolRunner([starts_sleeper], timeout=1.0, isolation="process")
    for hang in (True, False):
        marker = f"agentrl-test-{os.getpid()}-{hang}"
        assert runner(ToolCall("starts_sleeper", {"marker": marker, "hang": hang}))[1] is (not hang)
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        assert left == [], f"the call's sleeper outlived it (hang={hang}): pids {left}"
