"""Scheduler-side state of the vLLM connectors, free of vLLM and torch imports.

The connector facade (:mod:`kvxfer.adapters.vllm.connector`) drives this state machine
from vLLM's scheduler hooks. It keeps no transfer logic: per request it decides which
of four things the worker's Agent must do on a coming step, and hands out each held
prompt's ticket as ``kv_transfer_params`` (through :mod:`~kvxfer.adapters.vllm.params`):

* **stage** (producer, host bounce, pull): after the forward that completes a
  prompt, copy its blocks into the staging buffers, so they are readable before the
  ticket can reach a consumer (the hold comes one step later);
* **stream** (producer, push with ``push_stream``): after each forward of a chunked
  prefill, write the blocks it closed to a consumer that already registered;
* **hold** (producer): keep a finished prompt's blocks for the consumer under a
  lease (pull: the consumer reads them; push: the Agent writes them once the
  consumer registered its blocks);
* **load** (consumer): pull the prompt's KV into freshly allocated blocks, or, in
  push mode, register those blocks with the producer and wait for its writes;
* **release** (consumer): tell the producer to free its blocks now (nothing will be
  read: the request was aborted before its load, or its prompt is a local hit).

Requests are duck-typed (:class:`RequestLike`), so this module is unit-testable with
plain objects.

Consumer (decode) request life, keyed by vLLM's request id::

    (no state) --update_state_after_alloc(n_ext > 0)--> LOADING --worker done--> LOADED
         |                                                  '----worker failed--> FAILED
         '--update_state_after_alloc(n_ext == 0) or request_finished first--> RELEASED

Producer (prefill) request life: ``on_new_request`` with ``do_remote_decode`` ->
tracked (stage once the prompt's last forward ran) -> ``request_finished`` after a
normal finish -> HELD (blocks kept, ticket returned) -> ``finished_sending`` from the
worker (consumer done, aborted, lease expired, or push written).

Request ids: vLLM makes an engine id ``<external id>-<8 hex>`` per engine, so prefill
and decode never share one. Pull tickets name the producer's id exactly
(``remote_request_id``). Push matches the consumer's registration to the producer's
request on the *base* id (the random suffix stripped, as upstream does), which needs
the router to send one ``X-Request-Id`` (or body ``request_id``) to both instances:
the producer's Agent holds push leases under the base id.
"""

from __future__ import annotations

import enum
import heapq
import logging
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from kvxfer.adapters.vllm import timeline
from kvxfer.adapters.vllm.params import (
    WireGroups,
    is_remote_prefill,
    remote_block_groups,
    remote_block_size,
    remote_num_tokens,
    router_capability,
    ticket_params,
)
from kvxfer.agent import Ticket
from kvxfer.core import wire
from kvxfer.errors import ConfigError
from kvxfer.types import Direction, Role

__all__ = [
    "HoldSpec",
    "LoadSpec",
    "ReleaseSpec",
    "RenewSpec",
    "RequestLike",
    "SchedulerSide",
    "StageSpec",
    "StepPlan",
    "StreamSpec",
    "base_request_id",
    "hold_back_last_token",
    "is_remote_prefill",
    "running_slot",
]

log = logging.getLogger("kvxfer.adapters.vllm")

#: vLLM request statuses after which a producer's KV is complete and worth holding.
_NORMAL_FINISH = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
#: vLLM's per-engine request id randomisation: ``-`` and 8 hex digits at the end.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)

Groups = WireGroups


def base_request_id(request_id: str) -> str:
    """``request_id`` without vLLM's random ``-xxxxxxxx`` suffix (upstream's rule)."""
    return _RANDOM_SUFFIX.sub("", request_id)


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
    """Consumer: pull (push: register for and await) one request's KV.

    ``remote_params`` is the producer's ticket as ``kv_transfer_params`` (in push
    mode possibly only its address); ``skip_blocks`` leading blocks are local
    prefix-cache hits and not transferred; ``local_blocks`` (one tuple per KV group)
    receive the rest, in order; ``num_tokens`` is the request's token count the
    blocks end at (vLLM's computed tokens plus the external ones).
    ``transfer_id`` is the id the producer's Agent knows the request by.
    """

    request_id: str
    transfer_id: str
    remote_params: dict[str, Any]
    local_blocks: Groups
    skip_blocks: int
    num_tokens: int


class HoldSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Producer: keep a finished prompt's blocks for its consumer under a lease.

    ``lease_id`` is the id the Agent holds them under (vLLM's id in pull, its base id
    in push); ``request_id`` is vLLM's, reported back in ``finished_sending``.
    """

    request_id: str
    lease_id: str
    block_ids: Groups
    num_tokens: int
    lease_s: float
    #: The ticket's capability and guard word, minted here (the ticket leaves before
    #: the worker's hold runs; push: the router's token, or none); every rank arms
    #: the same slot of its own table.
    capability: str = ""
    guard_slot: int = -1
    generation: int = 0
    #: Push: the capability is the router's (pinned: only decode's registration that
    #: shows it receives the KV); one minted here only makes every rank's hold share a
    #: token (a decode rank's Release of an unread replica shows it).
    pinned: bool = True


class StageSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Producer, host bounce: copy a just-computed prompt's blocks to staging now."""

    request_id: str
    block_ids: Groups


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Producer, push_stream: after this step's forward, write the prompt's closed
    blocks to a consumer that already registered (``num_tokens`` computed so far)."""

    request_id: str
    lease_id: str
    block_ids: Groups
    num_tokens: int


class ReleaseSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Consumer: tell the producer named in ``remote_params`` to free ``transfer_id``."""

    request_id: str
    transfer_id: str
    remote_params: dict[str, Any]
    reason: str


class RenewSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Consumer, pull: keep the hold of ``transfer_id`` at the producer named in
    ``remote_params`` alive until its load starts (the worker's Agent renews it on its
    own timer, :meth:`kvxfer.agent.Agent.keep_alive`); vLLM's request ``request_id``
    waits to be scheduled. Sent once per request; its load or release ends it."""

    request_id: str
    transfer_id: str
    remote_params: dict[str, Any]


class StepPlan(msgspec.Struct, kw_only=True):
    """What the worker must do this step (carried in the connector metadata)."""

    step: int = 0
    idle: bool = False  # vLLM scheduled no tokens this step (nothing to forward)
    loads: list[LoadSpec] = msgspec.field(default_factory=list)
    holds: list[HoldSpec] = msgspec.field(default_factory=list)
    stages: list[StageSpec] = msgspec.field(default_factory=list)
    streams: list[StreamSpec] = msgspec.field(default_factory=list)
    releases: list[ReleaseSpec] = msgspec.field(default_factory=list)
    renewals: list[RenewSpec] = msgspec.field(default_factory=list)

    def empty(self) -> bool:
        return not (
            self.loads
            or self.holds
            or self.stages
            or self.streams
            or self.releases
            or self.renewals
        )


def running_slot(blocks: Sequence[int], spec_slots: int = 0) -> tuple[int, ...]:
    """A state group's list cut to the request's running state slot.

    vLLM lists a request's state blocks as (leading null or superseded slots, in
    ``mamba_cache_mode="align"``) the running slot, then ``spec_slots`` speculative
    scratch slots: the running slot is the last one before the scratch (the only one
    when the list is that short). An empty list stays empty.
    """
    ids = [int(b) for b in blocks]
    if not ids:
        return ()
    scratch = min(spec_slots, len(ids) - 1)
    return (ids[len(ids) - 1 - scratch],)


#: Set in a producer request's ``kv_transfer_params`` once its last prompt token is
#: held back, so that a preempted and rescheduled request is not cut twice.
_HELD_BACK_KEY = "kvxfer_held_back"


def hold_back_last_token(request: Any) -> bool:
    """Producer of a Mamba/GDN model: drop the prompt's last token before prefill.

    A recurrent state has no per-token history: the state after the whole prompt
    h(N) cannot be "recomputed at the last token" as vLLM does for attention after a
    full-prompt load. So the producer computes N - 1 tokens and sends h(N - 1) with
    their KV; decode loads those and computes token N itself, from that state. The
    producer's own output token is then not the request's (the router uses
    decode's). Returns True when the request was cut now.

    vLLM 0.32's ``Request`` has no public way to shorten a prompt: its token list
    ``all_token_ids`` is a read-only view of ``_all_token_ids``, cut here with the
    prompt list and count (as vLLM's own NIXL connector does). A ``Request`` without
    them is left alone and logged: its decode then refuses the load (its ticket
    holds the whole prompt) and computes the prompt itself, correct but slower.
    """
    params = request.kv_transfer_params
    prompt = getattr(request, "prompt_token_ids", None)
    tokens = getattr(request, "_all_token_ids", None)
    if params is None or params.get(_HELD_BACK_KEY):
        return False
    if int(request.num_prompt_tokens) < 2:
        return False  # nothing to load: decode computes a one-token prompt itself
    if not isinstance(prompt, list) or not isinstance(tokens, list):
        log.error(
            "kvxfer: request %s: cannot hold back its last prompt token (this vLLM's "
            "Request has no token lists kvxfer knows); its decode will compute the prompt",
            request.request_id,
        )
        return False
    del prompt[-1]
    del tokens[-1]
    request.num_prompt_tokens = int(request.num_prompt_tokens) - 1
    request.max_tokens = 1
    params[_HELD_BACK_KEY] = True
    return True


class _Consumer(enum.Enum):
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    RELEASED = "released"


class SchedulerSide:
    """Per-request bookkeeping behind the connector's scheduler hooks.

    Args:
        engine_id: This instance's engine id (``remote_engine_id`` in tickets).
        role: Producer, consumer or both.
        direction: Pull or push.
        block_size: Tokens per KV block.
        lease_s: How long a producer keeps a request's blocks for its consumer.
        tp_size: Tensor-parallel size advertised in tickets.
        stage_early: Producer with host bounce in pull mode: stage a prompt's blocks
            right after the forward that completed it (see the module docstring).
        push_stream: Producer in push mode: write each prompt block to a registered
            consumer in the step that closes it (chunked prefill), not only at the end.
        windows: Per KV cache group, its sliding window in tokens (0: full
            attention); empty: one full-attention group. A sliding group's block list
            holds the null block where the window dropped a block; tickets, holds and
            stages carry only the blocks the window keeps for the next token.
        state: Per KV cache group, True for a Mamba2 / Gated DeltaNet state group.
            Its lists carry one block, the request's running state slot
            (:func:`running_slot`); with such a group a producer stops one token short
            of the prompt (:func:`hold_back_last_token`), and a consumer loads exactly
            the tokens the producer computed, fewer than its prompt's, so that its
            first step computes the last prompt token from the state before it.
        spec_slots: Per state group, the speculative scratch slots vLLM appends to
            its lists.
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
        stage_early: bool = False,
        push_stream: bool = False,
        windows: Sequence[int] = (),
        state: Sequence[bool] = (),
        spec_slots: Sequence[int] = (),
    ) -> None:
        self.engine_id = engine_id
        self.windows = tuple(int(w) for w in windows)
        self.state = tuple(bool(x) for x in state)
        self.spec_slots = tuple(int(n) for n in spec_slots)
        self.role = role
        self.direction = direction
        self.block_size = block_size
        self.lease_s = lease_s
        self.tp_size = tp_size
        self.stage_early = stage_early and direction is Direction.PULL
        self.push_stream = push_stream and direction is Direction.PUSH
        # Filled from the workers' handshake metadata (set_xfer_handshake_metadata).
        self.host = ""
        self.port = 0
        self.incarnations: tuple[int, ...] = ()
        self._plan = StepPlan()
        self._consumer: dict[str, _Consumer] = {}
        self._producing: dict[str, RequestLike] = {}  # do_remote_decode, not finished
        # Consumer, pull: requests waiting to be scheduled whose keep-alive the next
        # step plan starts (dropped if they are scheduled or end first).
        self._renewing: dict[str, RenewSpec] = {}
        self._held: dict[str, float] = {}  # producer: request id -> lease expiry (wall)
        # Guard slots of the held requests: the lowest free one is taken, and a slot
        # comes back only when every rank reported the request freed (its word was
        # overwritten first), so a live hold never shares its slot. Holds hold a block
        # each, so slots stay below the workers' table size (num_blocks + spare).
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []  # a heap of returned slots
        self._next_slot = 0

    # -- configuration ---------------------------------------------------------------
    @property
    def full_group(self) -> int:
        """The first full-attention group (its blocks cover the whole prompt)."""
        return next((g for g, w in enumerate(self.windows) if not w and not self._is_state(g)), 0)

    @property
    def has_state(self) -> bool:
        """True when some KV cache group holds recurrent state."""
        return any(self.state)

    def _is_state(self, g: int) -> bool:
        return g < len(self.state) and self.state[g]

    def _spec(self, g: int) -> int:
        return self.spec_slots[g] if g < len(self.spec_slots) else 0

    def window_blocks(self, groups: Sequence[Sequence[int]], num_tokens: int) -> Groups:
        """Each group's blocks a consumer needs for ``num_tokens`` tokens (R-HYB-1).

        ``groups`` are vLLM's per-group lists, index = the request's block index. A
        full-attention group keeps its first ``ceil(num_tokens / block_size)`` blocks;
        a sliding one only those holding the window of the prompt's last token
        (tokens from ``num_tokens - window``): what a consumer's sliding group
        allocates for the prompt (vLLM skips tokens before ``num_tokens - window + 1``)
        or for all but its last token (:meth:`get_num_new_matched_tokens`).
        """
        bs = self.block_size
        end = -(-num_tokens // bs)
        out = []
        for g, blocks in enumerate(groups):
            if self._is_state(g):
                out.append(running_slot(blocks, self._spec(g)))
                continue
            window = self.windows[g] if g < len(self.windows) else 0
            first = max(num_tokens - window, 0) // bs if window else 0
            out.append(tuple(int(b) for b in blocks[first:end]))
        return tuple(out)

    def set_endpoint(self, host: str, port: int, incarnations: Sequence[int]) -> None:
        """Where consumers reach this instance: rank 0's side channel (rank *r*
        listens on ``port + r``) and every rank's incarnation, in rank order."""
        self.host, self.port, self.incarnations = host, int(port), tuple(incarnations)

    @property
    def is_producer(self) -> bool:
        return self.role in (Role.PRODUCER, Role.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.role in (Role.CONSUMER, Role.BOTH)

    def transfer_id(self, request: RequestLike) -> str:
        """The id the producer's Agent knows this consumer request by."""
        params = request.kv_transfer_params or {}
        remote = params.get("remote_request_id")
        if self.direction is Direction.PUSH:
            return base_request_id(str(remote) if remote else request.request_id)
        return str(remote or "")

    # -- consumer hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the producer holds beyond ``num_computed_tokens``; side-effect free."""
        params = request.kv_transfer_params
        if not self.is_consumer or not is_remote_prefill(params, self.direction):
            return 0, False
        if request.request_id in self._consumer:
            return 0, False  # already loaded, failed or released: never claim twice
        assert params is not None
        timeline.mark("d_new", request.request_id)
        available = int(request.num_prompt_tokens)
        try:
            remote_tokens = remote_num_tokens(params)
            groups = remote_block_groups(params)
            theirs = remote_block_size(params, self.block_size)
        except ConfigError as exc:
            # Claim the prompt anyway: the worker refuses the load with this error and
            # vLLM fails (or recomputes) this request; the engine keeps running.
            log.error("kvxfer: request %s: bad %s; its load will fail", request.request_id, exc)
            remote_tokens, groups, theirs = None, (), self.block_size
        if remote_tokens is not None:
            available = min(available, remote_tokens)
        if groups:
            # Sliding groups carry only their window's blocks, state groups one slot:
            # full ones bound the prompt.
            full = [
                len(g)
                for i, (g, w) in enumerate(zip(groups, self.windows))
                if not w and not self._is_state(i)
            ]
            lengths = (
                full if len(groups) == len(self.windows) and full else [len(g) for g in groups]
            )
            available = min(available, min(lengths) * theirs)
        if self.has_state:
            # The state slot holds h(k) for the k tokens the producer computed; only a
            # load of exactly those k, fewer than the prompt, lets this instance's
            # first step compute token k+1 from it (a full-prompt load would have vLLM
            # recompute the last token over a state that already saw it).
            prompt = int(request.num_prompt_tokens)
            if remote_tokens is None or remote_tokens >= prompt or available != remote_tokens:
                log.error(
                    "kvxfer: request %s: the ticket holds %s token(s) of a %d-token prompt; "
                    "a Mamba/GDN state can only be loaded for fewer tokens than the "
                    "prompt, exactly the ones the producer computed (a producer of "
                    "this model stops one token short): decode computes the prompt itself",
                    request.request_id,
                    remote_tokens,
                    prompt,
                )
                return 0, False
        elif available == int(request.num_prompt_tokens) and self._drops_last_window(available):
            # vLLM recomputes the last prompt token after a full-prompt load, but its
            # sliding groups allocated only the window of the token after it: when
            # that window starts on a block boundary, the block holding the first
            # token the recompute attends is a null block. Leaving the last token to
            # vLLM makes it allocate that block (and the load fills it).
            available -= 1
        count = available - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _drops_last_window(self, num_tokens: int) -> bool:
        """True when some sliding group, loaded for ``num_tokens`` tokens, would skip
        the block holding token ``num_tokens - window`` (see above)."""
        return any(
            w and num_tokens - w + 1 > 0 and (num_tokens - w + 1) % self.block_size == 0
            for w in self.windows
        )

    def update_state_after_alloc(
        self,
        request: RequestLike,
        unhashed_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
        num_local_computed_tokens: int,
    ) -> None:
        """Queue the load of ``num_external_tokens`` into the freshly allocated blocks.

        Decides on ``num_external_tokens``, never on whether blocks came (vLLM calls
        this again after the load with 0). With 0 on the first call, a remote prefill
        that will not be transferred (full local prefix hit) releases the producer.
        """
        params = request.kv_transfer_params
        rid = request.request_id
        if not self.is_consumer or not is_remote_prefill(params, self.direction):
            return
        assert params is not None
        # Scheduled: its load (or release) starts in this step; no more renewals.
        self._renewing.pop(rid, None)
        if rid in self._consumer:
            return  # the second call, after the load: nothing new
        transfer_id = self.transfer_id(request)
        if num_external_tokens <= 0:
            self._consumer[rid] = _Consumer.RELEASED
            self._plan.releases.append(
                ReleaseSpec(
                    request_id=rid,
                    transfer_id=transfer_id,
                    remote_params=dict(params),
                    reason="its prompt is a local prefix-cache hit",
                )
            )
            return
        skip = num_local_computed_tokens // self.block_size
        local = tuple(
            running_slot(g, self._spec(i)) if self._is_state(i) else tuple(int(b) for b in g)
            for i, g in enumerate(unhashed_block_ids)
        )
        self._consumer[rid] = _Consumer.LOADING
        timeline.mark("d_alloc", rid)
        remote = dict(params)
        if self.direction is Direction.PUSH and not remote.get("kvxfer_capability"):
            # Every worker of this instance registers under one token (a producer rank
            # writing to two of them across TP sizes must see one consumer). A router
            # that minted one gave it to both instances instead.
            remote["kvxfer_capability"] = wire.new_capability()
        self._plan.loads.append(
            LoadSpec(
                request_id=rid,
                transfer_id=transfer_id,
                remote_params=remote,
                local_blocks=local,
                skip_blocks=skip,
                num_tokens=num_local_computed_tokens + num_external_tokens,
            )
        )

    # -- producer hooks ----------------------------------------------------------------
    def on_new_request(self, request: RequestLike) -> None:
        """Track requests this producer prefills for a remote decode, and, on a pull
        consumer, requests whose producer's hold must outlast their wait in vLLM's
        queue (kept alive until their load starts, see :class:`RenewSpec`)."""
        params = request.kv_transfer_params
        if self.is_consumer and self.direction is Direction.PULL:
            self._track_renewal(request)
        if self.is_producer and params and params.get("do_remote_decode"):
            if self.has_state:
                hold_back_last_token(request)
            self._producing[request.request_id] = request
            timeline.mark("p_new", request.request_id)

    def _track_renewal(self, request: RequestLike) -> None:
        params = request.kv_transfer_params
        if not is_remote_prefill(params, self.direction) or params is None:
            return
        expiry = params.get("lease_expiry")
        if isinstance(expiry, bool) or not isinstance(expiry, int | float):
            return  # a ticket without one (an earlier build): nothing to renew by
        if not float(expiry) > time.time():
            return  # already over: its load fails closed (lease_expired)
        self._renewing[request.request_id] = RenewSpec(
            request_id=request.request_id,
            transfer_id=self.transfer_id(request),
            remote_params=dict(params),
        )

    # -- step --------------------------------------------------------------------------
    def build_step_plan(
        self,
        num_scheduled_tokens: Mapping[str, int] | None = None,
        block_ids_of: Callable[[str], Sequence[Sequence[int]]] | None = None,
    ) -> StepPlan:
        """The work queued since the last step; resets the queue.

        ``num_scheduled_tokens`` (vLLM's, this step's) and ``block_ids_of`` (the KV
        cache manager's ``get_block_ids``) let a host-bounce producer stage a prompt's
        blocks in the step whose forward completes it.
        """
        if (self.stage_early or self.push_stream) and num_scheduled_tokens and block_ids_of:
            for rid, n in num_scheduled_tokens.items():
                req = self._producing.get(rid)
                if req is not None:
                    self._after_forward(req, int(n), block_ids_of)
        if self._renewing:
            # Waiting past this step: their keep-alives start (sent once).
            self._plan.renewals.extend(self._renewing.values())
            self._renewing.clear()
        plan, self._plan = self._plan, StepPlan(step=self._plan.step + 1)
        plan.idle = num_scheduled_tokens is not None and not num_scheduled_tokens
        return plan

    def _after_forward(
        self,
        req: RequestLike,
        n: int,
        block_ids_of: Callable[[str], Sequence[Sequence[int]]],
    ) -> None:
        """A producing request computes ``n`` more tokens this step: stage or stream."""
        rid = req.request_id
        prompt = int(req.num_prompt_tokens)
        end = min(int(req.num_computed_tokens) + n, prompt)
        if self.push_stream:
            closed = end // self.block_size
            if end < prompt and closed > 0:  # the last part goes with the hold
                groups = tuple(tuple(int(b) for b in g[:closed]) for g in block_ids_of(rid))
                self._plan.streams.append(
                    StreamSpec(
                        request_id=rid,
                        lease_id=base_request_id(rid),
                        block_ids=groups,
                        num_tokens=end,
                    )
                )
            return
        if end < prompt:
            return
        del self._producing[rid]  # staged once; hold() restages at the end
        groups = self.window_blocks(block_ids_of(rid), prompt)
        self._plan.stages.append(StageSpec(request_id=rid, block_ids=groups))

    def update_connector_output(
        self,
        finished_sending: set[str] | None,
        finished_recving: set[str] | None,
        failed_recving: set[str] | None = None,
    ) -> None:
        """Fold the workers' completions (aggregated over ranks by vLLM) back in."""
        for rid in finished_sending or ():
            self._held.pop(rid, None)
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                heapq.heappush(self._free_slots, slot)
        failed = failed_recving or set()
        for rid in finished_recving or ():
            if self._consumer.get(rid) is _Consumer.LOADING:
                self._consumer[rid] = _Consumer.FAILED if rid in failed else _Consumer.LOADED
                timeline.mark("d_loaded", rid)

    def has_pending_push_work(self) -> bool:
        """Push: keep an idle producer stepping while a held request is not yet written."""
        return self.direction is Direction.PUSH and bool(self._held)

    def _take_slot(self, rid: str) -> int:
        old = self._slot_of.get(rid)
        if old is not None:
            return old
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._slot_of[rid] = slot
        return slot

    @property
    def num_held(self) -> int:
        """Producer: requests whose blocks are kept for a consumer."""
        return len(self._held)

    # -- both ----------------------------------------------------------------------------
    def request_finished(
        self, request: RequestLike, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Returns ``(delay_free, kv_transfer_params)`` as vLLM expects.

        Producer: a ``do_remote_decode`` request that finished normally keeps its blocks
        (delay-free) and returns the ticket as upstream ``kv_transfer_params``.
        Consumer: a remote prefill that never reached its load tells the producer to
        free its blocks now.
        """
        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._producing.pop(rid, None)
        self._renewing.pop(rid, None)
        state = self._consumer.pop(rid, None)
        if self.is_consumer and is_remote_prefill(params, self.direction) and state is None:
            # Finished (aborted) before update_state_after_alloc: nothing was pulled.
            # Marked in the request's own params (as upstream does): vLLM may report
            # one abort twice, and the producer needs one release.
            if request.kv_transfer_params is not None:
                request.kv_transfer_params["do_remote_prefill"] = False
            self._plan.releases.append(
                ReleaseSpec(
                    request_id=rid,
                    transfer_id=self.transfer_id(request),
                    remote_params=dict(params),
                    reason="the request was aborted before its transfer",
                )
            )
            return False, None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        status = str(getattr(request.status, "name", request.status))
        num_tokens = int(request.num_computed_tokens)
        groups = self.window_blocks(block_ids, num_tokens)
        if not any(s in status for s in _NORMAL_FINISH) or not any(groups):
            return False, None  # aborted or empty: free at once, hand out nothing
        pinned = True
        if self.direction is Direction.PUSH:
            # Push: a token the router minted and gave decode too pins the hold to
            # decode's registration; without one, one minted here is shared by every
            # rank's hold unpinned (the first registration of the id wins).
            try:
                capability = router_capability(params)
            except ConfigError as exc:
                log.error("kvxfer: request %s not held for its consumer: %s", rid, exc)
                return False, None
            if not capability:
                capability, pinned = wire.new_capability(), False
        else:
            capability = wire.new_capability()
        expiry = time.time() + self.lease_s
        lease_id = base_request_id(rid) if self.direction is Direction.PUSH else rid
        self._held[rid] = expiry
        slot = self._take_slot(rid)
        generation = secrets.randbits(56) or 1
        timeline.mark("p_finished", rid)
        self._plan.holds.append(
            HoldSpec(
                request_id=rid,
                lease_id=lease_id,
                block_ids=groups,
                num_tokens=num_tokens,
                lease_s=self.lease_s,
                capability=capability,
                guard_slot=slot,
                generation=generation,
                pinned=pinned,
            )
        )
        ticket = Ticket(
            engine_id=self.engine_id,
            host=self.host,
            port=self.port,
            request_id=rid,
            block_ids=groups,
            num_tokens=num_tokens,
            incarnation=self.incarnations[0] if self.incarnations else 0,
            lease_expiry=expiry,
            tp_size=self.tp_size,
            capability=capability,
            guard_slot=slot,
            generation=generation,
            block_size=self.block_size,
        )
        return True, ticket_params(ticket, direction=self.direction, incarnations=self.incarnations)
