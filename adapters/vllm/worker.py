"""Worker-side half of the vLLM connectors: vLLM's KV tensors and step calls mapped
onto one :class:`kvxfer.Agent` per worker process (one per tensor-parallel rank).

No transfer logic lives here: the Agent owns handshakes, plans, leases and progress.
This module only translates:

* ``register_kv_caches`` -> :meth:`WorkerSide.from_kv_caches`: :func:`describe_kv_caches`,
  the Agent built, ``Agent.register`` (deferred for device-to-device until the first
  real step) + ``Agent.serve``
* a step's :class:`~kvxfer.adapters.vllm.scheduler.StepPlan` -> ``hold`` / ``pull`` /
  ``expect_push`` / ``abort`` (tickets read by :mod:`~kvxfer.adapters.vllm.params`),
  and (after the forward) host-bounce staging
* ``get_transfer_results`` -> ``Transfer.poll()`` of what is in flight, ``Agent.freed()``
* ``get_kv_connector_stats`` -> per-interval counters vLLM aggregates across ranks

Nothing here raises into vLLM once the engine runs (an exception from a connector
hook kills vLLM's engine core): a load that cannot start is a failed load. The one
exception is a deferred registration that fails (:meth:`WorkerSide.start_step`). torch is
never imported: tensors are duck-typed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvxfer.adapters.vllm import timeline
from kvxfer.adapters.vllm.ahead import ConnectAhead
from kvxfer.adapters.vllm.cache_layout import (
    CPU_VEC_INTERIOR,
    Interior,
    describe_kv_caches,
    token_major_groups,
)
from kvxfer.adapters.vllm.kv_transfer_config import TransferConfig
from kvxfer.adapters.vllm.params import across_tp, pairing_error, release_ticket, remote_ticket
from kvxfer.adapters.vllm.scheduler import Groups, LoadSpec, RenewSpec, StepPlan
from kvxfer.agent import Agent
from kvxfer.core.descriptors import DescriptorTable, PlanOptions
from kvxfer.core.layout import Group, GroupKind, KVLayout
from kvxfer.errors import RegistrationError
from kvxfer.ticket import Ticket
from kvxfer.transfer import Transfer, TransferState
from kvxfer.types import Direction, Role

__all__ = [
    "CPU_VEC_INTERIOR",
    "AgentFactory",
    "Interior",
    "WorkerSide",
    "describe_kv_caches",
    "token_major_groups",
    "unique_tensors",
]

#: Builds a worker's Agent once its KV cache is known: ``factory(layout, tensors)``
#: (the tensors are the distinct KV tensors, for backends that copy by tensor).
AgentFactory = Callable[[KVLayout, Sequence[Any]], Agent]

log = logging.getLogger("kvxfer.adapters.vllm")

#: Staged-but-not-yet-held prompts remembered at most (the rest are staged again).
_STAGED_KEEP = 4096

#: The longest an idle step (vLLM scheduled nothing) waits for a consumer's load to
#: settle, or for a producer's hold to end, before it returns. vLLM's engine loop
#: re-runs an empty step every ~1 ms while a request waits for its KV (a push: for as
#: long as the remote prefill runs; a pull: its first contact's handshake, a READ over
#: TCP) and while a producer holds a finished request's blocks for its consumer, and a
#: TP group's workers spin with it; on a small host those steps took the CPU from the
#: very peer they wait for (a TP1 producer got 2 % of a core for 10 s while its TP2
#: consumer's workers spun, and its handshake went unanswered: issue 25). Waiting here
#: on an event (set when a load settles or a hold ends) turns the loop into a sleep;
#: the cap bounds how long a request arriving meanwhile waits for the engine to look
#: at it.
IDLE_WAIT_S = 0.02


def unique_tensors(kv_caches: Mapping[str, Any]) -> list[Any]:
    """The distinct KV tensors, in layer order (layers sharing KV appear once; a
    state layer's list of conv and SSM state views gives each of them)."""
    seen: set[int] = set()
    tensors = []
    flat = (t for v in kv_caches.values() for t in (v if isinstance(v, list | tuple) else (v,)))
    for t in flat:
        if int(t.data_ptr()) in seen:
            continue
        seen.add(int(t.data_ptr()))
        tensors.append(t)
    return tensors


class WorkerSide:
    """One worker's Agent and the transfers it has in flight.

    Built by :meth:`from_kv_caches` once vLLM allocated the KV cache (the Agent
    needs its layout); the Agent is registered (or, device-to-device, deferred) and
    serving when the constructor returns.

    Args:
        config: The parsed connector configuration.
        agent: This worker's Agent (not yet registered).
        layout: The KV cache's layout.
        tensors: The distinct KV tensors (vLLM's, not copied).
        tp_rank: This worker's tensor-parallel rank (port offset, incarnation index).
        tp_size: This instance's tensor-parallel size (a producer's may differ: each
            rank then reads, or receives, the heads it holds from the producer ranks).
        defer_registration: Device-to-device: register only once the engine's warm-up
            is over, at the first real step (device memory may move before).
    """

    def __init__(
        self,
        config: TransferConfig,
        agent: Agent,
        layout: KVLayout,
        tensors: Sequence[Any],
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        defer_registration: bool = False,
    ) -> None:
        self.config = config
        self.agent = agent
        self.layout = layout
        self.tensors = list(tensors)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._defer = defer_registration
        self._inflight: dict[str, Transfer] = {}  # vLLM request id -> its load
        self._held: dict[str, str] = {}  # lease id -> vLLM request id (not yet freed)
        # Host bounce: prompts staged after their last forward (request id -> blocks),
        # so that their hold, a step later, does not copy the same bytes again.
        self._staged: dict[str, Any] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        # Loads vLLM was told failed while their transfer is still doomed, not final
        # (R-SAFE-5): their blocks stay with vLLM until the transfer settles.
        self._failed_early: set[str] = set()
        self._released: set[str] = set()  # loads vLLM ended itself (an abort)
        # vLLM takes block-level load errors for a single KV cache group only; with
        # several (a hybrid model) a failed load is reported by request id alone.
        self._block_errors = len(layout.groups) == 1
        self._orphan_frees: list[str] = []  # held by vLLM, never by the Agent
        self._producer = config.role is not Role.CONSUMER
        self._interval = _Interval(push=config.direction is Direction.PUSH)
        self._consumer = config.role is not Role.PRODUCER
        self._idle_step = False  # the current step forwards nothing
        self._wake = threading.Event()  # a load settled, or a hold ended
        self._freed_ids: list[str] = []  # drained from the agent by an idle step's wait
        agent.register(layout, defer=defer_registration)
        if self._producer:
            agent.add_freed_callback(self._wake.set)
        agent.serve()
        # Handshakes need the registered layout: with deferred registration they start
        # at the first real step, once it is complete.
        self._ahead = ConnectAhead(agent, config.connect_ahead)
        if not defer_registration:
            self._ahead.start()

    @classmethod
    def from_kv_caches(
        cls,
        config: TransferConfig,
        kv_caches: Mapping[str, Any],
        *,
        agent_factory: AgentFactory,
        block_size: int,
        num_blocks: int,
        kv_layout: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        first_head: int | None = None,
        defer_registration: bool = False,
        groups: Sequence[Group] | None = None,
        layer_groups: Mapping[str, int] | None = None,
        plan_options: PlanOptions | None = None,
        interior: tuple[Interior, Interior] | None = CPU_VEC_INTERIOR,
        head_regions: bool = False,
        state_parts: Mapping[int, Sequence[int]] | None = None,
    ) -> WorkerSide:
        """Describe vLLM's KV cache, build the Agent with ``agent_factory`` (in vLLM:
        :func:`kvxfer.adapters.vllm.startup.agent_factory`), register it and serve.

        ``groups``, ``layer_groups``, ``interior``, ``head_regions``, ``first_head`` and
        ``state_parts`` are as in :func:`describe_kv_caches`; ``plan_options`` the
        Agent's. The descriptor table is built here once, so a mode this layout cannot
        support fails now, at start-up (``ConfigError`` naming key, value and rule),
        even when device-to-device registration itself waits for the first step.
        """
        options = plan_options if plan_options is not None else PlanOptions()
        layout = describe_kv_caches(
            kv_caches,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_layout=kv_layout,
            groups=groups,
            layer_groups=layer_groups,
            interior=interior,
            tp_rank=tp_rank,
            first_head=first_head,
            head_regions=head_regions,
            state_parts=state_parts,
            token_major_groups=token_major_groups(
                groups if groups is not None else (Group(kind=GroupKind.FULL),),
                block_size,
                options,
            ),
        )
        DescriptorTable.build(layout, options)
        log.info("kvxfer: KV layout %s", layout.summary())
        tensors = unique_tensors(kv_caches)
        return cls(
            config,
            agent_factory(layout, tensors),
            layout,
            tensors,
            tp_rank=tp_rank,
            tp_size=tp_size,
            defer_registration=defer_registration,
        )

    def handshake_info(self) -> dict[str, Any]:
        """What the scheduler side puts into tickets: this rank's advertised address."""
        host, port = self.agent.address
        return {
            "host": host,
            "port": int(port),
            "incarnation": int(self.agent.incarnation),
            "tp_rank": self.tp_rank,
        }

    # -- per step ------------------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """Start what the scheduler queued.

        Raises only when a deferred registration fails (the first real step,
        device-to-device): an instance that cannot register its KV memory can never
        move KV, and serving on would fail every P/D request, so vLLM's engine core
        stops with the reason. Every mode the layout cannot support was refused before,
        in :meth:`from_kv_caches`; what is left here is the backend or device refusing
        the memory.
        """
        agent = self.agent
        self._idle_step = plan.idle
        if self._defer:
            self._defer = False
            try:
                agent.complete_registration()
            except Exception as exc:
                log.error("kvxfer: deferred KV registration failed, stopping: %s", exc)
                raise RegistrationError(
                    f"deferred KV registration failed: {exc}; this instance cannot move KV"
                ) from exc
            self._ahead.start()
        for hold in plan.holds:
            staged = self._staged.pop(hold.request_id, None) == hold.block_ids
            try:
                agent.hold(
                    hold.lease_id,
                    hold.block_ids,
                    hold.num_tokens,
                    lease_s=hold.lease_s,
                    staged=staged,
                    capability=hold.capability,
                    guard=(hold.guard_slot, hold.generation) if hold.generation else None,
                    pin=hold.pinned,
                )
            except Exception:
                log.exception(
                    "kvxfer: could not hold %s; its blocks are freed now", hold.request_id
                )
                self._orphan_frees.append(hold.request_id)
                continue
            self._held[hold.lease_id] = hold.request_id
            timeline.mark("p_hold", hold.request_id)
        if plan.renewals:
            # Before the loads: a request scheduled in this step ends its keep-alive.
            self._keep_alive(plan.renewals)
        for load in plan.loads:
            self._start_load(load)
        for rel in plan.releases:
            # vLLM ended the request itself (an abort): a load of it that runs is not
            # reported failed early. Matched by the producer's id, as the Agent's abort
            # is: the release may come from another vLLM request for the same
            # producer request (seen in the hang-up soak: an aborted one that never
            # loaded), and it dooms this load all the same.
            self._released.update(
                rid for rid, t in self._inflight.items() if t.request_id == rel.transfer_id
            )
            self._release_remote(rel.transfer_id, rel.remote_params, rel.reason)

    def _keep_alive(self, renewals: Sequence[RenewSpec]) -> None:
        """Keep the producers' holds of requests waiting here alive until their loads
        start (the agent renews them on its own timer, so a long step cannot starve
        them); their load, or their release, ends it. Never raises: a hold not kept
        ends at its lease as it would have."""
        tickets = []
        for r in renewals:
            try:
                tickets.append(self._hold_ticket(r.transfer_id, r.remote_params, expiry=True))
            except Exception as exc:
                log.warning("kvxfer: cannot renew %s: %s", r.request_id, exc)
        added = self.agent.keep_alive(tickets) if tickets else 0
        if added < len(tickets):
            # The scheduler sends each waiting request once, and only while its lease
            # runs: one not added ended meanwhile; its load fails closed (lease_expired).
            log.warning(
                "kvxfer: %d of %d hold(s) not kept alive: lease over or kept already",
                len(tickets) - added,
                len(tickets),
            )

    def _hold_ticket(
        self, transfer_id: str, params: Mapping[str, Any], *, expiry: bool = False
    ) -> Ticket:
        """The ticket naming the producer rank that holds ``transfer_id`` for this rank
        (with the lease's expiry, for a keep-alive)."""
        return release_ticket(
            params, tp_rank=self._paired_rank(params), transfer_id=transfer_id, expiry=expiry
        )

    def after_forward(self, plan: StepPlan) -> None:
        """Producer, after the step's forward: stage the prompts it completed (host
        bounce) or write the blocks it closed (push_stream). Never raises."""
        agent = self.agent
        if not agent.registered or not (plan.stages or plan.streams):
            return
        try:
            for stage in plan.stages:
                agent.stage_out(stage.block_ids)
                self._staged[stage.request_id] = stage.block_ids
                while len(self._staged) > _STAGED_KEEP:  # prompts aborted before their hold
                    del self._staged[next(iter(self._staged))]
        except Exception:
            # Unstaged prompts are staged by hold(); only the (unlikely) early reader
            # is exposed.
            log.exception("kvxfer: early staging failed")
        for stream in plan.streams:
            try:
                agent.stream(stream.lease_id, stream.block_ids, stream.num_tokens)
            except Exception:
                # hold() writes whatever streaming did not.
                log.exception("kvxfer: streaming %s failed", stream.request_id)

    def _start_load(self, load: LoadSpec) -> None:
        agent = self.agent
        why = pairing_error(load.remote_params, self.config.direction, self.tp_size)
        if (
            why is None
            and across_tp(load.remote_params, self.tp_size)
            and any(g.is_state for g in self.layout.groups)
        ):
            tp = agent.config.tp
            theirs = load.remote_params.get("tp_size")
            if tp is None or tp.state is None:
                why = (
                    f"tp_size={theirs} (the producer's; this instance runs "
                    f"{self.tp_size}): Mamba/GDN state moves across TP sizes only "
                    "where each rank knows how TP splits its state slots (TPRank.state) "
                    "and its conv state is dim-major (VLLM_SSM_CONV_STATE_LAYOUT=DS on "
                    "both instances); this rank's is not available (the start-up log "
                    "line 'kvxfer: Mamba/GDN state across TP sizes' says why): pair "
                    "instances of equal TP size"
                )
        if why is None and across_tp(load.remote_params, self.tp_size) and agent.config.tp is None:
            why = (
                f"the producer runs tensor-parallel size {load.remote_params.get('tp_size')}, "
                f"this instance {self.tp_size}, and this KV layout's regions do not say "
                "which KV heads they hold (see the start-up log): transfers across TP "
                "sizes read each rank's heads"
            )
        if why is not None:
            log.error("kvxfer: KV load of %s refused: %s", load.request_id, why)
            self._stop_keep_alive(load)
            self._fail_load(load.request_id, load.local_blocks, why)
            return
        try:
            ticket = remote_ticket(
                load.remote_params,
                # Across TP sizes the ticket names producer rank 0 and the Agent reads
                # the ranks holding this rank's heads (kvxfer._agent.tp_pull); else rank r pairs r.
                tp_rank=self._paired_rank(load.remote_params),
                transfer_id=load.transfer_id,
                local_blocks=load.local_blocks,
                skip_blocks=load.skip_blocks,
                num_tokens=load.num_tokens,
                block_size=self.layout.block_size,
                state=tuple(g.is_state for g in self.layout.groups),
            )
            # The ticket's blocks are already cut to the local ones (remote_ticket);
            # cached_blocks says which token positions they hold.
            start = agent.expect_push if self.config.direction is Direction.PUSH else agent.pull
            # Before the call: a pull over UCX on one host copies inside it (CMA).
            timeline.mark("d_load", load.request_id)
            transfer = start(
                ticket,
                load.local_blocks,
                num_tokens=load.num_tokens,
                cached_blocks=load.skip_blocks,
            )
        except Exception as exc:
            log.error("kvxfer: could not start the load of %s: %s", load.request_id, exc)
            self._stop_keep_alive(load)
            self._fail_load(load.request_id, load.local_blocks, str(exc))
            return
        self._inflight[load.request_id] = transfer
        if self._consumer:
            transfer.add_done_callback(self._on_landed)

    def _stop_keep_alive(self, load: LoadSpec) -> None:
        """A load that never reached the agent's pull: its hold is renewed no more."""
        try:
            self.agent.stop_keep_alive(self._hold_ticket(load.transfer_id, load.remote_params))
        except Exception as exc:
            log.warning("kvxfer: cannot stop renewing %s: %s", load.request_id, exc)

    def _fail_load(self, request_id: str, local_blocks: Groups, why: str) -> None:
        self._failed_recving.add(request_id)
        self._finished_recving.add(request_id)
        if self._block_errors:
            self._invalid_blocks.update(b for g in local_blocks for b in g)
        self._interval.failed(why)

    def _paired_rank(self, params: Mapping[str, Any]) -> int:
        """The producer rank this rank's tickets name: its own, or rank 0 across TP."""
        return 0 if across_tp(params, self.tp_size) else self.tp_rank

    def _release_remote(self, transfer_id: str, params: dict[str, Any], reason: str) -> None:
        try:
            ticket = self._hold_ticket(transfer_id, params)
            self.agent.abort(ticket)  # non-blocking: the message goes from a worker thread
        except Exception as exc:
            log.warning("kvxfer: could not release %s on the producer: %s", transfer_id, exc)
            return
        log.debug("kvxfer: releasing %s on %s (%s)", transfer_id, ticket.engine_id, reason)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        A failed load is reported in both receive sets and its blocks in
        :meth:`block_ids_with_load_errors` in the same step, as vLLM requires. Every id
        is reported once, and only ids vLLM still holds (vLLM asserts on others).

        A load that failed while bytes of it may still land (doomed, not final: a push
        whose producer cannot be reached to say its write ended) fails its request
        now (R-SAFE-4, R-VLLM-7) and keeps its blocks: it is reported failed without
        ``finished_recving``, so vLLM ends the request with an error but holds its
        blocks; ``finished_recving`` follows once the transfer is final, and vLLM
        frees them then (R-SAFE-5).
        """
        if self._idle_step:
            self._await_peers()
        for rid, transfer in list(self._inflight.items()):
            state = transfer.poll()
            if state is TransferState.PENDING:
                if transfer.doomed and not (rid in self._failed_early or rid in self._released):
                    self._fail_early(rid, transfer)
                continue
            del self._inflight[rid]
            self._released.discard(rid)
            early = rid in self._failed_early
            self._failed_early.discard(rid)
            timeline.mark(
                "d_landed",
                rid,
                ok=int(state is TransferState.DONE),
                settled=f"{transfer.stats.settled_at:.6f}",
                bytes=transfer.stats.bytes,
            )
            self._finished_recving.add(rid)
            self._interval.observe(transfer)
            if state is TransferState.FAILED:
                self._failed_recving.add(rid)
                if early:
                    log.info("kvxfer: KV load of %s is final; its blocks are freed now", rid)
                    continue
                if self._block_errors:
                    self._invalid_blocks.update(transfer.invalid_blocks)
                log.warning(
                    "kvxfer: KV load of %s failed (%s): %s",
                    rid,
                    transfer.stats.failure.value if transfer.stats.failure else "?",
                    transfer.error,
                )
        sending: set[str] = set()
        if self._producer:
            freed, self._freed_ids = [*self._freed_ids, *self.agent.freed()], []
            for lease_id in freed:
                held_rid = self._held.pop(str(lease_id), None)
                if held_rid is not None:
                    sending.add(held_rid)
        self._interval.producer(self.agent.stats())  # lease and failure counters
        sending.update(self._orphan_frees)
        self._orphan_frees.clear()
        recving, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return sending, recving, failed

    def _fail_early(self, rid: str, transfer: Transfer) -> None:
        """Tell vLLM that the load of ``rid`` failed, before it is final (see
        :meth:`transfer_results`). Not for a load vLLM ended itself: that request is
        over, and its blocks wait for ``finished_recving`` already."""
        self._failed_early.add(rid)
        self._failed_recving.add(rid)
        if self._block_errors:
            self._invalid_blocks.update(b for g in transfer.local_blocks for b in g)
        log.warning(
            "kvxfer: KV load of %s failed: %s; its blocks stay quarantined until no byte "
            "of it can land",
            rid,
            transfer.doomed_error,
        )

    def _on_landed(self, transfer: Transfer) -> None:
        self._wake.set()  # on the settling thread: quick, never raises

    def _await_peers(self) -> None:
        """An idle step: while it waits on peers alone (a consumer's loads in flight, a
        producer's held blocks), sleep until a load settles (a pull's READ completes, a
        push's notices are drained), a hold ends (read, written, released, expired) or
        :data:`IDLE_WAIT_S` passed. vLLM keeps stepping a producer for as long as it
        holds a request's blocks for its consumer; without this, an instance whose
        consumer never came spun a core until the lease expired."""
        if self._orphan_frees:
            return  # to report now
        loads = self._consumer and bool(self._inflight)
        holds = self._producer and bool(self._held)
        if not (loads or holds):
            return
        self._wake.clear()
        if loads and any(t.done for t in self._inflight.values()):
            return
        if self._producer:
            self._freed_ids.extend(self.agent.freed())
            if self._freed_ids:
                return
        self._wake.wait(IDLE_WAIT_S)

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def interval_stats(self) -> dict[str, Any] | None:
        """This interval's counters (None when nothing happened); resets them."""
        return self._interval.take()

    def close(self) -> None:
        self._ahead.stop()
        self.agent.close()


#: Agent counters a producer reports per interval (deltas), under these stats keys.
_PRODUCER_COUNTERS = {
    "leases_released": "num_leases_released",
    "leases_expired": "num_leases_expired",
    "leases_aborted": "num_leases_aborted",
    "leases_renewed": "num_leases_renewed",
    "renewals_sent": "num_renewals_sent",
    "renewals_refused": "num_renewals_refused",
    "renewals_lapsed": "num_renewals_lapsed",
    "handshakes": "num_handshakes",
    # failure accounting (issue 16), both roles
    "notices_failed": "num_failed_notifications",
    "capability_rejects": "num_capability_rejects",
    "guard_failures": "num_guard_failures",
    "guard_reads": "num_guard_reads",
    "unguarded_pulls": "num_unguarded_pulls",
    "liveness_probes": "num_liveness_probes",
    # R-SAFE-5: quarantined transfers (a level, shipped as its change) and how many ever
    "quarantined": "delta_quarantined",
    "quarantines": "num_quarantines",
}


class _Interval:
    """Per-interval counters in the plain-dict form vLLM ships across processes
    (``KVConnectorStats.data``): numbers add up and lists concatenate when vLLM
    aggregates ranks and steps.

    Keys: ``num_transfers``, ``num_failed``, ``failed_<kind>``, ``bytes``,
    ``descriptors``, ``transfer_s`` / ``post_s`` (one entry per transfer), and on
    producers the lease counters of :data:`_PRODUCER_COUNTERS` (push producers also
    ``num_push_writes``: WRITEs done, several per request with push_stream).
    """

    def __init__(self, *, push: bool = False) -> None:
        self.data: dict[str, Any] = {}
        self._last: dict[str, int] = {}
        self._counters = dict(_PRODUCER_COUNTERS)
        if push:  # a push producer's own transfers are its WRITEs
            self._counters["transfers_done"] = "num_push_writes"

    def _add(self, key: str, value: int) -> None:
        if value:
            self.data[key] = self.data.get(key, 0) + value

    def observe(self, transfer: Transfer) -> None:
        stats = transfer.stats
        self._add("num_transfers", 1)
        if stats.failure is not None:
            self._add("num_failed", 1)
            self._add(f"failed_{stats.failure.value}", 1)
            if stats.stage is not None:
                self._add(f"failed_stage_{stats.stage.value}", 1)
            return
        self._add("bytes", int(stats.bytes))
        self._add("descriptors", int(stats.descriptors))
        self.data.setdefault("transfer_s", []).append(float(stats.transfer_s))
        self.data.setdefault("post_s", []).append(float(stats.post_s))

    def failed(self, why: str) -> None:
        """A load that could not even start."""
        self._add("num_transfers", 1)
        self._add("num_failed", 1)
        self._add("failed_start", 1)

    def producer(self, agent_stats: Any) -> None:
        for attr, key in self._counters.items():
            now = int(getattr(agent_stats, attr, 0))
            self._add(key, now - self._last.get(attr, 0))
            self._last[attr] = now

    def take(self) -> dict[str, Any] | None:
        if not self.data:
            return None
        out, self.data = self.data, {}
        return out
