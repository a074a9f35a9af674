"""Counting the consumer ranks that read one request from a producer rank.

Across tensor-parallel sizes several decode ranks may read the same producer rank
(prefill TP1 → decode TP2: both decode ranks read rank 0's blocks, each its heads).
The producer may reuse the blocks only once every one of them is finished: each
reader's DONE notice or Release says how many readers there are (``readers``) and
which one it is (``reader``), and :class:`ReaderCount` answers True only for the
one that completes the set. Duplicates (a notice delivered twice, a Release retried)
count once. A request whose readers never all report is forgotten after
``forget_s`` (its lease expires meanwhile).

The network fills this table, so it is bounded (R-SAFE-3): at most ``max_requests``
partial counts (the oldest is dropped first: its hold then ends at lease expiry, never
early), and a report naming more than ``MAX_READERS`` readers, or a reader (a
consumer rank) outside ``[0, MAX_READERS)``, is ignored.
"""

from __future__ import annotations

import threading
import time

__all__ = ["MAX_READERS", "ReaderCount"]

#: The most consumer ranks that can read one producer rank (a TP size bound).
MAX_READERS = 1024


class ReaderCount:
    """Readers heard from, per request (internal; thread-safe).

    Args:
        forget_s: Drop a request's partial count this long after its first report.
        max_requests: The most partial counts kept.
    """

    def __init__(self, forget_s: float = 600.0, max_requests: int = 4096) -> None:
        self._forget_s = forget_s
        self._max = max_requests
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, set[int]]] = {}

    def last(self, request_id: str, readers: int, reader: int) -> bool:
        """Record ``reader`` of ``readers`` for ``request_id``; True when every reader
        has now reported (always True for a single reader)."""
        if readers <= 1:
            return True
        if readers > MAX_READERS or not 0 <= reader < MAX_READERS:
            return False  # not a report any consumer sends: never frees the hold
        now = time.monotonic()
        with self._lock:
            if len(self._seen) > 64:
                old = [k for k, (t, _) in self._seen.items() if now - t > self._forget_s]
                for k in old:
                    del self._seen[k]
            if request_id not in self._seen and len(self._seen) >= self._max:
                del self._seen[next(iter(self._seen))]  # the oldest (insertion order)
            _, seen = self._seen.setdefault(request_id, (now, set()))
            seen.add(reader)
            if len(seen) < readers:
                return False
            del self._seen[request_id]
            return True

    def __len__(self) -> int:
        """Requests with a partial count."""
        with self._lock:
            return len(self._seen)
