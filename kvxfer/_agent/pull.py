"""The consumer's side of a pull: from a ticket to a posted, fail-closed READ.

:meth:`Puller.pull` checks the local block ids against the ticket's, makes the
transfer, and posts its READ (:meth:`Runtime.post <kvxfer._agent.runtime.Runtime.post>`) on
the caller's thread when the producer is a known peer, else after a first-contact
handshake on an io worker. A guarded pull reads the producer's guard word after its
data; its DONE goes to the producer only then, over the side channel, and a pull that
fails tells its producer to release at once (R-SAFE-4). Across TP sizes the request is
read from several producer ranks (:mod:`kvxfer._agent.tp_pull`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import msgspec

from kvxfer._agent.gather_pull import GatherPuller
from kvxfer._agent.local import LocalEnd
from kvxfer._agent.peers import Peer, PeerCache, refused_pairing
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.side_channel import SideChannel
from kvxfer._agent.tp_producers import ProducerGroup
from kvxfer._agent.tp_pull import TPPuller
from kvxfer._agent.workers import IoPool
from kvxfer.backend import XferOp
from kvxfer.core import blocks, wire
from kvxfer.core.blocks import BlockIds, Pairing
from kvxfer.core.ratio import UnitPairing, pair_ratio
from kvxfer.errors import ConfigError, KvxferError, LayoutMismatch, PlanError
from kvxfer.ticket import Ticket
from kvxfer.transfer import FailureKind, PullState, Transfer

__all__ = ["Puller"]

log = logging.getLogger("kvxfer.agent")


class Puller:
    """A consumer's pulls (internal).

    Args:
        local: Identity, registered memory and message signing.
        peers: The producers, handshaken once per incarnation.
        runtime: Posts and settles the READs.
        side: Sends the producer its Release (done, failed or aborted).
        io: Worker threads for first contacts and releases.
        tp: Pulls of tickets from a producer of another TP size.
        group: That producer group's ranks (which a ticket involves, their releases).
        gather: Takes a pull through the staging slots where that pays (issue 55);
            None: every pull goes direct.
    """

    def __init__(
        self,
        local: LocalEnd,
        peers: PeerCache,
        runtime: Runtime,
        side: SideChannel,
        io: IoPool,
        tp: TPPuller,
        group: ProducerGroup,
        gather: GatherPuller | None = None,
    ) -> None:
        self._local = local
        self._gather = gather
        self._peers = peers
        self._runtime = runtime
        self._side = side
        self._io = io
        self._tp = tp
        self._group = group

    def pull(
        self,
        ticket: Ticket,
        local_blocks: BlockIds,
        *,
        num_tokens: int | None = None,
        cached_blocks: int = 0,
    ) -> Transfer:
        """:meth:`Agent.pull <kvxfer.agent.Agent.pull>` (its docstring says what it
        raises)."""
        across_tp = self._group.wants(ticket)
        # A ticket tp_size the heads do not allow raises here, before anything is checked.
        sources = self._group.sources(ticket) if across_tp else None
        tokens = ticket.num_tokens if num_tokens is None else num_tokens
        rules = self._local.require_rules()
        pairing: Pairing | UnitPairing
        try:
            if ticket.block_size and ticket.block_size != rules.block_size:
                # The producer's blocks hold another token count (kvxfer.core.ratio).
                if across_tp:
                    raise PlanError(
                        f"request {ticket.request_id!r}: blocks of {rules.block_size} "
                        f"tokens here and {ticket.block_size} at the producer, across TP "
                        "sizes: different block sizes are served between equal TP sizes only"
                    )
                plan = self._local.config.plan
                if plan.chunk_mode or plan.swa_window_mode:
                    raise PlanError(
                        f"request {ticket.request_id!r}: blocks of {rules.block_size} "
                        f"tokens here and {ticket.block_size} at the producer: chunk_mode "
                        "and swa_window_mode cut blocks of one size only; turn them off"
                    )
                pairing = pair_ratio(
                    local_blocks,
                    ticket.block_ids,
                    rules,
                    num_tokens=tokens,
                    remote_num_tokens=ticket.num_tokens,
                    remote_block_size=ticket.block_size,
                    cached_blocks=cached_blocks,
                    request_id=ticket.request_id,
                )
            else:
                pairing = blocks.pair(
                    local_blocks,
                    ticket.block_ids,
                    rules,
                    num_tokens=tokens,
                    remote_num_tokens=ticket.num_tokens,
                    cached_blocks=cached_blocks,
                    request_id=ticket.request_id,
                )
        except (PlanError, LayoutMismatch):
            # Nothing will be read: let the producer free its blocks now, not at lease expiry.
            if across_tp:
                self._group.release_all(ticket)
            else:
                self.abort(ticket)
            raise
        if sources is not None:
            assert isinstance(pairing, Pairing)  # a ratio across TP sizes raised above
            return self._tp.pull(ticket, pairing, sources)
        runtime = self._runtime
        transfer = runtime.new_transfer(ticket.request_id, blocks.to_wire(pairing.local))
        meta = transfer.meta
        meta.capability = ticket.capability
        meta.producer_at = (ticket.host, ticket.port)
        meta.pull = PullState(lease_expiry=ticket.lease_expiry or None)
        if ticket.lease_expiry and runtime.lease_over(ticket.lease_expiry):
            runtime.fail(
                transfer, FailureKind.LEASE_EXPIRED, runtime.expired_error(ticket.request_id)
            )
            return transfer
        peer = self._peers.cached(
            ticket.host, ticket.port, ticket.engine_id, ticket.incarnation or None
        )
        if peer is not None:
            self._start(transfer, peer, ticket, pairing)
        else:
            # A first contact handshakes on a worker thread: the engine's step loop never
            # waits for a peer (which can take the whole handshake timeout if it is gone).
            self._io.submit(self._connect_and_start, transfer, ticket, pairing)
        return transfer

    def connected(self, peer: Peer) -> None:
        """The engine connected to ``peer`` ahead of its pulls: prepare what they
        need (across TP sizes, the planner; :meth:`TPPuller.prepare
        <kvxfer._agent.tp_pull.TPPuller.prepare>`)."""
        self._tp.prepare(peer)

    def abort(self, ticket: Ticket, *, wait: bool = False) -> None:
        """:meth:`Agent.abort <kvxfer.agent.Agent.abort>`."""
        capability = ticket.capability or self._runtime.capability_of(ticket.request_id)
        self._runtime.abort_request(ticket.request_id)
        ticket = msgspec.structs.replace(ticket, capability=capability)
        if self._group.wants(ticket):
            # Across TP sizes: every producer rank this rank reads (or is the one to
            # release, for replicas nobody reads) frees it, counted as one reader.
            try:
                self._group.release_all(ticket)
            except ConfigError as exc:
                log.warning("could not release %s: %s", ticket.request_id, exc)
            return
        if not wait:
            if not self._runtime.closed:
                self._io.submit(self._side.release, ticket)
            return
        self._side.release(ticket)

    def _connect_and_start(
        self, transfer: Transfer, ticket: Ticket, pairing: Pairing | UnitPairing
    ) -> None:
        try:
            # A producer that answers late (frozen, starved) is tried until the pull's
            # deadline; one whose port refuses fails it at once (R-SAFE-6).
            peer = self._peers.get(
                ticket.host,
                ticket.port,
                ticket.engine_id,
                ticket.incarnation or None,
                until=transfer.deadline,
            )
        except KvxferError as exc:
            self._runtime.fail(transfer, FailureKind.HANDSHAKE, exc)
            if refused_pairing(exc):
                # The producer answered and refused to pair (layout, role): nothing will
                # be read, so it frees the blocks now rather than at lease expiry. We are
                # on a worker thread already. A producer that did not answer cannot be
                # told; one that answered as another engine or incarnation does not
                # hold this ticket's lease.
                self._side.release(ticket)
            return
        self._start(transfer, peer, ticket, pairing)

    def _release_after(self, ticket: Ticket, pull: PullState) -> None:
        """A pull that fails from now on tells its producer to release at once."""
        pull.release = self._teller(ticket)

    def _teller(self, ticket: Ticket) -> Callable[[str], None]:
        """Tells ``ticket``'s producer how its pull ended (``PullState.release``)."""

        def release(reason: str) -> None:
            # "": the pull is DONE (its guard word checked); else why it failed. One
            # short try (see SideChannel.release), on an io worker.
            tell = functools.partial(
                self._side.release,
                ticket,
                reason=f"pull failed: {reason}" if reason else "",
                done=not reason,
                brief=True,
            )
            self._io.submit(tell)

        return release

    def _start(
        self, transfer: Transfer, peer: Peer, ticket: Ticket, pairing: Pairing | UnitPairing
    ) -> None:
        # Encoded only where it goes as a notification (an unguarded pull's, on its
        # data): a guarded pull tells DONE over the side channel (_release_after).
        def notice() -> bytes:
            return self._local.encode(
                wire.Notice(
                    kind=wire.NoticeKind.DONE,
                    request_id=ticket.request_id,
                    engine_id=self._local.config.engine_id,
                    incarnation=self._local.incarnation,
                    capability=ticket.capability,
                )
            )

        pull = transfer.meta.pull
        assert pull is not None
        if transfer.done:
            # Settled meanwhile: the agent closed, or the pull failed while its first
            # contact handshook (its deadline passed; an abort told the producer
            # itself). The producer answered that handshake, so it frees the blocks
            # now rather than at lease expiry (R-SAFE-4).
            failure = transfer.stats.failure
            if failure not in (None, FailureKind.ABORTED) and not self._runtime.closed:
                self._teller(ticket)(f"{failure.value}: {transfer.error}")
            return
        self._release_after(ticket, pull)
        if not self._runtime.arm_guard(
            transfer, peer, ticket.guard_slot, ticket.generation, notice
        ):
            return
        on_data = b"" if pull.guard is not None else notice()
        direct = functools.partial(
            self._runtime.post, transfer, XferOp.READ, peer, pairing, on_data
        )
        if self._gather is None:
            direct()
            return
        work = self._gather.start(transfer, peer, ticket, pairing, direct)
        if work is None:
            # Gathered: its DONE goes over the side channel once the last round was
            # scattered (the settler sends it through pull.release, guarded or not).
            if pull.done_notice is None:
                pull.done_notice = notice
            transfer.meta.peer = peer
            return
        # Direct, with the plan the choice made where it made one.
        self._runtime.post(transfer, XferOp.READ, peer, work, on_data)
