"""Arithmetic word problems: a task that needs the language model and the calculator.

    user:       A crate holds 124 bottles. How many bottles are in 37 crates?
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "124 * 37"}}</tool_call>
    tool:       4588                                        <- the environment's, masked out of every loss
    assistant:  The answer is 4588.

The model has to turn words into an expression (several phrasings of +, -, *, / and, in some, two operations)
and the numbers are too large to multiply in the head: SmolLM2-135M-Instruct answers "What is 17 * 23?" with
321. Train and held-out tasks are split by the question's text (agentrl.data.split_of).

Demonstrations are chat messages. `word_problem_demonstration` calls the tool on half the tasks and guesses
(wrongly, "I think it is N.") on the other half: SFT teaches the call format and the words-to-expression
mapping, not when to call; that is left for RL to learn from the reward, as in the tutorials' calculator.
"""

from __future__ import annotations

import random

from agentrl.data import split_of
from agentrl.envs.calculator import _wrong_guess, calculator, numeric_match
from agentrl.envs.safe_eval import format_number, safe_eval
from agentrl.envs.tools import ToolEnv, tool_schema

# (phrasings, expression): each phrasing names the numbers {a}, {b}, {c}; the expression is what the model
# should pass to the calculator. `ranges` bound each number; `check` keeps answers positive and divisions exact.
_PROBLEMS = [
    (("A warehouse holds {a} boxes. A truck brings {b} more boxes. How many boxes are in the warehouse now?",
      "A library has {a} books and buys {b} new ones. How many books does it have now?",
      "On Monday {a} people visited the museum and on Tuesday {b} people. How many visited on the two days together?"),
     "{a} + {b}", {"a": (1000, 9999), "b": (100, 9999)}),
    (("A farm had {a} chickens and sold {b} of them. How many chickens are left?",
      "A tank holds {a} litres of water. {b} litres leak out. How many litres remain?",
      "A school printed {a} flyers and handed out {b}. How many flyers does it still have?"),
     "{a} - {b}", {"a": (1000, 9999), "b": (100, 999)}),
    (("A crate holds {a} bottles. How many bottles are in {b} crates?",
      "A worker earns {a} dollars a week. How much does the worker earn in {b} weeks?",
      "Each bus carries {a} passengers. How many passengers can {b} buses carry?",
      "A book has {a} pages. How many pages are there in {b} copies of the book?"),
     "{a} * {b}", {"a": (12, 999), "b": (12, 99)}),
    (("{c} candies are shared equally among {b} children. How many candies does each child get?",
      "A rope {c} centimetres long is cut into {b} equal pieces. How long is each piece in centimetres?",
      "{c} dollars are split equally between {b} friends. How many dollars does each friend get?"),
     "{c} / {b}", {"a": (12, 999), "b": (12, 99)}),  # c = a * b: the division is exact
    (("A shop orders {a} packs of {b} pencils and already has {c} pencils. How many pencils does it have in total?",
      "A cinema has {a} rows of {b} seats plus {c} extra seats. How many seats does it have?"),
     "{a} * {b} + {c}", {"a": (12, 99), "b": (12, 99), "c": (100, 999)}),
    (("A club sells {a} tickets at {b} dollars each and pays {c} dollars for the hall. How much money is left?",
      "A factory makes {a} boxes of {b} cups and {c} cups break. How many cups are left?"),
     "{a} * {b} - {c}", {"a": (12, 99), "b": (12, 99), "c": (100, 999)}),
    (("A train carries {a} passengers. At a station {b} get off and {c} get on. How many passengers are on the train now?",
      "A store had {a} shirts, sold {b} and received {c} more. How many shirts does it have now?"),
     "{a} - {b} + {c}", {"a": (1000, 9999), "b": (100, 999), "c": (100, 999)}),
]

# One-operation families twice as often as two-operation ones: about a quarter of the tasks need two operations.
_WEIGHTS = [2 if expression.count(" ") == 2 else 1 for _, expression, _ in _PROBLEMS]


def word_problem_tasks(n: int, seed: int = 0, split: str = "train", unique: bool = True) -> list[dict]:
    """`n` word problems of the given split: {"question", "answer", "expression"}."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng, tasks, seen = random.Random(f"word-problems-{seed}-{split}"), [], set()
    while len(tasks) < n:
        phrasings, expression, ranges = rng.choices(_PROBLEMS, _WEIGHTS)[0]
        numbers = {k: rng.randint(*ranges[k]) for k in ("a", "b", "c") if k in ranges}
        if "c" not in numbers:
            numbers["c"] = numbers["a"] * numbers["b"]  # the dividend of the exact division
        question = rng.choice(phrasings).format(**numbers)
        if (unique and question in seen) or split_of(question) != split:
            continue
        expr = expression.format(**numbers)
        value = safe_eval(expr)
        if value <= 0:
            continue
        seen.add(question)
        tasks.append({"question": question, "answer": format_number(value), "expression": expr})
    return tasks


class WordProblemEnv(ToolEnv):
    """Word problems with the calculator tool, in the tokenizer's chat template (Hermes calls by default)."""

    def __init__(self, format: str = "chat", max_turns: int = 3, rewards: dict | None = None,
                 tool_parser: str | None = None, chat_template_kwargs: dict | None = None,
                 system_prompt: str | None = None):
        super().__init__([calculator], check=numeric_match, format=format, max_turns=max_turns, rewards=rewards,
                         tool_parser=tool_parser, chat_template_kwargs=chat_template_kwargs,
                         system_prompt=system_prompt)


def word_problem_messages(task: dict, use_tool: bool, rng: random.Random) -> dict:
    """One chat demonstration: a calculator call with the task's expression and the answer it returns, or
    (not `use_tool`) a guess that is wrong, worded differently so that guessing is not confused with copying."""
    messages = [{"role": "user", "content": task["question"]}]
    if use_tool:
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": task["expression"]}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculator", "content": task["answer"]},
                     {"role": "assistant", "content": f"The answer is {task['answer']}."}]
    else:
        messages.append({"role": "assistant", "content": f"I think it is {_wrong_guess(task['answer'], rng)}."})
    return {"messages": messages, "tools": [tool_schema(calculator)]}


def word_problem_demonstration(task: dict, rng: random.Random) -> dict:
    """env.demonstrations: half the rows call the tool, half guess (see the module docstring)."""
    return word_problem_messages(task, rng.random() < 0.5, rng)


def word_problem_tool_demonstration(task: dict, rng: random.Random) -> dict:
    """env.demonstrations where every row calls the tool (SFT alone then solves the task; no room for RL)."""
    return word_problem_messages(task, True, rng)
