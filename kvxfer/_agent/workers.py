"""The agent's io workers: side-channel round trips off the engine's thread.

A first-contact handshake, a push registration, a Release, a liveness probe: each is a
network round trip that can take a timeout when the peer is gone, so none runs on the
engine's thread. Unlike :class:`concurrent.futures.ThreadPoolExecutor` (whose workers
the interpreter joins at exit), these workers are daemons and :meth:`IoPool.shutdown`
never waits: a request still pending when the agent closes is cancelled by the side
channel client's ``close()`` and never delays the process's exit (R-SAFE-4).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["IoPool"]

log = logging.getLogger("kvxfer.agent")


class IoPool:
    """Up to ``workers`` daemon threads running submitted calls in order of arrival.

    Args:
        workers: The most threads it starts (all at :meth:`start`, else each when a
            call waits for one).
        name: Prefix of the threads' names.
    """

    def __init__(self, workers: int, name: str) -> None:
        self._max = workers
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        # Calls due later (:meth:`later`): (monotonic due time, order, call, args).
        self._due: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._timer_wake = threading.Condition(self._lock)
        self._timer: threading.Thread | None = None

    def start(self) -> None:
        """Start every worker now (idempotent; none after shutdown). A thread's start
        holds the interpreter lock across its creation, which can wait on the
        process's memory map behind other work (issue 25): an agent that serves
        starts its workers then, so that no request's path starts one."""
        with self._lock:
            while not self._closed and len(self._threads) < self._max:
                self._spawn()
                self._idle += 1
            self._start_timer()

    def later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on a worker ``delay_s`` seconds from now (one timer thread
        for all such calls, started with the workers: no thread per call); False
        (and never run) once shut down."""
        with self._lock:
            if self._closed:
                return False
            heapq.heappush(self._due, (time.monotonic() + delay_s, next(self._order), fn, args))
            self._start_timer()
            self._timer_wake.notify()
        return True

    def _start_timer(self) -> None:
        """Under the lock: the timer thread, once."""
        if self._timer is None and not self._closed:
            self._timer = threading.Thread(
                target=self._run_timer, name=f"{self._name}-timer", daemon=True
            )
            self._timer.start()

    def _run_timer(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._due:
                    self._timer_wake.wait()
                    continue
                wait = self._due[0][0] - time.monotonic()
                if wait > 0:
                    self._timer_wake.wait(wait)
                    continue
                _, _, fn, args = heapq.heappop(self._due)
                self._submit_locked(fn, args)

    def _spawn(self) -> None:
        t = threading.Thread(
            target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
        )
        self._threads.append(t)
        t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on a worker; False (and not run) once shut down."""
        with self._lock:
            if self._closed:
                return False
            self._submit_locked(fn, args)
        return True

    def _submit_locked(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._jobs.put((fn, args))
        if self._idle == 0 and len(self._threads) < self._max:
            self._spawn()
        elif self._idle:
            self._idle -= 1  # an idle worker takes it

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:  # a job's failure must never kill the worker
                log.exception("kvxfer io worker")
            with self._lock:
                if self._closed:
                    return
                self._idle += 1

    def shutdown(self) -> None:
        """Drop queued calls and let the workers end; never waits for them."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
            self._due.clear()
            self._timer_wake.notify()
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        for _ in range(threads):
            self._jobs.put(None)
