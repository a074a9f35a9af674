"""The parent side of ``kvxfer bench --tp``: the processes of one TP case and its reps.

Per case: one process per prefill rank holding the decode rank's heads (rank *p*
serving at base port + *p*) and one for the decode rank. Per rep, as :mod:`.runner`
does for the plain matrix and interleaved the same way (alternating which goes
first): kvxfer, raw NIXL posting the same planner's ids on the same memory, raw NIXL
posting its merged runs, and a memcpy of the same bytes. A pull case is the decode
rank's ``pull()`` of every prefill rank's ``hold()`` (under one capability and guard
word, as vLLM's scheduler mints them) against one READ per prefill rank, posted
together; a push case is the decode rank's ``expect_push()`` and every prefill rank's
``hold()`` against one WRITE per prefill rank, posted at once from each. The first of
each is verified per (layer, K/V, head, block, token) and kept out of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

import kvxfer.tools.bench.cases as bc
import kvxfer.tools.bench.device as device
import kvxfer.tools.bench.tp_cases as tc
from kvxfer.tools import cma
from kvxfer.tools.bench.procs import BenchError, Children
from kvxfer.tools.bench.tp_bars import format_tp_bars, tp_bars
from kvxfer.tools.bench.tp_main import tp_worker_main

__all__ = ["TPRunner", "main_tp", "plan_tp_cases"]


class TPRunner:
    """Runs TP cases, each with its own set of processes.

    Args:
        reps: Timed reps per case.
        timeout_s: How long one step may take before it counts as hung.
        max_reps: Reps a case may take while kvxfer over raw NIXL's merged runs (the
            issue-27 target's ratio) is not yet known to within ±0.04 (95%): three
            processes share two cores here, and five reps left it 0.78-0.99 between
            runs of one case.
    """

    def __init__(
        self,
        *,
        reps: int,
        timeout_s: float,
        max_reps: int | None = None,
        firsts: int = 1,
        device: str | None = None,
    ) -> None:
        self.reps, self.timeout_s = reps, timeout_s
        self.device = device  # --device: every rank's cache copied there
        self.max_reps = max(reps, max_reps if max_reps is not None else reps)
        if firsts < 1:
            raise ValueError(f"firsts={firsts}: must be 1 or more")
        self.firsts = firsts
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

    def send(self, name: str, cmd: str, payload: Any = None) -> None:
        """Send process ``name`` a command without waiting for its answer."""
        self._children.send(name, cmd, payload)

    def recv(self, name: str) -> Any:
        """The answer to process ``name``'s last command."""
        return self._children.recv(name)

    def call(self, name: str, cmd: str, payload: Any = None) -> Any:
        """Send process ``name`` a command and return its answer."""
        return self._children.call(name, cmd, payload)

    def request_id(self) -> int:
        """A number no earlier rep of this run used."""
        return next(self._rid)

    # -- one case -----------------------------------------------------------------------
    def run(self, case: tc.TPCase) -> dict[str, Any]:
        """Measure one case; a result object either way. With ``firsts`` above 1, the
        case's processes are started again that many times less one, each time for
        one verified first request of kvxfer and of raw NIXL and a few steady reps of
        each to hold it against: a first request is one sample (on two shared cores
        one sample of the steady ones ranged 0.9-1.4x their median), and each start
        has its own steady level (how the kernel backed its caches, where its threads
        run). Starts alternate whose first runs first, kvxfer's in the first start."""
        ranks = case.producer_ranks
        try:
            with self._processes(ranks):
                result = self._run(case, ranks)
            for start in range(1, self.firsts):
                if result["status"] != "ok":
                    break
                # Whichever moves bytes first after the set-up pays for the quiet
                # before it (tc._first_fields): odd starts let raw NIXL's first lead.
                led = start % 2 == 0
                with self._processes(ranks):
                    reps, _ = self._set_up(case, ranks)
                    if led:
                        kv, raw = reps.kvxfer(True), reps.raw(True)
                    else:
                        raw, kv = reps.raw(True), reps.kvxfer(True)
                    steady = self._steady(reps)
                result = tc.add_first(result, kv, raw, *steady, kvxfer_led=led)
            return result
        except BenchError as exc:
            return tc.tp_failed(case, str(exc))

    @contextlib.contextmanager
    def _processes(self, ranks: Sequence[int]) -> Iterator[None]:
        """One process per prefill rank and the decode rank's, closed on the way out."""
        try:
            self._start([*(f"prefill{p}" for p in ranks), "decode"])
            yield
        finally:
            self._close()

    def _serve_producers(
        self, ranks: Sequence[int], direction: str
    ) -> tuple[int, dict[int, dict[str, Any]]]:
        """Prefill rank p's agent at base + p (another base when a port is taken)."""
        for _ in range(10):
            base = random.randrange(20000, 60000)
            try:
                return base, {
                    p: self.call(f"prefill{p}", "agent", {"port": base + p, "direction": direction})
                    for p in ranks
                }
            except BenchError as exc:
                if exc.dead or "ddress" not in str(exc):
                    raise
        raise BenchError("no free consecutive side-channel ports")

    def _set_up(
        self, case: tc.TPCase, ranks: Sequence[int]
    ) -> tuple[_PullReps | _PushReps, dict[str, float]]:
        """Caches, agents and handshakes of one case's processes: its reps, and the
        seconds of each handshake."""
        cb = msgspec.to_builtins(case)
        nbytes = tc.expected_bytes(case)
        made = {
            p: self.call(
                f"prefill{p}",
                "cache",
                {"case": cb, "role": "producer", "rank": p, "device": self.device},
            )
            for p in ranks
        }
        decode = self.call(
            "decode",
            "cache",
            {
                "case": cb,
                "role": "consumer",
                "rank": case.decode_rank,
                "nbytes": nbytes,
                "device": self.device,
            },
        )
        base, served = self._serve_producers(ranks, case.direction)
        own = self.call("decode", "agent", {"port": 0, "direction": case.direction})
        producers = {str(p): {**made[p], **served[p]} for p in ranks}
        peers = self.call("decode", "peers", {"producers": producers})
        handshake_s = dict(peers["handshake_s"])
        if case.direction == "push":
            # The prefill ranks post: each connects to the decode rank ahead, as an
            # embedder's writer would (Agent.connect), and plans as its agent does.
            for p in ranks:
                wrote = self.call(f"prefill{p}", "writer", {**decode, **own})
                handshake_s[f"{p}->decode"] = wrote["handshake_s"]
        # Prefill ranks another decode rank reads too: the bench releases that share.
        from kvxfer.core.heads import reader_ranks

        release = {
            p: len(reader_ranks(case.prefill_heads, p, case.decode_heads)) > 1 for p in ranks
        }
        reps: _PullReps | _PushReps
        if case.direction == "pull":
            incarnations = [
                served[p]["incarnation"] if p in served else 0 for p in range(max(ranks) + 1)
            ]
            reps = _PullReps(self, case, base, incarnations, release)
        else:
            reps = _PushReps(self, case, (served[ranks[0]]["host"], base), release)
        return reps, handshake_s

    def _steady(self, reps: _PullReps | _PushReps) -> tuple[float | None, float | None]:
        """The steady medians of kvxfer and raw NIXL (the planner's ids) over
        ``min(reps, 5)`` back-to-back unverified reps of each, alternating which goes
        first: a later start's level for its first request."""
        kv: list[float] = []
        raw: list[float] = []
        for i in range(min(self.reps, 5)):
            steps = [(kv, reps.kvxfer), (raw, reps.raw)]
            for into, fn in steps if i % 2 == 0 else steps[::-1]:
                into.append(fn(False)["s"])
        return bc.median(kv), bc.median(raw)

    def _run(self, case: tc.TPCase, ranks: Sequence[int]) -> dict[str, Any]:
        reps, handshake_s = self._set_up(case, ranks)
        first, raw_first, runs_first = reps.kvxfer(True), reps.raw(True), reps.raw(True, True)
        times: dict[str, list[float]] = {"kvxfer": [], "nixl": [], "nixl_runs": [], "memcpy": []}
        holds: list[float] = []
        hs: list[int] = []
        steps: list[tuple[str, Callable[[bool], dict[str, Any]]]] = [
            ("kvxfer", reps.kvxfer),
            ("nixl", reps.raw),
            ("nixl_runs", lambda verify: reps.raw(verify, True)),
        ]
        i = 0
        while i < self.reps or (
            i < self.max_reps and not bc.settled(times["kvxfer"], times["nixl_runs"])
        ):
            for name, fn in steps if i % 2 == 0 else steps[::-1]:
                got = fn(False)
                times[name].append(got["s"])
                if name == "kvxfer":
                    holds.append(got["hold_s"])
                    hs.append(got["handshakes"])
            times["memcpy"].append(self.call("decode", "memcpy", first["bytes"]))
            i += 1
        extra = {
            "runs": raw_first["runs"],
            "units_posted": raw_first["units_posted"],
            "nixl_units": raw_first["nixl_units"],
            "descriptors_per_rank": raw_first["descriptors_per_rank"],
            "handshake_s": handshake_s,
            "handshakes_in_timed_reps": (max(hs) - first["handshakes"]) if hs else None,
            "hold_s": bc.median(holds),
        }
        return tc.assemble(case, first, raw_first, runs_first, times, extra)


