"""The ticket: what a producer hands the router for its consumer.

Re-exported by :mod:`kvxfer.agent`.
"""

from __future__ import annotations

import msgspec

__all__ = ["Ticket"]


class Ticket(msgspec.Struct, frozen=True, kw_only=True):
    """What a producer hands the router for the consumer: where and what to fetch.

    Maps one-to-one onto upstream vLLM's ``kv_transfer_params`` keys (so existing
    routers forward it untouched) plus kvxfer's own ``remote_incarnation``,
    ``remote_num_tokens`` and ``lease_expiry``.

    Across tensor-parallel sizes (``tp_size`` differs from the consumer's), the ticket
    names the producer's rank 0: its ``host``, ``port`` and ``incarnation``; producer
    rank *p* serves its side channel at ``port + p`` (upstream vLLM's convention) and
    holds the request under the same ``request_id`` and block ids.
    ``incarnations`` lists every producer rank's incarnation when the producer
    published them (upstream-shaped params: ``remote_incarnations``); without it only
    rank 0's is checked.

    ``block_size`` is the producer's tokens per block (0: not stated, taken as the
    consumer's own). A consumer whose blocks hold another number of tokens pulls unit
    by unit (:mod:`kvxfer.core.ratio`).
    """

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    incarnation: int = 0
    lease_expiry: float = 0.0
    tp_size: int = 1
    incarnations: tuple[int, ...] = ()
    capability: str = ""
    guard_slot: int = -1
    generation: int = 0
    block_size: int = 0

    @classmethod
    def for_push(
        cls,
        engine_id: str,
        host: str,
        port: int,
        request_id: str,
        num_tokens: int,
        *,
        capability: str = "",
        tp_size: int = 1,
    ) -> Ticket:
        """The ticket a push consumer registers with, before the producer's prefill ran.

        It names the producer (its engine id and side-channel address, which the router
        knows in advance), the request and its token count; it has no blocks (the
        producer's are matched by request id). Pass it to
        :meth:`Agent.expect_push <kvxfer.agent.Agent.expect_push>`.

        ``capability``: the request's token when the router minted one and gives the
        same to the producer's ``hold(capability=...)``; the producer then writes only
        to a registration that shows it (without one, the first registration wins).

        ``tp_size``: the producer group's TP size, ``host``/``port`` its rank 0's (rank
        *p* at ``port + p``). A consumer of another TP size registers with each producer
        rank holding its heads; its ranks must then all pass the same ``capability``.
        """
        return cls(
            engine_id=engine_id,
            host=host,
            port=port,
            request_id=request_id,
            block_ids=(),
            num_tokens=num_tokens,
            capability=capability,
            tp_size=tp_size,
        )
