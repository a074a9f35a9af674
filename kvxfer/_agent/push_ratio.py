"""A push producer's writes into a consumer of another block size (issue 54).

The consumer's block size is known once the producer handshook with it (its
``Welcome.layout``, which the handshake checked against ours:
:func:`~kvxfer.core.compat.check_pair`), so a write is planned here, as it posts, from
the token window :class:`Span` that :meth:`PushWriter.write
<kvxfer._agent.push_write.PushWriter.write>` cut when it queued the write. The
pairing (:func:`~kvxfer.core.ratio_write.pair_write`) becomes address runs in
:meth:`Runtime.post <kvxfer._agent.runtime.Runtime.post>`, which fails the write by
name on a backend that posts none.
"""

from __future__ import annotations

import msgspec

from kvxfer.core import blocks, wire
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.ratio import UnitPairing
from kvxfer.core.ratio_write import pair_write, written_blocks
from kvxfer.errors import PlanError

__all__ = ["RatioWrite", "Span", "plan_ratio"]


class Span(msgspec.Struct, frozen=True, kw_only=True):
    """The part of a lease one write covers, as the producer knew it then.

    Attributes:
        blocks: The lease's block lists (each the last blocks of ``held_tokens``).
        held_tokens: The tokens those lists end at.
        start: The write's first token (a producer block boundary).
        stop: The token the write ends before.
        final: The hold's write (nothing comes after it).
    """

    blocks: tuple[tuple[int, ...], ...]
    held_tokens: int
    start: int
    stop: int
    final: bool


class RatioWrite(msgspec.Struct, frozen=True, kw_only=True):
    """One write between block sizes, planned: its unit pairing and the blocks of each
    side it touches (the transfer's and the PUSHED notice's)."""

    pairing: UnitPairing
    local: tuple[tuple[int, ...], ...]
    remote: tuple[tuple[int, ...], ...]


def plan_ratio(
    span: Span,
    target: wire.PushRegister,
    *,
    block_size: int,
    consumer_block_size: int,
    plan: PlanOptions,
) -> RatioWrite:
    """Pair one write's units with the consumer's registered blocks.

    Raises:
        PlanError: chunk_mode or swa_window_mode on (they cut blocks of one size
            only), or the lists do not cover the write (:func:`pair_write`).
        LayoutMismatch: sizes neither of which divides the other.
    """
    if plan.chunk_mode or plan.swa_window_mode:
        raise PlanError(
            f"request {target.request_id!r}: blocks of {block_size} tokens here and "
            f"{consumer_block_size} at the consumer: chunk_mode and swa_window_mode cut "
            "blocks of one size only; turn them off"
        )
    pairing = pair_write(
        blocks.from_wire(span.blocks),
        blocks.from_wire(target.block_ids),
        producer_tokens=span.held_tokens,
        consumer_tokens=target.num_tokens,
        producer_block_size=block_size,
        consumer_block_size=consumer_block_size,
        start=span.start,
        stop=span.stop,
        final=span.final,
        request_id=target.request_id,
    )
    local, remote = written_blocks(pairing)
    return RatioWrite(pairing=pairing, local=local, remote=remote)