class _PullReps:
    """One transfer of each kind of a pull case: the decode rank reads."""

    def __init__(
        self,
        runner: TPRunner,
        case: tc.TPCase,
        base: int,
        incarnations: list[int],
        release: dict[int, bool],
    ) -> None:
        self.runner, self.case, self.base = runner, case, base
        self.incarnations, self.release = incarnations, release
        self.ranks = case.producer_ranks
        self.slots = bc.num_blocks_for(case.base) + 64  # GuardBook.slots_for

    def kvxfer(self, verify: bool) -> dict[str, Any]:
        """Every prefill rank's ``hold()`` under one capability and guard word, as
        vLLM's scheduler mints them, then the decode rank's ``pull()`` + ``wait()``."""
        call, i = self.runner.call, self.runner.request_id()
        rid, cap = f"tp-{i}", secrets.token_hex(16)
        guard = [i % self.slots, secrets.randbits(56) or 1]
        hold = {"rid": rid, "capability": cap, "guard": guard}
        held = {p: call(f"prefill{p}", "hold", hold) for p in self.ranks}
        ticket = dict(held[self.ranks[0]]["ticket"], port=self.base, incarnations=self.incarnations)
        got = call("decode", "pull", {"ticket": ticket, "verify": verify})
        for p in self.ranks:
            if not call(f"prefill{p}", "freed", {"rid": rid, "release": self.release[p]}):
                raise BenchError(f"prefill rank {p} never freed {rid}")
        return {**got, "hold_s": max(h["hold_s"] for h in held.values())}

    def raw(self, verify: bool, runs: bool = False) -> dict[str, Any]:
        """Raw NIXL's READs of the same request (``runs``: its merged runs)."""
        out: dict[str, Any] = self.runner.call(
            "decode", "raw_read", {"verify": verify, "runs": runs}
        )
        return out


