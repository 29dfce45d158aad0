"""The tutorials' calculator agent: a ReAct text protocol with one real tool.

    Question: What is 123 * 456?
    Thought: I need to calculate 123 * 456.
    Action: calculator(123 * 456)          <- the model's turn ends at this newline
    Observation: 56088                     <- written by the environment, masked out of the loss
    Answer: 56088<eos>

Rewards (configurable) follow the tutorials' table: 1.0 correct answer after a tool call, 0.2 tool called but the
answer is wrong, -0.5 only malformed tool calls, -1.0 no tool call at all. The answer is read from the
`Answer:` line only; an `Observation:` the model writes itself is never read.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import re

from agentrl.data import split_of
from agentrl.envs.base import Corpus
from agentrl.envs.chat import CHATML_TOOLS_TEMPLATE
from agentrl.envs.safe_eval import CalculatorError, format_number, safe_eval
from agentrl.envs.tools import Tool, ToolCall, ToolEnv, ToolFailure, tool_schema

_ACTION_LINE = re.compile(r"^[ \t]*Action:[ \t]*(.*)$", re.MULTILINE)
_CALL = re.compile(r"^calculator\((.*)\)\s*$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression to evaluate, e.g. 123 * 456
    """
    return format_number(safe_eval(expression))


def numeric_match(task: dict, answer: str) -> bool:
    """The answer text holds exactly one number and it equals the task's answer."""
    numbers = _NUMBER.findall(answer)
    return len(numbers) == 1 and abs(float(numbers[0]) - float(task["answer"])) < 1e-6


@functools.lru_cache(maxsize=None)  # environments are made per episode; deriving the schema takes milliseconds
def react_calculator(max_operations: int | None = None) -> Tool:
    """The calculator tool as the ReAct environments run it: its schema, `max_operations` binary operations a
    call at most, and an unusable expression answered `Error: <what is wrong>` (a ToolFailure)."""
    def run(expression: str) -> str:
        try:
            return format_number(safe_eval(expression, max_operations))
        except CalculatorError as e:
            raise ToolFailure(str(e)) from None

    return Tool(tool_schema(calculator), run)


class CalculatorEnv(ToolEnv):
    """The tutorials' multi-turn calculator: ToolEnv's ReAct format with one tool. Tasks: `{"question": ...,
    "answer": ...}`.

    What differs from a plain `ToolEnv([calculator], format="react")` is the tutorials' strict grammar: an
    Action line is `calculator(<expression>)` and nothing else (no quotes, no JSON arguments, no other tool
    names; anything else is a malformed call), and a call in the last turn still runs and counts as a tool
    call although its result is never read.
    """

    def __init__(self, max_turns: int = 3, rewards: dict | None = None, max_operations: int | None = None):
        super().__init__([react_calculator(max_operations)], check=numeric_match, format="react",
                         max_turns=max_turns, rewards=rewards, run_last_turn_calls=True)
        self.max_operations = max_operations
        self.concurrent_steps = False  # the calculator computes in microseconds: no waiting to overlap

    def reset(self, task: dict) -> str:
        if "question" not in task or "answer" not in task:
            raise KeyError(f"calculator task needs 'question' and 'answer', got keys {sorted(task)}")
        return super().reset(task)

    def _parse_react(self, action: str) -> tuple[list[ToolCall], list[str]]:
        line = _ACTION_LINE.search(action)
        if line is None:
            return [], []
        call = _CALL.match(line.group(1).strip())
        if call is None:
            return [], ["expected calculator(<expression>)"]
        return [ToolCall("calculator", {"expression": call.group(1)})], []


# --- tasks and demonstrations -------------------------------------------------------------------------

def _operand(rng: random.Random) -> int:
    return rng.randint(1, [9, 99, 999][rng.randint(0, 2)])


