"""What a third hostile sweep found: exceptions and values whose own methods fail (an exception's __str__, a
reward's __float__, a done that is an array, an info value whose __str__ raises), text that is not UTF-8, tasks
that cannot be logged, os._exit in user code, a Ctrl-C while the job loads, and forked tool calls left running
when a run exits on a signal."""

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from agentrl.config import ConfigError, load_config
from agentrl.envs.base import StepResult, checked_reset, checked_step, load_tasks
from agentrl.errors import EnvironmentContractError
from test_reliability_envs import Env


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


class FloatInterrupts:
    def __float__(self):
        raise KeyboardInterrupt


class StrRaises:
    def __str__(self):
        raise RuntimeError("no str")

    __repr__ = __str__


def stepping(result):
    return type("HostileEnv", (Env,), {"step": lambda self, action: result})()


def test_an_exception_whose_message_raises_is_still_one_named_line():
    def raising(self, action):
        raise Unprintable

    with pytest.raises(EnvironmentContractError, match=r"HostileEnv\.step raised Unprintable: <its message raised>"):
        checked_step(type("HostileEnv", (Env,), {"step": raising})(), "Answer: 1")


@pytest.mark.parametrize("result, message", [
    (StepResult(None, 10 ** 400, True, {}), r"its reward is int 1000"),
    (StepResult(None, FloatInterrupts(), True, {}), r"its reward is FloatInterrupts"),
    (StepResult(None, 0.0, np.array([True, False]), {}), r"its done is ndarray"),
    (StepResult(None, 0.0, True, {"tool_calls": 10 ** 400}), r"its info\['tool_calls'\] is int"),
    (StepResult(None, 0.0, True, {"obj": StrRaises()}), r"cannot be written as JSON \(RuntimeError: no str\)"),
    (StepResult("Obs: \udcff\n", 0.0, False, {}), r"its observation is not UTF-8 text \(a lone surrogate"),
])
def test_step_results_whose_values_break_their_own_methods_are_named(result, message):
    with pytest.raises(EnvironmentContractError, match=rf"HostileEnv\.step must return .*{message}"):
        checked_step(stepping(result), "Answer: 1")


def test_a_prompt_with_a_lone_surrogate_is_named_and_nul_is_kept():
    env = type("SurrogateEnv", (Env,), {"reset": lambda self, task: "Q: \ud800\n"})()
    with pytest.raises(EnvironmentContractError, match=r"SurrogateEnv\.reset: the prompt .* lone surrogate"):
        checked_reset(env, {})
    assert checked_reset(type("NulEnv", (Env,), {"reset": lambda self, task: "Q: \x00\n"})(), {}) == "Q: \x00\n"


def question_list(n, seed=0, split="train"):
    return [{"question": [i], "answer": "1"} for i in range(n)]


def tuple_key(n, seed=0, split="train"):
    return [{"question": f"q{i}", "answer": "1", ("q",): "x"} for i in range(n)]


@pytest.mark.parametrize("tasks, message", [(question_list, r"task 0's question is list \[0\] \(a str\)"),
                                            (tuple_key, r"task 0 cannot be written as JSON \(task 0 has the key tuple")])
def test_tasks_that_cannot_be_told_apart_or_logged_are_named(tasks, message):
    with pytest.raises(EnvironmentContractError, match=message):
        load_tasks(f"{__name__}:{tasks.__name__}", 2, 0, "train")


def test_an_unknown_builder_corpus_is_a_config_error():
    from agentrl.jobs.ppo import JobConfig

    with pytest.raises(ConfigError, match=r"model\.builder\.corpus: 'nope' is not one of the built-in corpora"):
        load_config(JobConfig, None, ["model.builder.corpus=nope"])


def test_os_exit_raises_in_a_job_but_a_forked_child_still_exits():
    from agentrl.cli import _os_exit_raises

    real = os._exit
    with _os_exit_raises():
        with pytest.raises(SystemExit, match=r"os\._exit\(0\)"):
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    assert os._exit is real


def test_an_os_exit_in_a_tool_is_a_failed_call_under_the_cli(monkeypatch, capsys):
    import agentrl.cli as cli
    from agentrl.envs.tools import ToolCall, ToolRunner

    def quits(x: str) -> str:
        """Quit.

        Args:
            x: anything
        """
        os._exit(0)

    def job(args):
        text, ok = ToolRunner([quits], timeout=5.0)(ToolCall("quits", {"x": "1"}))
        print(text)
        return 0

    monkeypatch.setattr(cli, "_cmd_report", job)
    assert cli.main(["report", "somewhere"]) == 0
    assert "os._exit(0)" in capsys.readouterr().out


