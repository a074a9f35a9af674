"""The consumer's side of a push: receptions awaiting the producer's PUSHED notices.

A consumer's :meth:`~kvxfer.agent.Agent.expect_push` registers its receiving blocks
with the producer and expects the request here. Each write's PUSHED notice names the
blocks it covered; a reception is complete once the final notice came and the writes
cover every expected block (R-XFER-2). The usual push, one final write of every
block, settles on one notice, which the producer announced in its registration reply
so that it is recognised by its bytes instead of decoded and authenticated again.

Every method but :meth:`Receptions.learn_final_notice` runs under the agent lock.
"""

from __future__ import annotations

import logging
import threading
import time

from kvxfer._agent.local import LocalEnd
from kvxfer.core import wire
from kvxfer.errors import KvxferError
from kvxfer.transfer import ReceptionState, Transfer

__all__ = ["NOTICE_REUSE_S", "Receptions"]

log = logging.getLogger("kvxfer.agent")

#: A signed notice encoded ahead is used only this long after (the receiver refuses
#: notices whose timestamp is far from its clock).
NOTICE_REUSE_S = 60.0


class Receptions:
    """Push receptions by request id, and the final notices announced for them.

    Args:
        local: The agent's identity (its shared secret checks the notices).
        lock: The agent lock.

    Attributes:
        expected: Receptions awaiting their PUSHED notices, by request id and the
            producer rank they await (``Notice.source``; 0 unless TP sizes differ).
        final_notices: Final PUSHED notices announced in the producers' registration
            replies, already checked, by their exact bytes: the notice and the
            monotonic time it is known until.
    """

    def __init__(self, local: LocalEnd, lock: threading.RLock) -> None:
        self._local = local
        self._lock = lock
        self.expected: dict[tuple[str, int], Transfer] = {}
        self.final_notices: dict[bytes, tuple[wire.Notice, float]] = {}

    def expect(self, transfer: Transfer) -> None:
        """``transfer`` settles once its producer's PUSHED notices cover its blocks
        (those of producer rank ``ReceptionState.source``)."""
        with self._lock:
            self.expected[(transfer.request_id, _state(transfer).source)] = transfer

    def unexpect(self, request_id: str, source: int = 0) -> Transfer | None:
        """Stop awaiting pushes for ``request_id`` from producer rank ``source``;
        returns the reception if any."""
        with self._lock:
            return self.expected.pop((request_id, source), None)

    def drop(self, transfer: Transfer) -> None:
        """``transfer`` settled: no longer awaited (if it still was)."""
        reception = transfer.meta.reception
        if reception is None:  # not a reception: never awaited here
            return
        with self._lock:
            key = (transfer.request_id, reception.source)
            if self.expected.get(key) is transfer:
                del self.expected[key]

    def of(self, notice: wire.Notice) -> Transfer | None:
        """The reception a PUSHED/FAILED notice is about, if awaited."""
        return self.expected.get((notice.request_id, notice.source))

    def forget(self, transfer: Transfer) -> None:
        """``transfer`` settled: its announced notice is of no use any more."""
        reception = transfer.meta.reception  # None: not a reception
        if reception is not None and reception.notice_bytes is not None:
            self.final_notices.pop(reception.notice_bytes, None)
            reception.notice_bytes = None

    def learn_final_notice(self, transfer: Transfer, data: bytes) -> None:
        """Remember the final PUSHED notice a producer announced for ``transfer``.

        It is checked here as if it had arrived (decoded, its MAC verified), and must be
        the one notice that settles the transfer alone: final, for this request, naming
        every expected block. When it arrives, :meth:`announced` knows it by its bytes.
        A notice that does not qualify is ignored: the real one is then decoded and
        checked on arrival, as any other.
        """
        try:
            notice = wire.decode_notice(
                data,
                max_bytes=self._local.config.max_message_bytes,
                auth_key=self._local.auth_key,
            )
        except KvxferError as exc:
            log.debug("producer's announced notice for %s not used: %s", transfer.request_id, exc)
            return
        if not (
            notice.kind is wire.NoticeKind.PUSHED
            and notice.final
            and notice.request_id == transfer.request_id
            and notice.block_ids == transfer.local_blocks
        ):
            return
        with self._lock:
            # Arrived (or failed) meanwhile: nothing left to recognise.
            reception = _state(transfer)
            key = (transfer.request_id, reception.source)
            if transfer.done or self.expected.get(key) is not transfer:
                return
            # A producer sends the announced bytes only this long after encoding them
            # (later it signs a fresh notice), so later they are not recognised either.
            self.final_notices[data] = (notice, time.monotonic() + NOTICE_REUSE_S)
            reception.notice_bytes = data

    def announced(self, payload: bytes) -> wire.Notice | None:
        """The notice ``payload`` is, if it is an announced one still fresh (a late one
        is decoded and verified like any other: clock skew)."""
        if not self.final_notices:
            return None
        known = self.final_notices.pop(payload, None)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        return None

    def pushed(self, notice: wire.Notice) -> Transfer | None:
        """Record one PUSHED notice; returns the reception once every write landed."""
        key = (notice.request_id, notice.source)
        t = self.expected.get(key)
        if t is None:
            log.warning("write notice for unknown request %s", notice.request_id)
            return None
        state = _state(t)
        if notice.final and state.covered is None and notice.block_ids == t.local_blocks:
            # the usual push: one final write of every expected block
            self.expected.pop(key, None)
            state.stage_in = True
            return t
        # Settle only when the final notice arrived and the writes announced so far
        # cover every expected block of every group: no gaps (R-XFER-2).
        if state.covered is None:
            state.covered = [set() for _ in t.local_blocks]
        for group, ids in zip(state.covered, notice.block_ids):
            group.update(ids)
        if notice.final:
            state.final = True
        complete = all(set(want) <= got for want, got in zip(t.local_blocks, state.covered))
        if state.final and complete:
            # every write of the request has landed: no gaps (R-XFER-2)
            self.expected.pop(key, None)
            state.stage_in = True
            return t
        return None


def _state(transfer: Transfer) -> ReceptionState:
    """The reception's own state (every transfer this table holds is a reception)."""
    reception = transfer.meta.reception
    assert reception is not None, f"{transfer} is not a push reception"
    return reception
