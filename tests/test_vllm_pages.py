"""The vLLM adapter's start-up hint for a host KV cache on 4 KiB pages (``page_hint``)."""

from __future__ import annotations

import mmap

import msgspec
import numpy as np
import pytest
import torch

from kvxfer.adapters.vllm import worker
from kvxfer.core.layout import KVLayout, MemKind
from kvxfer.io import pages


def _cache(blocks: int, advice: int) -> torch.Tensor:
    """A (2, blocks, 16, 64) float32 cache in its own map, advised and touched (the map
    closes with the last view of it)."""
    m = mmap.mmap(-1, 2 * blocks * 16 * 64 * 4, flags=mmap.MAP_PRIVATE)
    m.madvise(advice)
    arr = np.frombuffer(m, dtype=np.float32).reshape(2, blocks, 16, 64)
    arr[...] = 1.0  # the kernel backs every page now
    return torch.from_numpy(arr)


@pytest.fixture
def small_pages() -> torch.Tensor:
    return _cache(64, mmap.MADV_NOHUGEPAGE)


@pytest.fixture
def huge_pages() -> torch.Tensor:
    return _cache(512, mmap.MADV_HUGEPAGE)  # 8 MiB: whole 2 MiB pages fit


def test_a_host_cache_on_small_pages_gets_a_hint_naming_the_fix(small_pages: torch.Tensor) -> None:
    hint = worker.page_hint(KVLayout.from_kv_caches([small_pages], block_size=16))
    assert hint is not None and hint.startswith("the KV cache is 0% on huge pages")
    fix = "enable 'madvise'" if pages.thp_mode() == "never" else "THP_MEM_ALLOC_ENABLE=1"
    assert fix in hint


def test_no_hint_for_device_memory_or_addresses_proc_does_not_show(
    small_pages: torch.Tensor,
) -> None:
    layout = KVLayout.from_kv_caches([small_pages], block_size=16)
    on_device = msgspec.structs.replace(
        layout,
        regions=tuple(msgspec.structs.replace(r, mem=MemKind.VRAM) for r in layout.regions),
    )
    assert worker.page_hint(on_device) is None
    unmapped = msgspec.structs.replace(
        layout,
        regions=tuple(
            msgspec.structs.replace(r, base=4096 * (1 + i)) for i, r in enumerate(layout.regions)
        ),
    )
    assert worker.page_hint(unmapped) is None


def test_the_hint_follows_what_the_kernel_granted(huge_pages: torch.Tensor) -> None:
    layout = KVLayout.from_kv_caches([huge_pages], block_size=16)
    share = pages.huge_page_share((r.base, r.end) for r in layout.regions)
    # Huge pages come where the kernel's mode and free memory allow: no hint when they did.
    assert 0.0 <= share <= 1.0
    assert (worker.page_hint(layout) is None) == (share >= 0.5)
    if pages.thp_mode() in ("madvise", "always"):
        assert share > 0.0, "an 8 MiB advised map got no huge page at all"
