"""The entry point of a ``kvxfer bench --tp`` process: one TP rank's
:class:`~kvxfer.tools.bench.tp_worker.TPRankProc` and its push commands
(:class:`~kvxfer.tools.bench.tp_push.TPPushCommands`), served to the parent."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

from kvxfer.tools.bench.procs import serve_commands
from kvxfer.tools.bench.raw_nixl import RawNixl
from kvxfer.tools.bench.tp_push import TPPushCommands
from kvxfer.tools.bench.tp_worker import TPRankProc

__all__ = ["tp_worker_main"]

#: Commands on kvxfer's side of a rep: raw NIXL's poller pauses from one of them to
#: this process's next other command (see RawNixl.pause).
_KVXFER_TURN = frozenset({"hold", "pull", "expect_push"})


def tp_worker_main(conn: Connection) -> None:
    """Entry point of a TP bench process (``multiprocessing`` spawn target)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        raw = RawNixl(f"bench-tp-raw-{os.getpid()}")
        proc = TPRankProc(conn, raw)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return

    def before(cmd: str, payload: Any) -> Any:
        if cmd in _KVXFER_TURN:
            raw.pause()
        else:
            raw.resume()
        return payload

    try:
        push = TPPushCommands(proc)

        def command(cmd: str) -> Any:
            return getattr(proc, f"cmd_{cmd}", None) or getattr(push, f"cmd_{cmd}", None)

        serve_commands(conn, command, before)
    finally:
        try:
            proc.close()
        finally:
            raw.close()
