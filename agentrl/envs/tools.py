"""Tools as plain typed Python functions, and an environment built from a list of them.

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. 3 * (4 + 5)
        \"\"\"

Schemas come from `transformers.utils.get_json_schema` (the docstring's Args section); a tool defined elsewhere
(an MCP server's, envs/ecosystems/mcp_tools.py) is a `Tool(schema, fn)` instead. Calls are validated
against the schema, run with a timeout, and anything that goes wrong (bad JSON, unknown tool, bad
arguments, an exception, a timeout) becomes an observation the model can read, never a crash.

In chat format the calls are read in the form the model's family writes (TOOL_PARSERS, picked from the
chat template unless `tool_parser=` says otherwise):
    hermes       Hermes 2/3, Qwen2.5, Qwen3:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, several a turn
    llama3_json  Llama 3.1 / 3.2 / 3.3:       {"name": ..., "parameters": {...}}, optionally after <|python_tag|>
    mistral      Mistral v0.3, Nemo:          [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "a1B2c3D4e"}]
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import math
import os
import random
import re
import select
import signal
import string
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from agentrl.envs.threads import CallThreads

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_REACT_ACTION = re.compile(r"^[ \t]*Action:[ \t]*([A-Za-z_]\w*)\((.*)\)[ \t]*$", re.MULTILINE)


def tool_schema(fn: Callable) -> dict:
    """The JSON schema transformers derives from a typed, documented function."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


@dataclass(frozen=True)
class Tool:
    """A tool given by its JSON schema instead of a typed function (an MCP server's tool, say): the runner
    validates arguments against `schema` ({"type": "function", "function": {"name", "description",
    "parameters"}}) and calls `fn(**arguments)`."""

    schema: dict
    fn: Callable

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


class ToolFailure(Exception):
    """Raised by a tool whose failure message is meant for the model as is: the observation is
    `Error: <message>` (not `Error: <tool> raised <Type>: ...`), and the call counts as failed.
    infra=True: the tool's infrastructure failed (a server that is down), not the call the model wrote; the
    episode is then marked info["infra_failure"] and left out of the loss (agentrl.envs.base), with thread
    isolation (a forked child's flag does not come back)."""

    def __init__(self, message: str, infra: bool = False):
        super().__init__(message)
        self.infra = infra


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None  # the call id the model wrote (Mistral), else one is made up when the call is run


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
        except (ValueError, RecursionError) as e:  # bad JSON, a 4,300+ digit int, deep nesting
            errors.append(f"tool call is not valid JSON ({_json_problem(e)})")
            continue
        parsed = _call_from_object(obj, "arguments")
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    return calls, errors


def _json_problem(e: Exception) -> str:
    """What is wrong with model-written JSON: the decoder's message, or the limit it ran into."""
    return getattr(e, "msg", None) or ("nested too deeply" if isinstance(e, RecursionError) else str(e)[:100])


