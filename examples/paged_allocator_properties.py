"""Property-test an engine's block mapping against kvxfer's plan (docs/TESTING.md).

A decode engine with a paged KV cache and a prefix cache pulls each prompt's KV from a
prefill engine. Only the blocks its prefix cache does not hold are pulled: the engine
passes the *suffix* of its block table (and the producer's) to
:func:`kvxfer.core.descriptors.build_plan`. This script checks, for random prompt streams
sharing prefixes and random :class:`~kvxfer.core.descriptors.PlanOptions` (drawn by
``kvxfer.testing.strategies.plan_options``), that after copying the plan's runs byte by
byte between two real numpy caches:

* every token of the prompt reads back, from the block the engine's block table names,
  the KV the producer computed for it (cached prefix blocks and pulled blocks alike);
* no byte outside the pulled blocks changed: cached blocks shared with other requests,
  free blocks and other live requests' blocks are untouched.

Run: ``python examples/paged_allocator_properties.py [--examples N]``; prints ``OK``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
from collections import deque

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.layout import KVLayout, KVPart, Region
from kvxfer.testing import strategies as kst

BLOCK_SIZE, LAYERS, TOKEN_BYTES = 4, 2, 8


class PagedAllocator:
    """Blocks from a free list; full blocks are kept in a prefix cache until reused.

    A block is keyed by the whole token prefix up to its end (as vLLM hashes block
    chains), so a hit means every earlier token matches too. Free cached blocks are
    evicted oldest first when the free list runs dry.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.cached: dict[tuple[int, ...], int] = {}
        self.key_of: dict[int, tuple[int, ...]] = {}

    def admit(self, tokens: list[int]) -> tuple[list[int], int]:
        """Block table for ``tokens`` and how many leading blocks the cache held."""
        bs, blocks, hits = self.block_size, [], 0
        for i in range(-(-len(tokens) // bs)):
            key = tuple(tokens[: (i + 1) * bs])
            hit = self.cached.get(key) if hits == i and len(key) == (i + 1) * bs else None
            if hit is not None:
                hits += 1
                if self.refs[hit] == 0:
                    self.free.remove(hit)  # revive a free block still holding its KV
                block = hit
            else:
                block = self.free.popleft()
                if block in self.key_of:  # its cached KV is about to be overwritten
                    del self.cached[self.key_of.pop(block)]
            self.refs[block] += 1
            blocks.append(block)
        return blocks, hits

    def commit(self, tokens: list[int], blocks: list[int]) -> None:
        """Publish the request's full blocks to the prefix cache."""
        for i in range(len(tokens) // self.block_size):
            key = tuple(tokens[: (i + 1) * self.block_size])
            if key not in self.cached and blocks[i] not in self.key_of:
                self.cached[key], self.key_of[blocks[i]] = blocks[i], key

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)


class Cache:
    """One instance's KV cache: per layer, K and V arrays of (blocks, block_size, bytes)."""

    def __init__(self, num_blocks: int) -> None:
        self.arrays = [
            np.zeros((num_blocks, BLOCK_SIZE, TOKEN_BYTES), np.uint8) for _ in range(2 * LAYERS)
        ]
        self.layout = KVLayout(
            block_size=BLOCK_SIZE,
            regions=tuple(
                Region(
                    base=a.ctypes.data,
                    num_blocks=num_blocks,
                    stride=a.strides[0],
                    block_len=a.strides[0],
                    layer=i // 2,
                    part=KVPart.K if i % 2 == 0 else KVPart.V,
                )
                for i, a in enumerate(self.arrays)
            ),
        )

    def token(self, blocks: list[int], t: int) -> list[bytes]:
        """What the cache holds for token ``t`` of the request with ``blocks``."""
        return [a[blocks[t // BLOCK_SIZE], t % BLOCK_SIZE].tobytes() for a in self.arrays]


def kv_of(tokens: list[int], t: int) -> list[bytes]:
    """The KV a model computes for token ``t``: it depends on the prefix up to it."""
    prefix = repr(tokens[: t + 1]).encode()
    return [
        hashlib.blake2b(prefix, digest_size=TOKEN_BYTES, salt=bytes([i])).digest()
        for i in range(2 * LAYERS)
    ]


# Prompts share whole-block "documents" so that later prompts hit the prefix cache.
DOCS = [[d * 10 + k for k in range(BLOCK_SIZE)] for d in range(3)]
prompts = st.lists(
    st.builds(
        lambda docs, tail: [tok for d in docs for tok in DOCS[d]] + tail,
        st.lists(st.integers(0, len(DOCS) - 1), max_size=3),
        st.lists(st.integers(100, 103), max_size=2 * BLOCK_SIZE),
    ).filter(len),
    min_size=1,
    max_size=6,
)


def check(options: PlanOptions, stream: list[list[int]], keep_live: int) -> None:
    producer, consumer = Cache(40), Cache(24)
    p_alloc, c_alloc = PagedAllocator(40, BLOCK_SIZE), PagedAllocator(24, BLOCK_SIZE)
    remote = DescriptorTable.build(producer.layout, options)
    local = DescriptorTable.build(consumer.layout, options)
    live: deque[tuple[list[int], list[int]]] = deque()
    for tokens in stream:
        while len(live) > keep_live:  # finished requests give their blocks back
            p_blocks, c_blocks = live.popleft()
            p_alloc.release(p_blocks)
            c_alloc.release(c_blocks)
        # Prefill: the producer computes every token's KV into its blocks.
        p_blocks, _ = p_alloc.admit(tokens)
        for t in range(len(tokens)):
            for a, kv in zip(producer.arrays, kv_of(tokens, t)):
                a[p_blocks[t // BLOCK_SIZE], t % BLOCK_SIZE] = np.frombuffer(kv, np.uint8)
        p_alloc.commit(tokens, p_blocks)
        # Decode: pull only what the prefix cache lacks, i.e. the block table's suffix.
        c_blocks, hits = c_alloc.admit(tokens)
        before = [a.copy() for a in consumer.arrays]
        plan = build_plan(local, remote, c_blocks[hits:], p_blocks[hits:], len(tokens))
        runs = plan.runs(local, remote)
        for dst, src, n in zip(runs.local_addr, runs.remote_addr, runs.length):
            ctypes.memmove(int(dst), int(src), int(n))
        c_alloc.commit(tokens, c_blocks)
        live.append((p_blocks, c_blocks))
        for t in range(len(tokens)):
            assert consumer.token(c_blocks, t) == kv_of(tokens, t), f"token {t} of {tokens}"
        pulled = np.zeros(len(c_alloc.refs), dtype=np.bool_)
        pulled[c_blocks[hits:]] = True
        for a, old in zip(consumer.arrays, before):
            assert (a[~pulled] == old[~pulled]).all(), "bytes outside the pulled blocks changed"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--examples", type=int, default=60)
    args = parser.parse_args()
    layout = Cache(1).layout

    @settings(
        max_examples=args.examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(kst.plan_options(layout), prompts, st.integers(0, 3))
    def prompt_streams_land_exactly(
        options: PlanOptions, stream: list[list[int]], keep_live: int
    ) -> None:
        check(options, stream, keep_live)

    prompt_streams_land_exactly()
    print(f"OK: {args.examples} prompt streams landed exactly")


if __name__ == "__main__":
    main()
