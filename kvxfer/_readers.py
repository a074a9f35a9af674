"""Counting the consumer ranks that read one request from a producer rank.

Across tensor-parallel sizes several decode ranks may read the same producer rank
(prefill TP1 → decode TP2: both decode ranks read rank 0's blocks, each its heads).
The producer may reuse the blocks only once every one of them is finished: each
reader's DONE notice or Release says how many readers there are (``readers``) and
which one it is (``reader``), and :class:`ReaderCount` answers True only for the
one that completes the set. Duplicates (a notice delivered twice, a Release retried)
count once. A request whose readers never all report is forgotten after
``forget_s`` (its lease expires meanwhile).
"""

from __future__ import annotations

import threading
import time

__all__ = ["ReaderCount"]


class ReaderCount:
    """Readers heard from, per request (internal; thread-safe).

    Args:
        forget_s: Drop a request's partial count this long after its first report.
    """

    def __init__(self, forget_s: float = 600.0) -> None:
        self._forget_s = forget_s
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, set[int]]] = {}

    def last(self, request_id: str, readers: int, reader: int) -> bool:
        """Record ``reader`` of ``readers`` for ``request_id``; True when every reader
        has now reported (always True for a single reader)."""
        if readers <= 1:
            return True
        now = time.monotonic()
        with self._lock:
            if len(self._seen) > 64:
                old = [k for k, (t, _) in self._seen.items() if now - t > self._forget_s]
                for k in old:
                    del self._seen[k]
            _, seen = self._seen.setdefault(request_id, (now, set()))
            seen.add(reader)
            if len(seen) < readers:
                return False
            del self._seen[request_id]
            return True
