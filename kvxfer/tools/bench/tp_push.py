"""The push commands of a ``kvxfer bench --tp`` process (:mod:`.tp_worker`).

A prefill rank plans its writes into the decode rank as its agent does (the decode
rank's :class:`~kvxfer.core.tp_plan.TPPlanner` restricted to this rank) and raw NIXL
posts one WRITE of that plan per rank, with a notification; the decode rank registers
with kvxfer's prefill ranks (``expect_push``) or waits for raw NIXL's notifications.
They act on the process's :class:`~kvxfer.tools.bench.tp_worker.TPRankProc`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from kvxfer.tools.bench.tp_cases import PREFILL_ENGINE
from kvxfer.tools.bench.tp_worker import TPRankProc

__all__ = ["TPPushCommands"]


class TPPushCommands:
    """A TP bench process's commands of a push case."""

    def __init__(self, proc: TPRankProc) -> None:
        self.proc = proc

    def cmd_writer(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Prefill rank of a push: the decode rank's raw peer, the planner of this rank's
        writes into it as the agent builds it (:mod:`kvxfer._agent.tp_push_write`: the
        decode rank's planner restricted to this rank), raw NIXL's prepared lists of
        its tables, and one timed handshake with the decode rank's agent."""
        from kvxfer.core.descriptors import DescriptorTable, PlanOptions
        from kvxfer.core.heads import heads_per_region, pairing_heads, split_heads
        from kvxfer.core.layout import KVLayout
        from kvxfer.core.tp_plan import TPPlanner

        proc = self.proc
        case = proc.case
        assert case is not None and proc.agent is not None and proc.producer
        opts = PlanOptions()
        theirs = msgspec.convert(payload["layout"], KVLayout)
        d, p = case.decode_rank, proc.rank
        per = pairing_heads(
            heads_per_region(theirs, case.decode_heads, d),
            heads_per_region(proc.layout(), case.prefill_heads, p),
        )
        consumer = DescriptorTable.build(split_heads(theirs, case.decode_heads, d, per), opts)
        mine = DescriptorTable.build(split_heads(proc.layout(), case.prefill_heads, p, per), opts)
        proc.planner = TPPlanner.build(
            consumer,
            {p: mine},
            local_heads=case.decode_heads,
            remote_heads=case.prefill_heads,
            local_rank=d,
            only=(p,),
        )
        proc.raw_peers[d] = proc.raw.add_peer(payload["raw"])
        proc.dlists = (proc.raw.prep(None, mine), {d: proc.raw.prep(proc.raw_peers[d], consumer)})
        t0 = time.perf_counter()
        proc.agent.connect(payload["host"], payload["port"], payload["engine_id"])
        return {"handshake_s": time.perf_counter() - t0}

    def cmd_raw_write(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Raw NIXL's push from this rank: the planner's output computed on the clock,
        one WRITE of its ids on the prepared lists (or with ``runs`` its merged address
        runs as per-request lists) carrying ``tag`` as its notification."""
        from kvxfer.core.descriptors import Runs

        proc = self.proc
        assert proc.case is not None and proc.dlists is not None
        (d,) = proc.dlists[1]
        mine, remotes = proc.dlists
        tag = payload["tag"].encode()
        t0 = time.perf_counter()
        plans = proc.planner.plan([proc.blocks_theirs], [proc.blocks_mine], proc.case.tokens)
        # Planned as the decode rank reads from this rank; a WRITE swaps the sides.
        if payload.get("runs"):
            merged = []
            for rp in plans:
                r = rp.runs()
                swapped = Runs(
                    local_addr=r.remote_addr,
                    remote_addr=r.local_addr,
                    length=r.length,
                    local_device=r.remote_device,
                    remote_device=r.local_device,
                )
                merged.append((swapped, proc.raw_peers[d]))
            proc.raw.xfer_runs_many("WRITE", merged, tag, 300)
        else:
            posts = [
                (
                    mine,
                    rp.plan.remote_ids.astype(np.int32),
                    remotes[d],
                    rp.plan.local_ids.astype(np.int32),
                )
                for rp in plans
            ]
            proc.raw.xfer_many("WRITE", posts, tag, 300)
        return {"t0": t0, **proc.counts(plans, pushed=True)}

    def cmd_pushed(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Prefill rank of a push: wait until the request is freed (``release``: other
        decode ranks hold these heads too and the bench runs one of them, so the bench
        releases their share once this decode rank's write is done)."""
        proc = self.proc
        if payload["release"]:
            proc.agent.release(payload["rid"])
        if not proc.cmd_freed({"rid": payload["rid"], "release": False}):
            raise TimeoutError(f"prefill rank {proc.rank} never freed {payload['rid']}")
        after = proc.agent.stats()
        # The writer's count: a decode rank of another TP size counts only bytes.
        posted = after.descriptors_posted - proc.before.descriptors_posted
        return {"handshakes": after.handshakes, "descriptors": posted}

    def cmd_expect_push(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Register for the push (with every prefill rank holding this rank's heads),
        say so, and wait for the bytes; ``t1`` is when the transfer was over."""
        from kvxfer.agent import Ticket

        proc = self.proc
        assert proc.case is not None
        if payload["verify"]:
            proc.zero()
        ticket = Ticket.for_push(
            PREFILL_ENGINE,
            payload["host"],
            payload["port"],
            payload["rid"],
            proc.case.tokens,
            capability=payload["capability"],
            tp_size=proc.case.prefill_tp,
        )
        transfer = proc.agent.expect_push(ticket, proc.blocks_mine)
        proc.conn.send(("ok", "registered"))
        transfer.wait(300)
        t1 = time.perf_counter()
        return {
            "t1": t1,
            "bytes": transfer.stats.bytes,
            "descriptors": transfer.stats.descriptors,
            "bad": proc.mismatches() if payload["verify"] else None,
            "handshakes": proc.agent.stats().handshakes,
        }

    def cmd_raw_expect(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Wait for raw NIXL's WRITE notification from each prefill rank (``tags``);
        ``t1`` is when the last was seen."""
        proc = self.proc
        if payload["verify"]:
            proc.zero()
        proc.conn.send(("ok", "polling"))
        t1 = max(proc.raw.wait_notif(tag.encode(), 300) for tag in payload["tags"])
        return {"t1": t1, "bad": proc.mismatches() if payload["verify"] else None}
