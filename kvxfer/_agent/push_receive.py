"""The consumer's side of a push: registering receiving blocks with the producer.

:meth:`PushReceiver.expect` makes the reception (awaited by
:class:`~kvxfer._agent.receptions.Receptions` until the producer's PUSHED notices cover its
blocks) and sends the :class:`~kvxfer.core.wire.PushRegister` from an io worker. From the
registration's send on, the producer may write into the blocks (R-SAFE-5): a
registration that got no answer leaves the reception quarantined until a probe of the
producer's hold says no write can come. Across TP sizes one reception per producer
rank (:mod:`kvxfer._agent.tp_push_receive`).
"""

from __future__ import annotations

import time

from kvxfer._agent.local import LocalEnd
from kvxfer._agent.receptions import Receptions
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.side_channel import SideChannel
from kvxfer._agent.tp_producers import ProducerGroup
from kvxfer._agent.tp_push_receive import TPReceiver
from kvxfer._agent.workers import IoPool
from kvxfer.core import blocks, wire
from kvxfer.core.descriptors import plan_pairing
from kvxfer.errors import ConfigError, HandshakeRejected, KvxferError
from kvxfer.ticket import Ticket
from kvxfer.transfer import FailureKind, FailureStage, ReceptionState, Transfer

__all__ = ["PushReceiver"]


class PushReceiver:
    """A consumer's push receptions (internal).

    Args:
        local: Identity and registered memory.
        runtime: Makes, fails and wakes for the receptions.
        receptions: Where the receptions await their notices.
        side: Sends the registrations (this agent's address goes in them).
        io: Worker threads the registrations go from.
        group: The producer group's ranks when its TP size differs from ours.
        agent_name: The backend's name of this agent (the producer writes to it).
    """

    def __init__(
        self,
        local: LocalEnd,
        runtime: Runtime,
        receptions: Receptions,
        side: SideChannel,
        io: IoPool,
        group: ProducerGroup,
        agent_name: str,
    ) -> None:
        self._local = local
        self._runtime = runtime
        self._receptions = receptions
        self._side = side
        self._io = io
        self._group = group
        self._agent_name = agent_name
        # Push receptions from a producer of another TP size (one per producer rank).
        self._tp_push = TPReceiver(local, group, runtime, receptions, io, self._register)

    def expect(self, ticket: Ticket, local: blocks.Groups, tokens: int) -> Transfer:
        """Register ``local`` (checked already) with the ticket's producer; the agent
        serves its side channel already.

        Raises:
            ConfigError: see :meth:`Agent.expect_push <kvxfer.agent.Agent.expect_push>`.
        """
        table, _ = self._local.require_registered()
        groups = blocks.to_wire(local)
        runtime = self._runtime
        if self._group.wants(ticket):
            try:
                nbytes = plan_pairing(table, table, blocks.Pairing(local, local, tokens)).nbytes
            except KvxferError:
                nbytes = 0  # the producer ranks' plans say why
            if not ticket.capability:
                # Each rank minting its own would make a producer rank writing to two
                # of them see two consumers, and refuse the second.
                raise ConfigError(
                    "ticket.capability",
                    "",
                    "a push across TP sizes needs the request's capability on the ticket, "
                    "the same on every consumer rank (Ticket.for_push(capability=...))",
                )
            return self._tp_push.expect(
                ticket,
                local,
                tokens,
                ticket.capability,
                nbytes,
                self._side.address,
                self._agent_name,
            )
        transfer = runtime.new_transfer(ticket.request_id, groups)
        reception = transfer.meta.reception = ReceptionState(
            producer_incarnation=ticket.incarnation
        )
        # Probed while its registration has not returned (a producer that died refuses
        # its port at once; the registration's own timeout is seconds per try).
        transfer.meta.producer_at = (ticket.host, ticket.port)
        # Binds the registration to us: notices must echo it, and a later registration
        # of this request id by anyone else is refused (R-SAFE-3). A router that minted
        # the request's capability gave it to both sides (the ticket's): the producer's
        # hold then takes no registration without it.
        transfer.meta.capability = ticket.capability or wire.new_capability()
        # The bytes the producer will write are the bytes our own plan of these blocks
        # covers (both sides share the layout shape); computed here for the stats.
        try:
            plan = plan_pairing(table, table, blocks.Pairing(local, local, tokens))
            transfer.stats.bytes, transfer.stats.descriptors = plan.nbytes, plan.num_descriptors
        except KvxferError as exc:
            runtime.fail(transfer, FailureKind.POST, exc)
            return transfer
        self._receptions.expect(transfer)
        reception.writer_live = True  # from the registration on (R-SAFE-5)
        host, port = self._side.address
        msg = wire.PushRegister(
            request_id=ticket.request_id,
            engine_id=self._local.config.engine_id,
            incarnation=self._local.incarnation,
            block_ids=groups,
            num_tokens=tokens,
            agent_name=self._agent_name,
            host=host,
            port=port,
            capability=transfer.meta.capability,
        )
        # The registration is a side-channel round trip (a timeout when the producer is
        # gone): it goes from a worker thread, and a failure lands on the transfer.
        self._io.submit(self._register, ticket, msg, transfer)
        # Awaiting notices now: out of its idle nap, the progress thread polls them at
        # the in-flight pace (or, if a thread waits on this transfer, leaves that to it).
        runtime.nudge()
        return transfer

    def _register(self, ticket: Ticket, msg: wire.PushRegister, transfer: Transfer) -> None:
        """Send one registration to one producer (rank), on an io worker; a failure
        lands on ``transfer``."""
        reception = transfer.meta.reception
        assert reception is not None
        try:
            reply = self._side.request(ticket.host, ticket.port, msg)
        except KvxferError as exc:
            # Refused: the producer will never write. No answer: it may have taken the
            # registration all the same, so the reception stays quarantined until a
            # probe of its hold says no write can come (R-SAFE-5).
            refused = isinstance(exc, HandshakeRejected)
            if not refused:
                reception.push_from = (ticket.host, ticket.port)
            self._runtime.fail(
                transfer, FailureKind.HANDSHAKE, exc, FailureStage.REGISTRATION, quiet=refused
            )
            return
        if isinstance(reply, wire.Ack):
            reception.producer_stall_s = reply.stall_limit_s
            if reply.notice:
                self._receptions.learn_final_notice(transfer, reply.notice)
        # Registered: from now on a quiet reception asks this producer how it stands.
        transfer.meta.last_progress = time.monotonic()
        reception.push_from = (ticket.host, ticket.port)
