"""The bench's child processes: named, spawned, driven over pipes.

Both runners (the plain matrix's :mod:`.runner` and the TP cases' :mod:`.tp_runner`)
keep their worker processes here. A child answers every command with ``("ok",
value)`` or ``("error", text)``; a child that dies or stops answering raises
:class:`BenchError` with ``dead`` set, so the runner restarts its processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["BenchError", "Children", "serve_commands"]


class BenchError(RuntimeError):
    """A bench process failed a command (alive) or died (``dead``)."""

    def __init__(self, message: str, *, dead: bool = False) -> None:
        super().__init__(message)
        self.dead = dead


class Children:
    """Named child processes of one runner.

    Args:
        timeout_s: How long a command may take before its process counts as hung.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._procs: dict[str, Any] = {}
        self._conns: dict[str, Connection] = {}

    def start(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Spawn ``target(pipe_end, *args)`` as ``name`` (it says "ok" when ready:
        :meth:`recv` that before the first command)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=target, args=(child, *args), name=f"kvxfer-bench-{name}", daemon=True
        )
        proc.start()
        child.close()
        self._procs[name], self._conns[name] = proc, parent

    def alive(self, name: str) -> bool:
        """Whether ``name`` was started and still runs."""
        proc = self._procs.get(name)
        return proc is not None and bool(proc.is_alive())

    def send(self, name: str, cmd: str, payload: Any = None) -> None:
        """Send a command without waiting for its answer (see :meth:`recv`)."""
        try:
            self._conns[name].send((cmd, payload))
        except OSError as exc:
            raise BenchError(f"the {name} process is gone: {exc}", dead=True) from None

    def recv(self, name: str, timeout: float | None = None) -> Any:
        """The answer to ``name``'s last command."""
        conn = self._conns[name]
        limit = self.timeout_s if timeout is None else timeout
        if not conn.poll(limit):
            raise BenchError(f"the {name} process did not answer within {limit:g}s", dead=True)
        try:
            status, value = conn.recv()
        except (EOFError, OSError):
            code = self._procs[name].exitcode
            raise BenchError(f"the {name} process exited (status {code})", dead=True) from None
        if status != "ok":
            raise BenchError(f"{name}: {value}")
        return value

    def call(self, name: str, cmd: str, payload: Any = None) -> Any:
        """Send a command and return its answer."""
        self.send(name, cmd, payload)
        return self.recv(name)

    def close(self) -> None:
        """Ask every process to stop, kill those that do not, forget them all."""
        for conn in self._conns.values():
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        for proc in self._procs.values():
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns.values():
            conn.close()
        self._procs, self._conns = {}, {}


Handler = Callable[[Any], Any]


def serve_commands(
    conn: Connection,
    handler_for: Callable[[str], Handler | None],
    before: Callable[[str, Any], Any] | None = None,
) -> None:
    """A child's side of :class:`Children`: say it is ready, then answer each command
    with its handler's value (``("ok", value)``) or the error (``("error", text)``)
    until "stop" or the parent goes away. ``before(cmd, payload)`` runs first and
    returns the payload the handler gets (a conversion, a pause of a poller)."""
    conn.send(("ok", "ready"))
    while True:
        try:
            cmd, payload = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            return
        handler = handler_for(cmd)
        try:
            if handler is None:
                raise ValueError(f"unknown bench command {cmd!r}")
            if before is not None:
                payload = before(cmd, payload)
            conn.send(("ok", handler(payload)))
        except Exception as exc:
            detail = traceback.format_exc(limit=4)
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{detail}"))
