"""A single thread that runs submitted calls one after another (the push writer).

Lighter than a one-worker ``ThreadPoolExecutor`` on the push path: no future per call,
a C queue, and nothing on the caller's side but a ``put`` and a count (the writer
hand-off sits on the critical path of every push it posts). Calls run in submission
order, which keeps a request's streamed writes ahead of its final one; :attr:`idle`
tells the agent whether a write posted elsewhere could overtake a queued one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["SerialWorker"]

log = logging.getLogger("kvxfer.agent")


class SerialWorker:
    """Runs ``submit``-ted calls in order on one daemon thread, started by
    :meth:`start` or on first use.

    Exceptions are logged (the calls report their own failures on their transfers);
    after :meth:`shutdown` the calls still queued are dropped, not run.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pending = 0  # submitted and not finished (the running call included)

    def start(self) -> bool:
        """Start the thread now rather than at the first call (idempotent). Returns
        False once shut down."""
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            return True

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)``; ignored once shut down."""
        if self._thread is None and not self.start():
            return
        with self._lock:
            self._pending += 1
        self._queue.put((fn, args))

    @property
    def idle(self) -> bool:
        """True when no submitted call is queued or running."""
        return self._pending == 0

    def shutdown(self) -> None:
        """Stop after the call in progress; queued calls are dropped. Idempotent."""
        with self._lock:
            self._closed = True
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._closed:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # a writer thread never dies silently
                log.exception("kvxfer %s", self._name)
            finally:
                with self._lock:
                    self._pending -= 1
