"""The backend contract: the one boundary between kvxfer and a data plane.

A backend moves bytes between registered memory of two processes. It speaks only
kvxfer's own types (layouts, descriptor tables as numpy arrays, enums, bytes); nothing
it returns is a NIXL, UCX or torch object. The :class:`~kvxfer.agent.Agent` owns every
policy (leases, deadlines, retries, which blocks go); a backend owns only the mechanism.

Lifecycle, as the agent drives it::

    be = Backend(options)                # one per agent / worker process
    exposed = be.register(layout)        # the layout peers will address
    be.prepare_local(local_table)        # once: the local descriptor table
    peer = be.add_peer(metadata, remote_table)   # once per (peer, incarnation)
    h = be.post(XferOp.READ, peer, local_ids, remote_ids, notif)  # per request
    be.status(h) -> XferStatus           # non-blocking, from the engine's step loop
    be.release(h)
    be.drain_notifications()             # (peer name, payload) pairs
    be.remove_peer(peer); be.close()     # teardown in reverse order

Fail-closed pulls (issue 16, docs/RELIABILITY.md), when ``capabilities.guard``::

    words = be.register_guard(slots)     # producer, right after register()
    be.guard_table()                     # what the handshake tells consumers
    be.add_peer_guard(peer, guard)       # consumer, once per peer
    h = be.post_guard_read(peer, slot)   # after a pull's data READ completed
    be.status(h); be.guard_word(h); be.release(h)

A backend without them (``guard=False``, the default of a third-party backend) still
works: its pulls are *unguarded*, counted in ``AgentStats.unguarded_pulls`` and
checked against the ticket's ``lease_expiry`` only.

Implementations: ``ucx`` (NIXL over UCX), ``host_bounce`` (staging buffers, then
``ucx``), ``nixl_rbln`` (NPU memory through nixl-rbln), and the fault-injecting ``fake``
in :mod:`kvxfer.testing`. Every one passes :mod:`kvxfer.testing.conformance`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NewType

import msgspec

from kvxfer.errors import BackendError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from kvxfer.core.block_lists import ChainLists
    from kvxfer.core.descriptors import DescriptorTable, Runs
    from kvxfer.core.layout import KVLayout, MemKind
    from kvxfer.core.wire import GuardTable

__all__ = [
    "BACKEND_API_VERSION",
    "Backend",
    "BackendOptions",
    "Capabilities",
    "PeerHandle",
    "XferHandle",
    "XferOp",
    "XferStatus",
]

#: Bumped on incompatible changes of this contract; the registry refuses backends
#: declaring another version.
BACKEND_API_VERSION = 1

PeerHandle = NewType("PeerHandle", str)
"""Opaque name of a connected peer (unique per peer incarnation)."""

XferHandle = NewType("XferHandle", int)
"""Opaque id of one posted transfer."""


class XferOp(enum.Enum):
    """Direction of a one-sided transfer, seen from the initiator."""

    READ = "read"  # pull: initiator reads the peer's memory into its own
    WRITE = "write"  # push: initiator writes its memory into the peer's


class XferStatus(enum.Enum):
    """State of a posted transfer as the backend sees it."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can do; the agent checks these instead of backend names."""

    name: str
    mem_kinds: frozenset[MemKind]
    device_to_device: bool
    """Moves device memory directly (chunk_mode / swa_window_mode / push_stream need it)."""
    stages_through_host: bool = False
    """Copies device blocks into host staging buffers around each transfer."""
    merges_contiguous: bool = True
    """Posting merges descriptors contiguous on both sides into one transfer unit."""
    guard: bool = False
    """Registers a guard table and reads peers' guard words (fail-closed pulls)."""
    head_sections: bool = True
    """Takes a local table with more rows than its layout's (a one-head section after
    the whole-block table, :func:`kvxfer.core.tp_plan.prepared_rows`) and posts any of its
    ids; False leaves a posting agent without one, and pairs across TP sizes that
    need it are refused by name."""
    writes_outlive_process: bool = True
    """A WRITE's bytes may go on landing at the peer after this process died: over
    kernel TCP the dead process's socket keeps what was queued and sends it until
    :attr:`BackendOptions.stall_limit_s` ends it. A producer announces that limit to
    its consumers, who keep a dead producer's blocks quarantined that long (R-SAFE-5);
    False (writes end with the process, as on the in-process fake fabric) announces
    none. True unless a backend knows better: a wrong False lets bytes land in reused
    blocks, a wrong True only holds them longer."""
    address_runs: bool = False
    """Posts per-request lists of address runs (:meth:`Backend.post_runs`): what a pull
    between different block sizes needs (:mod:`kvxfer.core.ratio`)."""
    log_prefix: str = "kvxfer: "
    """How the agent's log lines about this transport begin (a vendor's backend names
    itself there, as operators of that hardware grep for it)."""


class BackendOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options every backend accepts; backend-specific ones go in ``extra``."""

    agent_name: str
    """Name unique to this process incarnation; peers address it by this name."""
    rails: tuple[str, ...] = ()
    """RDMA devices (``mlx5_0:1`` style) to pin the data plane to; empty = transport default."""
    stripe_width: int | None = None
    """None: one rail per transfer; 0: every rail both peers share."""
    progress_thread: bool = False
    """NIXL's own progress thread; off by default because it spins a core while idle."""
    stall_limit_s: float | None = None
    """How long a connection may hold bytes the peer has not acknowledged before the
    transport ends it, and the transfers on it fail (over kernel TCP: the socket's
    ``TCP_USER_TIMEOUT``). A WRITE cut by a dead link then ends, its bytes with it, at
    most this long after the link went quiet, instead of resuming whenever TCP's
    backed-off retransmission timer fires (up to minutes after the link came back).
    None: the transport's default (TCP: about 15 minutes)."""
    extra: dict[str, str] = msgspec.field(default_factory=dict)


class Backend(ABC):
    """Abstract data plane. Subclasses are registered in the ``kvxfer.backends`` group.

    Thread-safety: the agent calls a backend from its own progress thread and from the
    engine's thread; implementations serialise access to their transport themselves.
    """

    name: ClassVar[str]
    api_version: ClassVar[int] = BACKEND_API_VERSION

    @abstractmethod
    def __init__(self, options: BackendOptions) -> None: ...

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports."""

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """The name peers use for this endpoint (from :class:`BackendOptions`)."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Connection blob a peer passes to :meth:`add_peer` (sent in the handshake)."""

    @abstractmethod
    def register(self, layout: KVLayout) -> KVLayout:
        """Register the memory described by ``layout``.

        Returns the layout peers will address: the same one for direct backends, the
        host staging buffers' layout for ``host_bounce``.
        """

    @abstractmethod
    def prepare_local(self, table: DescriptorTable) -> None:
        """Prepare the local descriptor table once, so posts pass only indices."""

    @abstractmethod
    def add_peer(self, metadata: bytes, table: DescriptorTable) -> PeerHandle:
        """Connect to a peer from its metadata and prepare its descriptor table."""

    @abstractmethod
    def remove_peer(self, peer: PeerHandle) -> None:
        """Forget a peer: no new post to it. A READ still in flight fails (its bytes
        come in through our own connection, which goes). A WRITE still in flight goes
        on until it ends on its own, completed or failed by the transport, and its
        connection with it: cut any other way, bytes already on their way to the peer
        would land in its blocks after it was told the write ended (R-SAFE-5). NIXL's
        UCX backend closes a removed agent's endpoint by flushing it, so the WRITE's
        bytes keep going after NIXL reported it over, and a TCP socket's send queue
        drains after it was closed. :attr:`BackendOptions.stall_limit_s` bounds how
        long such a WRITE lasts on a dead link."""

    @abstractmethod
    def post(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        """Post one transfer of paired descriptors; ``notification`` reaches the peer
        only after every byte landed. Raises :class:`~kvxfer.errors.BackendError` when
        the transport refuses the request."""

    def post_engine(
        self,
        op: XferOp,
        peer: PeerHandle,
        local_ids: npt.NDArray[np.int64],
        remote_ids: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        """Post a transfer whose local end is the engine's own blocks (what the agent
        calls): as :meth:`post`, and a READ is DONE only once its bytes are in the
        engine's blocks, a WRITE takes its bytes from them. Backends that move engine
        memory directly inherit this (it is :meth:`post`); staging backends overlap
        their local copy with the transfer here."""
        return self.post(op, peer, local_ids, remote_ids, notification)

    def prepare_lists(self, peer: PeerHandle, lists: ChainLists) -> bool:
        """Prepare both sides of ``lists`` (:mod:`kvxfer.core.block_lists`) with
        ``peer`` for :meth:`post_lists`, once: they stay prepared until the peer is
        removed. False where this backend posts no such lists (the default: a staging
        backend copies per block id) or holds as many as it keeps for ``peer``; the
        caller then posts ids as before."""
        return False

    def post_lists(
        self,
        op: XferOp,
        peer: PeerHandle,
        lists: ChainLists,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notification: bytes = b"",
    ) -> XferHandle:
        """Post rows of ``lists`` paired by position, as :meth:`post_engine` (a READ is
        DONE once its bytes are in the engine's blocks). Lists that :meth:`prepare_lists`
        accepted once are prepared again here if the peer was removed and added since.
        Raises :class:`~kvxfer.errors.BackendError` where this backend posts no lists
        or holds as many as it keeps for ``peer``."""
        raise BackendError(f"{type(self).__name__} posts no chain lists")

    def post_runs(
        self,
        op: XferOp,
        peer: PeerHandle,
        runs: Runs,
        notification: bytes = b"",
    ) -> XferHandle:
        """Post one transfer of address runs built for this request (local and remote
        addresses inside registered memory, paired by position), as :meth:`post_engine`
        (a READ is DONE once its bytes are in the engine's blocks). Backends that say
        :attr:`Capabilities.address_runs` implement it; the default raises
        :class:`~kvxfer.errors.BackendError`."""
        raise BackendError(f"{type(self).__name__} posts no address runs")

    @abstractmethod
    def status(self, handle: XferHandle) -> XferStatus:
        """Non-blocking state of a posted transfer (drives the transport's progress).

        Never waits for another thread's call into the transport (a post that copies
        inline): PENDING is the answer until the transport can be asked."""

    @abstractmethod
    def release(self, handle: XferHandle) -> None:
        """Release a transfer handle (done, failed or abandoned)."""

    def cancel(self, handle: XferHandle) -> bool:
        """Stop a transfer the agent gave up on (an abort, a failure, a deadline).

        Returns True when no further byte of it can move (it completed or failed, or
        the transport really cancelled it) and the handle is released. Returns False
        while it may still move bytes (NIXL cannot cancel a request in flight, and a
        UCX send or RDMA operation goes on regardless): the caller keeps the handle
        and asks again; the transfer's local blocks stay quarantined meanwhile
        (R-SAFE-5). The default trusts :meth:`status`: anything but PENDING is over."""
        if self.status(handle) is XferStatus.PENDING:
            return False
        self.release(handle)
        return True

    @abstractmethod
    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        """Send a small message to a peer outside any transfer."""

    @abstractmethod
    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """Return and forget the notifications received so far as (agent name, payload).

        A poll: it never waits for another thread's call into the transport (an empty
        list then; the notifications stay queued for the next poll)."""

    def failure_detail(self, handle: XferHandle) -> str:
        """What the transport said about a FAILED transfer (a local memory error is
        named as such, not as a dead peer); "" when it said nothing."""
        return ""

    # -- guard table (optional: Capabilities.guard) ---------------------------------
    def register_guard(self, slots: int) -> npt.NDArray[np.uint64]:
        """Register a host table of ``slots`` zeroed 64-bit words and return it,
        writable (the agent writes its holds' generations there). Called right after
        :meth:`register`, before :meth:`metadata` is sent to any peer."""
        raise BackendError(f"backend {type(self).__name__} has no guard table")

    def guard_table(self) -> GuardTable | None:
        """Where peers read the guard table (sent in the handshake); None: none."""
        return None

    # -- gather path staging (optional; issue 55) ----------------------------------
    def register_staging(self, nbytes: int) -> int:
        """Register ``nbytes`` of zeroed staging memory for the gather path and return
        its address (as this backend's metadata addresses it, for peers to READ). Host
        memory for now; a device cache's staging will take the cache's memory kind
        through this same call. At most once, right after :meth:`register`, before
        :meth:`metadata` is sent to any peer; the memory never grows."""
        raise BackendError(f"backend {type(self).__name__} has no staging memory")

    def add_peer_guard(self, peer: PeerHandle, guard: GuardTable) -> None:
        """Prepare reads of a connected peer's guard table (from its handshake)."""
        raise BackendError(f"backend {type(self).__name__} cannot read guard words")

    def post_guard_read(
        self, peer: PeerHandle, slot: int, notification: bytes = b"", *, copies: int = 1
    ) -> XferHandle:
        """Post one 8-byte READ of ``slot`` of the peer's guard table; :meth:`status`
        and :meth:`release` take its handle like any transfer's. ``notification``
        reaches the peer only after the word was read. ``copies``: post the read as
        that many descriptors, every one of the same word into the same landing word
        (the agent's warm-up, sized like a large request: see
        :attr:`~kvxfer.agent.AgentConfig.warm_up_descriptors`)."""
        raise BackendError(f"backend {type(self).__name__} cannot read guard words")

    def guard_word(self, handle: XferHandle) -> int:
        """The word a guard read read, once its :meth:`status` is DONE."""
        raise BackendError(f"backend {type(self).__name__} cannot read guard words")

    def post_sink_write(self, peer: PeerHandle, *, copies: int = 1) -> XferHandle:
        """Post a WRITE of one word of ours into the peer's sink word
        (:attr:`GuardTable.sink <kvxfer.core.wire.GuardTable.sink>`, from its handshake)
        as ``copies`` descriptors, every one the same word: a push producer's warm-up,
        which uses the write path before a request does. Nobody reads the sink.
        :meth:`status` and :meth:`release` take its handle like any transfer's.

        Raises:
            PeerError: the peer announced no sink (or is unknown).
            BackendError: ``copies`` below 1, or a backend without sinks.
        """
        raise BackendError(f"backend {type(self).__name__} cannot write a peer's sink word")

    def stage_out(self, block_ids: Sequence[npt.NDArray[np.int64]]) -> None:  # noqa: B027
        """Make device blocks readable by peers before they READ them (host staging
        copies them out; a WRITE's own blocks are staged by :meth:`post_engine`)."""

    def stage_in(self, block_ids: Sequence[npt.NDArray[np.int64]]) -> None:  # noqa: B027
        """Move blocks a peer WROTE into device memory (host staging copies them in;
        a READ's blocks are staged in by :meth:`post_engine`)."""

    @abstractmethod
    def close(self) -> None:
        """Release every handle in dependency order; idempotent."""
