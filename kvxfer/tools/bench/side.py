"""One bench process's state, and what both of its measurements use.

A :class:`BenchSide` holds the process's model-shaped cache, its kvxfer agents, its
raw NIXL agent and the descriptor tables of the current case group; the set-up and
kvxfer commands (:mod:`.worker`) and the raw NIXL, memcpy and planning measurements
(:mod:`.measure`) both get it passed in. Its helpers are the parts the two share: the
case's block lists and plans, byte verification, and the host-bounce copies done
directly.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import kvxfer.tools.bench.block_ratio as block_ratio
import kvxfer.tools.bench.cases as bc
from kvxfer.tools.bench.data import MemcpyBench, verify_regions, zero_rows
from kvxfer.tools.bench.device import TorchKVCache
from kvxfer.tools.bench.raw_nixl import RawNixl

if TYPE_CHECKING:
    from kvxfer.tools.bench.device import DeviceMemcpy

__all__ = ["BenchSide"]


class BenchSide:
    """A producer's or a consumer's state, filled in by the parent's commands."""

    def __init__(self, conn: Connection, side: str, raw: RawNixl) -> None:
        self.conn, self.side, self.raw = conn, side, raw
        self.raw_peer: str | None = None
        self.cache: Any = None
        self.peer_layout: Any = None  # the other side's cache layout
        self.memcpy: MemcpyBench | DeviceMemcpy | None = None
        self.agents: dict[str, Any] = {}
        self.exposed: Any = None
        self.dlists: tuple[Any, Any] | None = None
        self.tables: tuple[Any, Any] | None = None
        self.verify_tables: tuple[Any, Any] | None = None
        self.block_cache: dict[tuple[bc.Case, bool], npt.NDArray[np.int64]] = {}
        self.engine_busy_s = 0.0  # Python the producer runs after starting a push

    def engine_busy(self) -> None:
        """``--engine-busy-ms``: keep this (the engine's) thread running Python for a
        while after starting a push, as an engine's step goes on after hold(): a
        background thread of this process then gets the GIL only at the interpreter's
        switch interval. Raw NIXL's producer does the same after its write returns."""
        end = time.perf_counter() + self.engine_busy_s
        spins = 0
        while time.perf_counter() < end:
            spins += 1

    @property
    def own_side(self) -> str:
        """This process's side as the case's block lists name it ("remote": producer)."""
        return "remote" if self.side == "producer" else "local"

    def blocks(self, case: bc.Case, *, own: bool) -> npt.NDArray[np.int64]:
        """The case's block ids on this side (``own``) or the other; computed once, so
        that generating them never lands inside a timed region."""
        theirs = "local" if self.side == "producer" else "remote"
        key = (case, own)
        if key not in self.block_cache:
            self.block_cache[key] = bc.case_blocks(case, self.own_side if own else theirs)
        return self.block_cache[key]

    def groups(self, blocks: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
        """The same block list for every KV cache group (the bench's caches share one
        block table across groups)."""
        return [blocks] * len(self.exposed.groups)

    def plan(self, case: bc.Case, tables: tuple[Any, Any]) -> Any:
        """kvxfer's plan of the case on the given (local, remote) tables."""
        from kvxfer.core.descriptors import build_plan

        mine, theirs = self.blocks(case, own=True), self.blocks(case, own=False)
        return build_plan(tables[0], tables[1], self.groups(mine), self.groups(theirs), case.tokens)

    def ratio_runs(self, case: bc.Case, local: Any, remote: Any) -> Any:
        """kvxfer's address runs of a pull between block sizes on the consumer's
        ``local`` layout from the producer's ``remote`` one (:mod:`.block_ratio`)."""
        mine, theirs = self.blocks(case, own=True), self.blocks(case, own=False)
        return block_ratio.pull_runs(case, local, remote, mine, theirs)

    def prepare_verify(self, case: bc.Case, verify: bool) -> None:
        """Before a transfer: zero the blocks it will land in when it is verified, and
        drop raw NIXL notifications left from earlier reps."""
        if verify:
            blocks = self.blocks(case, own=True)
            if isinstance(self.cache, TorchKVCache):  # --device: zeroed where it is
                self.cache.zero(blocks)
            else:
                zero_rows(self.cache.regions, blocks)
            if case.backend == "host_bounce":
                # Staging still holds the last transfer's bytes: clear it as well, so a
                # transfer that moved nothing cannot pass on its predecessor's bytes.
                from kvxfer.backends.host_bounce import host_block_view

                for agent in self.agents.values():
                    for region in agent.exposed_layout.regions:
                        host_block_view(region)[blocks] = 0
        if self.side == "consumer":
            self.raw.forget_notifs()

    def verify(self, case: bc.Case) -> int:
        """Wrong 8-byte words in the case's landed blocks (0: byte-exact)."""
        assert self.verify_tables is not None
        if case.is_ratio:
            layout = self.cache.layout()
            runs = self.ratio_runs(case, layout, self.peer_layout)
            addrs = block_ratio.split_at_regions(runs, layout, self.peer_layout)
        else:
            plan = self.plan(case, self.verify_tables)
            runs = plan.runs(*self.verify_tables, merge=False)
            addrs = (runs.local_addr, runs.remote_addr, runs.length)
        rows = [self.blocks(case, own=True)] * len(self.cache.regions)
        device = isinstance(self.cache, TorchKVCache)  # --device: check a host copy
        return verify_regions(
            self.cache.host_regions() if device else self.cache.regions,
            *addrs,
            self.peer_layout,
            rows,
            self.cache.bases() if device else None,
        )

    def stage(self, case: bc.Case, out: bool) -> float:
        """The two host-bounce copies, done directly (the raw baseline's share): a
        slice copy per run of consecutive blocks (engine block b <-> staging row b)."""
        from kvxfer.backends.host_bounce import host_block_view

        blocks = np.unique(self.blocks(case, own=True))
        cut = np.flatnonzero(np.diff(blocks) != 1) + 1
        starts = blocks[np.concatenate(([0], cut))].tolist()
        stops = (blocks[np.append(cut - 1, len(blocks) - 1)] + 1).tolist()
        t0 = time.perf_counter()
        for eng, stg in zip(self.cache.layout().regions, self.exposed.regions):
            e, s = host_block_view(eng), host_block_view(stg)
            src, dst = (e, s) if out else (s, e)
            for a, z in zip(starts, stops):
                dst[a:z] = src[a:z]
        return time.perf_counter() - t0
