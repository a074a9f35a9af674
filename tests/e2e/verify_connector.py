"""kvxfer's connectors with a byte-level verification mode, for the e2e tests.

Load with ``kv_connector_module_path="tests.e2e.verify_connector"`` and the usual
``kv_connector`` name (``RblnNixlPullConnector`` or ``RblnNixlPushConnector``: the
classes here carry the real names, because kvxfer's config parser accepts only those
and vLLM looks the class up by that name in this module). They behave exactly as
kvxfer's connectors; in addition, with ``$KVXFER_VERIFY_OUT`` set, every worker rank
appends one JSON line per request to ``$KVXFER_VERIFY_OUT/<side>-<engine>-r<rank>-
<pid>.jsonl`` (read by :mod:`tests.e2e.kv_digests`):

* producer, in the step that holds a prompt's blocks for its consumer (after the
  forward that wrote the prompt, before the blocks can be freed): a digest of every
  token ``[0, num_tokens)`` the hold covers;
* consumer, in the step that reports the load finished (the request still waits for
  its KV, so no forward of decode has touched its blocks yet): a digest of every token
  ``[skip_blocks * block_size, num_tokens)`` the load wrote.

A digest covers one (layer, K or V, global KV head, token): the ``head_size`` elements
of that token's K (or V) in that head, wherever the engine's CPU cache keeps them.
Where that is is probed at start-up with vLLM's own cache-write op (one token and head
at a time into a scratch block), so the check does not rely on kvxfer's view of the
layout (which the transfer itself uses). The global head is the rank's first head plus
``h``: ``tp_rank * local heads`` as vLLM shards KV heads when TP does not exceed their
number, ``tp_rank // replicas`` where a head is replicated on several ranks.

To verify another connector class, derive from :class:`VerifyingConnector` and it
(``class X(VerifyingConnector, kvxfer_connector_class)``), as the two below do.
Only layers of full-attention KV cache groups are digested.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from kvxfer.adapters.vllm import connector as kvxfer_connector
from kvxfer.adapters.vllm.scheduler import Groups, LoadSpec
from kvxfer.adapters.vllm.startup import tp_identity
from kvxfer.core.layout import GroupKind

from .kv_digests import ENV

__all__ = ["RblnNixlPullConnector", "RblnNixlPushConnector", "VerifyingConnector"]

log = logging.getLogger("kvxfer.adapters.vllm")

#: Bytes per digest (hex doubles it): collisions are no concern at this size.
DIGEST_BYTES = 8


def _token_offsets(cache: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU cache write puts each (head, token, element) in a block.

    Returns ``(k, v)``, each ``(num_kv_heads, block_size, head_size)`` int64 flat
    offsets into one block of ``cache`` (``(num_blocks, heads, block_size, 2 *
    head_size)``). Written one (token, head) at a time with values 1..head_size (exact
    in every float type the engine uses, up to a head size of 256), K positive and V
    negative, and read back from where they landed.

    Raises:
        RuntimeError: a write did not land as exactly ``head_size`` distinct K and V
            elements (an order this probe cannot map).
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    _, heads, block, two_hs = (int(d) for d in cache.shape)
    hs = two_hs // 2
    # The ISA the engine's attention picked for this cache (the test servers pin the
    # portable kernels; this follows whatever the engine does).
    isa = cpu_attn._get_attn_isa(cache.dtype, block, hs, kv_cache_dtype)
    scratch = torch.zeros(1, heads, block, two_hs, dtype=cache.dtype)
    key_cache, value_cache = scratch.view(1, heads, 2 * block, hs).chunk(2, dim=2)
    values = (torch.arange(hs) + 1).to(cache.dtype)
    offsets = torch.empty(2, heads, block, hs, dtype=torch.int64)
    for t in range(block):
        for h in range(heads):
            scratch.zero_()
            key = torch.zeros(1, heads, hs, dtype=cache.dtype)
            key[0, h] = values
            ops.cpu_attn_reshape_and_cache(
                key, -key, key_cache, value_cache, torch.tensor([t], dtype=torch.int64), isa
            )
            flat = scratch.view(-1).float()
            for part, sign in ((0, 1.0), (1, -1.0)):
                where = torch.nonzero(flat * sign > 0).squeeze(1)
                element = (flat[where] * sign).round().long() - 1
                if where.numel() != hs or sorted(element.tolist()) != list(range(hs)):
                    raise RuntimeError(
                        f"cache write of token {t}, head {h} (isa {isa}) landed as "
                        f"{where.numel()} elements, not a permutation of {hs}"
                    )
                offsets[part, h, t, element] = where
    return offsets[0], offsets[1]


class _LayerDigests:
    """Digests of one rank's KV cache, per (layer, K/V, global head, token)."""

    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        *,
        layer_groups: dict[str, int],
        full_groups: set[int],
        block_size: int,
        tp_rank: int,
        kv_cache_dtype: str,
        first_head: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.layers: list[tuple[str, int, torch.Tensor]] = []
        for name, t in kv_caches.items():
            g = int(layer_groups.get(name, 0))
            if g not in full_groups:
                continue  # sliding groups keep only a window: not checked here
            if t.dim() != 4 or int(t.shape[2]) != block_size:
                raise RuntimeError(f"{name}: not vLLM's CPU cache shape: {tuple(t.shape)}")
            self.layers.append((name, g, t))
        first = self.layers[0][2]
        self.local_heads = int(first.shape[1])
        self.first_head = tp_rank * self.local_heads if first_head is None else first_head
        self.k_off, self.v_off = _token_offsets(first, kv_cache_dtype)

    @property
    def heads(self) -> list[int]:
        return list(range(self.first_head, self.first_head + self.local_heads))

    def digest(self, blocks: Groups, first_block: int, start: int, end: int) -> dict[str, Any]:
        """Digests of tokens ``[start, end)``; ``blocks[g][i]`` holds the tokens of
        block index ``first_block + i`` of the request in KV cache group ``g``."""
        bs = self.block_size
        tokens = torch.arange(start, end)
        out: dict[str, list[str]] = {}
        for name, g, t in self.layers:
            ids = torch.tensor(blocks[g], dtype=torch.int64)[tokens // bs - first_block]
            unique, row = torch.unique(ids, return_inverse=True)
            # Copies only the request's blocks; works for any strides of the cache.
            sel = t.index_select(0, unique).reshape(len(unique), -1).contiguous().view(-1)
            base = (row * (sel.numel() // len(unique))).unsqueeze(1)
            slot = tokens % bs
            for part, offsets in (("K", self.k_off), ("V", self.v_off)):
                for h in range(self.local_heads):
                    vals = sel[base + offsets[h, slot]]  # (tokens, head_size)
                    raw = vals.contiguous().view(torch.uint8).reshape(len(tokens), -1).numpy()
                    out[f"{name}|{part}|{self.first_head + h}"] = [
                        hashlib.blake2b(r.tobytes(), digest_size=DIGEST_BYTES).hexdigest()
                        for r in raw
                    ]
        return {"start": start, "end": end, "heads": self.heads, "digests": out}


class VerifyingConnector(kvxfer_connector._RblnNixlBase):
    """Mix-in over one of kvxfer's connector classes (see the module docstring).

    Off (a pure pass-through) unless ``$KVXFER_VERIFY_OUT`` is set in the engine's
    environment. Never raises into vLLM: a failure to digest is written as a record
    with ``error`` set, which fails the test that reads it.
    """

    _verify_out: Path | None = None
    _digests: _LayerDigests | None = None
    _verify_error: str | None = None
    _verify_loads: dict[str, LoadSpec]

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        out = os.environ.get(ENV)
        if not out:
            return
        self._verify_out = Path(out)
        self._verify_out.mkdir(parents=True, exist_ok=True)
        self._verify_loads = {}
        try:
            self._digests = _LayerDigests(
                kv_caches,
                layer_groups=dict(self._groups.layer_groups),
                full_groups={
                    g for g, grp in enumerate(self._groups.groups) if grp.kind is GroupKind.FULL
                },
                block_size=self.block_size,
                tp_rank=self._tp_rank,
                kv_cache_dtype=str(self._vllm_config.cache_config.cache_dtype),
                # Replicated heads: rank r holds head r // replicas (the TP identity).
                first_head=tp_identity(self._vllm_config, self._tp_rank)
                .heads.heads_of(self._tp_rank)
                .start,
            )
            log.info(
                "kvxfer verify: digesting KV heads %s of rank %d into %s",
                self._digests.heads,
                self._tp_rank,
                self._verify_out,
            )
        except Exception as exc:
            self._verify_error = f"{type(exc).__name__}: {exc}"
            log.exception("kvxfer verify: cannot digest this cache")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        if self._verify_out is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, kvxfer_connector.KvxferConnectorMetadata):
            return
        for hold in meta.plan.holds:
            # The hold just ran (super): the prompt's forward is over and its blocks
            # stay untouched until the consumer is done with them.
            self._record(
                "producer", hold.request_id, hold.lease_id, hold.block_ids, 0, 0, hold.num_tokens
            )
        for load in meta.plan.loads:
            self._verify_loads[load.request_id] = load

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        if self._verify_out is None:
            return results
        failed = set(results.failed_recving or ())
        for rid in results.finished_recving or ():
            load = self._verify_loads.pop(rid, None)
            if load is None or rid in failed:
                continue
            # Landed, and the request waits for vLLM to learn so: decode has not run
            # a forward over these blocks yet.
            bs = self.block_size
            self._record(
                "consumer",
                rid,
                load.transfer_id,
                load.local_blocks,
                load.skip_blocks,
                load.skip_blocks * bs,
                load.num_tokens,
            )
        return results

    def _record(
        self,
        side: str,
        request_id: str,
        transfer_id: str,
        blocks: Groups,
        first_block: int,
        start: int,
        end: int,
    ) -> None:
        assert self._verify_out is not None
        rec: dict[str, Any] = {
            "side": side,
            "request_id": request_id,
            "transfer_id": transfer_id,
            "tp_rank": self._tp_rank,
            "tp_size": self._tp_size,
            # Wall time: lines up with the engines' logs when a pair is slow.
            "wall": round(time.time(), 3),
        }
        try:
            if self._digests is None:
                raise RuntimeError(self._verify_error or "no digests")
            rec.update(self._digests.digest(blocks, first_block, start, end))
        except Exception as exc:  # never into vLLM: the test reads the error instead
            log.exception("kvxfer verify: digest of %s failed", request_id)
            rec["error"] = f"{type(exc).__name__}: {exc}"
        path = self._verify_out / f"{side}-{self.engine_id}-r{self._tp_rank}-{os.getpid()}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class RblnNixlPullConnector(VerifyingConnector, kvxfer_connector.RblnNixlPullConnector):
    """kvxfer's pull connector, digesting what it holds and what it loads."""


class RblnNixlPushConnector(VerifyingConnector, kvxfer_connector.RblnNixlPushConnector):
    """kvxfer's push connector, digesting what it holds and what it receives."""
