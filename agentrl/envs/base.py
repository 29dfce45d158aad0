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

Optional, for environments that render through the tokenizer (ToolEnv in chat format): a method
`bind_tokenizer(tokenizer)` the engine calls before `reset`; `keep_special_tokens = True` to get each turn's
text with its special tokens (the sampled turn-end marker); `eos_ends_episode = False` when EOS only ends a turn.

Tasks come from a function next to the environment, `my_tasks(n: int, seed: int, split: str) -> list[dict]`
(split "train" or "eval"; a task's "question" key, when it has one, identifies it for the held-out split).
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
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

Segments = list[tuple[str, bool]]  # (text, trainable) pieces of one demonstration


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
    if os.getcwd() not in sys.path:  # so `agentrl ... env.name=my_env:MyEnv` finds ./my_env.py, as python -m would
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot load {spec!r}: module {module_name!r} not importable ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"cannot load {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def load_tasks(spec: str, n: int, seed: int, split: str) -> list[dict]:
    """Tasks from a `module:function(n, seed, split)` or a JSONL file (its rows of this split, see data.py)."""
    if spec.endswith(".jsonl"):
        from agentrl.data import read_task_split

        return read_task_split(spec, split)[:n]
    return load_object(spec)(n, seed=seed, split=split)


def make_env(spec: str | type, kwargs: dict | None = None) -> Environment:
    """Instantiate an environment from a class or a `"module:Class"` spec and check it has the protocol."""
    cls = load_object(spec) if isinstance(spec, str) else spec
    env = cls(**(kwargs or {}))
    missing = [name for name in ("reset", "step", "stop_patterns", "max_turns") if not hasattr(env, name)]
    if missing:
        raise TypeError(f"environment {spec!r} lacks {', '.join(missing)} (see agentrl.envs.base)")
    return env
