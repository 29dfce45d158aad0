"""Any MCP server's tools as the tools of a ToolEnv (`pip install agentrl[ecosystems]`).

    env:
      name: agentrl.envs.ecosystems.mcp_tools:MCPToolEnv
      kwargs:
        server: {command: python, args: [-m, agentrl.envs.ecosystems.mcp_calculator_server]}   # or {url: http://...}
        check: agentrl.envs.calculator:numeric_match
        format: chat

The rollout is synchronous and threaded; the MCP client is asyncio. So each process keeps one asyncio loop on a
daemon thread and, per server, one session owned by one task on it (the SDK's transports must be entered and
left in the same task). Tool calls from any thread are coroutines submitted to that loop, waited for with a
timeout. The tool schemas come from `list_tools` once per process and become the ToolEnv's schemas (chat: the
template's `tools=`; ReAct: a tool list in the prompt).

Every failure is an observation, never an exception into the training loop: an unknown tool and arguments
that do not fit the schema are caught before the call (ToolRunner); a tool error is the server's message; a hang
is the runner's timeout; a server that died or closed the connection is reported and restarted (a URL:
reconnected) on the next call. Servers started here (stdio) are stopped at exit (atexit), and on Linux get
PR_SET_PDEATHSIG, so they are killed when this process dies without running atexit (SIGKILL, an unhandled
SIGTERM).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Callable

from agentrl.envs.base import load_object
from agentrl.envs.tools import Tool, ToolEnv, ToolFailure

try:
    BaseExceptionGroup  # noqa: B018 - a builtin from Python 3.11
except NameError:  # Python 3.10: the backport, which anyio (under mcp) installs there
    from exceptiongroup import BaseExceptionGroup
from agentrl.errors import UserError

# Runs the server's command with PR_SET_PDEATHSIG(SIGKILL): the kernel kills it when the thread that started it
# (the loop thread, which lives as long as this process) ends. argv: parent pid, command, args. A server whose
# parent already died before prctl exits at once.
_PDEATHSIG_EXEC = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL); "
                   "os.getppid() != int(sys.argv[1]) and os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")
_SERVER_KEYS = {"command", "args", "env", "cwd", "url", "headers", "startup_timeout"}


class MCPServerError(UserError):
    """A server that cannot be started or listed: at environment construction, so the job reports the config
    (`agentrl: error: env.kwargs.server: ...`, one line)."""


class _Loop:
    """One asyncio event loop on a daemon thread, for every MCP session of this process."""

    def __init__(self):
        self.loop, self.pid = asyncio.new_event_loop(), os.getpid()
        threading.Thread(target=self.loop.run_forever, name="agentrl-mcp", daemon=True).start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_LOOP: _Loop | None = None
_LOOP_LOCK = threading.Lock()


def _loop() -> _Loop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.pid != os.getpid():  # a forked child has no loop thread: start its own
            _LOOP = _Loop()
        return _LOOP


def _describe(spec: dict) -> str:
    return spec.get("url") or " ".join([spec["command"], *spec.get("args", [])])


def check_server_spec(server: dict) -> dict:
    """The server section, checked: `command` (+ `args`, `env`, `cwd`) to start one over stdio, or `url`
    (+ `headers`) for streamable HTTP; `startup_timeout` seconds to connect and list tools (default 60)."""
    if not isinstance(server, dict):
        raise ValueError(f"server must be a mapping with 'command' or 'url', got {type(server).__name__}")
    unknown = sorted(set(server) - _SERVER_KEYS)
    if unknown:
        raise ValueError(f"server: unknown key {unknown[0]!r} (expected {', '.join(sorted(_SERVER_KEYS))})")
    if ("command" in server) == ("url" in server):
        raise ValueError("server needs exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
    if "command" in server and not (isinstance(server["command"], str) and server["command"]):
        raise ValueError(f"server.command must be a non-empty string, got {server['command']!r}")
    if not isinstance(server.get("args", []), list) or not all(isinstance(a, str) for a in server.get("args", [])):
        raise ValueError(f"server.args must be a list of strings, got {server.get('args')!r}")
    return server


class MCPConnection:
    """One server, one session: a task on the shared loop enters the transport and the session, lists the
    tools, then waits to be told to stop and leaves both (in that same task)."""

    # Calls timing out in a row before the server is restarted: a hung synchronous tool keeps one of the server's
    # worker threads (anyio lends 40), so a server whose tool keeps hanging would end up answering nothing.
    RESTART_AFTER_TIMEOUTS = 4

    def __init__(self, spec: dict):
        self.spec, self.label, self.pid = spec, _describe(spec), os.getpid()
        self.session = None
        self.schemas: list[dict] = []
        self.closed_reason: str | None = None  # set once the server or the connection is gone
        self.ready: concurrent.futures.Future = concurrent.futures.Future()  # True once tools are listed
        self.ended = threading.Event()  # the task has left the session and the transport (server stopped)
        self._stop: asyncio.Event | None = None
        self._task: concurrent.futures.Future | None = None
        self._timeouts = 0  # calls that timed out since the last answer

    def begin(self) -> None:
        """Start connecting on the loop (not waiting); given up, and the server stopped, after startup_timeout."""
        loop = _loop()
        with _LIVE_LOCK:
            _LIVE.add(self)
        self._task = loop.submit(self._own())
        timeout = float(self.spec.get("startup_timeout", 60))
        loop.loop.call_soon_threadsafe(loop.loop.call_later, timeout, self._give_up, timeout)

    def start(self) -> None:
        """Connect and list the tools; MCPServerError naming the server if that fails."""
        self.begin()
        try:
            self.ready.result()  # bounded: _give_up ends the attempt after startup_timeout
        except Exception as e:  # noqa: BLE001 - whatever the transport raised, named with the server
            self.close()
            raise MCPServerError(f"env.kwargs.server: MCP server {self.label!r} could not be started or listed: "
                                 f"{self.closed_reason or _error_text(e)}") from None

    def _give_up(self, timeout: float) -> None:
        if not self.ready.done():
            self.closed_reason = f"no answer to initialize/list_tools within {timeout:g} s (server.startup_timeout)"
            self._task.cancel()

    def _transport(self):
        if "url" in self.spec:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            return streamable_http_client(self.spec["url"], http_client=create_mcp_http_client(
                headers=self.spec.get("headers")))
        from mcp.client.stdio import StdioServerParameters, stdio_client

        command, args = self.spec["command"], list(self.spec.get("args", []))
        if command in ("python", "python3"):  # this run's interpreter, so the server sees the same packages
            command = sys.executable
        if shutil.which(command) is None:  # said here: behind the launcher it would read as "connection closed"
            raise FileNotFoundError(f"command {command!r} not found (not on PATH, or not executable)")
        if sys.platform.startswith("linux"):
            command, args = sys.executable, ["-c", _PDEATHSIG_EXEC, str(os.getpid()), command, *args]
        env = {str(k): str(v) for k, v in (self.spec.get("env") or {}).items()}
        return stdio_client(StdioServerParameters(command=command, args=args, env=env or None,
                                                  cwd=self.spec.get("cwd")))

    async def _own(self) -> None:
        from mcp.client.session import ClientSession
        from mcp.types import PaginatedRequestParams

        self._stop = asyncio.Event()
        try:
            async with self._transport() as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                tools, cursor = [], None
                while True:  # every page of the listing
                    page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self.schemas = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                                  "parameters": t.input_schema}} for t in tools]
                self.session = session
                self.ready.set_result(True)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to start() or to the next call, never raised here
            self.closed_reason = self.closed_reason or (
                "the server closed the connection (it exited or crashed; its stderr is this run's)"
                if _connection_closed(e) else f"connection ended ({_error_text(e)})")
            if not self.ready.done():
                self.ready.set_exception(e if isinstance(e, Exception) else RuntimeError(self.closed_reason))
            if not isinstance(e, Exception):  # cancelled, or the interpreter is going down
                raise
        finally:
            self.closed_reason = self.closed_reason or "connection closed"
            self.session = None
            with _LIVE_LOCK:
                _LIVE.discard(self)
            self.ended.set()

    def call(self, name: str, arguments: dict, timeout: float) -> str:
        """The tool's text; ToolFailure with the observation when the tool or the server fails."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        deadline = time.monotonic() + timeout
        try:
            self.ready.result(timeout)  # a server being (re)started
        except concurrent.futures.TimeoutError:
            raise ToolFailure(f"{name}: the MCP server is still starting", infra=True) from None
        except Exception:  # noqa: BLE001 - its failure is in closed_reason
            pass
        session = self.session
        if session is None:
            raise ToolFailure(f"{name}: the MCP server is not connected ({self.closed_reason})", infra=True)
        left = max(deadline - time.monotonic(), 0.01)
        future = _loop().submit(session.call_tool(name, arguments, read_timeout_seconds=left))
        try:
            result = future.result(left + 1.0)  # the SDK's own timeout answers first (the runner's before both)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise self._timed_out(name, timeout) from None
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                raise self._timed_out(name, timeout) from None
            if e.code == CONNECTION_CLOSED:
                self.closed_reason = self.closed_reason or "the server closed the connection (it exited or crashed)"
                raise ToolFailure(f"{name}: the MCP server closed the connection (it exited or crashed); it is "
                                  f"restarted for the next call", infra=True) from None
            raise ToolFailure(f"{name}: MCP error {e.code}: {e.error.message}") from None
        except Exception as e:  # noqa: BLE001 - a transport failure is the model's observation too
            self.closed_reason = self.closed_reason or f"the call failed ({_error_text(e)})"  # reconnect next time
            raise ToolFailure(f"{name}: MCP call failed: {_error_text(e)}", infra=True) from None
        self._timeouts = 0
        text = _result_text(result)
        if result.is_error:
            # The SDK prefixes a tool's own message with "Error executing tool <name>: " and sends only
            # "Error executing tool <name>" for an unexpected exception (its text stays on the server).
            prefix = f"Error executing tool {name}"
            if text == prefix:
                raise ToolFailure(f"{name} failed on the server (an unexpected exception; its message is in "
                                  f"the server's log)")
            raise ToolFailure(text.removeprefix(prefix + ": "))
        return text

    def _timed_out(self, name: str, timeout: float) -> ToolFailure:
        self._timeouts += 1
        if self._timeouts >= self.RESTART_AFTER_TIMEOUTS:
            self.closed_reason = self.closed_reason or f"{self._timeouts} calls in a row timed out"
        return ToolFailure(f"{name} timed out after {timeout:g} s")

    def close(self, timeout: float = 10.0) -> None:
        """Leave the session and the transport (stdio: the server is asked to exit, then killed)."""
        task = self._task
        if task is None:
            return
        self.closed_reason = self.closed_reason or "closed"
        if self.session is not None and self._stop is not None:
            _loop().loop.call_soon_threadsafe(self._stop.set)  # leave both contexts in the owning task
        else:
            task.cancel()  # still starting: cancelling the task stops the server it spawned
        deadline = time.monotonic() + timeout
        while not self.ended.wait(0.05) and time.monotonic() < deadline:
            if self._stop is None and task.done():  # cancelled before it ran: nothing was spawned
                break


