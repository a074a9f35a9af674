"""Fail-closed pulls: the producer's guard word, read after the data (R-SAFE-1).

A guarded pull (:meth:`GuardReads.arm`) reads its hold's guard word once its data
landed (:meth:`GuardReads.landed`) and settles DONE only if the word still holds the
ticket's generation; a producer that freed the hold meanwhile has overwritten it, and
the pull fails at stage ``lease``. A ticket handed out before its hold came (the vLLM
scheduler's, a step ahead of the worker) reads the word alone, with growing waits,
until the hold came, then data and word again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvxfer._agent.guard import not_held_yet, verdict
from kvxfer._agent.peers import Peer
from kvxfer._agent.settle import Settler
from kvxfer.agent_config import AgentStats
from kvxfer.backend import Backend, XferStatus
from kvxfer.errors import KvxferError, TransferError
from kvxfer.transfer import FailureKind, FailureStage, Transfer

__all__ = ["REREAD_DELAYS_S", "GuardReads", "Later", "expired_error"]

#: ``later(delay_s, fn, transfer)``: run ``fn(transfer)`` after ``delay_s``.
Later = Callable[[float, Callable[[Transfer], None], Transfer], object]

log = logging.getLogger("kvxfer.agent")

#: Waits before reading a guarded pull's guard word again while its hold has not come
#: (see GuardReads._read_again); the last one repeats until the deadline or the lease.
REREAD_DELAYS_S = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1)


def expired_error(request_id: str) -> TransferError:
    """The error of a pull whose lease ran out before its blocks were read."""
    return TransferError(
        f"the producer's lease on {request_id} ran out before its blocks were read; "
        "they may have been reused (raise lease_s, or pull sooner)"
    )


class GuardReads:
    """Reads guarded pulls' guard words and settles the pulls by them (internal).

    Args:
        backend: Posts and polls the 8-byte reads.
        settler: Settles the pulls.
        stats: The agent's counters (guard reads, rereads, failures).
        lock: The agent lock.
        lease_over: Whether a producer's lease ending at a wall-clock time may be over.
        later: Runs a call (with the transfer) after a delay, on a thread that
            exists already (the io pool's timer: no thread starts per re-read).
    """

    def __init__(
        self,
        backend: Backend,
        settler: Settler,
        stats: AgentStats,
        lock: threading.RLock,
        lease_over: Callable[[float], bool],
        later: Later,
    ) -> None:
        self._backend = backend
        self._settler = settler
        self._stats = stats
        self._lock = lock
        self._lease_over = lease_over
        self._later = later

    def landed(self, t: Transfer) -> None:
        """The backend reports every byte of ``t`` moved: check, then settle it."""
        pull = t.meta.pull  # None: a push write, nothing to check
        expiry = pull.lease_expiry if pull is not None else None
        if expiry is not None and self._lease_over(expiry):
            # Landed after the producer was free to reuse the blocks:
            # the bytes may be another request's, so they are not valid.
            self._settler.fail(t, FailureKind.LEASE_EXPIRED, expired_error(t.request_id))
        elif pull is not None and pull.guard is not None:
            self.read_guard(t)
        else:
            self._settler.succeed(t)

    def read_guard(self, t: Transfer) -> None:
        """Read the hold's guard word back: after the data landed (R-SAFE-1), or alone
        while the hold has not come yet (``PullState.awaiting_hold``, no data handle)."""
        meta = t.meta
        pull = meta.pull
        assert pull is not None and pull.guard is not None and meta.peer is not None
        with self._lock:
            if t.done or meta.doomed is not None or pull.guarding:
                return  # another thread saw the data land first, or it failed
            pull.guarding = True
            data, meta.handle = meta.handle, None
        if data is not None:
            self._backend.release(data)  # DONE: nothing of it moves any more
        t0 = time.perf_counter()
        try:
            handle = self._backend.post_guard_read(meta.peer.handle, pull.guard[0])
        except KvxferError as exc:
            self._settler.fail(t, FailureKind.TRANSPORT, exc, FailureStage.LEASE)
            return
        with self._lock:
            settled = t.done
            if not settled:
                meta.handle = handle
            self._stats.guard_reads += 1
            failed = settled or meta.doomed is not None
        if settled:  # closed meanwhile: nothing polls this read any more
            self._backend.release(handle)
            return
        if failed:  # the 8-byte read lands in our own landing word: ended when it ends
            self._settler.finish(t)
            return
        state = self._backend.status(handle)
        self._stats.guard_s_total += time.perf_counter() - t0
        if state is XferStatus.DONE:
            self.guard_read(t, handle)

    def guard_read(self, t: Transfer, handle: object) -> None:
        """The guard word arrived: DONE if it still is the ticket's generation (or, while
        awaiting the hold, read the data again now that it came)."""
        meta = t.meta
        pull = meta.pull
        assert pull is not None and pull.guard is not None
        with self._lock:
            # The poster and the progress thread can both see one read complete: one
            # acts on its word. The other would read a word the first may have
            # released already (to read again) and take that for a transport error.
            if t.done or not pull.guarding or meta.handle is not handle or pull.word_of is handle:
                return
            pull.word_of = meta.handle
        try:
            word = self._backend.guard_word(handle)  # type: ignore[arg-type]
        except KvxferError as exc:
            self._settler.fail(t, FailureKind.TRANSPORT, exc, FailureStage.LEASE)
            return
        why = verdict(word, pull.guard[1])
        if why is None and not pull.awaiting_hold:
            self._settler.succeed(t)
            return
        if self._read_again(t, handle, word):
            return
        with self._lock:
            self._stats.guard_failures += 1
        self._settler.fail(
            t,
            FailureKind.LEASE_EXPIRED,
            TransferError(
                f"the producer no longer held the blocks of {t.request_id} when they were "
                f"read ({why or 'lease over'}): they may be another request's; recompute"
            ),
            FailureStage.LEASE,
        )

    def _read_again(self, t: Transfer, handle: object, word: int) -> bool:
        """A ticket minted before its hold (the vLLM scheduler hands tickets out a step
        before the worker's hold runs; under load that step comes seconds later) finds
        the slot's word not the ticket's yet: the word alone is read again, with
        growing waits up to ``REREAD_DELAYS_S[-1]``, until the hold came; then data and
        word are read again. The wait is bounded by the transfer's deadline and the
        ticket's lease, not by a count. A slot that holds another live hold's
        generation is really another hold's: that fails at once (returns False), and
        so does a word saying this very hold was freed."""
        meta = t.meta
        pull = meta.pull
        assert pull is not None and pull.guard is not None
        came = word == pull.guard[1]
        if not came and not not_held_yet(word, pull.guard[1]):
            return False
        with self._lock:
            if t.done or meta.doomed is not None:
                return False
            if not pull.guarding or meta.handle is not handle:
                return True  # another thread took this word and acts on it
            expiry = pull.lease_expiry
            if pull.repost is None or (expiry is not None and self._lease_over(expiry)):
                return False
            pull.guarding = False
            meta.handle = None
            if came:
                pull.awaiting_hold = False
                delay, then = 0.0, self._repost
            else:
                if not pull.awaiting_hold:
                    self._stats.guard_rereads += 1
                pull.awaiting_hold = True
                delay = REREAD_DELAYS_S[min(pull.reposts, len(REREAD_DELAYS_S) - 1)]
                then = self._poll_word
            pull.reposts += 1
        self._backend.release(handle)  # type: ignore[arg-type]
        if came:
            log.debug("%s: its hold came; reading data and word again", t)
        else:
            log.debug("%s: not held yet; its guard word again in %.0f ms", t, delay * 1e3)
        self._later(delay, then, t)
        return True

    def _poll_word(self, t: Transfer) -> None:
        if not t.done and t.meta.doomed is None and not self._settler.closed:
            t.meta.last_progress = time.monotonic()
            self.read_guard(t)

    def _repost(self, t: Transfer) -> None:
        repost = t.meta.pull.repost if t.meta.pull is not None else None
        if repost is not None and not t.done and t.meta.doomed is None and not self._settler.closed:
            repost()

    def arm(
        self,
        t: Transfer,
        peer: Peer,
        slot: int,
        generation: int,
        done_notice: Callable[[], bytes],
    ) -> bool:
        """Before a pull's post: make it fail-closed when both ends can (its DONE
        notice then waits for the guard word). A ticket without a generation from a
        producer that guards its holds is refused (a router dropped the kvxfer keys,
        or someone forged the ticket); a producer or backend without a guard table is
        pulled unguarded and counted. Returns False when ``t`` failed."""
        guard = peer.info.guard
        if guard is None or not self._backend.capabilities.guard:
            with self._lock:
                self._stats.unguarded_pulls += 1
            return True
        if not generation or not 0 <= slot < guard.slots:
            self._settler.fail(
                t,
                FailureKind.LEASE_EXPIRED,
                TransferError(
                    f"ticket of {t.request_id} carries no guard word (kvxfer_generation, "
                    f"kvxfer_guard_slot={slot}) although producer {peer.engine_id} guards its "
                    "holds: refused, the blocks' validity could not be checked"
                ),
                FailureStage.LEASE,
            )
            return False
        pull = t.meta.pull
        assert pull is not None, "only a pull is guarded"
        pull.guard = (slot, generation)
        pull.done_notice = done_notice
        return True
