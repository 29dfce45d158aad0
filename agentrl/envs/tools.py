"""Tools as plain typed Python functions, and an environment built from a list of them.

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. 3 * (4 + 5)
        \"\"\"

Schemas come from `transformers.utils.get_json_schema` (the docstring's Args section). Calls are validated
against the schema, run with a timeout, and anything that goes wrong (bad JSON, unknown tool, bad
arguments, an exception, a timeout) becomes an observation the model can read, never a crash.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_REACT_ACTION = re.compile(r"^[ \t]*Action:[ \t]*([A-Za-z_]\w*)\((.*)\)[ \t]*$", re.MULTILINE)


def tool_schema(fn: Callable) -> dict:
    """The JSON schema transformers derives from a typed, documented function."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


@dataclass
class ToolCall:
    name: str
    arguments: dict


def parse_hermes_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text` -> (calls, errors).

    Malformed JSON, a missing name or non-object arguments, and a call cut off before `</tool_call>`
    are reported in `errors` (one message each) instead of raising.
    """
    calls, errors = [], []
    for match in _HERMES.finditer(text):
        body, closing = match.group(1).strip(), match.group(2)
        if not closing:
            errors.append("truncated tool call: no </tool_call>")
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append("tool call needs a string 'name'")
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f"arguments of {obj['name']!r} must be an object")
            continue
        calls.append(ToolCall(obj["name"], arguments))
    return calls, errors


def validate_arguments(schema: dict, arguments: dict) -> str | None:
    """None if `arguments` fit the function schema, else a message naming the offending argument."""
    params = schema["function"].get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    for name in required:
        if name not in arguments:
            return f"missing argument {name!r}"
    for name, value in arguments.items():
        if name not in props:
            return f"unknown argument {name!r} (expected {', '.join(props) or 'none'})"
        expected = props[name].get("type")
        types = expected if isinstance(expected, list) else [expected] if expected else []
        if types and not any(isinstance(value, _JSON_TYPES.get(t, object)) and not (
                t in ("integer", "number") and isinstance(value, bool)) for t in types):
            return f"argument {name!r} must be {' or '.join(types)}, got {type(value).__name__}"
    return None


_POOL: concurrent.futures.ThreadPoolExecutor | None = None  # shared: environments are created per episode


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentrl-tool")
    return _POOL


@functools.lru_cache(maxsize=256)
def _cached_schema(fn: Callable) -> dict:
    return tool_schema(fn)


class ToolRunner:
    """Dispatches validated calls to the functions with a per-call timeout and an observation size limit."""

    def __init__(self, tools: list[Callable], timeout: float = 5.0, max_observation_chars: int = 500):
        self.functions = {fn.__name__: fn for fn in tools}
        self.schemas = {fn.__name__: _cached_schema(fn) for fn in tools}
        self.timeout, self.max_chars = timeout, max_observation_chars

    def __call__(self, call: ToolCall) -> tuple[str, bool]:
        """(observation text, ok). Never raises."""
        if call.name not in self.functions:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self.functions)}", False
        problem = validate_arguments(self.schemas[call.name], call.arguments)
        if problem:
            return f"Error: {call.name}: {problem}", False
        future = _pool().submit(self.functions[call.name], **call.arguments)
        try:
            result = future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            # A Python thread cannot be killed; the call is abandoned and its result ignored.
            return f"Error: {call.name} timed out after {self.timeout:g} s", False
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
            return f"Error: {call.name} raised {type(e).__name__}: {e}"[: self.max_chars], False
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + " ...[truncated]"
        return text, True

    def parse_react(self, call_text: str) -> ToolCall | str:
        """`name(args)` from an Action line: a JSON object, or the raw text for a one-parameter tool."""
        match = re.match(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", call_text, re.DOTALL)
        if match is None:
            return "expected name(arguments)"
        name, raw = match.group(1), match.group(2).strip()
        if raw.startswith("{"):
            try:
                return ToolCall(name, json.loads(raw))
            except json.JSONDecodeError as e:
                return f"arguments are not valid JSON ({e.msg})"
        required = self.schemas.get(name, {}).get("function", {}).get("parameters", {}).get("required", [])
        if name in self.schemas and len(required) == 1:
            return ToolCall(name, {required[0]: raw.strip("\"'")})
        return ToolCall(name, {})


@dataclass
class ToolRewards:
    correct: float = 1.0  # correct final answer after at least one successful call
    tool_but_wrong: float = 0.2  # a successful call, wrong or no answer
    malformed_call: float = -0.5  # only failed / malformed calls
    no_tool: float = -1.0  # no call at all


class ToolEnv:
    """An environment from a list of typed functions.

    format "react": the tutorials' text, `Action: name(args)` lines, `Observation: ...` replies, `Answer: ...`.
    format "chat": the tokenizer's chat template with `tools=`, Hermes `<tool_call>` JSON (several per
    turn allowed), tool results as `tool` messages rendered by the same template (see agentrl.envs.chat).
    `check(task, answer_text) -> bool` decides correctness; rewards follow the tutorial's table.
    """

    def __init__(self, tools: list[Callable], check: Callable[[dict, str], bool], format: str = "react",
                 max_turns: int = 4, timeout: float = 5.0, max_observation_chars: int = 500,
                 rewards: dict | None = None, system_prompt: str | None = None):
        if format not in ("react", "chat"):
            raise ValueError(f"format must be 'react' or 'chat', got {format!r}")
        self.runner = ToolRunner(tools, timeout, max_observation_chars)
        self.check, self.format, self.max_turns = check, format, max_turns
        self.rewards = ToolRewards(**(rewards or {}))
        self.system_prompt = system_prompt
        self.stop_patterns = (r"Action:[^\n]*\n",) if format == "react" else ()
        self.eos_ends_episode = True  # chat: unless EOS is the template's end of turn (set in bind_tokenizer)
        self.keep_special_tokens = format == "chat"  # chat turns are read with their turn-end marker
        self.chat = None

    @property
    def schemas(self) -> list[dict]:
        return list(self.runner.schemas.values())

    @property
    def messages(self) -> list[dict] | None:
        """Chat format: the conversation so far as messages (prompt, assistant turns, tool results)."""
        return self.chat.messages if self.chat is not None else None

    def bind_tokenizer(self, tokenizer) -> None:
        """Called by the rollout engine: chat format renders through the tokenizer's template."""
        if self.format == "chat":
            from agentrl.envs.chat import ChatRenderer

            self.chat = ChatRenderer.for_tokenizer(tokenizer, self.schemas)
            self.stop_patterns = (self.chat.stop_pattern,)
            self.eos_ends_episode = tokenizer.eos_token != self.chat.turn_end

    def reset(self, task: dict) -> str:
        self.task, self.turns, self.calls, self.failures, self.format_errors = task, 0, 0, 0, 0
        question = task.get("question")
        if not isinstance(question, str):
            raise KeyError(f"tool task needs a string 'question', got keys {sorted(task)}")
        if self.format == "react":
            return f"Question: {question}\n"
        if self.chat is None:
            raise RuntimeError("chat format needs bind_tokenizer(tokenizer) before reset()")
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        return self.chat.start(messages + [{"role": "user", "content": question}])

    def step(self, action: str):
        from agentrl.envs.base import StepResult

        self.turns += 1
        calls, errors = self._parse(action)
        # A chat turn that ends in EOS (not the turn-end marker) ends the episode: score it as the last turn.
        last = self.turns >= self.max_turns or (self.chat is not None and self.chat.ended_with_eos(action))
        if (calls or errors) and not last:
            results = []
            for problem in errors:
                results.append(f"Error: {problem}")
            for call in calls:
                text, ok = self.runner(call)
                self.calls += ok
                self.failures += not ok
                results.append(text)
            self.format_errors += len(errors)
            if self.format == "react":
                observation = "".join(f"Observation: {r}\n" for r in results)
            else:
                observation = self.chat.tool_turn(action, results)
            return StepResult(observation, 0.0, False, self._info(False))
        answer = self._answer(action) if not (calls or errors) else None
        if self.chat is not None:
            self.chat.messages.append({"role": "assistant", "content": self.chat.content(action)})
        correct = answer is not None and bool(self.check(self.task, answer))
        r = self.rewards
        reward = (r.correct if correct else r.tool_but_wrong) if self.calls else \
            (r.malformed_call if self.failures or self.format_errors else r.no_tool)
        return StepResult(None, reward, True, self._info(correct, answer))

    def _parse(self, action: str) -> tuple[list[ToolCall], list[str]]:
        if self.format == "chat":
            return parse_hermes_tool_calls(action)
        match = _REACT_ACTION.search(action)
        if match is None:
            return ([], ["expected Action: name(arguments)"]) if re.search(r"^\s*Action:", action, re.M) else ([], [])
        parsed = self.runner.parse_react(f"{match.group(1)}({match.group(2)})")
        return ([parsed], []) if isinstance(parsed, ToolCall) else ([], [parsed])

    def _answer(self, action: str) -> str | None:
        if self.format == "react":
            match = re.search(r"^[ \t]*Answer:[ \t]*(.*)$", action, re.MULTILINE)
            return match.group(1).strip() if match else None
        return self.chat.content(action).strip() or None

    def _info(self, correct: bool, answer: Any = None) -> dict:
        return {"correct": correct, "answer": answer, "tool_calls": self.calls, "tool_failures": self.failures,
                "format_errors": self.format_errors + self.failures}
