"""The environment protocol: what a user writes to train an agent on their own task.

An environment is any object with this shape (no base class to inherit):

    class MyEnv:
        stop_patterns = (r"Action:[^\n]*\n",)   # regexes: a turn ends right after the first match (or EOS)
        max_turns = 4                            # model turns per episode

        def reset(self, task: dict) -> str: ...              # the prompt text
        def step(self, action: str) -> StepResult: ...        # the world's answer to one model turn

`step` gets the text the model wrote in this turn. It returns the observation to append (text the model
did not write, masked out of every loss), the reward for this turn, and whether the episode is over.
Episode score = sum of turn rewards. PPO puts each turn's reward on the last token of that turn.

An episode that failed for reasons outside the policy (a tool server that died, a sandbox that did not start)
says so with `info["infra_failure"] = True` in any step's StepResult: the trainers leave it out of the loss and
of the group baselines and count it (env/infra_failure_rate), instead of teaching the policy from a 0 it did
not earn.

Optional members (OPTIONAL_MEMBERS below holds what an environment without one gets; the engine reads them
through `env_option` and nothing else):
- `bind_tokenizer(tokenizer)`: a method the engine calls before `reset`, for environments that render through
  the tokenizer (ToolEnv in chat format);
- `keep_special_tokens = True`: each turn's text with its special tokens (the sampled turn-end marker);
- `eos_ends_episode = False`: EOS only ends a turn (chat templates whose end-of-turn token is the EOS);
- `step_timeout` (seconds, 0 or None: none): when `reset` or `step` may rightly take longer than the rollout's
  deadline (300 s, STEP_TIMEOUT; env.step_timeout in jobs). A call past it is abandoned on its thread and the
  episode ends as an infrastructure failure (env/timeout_rate);
- `concurrent_steps = True`: the batch's `step` calls may run at once on threads (tools waiting on I/O);
- `messages`, `schemas`, `chat_template_kwargs`: chat environments' conversation so far, tool schemas and extra
  template arguments, kept with each episode so preference and SFT rows can be written as messages.

Tasks come from a function next to the environment, `my_tasks(n: int, seed: int, split: str, **kw) -> list[dict]`
(split "train" or "eval"; a task's "question" key, when it has one, identifies it for the held-out split; `kw`
are the config's env.tasks_kwargs, e.g. the name of a dataset or a game).
Demonstrations for SFT (`env.demonstrations: module:function`, agentrl/trainers/sft.py) come from a function
`my_demonstrations(task: dict, rng: random.Random) -> dict` returning one row for that task:

    {"segments": [[reset(task), False], ["Thought: ...\nAction: tool(...)\n", True],
                  ["Observation: ...\n", False], ["Answer: ...", True]]}
    {"messages": [...], "tools": [...]}          # chat environments: only assistant messages are trained

Split a segments row where the rollout engine splits turns: the prompt is exactly `reset(task)`, each model
turn ends where a stop pattern matches, observations are exactly what `step` returns (none trainable); the
row ends with EOS, as an episode does. Draw choices from `rng` so that the set is reproducible.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from agentrl.errors import EnvironmentContractError, SignalExit

Segments = list[tuple[str, bool]]  # (text, trainable) pieces of one demonstration
INFRA_FAILURE = "infra_failure"  # StepResult.info key: the episode failed for reasons outside the policy


@dataclass
class StepResult:
    """What the environment answers to one model turn."""

    observation: str | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    stop_patterns: tuple[str, ...]
    max_turns: int

    def reset(self, task: dict) -> str: ...

    def step(self, action: str) -> StepResult: ...


# Seconds an environment's reset or step may run before its episode ends as an infrastructure failure (the call
# abandoned on its daemon thread), unless the environment says otherwise (its `step_timeout`).
STEP_TIMEOUT = 300.0

OPTIONAL_MEMBERS: dict[str, Any] = {  # name: what an environment without it gets (the module docstring says why)
    "bind_tokenizer": None,
    "keep_special_tokens": False,
    "eos_ends_episode": True,
    "step_timeout": STEP_TIMEOUT,
    "concurrent_steps": False,
    "messages": None,
    "schemas": None,
    "chat_template_kwargs": None,
}


def env_option(env, name: str) -> Any:
    """One of the protocol's optional members (OPTIONAL_MEMBERS) of `env`, or its default. A property that
    raises (sys.exit included) is an error naming the class and the member."""
    return _user_call(getattr, f"{type(env).__name__}.{name}", env, name, OPTIONAL_MEMBERS[name])


@dataclass
class Corpus:
    """Synthetic demonstrations the embedded base model learns: tasks(n, seed, split, unique) and
    demonstrate(task, right, rng) -> Segments, where `right` asks for a demonstration that does the job right."""

    tasks: Callable
    demonstrate: Callable
    special_tokens: tuple[str, ...] = ()  # extra special tokens (chat markers)
    chat_template: str | None = None  # saved with the tokenizer
    decision: str = r"[^\n]*\n"  # regex: where a turn decides to call or not (not scored by the probe)


def load_object(spec: str) -> Any:
    """Import `"package.module:Name"` (or `"package.module.Name"`). Errors name the spec."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"cannot load {spec!r}: expected 'package.module:ClassName'")
    # So `agentrl ... env.name=my_env:MyEnv` finds ./my_env.py; appended, not put first, so that a file in the
    # working directory named like an installed package (peft.py, datasets.py) never shadows the package, and
    # only while the user's module imports: a library's later `try: import bitsandbytes` must not find a
    # ./bitsandbytes.py of the user's when that optional package is not installed.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot load {spec!r}: module {module_name!r} not importable ({e})") from e
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"cannot load {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def load_tasks(spec: str, n: int, seed: int, split: str, kwargs: dict | None = None) -> list[dict]:
    """Tasks from a `module:function(n, seed, split, **kwargs)` or a JSONL file (its rows of this split, see
    data.py). `kwargs` (env.tasks_kwargs) name what the function draws from: a dataset, a game, a server."""
    if spec.endswith(".jsonl"):
        if kwargs:
            raise ValueError(f"env.tasks_kwargs {kwargs} given, but the tasks come from the file {spec}")
        from agentrl.data import read_task_split

        return read_task_split(spec, split)[:n]
    extra = "".join(f", {k}={v!r}" for k, v in (kwargs or {}).items())
    where = f"{spec}({n}, seed={seed}, split={split!r}{extra})"
    tasks = _user_call(load_object(spec), where, n, seed=seed, split=split, **(kwargs or {}))
    if not isinstance(tasks, (list, tuple)):
        raise EnvironmentContractError(f"{where} must return a list of task dicts, returned {_shown(tasks)}")
    for i, task in enumerate(tasks):
        if not isinstance(task, dict):
            raise EnvironmentContractError(f"{where} must return a list of task dicts; item {i} is {_shown(task)}")
        if "question" in task and not isinstance(task["question"], str):  # held-out tasks are told apart by it
            raise EnvironmentContractError(f"{where}: task {i}'s question is {_shown(task['question'])} (a str)")
        if (problem := json_problem(task, f"task {i}")) is not None:  # tasks are written to samples.jsonl
            raise EnvironmentContractError(f"{where}: task {i} cannot be written as JSON ({problem})")
    return list(tasks)


