"""What a bench process measures and checks: block lists and plans of a case, byte
verification, the host-bounce copies done directly, raw NIXL transfers, memcpy, and
the planning cost. Mixed into the bench process class of :mod:`.worker`.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

import kvxfer.tools.bench.cases as bc
from kvxfer.tools.bench.data import MemcpyBench, verify_regions, zero_rows
from kvxfer.tools.bench.raw_nixl import RawNixl

__all__ = ["DONE_NOTICE", "Measure"]

DONE_NOTICE = b"raw-done" * 16  # about the size of kvxfer's signed DONE notice


class Measure:
    """State the measurements read (set up by the bench process's commands)."""

    conn: Connection
    side: str
    raw: RawNixl
    raw_peer: str | None
    cache: Any
    peer_layout: Any
    memcpy: MemcpyBench | None
    agents: dict[str, Any]
    exposed: Any
    dlists: tuple[Any, Any] | None
    tables: tuple[Any, Any] | None
    verify_tables: tuple[Any, Any] | None
    last_runs: int
    _block_cache: dict[tuple[bc.Case, bool], npt.NDArray[np.int64]]
    engine_busy_s: float

    def engine_busy(self) -> None:
        """``--engine-busy-ms``: keep this (the engine's) thread running Python for a
        while after starting a push, as an engine's step goes on after hold(): a
        background thread of this process then gets the GIL only at the interpreter's
        switch interval. Raw NIXL's producer does the same after its write returns."""
        end = time.perf_counter() + self.engine_busy_s
        spins = 0
        while time.perf_counter() < end:
            spins += 1

    # -- helpers ----------------------------------------------------------------------
    def _blocks(self, case: bc.Case, *, own: bool) -> npt.NDArray[np.int64]:
        """The case's block ids on this side (``own``) or the other; computed once, so
        that generating them never lands inside a timed region."""
        mine = "remote" if self.side == "producer" else "local"
        theirs = "local" if self.side == "producer" else "remote"
        key = (case, own)
        if key not in self._block_cache:
            self._block_cache[key] = bc.case_blocks(case, mine if own else theirs)
        return self._block_cache[key]

    def _groups(self, blocks: npt.NDArray[np.int64]) -> list[npt.NDArray[np.int64]]:
        return [blocks] * len(self.exposed.groups)

    def _plan(self, case: bc.Case, tables: tuple[Any, Any]) -> Any:
        from kvxfer.descriptors import build_plan

        mine, theirs = self._blocks(case, own=True), self._blocks(case, own=False)
        return build_plan(
            tables[0], tables[1], self._groups(mine), self._groups(theirs), case.tokens
        )

    def _prepare_verify(self, case: bc.Case, verify: bool) -> None:
        if verify:
            blocks = self._blocks(case, own=True)
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

    def _verify(self, case: bc.Case) -> int:
        assert self.verify_tables is not None
        plan = self._plan(case, self.verify_tables)
        runs = plan.runs(*self.verify_tables, merge=False)
        rows = [self._blocks(case, own=True)] * len(self.cache.regions)
        return verify_regions(
            self.cache.regions,
            runs.local_addr,
            runs.remote_addr,
            runs.length,
            self.peer_layout,
            rows,
        )

    def _stage(self, case: bc.Case, out: bool) -> float:
        """The two host-bounce copies, done directly (the raw baseline's share): a
        slice copy per run of consecutive blocks (engine block b <-> staging row b)."""
        from kvxfer.backends.host_bounce import host_block_view

        blocks = np.unique(self._blocks(case, own=True))
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

    @staticmethod
    def _stats(transfer: Any) -> dict[str, Any]:
        s = transfer.stats
        return {
            "bytes": s.bytes,
            "descriptors": s.descriptors,
            "plan_s": s.plan_s,
            "post_s": s.post_s,
            "transfer_s": s.transfer_s,
        }

    # -- raw NIXL ---------------------------------------------------------------------
    def _counts(self, plan: Any) -> dict[str, int]:
        """What a raw request moved, worked out after its timed region."""
        assert self.tables is not None
        self.last_runs = len(plan.runs(*self.tables))
        return {
            "descriptors": plan.num_descriptors,
            "bytes": plan.nbytes,
            "runs": self.last_runs,
        }

    def _timed_ids(self, case: bc.Case) -> tuple[Any, Any, float, Any]:
        """The request's descriptor ids from the engine's block lists, as a raw NIXL
        user computes them per request (here with kvxfer's own algebra, so that they
        are the identical descriptors): inside the timed region, and computed only
        there. An untimed plan just before would run the timed one on warm caches,
        which kvxfer's own per-request planning never gets."""
        assert self.tables is not None
        t0 = time.perf_counter()
        plan = self._plan(case, self.tables)
        lids, rids = plan.local_ids.astype(np.int32), plan.remote_ids.astype(np.int32)
        return lids, rids, time.perf_counter() - t0, plan

    def cmd_raw_read(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        self._prepare_verify(case, payload["verify"])
        assert self.dlists is not None
        t0 = time.perf_counter()
        lids, rids, ids_s, plan = self._timed_ids(case)
        # The DONE notice rides with the READ, as kvxfer's pull sends it.
        xfer_s, make_s = self.raw.xfer(
            "READ", self.dlists[0], lids, self.dlists[1], rids, DONE_NOTICE, 300
        )
        if case.backend == "host_bounce":
            self._stage(case, out=False)
        s = time.perf_counter() - t0
        bad = self._verify(case) if payload["verify"] else None
        return {
            "s": s,
            "xfer_s": xfer_s,
            "ids_s": ids_s,
            "make_s": make_s,
            "bad": bad,
            **self._counts(plan),
        }

    def cmd_raw_stage_out(self, payload: dict[str, Any]) -> float:
        return self._stage(msgspec.convert(payload["case"], bc.Case), out=True)

    def cmd_raw_expect(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        self._prepare_verify(case, payload["verify"])
        self.conn.send(("ok", "ready"))
        t1 = self.raw.wait_notif(payload["tag"].encode(), 300)
        if case.backend == "host_bounce":
            self._stage(case, out=False)
            t1 = time.perf_counter()
        bad = self._verify(case) if payload["verify"] else None
        return {"t1": t1, "bad": bad}

    def cmd_raw_write(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        assert self.dlists is not None
        tag = payload["tag"].encode()
        t0 = time.perf_counter()
        lids, rids, ids_s, plan = self._timed_ids(case)
        if case.backend == "host_bounce":
            self._stage(case, out=True)
        s, make_s = self.raw.xfer("WRITE", self.dlists[0], lids, self.dlists[1], rids, tag, 300)
        self.engine_busy()
        return {
            "t0": t0,
            "ids_s": ids_s,
            "xfer_s": s,
            "make_s": make_s,
            **self._counts(plan),
        }

    def cmd_memcpy(self, nbytes: int) -> float:
        assert self.memcpy is not None
        return self.memcpy.run(nbytes)

    def cmd_memcpy2(self, nbytes: int) -> float:
        """The same bytes copied by two threads side by side (the bus's share for
        overlapped copies: host bounce's bound)."""
        assert self.memcpy is not None
        return self.memcpy.run(nbytes, threads=2)

    def cmd_plan_cost(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Engine block list → ids → coalesced runs → NIXL request, each timed."""
        from kvxfer.descriptors import build_plan

        case = msgspec.convert(payload["case"], bc.Case)
        assert self.tables is not None and self.dlists is not None
        mine = self._blocks(case, own=True).tolist()  # as an engine hands them over
        theirs = self._blocks(case, own=False).tolist()
        ids_s, runs_s, make_s, n_runs, n = [], [], [], 0, 0
        prepped: list[float] = []
        merged: list[float] = []
        merged_prep: list[float] = []
        for _ in range(payload["reps"]):
            t0 = time.perf_counter()
            plan = build_plan(
                self.tables[0],
                self.tables[1],
                self._groups(np.asarray(mine, dtype=np.int64)),
                self._groups(np.asarray(theirs, dtype=np.int64)),
                case.tokens,
            )
            t1 = time.perf_counter()
            runs = plan.runs(*self.tables)
            t2 = time.perf_counter()
            lids, rids = plan.local_ids.astype(np.int32), plan.remote_ids.astype(np.int32)
            with self.raw._lock:
                t3 = time.perf_counter()
                h = self.raw._nixl.make_prepped_xfer(
                    "READ", self.dlists[0], lids, self.dlists[1], rids, b""
                )
                t4 = time.perf_counter()
                h.release()
            ids_s.append(t1 - t0)
            runs_s.append(t2 - t1)
            make_s.append(t4 - t3)
            n_runs, n = len(runs), plan.num_descriptors
            # The two ways to post: prepared lists + the plan's indices (NIXL merges
            # contiguous pairs itself), or kvxfer's merged runs as per-request lists.
            assert self.raw_peer is not None
            done, _ = self.raw.xfer("READ", self.dlists[0], lids, self.dlists[1], rids, b"", 300)
            prepped.append(done + (t1 - t0))
            done, prep = self.raw.xfer_runs("READ", runs, self.raw_peer, b"", 300)
            merged.append(done + (t2 - t0))
            merged_prep.append(prep + (t2 - t0))
        return {
            "ids_s": bc.median(ids_s),
            "runs_s": bc.median(runs_s),
            "make_s": bc.median(make_s),
            "runs": n_runs,
            "descriptors": n,
            "prepped_total_s": bc.median(prepped),
            "premerged_total_s": bc.median(merged),
            "premerged_prep_s": bc.median(merged_prep),
        }
