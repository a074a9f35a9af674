"""The parent side of ``kvxfer bench --tp``: the processes of one TP case and its reps.

Per case: one process per prefill rank the decode rank reads (rank *p* serving at
base port + *p*) and one for the decode rank. Per rep, as :mod:`.runner` does for the
plain matrix and interleaved the same way (alternating which goes first): kvxfer
(every prefill rank's ``hold()`` under one capability and guard word, as vLLM's
scheduler mints them, then the decode rank's ``pull()`` + ``wait()`` of rank 0's
ticket), raw NIXL posting the same planner's ids on the same memory (one READ per
producer rank, posted together), and a memcpy of the same bytes. The first of each is
verified per (layer, K/V, head, block, token) and kept out of the medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

import kvxfer.tools.bench.cases as bc
import kvxfer.tools.bench.tp_cases as tc
from kvxfer.tools.bench.procs import BenchError, Children
from kvxfer.tools.bench.tp_worker import tp_worker_main

__all__ = ["TPRunner", "main_tp", "plan_tp_cases"]


class TPRunner:
    """Runs TP cases, each with its own set of processes."""

    def __init__(self, *, reps: int, timeout_s: float) -> None:
        self.reps, self.timeout_s = reps, timeout_s
        self._children = Children(timeout_s)
        self._rid = itertools.count()

    # -- processes ----------------------------------------------------------------------
    def _start(self, names: Sequence[str]) -> None:
        for name in names:
            self._children.start(name, tp_worker_main)
        for name in names:
            self._children.recv(name, 120)

    def _close(self) -> None:
        self._children.close()

    def _recv(self, name: str, timeout: float | None = None) -> Any:
        return self._children.recv(name, timeout)

    def call(self, name: str, cmd: str, payload: Any = None) -> Any:
        return self._children.call(name, cmd, payload)

    # -- one case -----------------------------------------------------------------------
    def run(self, case: tc.TPCase) -> dict[str, Any]:
        """Measure one case; a result object either way."""
        ranks = case.producer_ranks
        names = [f"prefill{p}" for p in ranks]
        try:
            self._start([*names, "decode"])
            return self._run(case, ranks)
        except BenchError as exc:
            return tc.tp_failed(case, str(exc))
        finally:
            self._close()

    def _serve_producers(self, ranks: Sequence[int]) -> tuple[int, dict[int, dict[str, Any]]]:
        """Prefill rank p's agent at base + p (another base when a port is taken)."""
        for _ in range(10):
            base = random.randrange(20000, 60000)
            try:
                return base, {p: self.call(f"prefill{p}", "agent", base + p) for p in ranks}
            except BenchError as exc:
                if exc.dead or "ddress" not in str(exc):
                    raise
        raise BenchError("no free consecutive side-channel ports")

    def _run(self, case: tc.TPCase, ranks: Sequence[int]) -> dict[str, Any]:
        cb = msgspec.to_builtins(case)
        nbytes = tc.expected_bytes(case)
        made = {
            p: self.call(f"prefill{p}", "cache", {"case": cb, "role": "producer", "rank": p})
            for p in ranks
        }
        self.call(
            "decode",
            "cache",
            {"case": cb, "role": "consumer", "rank": case.decode_rank, "nbytes": nbytes},
        )
        base, served = self._serve_producers(ranks)
        self.call("decode", "agent", 0)
        producers = {str(p): {**made[p], **served[p]} for p in ranks}
        peers = self.call("decode", "peers", {"producers": producers})
        incarnations = [
            served[p]["incarnation"] if p in served else 0 for p in range(max(ranks) + 1)
        ]
        # Prefill ranks some other decode rank reads too: the bench releases that share.
        from kvxfer.core.heads import reader_ranks

        release = {
            p: len(reader_ranks(case.prefill_heads, p, case.decode_heads)) > 1 for p in ranks
        }
        slots = bc.num_blocks_for(case.base) + 64  # GuardBook.slots_for

        def kvxfer(verify: bool) -> dict[str, Any]:
            i = next(self._rid)
            rid, cap = f"tp-{i}", secrets.token_hex(16)
            guard = [i % slots, secrets.randbits(56) or 1]
            hold = {"rid": rid, "capability": cap, "guard": guard}
            held = {p: self.call(f"prefill{p}", "hold", hold) for p in ranks}
            ticket = dict(held[ranks[0]]["ticket"], port=base, incarnations=incarnations)
            got = self.call("decode", "pull", {"ticket": ticket, "verify": verify})
            for p in ranks:
                if not self.call(f"prefill{p}", "freed", {"rid": rid, "release": release[p]}):
                    raise BenchError(f"prefill rank {p} never freed {rid}")
            return {**got, "hold_s": max(h["hold_s"] for h in held.values())}

        def raw(verify: bool) -> dict[str, Any]:
            out: dict[str, Any] = self.call("decode", "raw_read", {"verify": verify})
            return out

        def raw_runs(verify: bool) -> dict[str, Any]:
            out: dict[str, Any] = self.call("decode", "raw_read", {"verify": verify, "runs": True})
            return out

        first, raw_first, runs_first = kvxfer(True), raw(True), raw_runs(True)
        times: dict[str, list[float]] = {"kvxfer": [], "nixl": [], "nixl_runs": [], "memcpy": []}
        holds: list[float] = []
        hs: list[int] = []
        steps: list[tuple[str, Callable[[bool], dict[str, Any]]]] = [
            ("kvxfer", kvxfer),
            ("nixl", raw),
            ("nixl_runs", raw_runs),
        ]
        for i in range(self.reps):
            for name, fn in steps if i % 2 == 0 else steps[::-1]:
                got = fn(False)
                times[name].append(got["s"])
                if name == "kvxfer":
                    holds.append(got["hold_s"])
                    hs.append(got["handshakes"])
            times["memcpy"].append(self.call("decode", "memcpy", first["bytes"]))
        extra = {
            "runs": raw_first["runs"],
            "units_posted": raw_first["units_posted"],
            "nixl_units": raw_first["nixl_units"],
            "descriptors_per_rank": raw_first["descriptors_per_rank"],
            "handshake_s": peers["handshake_s"],
            "handshakes_in_timed_reps": (max(hs) - first["handshakes"]) if hs else None,
            "hold_s": bc.median(holds),
        }
        return tc.assemble(case, first, raw_first, runs_first, times, extra)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _strs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def plan_tp_cases(args: argparse.Namespace) -> tuple[list[tc.TPCase], list[dict[str, Any]]]:
    """The TP cases ``--tp`` selects (with ``--models`` ``--block-sizes`` ``--tokens``
    ``--patterns``; defaults Qwen3-0.6B, 16, 4000 (quick: 1000), contiguous) and those
    skipped for memory."""
    cases = tc.build_tp_cases(
        pairs=tc.parse_pairs(args.tp),
        models=_strs(args.models or bc.QWEN),
        block_sizes=_ints(args.block_sizes or "16"),
        tokens=_ints(args.tokens or ("1000" if args.quick else "4000")),
        patterns=_strs(args.patterns or "contiguous"),
    )
    budget = int((args.mem_budget * 2**30) if args.mem_budget else 0.75 * bc.mem_available())
    keep, skipped = [], []
    for case in cases:
        need = tc.tp_memory(case)
        if need > budget:
            why = f"needs {need / 2**30:.1f} GiB > memory budget {budget / 2**30:.1f} GiB"
            skipped.append(tc.tp_failed(case, why, "skipped"))
        else:
            keep.append(case)
    return keep, skipped