def calculator_tasks(n: int, seed: int = 0, split: str = "train", unique: bool = True) -> list[dict]:
    """`n` tasks `a op b` (op in + - *, operands of 1-3 digits) from the given split.

    With `unique`, no question repeats; SFT corpora pass False so that short operands (only 81 pairs of
    one-digit numbers exist) keep their share instead of running out after a few hundred draws.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng, tasks, seen = random.Random(f"calculator-{seed}-{split}"), [], set()
    while len(tasks) < n:
        a, b, op = _operand(rng), _operand(rng), rng.choice("+-*")
        expression = f"{a} {op} {b}"
        question = f"What is {expression}?"
        if (unique and question in seen) or split_of(question) != split:
            continue
        seen.add(question)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        tasks.append({"question": question, "answer": str(answer), "expression": expression})
    return tasks


def _wrong_guess(answer: str, rng: random.Random) -> str:
    """A plausible but wrong number: the right one with one or two digits changed."""
    digits = list(answer.lstrip("-"))
    while True:
        guess = digits[:]
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(len(guess))
            guess[i] = str(rng.randrange(1 if i == 0 and len(guess) > 1 else 0, 10))
        text = ("-" if answer.startswith("-") else "") + "".join(guess)
        if text != answer:
            return text


def calculator_demonstration(task: dict, use_tool: bool, rng: random.Random) -> list[tuple[str, bool]]:
    """One SFT trace as (text, trainable) segments, split where the rollout engine splits turns.

    Observation segments are not trainable, as in RL. Without the tool the trace guesses (wrongly), so a
    model trained on a mix must learn from reward when calling the tool pays.
    """
    prompt, expression = f"Question: {task['question']}\n", task["expression"]
    if not use_tool:
        guess = _wrong_guess(task["answer"], rng)
        return [(prompt, False), (f"Thought: I can answer {expression} directly.\nAnswer: {guess}", True)]
    return [
        (prompt, False),
        (f"Thought: I need to calculate {expression}.\nAction: calculator({expression})\n", True),
        (f"Observation: {task['answer']}\n", False),
        (f"Answer: {task['answer']}", True),
    ]


# --- the multi-step variant -----------------------------------------------------------------------------

class MultiStepCalculatorEnv(CalculatorEnv):
    """`(a + b) * c`, `a * b - c`, ...: the calculator does one operation per call, so a correct answer
    takes two or three calls in sequence. Same rewards and text protocol as CalculatorEnv."""

    def __init__(self, max_turns: int = 5, rewards: dict | None = None):
        super().__init__(max_turns=max_turns, rewards=rewards, max_operations=1)


_TEMPLATES = ("({a} + {b}) * {c}", "({a} - {b}) * {c}", "{a} * {b} - {c}", "{a} * {b} + {c}", "({a} + {b}) * ({c} - {d})")


def _steps_of(expression: str) -> list[tuple[str, str]]:
    """The single operations that evaluate `expression`, innermost first: [(step expression, result)]."""
    steps = []

    def walk(node: ast.AST) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        left, right = walk(node.left), walk(node.right)
        step = f"{left} {_OPS[type(node.op)]} {right}"
        steps.append((step, format_number(safe_eval(step))))
        return steps[-1][1]

    walk(ast.parse(expression, mode="eval").body)
    return steps


_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}


def multistep_tasks(n: int, seed: int = 0, split: str = "train", unique: bool = True) -> list[dict]:
    """`n` tasks needing 2-3 single-operation calls, from the given split (see calculator_tasks)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng, tasks, seen = random.Random(f"multistep-{seed}-{split}"), [], set()
    while len(tasks) < n:
        template = rng.choice(_TEMPLATES)
        expression = template.format(a=rng.randint(1, 99), b=rng.randint(1, 99), c=rng.randint(1, 9), d=rng.randint(1, 9))
        question = f"What is {expression}?"
        if (unique and question in seen) or split_of(question) != split:
            continue
        seen.add(question)
        tasks.append({"question": question, "answer": format_number(safe_eval(expression)), "expression": expression})
    return tasks


def multistep_demonstration(task: dict, complete: bool, rng: random.Random) -> list[tuple[str, bool]]:
    """A multi-call trace. Imperfect on purpose when not `complete`: it stops after the first call and
    answers the intermediate result, or guesses the final step, so RL must teach it to finish the job."""
    steps = _steps_of(task["expression"])
    segments = [(f"Question: {task['question']}\n", False)]
    n_calls = len(steps) if complete else rng.randint(1, len(steps) - 1)
    for k, (step, result) in enumerate(steps[:n_calls]):
        word = "First" if k == 0 else "Then"
        segments.append((f"Thought: {word} {step}.\nAction: calculator({step})\n", True))
        segments.append((f"Observation: {result}\n", False))
    if complete:
        answer = steps[-1][1]
    else:
        answer = steps[n_calls - 1][1] if rng.random() < 0.5 else _wrong_guess(steps[-1][1], rng)
    segments.append((f"Answer: {answer}", True))
    return segments


# --- the same task with a typed tool function and JSON tool calls ----------------------------------------

class CalculatorToolEnv(ToolEnv):
    """CalculatorEnv's tasks through ToolEnv: `react` text or `chat` (tool calls in the template's family's form)."""

    def __init__(self, format: str = "chat", max_turns: int = 3, rewards: dict | None = None,
                 tool_parser: str | None = None, chat_template_kwargs: dict | None = None):
        super().__init__([calculator], check=numeric_match, format=format, max_turns=max_turns, rewards=rewards,
                         tool_parser=tool_parser, chat_template_kwargs=chat_template_kwargs)


def chat_calculator_demonstration(task: dict, use_tool: bool, rng: random.Random) -> list[tuple[str, bool]]:
    """A chat-format trace exactly as CHATML_TOOLS_TEMPLATE renders it (a test checks the two agree).

    The decision to call is the first token of the turn, `<tool_call>` or "I" (of "I think it is N"), with
    the corpus' 40/60 odds: the base model guesses under greedy decoding and RL has to teach it when the
    tool pays, as in the ReAct quickstart. The answer after a tool result is worded differently ("The
    answer is N"), so that copying the result is not confused with guessing.
    """
    prompt = (f"<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
              f"<|im_start|>user\n{task['question']}<|im_end|>\n<|im_start|>assistant\n")
    if not use_tool:
        return [(prompt, False), (f"I think it is {_wrong_guess(task['answer'], rng)}<|im_end|>", True)]
    call = json.dumps({"name": "calculator", "arguments": {"expression": task["expression"]}})
    return [
        (prompt, False),
        (f"<tool_call>{call}</tool_call><|im_end|>", True),
        (f"\n<|im_start|>tool\n{task['answer']}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"The answer is {task['answer']}<|im_end|>", True),
    ]


# --- the embedded base models' corpora (jobs/base_model.py) ---------------------------------------------

CALCULATOR_CORPUS = Corpus(calculator_tasks, calculator_demonstration)
MULTISTEP_CORPUS = Corpus(multistep_tasks, multistep_demonstration)
CHAT_CORPUS = Corpus(calculator_tasks, chat_calculator_demonstration, ("<|im_start|>", "<|im_end|>"),
                     CHATML_TOOLS_TEMPLATE, decision="<")  # the "<" of <tool_call>: its own token
