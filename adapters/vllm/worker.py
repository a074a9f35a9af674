"""DRAFT — worker-side half of the vLLM connectors: vLLM's KV tensors and step calls
mapped onto one :class:`kvxfer.Agent` per worker process.

Not finished and not proven against a real engine (the Agent is still being
written); see docs/VLLM_ADAPTER_NOTES.md for the facts it is built on. No transfer
logic lives here: the Agent owns handshakes, plans, leases and progress. This module
only translates:

* ``register_kv_caches`` -> :func:`describe_kv_caches` -> ``Agent.register`` (+ serve)
* a step's :class:`~kvxfer.adapters.vllm.scheduler.StepPlan` -> ``hold`` / ``pull`` /
  ``expect_push`` / ``abort``
* ``get_transfer_results`` -> ``Transfer.poll()`` of what is in flight, ``Agent.freed()``
* ``get_kv_connector_stats`` -> per-interval counters vLLM aggregates across ranks

torch is never imported here: tensors are duck-typed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvxfer.adapters.vllm.scheduler import StepPlan
from kvxfer.config import Direction, TransferConfig
from kvxfer.layout import KVLayout

__all__ = ["WorkerSide", "describe_kv_caches"]

log = logging.getLogger("kvxfer.adapters.vllm")


def describe_kv_caches(
    kv_caches: Mapping[str, Any], *, block_size: int, num_blocks: int, kv_layout: str
) -> KVLayout:
    """The :class:`KVLayout` of vLLM's per-layer KV tensors, without copying.

    Tensors shared by several layers (KV sharing) are described once. Three shapes
    are understood: block-first ``(num_blocks, ...)`` (vLLM 0.32 on CPU gives
    ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``, one region per layer
    holding K and V), ``(2, num_blocks, ...)`` and ``(num_blocks, 2, ...)`` (a K and
    a V region per layer).

    On CPU the block interior is head-major (per head: all K rows, then all V rows), so
    these regions are token-major only *per head*: whole-block transfers are exact,
    token-partial ones (chunk_mode) would need one region per (layer, head, K/V).
    """
    seen: set[int] = set()
    tensors = []
    for t in kv_caches.values():
        if int(t.data_ptr()) in seen:
            continue
        seen.add(int(t.data_ptr()))
        tensors.append(t)
    first = tensors[0]
    if int(first.shape[0]) == num_blocks:
        return KVLayout.from_tensors(tensors, block_size=block_size, kv_layout=kv_layout)
    kv_dim = 0 if int(first.shape[0]) == 2 else 1
    return KVLayout.from_kv_caches(
        tensors, block_size=block_size, kv_dim=kv_dim, kv_layout=kv_layout
    )


class WorkerSide:
    """One worker's Agent and the transfers it has in flight.

    Args:
        config: The parsed connector configuration.
        agent_factory: Builds the Agent once the layout is known (injected so tests
            can pass a fake): ``agent_factory(layout) -> Agent``.
        defer_registration: Device-to-device: register only after the engine's
            warm-up (the first step), since device memory may move before.
    """

    def __init__(
        self,
        config: TransferConfig,
        *,
        agent_factory: Callable[[KVLayout], Any],
        defer_registration: bool = False,
    ) -> None:
        self.config = config
        self._agent_factory = agent_factory
        self._defer = defer_registration
        self.agent: Any = None
        self._copy_op: Callable[..., None] | None = None
        self._inflight: dict[str, Any] = {}  # request id -> Transfer
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._interval = _Interval()

    # -- set-up ------------------------------------------------------------------------
    def register_kv_caches(
        self, kv_caches: Mapping[str, Any], *, block_size: int, num_blocks: int, kv_layout: str
    ) -> None:
        layout = describe_kv_caches(
            kv_caches, block_size=block_size, num_blocks=num_blocks, kv_layout=kv_layout
        )
        self.agent = self._agent_factory(layout)
        self.agent.register(layout, defer=self._defer)
        self.agent.serve()
        log.info("kvxfer: KV layout %s", layout.summary())

    def set_copy_op(self, op: Callable[..., None]) -> None:
        """Host bounce: the engine's block copy (vLLM's ``copy_kv_blocks``).

        On vLLM's CPU platform that op is unusable (the platform defines no block
        swap functions; calling it raises TypeError) and the KV cache already is host
        memory, so it is kept only for accelerator platforms.
        """
        self._copy_op = op

    def handshake_info(self) -> dict[str, Any] | None:
        """What the scheduler side puts into tickets: the agent's advertised address."""
        if self.agent is None:
            return None
        host, port = self.agent.address
        return {"host": host, "port": port, "incarnation": int(self.agent.incarnation)}

    # -- per step ------------------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """Start what the scheduler queued. Never raises: vLLM's engine dies on an
        exception from a connector hook, so failures become failed transfers."""
        agent = self.agent
        if agent is None:
            return
        if self._defer:
            agent.complete_registration()
            self._defer = False
        for hold in plan.holds:
            try:
                agent.hold(hold.request_id, hold.block_ids, hold.num_tokens, lease_s=hold.lease_s)
            except Exception:
                log.exception(
                    "kvxfer: could not hold %s; its blocks stay until lease expiry", hold.request_id
                )
        for load in plan.loads:
            self._start_load(
                load.request_id,
                load.remote_params,
                load.local_blocks,
                load.skip_blocks,
                load.num_tokens,
            )
        for rel in plan.releases:
            self._release_remote(rel.remote_params, rel.reason)

    def _start_load(
        self,
        request_id: str,
        params: dict[str, Any],
        local_blocks: tuple[tuple[int, ...], ...],
        skip_blocks: int,
        num_tokens: int,
    ) -> None:
        from kvxfer.agent import Ticket

        try:
            ticket = Ticket.from_kv_transfer_params(params, num_tokens)
            if skip_blocks:
                ticket = msgspec.structs.replace(
                    ticket, block_ids=tuple(g[skip_blocks:] for g in ticket.block_ids)
                )
            if self.config.direction is Direction.PUSH:
                transfer = self.agent.expect_push(ticket, local_blocks, num_tokens=num_tokens)
            else:
                # TODO(agent): pull() handshakes synchronously with a new peer; that
                # stalls this engine step. Upstream runs handshakes in the background.
                transfer = self.agent.pull(ticket, local_blocks, num_tokens=num_tokens)
        except Exception:
            log.exception("kvxfer: could not start the load of %s", request_id)
            self._failed_recving.add(request_id)
            self._finished_recving.add(request_id)
            self._invalid_blocks.update(b for g in local_blocks for b in g)
            return
        self._inflight[request_id] = transfer

    def _release_remote(self, params: dict[str, Any], reason: str) -> None:
        from kvxfer.agent import Ticket

        try:
            ticket = Ticket.from_kv_transfer_params(params)
        except Exception:
            return
        # abort() is a side-channel round trip: keep it off the engine step.
        threading.Thread(
            target=self.agent.abort, args=(ticket,), name="kvxfer-release", daemon=True
        ).start()
        log.debug("kvxfer: releasing %s on %s (%s)", ticket.request_id, ticket.engine_id, reason)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call.

        A failed load is reported in both receive sets and its blocks in
        :meth:`block_ids_with_load_errors` in the same step, as vLLM requires.
        """
        from kvxfer.transfer import TransferState

        for rid, transfer in list(self._inflight.items()):
            state = transfer.poll()
            if state is TransferState.PENDING:
                continue
            del self._inflight[rid]
            self._finished_recving.add(rid)
            self._interval.observe(transfer)
            if state is TransferState.FAILED:
                self._failed_recving.add(rid)
                self._invalid_blocks.update(transfer.invalid_blocks)
        sending = set(self.agent.freed()) if self.agent is not None else set()
        recving, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return sending, recving, failed

    def block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def interval_stats(self) -> dict[str, Any] | None:
        """This interval's counters (None when nothing happened); resets them."""
        return self._interval.take()

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


class _Interval:
    """Per-interval transfer counters in the plain-dict form vLLM ships across
    processes (``KVConnectorStats.data``)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def observe(self, transfer: Any) -> None:
        stats = transfer.stats
        d = self.data
        failed = stats.failure is not None
        d["num_transfers"] = d.get("num_transfers", 0) + 1
        d["num_failed"] = d.get("num_failed", 0) + int(failed)
        d["bytes"] = d.get("bytes", 0) + int(stats.bytes)
        d.setdefault("transfer_s", []).append(float(stats.transfer_s))
        d.setdefault("post_s", []).append(float(stats.post_s))

    def take(self) -> dict[str, Any] | None:
        if not self.data:
            return None
        out, self.data = self.data, {}
        return out
