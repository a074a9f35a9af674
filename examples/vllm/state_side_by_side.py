"""A recurrent-state hybrid through kvxfer's pull connector and upstream's NixlConnector,
side by side on one host: equal output, and the time decode takes after prefill.

    python -m examples.vllm.state_side_by_side [--model gdn|mamba2] [--reps 3]
        [--sizes 5 127 128 129 257 450] [--json out.json]

Run it from the repository root (it starts engines with the e2e test bed in
``tests/e2e``). What runs, all at once: one unified instance, a kvxfer pull pair
(host bounce, ``kv_buffer_device: cpu``) and an upstream pair (``NixlConnector``,
``kv_role: kv_both``, ``kv_buffer_device: cpu``, NIXL's progress thread off through
:mod:`examples.vllm.upstream_nixl_noprog` so that it does not spin a core of the
two), each of the tiny hybrid of :mod:`tests.e2e.model` (``gdn``: Qwen3-Next-style
Gated DeltaNet; ``mamba2``: GraniteMoeHybrid-style, float32, prefix caching off as
vLLM's CPU build needs). Per prompt size and repetition, a fresh prompt goes through
the toy proxy's flow on each pair (prefill with ``do_remote_decode``, then decode
with the returned ``kv_transfer_params``) and through unified:

* ``equal``: whether the 8 greedy tokens decode returns equal unified's;
* ``after prefill``: the decode request's wall time with ``max_tokens: 1`` (its
  scheduling, the transfer, the first step that computes the held-back token), the
  median over repetitions, in ms.

Not part of ``make test``: ~3 min on a quiet 2-core host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.e2e.model import GDN_SPEC, MAMBA2_SPEC, build_tiny_model
from tests.e2e.pd import divergence, kv_config, prefill, tokens
from tests.e2e.servers import F32_ARGS, VllmServer, free_port, start_server, wait_all_healthy

SPECS = {"gdn": GDN_SPEC, "mamba2": MAMBA2_SPEC}
ARGS = {"gdn": (), "mamba2": (*F32_ARGS, "--no-enable-prefix-caching")}
UPSTREAM_SHIM = "examples.vllm.upstream_nixl_noprog"
NEW_TOKENS = 8


def _pair(name: str, model: Path, logs: Path, args: Sequence[str]) -> list[VllmServer]:
    servers = []
    for role in ("prefill", "decode"):
        if name == "kvxfer":
            kvc = kv_config("kv_producer" if role == "prefill" else "kv_consumer", "pull")
        else:
            kvc = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
                "kv_connector_module_path": UPSTREAM_SHIM,
            }
        servers.append(
            start_server(
                f"{name}-{role}",
                model,
                logs,
                block_size=None,
                extra_args=args,
                env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                kv_transfer_config=kvc,
                wait=False,
            )
        )
    return servers


def _decode(
    server: VllmServer, prompt: list[int], params: dict[str, Any], rid: str, n: int
) -> tuple[list[int], float]:
    t0 = time.monotonic()
    out = server.complete(
        prompt,
        max_tokens=n,
        logprobs=None,
        return_token_ids=True,
        kv_transfer_params=dict(params),
        headers={"X-Request-Id": rid},
    )
    return tokens(out), time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(SPECS), default="gdn")
    ap.add_argument("--sizes", nargs="+", type=int, default=[5, 127, 128, 129, 257, 450])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = build_tiny_model(SPECS[args.model])
    extra = ARGS[args.model]
    logs = Path(tempfile.mkdtemp(prefix="kvxfer-state-sbs-"))
    unified = start_server("unified", model, logs, block_size=None, extra_args=extra, wait=False)
    pairs = {name: _pair(name, model, logs, extra) for name in ("kvxfer", "upstream")}
    every = [unified, *(s for p in pairs.values() for s in p)]
    rows: list[dict[str, Any]] = []
    try:
        wait_all_healthy(every)
        rng = random.Random(0)
        vocab = SPECS[args.model].vocab_size
        for size in args.sizes:
            row: dict[str, Any] = {"tokens": size}
            equal: dict[str, list[bool]] = {n: [] for n in pairs}
            after: dict[str, list[float]] = {n: [] for n in pairs}
            for _ in range(args.reps):
                # One prompt for both pairs, so that a near tie in unified's greedy
                # picks (random bf16 weights) hits both or neither.
                prompt = [rng.randrange(1, vocab) for _ in range(size)]
                ref = tokens(
                    unified.complete(
                        prompt, max_tokens=NEW_TOKENS, logprobs=None, return_token_ids=True
                    )
                )
                for name, (p, d) in pairs.items():
                    rid = f"sbs-{uuid.uuid4().hex[:12]}"
                    got, _ = _decode(d, prompt, prefill(p, prompt, rid), rid, NEW_TOKENS)
                    equal[name].append(got == ref)
                    if got != ref:
                        print(f"{name} {size}: {divergence(unified, prompt, got)}", flush=True)
                    rid = f"sbs-{uuid.uuid4().hex[:12]}"
                    _, seconds = _decode(d, prompt, prefill(p, prompt, rid), rid, 1)
                    after[name].append(seconds * 1e3)
            for name in pairs:
                row[name] = {
                    "equal": sum(equal[name]),
                    "of": len(equal[name]),
                    "after_ms": statistics.median(after[name]),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for s in every:
            s.stop()
    print(f"\n{args.model}: equal / after prefill (median ms), logs in {logs}")
    print("| prompt | kvxfer pull | upstream NixlConnector |\n|---:|---:|---:|")
    for row in rows:
        cells = [f"{row[n]['equal']}/{row[n]['of']} / {row[n]['after_ms']:.0f}" for n in pairs]
        print(f"| {row['tokens']} | " + " | ".join(cells) + " |")
    result = {"model": args.model, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
