"""reasoning-gym's task families as agentrl environments (`pip install agentrl[ecosystems]`).

    env:
      name: agentrl.envs.ecosystems.reasoning_gym:ReasoningGymEnv
      kwargs: {format: react}                   # or chat (the tokenizer's chat template)
      tasks: agentrl.envs.ecosystems.reasoning_gym:reasoning_gym_tasks
      tasks_kwargs: {dataset: leg_counting, config: {min_animals: 1, max_animals: 1}}
      demonstrations: agentrl.envs.ecosystems.reasoning_gym:reasoning_gym_demonstration

    Question: Your task is to count how many legs ... if you have 3 dogs?
    Answer: 12<eos>                              <- scored by the family's own scorer (1.0 = correct)

The split. reasoning-gym builds item `idx` of a dataset seeded `s` from `Random(s + idx)`, so datasets seeded 1
and 2 share all but one item. Here every item comes from one dataset per (family, config), seeded 0, and the
split picks the indices: train draws even indices, held-out odd ones, `2 * (seed * SEED_STRIDE + i) + (split ==
"eval")`; no index, hence no `Random` stream, is ever in both splits, whatever the two seeds. Small families still
repeat a question under two indices, so a question's text also decides its split (`agentrl.data.split_of` at
one half, as the built-in tasks do): no train question ever equals a held-out one, under any seeds. Held-out
questions are distinct. Nothing here depends on the time or the process: the same config gives the same tasks
(five families iterate over sets, so theirs follow PYTHONHASHSEED; docs/ecosystems-reasoning-gym.md).

Answers are extracted before scoring (the default scorer gives containment credit: "The answer is 7" scores
0.067 against "7"): the text of the last `<answer>...</answer>`, else what follows the last `Answer:`. A turn with
neither scores 0. The family's score of that text is the reward, partial scores included (`partial_credit=False`
rounds them down to 0). Datasets and scorers are built once per process (arc_agi's takes half a second).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import random
import re
import threading
import warnings
from dataclasses import fields
from typing import Any

from agentrl.config import ConfigError
from agentrl.data import split_of
from agentrl.envs.base import StepResult, load_object
from agentrl.envs.tools import _THREADS, ToolEnv

SEED_STRIDE = 1_000_000  # items one seed may draw per split; seeds s and s+1 never share an index
MAX_SEED = 2000  # indices stay below 2**32 (some families seed numpy with them)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_LINE = re.compile(r"^[ \t]*Answer:[ \t]*", re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_LOCK = threading.Lock()
# Families whose items follow Python's string hashing (they iterate over sets): measured on reasoning-gym 0.1.25,
# 105 families drawn under PYTHONHASHSEED 1 and 2 (docs/ecosystems-reasoning-gym.md).
HASH_SEEDED = frozenset({"isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder"})


def _registry() -> dict:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError("reasoning-gym is not installed: pip install 'agentrl[ecosystems]'") from None
    return DATASETS


def _config_cls(name: str):
    registry = _registry()
    if not isinstance(name, str) or name not in registry:
        near = difflib.get_close_matches(str(name), list(registry), n=3, cutoff=0.5)
        hint = f"; nearest: {', '.join(near)}" if near else f"; one of {len(registry)} (reasoning_gym.factory.DATASETS)"
        raise ConfigError(f"env.tasks_kwargs.dataset: unknown reasoning-gym dataset {name!r}{hint}")
    return registry[name][1]


def check_config(name: str, config: dict | None) -> dict:
    """The family's config fields as given, checked against its dataclass; an error names the bad key."""
    cls = _config_cls(name)
    if config is not None and not isinstance(config, dict):
        raise ConfigError(f"env.tasks_kwargs.config: a mapping of {name}'s config fields, got {config!r}")
    config = dict(config or {})
    allowed = [f.name for f in fields(cls) if f.name not in ("seed", "size")]
    for key in config:
        if key in ("seed", "size"):
            raise ConfigError(f"env.tasks_kwargs.config.{key}: set by agentrl (the split picks item indices; "
                              f"use the job's seed)")
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; nearest: {near[0]}" if near else f"; fields: {', '.join(allowed)}"
            raise ConfigError(f"env.tasks_kwargs.config.{key}: not a field of {name}'s config ({cls.__name__}){hint}")
    try:
        _dataset(name, json.dumps(config, sort_keys=True))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the family's validate() asserts; a wrong type fails inside it
        raise ConfigError(f"env.tasks_kwargs.config: {name} rejects {config}: {type(e).__name__}: {e}"[:300]) from None
    return config


@functools.cache
def _dataset_unlocked(name: str, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=0, **json.loads(config_json))


def _dataset(name: str, config_json: str):
    """One dataset (and so one scorer) per family and config per process; the lock keeps threads from building
    the same one twice."""
    with _LOCK:
        return _dataset_unlocked(name, config_json)


