"""The producer's side of a push: the writer that moves held blocks to the consumer.

A consumer registers its receiving blocks (:class:`~kvxfer.wire.PushRegister`, on the
side channel); once the engine's :meth:`~kvxfer.agent.Agent.hold` marks the prompt
ready, the lease's blocks are written to it (R-XFER-2), early ones during prefill with
``push_stream`` (R-XFER-3).

Who posts a write (:class:`~kvxfer.agent.PushPost`): by default on backends that move
engine memory directly, the engine's own ``hold()``/``stream()`` call, when the
consumer is already connected and the writer thread has nothing queued (so a request's
writes stay in order); everything else (a first contact's handshake, a registration
that arrives after ``hold()``, staging backends) goes to one ordered writer thread. A
writer thread costs a thread wake and a GIL hand-off per write, and behind an engine
thread that keeps running Python it waits up to the interpreter's switch interval
(5 ms) for the GIL at every step of the post.
"""

from __future__ import annotations

import logging
import time

from kvxfer import wire
from kvxfer._agent_runtime import AgentRuntime
from kvxfer._agent_types import Lease, PushPost
from kvxfer._peers import Peer
from kvxfer._serial import SerialWorker
from kvxfer.backend import XferOp
from kvxfer.errors import KvxferError
from kvxfer.transfer import FailureKind, Transfer, TransferState
from kvxfer.types import Direction

__all__ = ["InlineWrite", "PushProducer"]

log = logging.getLogger("kvxfer.agent")

#: A signed notice encoded ahead is used only this long after (the receiver refuses
#: notices whose timestamp is far from its clock).
NOTICE_REUSE_S = 60.0


#: One write the engine's call posts itself once the agent lock is released: the
#: arguments of :meth:`PushProducer._post_write` (transfer, target, local, remote,
#: tokens, final, early notice).
InlineWrite = tuple[
    Transfer,
    wire.PushRegister,
    tuple[tuple[int, ...], ...],
    tuple[tuple[int, ...], ...],
    int,
    bool,
    tuple[float, bytes] | None,
]


