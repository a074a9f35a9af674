"""The producer's side of a push: the writer that moves held blocks to the consumer.

A consumer registers its receiving blocks (:class:`~kvxfer.core.wire.PushRegister`, on the
side channel); once the engine's :meth:`~kvxfer.agent.Agent.hold` marks the prompt
ready, the lease's blocks are written to it (R-XFER-2), early ones during prefill with
``push_stream`` (R-XFER-3).

Who posts a write (:class:`~kvxfer.agent_config.PushPost`): by default on backends that
move engine memory directly, the engine's own ``hold()``/``stream()`` call, when the
consumer is already connected and the writer thread has nothing queued (so a request's
writes stay in order); everything else (a first contact's handshake, a registration
that arrives after ``hold()``, staging backends) goes to one ordered writer thread. A
writer thread costs a thread wake and a GIL hand-off per write, and behind an engine
thread that keeps running Python it waits up to the interpreter's switch interval
(5 ms) for the GIL at every step of the post.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec

from kvxfer._agent.guard import FreeReason
from kvxfer._agent.leases import MAX_RIVALS, Lease, LeaseBook, Target
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import Peer, PeerCache
from kvxfer._agent.push_ratio import Span, plan_ratio
from kvxfer._agent.readers import MAX_READERS
from kvxfer._agent.receptions import NOTICE_REUSE_S
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.tp_push_write import WritePlanner
from kvxfer._agent.workers import IoPool
from kvxfer.agent_config import PushPost
from kvxfer.backend import Backend, XferOp
from kvxfer.core import blocks, wire
from kvxfer.core.block_lists import ChainPlan
from kvxfer.core.descriptors import Plan, Runs
from kvxfer.core.ratio import UnitPairing
from kvxfer.errors import KvxferError, TransferError
from kvxfer.io.serial import SerialWorker
from kvxfer.transfer import FailureKind, FailureStage, Transfer, TransferState, WriteState
from kvxfer.types import Direction

__all__ = ["PushWriter", "Write"]

log = logging.getLogger("kvxfer.agent")
# Per-request timestamps for benchmarks (kvxfer.adapters.vllm.timeline turns it on).
_timeline = logging.getLogger("kvxfer.timeline")


#: A consumer rank's side channel and identity: host, port, engine id, incarnation.
_Key = tuple[str, int, str, int]


def _key(target: wire.PushRegister) -> _Key:
    return (target.host, target.port, target.engine_id, target.incarnation)


class Write(msgspec.Struct):
    """One WRITE of a lease's slice to one consumer rank, ready to post."""

    transfer: Transfer
    slot: Target
    target: wire.PushRegister
    local: tuple[tuple[int, ...], ...]
    remote: tuple[tuple[int, ...], ...]
    tokens: int
    final: bool
    early: tuple[float, bytes] | None  # the final notice encoded at registration
    span: Span  # the write's tokens, planned anew into a consumer of another block size