@functools.lru_cache(maxsize=65536)
def _item(name: str, config_json: str, index: int) -> dict:
    dataset = _dataset(name, config_json)
    try:
        return dataset[index]
    except IndexError:  # acre, gsm_symbolic, list_functions, word_ladder: a list built (or read) at creation
        raise ConfigError(f"env.tasks_kwargs.dataset: {name} holds a fixed list of {len(dataset)} items and the split "
                          f"needs item {index} (train: even indices, held-out: odd, {SEED_STRIDE} per seed); only "
                          f"seed 0 and a few hundred tasks fit") from None


def _index(seed: int, i: int, split: str) -> int:
    """Train: even indices, held-out: odd; seed s owns [s * SEED_STRIDE, (s + 1) * SEED_STRIDE) of each."""
    return 2 * (seed * SEED_STRIDE + i) + (split == "eval")


def reasoning_gym_tasks(n: int, seed: int = 0, split: str = "train", dataset: str | None = None,
                        config: dict | None = None, wrong_fraction: float = 0.5) -> list[dict]:
    """`n` tasks of one reasoning-gym family: {"question", "answer", "dataset", "config", "index",
    "wrong_fraction"} (the family's item is rebuilt from dataset, config and index when scoring).
    `wrong_fraction`: the share of wrong answers in reasoning_gym_demonstration's rows."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if dataset is None:
        raise ConfigError("env.tasks_kwargs.dataset: name a reasoning-gym dataset (e.g. leg_counting)")
    if not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, {MAX_SEED}) for reasoning-gym tasks (eval_seed, sft.seed, "
                          f"ppo.seed or grpo.seed), got {seed!r}")
    if not 0.0 <= wrong_fraction <= 1.0:
        raise ConfigError(f"env.tasks_kwargs.wrong_fraction must be in [0, 1], got {wrong_fraction!r}")
    config = check_config(dataset, config)
    if dataset in HASH_SEEDED and os.environ.get("PYTHONHASHSEED", "random") == "random":
        warnings.warn(f"reasoning-gym {dataset} iterates over sets, so its tasks change from run to run unless "
                      f"PYTHONHASHSEED is set (e.g. PYTHONHASHSEED=0); the split stays disjoint", stacklevel=2)
    config_json = json.dumps(config, sort_keys=True)
    tasks, seen, i = [], set(), 0
    budget = 20 * n + 200  # draws; only a family with few distinct questions runs out
    while len(tasks) < n:
        if i >= min(budget, SEED_STRIDE):
            raise ConfigError(f"env.tasks_kwargs: {dataset} {config} gave only {len(tasks)} distinct {split} questions "
                              f"in {i} draws, {n} asked; widen its config or ask for fewer tasks")
        index = _index(seed, i, split)
        i += 1
        item = _item(dataset, config_json, index)
        question = item["question"].strip()
        if split_of(question, 0.5) != split or (split == "eval" and question in seen):
            continue
        seen.add(question)
        tasks.append({"question": question, "answer": item["answer"], "dataset": dataset, "config": config,
                      "index": index, "wrong_fraction": wrong_fraction})
    return tasks


def family_score(task: dict, answer: str | None) -> float:
    """The family's own score of an extracted answer (0.0 for none, or when its scorer raises on it)."""
    if answer is None:
        return 0.0
    config_json = json.dumps(task["config"], sort_keys=True)
    try:
        return float(_dataset(task["dataset"], config_json).score_answer(answer, _item(task["dataset"], config_json,
                                                                                        task["index"])))
    except Exception:  # noqa: BLE001 - a scorer that chokes on a malformed answer: that answer is wrong, not a crash
        return 0.0


