"""DRAFT — scheduler-side state of the vLLM connectors, free of vLLM and torch imports.

Not finished and not proven against a real engine: it is the state machine the
connector facade (:mod:`kvxfer.adapters.vllm.connector`) drives from vLLM's
scheduler hooks, written against docs/VLLM_ADAPTER_NOTES.md. It keeps no transfer
logic: it only decides, per request, which of three things the worker's Agent must do
on the next step (hold a producer's blocks, pull/expect a consumer's blocks, or tell
a producer to release) and builds upstream-compatible ``kv_transfer_params``.

Requests are duck-typed (:class:`RequestLike`), so this module is unit-testable with
plain objects.

Consumer (decode) request life, keyed by vLLM's request id::

    (no state) --update_state_after_alloc(n_ext > 0)--> LOADING --worker done--> LOADED
         |                                                  '----worker failed--> FAILED
         '--update_state_after_alloc(n_ext == 0) or request_finished first--> RELEASED
                       (nothing to pull: the producer is told to free its blocks now)

Producer (prefill) request life: ``request_finished`` of a request with
``do_remote_decode`` that finished normally -> HELD (blocks kept, ticket returned)
-> ``finished_sending`` from the worker (consumer done, aborted or lease expired).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

from kvxfer.config import Direction, Role

__all__ = [
    "HoldSpec",
    "LoadSpec",
    "ReleaseSpec",
    "RequestLike",
    "SchedulerSide",
    "StepPlan",
    "is_remote_prefill",
]

log = logging.getLogger("kvxfer.adapters.vllm")

#: vLLM request statuses after which a producer's KV is complete and worth holding.
_NORMAL_FINISH = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
#: Keys a consumer needs in ``kv_transfer_params`` to reach the producer.
_REMOTE_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")


class RequestLike(Protocol):
    """The attributes of ``vllm.v1.request.Request`` this module reads."""

    @property
    def request_id(self) -> str: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def status(self) -> Any: ...


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Consumer: pull (or, in push mode, expect) one request's KV into local blocks.

    ``remote_params`` is the producer's ticket as ``kv_transfer_params``;
    ``skip_blocks`` leading remote blocks are already present locally (local prefix
    cache hit) and are not transferred; ``local_blocks`` (one tuple per KV group)
    receive the rest, in order; ``num_tokens`` counts the tokens those blocks hold.
    """

    request_id: str
    remote_params: dict[str, Any]
    local_blocks: tuple[tuple[int, ...], ...]
    skip_blocks: int
    num_tokens: int


class HoldSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Producer: keep a finished prompt's blocks for its consumer under a lease."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    lease_s: float


class ReleaseSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Consumer: tell the producer named in ``remote_params`` to free its blocks now."""

    request_id: str
    remote_params: dict[str, Any]
    reason: str


class StepPlan(msgspec.Struct, kw_only=True):
    """What the worker must start this step (carried in the connector metadata)."""

    step: int = 0
    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    holds: list[HoldSpec] = msgspec.field(default_factory=list)
    releases: list[ReleaseSpec] = msgspec.field(default_factory=list)

    def empty(self) -> bool:
        return not (self.loads or self.holds or self.releases)


class _Consumer(enum.Enum):
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    RELEASED = "released"


def is_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True when ``params`` ask this (decode) instance to take the prompt's KV remotely
    and name the producer completely."""
    if not params or not params.get("do_remote_prefill"):
        return False
    return all(params.get(k) is not None for k in _REMOTE_KEYS)


