"""Calls with a deadline on reused daemon threads: the tool runner's (envs/tools.py) and the environments' own
reset and step (envs/base.py)."""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any


class CallThreads:
    """Daemon threads that run tool (or environment) calls, one call per thread at a time, reused once a call returns.

    Python cannot kill a thread, so a call that overruns its timeout keeps its thread and is abandoned: the
    next call takes another idle thread or starts a new one, and hung calls never starve later ones (a fixed
    pool would, once every worker hangs). Daemon threads, unlike concurrent.futures' workers (joined at
    exit), never keep the process alive after the run ends or on SIGTERM/SIGINT, whatever a tool is doing.
    """

    # Far more threads than calls ever run at once (engine.STEP_WORKERS steps at a time): most hold hung calls.
    WARN_AT = 256

    def __init__(self, what: str = "tool", advice: str = "for a tool that hangs, ToolEnv(isolation='process') kills "
                                                             "each call at its deadline"):
        self._idle: list[queue.SimpleQueue] = []  # inboxes of threads waiting for a call
        self._lock = threading.Lock()
        self._started = 0
        self._what, self._advice = what, advice

    def run(self, fn: Callable, kwargs: dict, timeout: float | None) -> tuple[str, Any]:
        """("ok", result), ("raised", exception) or ("timeout", None)."""
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            started = self._started = self._started + (inbox is None)
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=f"agentrl-{self._what}", daemon=True).start()
            if started == self.WARN_AT:
                warnings.warn(f"{self.WARN_AT} {self._what} threads started: calls that overran their timeout are "
                              f"still running (a Python thread cannot be stopped); {self._advice}", stacklevel=3)
        inbox.put((fn, kwargs, outbox))
        try:
            return outbox.get(timeout=timeout)
        except queue.Empty:
            return "timeout", None

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            fn, kwargs, outbox = inbox.get()
            try:
                outcome = ("ok", fn(**kwargs))
            except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt too: a failed call
                outcome = ("raised", e)
            outbox.put(outcome)  # after a timeout nobody reads it; the thread is free again all the same
            del fn, kwargs, outbox, outcome  # an idle thread keeps no result (or traceback) alive
            with self._lock:
                self._idle.append(inbox)
