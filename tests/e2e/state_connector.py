"""kvxfer's connectors with one recurrent-state or KV element corrupted on arrival, for
the negative controls of tests/e2e/test_pd_state.py and tests/e2e/test_pd_block_ratio.py.

Load with ``kv_connector_module_path="tests.e2e.state_connector"`` and the usual
``kv_connector`` name. With ``$KVXFER_E2E_FLIP_STATE=1`` in the consumer's
environment, every load that lands for a request whose id contains :data:`FLIP_MARK`
has one element of its running state slot changed before vLLM learns the load is over
(so before decode's first forward reads it): the first element of the temporal SSM
state of the first Mamba2 / Gated DeltaNet layer gets its high exponent bit flipped
(an element of 0.01 becomes ~1e36). That is what a byte corrupted in flight looks like
to decode; if decode's output does not change, decode
did not use the state kvxfer moved.

With ``$KVXFER_E2E_FLIP_KV=1`` instead, a load for a request whose id contains
:data:`FLIP_KV_MARK` gets every element of its first local block of the first
attention layer negated (vLLM 0.32's CPU caches are block-first).

With ``$KVXFER_E2E_DUMP_STATE`` set to a directory, a request whose id contains
:data:`DUMP_MARK` has its running state slot saved there, every state layer's conv
and temporal SSM state (``torch.save`` of ``{layer: (conv, ssm)}``): by the producer
when it holds the prompt (``<id>.producer.rank<r>.pt``), by each consumer rank when
the load landed, after any corruption above and before decode's first forward reads
the slot (``<id>.consumer.rank<r>.pt``). tests/e2e/test_pd_state_tp.py compares them
byte for byte where output equality proves nothing.

Other requests, and every request without the variables, go through kvxfer's
connectors unchanged, so one decode instance serves both the equality checks and the
control.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from kvxfer.adapters.vllm import connector as kvxfer_connector
from kvxfer.adapters.vllm.scheduler import LoadSpec

__all__ = [
    "DUMP_ENV",
    "DUMP_MARK",
    "ENV",
    "FLIP_KV_MARK",
    "FLIP_MARK",
    "KV_ENV",
    "RblnNixlPullConnector",
    "RblnNixlPushConnector",
    "StateDumpConnector",
    "StateFlipConnector",
]

ENV = "KVXFER_E2E_FLIP_STATE"
#: Marks the requests (in ``X-Request-Id``) whose state is corrupted.
FLIP_MARK = "flip-state"
KV_ENV = "KVXFER_E2E_FLIP_KV"
#: Marks the requests whose attention KV is corrupted.
FLIP_KV_MARK = "flip-kv"
DUMP_ENV = "KVXFER_E2E_DUMP_STATE"
#: Marks the requests whose state slots are saved.
DUMP_MARK = "dump-state"

log = logging.getLogger("kvxfer.adapters.vllm")


class StateFlipConnector(kvxfer_connector._RblnNixlBase):
    """Mix-in over one of kvxfer's connector classes (see the module docstring)."""

    _flip_state: tuple[int, torch.Tensor] | None = None
    _flip_loads: dict[str, LoadSpec]
    _mark: str = FLIP_MARK

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._flip_loads = {}
        if os.environ.get(KV_ENV) == "1":
            for name, cache in kv_caches.items():
                g = int(self._groups.layer_groups.get(name, -1))
                if g >= 0 and not self._groups.groups[g].is_state:
                    self._flip_state = (g, cache)
                    self._mark = FLIP_KV_MARK
                    log.warning("kvxfer e2e: corrupting the KV of %s on marked loads", name)
                    return
            raise RuntimeError(f"{KV_ENV}=1 but no attention layer among {sorted(kv_caches)}")
        if os.environ.get(ENV) != "1":
            return
        state_groups = [g for g, grp in enumerate(self._groups.groups) if grp.is_state]
        context = self._vllm_config.compilation_config.static_forward_context
        for name in kv_caches:
            g = int(self._groups.layer_groups.get(name, -1))
            if g in state_groups:
                # vLLM hands kvxfer a state layer's raw pages; the layer itself keeps
                # its views of them: (conv state, temporal SSM state), slot first.
                states = context[name].kv_cache
                self._flip_state = (g, states[-1])
                log.warning("kvxfer e2e: corrupting the SSM state of %s on marked loads", name)
                return
        raise RuntimeError(f"{ENV}=1 but no state layer among {sorted(kv_caches)}")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        if self._flip_state is None or not isinstance(
            meta, kvxfer_connector.KvxferConnectorMetadata
        ):
            return
        for load in meta.plan.loads:
            if self._mark in load.request_id:
                self._flip_loads[load.request_id] = load

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._flip_state is None:
            return results
        g, ssm = self._flip_state
        failed = set(results.failed_recving or ())
        for rid in results.finished_recving or ():
            load = self._flip_loads.pop(rid, None)
            if load is None or rid in failed:
                continue
            # A state group's one running slot, or an attention group's first block.
            slot = int(load.local_blocks[g][0])
            if self._mark == FLIP_KV_MARK:
                # Every element of the block's K and V negated (their sign bits
                # flipped): one bad block. One flipped element of a random-weight
                # model's K can leave greedy output as it was.
                ssm[slot].neg_()
            else:
                # The high exponent bit of the first element (little-endian: its last
                # byte): one flipped bit, as a bad link would flip it.
                ssm[slot].view(-1)[:1].view(torch.uint8)[-1] ^= 0x40
            what = FLIP_KV_MARK if self._mark == FLIP_KV_MARK else "SSM state"
            log.warning("kvxfer e2e: %s of slot %d of %s corrupted", what, slot, rid)
        return results


