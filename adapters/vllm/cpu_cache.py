"""The in-block order of vLLM's CPU KV cache, probed with vLLM's own cache write.

vLLM 0.32's CPU attention keeps a layer's cache as ``(num_blocks, num_kv_heads,
block_size, 2 * head_size)``; per head, a block holds the K part then the V part, each
``block_size * head_size`` elements, whose order depends on the attention kernel
(the "vec" kernels store K transposed, element-major, and V token-major; the AMX one
packs differently). Token-granular descriptors (chunk_mode, swa_window_mode) need to
know that order, so the connector writes one token into a scratch block with the same
op and ISA the engine uses and looks where its elements landed. An order it does not
recognise is reported as ``None`` and the modes that need it are refused at start-up.

Imports torch and vLLM inside :func:`probe_interior` (called in vLLM's worker only).
"""

from __future__ import annotations

import logging
from typing import Any

from kvxfer.adapters.vllm.cache_layout import Interior

__all__ = ["probe_interior"]

log = logging.getLogger("kvxfer.adapters.vllm")


def _order(part: Any, want: Any, token: int, heads: int, block: int, hs: int) -> Interior | None:
    """Which order puts ``want`` (per head, one token's elements) into ``part``."""
    import torch

    token_major = part.view(heads, block, hs)
    if torch.equal(token_major[:, token], want) and int(torch.count_nonzero(part)) == want.numel():
        return Interior.TOKEN_MAJOR
    element_major = part.view(heads, hs, block)
    if torch.equal(element_major[:, :, token], want):
        return Interior.ELEMENT_MAJOR
    return None


def probe_interior(
    *, num_kv_heads: int, block_size: int, head_size: int, dtype: Any, kv_cache_dtype: str
) -> tuple[Interior, Interior] | None:
    """(K, V) order inside one head's block of vLLM's CPU cache, or None if unknown.

    Args:
        num_kv_heads: KV heads per layer (dim 1 of the cache tensor).
        block_size: tokens per block.
        head_size: elements per head and token.
        dtype: the cache's torch dtype.
        kv_cache_dtype: vLLM's ``cache_config.cache_dtype`` ("auto", "fp8", ...).
    """
    try:
        import torch
        from vllm import _custom_ops as ops

        # The ISA the engine's CPU attention picks for this cache (a module-level
        # function of vLLM's backend; the same call its metadata builder makes).
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
        cache = torch.zeros(1, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(1, num_kv_heads, 2 * block_size, head_size).chunk(
            2, dim=2
        )
        # Small distinct integers: exact in bf16/fp16; K and V told apart by sign.
        values = torch.arange(num_kv_heads * head_size) % 97 + 1
        key = values.view(1, num_kv_heads, head_size).to(dtype)
        token = 1 if block_size > 1 else 0
        ops.cpu_attn_reshape_and_cache(
            key, -key, key_cache, value_cache, torch.tensor([token], dtype=torch.int64), isa
        )
        parts = cache[0].reshape(num_kv_heads, 2, block_size * head_size)
        k = _order(parts[:, 0], key[0], token, num_kv_heads, block_size, head_size)
        v = _order(parts[:, 1], -key[0], token, num_kv_heads, block_size, head_size)
    except Exception as exc:  # an engine without the op: the order stays unknown
        log.warning("kvxfer: could not probe the CPU KV cache order: %s", exc)
        return None
    if k is None or v is None:
        log.warning("kvxfer: unknown CPU KV cache order (isa %s): K %s, V %s", isa, k, v)
        return None
    log.info("kvxfer: CPU KV cache order (isa %s): K %s, V %s", isa, k.value, v.value)
    return k, v