class PushWriter:
    """The push writer of an agent (internal).

    Args:
        local: Identity, registered memory and message signing.
        backend: The transport (notices of streamed or failed writes).
        runtime: Posts and settles the writes.
        peers: The consumers, handshaken on io workers.
        leases: The producer's leases, which the writes serve.
        lock: The agent lock; the methods documented as such run under it.
        io: Worker threads for first-contact handshakes with consumers.
    """

    def __init__(
        self,
        local: LocalEnd,
        backend: Backend,
        runtime: Runtime,
        peers: PeerCache,
        leases: LeaseBook,
        lock: threading.RLock,
        io: IoPool,
    ) -> None:
        self._local = local
        self._config = local.config
        self._backend = backend
        self._runtime = runtime
        self._peers = peers
        self._leases = leases
        self._lock = lock
        self._pusher = SerialWorker("kvxfer-push")
        self._io = io
        # Writes to a consumer whose first-contact handshake runs on an io worker, in
        # order, by its address and identity. Touched on the writer thread only (read
        # elsewhere): a slow consumer's handshake never holds the other consumers'
        # writes queued behind it on the one writer thread.
        self._parked: dict[_Key, list[Write]] = {}
        self._planner = WritePlanner(local, lock, runtime.prepare_lists)
        mode = self._config.push_post
        # A staging backend's post also copies the blocks out on the CPU first.
        stages = backend.capabilities.stages_through_host
        self._inline = (not stages) if mode is PushPost.AUTO else mode is PushPost.ENGINE
        # How long after this process died bytes of its writes may still land, told to
        # each consumer in the registration's answer (kvxfer._agent.liveness); none where
        # the transport's writes end with the process.
        outlive = backend.capabilities.writes_outlive_process
        self._stall_announced = (self._config.stall_limit_s or 0.0) if outlive else 0.0

    def start_writer(self) -> None:
        """Start the writer thread now (a push producer that serves), so that no
        request's write waits for a thread's creation."""
        if self._config.direction is Direction.PUSH and self._local.posts:
            self._pusher.start()

    def shutdown(self) -> None:
        """Stop the writer thread (queued writes are dropped; their transfers failed)."""
        self._pusher.shutdown()

    @property
    def writer_idle(self) -> bool:
        """No write is queued on the writer thread or in its post (the engine's next
        write may then post on its own thread)."""
        return self._pusher.idle

    def connected(self, peer: Peer) -> None:
        """The engine connected to ``peer`` ahead of its pushes: prepare what its writes
        need (into a consumer rank of another TP size, the planner;
        :meth:`WritePlanner.prepare <kvxfer._agent.tp_push_write.WritePlanner.prepare>`)."""
        self._planner.prepare(peer)

    def post_inline(self, writes: list[Write]) -> None:
        """Post writes collected under the lock, on this (the engine's) thread; one
        whose consumer is not connected yet goes to the writer (a handshake never runs
        on the engine's thread)."""
        for job in writes:
            target = job.target
            key = _key(target)
            peer = None if key in self._parked else self._peers.cached(*key)
            if peer is None:
                self._pusher.submit(self._post_write, job)
                continue
            try:
                self._post_write(job, peer)
            except Exception as exc:  # never into the engine's step: fail the write
                self._runtime.fail(job.transfer, FailureKind.POST, exc)

    def on_register(self, msg: wire.PushRegister) -> wire.Message:
        """A consumer registered its receiving blocks (side-channel server thread)."""
        if self._config.direction is not Direction.PUSH:
            return wire.Reject(
                code=wire.RejectCode.UNKNOWN_REQUEST, reason="this instance does not push"
            )
        leases = self._leases
        if not (1 <= msg.readers <= MAX_READERS and msg.reader < MAX_READERS):
            # ``reader`` is the consumer's TP rank; ``readers`` how many write to: both
            # bounded by a TP size, so the targets a lease keeps are too (R-SAFE-3).
            return wire.Reject(
                code=wire.RejectCode.INVALID,
                reason=f"readers={msg.readers}, reader={msg.reader}: must be in "
                f"[1, {MAX_READERS}] and [0, {MAX_READERS})",
            )
        final = wire.Notice(
            kind=wire.NoticeKind.PUSHED,
            request_id=msg.request_id,
            engine_id=self._config.engine_id,
            incarnation=self._local.incarnation,
            block_ids=msg.block_ids,
            capability=msg.capability,
            source=msg.source,
        )
        # Encoded before the lock (signing costs ~75 µs cold); the consumer learns
        # these bytes now, so that it recognises the notice when it arrives instead of
        # decoding and authenticating it on the transfer's path.
        encoded = (time.monotonic(), self._local.encode(final))
        ack = wire.Ack(notice=encoded[1], stall_limit_s=self._stall_announced)
        with self._lock:
            ended = leases.ended_unwritten(msg.request_id)
            if ended is not None:
                # Its hold ended before this registration came (a consumer's abort
                # overtook it): a lease made now would wait for a hold that already
                # came and went, and keep the consumer's blocks quarantined until it
                # expired; refused, the consumer fails at once.
                return wire.Reject(
                    code=wire.RejectCode.UNKNOWN_REQUEST,
                    reason=f"request {msg.request_id}: its hold ended ({ended}) before "
                    "this registration; nothing will be written",
                )
            if leases.ended_pushed(msg.request_id, msg.capability):
                # A retry of a registration whose writes all landed (its first answer
                # was lost): answered as taken, with no lease, which would wait for a
                # hold that already came and went until lease_s.
                return msgspec.structs.replace(ack, request_id=msg.request_id, notice=b"")
            held = leases.held.get(msg.request_id)
            refusal = self._refusal(held, msg)
            if refusal is not None:
                leases.reject()
                return refusal
            if held is None and not leases.registration_room(msg.request_id):
                return wire.Reject(
                    code=wire.RejectCode.NOT_READY,
                    reason="too many push registrations waiting for their prefill; retry",
                )
            lease = leases.lease(
                msg.request_id, (), msg.num_tokens, time.time() + self._config.lease_s
            )
            bound = lease.consumer
            if bound is not None and _same_consumer(bound, msg):
                slot = lease.targets.get(msg.reader)
                if slot is not None and slot.parts_posted:
                    # A retry, writes under way.
                    return msgspec.structs.replace(ack, request_id=msg.request_id, notice=b"")
                if msg.readers != lease.readers:
                    return wire.Reject(
                        code=wire.RejectCode.INVALID,
                        reason=f"request {msg.request_id}: readers {msg.readers} differs "
                        f"from its other consumer ranks' {lease.readers}",
                    )
            elif bound is not None:
                # Before hold(): which of them is the consumer is known only when the
                # hold brings the router's capability (LeaseBook.arm keeps that one).
                lease.rivals.append((msg, encoded))
                return ack
            lease.targets[msg.reader] = Target(register=msg, final_notice=encoded)
            lease.readers = msg.readers
            leases.registered(msg.request_id)
        self._runtime.wake()
        return ack

    @staticmethod
    def _refusal(held: Lease | None, msg: wire.PushRegister) -> wire.Reject | None:
        """Why ``msg`` may not register for ``held`` (None: it may), R-SAFE-3.

        A hold whose capability the router minted (``pinned``) takes only a registration
        that shows it. Otherwise a request is bound to the consumer that registered
        first, so a stranger re-sending a registration cannot redirect its KV; before
        hold() a few others wait beside it (``MAX_RIVALS``).
        """
        if held is None:
            return None
        if held.pinned:
            if wire.capability_matches(held.capability, msg.capability):
                return None
            return wire.Reject(
                code=wire.RejectCode.INVALID,
                reason=f"request {msg.request_id}: the registration lacks the hold's capability",
            )
        bound = held.consumer
        if bound is None or _same_consumer(bound, msg):
            return None
        if not held.ready and len(held.rivals) < MAX_RIVALS:
            return None
        return wire.Reject(
            code=wire.RejectCode.INVALID,
            reason=f"request {msg.request_id} is registered by another consumer",
        )

    def resume(self) -> None:
        """Under the lock, from a tick: write the ready leases whose consumer registered
        after their hold() (from the writer thread)."""
        for lease in list(self._leases.held.values()):
            if lease.ready and lease.targets and not lease.all_written:
                self.start(lease, engine=False)

    def start(self, lease: Lease, *, engine: bool = True) -> list[Write]:
        """Under the lock: write what is left of a ready lease to each consumer rank
        that registered for it. Returns the writes for the engine's call to post itself
        after the lock (:meth:`post_inline`; ``engine``: it is the engine's call)."""
        if not lease.ready:
            return []
        total = max((len(g) for g in lease.blocks), default=0)
        writes = []
        for slot in list(lease.targets.values()):
            if not slot.final_posted:
                writes.append(
                    self.write(lease, slot, slot.pushed_blocks, total, final=True, engine=engine)
                )
        return [w for w in writes if w is not None]

    def stream(self, request_id: str, groups: tuple[tuple[int, ...], ...], num_tokens: int) -> None:
        """The engine's :meth:`Agent.stream <kvxfer.agent.Agent.stream>` (push_stream):
        write the blocks closed so far, whole ones before ``num_tokens``, to every
        consumer rank registered (the rest go with :meth:`start`)."""
        closed = num_tokens // self._local.block_size
        writes = []
        with self._lock:
            lease = self._leases.lease(
                request_id, groups, num_tokens, time.time() + self._config.lease_s
            )
            lease.blocks, lease.num_tokens = groups, num_tokens
            for slot in list(lease.targets.values()):
                if closed > slot.pushed_blocks and not slot.final_posted:
                    writes.append(
                        self.write(
                            lease, slot, slot.pushed_blocks, closed, final=False, engine=True
                        )
                    )
                    slot.pushed_blocks = closed
        self.post_inline([w for w in writes if w is not None])  # outside the lock

    def write(
        self,
        lease: Lease,
        slot: Target,
        start: int,
        stop: int,
        *,
        final: bool,
        engine: bool = False,
    ) -> Write | None:
        """Under the lock: queue one WRITE of blocks ``[start, stop)`` of a lease to
        the consumer rank of ``slot`` (R-XFER-2/3).

        The handshake with the consumer (which can take a timeout when it is gone) runs
        on an io worker, never under the lock, while the writes to that consumer wait in
        order and the writer thread goes on with other consumers'. One writer keeps a
        request's writes in order. Each write's notice names the blocks it covers, and
        the last one says it is final, so the consumer settles only when no block is
        missing. ``engine``: the engine's call may post the write itself after the lock
        (see :class:`~kvxfer.agent_config.PushPost`), when the writer has nothing queued
        that it could overtake; the write is then returned instead of queued.
        """
        target = slot.register
        layout = self._local.exposed_layout
        assert layout is not None
        block_size = layout.block_size
        slot.parts_posted += 1
        if final:
            slot.final_posted = True
        # A consumer whose leading blocks are local prefix-cache hits registers only the
        # request's last blocks: skip as many of ours (per group) and write the suffix.
        if final:
            offsets = [max(0, len(g) - len(t)) for g, t in zip(lease.blocks, target.block_ids)]
        else:
            # Mid-stream our lists hold the blocks closed so far, not the request's: the
            # consumer's skip is its request's blocks less those it registered.
            whole = -(-target.num_tokens // block_size)
            offsets = [max(0, whole - len(t)) for t in target.block_ids]
        local = tuple(g[max(start, o) : stop] for g, o in zip(lease.blocks, offsets))
        remote = tuple(t[max(start, o) - o : stop - o] for t, o in zip(target.block_ids, offsets))
        first = max(start, offsets[0]) if offsets else start
        transfer = self._runtime.new_transfer(lease.request_id, local)
        lease.writes.append(transfer)
        transfer.meta.write = WriteState(lease=lease.request_id)
        transfer.meta.on_settled = self._settle_write
        # Tokens inside the written slice: whole blocks, except the request's tail.
        tokens = lease.num_tokens - first * block_size if final else (stop - first) * block_size
        early, slot.final_notice = (slot.final_notice if final else None), None
        # A stream's lists are whole blocks from block 0; the hold's end at its last token.
        held = lease.num_tokens if final else max(map(len, lease.blocks), default=0) * block_size
        span = Span(
            blocks=lease.blocks,
            held_tokens=held,
            start=start * block_size,
            stop=lease.num_tokens if final else stop * block_size,
            final=final,
        )
        job = Write(transfer, slot, target, local, remote, max(tokens, 0), final, early, span)
        if engine and self._pusher.idle and self._inline:
            return job
        self._pusher.submit(self._post_write, job)
        return None

    def _post_write(self, job: Write, peer: Peer | None = None) -> None:
        transfer, target = job.transfer, job.target
        if peer is None:
            # On the writer thread: a consumer not connected yet is handshaken on an io
            # worker, its writes parked in order until then (:meth:`_handshaken`).
            key = _key(target)
            parked = self._parked.get(key)
            if parked is not None:
                parked.append(job)
                return
            peer = self._peers.cached(*key)
            if peer is None:
                self._parked[key] = [job]
                if not self._io.submit(self._handshake, key):  # the agent is closing
                    self._handshaken(key, None, TransferError("the agent closed"), False)
                return
        write = transfer.meta.write
        assert write is not None
        write.consumer = job.slot.peer = peer
        if transfer.done:  # failed meanwhile (agent closing, lease gone)
            return
        ratio = None
        try:
            # A consumer of another TP size: this rank writes only the heads that
            # consumer rank holds and reads from this rank (None: the whole blocks).
            plan = self._planner.plan(peer, target, job.local, job.remote, job.tokens)
            theirs = peer.info.layout.block_size
            if theirs != self._local.block_size:
                # Another block size (the handshake allowed a whole multiple): the
                # write's tokens paired unit by unit, posted as address runs.
                ratio = plan_ratio(
                    job.span,
                    target,
                    block_size=self._local.block_size,
                    consumer_block_size=theirs,
                    plan=self._config.plan,
                )
                transfer.local_blocks = ratio.local
                job = msgspec.structs.replace(job, local=ratio.local, remote=ratio.remote)
        except KvxferError as exc:
            self._runtime.fail(transfer, FailureKind.POST, exc)
            return
        notice = self._pushed_notice(target, job.remote, job.final, job.early)
        if not any(job.local):
            # Everything was streamed already: only the final notice is left to send.
            try:
                self._backend.notify(peer.handle, notice)
            except KvxferError as exc:
                self._runtime.fail(transfer, FailureKind.PEER_GONE, exc)
                return
            self._runtime.succeed(transfer)
            return
        t0 = time.monotonic()
        # The job's blocks were checked when the engine called (Agent.push, stream).
        work: Plan | ChainPlan | Runs | UnitPairing | blocks.Pairing
        if ratio is not None:
            work = ratio.pairing
        else:
            work = (
                plan
                if isinstance(plan, Runs)
                else plan
                or blocks.Pairing(
                    blocks.from_wire(job.local), blocks.from_wire(job.remote), job.tokens
                )
            )
        self._runtime.post(transfer, XferOp.WRITE, peer, work, notice)
        if _timeline.isEnabledFor(logging.DEBUG):
            _timeline.debug(
                "TL push_post %s %.6f end=%.6f bytes=%d final=%d",
                transfer.request_id,
                t0,
                time.monotonic(),
                transfer.stats.bytes,
                int(job.final),
            )

    def _handshake(self, key: _Key) -> None:
        """On an io worker: connect to the consumer of the writes parked at ``key``."""
        gave_up = False

        def cancel() -> bool:
            # Given up once every write parked for it failed (its lease expired or was
            # freed): a consumer that went mute mid-handshake keeps no io worker for
            # every handshake try. (Every failure is doomed first: Runtime.post's rule.)
            nonlocal gave_up
            gave_up = self._abandoned(key)
            return gave_up

        try:
            peer = self._peers.get(*key, cancel=cancel)
        except KvxferError as exc:
            self._pusher.submit(self._handshaken, key, None, exc, gave_up)
            return
        self._pusher.submit(self._handshaken, key, peer, None, False)

    def _abandoned(self, key: _Key) -> bool:
        return all(job.transfer.meta.doomed is not None for job in tuple(self._parked.get(key, ())))

    def _handshaken(
        self, key: _Key, peer: Peer | None, error: KvxferError | None, gave_up: bool
    ) -> None:
        """On the writer thread: post the writes parked at ``key`` in order, or fail
        them. A handshake given up because its writes had failed says nothing of the
        consumer: a write parked after that decision is handshaken for anew."""
        jobs = self._parked.pop(key, [])
        live = [job for job in jobs if job.transfer.meta.doomed is None]
        if peer is None and gave_up and live:
            self._parked[key] = live
            if self._io.submit(self._handshake, key):
                return
            del self._parked[key]  # the agent is closing
        for job in jobs:
            if peer is None:
                assert error is not None
                self._runtime.fail(job.transfer, FailureKind.HANDSHAKE, error)
                continue
            try:
                self._post_write(job, peer)
            except Exception as exc:  # one write's failure must not strand the others
                self._runtime.fail(job.transfer, FailureKind.POST, exc)

    def _pushed_notice(
        self,
        target: wire.PushRegister,
        remote: tuple[tuple[int, ...], ...],
        final: bool,
        early: tuple[float, bytes] | None,
    ) -> bytes:
        """The PUSHED notice of one write. The common one, a single final write of every
        block the consumer registered, was encoded when the registration arrived (off
        the write's path); signed ones only while their timestamp is fresh."""
        if (
            early is not None
            and final
            and remote == target.block_ids
            and (self._local.auth_key is None or time.monotonic() - early[0] < NOTICE_REUSE_S)
        ):
            return early[1]
        return self._local.encode(
            wire.Notice(
                kind=wire.NoticeKind.PUSHED,
                request_id=target.request_id,
                engine_id=self._config.engine_id,
                incarnation=self._local.incarnation,
                block_ids=remote,
                final=final,
                capability=target.capability,
                source=target.source,
            )
        )

    def _settle_write(self, transfer: Transfer, ok: bool) -> None:
        """A write settled (under the lock): free the lease when every consumer rank got
        all its writes, or on failure (telling every consumer rank, which then stops
        waiting)."""
        if transfer.meta.write is None:
            return
        rid = transfer.meta.write.lease
        draining = self._leases.draining.get(rid)
        if draining is not None:
            # A freed lease's write ended: once the last did, no byte of the request
            # can land any more, and only now may its consumers reuse their blocks.
            ended, why = draining
            if not any(w.state is TransferState.PENDING for w in ended.writes):
                del self._leases.draining[rid]
                self._tell_failed(ended, why)
            return
        lease = self._leases.held.get(rid)
        if lease is None:
            return
        if not ok:
            # Freeing fails the other writes in flight; the consumers hear FAILED once
            # none of them can land any more (on_free).
            self._leases.free(rid, FreeReason.RELEASED, wire.HoldState.FAILED)
            draining = self._leases.draining.get(rid)
            # The consumer hears why (a backend that posts no address runs, named),
            # not only that its request failed.
            why = f"a write failed: {transfer.error}"[:1024]
            if draining is None:
                self._tell_failed(lease, why)
            else:
                self._leases.draining[rid] = (lease, why)
            return
        if lease.all_written and all(w.state is TransferState.DONE for w in lease.writes):
            self._leases.free(rid, FreeReason.DONE, wire.HoldState.PUSHED)

    def _tell_failed(self, lease: Lease, reason: str) -> None:
        """Under the lock: send each consumer rank written to a FAILED notice (it stops
        waiting; one that no write reached yet learns it from its probe)."""
        for slot in lease.targets.values():
            peer, target = slot.peer, slot.register
            if peer is None:
                continue
            failed = wire.Notice(
                kind=wire.NoticeKind.FAILED,
                request_id=target.request_id,
                engine_id=self._config.engine_id,
                incarnation=self._local.incarnation,
                reason=reason,
                capability=target.capability,
                source=target.source,
            )
            try:
                self._backend.notify(peer.handle, self._local.encode(failed))
            except KvxferError as exc:
                log.debug("could not tell the consumer about the failed push: %s", exc)

    def on_free(self, lease: Lease, reason: FreeReason) -> None:
        """Under the lock, as a lease is freed (before the engine gets its blocks):
        each write still in flight is failed. A transport that can cancel stops it at
        once; over NIXL it goes on until it completes or fails, so the consumers are
        told FAILED only when the last one ended (R-SAFE-5): that notice is their
        proof that no byte of the request can land in their blocks any more. Probes
        meanwhile hear WRITING."""
        pending = [w for w in lease.writes if w.state is TransferState.PENDING]
        if reason is FreeReason.DONE or not pending:
            return
        for w in pending:
            self._runtime.fail(
                w,
                FailureKind.ABORTED,
                TransferError(f"the hold of {lease.request_id} was {reason.text} mid-write"),
                FailureStage.TRANSFER,
            )
        if any(w.state is TransferState.PENDING for w in lease.writes):
            self._leases.draining[lease.request_id] = (lease, reason.text)
        else:
            self._tell_failed(lease, reason.text)


def _same_consumer(a: wire.PushRegister, b: wire.PushRegister) -> bool:
    """Whether two registrations come from one consumer: the same capability, or none
    on either (an older consumer that does not send one)."""
    return wire.capability_matches(a.capability, b.capability) or not (a.capability or b.capability)