def extract_answer(text: str) -> str | None:
    """The last `<answer>...</answer>`, else everything after the last `Answer:` line start; None when neither."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    starts = list(_ANSWER_LINE.finditer(text))
    if not starts:
        return None
    return text[starts[-1].end():].strip() or None


def math_verify_check(task: dict, answer_text: str, timeout: float = 5.0) -> bool:
    """math-verify's equivalence of the answer text and task["answer"] (LaTeX or plain: "1/2" = "0.5" =
    "\\frac{1}{2}"); a ToolEnv `check`. Safe in worker threads: math-verify's own timeouts use signal.alarm,
    which raises in any thread but the main one (a caller that swallows errors then scores every answer 0), so
    they are off and the check runs on a tool thread with `timeout` instead (False when it overruns; Python
    cannot stop the thread, which is abandoned as a hung tool call is)."""
    if not answer_text or len(answer_text) > 1000:
        return False
    status, result = _THREADS.run(_math_verify, {"gold": str(task["answer"]), "answer": answer_text}, timeout)
    return status == "ok" and result


def _math_verify(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    parsed_gold = parse(gold, parsing_timeout=None) or parse(f"${gold}$", parsing_timeout=None)
    pred = parse(answer, parsing_timeout=None)
    return bool(parsed_gold and pred and verify(parsed_gold, pred, timeout_seconds=None))


class ReasoningGymEnv(ToolEnv):
    """One reasoning-gym task per episode, scored by the family's scorer on the extracted answer.

    format "react": `Question: ...` then the model writes `Answer: ...` (a `Thought:` before it is fine).
    format "chat": the question as the user message through the tokenizer's chat template.
    `scorer`: "family" (its score_answer, partial scores kept unless `partial_credit=False`) or "math_verify".
    `tools`: "module:function" specs (e.g. agentrl.envs:calculator) the model may call before answering (ToolEnv's
    protocols); give max_turns > 1 with them. info["correct"] is a score of 1.0.
    """

    def __init__(self, format: str = "react", max_turns: int = 1, scorer: str = "family", partial_credit: bool = True,
                 tools: list[str] | None = None, system_prompt: str | None = None, tool_parser: str | None = None,
                 chat_template_kwargs: dict | None = None, timeout: float = 5.0):
        if scorer not in ("family", "math_verify"):
            raise ValueError(f"scorer must be 'family' or 'math_verify', got {scorer!r}")
        super().__init__([load_object(t) for t in tools or []], check=lambda task, answer: False, format=format,
                         max_turns=max_turns, timeout=timeout, system_prompt=system_prompt, tool_parser=tool_parser,
                         chat_template_kwargs=chat_template_kwargs)
        self.scorer, self.partial_credit = scorer, partial_credit

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        if not result.done:
            return result
        text = self.chat.content(action).rsplit("</think>", 1)[-1] if self.chat is not None else action
        answer = extract_answer(text)
        if self.scorer == "math_verify":
            score = float(answer is not None and math_verify_check(self.task, answer))
        else:
            score = family_score(self.task, answer)
        if not self.partial_credit:
            score = float(score >= 1.0)
        info = {**result.info, "answer": answer, "correct": score >= 1.0, "score": score,
                "format_errors": result.info["format_errors"] + (answer is None)}
        return StepResult(None, score, True, info)


# --- demonstrations for SFT: the family's own answers, a share of them made wrong ---------------------------------

def wrong_answer(task: dict, rng: random.Random) -> str:
    """A plausible answer the family scores below 1: a number with a digit or two changed, else the text with
    two characters swapped or one changed."""
    answer = str(task["answer"])
    for _ in range(50):
        if _NUMBER.fullmatch(answer):
            chars = list(answer)
            digits = [k for k, c in enumerate(chars) if c.isdigit()]
            for k in rng.sample(digits, min(len(digits), rng.randint(1, 2))):
                chars[k] = str(rng.randrange(1 if k == 0 and len(digits) > 1 and chars[k] != "0" else 0, 10))
            if rng.random() < 0.2:
                chars.append(str(rng.randrange(10)))
        else:
            chars = list(answer or "?")
            k = rng.randrange(len(chars))
            if len(chars) > 1 and rng.random() < 0.5:
                j = rng.randrange(len(chars))
                chars[k], chars[j] = chars[j], chars[k]
            else:
                chars[k] = rng.choice("abcdefghijklmnopqrstuvwxyz0123456789")
        guess = "".join(chars)
        if guess != answer and family_score(task, guess) < 1.0:
            return guess
    return answer + "0"  # never reached by the families tried; still wrong for an exact scorer


def _answer_of(task: dict, rng: random.Random) -> str:
    if task.get("answer") is None:
        raise ValueError(f"reasoning-gym {task.get('dataset')} stores no answer (several are right; its scorer "
                         f"checks them), so it has no demonstrations")
    return wrong_answer(task, rng) if rng.random() < task.get("wrong_fraction", 0.5) else str(task["answer"])


def reasoning_gym_demonstration(task: dict, rng: random.Random) -> dict:
    """env.demonstrations, ReAct format: the prompt as ReasoningGymEnv(format="react").reset writes it, then
    `Answer: <the family's answer>`, wrong in a share `task["wrong_fraction"]` of rows (tasks_kwargs.wrong_fraction):
    SFT teaches the format, RL the correctness."""
    return {"segments": [[f"Question: {task['question']}\n", False], [f"Answer: {_answer_of(task, rng)}", True]]}


def reasoning_gym_chat_demonstration(task: dict, rng: random.Random) -> dict:
    """env.demonstrations, chat format (no system prompt, as ReasoningGymEnv's default)."""
    return {"messages": [{"role": "user", "content": task["question"]},
                         {"role": "assistant", "content": f"Answer: {_answer_of(task, rng)}"}]}


def task_entry(task: dict) -> dict[str, Any]:
    """The family's own item behind a task (question, answer, metadata)."""
    return _item(task["dataset"], json.dumps(task["config"], sort_keys=True), task["index"])