def make_env(spec: str | type, kwargs: dict | None = None) -> Environment:
    """Instantiate an environment from a class or a `"module:Class"` spec and check it has the protocol."""
    cls = load_object(spec) if isinstance(spec, str) else spec
    env = _user_call(cls, f"{getattr(cls, '__name__', cls)}(**{kwargs or {}})", **(kwargs or {}))
    missing = [name for name in ("reset", "step", "stop_patterns", "max_turns")
               if not _user_call(hasattr, f"{type(env).__name__}.{name}", env, name)]
    if missing:
        raise TypeError(f"environment {spec!r} lacks {', '.join(missing)} (see agentrl.envs.base)")
    check_attributes(env)
    return env


# --- the protocol, checked where the rollout calls it: a broken environment is one line naming the class, the
# method and what it returned, not a traceback from deep inside the engine -----------------------------------

def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except SignalExit:
        raise
    except BaseException:  # noqa: BLE001 - a user's __repr__ that raises (or exits) must not hide the error
        text = "<its repr raised>"
    return f"{type(value).__name__} {text}"[:120]


def _message(e: BaseException) -> str:
    """str(e), or a stand-in when the exception's own __str__ raises."""
    try:
        return str(e)
    except SignalExit:
        raise
    except BaseException:  # noqa: BLE001
        return "<its message raised>"


