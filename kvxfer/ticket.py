"""The ticket: what a producer hands the router for its consumer.

Re-exported by :mod:`kvxfer.agent`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvxfer.errors import ConfigError

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

    @classmethod
    def for_push(
        cls, engine_id: str, host: str, port: int, request_id: str, num_tokens: int
    ) -> Ticket:
        """The ticket a push consumer registers with, before the producer's prefill ran.

        It names the producer (its engine id and side-channel address, which the router
        knows in advance), the request and its token count; it has no blocks (the
        producer's are matched by request id). Pass it to
        :meth:`Agent.expect_push <kvxfer.agent.Agent.expect_push>`.
        """
        return cls(
            engine_id=engine_id,
            host=host,
            port=port,
            request_id=request_id,
            block_ids=(),
            num_tokens=num_tokens,
        )

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """The upstream ``kv_transfer_params`` dict (decode side of a pull)."""
        blocks: Any = (
            list(self.block_ids[0])
            if len(self.block_ids) == 1
            else [list(g) for g in self.block_ids]
        )
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "remote_block_ids": blocks,
            "tp_size": self.tp_size,
            "remote_incarnation": self.incarnation,
            "remote_incarnations": list(self.incarnations),
            "remote_num_tokens": self.num_tokens,
            "lease_expiry": self.lease_expiry,
            "kvxfer_capability": self.capability,
            "kvxfer_guard_slot": self.guard_slot,
            "kvxfer_generation": self.generation,
        }

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any], num_tokens: int = 0) -> Ticket:
        """Read a ticket back from ``kv_transfer_params``; missing keys raise ConfigError."""
        for key in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids"):
            if key not in params or params[key] is None:
                raise ConfigError(
                    f"kv_transfer_params.{key}", None, "is required for a remote prefill"
                )
        raw = params["remote_block_ids"]
        groups = (
            tuple(tuple(int(b) for b in g) for g in raw)
            if raw and isinstance(raw[0], (list, tuple))
            else (tuple(int(b) for b in raw),)
        )
        return cls(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            request_id=str(params.get("remote_request_id") or ""),
            block_ids=groups,
            num_tokens=int(params.get("remote_num_tokens") or num_tokens),
            incarnation=int(params.get("remote_incarnation") or 0),
            lease_expiry=float(params.get("lease_expiry") or 0.0),
            tp_size=int(params.get("tp_size") or 1),
            incarnations=tuple(int(i) for i in params.get("remote_incarnations") or ()),
            capability=str(params.get("kvxfer_capability") or ""),
            guard_slot=int(_or(params.get("kvxfer_guard_slot"), -1)),
            generation=int(params.get("kvxfer_generation") or 0),
        )


def _or(value: Any, default: int) -> Any:
    """``value`` unless it is missing (None); 0 is a valid guard slot."""
    return default if value is None else value
