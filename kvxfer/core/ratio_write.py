"""Pushes between different block sizes: a producer's write paired unit by unit.

A push producer writes a request's blocks as its consumer registered them
(:class:`~kvxfer.core.wire.PushRegister`), in one write at the end or, with
``push_stream``, a write per stretch of whole blocks prefill closed. Between block sizes
of which one is a whole multiple of the other (:mod:`kvxfer.core.ratio`) each write
is a *token window* of the request: ``[start, stop)``, both on the producer's block
boundaries, cut at the consumer's last token. :func:`pair_write` pairs the units of
that window: the producer's side is local (it posts the WRITE), the consumer's
remote; :func:`~kvxfer.core.ratio.unit_runs` then names their address runs as it
does for a pull's.

Why streaming stays exact: a window's ends are multiples of the producer's block
size, hence of the unit ``g`` (the smaller size), so every unit lies inside one
window. A consumer block larger than the producer's receives its pieces over several
writes, each naming it in its PUSHED notice; the consumer settles once the final
notice came and the notices together name all its blocks, whatever they overlap.

Pure numpy; nothing here touches a transport.
"""

from __future__ import annotations

import numpy as np

from kvxfer.core.blocks import Groups
from kvxfer.core.ratio import UnitPairing, ratio_pieces, units_between
from kvxfer.errors import PlanError

__all__ = ["pair_write", "written_blocks"]


def pair_write(
    producer: Groups,
    consumer: Groups,
    *,
    producer_tokens: int,
    consumer_tokens: int,
    producer_block_size: int,
    consumer_block_size: int,
    start: int,
    stop: int,
    final: bool,
    request_id: str = "",
) -> UnitPairing:
    """Pair the units of one push write between block sizes.

    ``producer`` lists, per group, the last blocks of ``producer_tokens`` tokens (a
    stream's whole blocks, or the hold's blocks); ``consumer`` the last blocks of
    ``consumer_tokens`` (its registration: a prefix-cache hit leaves out the leading
    ones). The units paired are those of tokens ``[start, stop)`` that the consumer
    lists, up to its last token: nothing past the request's last unit is written.
    ``final``: the hold's write, after which nothing more comes: a consumer that
    expects tokens past ``producer_tokens`` is refused (a stream's write cuts there).

    Returns:
        A pairing whose local side is the producer's, remote the consumer's.

    Raises:
        PlanError: another group count, a consumer expecting more tokens than the
            producer holds, or units of the window the producer's lists do not hold
            (naming both ranges).
        LayoutMismatch: sizes neither of which divides the other.
    """
    g, kp, kc = ratio_pieces(producer_block_size, consumer_block_size)
    if len(producer) != len(consumer):
        raise PlanError(
            f"request {request_id!r}: the consumer registered {len(consumer)} KV "
            f"group(s), the producer holds {len(producer)}"
        )
    if final and consumer_tokens > producer_tokens:
        raise PlanError(
            f"request {request_id!r}: the consumer registered {consumer_tokens} tokens, "
            f"the producer holds {producer_tokens}"
        )
    end = min(stop, producer_tokens, consumer_tokens)
    first_unit, last_unit = start // g, -(-end // g)
    wanted = -(-consumer_tokens // consumer_block_size)
    held = -(-producer_tokens // producer_block_size)
    per_group = []
    for gi, (mine, theirs) in enumerate(zip(producer, consumer, strict=True)):
        first_consumer = wanted - len(theirs)
        first_producer = held - len(mine)
        # The window's units the consumer lists (its leading prefix hits are skipped).
        u0 = max(first_unit, first_consumer * kc)
        u1 = min(last_unit, wanted * kc)
        if u1 > u0 and (u0 < first_producer * kp or u1 > held * kp):
            raise PlanError(
                f"group {gi} of {request_id!r}: the producer's {len(mine)} block(s) of "
                f"{producer_block_size} hold tokens {first_producer * producer_block_size}"
                f"..{producer_tokens}; the write needs tokens {u0 * g}..{min(u1 * g, end)}"
            )
        per_group.append(
            units_between(mine, theirs, u0, u1, (kp, first_producer), (kc, first_consumer))
        )
    return UnitPairing(
        local=producer,
        remote=consumer,
        num_tokens=end,
        local_block_size=producer_block_size,
        remote_block_size=consumer_block_size,
        unit=g,
        units=tuple(per_group),
    )


def written_blocks(
    pairing: UnitPairing,
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """``(local, remote)``: per group, the blocks of each side a write's units touch,
    in request order (what its transfer and its PUSHED notice name)."""

    def touched(ids: np.ndarray[tuple[int], np.dtype[np.int64]]) -> tuple[int, ...]:
        # Units run in token order, so a block's units are adjacent.
        keep = np.ones(len(ids), dtype=np.bool_)
        keep[1:] = ids[1:] != ids[:-1]
        return tuple(int(b) for b in ids[keep])

    local = tuple(touched(u.local_block) for u in pairing.units)
    remote = tuple(touched(u.remote_block) for u in pairing.units)
    return local, remote