def main_tp(args: argparse.Namespace, header: dict[str, Any]) -> int:
    """``kvxfer bench --tp``: run the TP cases and print their table (or JSON lines)."""
    other = [
        f"--{k.replace('_', '-')}"
        for k in ("directions", "backends", "modes", "netns", "from_json", "plot", "check")
        if getattr(args, k)
    ]
    if other:
        print(
            f"kvxfer bench: --tp runs pulls on ucx over loopback, not with {other[0]}",
            file=sys.stderr,
        )
        return 2
    try:
        cases, results = plan_tp_cases(args)
    except ValueError as exc:
        print(f"kvxfer bench: {exc}", file=sys.stderr)
        return 2
    header = {**header, "tp": args.tp}
    runner = TPRunner(reps=header["reps"], timeout_s=args.timeout)
    measured: list[dict[str, Any]] = []
    try:
        for case in cases:
            print(f"kvxfer bench --tp: {case.label} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            measured.append(runner.run(case))
            print(f"  {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("kvxfer bench: interrupted; reporting the cases measured", file=sys.stderr)
    results = measured + results
    if args.json:
        for r in [header, *results]:
            print(json.dumps(r, sort_keys=True))
    else:
        load = header.get("load") or ()
        print(
            f"kvxfer bench --tp {args.tp} — {header.get('date', '?')}, {header.get('cpus', '?')} "
            f"CPUs (load {' '.join(f'{x:.2f}' for x in load) or '?'}), loopback, "
            f"{header['reps']} timed reps per case"
        )
        print(tc.format_tp_table(results))
    return 1 if any(r.get("status") == "failed" for r in results) else 0
