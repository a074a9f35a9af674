"""What a bench process measures beside kvxfer: raw NIXL on the same descriptors, the
host-bounce copies done directly, memcpy of the same bytes, and the planning cost.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

import kvxfer.tools.bench.cases as bc
from kvxfer.core.descriptors import Runs
from kvxfer.core.gather_cost import GatherConfig, choose_path
from kvxfer.tools.bench.gather import STAGING_BYTES
from kvxfer.tools.bench.side import BenchSide

__all__ = ["BENCH_GATHER", "DONE_NOTICE", "Measure", "gather_choice"]

DONE_NOTICE = b"raw-done" * 16  # about the size of kvxfer's signed DONE notice

#: The gather path's model as the bench reports it: the staging of ``--gather``'s
#: agents, this host's CPU cost defaults (docs/DESIGN.md, "Gather path").
BENCH_GATHER = GatherConfig(staging_bytes=STAGING_BYTES)


def gather_choice(runs: Runs, config: GatherConfig = BENCH_GATHER) -> str:
    """The path the gather model would choose for ``runs`` ("direct" or "gather").

    A model's choice, not the path taken: a matrix case's agents have no staging and
    go direct whatever this says; ``--gather`` measures the path taken (``paths``).
    """
    return choose_path(runs, config).path.value


class Measure:
    """The ``raw_*``, ``memcpy*`` and ``plan_cost`` commands of one bench process."""

    def __init__(self, side: BenchSide) -> None:
        self.state = side

    def _counts(self, plan: Any) -> dict[str, int | str]:
        """What a raw request moved, worked out after its timed region."""
        assert self.state.tables is not None
        runs = plan.runs(*self.state.tables)
        return {
            "descriptors": plan.num_descriptors,
            "bytes": plan.nbytes,
            "runs": len(runs),
            "gather_model": gather_choice(runs),
        }

    def _timed_ids(self, case: bc.Case) -> tuple[Any, Any, float, Any]:
        """The request's descriptor ids from the engine's block lists, as a raw NIXL
        user computes them per request (here with kvxfer's own algebra, so that they
        are the identical descriptors): inside the timed region, and computed only
        there. An untimed plan just before would run the timed one on warm caches,
        which kvxfer's own per-request planning never gets."""
        assert self.state.tables is not None
        t0 = time.perf_counter()
        plan = self.state.plan(case, self.state.tables)
        lids, rids = plan.local_ids.astype(np.int32), plan.remote_ids.astype(np.int32)
        return lids, rids, time.perf_counter() - t0, plan

    def cmd_raw_read(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        self.state.prepare_verify(case, payload["verify"])
        if case.is_ratio:
            return self._raw_ratio_read(case, payload["verify"])
        assert self.state.dlists is not None
        t0 = time.perf_counter()
        lids, rids, ids_s, plan = self._timed_ids(case)
        # The DONE notice rides with the READ, as kvxfer's pull sends it.
        xfer_s, make_s = self.state.raw.xfer(
            "READ", self.state.dlists[0], lids, self.state.dlists[1], rids, DONE_NOTICE, 300
        )
        if case.backend == "host_bounce":
            self.state.stage(case, out=False)
        s = time.perf_counter() - t0
        bad = self.state.verify(case) if payload["verify"] else None
        return {
            "s": s,
            "xfer_s": xfer_s,
            "ids_s": ids_s,
            "make_s": make_s,
            "bad": bad,
            **self._counts(plan),
        }

    def _raw_ratio_read(self, case: bc.Case, verify: bool) -> dict[str, Any]:
        """Raw NIXL's pull between block sizes: kvxfer's address runs, planned inside
        the timed region as kvxfer's consumer plans them per request, posted as
        per-request lists (what kvxfer's ``post_runs`` does) with the DONE notice."""
        assert self.state.raw_peer is not None
        t0 = time.perf_counter()
        runs = self.state.ratio_runs(case, self.state.exposed, self.state.peer_layout)
        ids_s = time.perf_counter() - t0
        xfer_s, make_s = self.state.raw.xfer_runs(
            "READ", runs, self.state.raw_peer, DONE_NOTICE, 300
        )
        s = time.perf_counter() - t0
        bad = self.state.verify(case) if verify else None
        n = len(runs)
        return {
            "s": s,
            "xfer_s": xfer_s,
            "ids_s": ids_s,
            "make_s": make_s,
            "bad": bad,
            "descriptors": n,
            "bytes": runs.nbytes,
            "runs": n,
        }

    def cmd_raw_stage_out(self, payload: dict[str, Any]) -> float:
        return self.state.stage(msgspec.convert(payload["case"], bc.Case), out=True)

    def cmd_raw_expect(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        self.state.prepare_verify(case, payload["verify"])
        self.state.conn.send(("ok", "ready"))
        t1 = self.state.raw.wait_notif(payload["tag"].encode(), 300)
        if case.backend == "host_bounce":
            self.state.stage(case, out=False)
            t1 = time.perf_counter()
        bad = self.state.verify(case) if payload["verify"] else None
        return {"t1": t1, "bad": bad}

    def cmd_raw_write(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        assert self.state.dlists is not None
        tag = payload["tag"].encode()
        t0 = time.perf_counter()
        lids, rids, ids_s, plan = self._timed_ids(case)
        if case.backend == "host_bounce":
            self.state.stage(case, out=True)
        s, make_s = self.state.raw.xfer(
            "WRITE", self.state.dlists[0], lids, self.state.dlists[1], rids, tag, 300
        )
        self.state.engine_busy()
        return {
            "t0": t0,
            "ids_s": ids_s,
            "xfer_s": s,
            "make_s": make_s,
            **self._counts(plan),
        }

    def cmd_memcpy(self, nbytes: int) -> float:
        assert self.state.memcpy is not None
        return self.state.memcpy.run(nbytes)

    def cmd_memcpy2(self, nbytes: int) -> float:
        """The same bytes copied by two threads side by side (the bus's share for
        overlapped copies: host bounce's bound)."""
        assert self.state.memcpy is not None
        return self.state.memcpy.run(nbytes, threads=2)

    def cmd_plan_cost(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Engine block list → ids → coalesced runs → NIXL request, each timed."""
        from kvxfer.core.descriptors import build_plan

        case = msgspec.convert(payload["case"], bc.Case)
        assert self.state.tables is not None and self.state.dlists is not None
        mine = self.state.blocks(case, own=True).tolist()  # as an engine hands them over
        theirs = self.state.blocks(case, own=False).tolist()
        ids_s, runs_s, make_s, n_runs, n = [], [], [], 0, 0
        prepped: list[float] = []
        merged: list[float] = []
        merged_prep: list[float] = []
        for _ in range(payload["reps"]):
            t0 = time.perf_counter()
            plan = build_plan(
                self.state.tables[0],
                self.state.tables[1],
                self.state.groups(np.asarray(mine, dtype=np.int64)),
                self.state.groups(np.asarray(theirs, dtype=np.int64)),
                case.tokens,
            )
            t1 = time.perf_counter()
            runs = plan.runs(*self.state.tables)
            t2 = time.perf_counter()
            lids, rids = plan.local_ids.astype(np.int32), plan.remote_ids.astype(np.int32)
            make_s.append(
                self.state.raw.time_request(
                    "READ", self.state.dlists[0], lids, self.state.dlists[1], rids
                )
            )
            ids_s.append(t1 - t0)
            runs_s.append(t2 - t1)
            n_runs, n = len(runs), plan.num_descriptors
            # The two ways to post: prepared lists + the plan's indices (NIXL merges
            # contiguous pairs itself), or kvxfer's merged runs as per-request lists.
            assert self.state.raw_peer is not None
            done, _ = self.state.raw.xfer(
                "READ", self.state.dlists[0], lids, self.state.dlists[1], rids, b"", 300
            )
            prepped.append(done + (t1 - t0))
            done, prep = self.state.raw.xfer_runs("READ", runs, self.state.raw_peer, b"", 300)
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
