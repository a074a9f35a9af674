"""The parent side of ``kvxfer bench``: two bench processes and the script of each case.

Cases arrive ordered by cache (model, block size, tokens) and then by agent pair
(backend, mode); each cache and each agent pair is set up once for all the cases that
share it. Per case, the same run measures, interleaved rep by rep (alternating which
goes first): kvxfer (``hold`` + ``pull``, or ``expect_push`` + ``hold``), raw NIXL on
the same descriptors, and a memcpy of the same bytes. The first kvxfer and the first
raw transfer are verified byte for byte and kept out of the medians. A case whose
kvxfer/raw ratio is still uncertain after ``reps`` gets more reps, up to ``max_reps``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

import kvxfer.tools.bench.cases as bc
from kvxfer.tools.bench.block_ratio import KIND as RATIO_KIND
from kvxfer.tools.bench.gather import KIND as GATHER_KIND
from kvxfer.tools.bench.netns import NetnsPair
from kvxfer.tools.bench.procs import BenchError, Children
from kvxfer.tools.bench.worker import worker_main

__all__ = ["RESULT_FIELDS", "BenchError", "Runner", "assemble", "failed"]

#: Fields every measured case's JSON object carries (besides the case's identity).
RESULT_FIELDS = (
    "kind",
    "status",
    "reason",
    "reps",
    "bytes_moved",
    "bytes_expected",
    "whole_block_bytes",
    "bytes_saved",
    "descriptors_posted",
    "nixl_descriptors",
    "runs",
    "gather_model",
    "paths",
    "verified",
    "mismatched_words",
    "kvxfer_s",
    "nixl_s",
    "memcpy_s",
    "kvxfer_gbps",
    "nixl_gbps",
    "memcpy_gbps",
    "memcpy_2t_s",
    "memcpy_2t_gbps",
    "kvxfer_vs_nixl",
    "kvxfer_vs_memcpy",
    "kvxfer_vs_nixl_of_medians",
    "kvxfer_vs_memcpy_of_medians",
    "kvxfer_vs_nixl_strict",
    "nixl_vs_memcpy",
    "nixl_ids_s",
    "plan_s",
    "post_s",
    "nixl_post_s",
    "hold_s",
    "handshake_s",
    "first_transfer_s",
    "nixl_first_transfer_s",
    "handshakes_in_timed_reps",
    "failures",
    "samples",
)


class Runner:
    """Two bench processes (optionally each in its own network namespace)."""

    def __init__(
        self,
        *,
        reps: int,
        timeout_s: float,
        netns: NetnsPair | None = None,
        planning: bool = False,
        max_reps: int | None = None,
        push_post: str = "auto",
        engine_busy_s: float = 0.0,
        device: str | None = None,
        progress_interval_s: float | None = None,
    ) -> None:
        self.reps = reps
        self.options = {
            "push_post": push_post,
            "engine_busy_s": engine_busy_s,
            "device": device,  # --device: each process's cache in torch memory there
            "progress_interval_s": progress_interval_s,  # None: AgentConfig's default
        }
        # A noisy case (the paired ratio's confidence interval still wide) gets more
        # reps, up to this many.
        self.max_reps = max(reps, max_reps if max_reps is not None else reps)
        self.planning = planning
        self.timeout_s = timeout_s
        self.netns = netns
        self._children = Children(timeout_s)
        self._rid = itertools.count()
        self._done: set[bc.Case] = set()

    # -- processes ----------------------------------------------------------------------
    def start(self) -> None:
        children = self._children
        for side in ("producer", "consumer"):
            ns = host = None
            if self.netns is not None:
                p = side == "producer"
                ns = self.netns.producer_ns if p else self.netns.consumer_ns
                host = self.netns.producer_addr if p else self.netns.consumer_addr
            children.start(side, worker_main, side, ns, host or "127.0.0.1")
        for side in ("producer", "consumer"):
            children.recv(side, 120)
        for side in ("producer", "consumer"):
            self.call(side, "options", self.options)

    def close(self) -> None:
        self._children.close()

    def restart(self) -> None:
        self.close()
        self.start()

    def _recv(self, side: str, timeout: float | None = None) -> Any:
        return self._children.recv(side, timeout)

    def _send(self, side: str, cmd: str, payload: Any = None) -> None:
        self._children.send(side, cmd, payload)

    def call(self, side: str, cmd: str, payload: Any = None) -> Any:
        return self._children.call(side, cmd, payload)

    # -- cases --------------------------------------------------------------------------
    def run(self, cases: Sequence[bc.Case], on_result: Callable[[dict[str, Any]], None]) -> None:
        """Run every case (ordered as :func:`build_matrix` orders them)."""
        for _, group in itertools.groupby(cases, key=lambda c: c.cache_key):
            members = list(group)
            # The machine is shared: check what is free now, not only the budget set at
            # the start, so the bench never pushes anyone (itself included) into OOM.
            free = bc.mem_available()
            fits = [c for c in members if bc.case_memory(c) <= 0.85 * free]
            for case in members:
                if case not in fits:
                    need = bc.case_memory(case) / 2**30
                    why = f"needs {need:.1f} GiB; {free / 2**30:.1f} GiB available now"
                    on_result(failed(case, why, "skipped"))
            members = fits
            if not members:
                continue
            try:
                with self._cache(members[0]):
                    for _, agent_group in itertools.groupby(members, key=lambda c: c.agent_key):
                        self._run_agent_group(list(agent_group), on_result)
            except BenchError as exc:
                for case in members:
                    if case not in self._done:
                        on_result(failed(case, str(exc)))
                if exc.dead:
                    self.restart()

    @contextlib.contextmanager
    def _cache(self, case: bc.Case) -> Iterator[None]:
        self._done = set()
        cb = msgspec.to_builtins(case)
        prod = self.call("producer", "cache", cb)
        cons = self.call("consumer", "cache", cb)
        self.call("producer", "peer", {"layout": cons["layout"], "raw": cons["raw"]})
        self.call("consumer", "peer", {"layout": prod["layout"], "raw": prod["raw"]})
        try:
            yield
        finally:
            for side in ("producer", "consumer"):
                with contextlib.suppress(BenchError):
                    self.call(side, "close_cache")

    def _run_agent_group(
        self, cases: list[bc.Case], on_result: Callable[[dict[str, Any]], None]
    ) -> None:
        cb = msgspec.to_builtins(cases[0])
        prod = self.call("producer", "agents", cb)
        cons = self.call("consumer", "agents", cb)
        self.call("producer", "agents_peer", {"exposed": cons["exposed"], "raw": cons["raw"]})
        self.call("consumer", "agents_peer", {"exposed": prod["exposed"], "raw": prod["raw"]})
        peers: dict[str, float] = {}
        for d in sorted({c.direction for c in cases}):
            # One explicit handshake per peer; every later transfer reuses it.
            if d == "pull":
                peers[d] = self.call("consumer", "connect", {"direction": d, **prod[d]})
            else:
                peers[d] = self.call("producer", "connect", {"direction": d, **cons[d]})
        try:
            for case in cases:
                try:
                    result = self._run_case(case, prod, peers[case.direction])
                    if self.planning:
                        result = self._plan_cost(case, result)
                except BenchError as exc:
                    if exc.dead:
                        raise
                    result = failed(case, str(exc))
                self._done.add(case)
                on_result(result)
        finally:
            for side in ("producer", "consumer"):
                with contextlib.suppress(BenchError):
                    if self._children.alive(side):
                        self.call(side, "close_agents")

    # one transfer of each kind -----------------------------------------------------------
    def _kvxfer(self, case: bc.Case, prod: dict[str, Any], verify: bool) -> dict[str, Any]:
        cb = msgspec.to_builtins(case)
        rid = f"bench-{next(self._rid)}"
        if case.direction == "pull":
            held = self.call("producer", "hold", {"case": cb, "direction": "pull", "rid": rid})
            got = self.call(
                "consumer", "pull", {"case": cb, "ticket": held["ticket"], "verify": verify}
            )
            freed = self.call("producer", "freed", rid)
            # The producer's hold() runs when prefill ends, before the ticket even
            # reaches the consumer: off the transfer's path, reported as hold_s. With
            # host bounce it is the staging copy the bytes wait for, so it counts.
            on_path = held["hold_s"] if case.backend == "host_bounce" else 0.0
            return {
                **got,
                "s": on_path + got["s"],
                "s_strict": held["hold_s"] + got["s"],
                "hold_s": held["hold_s"],
                "freed": freed,
            }
        self._send(
            "consumer", "expect_push", {"case": cb, "rid": rid, "verify": verify, **prod["push"]}
        )
        self._recv("consumer")  # registered with the producer
        # The reply to hold() is read only after the consumer's result, so that this
        # process sleeps through the write as it does through raw NIXL's, whether
        # hold() posts it itself (push_post engine: it returns after a CMA copy) or
        # leaves it to the agent's writer thread (it returns at once). Woken mid-write,
        # this process took CPU from the copy on a small host.
        self._send("producer", "hold", {"case": cb, "direction": "push", "rid": rid})
        try:
            got = self._recv("consumer")
        finally:
            held = self._recv("producer")  # its error, if hold() failed, wins
        pushed = self.call("producer", "pushed", rid)
        # The writer's side of the push: its post time (plan time is not exported).
        stats = {**got["stats"], "plan_s": None, "post_s": pushed["post_s"]}
        return {
            **got,
            "stats": stats,
            "s": got["t1"] - held["t0"],
            "hold_s": held["hold_s"],
            "handshakes": pushed["handshakes"],
            "freed": True,
        }

    def _raw(self, case: bc.Case, verify: bool) -> dict[str, Any]:
        cb = msgspec.to_builtins(case)
        if case.direction == "pull":
            staged = 0.0
            if case.backend == "host_bounce":
                staged = self.call("producer", "raw_stage_out", {"case": cb})
            got = self.call("consumer", "raw_read", {"case": cb, "verify": verify})
            return {**got, "s": staged + got["s"], "s_prepped": staged + got["s"] - got["ids_s"]}
        tag = f"raw-{next(self._rid)}"
        self._send("consumer", "raw_expect", {"case": cb, "verify": verify, "tag": tag})
        self._recv("consumer")  # polling for the tag
        wrote = self.call("producer", "raw_write", {"case": cb, "tag": tag})
        got = self._recv("consumer")
        s = got["t1"] - wrote["t0"]
        return {**wrote, **got, "s": s, "s_prepped": s - wrote["ids_s"]}

    def _run_case(self, case: bc.Case, prod: dict[str, Any], handshake_s: float) -> dict[str, Any]:
        first = self._kvxfer(case, prod, verify=True)
        raw_first = self._raw(case, verify=True)
        nbytes = first["stats"]["bytes"]
        kv: list[float] = []
        raw: list[float] = []
        memcpy: list[float] = []
        memcpy_2t: list[float] = []
        details: list[dict[str, Any]] = []
        raw_details: list[dict[str, Any]] = []
        i = 0
        while i < self.reps or (i < self.max_reps and not bc.settled(kv, raw)):
            if i % 2 == 0:
                details.append(self._kvxfer(case, prod, verify=False))
                raw_details.append(self._raw(case, verify=False))
            else:
                raw_details.append(self._raw(case, verify=False))
                details.append(self._kvxfer(case, prod, verify=False))
            kv.append(details[-1]["s"])
            raw.append(raw_details[-1]["s"])
            memcpy.append(self.call("consumer", "memcpy", nbytes))
            if case.backend == "host_bounce":
                # The bus's share for copies side by side: bounds an overlapped bounce.
                memcpy_2t.append(self.call("consumer", "memcpy2", nbytes))
            i += 1
        return assemble(
            case, first, raw_first, details, kv, raw, memcpy, handshake_s, raw_details, memcpy_2t
        )

    def _plan_cost(self, case: bc.Case, result: dict[str, Any]) -> dict[str, Any]:
        """Planning cost beside the transfer: block list → ids → runs → NIXL request."""
        cost = self.call(
            "consumer", "plan_cost", {"case": msgspec.to_builtins(case), "reps": self.reps}
        )
        return {
            **result,
            "kind": "planning",
            "plan_ids_s": cost["ids_s"],
            "plan_runs_s": cost["runs_s"],
            "nixl_make_xfer_s": cost["make_s"],
            "planning_s": cost["ids_s"] + cost["make_s"],
            "runs": cost["runs"],
            # block list -> DONE, raw NIXL, both posting paths
            "prepped_total_s": cost["prepped_total_s"],
            "premerged_total_s": cost["premerged_total_s"],
            "premerged_prep_s": cost["premerged_prep_s"],
        }


def failed(case: bc.Case, reason: str, status: str = "failed") -> dict[str, Any]:
    """A result object for a case that did not produce numbers."""
    return {"kind": _kind(case), **case.fields(), "status": status, "reason": reason}


def _kind(case: bc.Case) -> str:
    """A result's JSON ``kind``: ``ratio`` for a pull between block sizes and ``gather``
    for a pull with staging memory, which the matrix's bars and tables leave to
    :mod:`.block_ratio` and :mod:`.gather`."""
    if case.is_ratio:
        return RATIO_KIND
    return GATHER_KIND if case.gather != "off" else "transfer"


def assemble(
    case: bc.Case,
    first: dict[str, Any],
    raw_first: dict[str, Any],
    details: list[dict[str, Any]],
    kv: list[float],
    raw: list[float],
    memcpy: list[float],
    handshake_s: float,
    raw_details: Sequence[dict[str, Any]] = (),
    memcpy_2t: Sequence[float] = (),
) -> dict[str, Any]:
    """The JSON object of one measured case (medians, ratios, checks)."""
    stats = first["stats"]
    moved = int(stats["bytes"])
    expected, whole = bc.expected_bytes(case)
    kv_s, raw_s, mc_s = bc.median(kv), bc.median(raw), bc.median(memcpy)
    kv_g, raw_g, mc_g = bc.gbps(moved, kv_s), bc.gbps(moved, raw_s), bc.gbps(moved, mc_s)
    mc2_s = bc.median(memcpy_2t)
    # Each timed rep runs kvxfer and raw NIXL back to back (alternating which goes
    # first) and the memcpy right after: per-rep ratios cancel the slow drifts of a
    # shared machine that independent medians keep.
    paired = [r / k for k, r in zip(kv, raw) if k > 0]
    paired_mc = [m / k for k, m in zip(kv, memcpy) if k > 0]
    verified = first["bad"] == 0 and raw_first["bad"] == 0
    paths = [d["stats"].get("path", "direct") for d in (first, *details)]
    # A gathered request posts a few staging reads where raw NIXL posts the direct
    # path's runs: the counts agree only on the direct path.
    same = raw_first["descriptors"] == stats["descriptors"] or stats.get("path") == "gather"
    hs = [d["handshakes"] for d in (first, *details) if d.get("handshakes") is not None]
    ok = verified and same and moved == expected and all(d.get("freed", True) for d in details)
    # The stricter reading: kvxfer with the producer's hold() on the clock even where
    # it is off the transfer's path, raw NIXL with its ids computed before the clock.
    strict = [
        r["s_prepped"] / d.get("s_strict", d["s"])
        for d, r in zip(details, raw_details)
        if d.get("s_strict", d["s"]) > 0 and "s_prepped" in r
    ]
    return {
        "kind": _kind(case),
        **case.fields(),
        "status": "ok" if ok else "failed",
        "reason": "" if ok else _why(verified, same, moved, expected),
        "reps": len(kv),
        "bytes_moved": moved,
        "bytes_expected": expected,
        "whole_block_bytes": whole,
        "bytes_saved": whole - moved,
        "descriptors_posted": stats["descriptors"],
        "nixl_descriptors": raw_first["descriptors"],
        "runs": raw_first.get("runs"),
        # The bench's gather model's choice for these runs (64 MiB of staging), beside
        # the path kvxfer's agents took on each rep (``paths``, the verified one first).
        "gather_model": raw_first.get("gather_model"),
        "paths": paths,
        "verified": verified,
        "mismatched_words": {"kvxfer": first["bad"], "nixl": raw_first["bad"]},
        "kvxfer_s": kv_s,
        "nixl_s": raw_s,
        "memcpy_s": mc_s,
        "kvxfer_gbps": kv_g,
        "nixl_gbps": raw_g,
        "memcpy_gbps": mc_g,
        "memcpy_2t_s": mc2_s,
        "memcpy_2t_gbps": bc.gbps(moved, mc2_s),
        "kvxfer_vs_nixl": bc.median(paired),
        "kvxfer_vs_memcpy": bc.median(paired_mc),
        "kvxfer_vs_nixl_of_medians": bc.ratio(kv_g, raw_g),
        "kvxfer_vs_memcpy_of_medians": bc.ratio(kv_g, mc_g),
        "kvxfer_vs_nixl_strict": bc.median(strict) if strict else None,
        "nixl_vs_memcpy": bc.median([m / r for r, m in zip(raw, memcpy) if r > 0]),
        "nixl_ids_s": bc.median([r["ids_s"] for r in raw_details]) if raw_details else None,
        "plan_s": bc.median([d["stats"]["plan_s"] for d in details if d["stats"]["plan_s"]]),
        "post_s": bc.median([d["stats"]["post_s"] for d in details]),
        "nixl_post_s": bc.median([r["xfer_s"] for r in raw_details]) if raw_details else None,
        "hold_s": bc.median([d["hold_s"] for d in details]),
        "handshake_s": handshake_s,
        "first_transfer_s": first["s"],
        "nixl_first_transfer_s": raw_first["s"],
        "handshakes_in_timed_reps": (max(hs) - min(hs)) if hs else None,
        # The consumer agent's failure accounting after the last rep (issue 16); a
        # push's reps report none (its writer's agent is the producer's).
        "failures": (details[-1] if details else first).get("failures"),
        "samples": {"kvxfer": kv, "nixl": raw, "memcpy": memcpy, "memcpy_2t": list(memcpy_2t)},
    }


def _why(verified: bool, same: bool, moved: int, expected: int) -> str:
    if not verified:
        return "bytes did not verify"
    if not same:
        return "kvxfer and raw NIXL posted different descriptor counts"
    if moved != expected:
        return f"moved {moved} bytes, the algebra says {expected}"
    return "a lease was not released"