class _PushReps:
    """One transfer of each kind of a push case: the prefill ranks write.

    Each is timed from the first prefill rank's post (kvxfer: its ``hold()``; raw NIXL:
    its planning) to the decode rank seeing the last byte (its transfer over; raw:
    every rank's notification), on the host's one monotonic clock. The parent sends
    every rank its command before reading any reply, so the ranks write together.
    """

    def __init__(
        self,
        runner: TPRunner,
        case: tc.TPCase,
        address: tuple[str, int],
        release: dict[int, bool],
    ) -> None:
        self.runner, self.case, self.address, self.release = runner, case, address, release
        self.ranks = case.producer_ranks

    def kvxfer(self, verify: bool) -> dict[str, Any]:
        """The decode rank's ``expect_push()`` (it registers with each prefill rank),
        then, once every prefill rank has its registration, every prefill rank's
        ``hold()`` under the router's shared capability."""
        rid, cap = f"tp-{self.runner.request_id()}", secrets.token_hex(16)
        self.runner.send(
            "decode",
            "expect_push",
            {
                "host": self.address[0],
                "port": self.address[1],
                "rid": rid,
                "capability": cap,
                "verify": verify,
            },
        )
        self.runner.recv("decode")  # registered
        # Every prefill rank has the registration before any holds, as in a deployment,
        # where the decode registers while the prompt is computed: a rank whose copy
        # came a little later would otherwise start its write later, on the clock.
        for p in self.ranks:
            self.runner.send(f"prefill{p}", "registered", {"rid": rid})
        for p in self.ranks:
            self.runner.recv(f"prefill{p}")
        for p in self.ranks:
            self.runner.send(f"prefill{p}", "hold", {"rid": rid, "capability": cap})
        # Read the decode rank's result first, so this process sleeps through the write.
        try:
            got = self.runner.recv("decode")
        finally:
            held = {p: self.runner.recv(f"prefill{p}") for p in self.ranks}
        pushed = [
            self.runner.call(f"prefill{p}", "pushed", {"rid": rid, "release": self.release[p]})
            for p in self.ranks
        ]
        t0 = min(h["t0"] for h in held.values())
        return {
            **got,
            "s": got["t1"] - t0,
            "descriptors": sum(x["descriptors"] for x in pushed),
            "hold_s": max(h["hold_s"] for h in held.values()),
            "handshakes": got["handshakes"] + sum(x["handshakes"] for x in pushed),
        }

    def raw(self, verify: bool, runs: bool = False) -> dict[str, Any]:
        """Raw NIXL's WRITEs of the same request, one per prefill rank (``runs``: its
        merged runs), each with its own notification."""
        tag = f"raw-{self.runner.request_id()}"
        tags = {p: f"{tag}-{p}" for p in self.ranks}
        self.runner.send("decode", "raw_expect", {"tags": list(tags.values()), "verify": verify})
        self.runner.recv("decode")  # polling
        for p in self.ranks:
            self.runner.send(f"prefill{p}", "raw_write", {"tag": tags[p], "runs": runs})
        try:
            wrote = {p: self.runner.recv(f"prefill{p}") for p in self.ranks}
        finally:
            got = self.runner.recv("decode")
        out = {k: sum(w[k] for w in wrote.values()) for k in _SUMMED}
        out["descriptors_per_rank"] = {
            k: v for w in wrote.values() for k, v in w["descriptors_per_rank"].items()
        }
        return {**out, **got, "s": got["t1"] - min(w["t0"] for w in wrote.values())}