class StateDumpConnector(kvxfer_connector._RblnNixlBase):
    """Mix-in saving marked requests' state slots (see the module docstring)."""

    _dump_dir: Path | None = None
    _dump_layers: dict[str, tuple[int, Any]]
    _dump_loads: dict[str, LoadSpec]

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._dump_loads = {}
        where = os.environ.get(DUMP_ENV)
        if not where:
            return
        context = self._vllm_config.compilation_config.static_forward_context
        self._dump_layers = {
            name: (g, context[name].kv_cache)
            for name in sorted(kv_caches)
            if (g := int(self._groups.layer_groups.get(name, -1))) >= 0
            and self._groups.groups[g].is_state
        }
        if not self._dump_layers:
            raise RuntimeError(f"{DUMP_ENV} set but no state layer among {sorted(kv_caches)}")
        self._dump_dir = Path(where)
        self._dump_dir.mkdir(parents=True, exist_ok=True)
        log.warning("kvxfer e2e: saving marked requests' state slots to %s", where)

    def _dump(self, request_id: str, side: str, slots: Any) -> None:
        assert self._dump_dir is not None
        slot_of = {name: int(slots[g][0]) for name, (g, _) in self._dump_layers.items()}
        out = {
            name: tuple(t[slot_of[name]].clone() for t in states)
            for name, (_, states) in self._dump_layers.items()
        }
        path = self._dump_dir / f"{request_id}.{side}.rank{self._tp_rank}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.rename(path)  # whole or absent: the test polls for it
        log.warning("kvxfer e2e: state slots of %s saved to %s", request_id, path)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._get_connector_metadata()
        if self._dump_dir is None or not isinstance(meta, kvxfer_connector.KvxferConnectorMetadata):
            return
        for hold in meta.plan.holds:
            if DUMP_MARK in hold.request_id:
                self._dump(hold.request_id, "producer", hold.block_ids)
        for load in meta.plan.loads:
            if DUMP_MARK in load.request_id:
                self._dump_loads[load.request_id] = load

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        failed = set(results.failed_recving or ())
        for rid in results.finished_recving or ():
            load = self._dump_loads.pop(rid, None)
            if load is not None and rid not in failed:
                self._dump(rid, "consumer", load.local_blocks)
        return results


class RblnNixlPullConnector(
    StateDumpConnector, StateFlipConnector, kvxfer_connector.RblnNixlPullConnector
):
    """kvxfer's pull connector, corrupting or saving marked loads' state."""


class RblnNixlPushConnector(
    StateDumpConnector, StateFlipConnector, kvxfer_connector.RblnNixlPushConnector
):
    """kvxfer's push connector, corrupting or saving marked loads' state."""
