"""How long planning a request takes, on a Qwen3-0.6B-shaped KV cache: a micro-bench
of the descriptor algebra alone, in one process, with no NIXL and no memory behind the
addresses (``kvxfer bench``'s planning cases time the same steps inside a real run,
beside the NIXL request and the transfer).

28 layers x (K, V) = 56 regions of 8 KV heads x 128 head dim in bf16, so one block of
one region is ``block_size * 2 KiB``. For each case the script times, median of
repeats:

* ``plan``: :func:`kvxfer.core.descriptors.build_plan` alone (ids for the backend);
* ``plan+runs(flat)``: plus gathering addresses without merging;
* ``plan+runs(merged)`` with the request's blocks contiguous on both sides, in runs
  of 4 blocks (a recycled free list), and scattered (random permutations), where
  almost nothing merges.

Run: ``python -m kvxfer.tools.bench.plan_micro [--repeats N]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvxfer.core.descriptors import DescriptorTable, build_plan
from kvxfer.core.layout import KVLayout, KVPart, MemKind, Region

__all__ = ["main"]

LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 28, 8, 128, 2
CASES = [(4096, 16), (4096, 1024), (131072, 16)]  # (tokens, block_size)


def qwen3_layout(block_size: int, num_blocks: int, base: int) -> KVLayout:
    """56 regions, each its own allocation (as vLLM's per-layer K and V tensors)."""
    block_len = block_size * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    extent = num_blocks * block_len + (1 << 20)
    regions = tuple(
        Region(
            base=base + i * extent,
            num_blocks=num_blocks,
            stride=block_len,
            block_len=block_len,
            mem=MemKind.VRAM,
            layer=i // 2,
            part=KVPart.K if i % 2 == 0 else KVPart.V,
        )
        for i in range(2 * LAYERS)
    )
    return KVLayout(block_size=block_size, regions=regions)


def median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm caches and numpy's first-call paths
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e3


Blocks = npt.NDArray[np.int64]


def plan_only(
    local: DescriptorTable, remote: DescriptorTable, lb: Blocks, rb: Blocks, n: int
) -> object:
    return build_plan(local, remote, lb, rb, n)


def plan_flat(
    local: DescriptorTable, remote: DescriptorTable, lb: Blocks, rb: Blocks, n: int
) -> object:
    return build_plan(local, remote, lb, rb, n).runs(local, remote, merge=False)


def plan_merged(
    local: DescriptorTable, remote: DescriptorTable, lb: Blocks, rb: Blocks, n: int
) -> object:
    return build_plan(local, remote, lb, rb, n).runs(local, remote, merge=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Print one line per case and planning step: descriptors, runs, µs, ns/descriptor."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=0, help="default: by size")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    header = (
        f"{'tokens':>7} {'bs':>5} {'descs':>7} {'case':<28} {'runs':>7} {'us':>9} {'ns/desc':>8}"
    )
    print(header)
    print("-" * len(header))
    for tokens, bs in CASES:
        blocks = -(-tokens // bs)
        nb = 2 * blocks + 16  # room to scatter
        local = DescriptorTable.build(qwen3_layout(bs, nb, 1 << 40))
        remote = DescriptorTable.build(qwen3_layout(bs, nb + 7, 1 << 44))
        repeats = args.repeats or (200 if blocks * 56 < 100_000 else 30)
        contiguous = (np.arange(blocks) + 3, np.arange(blocks) + 9)
        scattered = (rng.permutation(nb)[:blocks], rng.permutation(nb)[:blocks])
        # A recycled free list: runs of 4 contiguous blocks in random order.
        quads = nb // 4
        fragmented = tuple(
            (rng.permutation(quads)[:, None] * 4 + np.arange(4)).ravel()[:blocks] for _ in "lr"
        )
        rows = [
            ("plan", plan_only, contiguous),
            ("plan+runs(flat)", plan_flat, contiguous),
            ("plan+runs(merged) contig", plan_merged, contiguous),
            ("plan+runs(merged) runs of 4", plan_merged, fragmented),
            ("plan+runs(merged) scatter", plan_merged, scattered),
        ]
        for name, fn, (lb, rb) in rows:
            plan = build_plan(local, remote, lb, rb, tokens)
            runs = len(plan.runs(local, remote, merge="merged" in name))
            us = median_us(functools.partial(fn, local, remote, lb, rb, tokens), repeats)
            n = plan.num_descriptors
            print(
                f"{tokens:>7} {bs:>5} {n:>7} {name:<28} {runs:>7} {us:>9.1f} {us * 1e3 / n:>8.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