def test_ctrl_c_while_the_job_loads_is_one_line_and_130(monkeypatch, capsys):
    import agentrl.cli as cli

    def job(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_report", job)
    assert cli.main(["report", "somewhere"]) == 130
    assert "SIGINT before the job started" in capsys.readouterr().err


def test_forked_tool_calls_still_running_are_killed_at_exit():
    from agentrl.envs import tools

    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    tools._CHILDREN.add(pid)
    tools._kill_children()
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(pid, os.WNOHANG)
    tools._CHILDREN.discard(pid)


# Data loss: paths the user gave that hold their own files.

def test_a_save_never_replaces_a_users_file_or_directory(tmp_path):
    from agentrl.checkpoint import save_atomically
    from agentrl.errors import UserError

    user_file, user_dir = tmp_path / "passwd", tmp_path / "notes"
    user_file.write_text("root:x:0:0\n")
    user_dir.mkdir()
    (user_dir / "todo.txt").write_text("keep me")
    for path in (user_file, user_dir):
        with pytest.raises(UserError, match="not a model agentrl wrote"):
            save_atomically(path, lambda d: (Path(d) / "config.json").write_text("{}"))
    assert user_file.read_text() == "root:x:0:0\n" and (user_dir / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "passwd"]  # no temporary or .old left
    for path in (tmp_path / "empty", tmp_path / "model"):  # an empty directory and an earlier save are replaced
        path.mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for path in (tmp_path / "empty", tmp_path / "model", tmp_path / "new"):
        save_atomically(path, lambda d: (Path(d) / "adapter_config.json").write_text("{}"))
        assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json"]


def test_base_dir_on_a_users_file_is_refused_before_training(tmp_path):
    from agentrl.errors import UserError
    from agentrl.jobs.base_model import build_base_model

    user_file = tmp_path / "passwd"
    user_file.write_text("root:x:0:0\n")
    started = time.time()
    with pytest.raises(UserError, match=r"model.base_dir: .*passwd exists and is a file"):
        build_base_model(user_file)
    assert time.time() - started < 5 and user_file.read_text() == "root:x:0:0\n"


def test_sft_takes_the_out_dir_lock_and_keeps_a_users_model_dir(tmp_path):
    import subprocess
    import sys

    from agentrl.errors import UserError
    from agentrl.jobs.sft import SFTJobConfig, run_sft_job

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from agentrl.jobs.run import lock_run; "
                               f"lock_run({str(tmp_path / 'busy')!r}); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match="another agentrl job is running there"):
            run_sft_job(SFTJobConfig(out_dir=str(tmp_path / "busy")))
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / "mine" / "model").mkdir(parents=True)
    (tmp_path / "mine" / "model" / "thesis.tex").write_text("keep me")
    with pytest.raises(UserError, match="not a model agentrl wrote"):
        run_sft_job(SFTJobConfig(out_dir=str(tmp_path / "mine")))
    assert (tmp_path / "mine" / "model" / "thesis.tex").read_text() == "keep me"


def test_a_fresh_start_clears_only_what_jobs_wrote_under_checkpoints(tmp_path):
    from agentrl.jobs.run import open_run, unlock_run

    root = tmp_path / "checkpoints"
    for name in ("step-000004", ".tmp-step-000008-x1", "notes"):
        (root / name).mkdir(parents=True)
    for name in ("eval-before.json", "eval-after.tmp", "README.txt"):
        (root / name).write_text("{}")
    assert open_run(tmp_path, None, {"steps": 4}) is None
    unlock_run(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["README.txt", "notes"]


def test_a_second_signal_ends_a_step_that_swallows_it(tmp_path):
    """A step that catches BaseException around its hang swallows the SignalExit of the second signal too; the
    process still ends, EXIT_GRACE_SECONDS later, with 128 + the signal and a line saying why."""
    import signal
    import subprocess
    import sys

    script = (f"import time, agentrl.checkpoint as c\n"
              f"c.EXIT_GRACE_SECONDS = 1.0\n"
              f"ckpt = c.Checkpointer({str(tmp_path / 'checkpoints')!r}, every=2)\n"
              f"with ckpt.signals(), ckpt.loop():\n"
              f"    print('in the step', flush=True)\n"
              f"    while True:\n"
              f"        try:\n"
              f"            time.sleep(1000)\n"
              f"        except BaseException:\n"
              f"            pass\n")
    job = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "in the step"
    job.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    try:
        _, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert job.returncode == 143
    assert "a second SIGTERM before the step ended" in err and "still running 1 s after the second signal" in err


# Inputs that reached a traceback: JSON Python cannot hold, paths that are not files, hub look-ups for typos.

@pytest.mark.parametrize("line, problem", [
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deep to read"),
    ('{"a": ' + "9" * 5000 + "}", "a number Python will not read"),
    ('{"prompt": "a\\ud800b"}', r"a string holds a lone surrogate \('\\ud800'\)"),
    ('{"prompt": "a\\uDC00"}', r"a string holds a lone surrogate \('\\udc00'\)")])
def test_json_lines_python_cannot_hold_are_named_by_file_and_line(tmp_path, line, problem):
    from agentrl.data import read_jsonl
    from agentrl.errors import UserError
    from agentrl.samples import read_jsonl as read_run_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "fine \\u00e9 \\ud83d\\ude00"}\n' + line + "\n")
    for read in (read_jsonl, read_run_jsonl):
        with pytest.raises(UserError, match=rf"rows.jsonl:2: {problem}"):
            read(path)
    path.write_text('{"prompt": "fine \\u00e9 \\ud83d\\ude00"}\n')
    assert read_jsonl(path) == [{"prompt": "fine \u00e9 \U0001F600"}]


