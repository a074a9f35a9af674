"""The producer group of another TP size, as one consumer rank sees it.

A consumer rank whose TP size differs from its producer's reads (or receives) each of
its heads from the one producer rank :func:`kvxfer.core.heads.source_ranks` names. Rank *p*
serves its side channel at ``ticket.port + p`` (upstream vLLM's convention) under the
same engine id and request id; ``ticket.incarnations[p]``, when given, is checked
against rank *p*'s. :class:`ProducerGroup` says which ranks a request involves, how
many consumer ranks read each (a producer rank frees once all of them reported,
:mod:`kvxfer._agent.readers`), and tells them to release. The pull
(:mod:`kvxfer._agent.tp_pull`) and the push reception
(:mod:`kvxfer._agent.tp_push_receive`) across TP sizes both use it.
"""

from __future__ import annotations

import functools
import zlib

import msgspec

from kvxfer._agent.local import LocalEnd
from kvxfer._agent.runtime import Runtime
from kvxfer._agent.side_channel import SideChannel
from kvxfer._agent.workers import IoPool
from kvxfer.core.heads import HeadLayout, TPRank, reader_ranks, source_ranks
from kvxfer.errors import ConfigError
from kvxfer.ticket import Ticket
from kvxfer.types import Direction

__all__ = ["ProducerGroup", "rank_ticket"]


def rank_ticket(ticket: Ticket, rank: int) -> Ticket:
    """The ticket of producer rank ``rank`` (its port, its incarnation if known).

    Raises:
        ConfigError: the rank's port is past 65535.
    """
    port = ticket.port + rank
    if port > 65535:
        raise ConfigError("port", ticket.port, f"producer rank {rank}'s port {port} > 65535")
    if rank < len(ticket.incarnations):
        incarnation = ticket.incarnations[rank]
    else:
        incarnation = ticket.incarnation if rank == 0 else 0
    return msgspec.structs.replace(ticket, port=port, incarnation=incarnation)


class ProducerGroup:
    """The producer ranks a consumer rank involves across TP sizes (internal).

    Args:
        local: Identity (``config.tp``).
        runtime: Says whether the agent closed (nothing is sent then).
        io: The agent's worker pool (releases go from there).
        side: Tells a producer rank to release the request.
    """

    def __init__(self, local: LocalEnd, runtime: Runtime, io: IoPool, side: SideChannel) -> None:
        self._local = local
        self._runtime = runtime
        self._io = io
        self._side = side

    def wants(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` is moved across TP sizes (this agent has a TP identity
        and the producer's ``tp_size`` differs from it)."""
        tp = self._local.config.tp
        return tp is not None and ticket.tp_size != tp.heads.tp_size

    @property
    def local_rank(self) -> int:
        """This agent's TP rank (0 without a TP identity)."""
        tp = self._local.config.tp
        return 0 if tp is None else tp.rank

    def tp(self) -> TPRank:
        """This agent's TP identity (ConfigError without one)."""
        tp = self._local.config.tp
        if tp is None:  # wants() said so; a caller skipping it is a bug
            raise ConfigError("tp", None, "a pull across TP sizes needs AgentConfig.tp")
        return tp

    def sources(self, ticket: Ticket) -> tuple[HeadLayout, dict[int, int]]:
        """The producer's head layout and, per local head, the producer rank read.

        Raises:
            ConfigError: the ticket's ``tp_size`` cannot split the model's heads.
        """
        tp = self.tp()
        try:
            producer = tp.heads.for_tp_size(ticket.tp_size)
        except ConfigError as exc:
            raise ConfigError(
                "ticket.tp_size", ticket.tp_size, f"{exc.rule} (the producer's TP size)"
            ) from exc
        salt = zlib.crc32(ticket.request_id.encode())
        return producer, source_ranks(tp.heads, tp.rank, producer, salt=salt)

    def ranks(self, ticket: Ticket) -> tuple[int, ...]:
        """The producer ranks this rank reads ``ticket`` from, ascending."""
        return tuple(sorted(set(self.sources(ticket)[1].values())))

    def release_all(self, ticket: Ticket, ranks: tuple[int, ...] | None = None) -> None:
        """Tell every needed producer rank (or ``ranks``) to release, from a worker.

        A pull's Release counts as one of the rank's readers (it frees once all
        finished); a push's frees the hold at once, cancelling the writes to every
        consumer rank: the request failed here, and a write landing later in blocks
        the engine recomputes would corrupt them."""
        if self._runtime.closed:
            return
        producer, _ = self.sources(ticket)
        me = self.tp().rank
        push = self._local.config.direction is Direction.PUSH
        for rank in self.ranks(ticket) if ranks is None else ranks:
            readers = 1 if push else self.readers(ticket, producer, rank)
            self._io.submit(self._release, rank_ticket(ticket, rank), readers, me)

    def read_all(self, ticket: Ticket, readers: int) -> None:
        """Tell one producer rank (its ticket) that this rank read all it needed, as
        reader ``tp.rank`` of its ``readers`` (the rank frees once all did): over the
        side channel from an io worker, as a direct pull's DONE goes. A notification
        would make the next read on that data endpoint complete only once the rank's
        worker progressed, and would be sent on the engine's thread."""
        if self._runtime.closed:
            return
        tell = functools.partial(
            self._side.release,
            ticket,
            reason="",
            done=True,
            brief=True,
            readers=readers,
            reader=self.tp().rank,
        )
        self._io.submit(tell)

    def _release(self, ticket: Ticket, readers: int, reader: int) -> None:
        """Tell one producer rank (its ticket) to release, as reader ``reader`` of the
        ``readers`` consumer ranks reading it (on an io worker)."""
        self._side.release(ticket, readers=readers, reader=reader)

    def readers(self, ticket: Ticket, producer: HeadLayout, rank: int) -> int:
        """How many consumer ranks read ``ticket`` from producer rank ``rank`` (at least
        1: a replica nobody reads is released by one consumer rank)."""
        salt = zlib.crc32(ticket.request_id.encode())
        return max(1, len(reader_ranks(producer, rank, self.tp().heads, salt=salt)))

    def release_unread(self, ticket: Ticket, producer: HeadLayout) -> None:
        """Producer ranks no consumer rank reads (replicas of a head the salt did not
        pick) hold the request too: the first consumer rank holding their head tells
        them to release it now rather than at lease expiry."""
        tp = self.tp()
        salt = zlib.crc32(ticket.request_id.encode())
        unread = tuple(
            p
            for p in range(producer.tp_size)
            if tp.heads.ranks_of(producer.heads_of(p).start).start == tp.rank
            and not reader_ranks(producer, p, tp.heads, salt=salt)
        )
        if unread:
            self.release_all(ticket, unread)
