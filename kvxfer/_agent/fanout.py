"""One Transfer the engine sees, made of one sub-transfer per producer rank.

A consumer rank whose heads live on several producer ranks (tensor-parallel sizes
that differ, :mod:`kvxfer._agent.tp_pull`) reads one request with one sub-transfer per producer
rank; each is an ordinary runtime transfer (its own handle, deadline, DONE told to
its rank). :class:`Fanout` folds them into the one :class:`~kvxfer.transfer.Transfer`
the engine polls:

* DONE only when every sub-transfer is DONE;
* FAILED once every sub-transfer settled and at least one failed. It waits for the
  others rather than failing at the first error, so that the invalid blocks are
  exact: the union of the blocks the failed ranks write into (their plans'
  ``local_blocks``; every local block when a rank failed before it was planned).
  A block that only ranks which succeeded write into landed whole and is valid;
  a block any failed rank writes into is invalid, even though the heads the other
  ranks wrote into it are correct byte for byte (a block is used whole or not at all).

Nothing hangs: every sub-transfer has the agent's transfer deadline and is failed by
:meth:`Runtime.close <kvxfer._agent.runtime.Runtime.close>`, so the aggregate settles as
soon as its last sub-transfer does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from kvxfer.errors import TransferError
from kvxfer.transfer import FailureKind, Transfer, TransferState, settle

__all__ = ["Fanout"]


class Fanout:
    """Aggregates per-rank sub-transfers into one transfer (internal).

    Args:
        transfer: The transfer the engine sees (not tracked by the runtime).
        subs: The sub-transfer of each producer rank (tracked by the runtime).
        on_failed: Called once, when the aggregate failed, with the ranks whose
            sub-transfer failed (under the agent lock: it must only queue work).
        on_all_settled: Called once, when every sub-transfer settled, before the
            aggregate settles either way (under the agent lock, like ``on_failed``).
    """

    def __init__(
        self,
        transfer: Transfer,
        subs: Mapping[int, Transfer],
        on_failed: Callable[[tuple[int, ...]], None],
        on_all_settled: Callable[[], None] | None = None,
    ) -> None:
        self.transfer = transfer
        self.subs = dict(subs)
        self._on_failed = on_failed
        self._on_all_settled = on_all_settled
        everything = tuple(sorted({b for g in transfer.local_blocks for b in g}))
        # Until a rank is planned, all local blocks are what it would write into.
        self._blocks: dict[int, tuple[int, ...]] = dict.fromkeys(self.subs, everything)
        self._lock = threading.Lock()
        self._settled: dict[int, bool] = {}
        for rank, sub in self.subs.items():
            sub.meta.on_settled = self._callback(rank)
        # The aggregate is doomed as soon as a part is (Transfer.doomed).
        transfer.meta.parts = tuple(self.subs[r] for r in sorted(self.subs))

    def planned(self, rank: int, local_blocks: tuple[tuple[int, ...], ...]) -> None:
        """Rank ``rank`` writes into exactly ``local_blocks`` (its plan's)."""
        with self._lock:
            self._blocks[rank] = tuple(sorted({int(b) for g in local_blocks for b in g}))

    def _callback(self, rank: int) -> Callable[[Transfer, bool], None]:
        def on_settled(_sub: Transfer, ok: bool) -> None:
            self._settle_one(rank, ok)

        return on_settled

    def _settle_one(self, rank: int, ok: bool) -> None:
        with self._lock:
            self._settled[rank] = ok
            if len(self._settled) < len(self.subs):
                return
            failed = tuple(sorted(r for r, good in self._settled.items() if not good))
            invalid = tuple(sorted({b for r in failed for b in self._blocks[r]}))
        if self._on_all_settled is not None:
            self._on_all_settled()
        agg = self.transfer
        stats = agg.stats
        subs = [self.subs[r] for r in sorted(self.subs)]
        stats.bytes = sum(s.stats.bytes for s in subs)
        stats.descriptors = sum(s.stats.descriptors for s in subs)
        stats.plan_s = max(s.stats.plan_s for s in subs)
        stats.post_s = sum(s.stats.post_s for s in subs)
        if not failed:
            settle(agg, TransferState.DONE)
            return
        first = self.subs[failed[0]]
        stats.failure = first.stats.failure or FailureKind.POST
        cause = first.error
        cls = type(cause) if isinstance(cause, TransferError) else TransferError
        error = cls(
            f"transfer {agg.request_id} failed on producer rank(s) {list(failed)} of "
            f"{sorted(self.subs)}: {cause}"
        )
        error.__cause__ = cause
        if settle(agg, TransferState.FAILED, error, invalid=invalid):
            self._on_failed(failed)
