"""``kvxfer demo``: the main job on an embedded default, end to end.

Starts a producer (prefill) and a consumer (decode) process on loopback, each with a
Qwen3-0.6B-shaped KV cache (28 layers, 8 KV heads × 128, bf16) in host memory. The
producer fills its blocks with a provenance pattern and holds a request; the consumer
handshakes over the side channel, pulls the blocks with NIXL, and checks every byte.
Then the same request goes the other way round with push. A memcpy of the same bytes,
measured in the consumer process in the same run, gives the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvxfer.tools import _demo_worker as worker
from kvxfer.tools import cma

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (4096)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    p.add_argument("--layers", type=int, default=28, help="model layers (28, Qwen3-0.6B)")
    p.add_argument("--backend", default="ucx", help="ucx | host_bounce (ucx)")
    p.add_argument("--direction", choices=["both", "pull", "push"], default="both")
    p.add_argument("--repeat", type=int, default=3, help="timed transfers per direction (3)")
    p.add_argument("--timeout", type=float, default=120.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _report(result: dict[str, Any]) -> str:
    lines = [
        f"kvxfer demo — {result['model']} KV, {result['tokens']} tokens, "
        f"block_size {result['block_size']}, backend {result['backend']}",
        f"  {result['regions']} regions, {result['blocks']} blocks per region, "
        f"{result['descriptors']} descriptors per request",
        "",
        f"  {'direction':<9} {'verified':<9} {'bytes':>12} {'seconds':>9} {'GB/s':>7} "
        f"{'x memcpy':>9} {'handshake':>10}",
    ]
    for d in ("pull", "push"):
        r = result.get(d)
        if r is None:
            continue
        lines.append(
            f"  {d:<9} {('yes' if r['verified'] else 'NO'):<9} {r['bytes']:>12,} "
            f"{r['seconds']:>9.4f} {r['gbps']:>7.2f} {r['memcpy_ratio']:>9.2f} "
            f"{r['handshake_s']:>9.3f}s"
        )
    lines += [
        "",
        f"  memcpy of the same bytes in the consumer process: {result['memcpy_gbps']:.2f} GB/s",
        *_push_lines(result),
        "  seconds = best of the timed transfers after the first (which pays the handshake)",
        f"  result: {'OK — every byte verified' if result['ok'] else 'FAILED'}",
    ]
    return "\n".join(lines)


def _push_lines(result: dict[str, Any]) -> list[str]:
    """Push over pull, beside the kernel's own write over read between two processes."""
    ratio = result.get("push_over_pull")
    if ratio is None:
        return []
    pages = cma.PAGE_NAMES.get(result.get("cache_pages", ""), "?")
    if "cma" not in result:  # UCX told to leave CMA out: the kernel's copy is not the path
        return [f"  push over pull: {ratio:.2f}{cma.tls_note(result.get('ucx_tls'))}"]
    return [
        f"  push over pull: {ratio:.2f} (caches on {pages}); this kernel's process_vm_writev "
        "over readv,",
        "    what UCX moves WRITE and READ with between two processes:",
        "      " + cma.describe(result.get("cma") or {}),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit status 0 when every direction moved and verified its bytes."""
    args = _parser().parse_args(argv)
    if args.tokens <= 0 or args.block_size <= 0 or args.layers <= 0 or args.repeat <= 0:
        print(
            "kvxfer demo: --tokens, --block-size, --layers and --repeat must be > 0",
            file=sys.stderr,
        )
        return 2
    # NIXL logs every agent start at INFO; the report is what the user came for.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ctx = mp.get_context("spawn")
    params = worker.DemoParams(
        tokens=args.tokens,
        block_size=args.block_size,
        layers=args.layers,
        backend=args.backend,
        repeat=args.repeat,
        directions=("pull", "push") if args.direction == "both" else (args.direction,),
    )
    to_prod, prod_end = ctx.Pipe()
    to_cons, cons_end = ctx.Pipe()
    procs = [
        ctx.Process(target=worker.producer, args=(prod_end, params), name="kvxfer-demo-producer"),
        ctx.Process(target=worker.consumer, args=(cons_end, params), name="kvxfer-demo-consumer"),
    ]
    for p in procs:
        p.start()
    # Drop the parent's copies of the children's ends: a child that dies then closes
    # its pipe and the parent sees EOF at once instead of waiting for the deadline.
    prod_end.close()
    cons_end.close()
    deadline = time.monotonic() + args.timeout
    try:
        result = worker.coordinate(to_prod, to_cons, params, deadline)
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for conn in (to_prod, to_cons):
            with contextlib.suppress(OSError):
                conn.send(("stop", None))
        for p in procs:
            p.join(max(1.0, min(15.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join()
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif "error" in result:
        print(f"kvxfer demo failed: {result['error']}", file=sys.stderr)
    else:
        print(_report(result))
    return 0 if result.get("ok") else 1
