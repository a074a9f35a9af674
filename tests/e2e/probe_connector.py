"""A diagnostic KV connector: records what vLLM hands a connector, moves no KV.

Load it with ``kv_connector_module_path="tests.e2e.probe_connector"`` and
``kv_connector="ProbeConnector"`` (the repository root must be on ``PYTHONPATH``).
Every hook call is appended as one JSON line to
``$KVXFER_PROBE_OUT/<role>-<pid>.jsonl``: ``register_kv_caches`` with each tensor's
shape, strides, dtype, address and storage, plus the scheduler-side calls with the
request's ``kv_transfer_params`` and block ids. This is how
docs/VLLM_ADAPTER_NOTES.md's shapes and call order were observed.

``kv_connector_extra_config.probe_mode``:

* ``"log"`` (default): never claims external tokens, frees blocks at once.
* ``"producer"``: a ``do_remote_decode`` request's blocks are kept after it finishes
  (``request_finished`` returns delay-free plus upstream-style params) and released
  on the next step through ``finished_sending``.
* ``"fake_remote"``: a ``do_remote_prefill`` request claims its whole prompt as
  external tokens, asynchronously; the worker reports it received one step later
  without writing anything (so its output is garbage by design). With
  ``probe_fail: true`` the load is reported failed instead (``failed_recving`` and
  ``get_block_ids_with_load_errors``), to watch ``kv_load_failure_policy``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)


@dataclasses.dataclass
class ProbeMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step."""

    loads: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)
    releases: list[str] = dataclasses.field(default_factory=list)
    step: int = 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return repr(value)


class ProbeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._mode = str(extra.get("probe_mode", "log"))
        self._fail = bool(extra.get("probe_fail", False))
        out = Path(os.environ.get("KVXFER_PROBE_OUT", "/tmp/kvxfer-probe"))
        out.mkdir(parents=True, exist_ok=True)
        self._path = out / f"{role.name.lower()}-{os.getpid()}.jsonl"
        self._t0 = time.monotonic()
        self._step = 0
        # scheduler state
        self._pending_loads: dict[str, list[list[int]]] = {}
        self._pending_releases: list[str] = []
        # worker state
        self._to_finish_recv: set[str] = set()
        self._to_finish_send: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._log(
            "init",
            role=role.name,
            kv_transfer_config=dataclasses.asdict(self._kv_transfer_config)
            if dataclasses.is_dataclass(self._kv_transfer_config)
            else repr(self._kv_transfer_config),
            block_size=vllm_config.cache_config.block_size,
            disable_hybrid_kv_cache_manager=(
                vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
            ),
            kv_cache_config=self._describe_kv_cache_config(kv_cache_config),
        )

    # --- logging ------------------------------------------------------------------

    def _log(self, event: str, **fields: Any) -> None:
        rec = {"t": round(time.monotonic() - self._t0, 4), "event": event, **fields}
        with open(self._path, "a") as f:
            f.write(json.dumps(_jsonable(rec)) + "\n")

    @staticmethod
    def _describe_kv_cache_config(cfg: Any) -> dict[str, Any]:
        groups = []
        for g in cfg.kv_cache_groups:
            spec = g.kv_cache_spec
            groups.append(
                {
                    "layer_names": list(g.layer_names),
                    "spec_type": type(spec).__name__,
                    "spec": repr(spec),
                }
            )
        tensors = [
            {
                "size": t.size,
                "layers": list(getattr(t, "layers", [])),
                "layer_stride": getattr(t, "layer_stride", None),
                "block_stride": getattr(t, "block_stride", None),
                "offset": getattr(t, "offset", None),
            }
            for t in cfg.kv_cache_tensors
        ]
        return {
            "num_blocks": cfg.num_blocks,
            "kv_cache_layout": getattr(cfg, "kv_cache_layout", None),
            "groups": groups,
            "tensors": tensors,
        }

    @staticmethod
    def _req(request: Any) -> dict[str, Any]:
        return {
            "request_id": request.request_id,
            "external_req_id": getattr(request, "external_req_id", None),
            "status": str(request.status),
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_tokens": request.num_tokens,
            "num_computed_tokens": request.num_computed_tokens,
            "kv_transfer_params": request.kv_transfer_params,
        }

    # --- worker side --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        info = {}
        for name, t in kv_caches.items():
            storage = t.untyped_storage()
            info[name] = {
                "type": type(t).__name__,
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "dtype": str(t.dtype),
                "device": str(t.device),
                "data_ptr": t.data_ptr(),
                "storage_ptr": storage.data_ptr(),
                "storage_nbytes": storage.nbytes(),
                "storage_offset": t.storage_offset(),
                "nbytes": t.numel() * t.element_size(),
                "is_contiguous": t.is_contiguous(),
            }
        self._log("register_kv_caches", caches=info)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        result = "not tried"
        if self._kv_caches:
            # Does the engine's block copy op work on this platform?
            name, t = next(iter(self._kv_caches.items()))
            dst = {name: torch.empty_like(t[:2])}
            try:
                copy_operation({name: t}, dst, [0], [1], "d2h")
                result = "ok"
            except Exception as e:
                result = f"{type(e).__name__}: {e}"
        self._log(
            "set_host_xfer_buffer_ops",
            op=f"{getattr(copy_operation, '__module__', '?')}."
            f"{getattr(copy_operation, '__qualname__', repr(copy_operation))}",
            trial_d2h=result,
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ProbeMetadata)
        if meta.loads or meta.releases:
            self._log("start_load_kv", step=meta.step, loads=meta.loads, releases=meta.releases)
        for req_id, groups in meta.loads.items():
            if self._fail:
                self._failed_reqs.add(req_id)
                self._failed_blocks.update(b for g in groups for b in g)
            self._to_finish_recv.add(req_id)
        self._to_finish_send.update(meta.releases)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults(
            finished_sending=set(self._to_finish_send),
            finished_recving=set(self._to_finish_recv),
            failed_recving=set(self._failed_reqs),
        )
        if res.finished_sending or res.finished_recving or finished_req_ids:
            self._log(
                "get_transfer_results",
                finished_req_ids=sorted(finished_req_ids),
                finished_sending=sorted(res.finished_sending),
                finished_recving=sorted(res.finished_recving),
                failed_recving=sorted(res.failed_recving),
            )
        self._to_finish_send.clear()
        self._to_finish_recv.clear()
        self._failed_reqs.clear()
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        if out:
            self._log("get_block_ids_with_load_errors", blocks=sorted(out))
        return out

    def shutdown(self) -> None:
        self._log("shutdown")

    # --- scheduler side -----------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._log("on_new_request", **self._req(request))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        n, is_async = 0, False
        if self._mode == "fake_remote" and params.get("do_remote_prefill"):
            n = request.num_prompt_tokens - num_computed_tokens
            is_async = n > 0
        self._log(
            "get_num_new_matched_tokens",
            arg_num_computed_tokens=num_computed_tokens,
            returns=[n, is_async],
            **self._req(request),
        )
        return n, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        block_ids = [list(g) for g in blocks.get_block_ids()]
        unhashed = [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
        self._log(
            "update_state_after_alloc",
            num_external_tokens=num_external_tokens,
            block_ids=block_ids,
            unhashed_block_ids=unhashed,
            **self._req(request),
        )
        if self._mode == "fake_remote" and params.get("do_remote_prefill"):
            if num_external_tokens > 0:
                self._pending_loads[request.request_id] = block_ids
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._step += 1
        meta = ProbeMetadata(
            loads=dict(self._pending_loads), releases=list(self._pending_releases), step=self._step
        )
        new = [
            {
                "req_id": r.req_id,
                "block_ids": [list(g) for g in r.block_ids] if r.block_ids else None,
                "num_computed_tokens": r.num_computed_tokens,
                "prompt_len": len(r.prompt_token_ids or []),
            }
            for r in scheduler_output.scheduled_new_reqs
        ]
        if new or meta.loads or meta.releases or scheduler_output.finished_req_ids:
            self._log(
                "build_connector_meta",
                step=self._step,
                scheduled_new_reqs=new,
                num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
                finished_req_ids=sorted(scheduler_output.finished_req_ids),
                loads=meta.loads,
                releases=meta.releases,
            )
        self._pending_loads.clear()
        self._pending_releases.clear()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if (
            connector_output.finished_sending
            or connector_output.finished_recving
            or connector_output.invalid_block_ids
            or getattr(connector_output, "failed_recving", None)
        ):
            self._log(
                "update_connector_output",
                finished_sending=sorted(connector_output.finished_sending or ()),
                finished_recving=sorted(connector_output.finished_recving or ()),
                failed_recving=sorted(getattr(connector_output, "failed_recving", None) or ()),
                invalid_block_ids=sorted(connector_output.invalid_block_ids or ()),
            )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        delay, out = False, None
        if self._mode == "producer" and params.get("do_remote_decode"):
            status = str(request.status)
            delay = bool(block_ids) and (
                "FINISHED_LENGTH" in status or "FINISHED_STOPPED" in status
            )
            out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [list(block_ids)],
                "remote_engine_id": self._kv_transfer_config.engine_id,
                "remote_request_id": request.request_id,
                "remote_host": "127.0.0.1",
                "remote_port": 0,
                "tp_size": 1,
                "remote_num_tokens": request.num_computed_tokens,
            }
            if delay:
                self._pending_releases.append(request.request_id)
        self._log(
            "request_finished",
            block_ids=list(block_ids),
            returns=[delay, out],
            **self._req(request),
        )
        return delay, out