def _text_problem(text: str) -> str | None:
    """Why `text` cannot reach the tokenizer, or None: lone surrogates are not UTF-8 (NUL is, and is kept)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not UTF-8 text (a lone surrogate {text[e.start]!r} at character {e.start})"
    return None


class EnvTimeout(Exception):
    """env.reset / env.step ran past its deadline (env.step_timeout); its thread is abandoned, still running."""


_ENV_THREADS = None  # envs/threads.CallThreads for env calls, made at the first call with a deadline


def _within(timeout: float | None, fn: Callable, *args) -> Any:
    """fn(*args), or with a deadline (seconds; None or 0: none) on a reused daemon thread (envs/threads.CallThreads):
    EnvTimeout when it overruns, leaving the call running on a thread that never keeps the process alive (a
    Python thread cannot be stopped). What fn raises (sys.exit included) is raised here, in the caller's thread."""
    global _ENV_THREADS
    if not timeout:
        return fn(*args)
    if _ENV_THREADS is None:
        from agentrl.envs.threads import CallThreads

        _ENV_THREADS = CallThreads("env", "an environment whose step or reset hangs needs fixing (a deadline inside "
                                           "it), or lower env.step_timeout")
    status, value = _ENV_THREADS.run(lambda: fn(*args), {}, timeout)
    if status == "timeout":
        raise EnvTimeout(f"did not return within {timeout:g} s (env.step_timeout)")
    if status == "raised":
        raise value
    return value


def _user_call(fn: Callable, where: str, *args, **kwargs) -> Any:
    """fn(*args, **kwargs); what the user's code raises (sys.exit included) becomes an EnvironmentContractError
    naming `where`: any BaseException (KeyboardInterrupt, GeneratorExit, a class of the user's own), since none of
    them may end a job silently or with a traceback. Our own errors (agentrl's exception classes, a stop signal)
    pass through: they say where."""
    try:
        return fn(*args, **kwargs)
    except SignalExit:
        raise
    except BaseException as e:
        if type(e).__module__.startswith("agentrl."):
            raise
        raise EnvironmentContractError(f"{where} raised {type(e).__name__}: {_message(e)}"[:500]) from e


def check_attributes(env) -> tuple[int, tuple[str, ...]]:
    """(max_turns, stop_patterns), checked: a positive integer, a sequence of regexes."""
    name = type(env).__name__
    turns = _user_call(getattr, f"{name}.max_turns", env, "max_turns")
    stops = _user_call(getattr, f"{name}.stop_patterns", env, "stop_patterns")
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise EnvironmentContractError(f"{name}.max_turns must be an integer >= 1, got {_shown(turns)}")
    if isinstance(stops, str) or not isinstance(stops, (tuple, list)) or not all(isinstance(p, str) for p in stops):
        raise EnvironmentContractError(f"{name}.stop_patterns must be a tuple of regex strings, got {_shown(stops)}")
    for pattern in stops:
        try:
            re.compile(pattern)
        except re.error as e:
            raise EnvironmentContractError(f"{name}.stop_patterns: {pattern!r} is not a regex ({e})") from None
    return turns, tuple(stops)


def checked_reset(env, task: dict, timeout: float | None = None) -> str:
    """env.reset(task), which must return the prompt text; EnvTimeout past `timeout` seconds (None: none)."""
    prompt = _user_call(_within, f"{type(env).__name__}.reset", timeout, env.reset, task)
    if not isinstance(prompt, str):
        raise EnvironmentContractError(f"{type(env).__name__}.reset must return the prompt (a str), "
                                       f"returned {_shown(prompt)}")
    if (problem := _text_problem(prompt)) is not None:
        raise EnvironmentContractError(f"{type(env).__name__}.reset: the prompt it returned {problem}")
    return prompt


