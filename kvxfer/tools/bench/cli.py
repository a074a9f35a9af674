"""The ``kvxfer bench`` command line: the presets, the case selection, the run loop.

Two processes (a producer and a consumer, on loopback or with ``--netns`` in two
network namespaces joined by a veth pair) hold model-shaped KV caches in host memory.
For every case of the matrix (model shape × block size × prompt length × allocation
pattern × direction × backend × mode) the same run measures kvxfer (``Agent.pull`` /
push), raw NIXL on exactly the same registered memory and descriptor indices, and a
memcpy of the same bytes; it reports medians, the ratios, the bytes each mode moves,
handshake and first-transfer latency, and the planning cost per request.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import kvxfer.tools.bench.block_ratio as block_ratio
import kvxfer.tools.bench.cases as bc
import kvxfer.tools.bench.device as device
import kvxfer.tools.bench.gather as gather
import kvxfer.tools.bench.report as report
from kvxfer.agent import PushPost
from kvxfer.agent_config import DEFAULT_PROGRESS_INTERVAL_S, check_progress_interval
from kvxfer.errors import ConfigError, MissingDependency
from kvxfer.tools import cma as _cma

__all__ = [
    "DESCRIPTION",
    "PLANNING",
    "QUICK",
    "main",
    "parser",
    "plan_cases",
    "run",
    "unavailable_backends",
]

#: What ``kvxfer bench --help`` says the command is.
DESCRIPTION = (
    "``kvxfer bench``: model-shaped KV transfers, kvxfer beside raw NIXL and memcpy (R-CLI-3)."
)
_ALL: dict[str, str] = {
    "models": ",".join(m for m in bc.SHAPES if m != bc.THIN),
    "block_sizes": "16,128,1024",
    "tokens": "1000,4000,32000",
    "patterns": ",".join(bc.PATTERNS),
    "directions": ",".join(bc.DIRECTIONS),
    "backends": ",".join(bc.BACKENDS),
    "modes": ",".join(bc.MODES),
}
#: The --quick preset, a union of small matrices (under a minute on a 2-core box): the
#: bs16 bar case both ways, bs1024 for the plot, host bounce, and the modes on a
#: sliding-window model.
QUICK: tuple[dict[str, str], ...] = (
    {
        **_ALL,
        "models": bc.QWEN,
        "block_sizes": "16",
        "tokens": "4000",
        "backends": "ucx",
        "modes": "whole",
    },
    {
        **_ALL,
        "models": bc.QWEN,
        "block_sizes": "1024",
        "tokens": "4000",
        "patterns": "contiguous",
        "backends": "ucx",
        "modes": "whole",
    },
    {
        **_ALL,
        "models": bc.QWEN,
        "block_sizes": "16",
        "tokens": "4000",
        "patterns": "contiguous",
        "backends": "host_bounce",
        "modes": "whole",
    },
    {
        **_ALL,
        "models": "gpt-oss-20b",
        "block_sizes": "1024",
        "tokens": "4000",
        "patterns": "contiguous",
        "directions": "pull",
        "backends": "nixl_rbln",
    },
)
#: Planning cost: a Qwen3-0.6B-shaped 4k prompt, and a 128k one on the thin shape
#: (same regions and descriptor count, a fraction of the bytes).
PLANNING = ((bc.QWEN, 4000), (bc.THIN, 128000))


def parser() -> argparse.ArgumentParser:
    """The options of ``kvxfer bench``."""
    p = argparse.ArgumentParser(prog="kvxfer bench", description=DESCRIPTION)
    p.add_argument("--quick", action="store_true", help="a small matrix (under a minute)")
    for key, text in (
        ("models", f"model shapes ({', '.join(bc.SHAPES)})"),
        ("block-sizes", "tokens per block"),
        ("tokens", "prompt lengths in tokens"),
        ("patterns", "block allocation patterns (contiguous, scattered)"),
        ("directions", "pull, push"),
        ("backends", "ucx, host_bounce, nixl_rbln (nixl_rbln on its EMULATED adapter)"),
        ("modes", "whole, chunk (chunk_mode), window (swa_window_mode)"),
    ):
        p.add_argument(f"--{key}", help=f"comma list of {text}")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per case (7; quick 5)")
    p.add_argument(
        "--max-reps",
        type=int,
        default=None,
        help="reps a noisy case may take until the kvxfer/NIXL ratio is within ±0.04 "
        "(3x --reps; quick: no extra reps, except with --tp: its x runs)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="run the two processes in two network namespaces joined by a veth pair",
    )
    p.add_argument(
        "--mem-budget",
        type=float,
        default=None,
        help="GiB both processes may hold (default: 75%% of MemAvailable)",
    )
    p.add_argument("--no-planning", action="store_true", help="skip the planning-cost cases")
    p.add_argument(
        "--tp",
        nargs="?",
        const="1:2,2:1",
        metavar="P:D,...",
        help="instead of the matrix, transfers across TP sizes: prefill TP P to decode "
        "TP D (default 1:2,2:1), one decode rank and one process per prefill rank holding "
        "its heads; --models --block-sizes --tokens --patterns --directions select "
        "(qwen3-0.6b, 16, 4000 (quick 1000), contiguous, pull and push)",
    )
    p.add_argument(
        "--block-ratios",
        metavar="P:C,...",
        help="instead of the matrix, pulls from a producer with blocks of P tokens to a "
        "consumer with blocks of C, one a whole multiple of the other (e.g. "
        "128:16,128:64,16:128), each beside the pull of equal block sizes at the smaller "
        "size (the same bytes), on ucx; --models --tokens --patterns select (qwen3-0.6b, "
        "4000, contiguous)",
    )
    p.add_argument(
        "--gather",
        action="store_true",
        help="instead of the matrix, pulls on ucx three ways in one run: direct (no "
        "staging), gathered (every request through the staging slots) and auto (the "
        "gather cost model picks per request), with the path each rep took and whether "
        "the model picked the slower one; --models --block-sizes --tokens --patterns "
        "select (qwen3-0.6b, 16,128, 4000, contiguous,scattered)",
    )
    p.add_argument(
        "--firsts",
        type=int,
        default=None,
        metavar="N",
        help="with --tp: first requests per case, each after a fresh start of the case's "
        "processes, their median over the steady median reported (3; quick 1); starts "
        "alternate whether kvxfer's or raw NIXL's first runs first",
    )
    p.add_argument(
        "--hybrid",
        action="store_true",
        help="print what vLLM's hybrid KV cache manager, swa_window_mode and chunk_mode "
        "save on a gpt-oss-like hybrid model (bytes, descriptors, runs; the algebra "
        "alone, no transfer) instead of measuring",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per case")
    p.add_argument("--plot", metavar="PNG", help="plot GB/s against block size (matplotlib)")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 3 when a target of the bar is missed (default: report only)",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="report (and --plot) a run saved with --json instead of measuring (a --tp "
        "run: its table and bars)",
    )
    p.add_argument(
        "--tables",
        nargs="+",
        metavar="FILE",
        help="print the Markdown tables of docs/PERFORMANCE.md from runs saved with "
        "--json (several files: one matrix run in parts) instead of measuring",
    )
    p.add_argument(
        "--push-post",
        choices=[m.value for m in PushPost],
        default=PushPost.AUTO.value,
        help="which thread posts kvxfer's push writes (AgentConfig.push_post; auto)",
    )
    p.add_argument(
        "--progress-interval-us",
        type=float,
        default=None,
        metavar="US",
        help="kvxfer's agents poll transfers in flight this often "
        "(AgentConfig.progress_interval_s; 200). Not with --tp",
    )
    p.add_argument(
        "--engine-busy-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="the push producer's engine thread runs Python this long after starting "
        "each push (kvxfer's hold(), raw NIXL's write), as an engine's step goes on (0)",
    )
    p.add_argument(
        "--device",
        type=_device,
        default=None,
        metavar="DEV",
        help="hold each process's cache in torch memory on DEV (cuda, cuda:N, or cpu as "
        "a CPU engine allocates it) instead of numpy arrays; memcpy becomes a copy on DEV. "
        "ucx only (the default backend then); not with --netns",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one bench step may take before it counts as hung (900)",
    )
    return p


def _device(text: str) -> str:
    try:
        return device.parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--device ")) from exc


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _strs(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def unavailable_backends(names: Sequence[str]) -> dict[str, str]:
    """Backends of the selection that cannot run here, with the reason."""
    out: dict[str, str] = {}
    from kvxfer.backends.ucx import import_nixl  # kvxfer's one NIXL edge

    try:
        import_nixl()
    except MissingDependency as exc:
        return {n: f"NIXL is not importable ({exc})" for n in names}
    for name in names:
        try:
            importlib.import_module(f"kvxfer.backends.{name}")
            if name == "nixl_rbln":
                importlib.import_module("kvxfer.testing.rbln_emulation")
        except ImportError as exc:
            out[name] = f"backend {name} is not importable here ({exc})"
    return out


def plan_cases(args: argparse.Namespace) -> tuple[list[bc.Case], list[Result]]:
    """The cases to run and the result objects of those that will not run.

    Selectors given on the command line replace the preset's (every sub-matrix of
    ``--quick``, or the full matrix).
    """
    cases: list[bc.Case] = []
    impossible: list[tuple[bc.Case, str]] = []
    if args.block_ratios:
        pick = {k: getattr(args, k) or v for k, v in block_ratio.DEFAULTS.items()}
        cases = block_ratio.build_cases(
            ratios=block_ratio.parse_ratios(args.block_ratios),
            models=_strs(pick["models"]),
            tokens=_ints(pick["tokens"]),
            patterns=_strs(pick["patterns"]),
        )
    if args.gather:
        pick = {k: getattr(args, k) or v for k, v in gather.DEFAULTS.items()}
        cases = gather.build_cases(
            models=_strs(pick["models"]),
            block_sizes=_ints(pick["block_sizes"]),
            tokens=_ints(pick["tokens"]),
            patterns=_strs(pick["patterns"]),
        )
    instead = args.block_ratios or args.gather  # a sub-bench in place of the matrix
    for preset in () if instead else QUICK if args.quick else (_ALL,):
        pick = {k: getattr(args, k) or preset[k] for k in preset}
        more, bad = bc.build_matrix(
            models=_strs(pick["models"]),
            block_sizes=_ints(pick["block_sizes"]),
            tokens=_ints(pick["tokens"]),
            patterns=_strs(pick["patterns"]),
            directions=_strs(pick["directions"]),
            backends=_strs(pick["backends"]),
            modes=_strs(pick["modes"]),
        )
        cases += [c for c in more if c not in cases]
        impossible += [(c, why) for c, why in bad if (c, why) not in impossible]
    cases = bc.order_cases(cases)
    from kvxfer.tools.bench.runner import failed

    skipped = [failed(c, why, "skipped") for c, why in impossible]
    missing = unavailable_backends(sorted({c.backend for c in cases}))
    skipped += [failed(c, missing[c.backend], "unavailable") for c in cases if c.backend in missing]
    cases = [c for c in cases if c.backend not in missing]
    budget = int((args.mem_budget * 2**30) if args.mem_budget else 0.75 * bc.mem_available())
    cases, too_big = bc.trim_to_budget(cases, budget)
    skipped += [failed(c, why, "skipped") for c, why in too_big]
    return cases, skipped


Result = dict[str, Any]


def _progress(total: int) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A tqdm bar on stderr when tqdm is importable, else a plain counter."""
    if total == 0:
        return (lambda _label: None), (lambda: None)
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)

        def step(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        return step, bar.close
    except ImportError:
        done = [0]

        def count(label: str) -> None:
            done[0] += 1
            print(f"\r[{done[0]}/{total}] {label:<70}", end="", file=sys.stderr, flush=True)

        return count, (lambda: print(file=sys.stderr))


def run(args: argparse.Namespace, results: list[Result], header: Result | None = None) -> None:
    """Run the bench, appending result objects in matrix order, planning last (an
    interrupted run keeps what it measured). Where a case runs both ways, ``header``
    gets ``cma``: the kernel's write over read between two processes, taken first."""
    from kvxfer.tools.bench.netns import netns_pair
    from kvxfer.tools.bench.runner import Runner

    cases, skipped = plan_cases(args)
    both = {"pull", "push"} <= {c.direction for c in cases}
    on_host = args.device in (None, "cpu")
    if header is not None and both and on_host and _cma.ucx_uses_cma(header.get("ucx_tls")):
        header["cma"] = _kernel_copy_rates()
    planning: list[bc.Case] = []
    # the planning cases belong to the matrix
    matrix = not (args.block_ratios or args.gather)
    if matrix and not args.no_planning and "ucx" not in unavailable_backends(["ucx"]):
        patterns = ("contiguous",) if args.quick else bc.PATTERNS
        planning = [
            bc.Case(model=m, block_size=16, tokens=n, pattern=p, direction="pull", backend="ucx")
            for m, n in PLANNING
            for p in patterns
        ]
    reps = args.reps or (5 if args.quick else 7)
    step, finish = _progress(len(cases) + len(planning))

    def collect(result: Result) -> None:
        results.append(result)
        step(result["label"])

    ctx = netns_pair() if args.netns else None
    pair = ctx.__enter__() if ctx is not None else None
    try:
        max_reps = (
            args.max_reps if args.max_reps is not None else (reps if args.quick else 3 * reps)
        )
        runner = Runner(
            reps=reps,
            timeout_s=args.timeout,
            netns=pair,
            max_reps=max_reps,
            push_post=args.push_post,
            engine_busy_s=args.engine_busy_ms / 1e3,
            device=args.device,
            progress_interval_s=_interval_s(args),
        )
        runner.start()
        try:
            runner.run(cases, collect)
            runner.planning = True
            if args.quick:  # planning is measured per call; a few reps do
                runner.reps = runner.max_reps = 3
            runner.run(planning, collect)
        finally:
            runner.close()
    finally:
        finish()
        if ctx is not None:
            ctx.__exit__(None, None, None)
    results += skipped


def _load(path: str) -> tuple[dict[str, Any], list[Result]]:
    """A saved ``--json`` run: its header and its case objects (bars are recomputed)."""
    header: dict[str, Any] = {}
    results: list[Result] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            if obj.get("kind") == "run":
                header = obj
            elif obj.get("kind") in ("transfer", "planning", "tp", block_ratio.KIND, gather.KIND):
                results.append(obj)
    return header, results


def _kernel_copy_rates() -> dict[str, Any]:
    """The kernel's write over read between two processes (the push bar's reference)."""
    from kvxfer.tools import cma

    return cma.by_page_size()


def _interval_s(args: argparse.Namespace) -> float:
    """kvxfer's agents' AgentConfig.progress_interval_s for this run."""
    us = args.progress_interval_us
    return DEFAULT_PROGRESS_INTERVAL_S if us is None else us / 1e6


def _interval_note(seconds: float | None) -> str:
    """The header line's note on kvxfer's poll pace (nothing at the default)."""
    if seconds is None or seconds == DEFAULT_PROGRESS_INTERVAL_S:
        return ""
    return f", kvxfer polls transfers in flight every {seconds * 1e6:g} us"


def _interval_refusal(args: argparse.Namespace) -> str:
    """Why --progress-interval-us cannot be used as given ("" when it can)."""
    if args.tp:
        return "applies to the matrix, not --tp"
    try:
        check_progress_interval("progress_interval_s", _interval_s(args))
    except ConfigError as exc:
        return f"AgentConfig.{exc}"
    return ""


def _header(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    """The run's JSON header: when, where, how many reps, the command line."""
    return {
        "kind": "run",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpus": os.cpu_count(),
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "network": "two network namespaces (veth)" if args.netns else "loopback",
        "ucx_tls": os.environ.get("UCX_TLS") or None,
        "device": args.device,
        "ucx_cuda_ipc_get_zcopy": device.cuda_ipc_get(),
        "nixl_ucx_sgl": device.list_writes(),
        "progress_interval_s": _interval_s(args),
        "reps": args.reps or (5 if args.quick else 7),
        "argv": list(argv if argv is not None else sys.argv[1:]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvxfer bench``; 0 when every case ran and verified (see ``--check``)."""
    args = parser().parse_args(argv)
    if args.tables:
        from kvxfer.tools.bench.tables import main as print_tables

        return print_tables(args.tables)
    if args.hybrid:
        from kvxfer.tools.bench.hybrid import main as print_hybrid

        return print_hybrid([])
    for key in ("reps", "firsts"):
        value = getattr(args, key)
        if value is not None and value < 1:
            print(f"kvxfer bench: --{key} {value}: must be 1 or more", file=sys.stderr)
            return 2
    if not 0 <= args.engine_busy_ms < 60_000:
        print(
            f"kvxfer bench: --engine-busy-ms {args.engine_busy_ms:g}: must be 0 or more "
            "and under 60000",
            file=sys.stderr,
        )
        return 2
    if args.progress_interval_us is not None:
        refused = _interval_refusal(args)
        if refused:
            print(
                f"kvxfer bench: --progress-interval-us {args.progress_interval_us:g}: {refused}",
                file=sys.stderr,
            )
            return 2
    if args.block_ratios and not (args.tables or args.hybrid or args.from_json):
        refused = block_ratio.refusal(args)
        if refused:
            print(f"kvxfer bench: --block-ratios: {refused}", file=sys.stderr)
            return 2
    if args.gather and not (args.tables or args.hybrid or args.from_json):
        refused = gather.refusal(args)
        if refused:
            print(f"kvxfer bench: --gather: {refused}", file=sys.stderr)
            return 2
    if args.firsts is not None and not args.tp:
        print(f"kvxfer bench: --firsts {args.firsts}: applies to --tp only", file=sys.stderr)
        return 2
    if args.device is not None and not (args.tables or args.hybrid or args.from_json):
        why = device.refusal(args.device, netns=args.netns, backends=args.backends)
        if why:
            print(f"kvxfer bench: --device {args.device}: {why}", file=sys.stderr)
            return 2
        if not args.tp:  # --tp runs on ucx and refuses --backends
            args.backends = args.backends or "ucx"
    if not (args.tables or args.hybrid or args.from_json):
        try:
            device.list_writes()
        except ValueError as exc:  # a NIXL_UCX_SGL_ENABLE its agents could not start with
            print(f"kvxfer bench: {exc}", file=sys.stderr)
            return 2
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.from_json:
        try:
            header, results = _load(args.from_json)
        except (OSError, ValueError) as exc:
            print(f"kvxfer bench: cannot read {args.from_json}: {exc}", file=sys.stderr)
            return 2
        if "tp" in header:  # a --tp run: its own table and bars
            from kvxfer.tools.bench.tp_runner import report_tp

            if args.plot:
                print(
                    f"kvxfer bench: --plot: {args.from_json} is a --tp run, which has no "
                    "GB/s against block size plot",
                    file=sys.stderr,
                )
                return 2

            return report_tp(header, results, as_json=args.json, check=args.check)
        if args.tp:
            print(f"kvxfer bench: --tp: {args.from_json} is not a --tp run", file=sys.stderr)
            return 2
        report.relate(results)
    elif args.tp:
        from kvxfer.tools.bench.tp_runner import main_tp

        return main_tp(args, _header(args, argv))
    else:
        header = _header(args, argv)
        results = []
        try:
            run(args, results, header)
        except (ValueError, RuntimeError) as exc:
            print(f"kvxfer bench: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("kvxfer bench: interrupted; reporting the cases measured", file=sys.stderr)
        report.relate(results)
    bars = report.check_bars(results, header.get("cma"))
    if args.json:
        for r in [header, *results, *bars]:
            print(json.dumps(r, sort_keys=True))
    else:
        print(
            f"kvxfer bench — {header.get('date', '?')}, {header.get('cpus', '?')} CPUs, "
            f"{header.get('network', '?')}{_cma.tls_note(header.get('ucx_tls'))}"
            f"{device.report_note(header.get('device'))}"
            f"{device.list_writes_note(header.get('nixl_ucx_sgl'))}"
            f"{_interval_note(header.get('progress_interval_s'))}, "
            f"{header.get('reps', '?')} timed reps per case"
        )
        print(report.format_table(results, bars))
    if args.plot:
        err = report.plot(results, args.plot)
        print(err or f"plot written to {args.plot}", file=sys.stderr)
    bad = [r for r in results if r.get("status") == "failed"]
    if bad:
        return 1
    if args.check and any(b["holds"] is False for b in bars):
        return 3
    return 0
