"""An environment that breaks the protocol (raises, exits, returns the wrong types) is one line naming the class,
the method and what it returned; a SIGTERM's exit still passes through."""

import re
import sys

import pytest

from agentrl.cli import main
from agentrl.envs.base import StepResult, make_env
from agentrl.errors import EnvironmentContractError, SignalExit, UserError
from agentrl.rollout import SamplingParams, rollout
from agentrl.rollout.sampling import Sample
from fake_tokenizer import FakeTokenizer


def writes_answer(contexts, params, eos, pad, **kwargs):
    return [Sample(ids=[ord(c) for c in "Answer: 1"], logprobs=[-1.0] * 9, finish="eos") for _ in contexts]


class Env:
    stop_patterns = ()
    max_turns = 2

    def reset(self, task):
        return "Q: "

    def step(self, action):
        return StepResult(None, 1.0, True, {})


def run(env_cls, n=2):
    return rollout(None, FakeTokenizer(), env_cls, [{"question": str(i)} for i in range(n)], SamplingParams(),
                   sampler=writes_answer)


def returning(**methods):
    return type("BrokenEnv", (Env,), {name: (lambda self, *a, v=v: v() if callable(v) else v)
                                      for name, v in methods.items()})


def test_a_working_environment_runs():
    assert [ep.score for ep in run(Env)] == [1.0, 1.0]


@pytest.mark.parametrize("methods, message", [
    ({"step": None}, "BrokenEnv.step must return StepResult(observation, reward, done, info); returned NoneType None"),
    ({"step": ("obs", 1.0, True)}, "BrokenEnv.step must return StepResult(observation, reward, done, info); "
                                   "returned tuple ('obs', 1.0, True)"),
    ({"step": StepResult(None, "1.0", True, {})}, "its reward is str '1.0' (a number)"),
    ({"step": StepResult(None, None, True, {})}, "its reward is NoneType None (a number)"),
    ({"step": StepResult(42, 1.0, True, {})}, "its observation is int 42 (a str, or None)"),
    ({"step": StepResult(None, 1.0, "yes", {})}, "its done is str 'yes' (True or False)"),
    ({"step": StepResult(None, 1.0, True, None)}, "its info is NoneType None (a dict)"),
    ({"reset": 7}, "BrokenEnv.reset must return the prompt (a str), returned int 7"),
    ({"reset": lambda: 1 / 0}, "BrokenEnv.reset raised ZeroDivisionError: division by zero"),
    ({"step": lambda: sys.exit(3)}, "BrokenEnv.step raised SystemExit: 3"),
    ({"step": lambda: sys.exit(0)}, "BrokenEnv.step raised SystemExit: 0"),
])
def test_a_broken_environment_is_one_line_naming_class_and_method(methods, message):
    with pytest.raises(EnvironmentContractError, match=re.escape(message) + "$"):
        run(returning(**methods))


def test_numbers_of_other_kinds_and_nan_are_rewards():
    numpy = pytest.importorskip("numpy")
    for reward in (numpy.float32(0.5), 1, float("nan")):
        assert len(run(returning(step=StepResult(None, reward, True, {})))) == 2


def test_a_stop_signal_passes_through_the_environment():
    def stop():
        raise SignalExit(143)

    with pytest.raises(SignalExit):
        run(returning(step=stop))


class Raising(Env):
    def __init__(self, size=1):
        raise RuntimeError("no index on disk")


@pytest.mark.parametrize("attrs, message", [({"max_turns": -3}, "Bad.max_turns must be an integer >= 1, got int -3"),
                                            ({"max_turns": "4"}, "Bad.max_turns must be an integer >= 1, got str '4'"),
                                            ({"stop_patterns": "Action:"}, "Bad.stop_patterns must be a tuple"),
                                            ({"stop_patterns": ("(",)}, r"Bad.stop_patterns: '\(' is not a regex")])
def test_make_env_checks_the_protocols_attributes(attrs, message):
    with pytest.raises(EnvironmentContractError, match=message.replace(".", r"\.")):
        make_env(type("Bad", (Env,), attrs))


def test_a_constructor_that_raises_is_named():
    with pytest.raises(EnvironmentContractError, match=r"^Raising\(\*\*\{'size': 2\}\) raised RuntimeError: no index"):
        make_env(Raising, {"size": 2})
    assert issubclass(EnvironmentContractError, UserError) and issubclass(EnvironmentContractError, TypeError)


BROKEN = """
class Raising:
    stop_patterns, max_turns = (), 2
    def __init__(self):
        raise RuntimeError("no index on disk")

class ResetsToInt:
    stop_patterns, max_turns = (), 2
    def reset(self, task):
        return 3
    def step(self, action):
        return None

def tasks(n, seed, split):
    return [{"question": f"q{i}-{split}", "answer": 1} for i in range(n)]
"""


def test_the_cli_prints_one_line_and_exits_2(tiny_base, tmp_path, monkeypatch, capsys):
    (tmp_path / "my_broken_env.py").write_text(BROKEN)
    monkeypatch.chdir(tmp_path)
    assert main(["ppo", "--config", "quickstart", "env.name=my_broken_env:Raising", "env.tasks=my_broken_env:tasks",
                 f"model.base={tiny_base}", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == ("agentrl: error: env.name=my_broken_env:Raising, env.kwargs={}: Raising(**{}) "
                                    "raised RuntimeError: no index on disk")
    assert main(["eval", "--model", tiny_base, "--env", "my_broken_env:ResetsToInt",
                 "--task-source", "my_broken_env:tasks", "--tasks", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "agentrl: error: ResetsToInt.reset must return the prompt (a str), returned int 3"


def test_a_tasks_function_that_raises_or_returns_the_wrong_type_is_named(tmp_path, monkeypatch):
    from agentrl.envs.base import load_tasks

    (tmp_path / "my_bad_tasks.py").write_text(
        "def raises(n, seed, split):\n    raise OSError('tasks.csv not found')\n"
        "def dict_of_tasks(n, seed, split):\n    return {'question': 'q'}\n"
        "def strings(n, seed, split):\n    return ['q1', 'q2']\n"
        "def generator(n, seed, split):\n    return ({'question': f'q{i}'} for i in range(n))\n")
    monkeypatch.chdir(tmp_path)
    for name, message in (("raises", "my_bad_tasks:raises(2, seed=0, split='eval') raised OSError: tasks.csv "
                                     "not found"),
                          ("dict_of_tasks", "must return a list of task dicts, returned dict {'question': 'q'}"),
                          ("strings", "must return a list of task dicts; item 0 is str 'q1'"),
                          ("generator", "must return a list of task dicts, returned generator")):
        with pytest.raises(EnvironmentContractError, match=re.escape(message)):
            load_tasks(f"my_bad_tasks:{name}", 2, 0, "eval")