#: Counts of a raw push that add up over its prefill ranks.
_SUMMED = ("bytes", "descriptors", "units_posted", "nixl_units", "runs")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _strs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def plan_tp_cases(args: argparse.Namespace) -> tuple[list[tc.TPCase], list[dict[str, Any]]]:
    """The TP cases ``--tp`` selects (with ``--models`` ``--block-sizes`` ``--tokens``
    ``--patterns`` ``--directions``; defaults Qwen3-0.6B, 16, 4000 (quick: 1000),
    contiguous, pull and push) and those skipped for memory."""
    cases = tc.build_tp_cases(
        pairs=tc.parse_pairs(args.tp),
        models=_strs(args.models or bc.QWEN),
        block_sizes=_ints(args.block_sizes or "16"),
        tokens=_ints(args.tokens or ("1000" if args.quick else "4000")),
        patterns=_strs(args.patterns or "contiguous"),
        directions=_strs(args.directions or ",".join(bc.DIRECTIONS)),
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
        for k in ("backends", "modes", "netns", "plot")
        if getattr(args, k)
    ]
    if other:
        print(
            f"kvxfer bench: --tp runs on ucx over loopback, not with {other[0]}",
            file=sys.stderr,
        )
        return 2
    try:
        cases, results = plan_tp_cases(args)
    except ValueError as exc:
        print(f"kvxfer bench: {exc}", file=sys.stderr)
        return 2
    header = {**header, "tp": args.tp}
    reps = header["reps"]
    max_reps = args.max_reps if args.max_reps is not None else 3 * reps
    firsts = args.firsts or (1 if args.quick else 3)
    header = {**header, "firsts": firsts}
    runner = TPRunner(
        reps=reps, timeout_s=args.timeout, max_reps=max_reps, firsts=firsts, device=args.device
    )
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
    return report_tp(
        {**header, "max_reps": runner.max_reps}, results, as_json=args.json, check=args.check
    )


def report_tp(
    header: dict[str, Any], results: list[dict[str, Any]], *, as_json: bool, check: bool
) -> int:
    """Print a TP run's table and bars (or its JSON lines), measured now or saved with
    ``--json`` (``kvxfer bench --from-json``); the bars are computed from ``results``."""
    bars = tp_bars(results)
    if as_json:
        for r in [header, *results, *bars]:
            print(json.dumps(r, sort_keys=True))
    else:
        load = header.get("load") or ()
        reps = header.get("reps", "?")
        max_reps = header.get("max_reps", "?")
        print(
            f"kvxfer bench --tp {header.get('tp', '?')} — {header.get('date', '?')}, "
            f"{header.get('cpus', '?')} CPUs (load {' '.join(f'{x:.2f}' for x in load) or '?'}), "
            f"loopback{cma.tls_note(header.get('ucx_tls'))}"
            f"{device.report_note(header.get('device'))}"
            f"{device.list_writes_note(header.get('nixl_ucx_sgl'))}, "
            f"{reps} timed reps per case (up to {max_reps} until x runs is known "
            f"to ±0.04), {header.get('firsts', '?')} first request(s) per case"
        )
        print(tc.format_tp_table(results))
        print()
        print(format_tp_bars(bars))
    if any(r.get("status") == "failed" for r in results):
        return 1
    return 3 if check and any(b["holds"] is False for b in bars) else 0
