"""One posted transfer as the engine sees it: pollable, awaitable, never ambiguous.

A :class:`Transfer` is what :meth:`Agent.pull <kvxfer.agent.Agent.pull>` and the push
calls return. Its state only moves forward (PENDING → DONE | FAILED); DONE means every
byte landed (the backend reported completion, and for host bounce the staging copy-in
finished); FAILED carries the exact local blocks that are not valid. Either is final
only when no byte of the transfer can land any more (R-SAFE-5): a transfer that failed
while its bytes may still move stays PENDING, :attr:`Transfer.doomed`, and its blocks
stay with it until then.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvxfer.core.gather_cost import XferPath
from kvxfer.errors import KvxferError, TransferError, TransferTimeout

if TYPE_CHECKING:
    from kvxfer.backend import PeerHandle, XferHandle

__all__ = [
    "FailureKind",
    "FailureStage",
    "PeerRef",
    "PullState",
    "ReceptionState",
    "Transfer",
    "TransferMeta",
    "TransferState",
    "TransferStats",
    "WriteState",
    "settle",
]

_NAP_S = 0.0002  # wait() polls this often
# Settling is rare and brief; one lock for all transfers keeps two threads that both
# saw the completion (a waiter and the progress thread) from settling it twice.
_SETTLE_LOCK = threading.Lock()


class TransferState(enum.Enum):
    """Lifecycle of a transfer; it only moves forward."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class FailureKind(enum.Enum):
    """Why a transfer failed, for stats and for the engine's recovery policy."""

    HANDSHAKE = "handshake"  # the peer could not be reached or refused us
    POST = "post"  # the transport refused the request
    TRANSPORT = "transport"  # the transport reported an error while moving bytes
    TIMEOUT = "timeout"  # no completion before the deadline
    PEER_GONE = "peer_gone"  # the peer died, restarted or released the blocks
    ABORTED = "aborted"  # the engine or the peer aborted the request
    LEASE_EXPIRED = "lease_expired"  # the producer may have reused the blocks


class FailureStage(enum.Enum):
    """Where a transfer failed (R-SAFE-4); :class:`FailureKind` says why."""

    HANDSHAKE = "handshake"  # reaching or agreeing with the peer
    REGISTRATION = "registration"  # push: the producer refused or never answered it
    POST = "post"  # planning or posting the transfer
    TRANSFER = "transfer"  # in flight: transport error, dead peer, timeout, abort
    NOTICE = "notice"  # push: notices lost and the producer could not confirm
    LEASE = "lease"  # the producer no longer held the blocks (fail-closed check)

    @classmethod
    def of(cls, kind: FailureKind) -> FailureStage:
        """The stage a failure of ``kind`` belongs to when its caller names none."""
        return _STAGE_OF[kind]


_STAGE_OF = {
    FailureKind.HANDSHAKE: FailureStage.HANDSHAKE,
    FailureKind.POST: FailureStage.POST,
    FailureKind.TRANSPORT: FailureStage.TRANSFER,
    FailureKind.TIMEOUT: FailureStage.TRANSFER,
    FailureKind.PEER_GONE: FailureStage.TRANSFER,
    FailureKind.ABORTED: FailureStage.TRANSFER,
    FailureKind.LEASE_EXPIRED: FailureStage.LEASE,
}


class TransferStats(msgspec.Struct, kw_only=True):
    """Per-transfer measurements (seconds, bytes)."""

    request_id: str
    bytes: int = 0
    descriptors: int = 0
    plan_s: float = 0.0
    post_s: float = 0.0
    transfer_s: float = 0.0
    settled_at: float = 0.0  # time.monotonic() when it settled (timelines across processes)
    failure: FailureKind | None = None
    stage: FailureStage | None = None
    #: How its bytes moved: DIRECT (runs posted between the caches) or GATHER (rounds
    #: through the staging slots, issue 55); ``descriptors`` counts what was posted.
    path: XferPath = XferPath.DIRECT


class PeerRef(Protocol):
    """What a transfer's bookkeeping knows of the peer it moves bytes with.

    The Agent's handshaken peer (``kvxfer._agent.peers.Peer``) is one; the record
    names only what settling and probing read, so it sits below the Agent's parts.
    """

    host: str
    port: int
    incarnation: int
    handle: PeerHandle
    suspect: bool