def _groups(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """Upstream sends one list per KV group; older routers send one flat list."""
    seq = list(block_ids or ())
    if seq and isinstance(seq[0], list | tuple):
        return tuple(tuple(int(b) for b in g) for g in seq)
    return (tuple(int(b) for b in seq),)


class SchedulerSide:
    """Per-request bookkeeping behind the connector's scheduler hooks.

    Args:
        engine_id: This instance's engine id (``remote_engine_id`` in tickets).
        role: Producer, consumer or both.
        direction: Pull or push.
        block_size: Tokens per KV block.
        lease_s: How long a producer keeps a request's blocks for its consumer.
        tp_size: Tensor-parallel size advertised in tickets.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        role: Role,
        direction: Direction,
        block_size: int,
        lease_s: float = 30.0,
        tp_size: int = 1,
    ) -> None:
        self.engine_id = engine_id
        self.role = role
        self.direction = direction
        self.block_size = block_size
        self.lease_s = lease_s
        self.tp_size = tp_size
        # Filled from the worker's handshake metadata (set_xfer_handshake_metadata).
        self.host = ""
        self.port = 0
        self.incarnation = 0
        self._plan = StepPlan()
        self._consumer: dict[str, _Consumer] = {}
        self._held: dict[str, float] = {}  # producer: request id -> lease expiry (wall)

    # -- configuration ---------------------------------------------------------------
    def set_endpoint(self, host: str, port: int, incarnation: int) -> None:
        """Where consumers reach this instance's (rank 0) agent."""
        self.host, self.port, self.incarnation = host, port, incarnation

    @property
    def is_producer(self) -> bool:
        return self.role in (Role.PRODUCER, Role.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.role in (Role.CONSUMER, Role.BOTH)

    # -- consumer hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the producer holds beyond ``num_computed_tokens``; side-effect free."""
        params = request.kv_transfer_params
        if not self.is_consumer or not is_remote_prefill(params) or params is None:
            return 0, False
        if request.request_id in self._consumer:
            return 0, False  # already loaded, failed or released: never claim twice
        remote_blocks = _groups(params.get("remote_block_ids"))
        covered = min(len(g) for g in remote_blocks) * self.block_size
        remote_tokens = int(params.get("remote_num_tokens") or request.num_prompt_tokens)
        available = min(remote_tokens, request.num_prompt_tokens, covered)
        count = available - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self,
        request: RequestLike,
        unhashed_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
        num_local_computed_tokens: int,
    ) -> None:
        """Queue the load of ``num_external_tokens`` into the freshly allocated blocks.

        Decides on ``num_external_tokens`` (vLLM may pass real blocks with 0 external
        tokens). With 0, a remote prefill that will not be pulled (full local prefix
        hit) releases the producer's blocks now.
        """
        params = request.kv_transfer_params
        rid = request.request_id
        if not self.is_consumer or not is_remote_prefill(params) or params is None:
            return
        if rid in self._consumer:
            return  # the second call, after the load: nothing new
        if num_external_tokens <= 0:
            self._consumer[rid] = _Consumer.RELEASED
            self._plan.releases.append(
                ReleaseSpec(request_id=rid, remote_params=dict(params), reason="not needed")
            )
            return
        skip = num_local_computed_tokens // self.block_size
        local = tuple(tuple(int(b) for b in g) for g in unhashed_block_ids)
        self._consumer[rid] = _Consumer.LOADING
        self._plan.loads.append(
            LoadSpec(
                request_id=rid,
                remote_params=dict(params),
                local_blocks=local,
                skip_blocks=skip,
                num_tokens=num_external_tokens,
            )
        )

    # -- step --------------------------------------------------------------------------
    def build_step_plan(self) -> StepPlan:
        """The work queued since the last step; resets the queue."""
        plan, self._plan = self._plan, StepPlan(step=self._plan.step + 1)
        return plan

    def update_connector_output(
        self,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
        failed_recving: set[str] | None = None,
    ) -> None:
        """Fold the workers' completions (aggregated over ranks by vLLM) back in."""
        for rid in finished_sending or ():
            self._held.pop(rid, None)
        failed = failed_recving or set()
        for rid in finished_recving or ():
            if self._consumer.get(rid) is _Consumer.LOADING:
                self._consumer[rid] = _Consumer.FAILED if rid in failed else _Consumer.LOADED

    def has_pending_push_work(self) -> bool:
        """Push: keep an idle producer stepping while a held request is not yet written."""
        return self.direction is Direction.PUSH and bool(self._held)

    # -- both ----------------------------------------------------------------------------
    def request_finished(
        self, request: RequestLike, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Returns ``(delay_free, kv_transfer_params)`` as vLLM expects.

        Producer: a ``do_remote_decode`` request that finished normally keeps its blocks
        (delay-free) and returns the ticket as upstream ``kv_transfer_params``.
        Consumer: a remote prefill that never started tells the producer to free now.
        """
        rid = request.request_id
        params = request.kv_transfer_params or {}
        state = self._consumer.pop(rid, None)
        if self.is_consumer and is_remote_prefill(params) and state is None:
            # Finished (aborted) before update_state_after_alloc: nothing was pulled.
            self._plan.releases.append(
                ReleaseSpec(request_id=rid, remote_params=dict(params), reason="aborted")
            )
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        status = str(getattr(request.status, "name", request.status))
        groups = tuple(tuple(int(b) for b in g) for g in block_ids)
        if not any(s in status for s in _NORMAL_FINISH) or not any(groups):
            return False, None  # aborted or empty: free at once, hand out nothing
        num_tokens = int(request.num_computed_tokens)
        expiry = time.time() + self.lease_s
        self._held[rid] = expiry
        self._plan.holds.append(
            HoldSpec(request_id=rid, block_ids=groups, num_tokens=num_tokens, lease_s=self.lease_s)
        )
        return True, self.ticket_params(rid, groups, num_tokens, expiry)

    def ticket_params(
        self,
        request_id: str,
        groups: tuple[tuple[int, ...], ...],
        num_tokens: int,
        lease_expiry: float,
    ) -> dict[str, Any]:
        """Upstream-shaped ``kv_transfer_params`` for the consumer (plus kvxfer's keys)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request_id,
            "remote_block_ids": [list(g) for g in groups],
            "remote_num_tokens": num_tokens,
            "tp_size": self.tp_size,
            "transfer_mode": self.direction.value,
            "remote_incarnation": self.incarnation,
            "lease_expiry": lease_expiry,
        }