_LIVE: set[MCPConnection] = set()  # connections whose task has not ended: what close_servers() stops
_LIVE_LOCK = threading.Lock()


def _connection_closed(e: BaseException) -> bool:
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED

    if isinstance(e, BaseExceptionGroup):
        return any(_connection_closed(x) for x in e.exceptions)
    return isinstance(e, MCPError) and e.code == CONNECTION_CLOSED


def _error_text(e: BaseException) -> str:
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_error_text(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _result_text(result) -> str:
    """A CallToolResult as text: its text blocks joined; other blocks named; structured content as JSON
    when the server sent no text."""
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:  # an image, audio or a resource: the model reads what it was, not its bytes
            what = getattr(block, "mime_type", None) or getattr(block, "uri", None)
            parts.append(f"[{getattr(block, 'type', 'content')}{f' {what}' if what else ''}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


class MCPClient:
    """A server for this process: its connection (restarted after it died), its tool schemas, its calls."""

    RESTART_INTERVAL = 2.0  # seconds between restart attempts of a server that keeps failing

    def __init__(self, spec: dict):
        self.spec, self.label = spec, _describe(spec)
        self._lock = threading.Lock()
        self.restarts, self.closed, self._last_restart = 0, False, 0.0
        self.connection = MCPConnection(spec)
        self.connection.start()
        self.schemas = self.connection.schemas  # fixed for the run: the prompt must not change mid-run

    def call(self, name: str, arguments: dict, timeout: float) -> str:
        connection = self.connection
        if connection.closed_reason is not None:
            connection = self._restart(connection, name)
        return connection.call(name, arguments, timeout)

    def _restart(self, dead: MCPConnection, name: str) -> MCPConnection:
        """A fresh connection in place of `dead`, begun here (the call waits for it within its timeout)."""
        with self._lock:
            if self.closed:
                raise ToolFailure(f"{name}: the MCP server was closed", infra=True)
            if self.connection is not dead:  # another thread restarted it already
                return self.connection
            if time.monotonic() - self._last_restart < self.RESTART_INTERVAL:
                raise ToolFailure(f"{name}: the MCP server is down ({dead.closed_reason}); restarting it", infra=True)
            self._last_restart = time.monotonic()
            self.restarts += 1
            warnings.warn(f"MCP server {self.label!r}: {dead.closed_reason}; restarting it "
                          f"(restart {self.restarts})", stacklevel=3)
            threading.Thread(target=dead.close, daemon=True).start()  # not on the call's clock
            self.connection = MCPConnection(self.spec)
            self.connection.begin()
            return self.connection

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self.connection.close()


_CLIENTS: dict[tuple, MCPClient] = {}
_CLIENTS_LOCK = threading.Lock()


def mcp_client(server: dict) -> MCPClient:
    """This process's client of `server` (started on first use; one session per process per server)."""
    spec = check_server_spec(server)
    key = (os.getpid(), json.dumps(spec, sort_keys=True, default=str))
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = MCPClient(spec)
        return _CLIENTS[key]


def close_servers() -> None:
    """Stop every server this process started and leave every session, those still starting too (run at exit)."""
    with _CLIENTS_LOCK:
        for key in [k for k in _CLIENTS if k[0] == os.getpid()]:
            _CLIENTS.pop(key).close()
    with _LIVE_LOCK:
        live = [c for c in _LIVE if c.pid == os.getpid()]  # a forked child's copies belong to its parent
    for connection in live:
        connection.close()


atexit.register(close_servers)


class MCPToolEnv(ToolEnv):
    """A ToolEnv whose tools are an MCP server's (all of them, or `allowed_tools`).

    server: `{command, args, env, cwd}` to start one over stdio (`command: python` is this run's interpreter),
        or `{url, headers}` for one already running (streamable HTTP); `startup_timeout` seconds to list tools.
    check: `"module:function"` (or the function) deciding whether `(task, answer_text)` is correct.
    react_tool_list: ReAct format only: put "Tools:" and one `name(arguments): description` line per tool
        before the question (a model must be told which tools exist).
    The rest are ToolEnv's options (format, max_turns, timeout, max_observation_chars, rewards, ...). Process
    isolation is not offered: the call runs on the server, and this process only waits for it.
    """

    def __init__(self, server: dict, check: str | Callable[[dict, str], bool], format: str = "chat",
                 allowed_tools: list[str] | None = None, react_tool_list: bool = True, timeout: float = 5.0,
                 **tool_env_options: Any):
        if "isolation" in tool_env_options:
            raise ValueError("MCPToolEnv runs tools on the MCP server; isolation does not apply (remove it)")
        client = mcp_client(server)
        schemas = client.schemas
        if allowed_tools is not None:
            served = {s["function"]["name"] for s in schemas}
            missing = [name for name in allowed_tools if name not in served]
            if missing:
                raise ValueError(f"allowed_tools: {missing[0]!r} is not served by {client.label!r} "
                                 f"(it serves {', '.join(sorted(served)) or 'no tools'})")
            schemas = [s for s in schemas if s["function"]["name"] in allowed_tools]
        tools = [Tool(schema, _caller(client, schema["function"]["name"], timeout)) for schema in schemas]
        check_fn = load_object(check) if isinstance(check, str) else check
        super().__init__(tools, check=check_fn, format=format, timeout=timeout, **tool_env_options)
        self.react_tool_list = react_tool_list

    def reset(self, task: dict) -> str:
        prompt = super().reset(task)
        if self.format == "react" and self.react_tool_list:
            lines = []
            for schema in self.schemas:
                fn = schema["function"]
                line = f"{fn['name']}({', '.join(fn.get('parameters', {}).get('properties', {}))})"
                lines.append(f"{line}: {fn['description']}\n" if fn.get("description") else line + "\n")
            prompt = "Tools:\n" + "".join(lines) + prompt
        return prompt


def _caller(client: MCPClient, name: str, timeout: float) -> Callable[..., str]:
    def call(**arguments):
        return client.call(name, arguments, timeout)

    call.__name__ = name
    return call