class PushProducer(AgentRuntime):
    """The push writer of an :class:`~kvxfer.agent.Agent` (internal)."""

    _pusher: SerialWorker

    def _posts_inline(self) -> bool:
        """Whether the engine's calls post writes themselves (:class:`PushPost`)."""
        mode = self.config.push_post
        if mode is PushPost.AUTO:
            # A staging backend's post also copies the blocks out on the CPU first.
            return not self._stages
        return mode is PushPost.ENGINE

    def _post_inline(self, writes: list[InlineWrite]) -> None:
        """Post writes collected under the lock, on this (the engine's) thread; one
        whose consumer is not connected yet goes to the writer (a handshake never runs
        on the engine's thread)."""
        for job in writes:
            target = job[1]
            peer = self._peers.cached(
                target.host, target.port, target.engine_id, target.incarnation
            )
            if peer is None:
                self._pusher.submit(self._post_write, *job)
                continue
            try:
                self._post_write(*job, peer=peer)
            except Exception as exc:  # never into the engine's step: fail the write
                self._fail(job[0], FailureKind.POST, exc)

    def _on_push_register(self, msg: wire.PushRegister) -> wire.Message:
        """A consumer registered its receiving blocks (side-channel server thread)."""
        if self.config.direction is not Direction.PUSH:
            return wire.Reject(
                code=wire.RejectCode.UNKNOWN_REQUEST, reason="this instance does not push"
            )
        with self._lock:
            lease = self._leases.get(msg.request_id)
            if lease is None:
                lease = Lease(
                    request_id=msg.request_id,
                    blocks=(),
                    num_tokens=msg.num_tokens,
                    expiry=time.time() + self.config.lease_s,
                )
                self._leases[msg.request_id] = lease
            lease.target = msg
        final = wire.Notice(
            kind=wire.NoticeKind.PUSHED,
            request_id=msg.request_id,
            engine_id=self.config.engine_id,
            incarnation=self.incarnation,
            block_ids=msg.block_ids,
        )
        encoded = (time.monotonic(), self._encode(final))
        with self._lock:
            current = lease.target is msg
            if current:
                lease.final_notice = encoded
        self._wake.set()
        # The consumer learns these bytes now, so that it recognises the notice when it
        # arrives instead of decoding and authenticating it on the transfer's path.
        return wire.Ack(notice=encoded[1] if current else b"")

    def _start_push(self, lease: Lease, inline: list[InlineWrite] | None = None) -> None:
        """Write what is left of a ready lease to the consumer that registered for it."""
        if lease.target is None or not lease.ready or lease.final_posted:
            return
        total = max((len(g) for g in lease.blocks), default=0)
        self._write(lease, lease.pushed_blocks, total, final=True, inline=inline)

    def _write(
        self,
        lease: Lease,
        start: int,
        stop: int,
        *,
        final: bool,
        inline: list[InlineWrite] | None = None,
    ) -> None:
        """Queue one WRITE of blocks ``[start, stop)`` of a lease (R-XFER-2/3).

        Called under the agent lock; the handshake with the consumer (which can take a
        timeout when it is gone) runs on the push worker, never under the lock. One
        worker keeps a request's writes in order. Each write's notice names the blocks
        it covers, and the last one says it is final, so the consumer settles only
        when no block is missing. ``inline``: the engine's call collects the write
        there instead, to post it itself after the lock (see :class:`PushPost`), when
        the writer has nothing queued that it could overtake.
        """
        target = lease.target
        assert target is not None and self.exposed_layout is not None
        block_size = self.exposed_layout.block_size
        lease.parts_posted += 1
        if final:
            lease.final_posted = True
        # A consumer whose leading blocks are local prefix-cache hits registers only the
        # request's last blocks: skip as many of ours (per group) and write the suffix.
        offsets = [max(0, len(g) - len(t)) for g, t in zip(lease.blocks, target.block_ids)]
        local = tuple(g[max(start, o) : stop] for g, o in zip(lease.blocks, offsets))
        remote = tuple(t[max(start, o) - o : stop - o] for t, o in zip(target.block_ids, offsets))
        first = max(start, offsets[0]) if offsets else start
        transfer = self._new_transfer(lease.request_id, local)
        lease.writes.append(transfer)
        transfer.meta["lease"] = lease.request_id
        # Tokens inside the written slice: whole blocks, except the request's tail.
        tokens = lease.num_tokens - first * block_size if final else (stop - first) * block_size
        early, lease.final_notice = (lease.final_notice if final else None), None
        job: InlineWrite = (transfer, target, local, remote, max(tokens, 0), final, early)
        if inline is not None and self._pusher.idle and self._posts_inline():
            inline.append(job)
        else:
            self._pusher.submit(self._post_write, *job)

    def _post_write(
        self,
        transfer: Transfer,
        target: wire.PushRegister,
        local: tuple[tuple[int, ...], ...],
        remote: tuple[tuple[int, ...], ...],
        tokens: int,
        final: bool,
        early: tuple[float, bytes] | None = None,
        peer: Peer | None = None,
    ) -> None:
        if peer is None:
            try:
                peer = self._peers.get(
                    target.host, target.port, target.engine_id, target.incarnation
                )
            except KvxferError as exc:
                self._fail(transfer, FailureKind.HANDSHAKE, exc)
                return
        transfer.meta["push_peer"] = peer
        notice = self._pushed_notice(target, remote, final, early)
        if transfer.done:  # failed meanwhile (agent closing, lease gone)
            return
        if not any(local):
            # Everything was streamed already: only the final notice is left to send.
            try:
                self.backend.notify(peer.handle, notice)
            except KvxferError as exc:
                self._fail(transfer, FailureKind.PEER_GONE, exc)
                return
            self._succeed(transfer)
            return
        self._post(transfer, XferOp.WRITE, peer, local, remote, tokens, notice)

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
            and (self._auth_key is None or time.monotonic() - early[0] < NOTICE_REUSE_S)
        ):
            return early[1]
        return self._encode(
            wire.Notice(
                kind=wire.NoticeKind.PUSHED,
                request_id=target.request_id,
                engine_id=self.config.engine_id,
                incarnation=self.incarnation,
                block_ids=remote,
                final=final,
            )
        )

    def _settle_lease_write(self, transfer: Transfer, ok: bool) -> None:
        """A push write finished: free the lease when every write is done, or on failure."""
        rid = transfer.meta.get("lease")
        if rid is None:
            return
        lease = self._leases.get(rid)
        if lease is None:
            return
        if not ok:
            peer = transfer.meta.get("push_peer")
            if peer is not None and lease.target is not None:
                failed = wire.Notice(
                    kind=wire.NoticeKind.FAILED,
                    request_id=lease.target.request_id,
                    engine_id=self.config.engine_id,
                    incarnation=self.incarnation,
                )
                try:
                    self.backend.notify(peer.handle, self._encode(failed))
                except KvxferError as exc:
                    log.debug("could not tell the consumer about the failed push: %s", exc)
            del self._leases[rid]
            self._freed.append(rid)
            return
        if lease.final_posted and all(w.state is TransferState.DONE for w in lease.writes):
            del self._leases[rid]
            self.stats_counters.leases_released += 1
            self._freed.append(rid)