class PullState(msgspec.Struct, kw_only=True):
    """What a pull (and each producer rank's part of one across TP sizes) keeps.

    Attributes:
        lease_expiry: The producer's lease (wall clock): landing later is invalid.
        guard: A guarded pull: the producer's guard slot and the hold's generation.
        guarding: The data landed; the transfer's ``handle`` is the guard word's read.
        awaiting_hold: The guard word says the hold has not come yet: only the word is
            read again until it does, then data and word.
        done_notice: Makes the DONE notice, sent once the guard word matched when no
            ``release`` tells the producer (made only then: an Agent's pulls tell
            DONE over the side channel).
        release: Called (outside the lock) when the posted pull fails: tells the
            producer at once.
        repost: Posts it again (same plan) when its guard word says the producer has
            not held the request yet.
        reposts: How often it was posted again.
        word_of: The guard read whose word a thread acts on (two threads that saw one
            read complete act on it once).
    """

    lease_expiry: float | None = None
    guard: tuple[int, int] | None = None
    guarding: bool = False
    awaiting_hold: bool = False
    done_notice: Callable[[], bytes] | None = None
    release: Callable[[str], None] | None = None
    repost: Callable[[], None] | None = None
    reposts: int = 0
    word_of: XferHandle | None = None


class ReceptionState(msgspec.Struct, kw_only=True):
    """What a push reception (the consumer's side of a push) keeps.

    Attributes:
        source: The producer rank it awaits (across TP sizes one reception per
            producer rank; 0 otherwise), echoed in its notices.
        push_from: The producer's side-channel address once it registered there.
        writer_live: Its producer may be writing into its blocks (from the
            registration's send until the producer said its writes ended, or is proven
            gone, R-SAFE-5).
        notice_bytes: Its announced final notice, known by its bytes.
        covered: Its blocks announced so far, per group.
        final: It saw its final notice.
        stage_in: Complete: copy the staging buffers in (host bounce).
        unreachable_since: Since when its producer has had no route (for the log:
            no route proves nothing about its write, kvxfer._agent.liveness), 0 while
            it has one.
        producer_stall_s: The producer's stall limit, from its answer to the
            registration (:attr:`kvxfer.core.wire.Ack.stall_limit_s`); 0: none.
        producer_incarnation: The producer's incarnation, from the ticket (0: the
            ticket did not say): a probe answered by another one found it restarted.
        writer_until: Its producer is gone, but until then bytes of its write could
            still land (a dead process's kernel still sends what it had queued:
            kvxfer._agent.liveness); 0: no such wait.
        siblings: Across TP sizes, the receptions of the same request from the other
            producer ranks. A copy in moves the whole blocks, every rank's heads, so
            one reception copies, the first to settle once all of them are complete,
            and after every rank's bytes landed: one copy, not one per rank.
        copies_in: It is that reception.
    """

    source: int = 0
    push_from: tuple[str, int] | None = None
    writer_live: bool = False
    notice_bytes: bytes | None = None
    covered: list[set[int]] | None = None
    final: bool = False
    stage_in: bool = False
    unreachable_since: float = 0.0
    producer_stall_s: float = 0.0
    producer_incarnation: int = 0
    writer_until: float = 0.0
    siblings: list[ReceptionState] = msgspec.field(default_factory=list)
    copies_in: bool = False


class WriteState(msgspec.Struct, kw_only=True):
    """What a push write (the producer's side of a push) keeps.

    Attributes:
        lease: Its lease (request id) on the producer.
        consumer: The consumer it writes to (told when the write failed).
    """

    lease: str
    consumer: PeerRef | None = None