def checked_step(env, action: str, timeout: float | None = None) -> StepResult:
    """env.step(action), which must return a StepResult (or an object with its four fields); EnvTimeout past
    `timeout` seconds (None: none)."""
    result = _user_call(_within, f"{type(env).__name__}.step", timeout, env.step, action)
    problem = None
    if not all(hasattr(result, name) for name in ("observation", "reward", "done", "info")):
        problem = f"returned {_shown(result)}"
    elif result.observation is not None and not isinstance(result.observation, str):
        problem = f"its observation is {_shown(result.observation)} (a str, or None)"
    elif result.observation is not None and _text_problem(result.observation):
        problem = f"its observation {_text_problem(result.observation)}"
    elif not _is_number(result.reward):
        problem = f"its reward is {_shown(result.reward)} (a number)"
    elif result.done is None or isinstance(result.done, (str, bytes)) or not _is_truth_value(result.done):
        problem = f"its done is {_shown(result.done)} (True or False)"
    elif not isinstance(result.info, dict):
        problem = f"its info is {_shown(result.info)} (a dict)"
    else:
        problem = _info_problem(result.info)
    if problem:
        raise EnvironmentContractError(f"{type(env).__name__}.step must return StepResult(observation, reward, done, "
                                       f"info); {problem}")
    return result


INFO_COUNTS = ("tool_calls", "format_errors", "tool_failures", "malformed_calls")  # summed into the step's metrics


def _info_problem(info: dict) -> str | None:
    """What in a step's info the metrics and samples.jsonl cannot take, or None: `correct` is counted as
    accuracy and the counts are summed, so a string there would be read wrongly; info is written as JSON."""
    correct = info.get("correct", False)
    if type(correct).__name__ not in ("bool", "bool_") and not (type(correct) is int and correct in (0, 1)):
        return f"its info['correct'] is {_shown(info['correct'])} (True or False)"
    for key in INFO_COUNTS:
        if key in info and (isinstance(info[key], bool) or not _is_number(info[key])):
            return f"its info[{key!r}] is {_shown(info[key])} (a number)"
    problem = json_problem(info, "info")
    return None if problem is None else f"its info cannot be written as JSON ({problem})"


def json_problem(value: Any, name: str) -> str | None:
    """Why json.dumps(value, default=str), as the logs write it, fails, naming where in `value`; or None."""
    try:
        json.dumps(value, default=str)
    except SignalExit:
        raise
    except BaseException as e:  # noqa: BLE001 - non-string keys, a cycle, deep nesting, a __str__ that raises
        where = _unwritable_at(value, name)
        return f"{where + ': ' if where else ''}{type(e).__name__}: {_message(e)[:80]}"
    return None


def _unwritable_at(info: Any, name: str = "info", max_depth: int = 200) -> str | None:
    """Where in `info` json.dumps fails: `info['a'][0]` holds a key of the wrong type, is a container it is
    inside of (a cycle), or is nested too deep; None if the walk finds nothing (json's own message then says it)."""
    stack, on_path = [(info, name, 0, None)], set()
    while stack:
        obj, where, depth, leaving = stack.pop()
        if leaving is not None:  # every child of `leaving` is done: it is no longer an ancestor
            on_path.discard(leaving)
            continue
        if not isinstance(obj, (dict, list, tuple)):
            continue
        if id(obj) in on_path:
            return f"{where} contains itself"
        if depth >= max_depth:
            return f"{where} is nested more than {max_depth} deep"
        on_path.add(id(obj))
        stack.append((None, where, depth, id(obj)))
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            if isinstance(obj, dict) and not (key is None or isinstance(key, (str, int, float, bool))):
                return f"{where} has the key {_shown(key)}"
            stack.append((value, f"{where}[{key!r}]" if depth < 8 else where.removesuffix("[...]") + "[...]",
                          depth + 1, None))
    return None


def _is_number(x: Any) -> bool:
    """int, float, numpy and 0-d torch numbers; not str, bytes, None or containers. NaN is a number (the trainers
    count non-finite steps)."""
    if x is None or isinstance(x, (str, bytes, list, tuple, dict)):
        return False
    try:
        float(x)
    except SignalExit:
        raise
    except BaseException:  # noqa: BLE001 - TypeError, ValueError, an int past float's range, a __float__ that raises
        return False
    return True


def _is_truth_value(x: Any) -> bool:
    """bool(x) gives an answer: not a numpy array of several values, nor a __bool__ that raises."""
    try:
        bool(x)
    except SignalExit:
        raise
    except BaseException:  # noqa: BLE001
        return False
    return True
