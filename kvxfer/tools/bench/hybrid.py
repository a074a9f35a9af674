"""What sliding-window and chunk modes save on a hybrid model in vLLM: the descriptor
algebra alone, in one process (no NIXL, no memory behind the addresses).

The cache is described as kvxfer's vLLM adapter describes vLLM 0.32's CPU cache
(:func:`kvxfer.adapters.vllm.worker.describe_kv_caches`): one
``(num_blocks, kv_heads, block_size, 2 * head_dim)`` tensor per pair of layers, shared
by a sliding-window layer and a full-attention layer (vLLM's hybrid KV cache manager
gives each group its own block ids over the same bytes). Whole blocks move as one region
per layer; a group whose blocks a mode cuts into token ranges is described one region
per (head, V) and per (head, K, element), because vLLM's CPU attention keeps K
element-major. Per case and mode the table gives the bytes one request moves, the
descriptors its plan posts, the runs left after merging (block ids contiguous on both
sides) and the planning time:

* ``no-HMA``: vLLM's hybrid manager off (a connector without ``SupportsHMA``): every
  layer moves every block of the prompt;
* ``whole``: the manager on: a sliding group moves only the blocks its window keeps;
* ``swa``: ``swa_window_mode``; ``chunk``: ``chunk_mode`` with ``chunk_tokens`` a
  quarter block; ``swa+chunk``: both.

Run: ``python -m kvxfer.tools.bench.hybrid`` (or ``kvxfer bench --hybrid``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, Region

__all__ = ["CASES", "HybridRow", "main", "rows", "table"]

#: gpt-oss-20b-like: 24 layers (every other one a 128-token sliding window), 8 KV heads
#: of 64, bf16.
LAYERS, KV_HEADS, HEAD_DIM, WINDOW, ELT = 24, 8, 64, 128, 2
#: (prompt tokens, block size): a window granule is a block at 128, a quarter at 512.
CASES = ((4000, 128), (4000, 512), (32000, 512))
MODES = ("no-HMA", "whole", "swa", "chunk", "swa+chunk")
_BASE = 1 << 32


class HybridRow(msgspec.Struct, frozen=True, kw_only=True):
    """One (case, mode) line of the table."""

    tokens: int
    block_size: int
    mode: str
    nbytes: int
    descs: int  # descriptors the plan posts
    runs: int  # runs after merging
    us: float  # median plan + runs time


def _options(mode: str, block_size: int) -> PlanOptions:
    chunk = "chunk" in mode
    return PlanOptions(
        chunk_mode=chunk,
        chunk_tokens=block_size // 4 if chunk else None,
        swa_window_mode="swa" in mode,
    )


def layout(mode: str, block_size: int, num_blocks: int) -> KVLayout:
    """The cache as the adapter describes it for ``mode`` (see the module doc)."""
    hybrid = mode != "no-HMA"
    groups = (
        (Group(kind=GroupKind.SLIDING, window=WINDOW), Group(kind=GroupKind.FULL))
        if hybrid
        else (Group(kind=GroupKind.FULL),)
    )
    options = _options(mode, block_size)
    head_bytes = block_size * HEAD_DIM * ELT  # one head's K (or V) in one block
    block = KV_HEADS * 2 * head_bytes
    regions: list[Region] = []
    for layer in range(LAYERS):
        group = (0 if layer % 2 == 0 else 1) if hybrid else 0
        # vLLM's hybrid manager: layers 2j and 2j+1 share one tensor; without it each
        # layer has its own.
        tensor = layer // 2 if hybrid else layer
        base = _BASE + tensor * num_blocks * block
        cut = (
            options.chunk_mode
            and options.chunk_tokens is not None
            and options.chunk_tokens < block_size
        )
        cut = cut or (options.swa_window_mode and group == 0 and block_size > WINDOW)
        if not cut:
            regions.append(
                Region(
                    base=base,
                    num_blocks=num_blocks,
                    stride=block,
                    block_len=block,
                    layer=layer,
                    group=group,
                )
            )
            continue
        for h in range(KV_HEADS):
            k = base + h * 2 * head_bytes
            for e in range(HEAD_DIM):  # K element-major: one region per element
                regions.append(
                    Region(
                        base=k + e * block_size * ELT,
                        num_blocks=num_blocks,
                        stride=block,
                        block_len=block_size * ELT,
                        layer=layer,
                        part=KVPart.K,
                        group=group,
                        head=h,
                        lane=e,
                    )
                )
            regions.append(
                Region(
                    base=k + head_bytes,
                    num_blocks=num_blocks,
                    stride=block,
                    block_len=head_bytes,
                    layer=layer,
                    part=KVPart.V,
                    group=group,
                    head=h,
                )
            )
    return KVLayout(
        block_size=block_size,
        regions=tuple(regions),
        groups=groups,
        kv_layout="NHD"
        if any(r.head or r.lane or r.part is not KVPart.KV for r in regions)
        else "HND",
    )


def _blocks(mode: str, tokens: int, block_size: int) -> list[npt.NDArray[np.int64]]:
    """Each group's block ids, contiguous (ids from 1), as vLLM lists them after the
    adapter kept a sliding group's window blocks."""
    end = -(-tokens // block_size)
    full = np.arange(1, end + 1, dtype=np.int64)
    if mode == "no-HMA":
        return [full]
    first = max(tokens - WINDOW + 1, 0) // block_size
    return [full[first:].copy(), full]


def rows(cases: Sequence[tuple[int, int]] | None = None, repeats: int = 5) -> list[HybridRow]:
    """Measure every (case, mode) of ``cases`` (default :data:`CASES`)."""
    out = []
    for tokens, bs in CASES if cases is None else cases:
        nb = -(-tokens // bs) + 2
        for mode in MODES:
            options = _options(mode, bs)
            table = DescriptorTable.build(layout(mode, bs, nb), options)
            blocks = _blocks(mode, tokens, bs)
            build_plan(table, table, blocks, blocks, tokens).runs(table, table)  # warm up
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = build_plan(table, table, blocks, blocks, tokens)
                runs = plan.runs(table, table)
                samples.append(time.perf_counter() - t0)
            assert runs.nbytes == plan.nbytes
            out.append(
                HybridRow(
                    tokens=tokens,
                    block_size=bs,
                    mode=mode,
                    nbytes=plan.nbytes,
                    descs=plan.num_descriptors,
                    runs=len(runs),
                    us=statistics.median(samples) * 1e6,
                )
            )
    return out


def table(measured: Sequence[HybridRow]) -> str:
    """The Markdown table of ``measured``."""
    lines = [
        "| prompt | block | mode | MiB | vs no-HMA | descriptors | runs merged | plan+runs µs |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    base: dict[tuple[int, int], int] = {}
    for r in measured:
        base.setdefault((r.tokens, r.block_size), r.nbytes)
        ref = base[(r.tokens, r.block_size)]
        lines.append(
            f"| {r.tokens} | {r.block_size} | {r.mode} | {r.nbytes / 2**20:.2f} | "
            f"{ref / r.nbytes:.2f}x | {r.descs} | {r.runs} | {r.us:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxfer.tools.bench.hybrid", description=__doc__)
    p.add_argument("--repeats", type=int, default=5, help="timed plans per case (median)")
    args = p.parse_args(argv)
    print(table(rows(repeats=args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