class TransferMeta(msgspec.Struct, kw_only=True):
    """The agent's bookkeeping of one transfer (engines never need it): what every
    kind keeps, and the state of its kind (one of ``pull``, ``reception``, ``write``;
    none for the one Transfer that folds several producer ranks' parts).

    Attributes:
        posting: Inside its post: nothing to poll yet (the progress thread's pace).
        peer: The peer it was posted against (marked suspect when the transport fails).
        handle: The backend's handle once posted; released when it settles.
        capability: A pull: the hold's token; a push reception: its registration token.
        producer_at: A pull or a push reception: its producer's side-channel address,
            probed while the pull waits for its handshake or sits in a post that does
            not return, or while the reception's registration has not returned.
        on_settled: Called under the agent lock when it settles (ok: DONE).
        last_progress: Monotonic time of its last sign of life (post, probe answer).
        probing: A liveness probe of its peer is in flight.
        doomed: Its failure, decided but not yet final (R-SAFE-5): bytes of it may
            still land, so its blocks stay quarantined with it until they cannot; it
            then settles FAILED with this (kind, error, stage). It never becomes DONE.
        doomed_at: Monotonic time it was doomed (the quarantine's length).
        quarantined: Doomed and waiting for its bytes to stop (counted in
            ``AgentStats.quarantined`` until it settles).
        pull, reception, write: The state of its kind.
        parts: The one Transfer that folds several producer ranks' parts
            (kvxfer._agent.fanout): those parts, each tracked on its own.
    """

    posting: bool = False
    peer: PeerRef | None = None
    handle: XferHandle | None = None
    capability: str = ""
    producer_at: tuple[str, int] | None = None
    on_settled: Callable[[Transfer, bool], None] | None = None
    last_progress: float = 0.0
    probing: bool = False
    doomed: tuple[FailureKind, KvxferError, FailureStage] | None = None
    doomed_at: float = 0.0
    quarantined: bool = False
    pull: PullState | None = None
    reception: ReceptionState | None = None
    write: WriteState | None = None
    parts: tuple[Transfer, ...] = ()

    @property
    def moving(self) -> bool:
        """Bytes of it may be moving: it is inside its post, or posted and not yet
        settled. Before its post (a handshake, a plan) none of its bytes can land."""
        return self.posting or self.handle is not None

    @property
    def writer_live(self) -> bool:
        """A push reception whose producer may still write into its blocks: it did
        not say its writes ended, or it is gone and its kernel may still deliver some
        (until ``writer_until``)."""
        r = self.reception
        return r is not None and (r.writer_live or r.writer_until > time.monotonic())

    def peers(self) -> tuple[PeerRef, ...]:
        """The peers its bytes move with (marked suspect when it fails)."""
        consumer = self.write.consumer if self.write is not None else None
        return tuple(p for p in (self.peer, consumer) if p is not None)