def test_config_paths_that_are_not_files_and_huge_integers_are_named(tmp_path):
    from agentrl.jobs.ppo import JobConfig

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, kind in ((tmp_path, "a directory"), (fifo, "a pipe"), (Path("/dev/zero"), "a device")):
        with pytest.raises(ConfigError, match=f"config file {path} is {kind}, not a YAML file"):
            load_config(JobConfig, path)
    (tmp_path / "big.yaml").write_text("steps: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"big.yaml: a value Python will not read \(Exceeds the limit"):
        load_config(JobConfig, tmp_path / "big.yaml")
    with pytest.raises(ConfigError, match=r"override steps=\.\.\.: a value Python will not read"):
        load_config(JobConfig, None, ["steps=" + "9" * 5000])


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "m", "--tasks-kwargs", "{bad json"], "argument --tasks-kwargs: not a JSON object"),
    (["eval", "--model", "m", "--env-kwargs", "[1]"], r"--env-kwargs: must be a JSON object \(\{...\}\), got list"),
    (["eval", "--model", "m", "--out", "."], r"argument --out: \. is a directory; give a file path"),
    (["report", "r", "--out", "."], r"argument --out: \. is a directory")])
def test_command_line_arguments_are_checked_before_any_work(argv, message, capsys):
    from agentrl.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_writing_to_a_directory_or_an_unwritable_place_is_named_and_leaves_nothing(tmp_path):
    from agentrl.checkpoint import write_text_atomically
    from agentrl.errors import UserError

    with pytest.raises(UserError, match="is a directory; give a file path"):
        write_text_atomically(tmp_path, "x")
    with pytest.raises(UserError, match=r"/proc/x.html: cannot write it \("):
        write_text_atomically("/proc/x.html", "x")
    assert list(tmp_path.iterdir()) == []


def test_a_report_whose_values_matplotlib_cannot_place_skips_that_panel(tmp_path):
    import json

    from agentrl.jobs.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"algo": "ppo", "steps": 2}))
    rows = [{"step": 1, "policy/kl": 1e308, "env/accuracy": 0.5}, {"step": 2, "policy/kl": -1e308,
                                                                     "env/accuracy": 0.6}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="panel is not drawn: matplotlib cannot place its values"):
        path = write_report(run)
    assert path.is_file() and "data:image/png;base64," in path.read_text()


def test_a_path_like_model_name_that_does_not_exist_fails_without_asking_the_hub(tmp_path, monkeypatch):
    from agentrl.errors import UserError
    from agentrl.jobs.evaluate import load_policy
    from agentrl.models.pretrained import resolve_model_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for name in ("runs/nope-model", "./nope", "/nonexistent/model", "a/b/c"):
        with pytest.raises(UserError, match="no such model directory or file"):
            resolve_model_dir(name)
    assert resolve_model_dir("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a Hub id stays one
    with pytest.raises(UserError, match="notes.txt: not a PEFT adapter directory"):
        load_policy("runs/any-model", "notes.txt")  # before loading the model


def test_a_tool_call_built_in_code_with_arguments_that_are_not_an_object_is_an_observation():
    from agentrl.envs.tools import ToolCall, ToolRunner
    from test_reliability_tools import echo

    runner = ToolRunner([echo])
    assert runner(ToolCall("echo", None)) == ("Error: echo: the arguments must be a JSON object, got NoneType", False)
    assert runner(ToolCall("echo", [1])) == ("Error: echo: the arguments must be a JSON object, got list", False)
    assert runner(ToolCall(["echo"], {}))[0].startswith("Error: unknown tool ['echo']")