def _call_from_object(obj, key: str, id_pattern: re.Pattern | None = None) -> ToolCall | str:
    """A ToolCall from one decoded `{"name": ..., key: {...}}` object, or the problem with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "tool call needs a string 'name'"
    arguments = obj.get(key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    if not isinstance(arguments, dict):
        return f"{key} of {obj['name']!r} must be an object"
    call_id = obj.get("id")
    return ToolCall(obj["name"], arguments, call_id if id_pattern and isinstance(call_id, str)
                    and id_pattern.fullmatch(call_id) else None)


def parse_llama3_json_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """A Llama 3.x call: the whole turn is `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally
    after `<|python_tag|>`; calls separated by `;` are read too, but Llama's templates render one call per
    turn, so every call after the first is reported as an error and not run. Text not starting with `{`
    (or `<|python_tag|>`) is an answer, not a call."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body[len("<|python_tag|>"):].strip() if tagged else body
    if not body.startswith("{") and not tagged:
        return [], []
    objects, errors, decoder, position = [], [], json.JSONDecoder(), 0
    while position < len(body):
        try:
            obj, position = decoder.raw_decode(body, position)
        except (ValueError, RecursionError) as e:  # bad JSON, a 4,300+ digit int, deep nesting
            return [], [f"tool call is not valid JSON ({_json_problem(e)})"]
        objects.append(obj)
        rest = body[position:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return [], ["text after the tool call's JSON"]
        position = len(body) - len(rest)
    if not objects:
        return [], ["empty tool call after <|python_tag|>"]
    calls = []
    for obj in objects:
        parsed = _call_from_object(obj, "parameters")
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    for extra in calls[1:]:
        errors.append(f"one tool call per turn: {extra.name!r} was not run")
    return calls[:1], errors


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def parse_mistral_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` (the id is kept when it is the
    9-character alphanumeric id Mistral's templates demand; otherwise one is made up when the call runs)."""
    if "[TOOL_CALLS]" not in text:
        return [], []
    body = text.split("[TOOL_CALLS]", 1)[1].strip()
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad JSON, a 4,300+ digit int, deep nesting
        return [], [f"tool call is not valid JSON ({_json_problem(e)})"]
    calls, errors = [], []
    for item in obj if isinstance(obj, list) else [obj]:
        parsed = _call_from_object(item, "arguments", _MISTRAL_ID)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    return calls, errors


@dataclass(frozen=True)
class ToolParser:
    """How one model family writes tool calls: `parse(text) -> (calls, errors)`, and `content(text)`, the
    assistant text outside the calls (kept as the message's content next to its structured tool_calls)."""

    parse: Callable[[str], tuple[list[ToolCall], list[str]]]
    content: Callable[[str], str]


TOOL_PARSERS = {
    "hermes": ToolParser(parse_hermes_tool_calls, lambda text: _HERMES.sub("", text).strip()),
    "llama3_json": ToolParser(parse_llama3_json_tool_calls, lambda text: ""),
    "mistral": ToolParser(parse_mistral_tool_calls, lambda text: text.split("[TOOL_CALLS]", 1)[0].strip()),
}


def detect_tool_parser(chat_template) -> str:
    """The parser for the calls a chat template teaches: Mistral's `[TOOL_CALLS]`, Hermes/Qwen `<tool_call>`,
    Llama 3's JSON with "parameters" (ipython role); Hermes when the template names none."""
    if isinstance(chat_template, dict):  # named templates (Hermes ships "default" and "tool_use")
        chat_template = chat_template.get("tool_use") or chat_template.get("default") or ""
    text = chat_template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if '"parameters"' in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def new_call_id(rng: random.Random) -> str:
    """A 9-character alphanumeric call id, the form Mistral's templates check (others accept any string)."""
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(9))


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


_THREADS = CallThreads()  # shared: environments are created per episode
_CHILDREN: set[int] = set()  # forked calls still running (isolation "process")


@atexit.register
def _kill_children() -> None:
    """A call's child whose waiting thread did not get to kill it (the run exited on a signal meanwhile)."""
    for pid in list(_CHILDREN):
        with contextlib.suppress(OSError):
            _kill_group(pid)
            os.waitpid(pid, 0)


def _kill_group(pid: int) -> None:
    """SIGKILL a forked call and every process it started (its process group; see _run_forked). Called before
    the child is reaped, so its pid, and with it the group's id, cannot have been reused."""
    for kill in (os.kill, os.killpg):  # the child itself even if it is not (yet) its group's leader
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _run_forked(observe: Callable[[str, Any], tuple[str, bool]], fn: Callable, kwargs: dict,
                timeout: float) -> tuple[str, Any]:
    """One call in a forked child with a deadline: ("observation", (text, ok)) made by `observe(status, value)`
    in the child, ("timeout", None) after killing it, or ("exited", how) when it died without answering
    (os._exit, a crash, a signal). The child inherits the tool's module state copy-on-write; nothing it
    changes comes back, and only the observation text crosses the pipe (no pickling). The child leads its own
    process group, which is killed when the call ends, so processes a tool started (and left) end with it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer on the pipe and leave with os._exit, never through the parent's code
        try:
            os.setpgid(0, 0)
            os.close(read_end)
            for sig in (signal.SIGTERM, signal.SIGINT):  # not the run's checkpoint-and-exit handlers
                signal.signal(sig, signal.SIG_DFL)
            try:
                outcome = observe("ok", fn(**kwargs))
            except BaseException as e:  # noqa: BLE001 - see CallThreads._serve
                outcome = observe("raised", e)
            os.write(write_end, json.dumps(outcome).encode())
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(0)
    _CHILDREN.add(pid)
    with contextlib.suppress(OSError):  # also here, so no kill below can come before the child's own setpgid
        os.setpgid(pid, pid)
    os.close(write_end)
    deadline, chunks = time.monotonic() + timeout, []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                return "timeout", None
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:  # also when a signal's exit interrupts the wait: never leave the child running
        os.close(read_end)
        _kill_group(pid)  # the child if it has not answered, and what the call started, answered or not
        _, status = os.waitpid(pid, 0)
        _CHILDREN.discard(pid)
    if chunks:
        text, ok = json.loads(b"".join(chunks))
        return "observation", (text, ok)
    how = (f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
           else f"exit status {os.waitstatus_to_exitcode(status)}")
    return "exited", how


@functools.lru_cache(maxsize=256)
def _cached_schema(fn: Callable) -> dict:
    return tool_schema(fn)


class ToolRunner:
    """Dispatches validated calls to the functions with a per-call timeout and an observation size limit.

    isolation "thread" (default): calls run on daemon threads of this process; a call that overruns is
    abandoned (see envs/threads.CallThreads). A tool that crashes the interpreter, or calls posix._exit, ends the
    run; `agentrl` jobs make os._exit raise SystemExit in their process (cli._os_exit_raises), a failed call here.
    "process": each call runs in a forked child that is killed at the deadline, so nothing a tool does (os._exit,
    a segfault, a hang holding a lock) reaches the run; it costs a fork per call (milliseconds on a large
    process), changes to module state in a call do not persist, and it needs os.fork (Linux, macOS).
    """

    def __init__(self, tools: list[Callable | Tool], timeout: float = 5.0, max_observation_chars: int = 500,
                 isolation: str = "thread"):
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if isolation == "process" and not hasattr(os, "fork"):
            raise ValueError("isolation='process' needs os.fork, which this platform lacks; use 'thread'")
        self.isolation = isolation
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int) \
                or max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be an integer >= 1, got {max_observation_chars!r}")
        tools = [t if isinstance(t, Tool) else Tool(_cached_schema(t), t) for t in tools]
        self.functions = {t.name: t.fn for t in tools}
        self.schemas = {t.name: t.schema for t in tools}
        self.timeout, self.max_chars = timeout, max_observation_chars
        self.infra_failures = 0  # calls that failed with ToolFailure(infra=True)

    def __call__(self, call: ToolCall) -> tuple[str, bool]:
        """(observation text, ok). Never raises."""
        if not isinstance(call.name, str) or call.name not in self.functions:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self.functions)}", False
        if not isinstance(call.arguments, dict):  # a parser always gives a dict; code that builds calls may not
            return (f"Error: {call.name}: the arguments must be a JSON object, got "
                    f"{type(call.arguments).__name__}"), False
        problem = validate_arguments(self.schemas[call.name], call.arguments)
        if problem:
            return f"Error: {call.name}: {problem}", False
        fn, observe = self.functions[call.name], functools.partial(self._observation, call.name)
        if self.isolation == "process":
            status, result = _run_forked(observe, fn, call.arguments, self.timeout)
        else:
            status, result = _THREADS.run(fn, call.arguments, self.timeout)
        if status == "timeout":  # abandoned (thread) or killed (process); its result is ignored
            return f"Error: {call.name} timed out after {self.timeout:g} s", False
        if status == "exited":  # isolation "process": the child ended without answering
            return f"Error: {call.name} ended its process ({result}) without returning", False
        return result if status == "observation" else observe(status, result)

    def _observation(self, name: str, status: str, result: Any) -> tuple[str, bool]:
        """(text, ok) of a call that returned (status "ok") or raised ("raised"): a tool's failure is the
        model's observation."""
        if status == "raised" and isinstance(result, ToolFailure):
            self.infra_failures += result.infra
            return f"Error: {result}"[: self.max_chars], False
        if status == "raised":
            return f"Error: {name} raised {type(result).__name__}: {result}"[: self.max_chars], False
        try:  # str(): a str subclass of the tool's own may override len, slicing, ...
            text = str.__str__(result) if isinstance(result, str) else json.dumps(result, default=str)
        except Exception as e:  # non-string keys of mixed types, a cycle, deep nesting, a __str__ that raises
            return f"Error: {name} returned a {type(result).__name__} that is not JSON ({e})"[: self.max_chars], False
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
            except (ValueError, RecursionError) as e:  # bad JSON, a 4,300+ digit int, deep nesting
                return f"arguments are not valid JSON ({_json_problem(e)})"
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
    # Added for each malformed or failed call in an episode that a later call rescued. The table above scores such
    # an episode by its successful call alone, so RL never sees the bad call unless the episode fails to recover.
    recovered_bad_call: float = 0.0


class ToolEnv:
    """An environment from a list of typed functions (or `Tool`s: a JSON schema and a callable).

    format "react": the tutorials' text, `Action: name(args)` lines, `Observation: ...` replies, `Answer: ...`.
    format "chat": the tokenizer's chat template with `tools=`; calls in the form the model's family writes
    (`tool_parser`: "hermes", "llama3_json" or "mistral", read from the template when None); all results of a
    turn are `tool` messages (with their call ids) rendered together by the same template, appended after
    what the model sampled (see agentrl.envs.chat). `chat_template_kwargs` go to every rendering
    (e.g. `{"enable_thinking": False}` for Qwen3).
    `isolation="process"` runs each tool call in a forked child killed at `timeout` (see ToolRunner), for
    tools that may call os._exit, crash or hang holding a lock.
    `check(task, answer_text) -> bool` decides correctness; rewards follow the tutorial's table.
    `run_last_turn_calls=True`: a call in the last turn still runs and counts as a call (the episode ends before
    its result is read), as the tutorials' calculator scores it; by default it is not run.
    """

    def __init__(self, tools: list[Callable | Tool], check: Callable[[dict, str], bool], format: str = "react",
                 max_turns: int = 4, timeout: float = 5.0, max_observation_chars: int = 500,
                 rewards: dict | None = None, system_prompt: str | None = None, tool_parser: str | None = None,
                 chat_template_kwargs: dict | None = None, isolation: str = "thread",
                 run_last_turn_calls: bool = False):
        if format not in ("react", "chat"):
            raise ValueError(f"format must be 'react' or 'chat', got {format!r}")
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)} (or None: read from the chat "
                             f"template), got {tool_parser!r}")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a mapping, got {type(chat_template_kwargs).__name__}")
        self.runner = ToolRunner(tools, timeout, max_observation_chars, isolation)
        self.check, self.format, self.max_turns = check, format, max_turns
        self.run_last_turn_calls = run_last_turn_calls
        self.rewards = ToolRewards(**(rewards or {}))
        self.system_prompt = system_prompt
        self.tool_parser, self.chat_template_kwargs = tool_parser, dict(chat_template_kwargs or {})
        self.stop_patterns = (r"Action:[^\n]*\n",) if format == "react" else ()
        self.eos_ends_episode = True  # chat: unless EOS is the template's end of turn (set in bind_tokenizer)
        self.keep_special_tokens = format == "chat"  # chat turns are read with their turn-end marker
        # The rollout steps a batch's environments from threads, so slow tools (I/O) overlap; not in chat
        # format, whose step renders through the shared fast tokenizer (not safe to call from threads).
        self.concurrent_steps = format == "react"
        self.chat = None

    @property
    def schemas(self) -> list[dict]:
        return list(self.runner.schemas.values())

    @property
    def messages(self) -> list[dict] | None:
        """Chat format: the conversation so far as messages (prompt, assistant turns with structured
        `tool_calls`, tool results with their `tool_call_id`)."""
        return self.chat.messages if self.chat is not None else None

    def bind_tokenizer(self, tokenizer) -> None:
        """Called by the rollout engine: chat format renders through the tokenizer's template."""
        if self.format == "chat":
            from agentrl.envs.chat import ChatRenderer

            self.chat = ChatRenderer.for_tokenizer(tokenizer, self.schemas, self.chat_template_kwargs)
            self.tool_parser = self.tool_parser or detect_tool_parser(tokenizer.chat_template)
            self.stop_patterns = (self.chat.stop_pattern,)
            self.eos_ends_episode = tokenizer.eos_token not in self.chat.turn_ends

    def reset(self, task: dict) -> str:
        self.task, self.turns, self.calls, self.failures, self.format_errors = task, 0, 0, 0, 0
        self.runner.infra_failures = 0
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
        rng = None  # react text has no call ids
        if self.chat is not None:  # call ids, the form Mistral demands, reproducible for a task and turn
            rng = random.Random(f"{self.task['question']}\x00{self.turns}")
            for call in calls:
                call.id = call.id or new_call_id(rng)
        # A chat turn that ends in EOS (not the turn-end marker) ends the episode: score it as the last turn.
        last = self.turns >= self.max_turns or (self.chat is not None and self.chat.ended_with_eos(action))
        if (calls or errors) and (not last or self.run_last_turn_calls):
            results = self._run_calls(calls, errors, rng)
            if not last:
                return StepResult(self._observation(action, calls, results), 0.0, False, self._info(False))
        answer = self._answer(action) if not (calls or errors) else None
        if self.chat is not None:
            self.chat.messages.append(self._assistant_message(action, calls))
        correct = answer is not None and bool(self.check(self.task, answer))
        r = self.rewards
        if self.calls:
            bad_calls = self.failures + self.format_errors
            reward = (r.correct if correct else r.tool_but_wrong) + r.recovered_bad_call * bad_calls
        else:
            reward = r.malformed_call if self.failures or self.format_errors else r.no_tool
        return StepResult(None, reward, True, self._info(correct, answer))

    def _run_calls(self, calls: list[ToolCall], errors: list[str], rng: random.Random | None) -> list[tuple]:
        """Run a turn's calls and count them: (text, call id, tool name) for each malformed call (the model reads
        why) and each call, in that order."""
        results = [(f"Error: {problem}", new_call_id(rng) if rng else None, None) for problem in errors]
        for call in calls:
            text, ok = self.runner(call)
            self.calls += ok
            self.failures += not ok
            results.append((text, call.id, call.name))
        self.format_errors += len(errors)
        return results

    def _observation(self, action: str, calls: list[ToolCall], results: list[tuple]) -> str:
        """What the environment appends after the turn: `Observation:` lines, or the template's tool turn."""
        if self.format == "react":
            return "".join(f"Observation: {text}\n" for text, _, _ in results)
        tool_messages = [{"role": "tool", "tool_call_id": call_id, **({"name": name} if name else {}),
                          "content": text} for text, call_id, name in results]
        return self.chat.tool_turn(action, self._assistant_message(action, calls), tool_messages)

    def _assistant_message(self, action: str, calls: list[ToolCall]) -> dict:
        """The turn as an OpenAI-style message: content (reasoning and text outside the calls, or the whole
        turn when no call parsed) and structured `tool_calls` with ids, so any template can render it."""
        text = self.chat.content(action)
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": TOOL_PARSERS[self.tool_parser].content(text),
                "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in calls]}

    def _parse(self, action: str) -> tuple[list[ToolCall], list[str]]:
        if self.format == "chat":
            return TOOL_PARSERS[self.tool_parser].parse(self.chat.content(action))
        return self._parse_react(action)

    def _parse_react(self, action: str) -> tuple[list[ToolCall], list[str]]:
        """The first `Action: name(arguments)` line: arguments a JSON object, or the raw text for a one-parameter
        tool. A subclass with a stricter grammar overrides this (CalculatorEnv)."""
        match = _REACT_ACTION.search(action)
        if match is None:
            return ([], ["expected Action: name(arguments)"]) if re.search(r"^\s*Action:", action, re.M) else ([], [])
        parsed = self.runner.parse_react(f"{match.group(1)}({match.group(2)})")
        return ([parsed], []) if isinstance(parsed, ToolCall) else ([], [parsed])

    def _answer(self, action: str) -> str | None:
        if self.format == "react":
            match = re.search(r"^[ \t]*Answer:[ \t]*(.*)$", action, re.MULTILINE)
            return match.group(1).strip() if match else None
        # Thinking models: the answer is what follows the reasoning block.
        return self.chat.content(action).rsplit("</think>", 1)[-1].strip() or None

    def _info(self, correct: bool, answer: Any = None) -> dict:
        info = {"correct": correct, "answer": answer, "tool_calls": self.calls, "tool_failures": self.failures,
                "malformed_calls": self.format_errors, "format_errors": self.format_errors + self.failures}
        if self.runner.infra_failures:  # a tool server was down: not the policy's doing (envs/base.py)
            info["infra_failure"] = True
        return info