class Transfer:
    """A transfer in flight.

    Engines poll it from their step loop (:meth:`poll` never blocks), block on it
    (:meth:`wait`) or ``await`` it.

    Attributes:
        request_id: The engine's request id this transfer serves.
        local_blocks: The local block ids it writes, one tuple per KV group.
        stats: Bytes, descriptors and timings; ``failure`` once failed.
    """

    def __init__(
        self,
        request_id: str,
        local_blocks: tuple[tuple[int, ...], ...],
        *,
        progress: Callable[[], None],
        deadline: float,
    ) -> None:
        self.request_id = request_id
        self.local_blocks = local_blocks
        self.stats = TransferStats(request_id=request_id)
        self.deadline = deadline
        self._progress = progress
        self._state = TransferState.PENDING
        self._settled = False  # claimed by the one _settle call that wins
        self._error: KvxferError | None = None
        # The blocks a FAILED transfer reports invalid when not all of local_blocks
        # (a transfer aggregated over several producer ranks: kvxfer._agent.fanout).
        self._invalid: tuple[int, ...] | None = None
        # Made by the first wait() (most transfers are polled or settle inside post).
        self._done: threading.Event | None = None
        self._waiters = 0  # threads inside wait(): they drive progress themselves
        self._callbacks: list[Callable[[Transfer], None]] = []
        self._started = time.perf_counter()
        self.meta = TransferMeta()  # the agent's bookkeeping (handle, peer, ...)

    # -- read side ----------------------------------------------------------------
    @property
    def state(self) -> TransferState:
        """Current state (does not drive progress; see :meth:`poll`)."""
        return self._state

    @property
    def done(self) -> bool:
        """True once DONE or FAILED."""
        return self._state is not TransferState.PENDING

    @property
    def doomed(self) -> bool:
        """True once it is sure to end FAILED while bytes of it may still land: an
        aborted or failed transfer whose transport is still moving bytes, or a push
        reception whose producer has not said its writes ended (R-SAFE-5). Its blocks
        stay with it (quarantined) until it settles. An engine may end its request
        now (the failure is decided: :attr:`doomed_error` says why), but must not reuse
        the blocks before the transfer is :attr:`done`. A transfer made of several
        producer ranks' parts is doomed once one of them is doomed or failed."""
        return self.doomed_error is not None

    @property
    def doomed_error(self) -> KvxferError | None:
        """Why a :attr:`doomed` transfer will fail (a part's error, for one made of
        several producer ranks' parts); None while it is not doomed."""
        if self._state is not TransferState.PENDING:
            return None
        if self.meta.doomed is not None:
            return self.meta.doomed[1]
        for part in self.meta.parts:
            if part.meta.doomed is not None:
                return part.meta.doomed[1]
            if part.state is TransferState.FAILED:
                return part.error
        return None

    @property
    def error(self) -> KvxferError | None:
        """Why it failed, or None."""
        return self._error

    @property
    def invalid_blocks(self) -> tuple[int, ...]:
        """Local blocks that did not land (every block of a failed transfer), sorted."""
        if self._state is not TransferState.FAILED:
            return ()
        if self._invalid is not None:
            return self._invalid
        return tuple(sorted({b for group in self.local_blocks for b in group}))

    def poll(self) -> TransferState:
        """Drive progress once without blocking and return the state."""
        if self._state is TransferState.PENDING:
            self._progress()
        return self._state

    @property
    def waited_on(self) -> bool:
        """True while a thread blocks in :meth:`wait`, or a coroutine awaits it (both
        poll it every ``_NAP_S``): the agent's progress thread then need not poll it
        as often."""
        return self._waiters > 0

    def add_done_callback(self, fn: Callable[[Transfer], None]) -> None:
        """Call ``fn(transfer)`` once it settles (at once if it has settled).

        ``fn`` runs on the thread that settles the transfer (often the agent's progress
        thread), so it must be quick and must not block or raise: setting an event an
        engine waits on is the intended use (no polling while it waits).
        """
        with _SETTLE_LOCK:
            if self._state is TransferState.PENDING:
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer settles.

        Raises:
            TransferError: it failed (``invalid_blocks`` on the error).
            TransferTimeout: ``timeout`` passed first (the transfer itself goes on).
        """
        with _SETTLE_LOCK:
            self._waiters += 1
        try:
            self._wait(timeout)
        finally:
            with _SETTLE_LOCK:
                self._waiters -= 1

    def _wait(self, timeout: float | None) -> None:
        limit = None if timeout is None else time.monotonic() + timeout
        while self.poll() is TransferState.PENDING:
            remaining = None if limit is None else limit - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TransferTimeout(
                    f"transfer {self.request_id} still pending after {timeout}s",
                    self.invalid_blocks,
                )
            # Short naps: a completion often shows only through polling (a notification
            # to drain), and this thread polling it beats a hand-off from the agent's
            # progress thread. A nap releases the GIL for the transfer's own threads.
            if self._done is None:
                self._done = threading.Event()
                if self._state is not TransferState.PENDING:
                    break  # settled before the event existed
            self._done.wait(_NAP_S if remaining is None else min(_NAP_S, remaining))
        self._raise_if_failed()

    def __await__(self) -> Generator[Any, None, None]:
        async def _wait() -> None:
            with _SETTLE_LOCK:
                self._waiters += 1  # polls as often as wait() does
            try:
                while self.poll() is TransferState.PENDING:
                    await asyncio.sleep(_NAP_S)
            finally:
                with _SETTLE_LOCK:
                    self._waiters -= 1
            self._raise_if_failed()

        return _wait().__await__()

    def _raise_if_failed(self) -> None:
        if self._state is TransferState.FAILED:
            err = self._error
            if isinstance(err, TransferError):
                raise err
            raise TransferError(
                f"transfer {self.request_id} failed: {err}", self.invalid_blocks
            ) from err

    def _settle(
        self,
        state: TransferState,
        error: KvxferError | None,
        invalid: tuple[int, ...] | None = None,
    ) -> bool:
        with _SETTLE_LOCK:
            if self._settled:
                return False
            self._settled = True
            if invalid is not None:
                self._invalid = tuple(sorted(set(invalid)))
        self.stats.transfer_s = time.perf_counter() - self._started
        self.stats.settled_at = time.monotonic()
        if state is TransferState.FAILED:
            if error is None:
                error = TransferError(f"transfer {self.request_id} failed")
            if not isinstance(error, TransferError):
                wrapped = TransferError(f"transfer {self.request_id} failed: {error}")
                wrapped.__cause__ = error
                error = wrapped
            error.invalid_blocks = (
                self._invalid
                if self._invalid is not None
                else tuple(sorted({b for g in self.local_blocks for b in g}))
            )
            self._error = error
        self._state = state
        if self._done is not None:
            self._done.set()
        with _SETTLE_LOCK:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True

    def __repr__(self) -> str:
        return f"<Transfer {self.request_id} {self._state.value} {self.stats.bytes}B>"


def settle(
    transfer: Transfer,
    state: TransferState,
    error: KvxferError | None = None,
    *,
    invalid: tuple[int, ...] | None = None,
) -> bool:
    """Move ``transfer`` to DONE or FAILED, once (the agent runtime's side of a transfer).

    Engines never call this: a transfer settles when its bytes landed or it failed.
    ``invalid`` (FAILED only) narrows the invalid blocks to those named, when not
    every local block was hit (one failed producer rank of several).

    Returns:
        False if it was already settled (by another thread that saw it finish).
    """
    return transfer._settle(state, error, invalid)
