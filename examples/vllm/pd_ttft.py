"""TTFT and tokens/s through a P/D pair (kvxfer connectors) versus one unified vLLM
instance, on the e2e test bed's tiny model, plus the per-request KV transfer time
from decode's connector stats.

    .venv/bin/python -m examples.vllm.pd_ttft [--modes pull push] [--requests 12]
        [--prompt-tokens 320] [--max-tokens 64] [--json out.json]

Run it from the repository root: it starts its engines with the end-to-end test bed
(``tests/e2e``: the tiny model, the server and P/D pair starters), so it is an example
of driving kvxfer under real vLLM, not part of the installed package. It is the seed of
a TTFT benchmark; ``kvxfer bench`` measures the transfers themselves.

Single stream (one request at a time) and bursts of ``--concurrency``; the unified
instance and the P/D pair run side by side and get the prompts interleaved, so both
see the same background load. TTFT through P/D is what a client of the toy proxy's
flow sees: from sending the prefill request (``max_tokens: 1``,
``do_remote_decode``) to decode's first streamed token; ``--proxy`` adds the same
through ``kvxfer proxy``. Every prompt is new to every instance (no prefix hits).
Numbers from a 2-core CPU box with three engines sharing it are indicative only: the
tiny model makes prefill nearly free, so P/D cannot win here (SPEC: P/D is for long
inputs on real models).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.e2e.model import build_tiny_model
from tests.e2e.pd import PDPair, prefill, start_pair
from tests.e2e.servers import VllmServer, start_server


def _prompt(i: int, tokens: int) -> list[int]:
    """A token-id prompt unique to ``i`` (no prefix-cache hit anywhere)."""
    return [(7 * i + 13 * k + (i * k) % 11) % 500 + 3 for k in range(tokens)]


def _stream(
    url: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None
) -> tuple[float, float, int]:
    """POST a streamed completion: (seconds to first token, total seconds, tokens).

    Tokens come from the final usage chunk: vLLM merges several tokens into one chunk
    when the client reads slower than the engine decodes, so chunks are not tokens.
    """
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                n = int(chunk["usage"]["completion_tokens"])
            choices = chunk.get("choices") or []
            # The first token's chunk, even when its text is empty (a partial character).
            if choices and choices[0].get("text") is not None and first is None:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (total if first is None else first), total, n


def _through_pair(pair: PDPair) -> Callable[[list[int], int], tuple[float, float, int]]:
    def run(prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        params = prefill(pair.prefill, prompt, f"bench-{uuid.uuid4().hex[:12]}")
        p_s = time.perf_counter() - t0
        ttft, total, n = _stream(pair.decode.url, prompt, max_tokens, params)
        return p_s + ttft, p_s + total, n

    return run


def _direct(server: VllmServer) -> Callable[[list[int], int], tuple[float, float, int]]:
    return lambda prompt, max_tokens: _stream(server.url, prompt, max_tokens)


def _measure(
    runs: dict[str, Callable[[list[int], int], tuple[float, float, int]]],
    prompts: Sequence[list[int]],
    max_tokens: int,
    concurrency: int,
) -> dict[str, dict[str, float]]:
    """Send every prompt through every setup in ``runs``, interleaved (the setups see
    the same background load), ``concurrency`` requests at a time per setup."""
    results: dict[str, list[tuple[float, float, int]]] = {name: [] for name in runs}
    walls: dict[str, float] = dict.fromkeys(runs, 0.0)
    for start in range(0, len(prompts), concurrency):
        batch = prompts[start : start + concurrency]
        for k, (name, run) in enumerate(runs.items()):
            lock = threading.Lock()
            out: list[tuple[float, float, int]] = []

            def one(
                prompt: list[int], run: Any = run, out: Any = out, lock: Any = lock, k: int = k
            ) -> None:
                # Each setup gets its own variant: P and D serve two setups (direct and
                # through the proxy), and a repeated prompt would be a prefix hit.
                r = run([(t + 37 * k) % 500 + 3 for t in prompt], max_tokens)
                with lock:
                    out.append(r)

            threads = [threading.Thread(target=one, args=(p,)) for p in batch]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            walls[name] += time.perf_counter() - t0
            results[name] += out
    report: dict[str, dict[str, float]] = {}
    for name, rs in results.items():
        ttfts = [r[0] for r in rs]
        e2e_rates = [r[2] / r[1] for r in rs if r[1] > 0]
        report[name] = {
            "requests": len(rs),
            "ttft_ms_p50": round(1e3 * statistics.median(ttfts), 1),
            "ttft_ms_mean": round(1e3 * statistics.fmean(ttfts), 1),
            "ttft_ms_max": round(1e3 * max(ttfts), 1),
            "latency_ms_p50": round(1e3 * statistics.median(r[1] for r in rs), 1),
            "tok_s_per_request_p50": round(statistics.median(e2e_rates), 1),
            "total_tok_s": round(sum(r[2] for r in rs) / walls[name], 1),
        }
    return report


def _transfer_stats(decode: VllmServer) -> tuple[float, float]:
    return (
        decode.metric("vllm:kvxfer_transfer_time_seconds_sum"),
        decode.metric("vllm:kvxfer_transfer_time_seconds_count"),
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--proxy", action="store_true", help="also measure through kvxfer proxy")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    model = build_tiny_model()
    logs = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-"))
    report: dict[str, Any] = {
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "logs": str(logs),
    }
    serial = [_prompt(i, args.prompt_tokens) for i in range(args.requests)]
    burst = [_prompt(1000 + i, args.prompt_tokens) for i in range(args.requests)]
    counter = iter(range(2000, 10**6))

    def fresh(prompts: list[list[int]]) -> list[list[int]]:
        k = next(counter)
        return [[(t + k) % 500 + 3 for t in p] for p in prompts]

    unified = start_server("unified", model, logs)
    try:
        _stream(unified.url, _prompt(99999, 16), 4)
        for mode in args.modes:
            pair = start_pair(mode, model, logs)
            try:
                runs = {"unified": _direct(unified), mode: _through_pair(pair)}
                stop: Callable[[], None] | None = None
                if args.proxy:
                    from kvxfer.adapters.vllm.proxy import start_proxy

                    url, stop = start_proxy([pair.prefill.url], [pair.decode.url], mode=mode)
                    _stream(url, _prompt(88888, 16), 4)  # a push proxy's first is serial
                    runs[f"{mode}_via_proxy"] = lambda p, m, u=url: _stream(u, p, m)
                s0, c0 = _transfer_stats(pair.decode)
                entry: dict[str, Any] = {
                    "serial": _measure(runs, fresh(serial), args.max_tokens, 1),
                    f"concurrent_{args.concurrency}": _measure(
                        runs, fresh(burst), args.max_tokens, args.concurrency
                    ),
                }
                if stop is not None:
                    stop()
                s1, c1 = _transfer_stats(pair.decode)
                entry["transfer_ms_mean"] = round(1e3 * (s1 - s0) / max(c1 - c0, 1), 2)
                entry["transfers"] = int(c1 - c0)
                lines = [
                    line.split("KV Transfer metrics: ", 1)[1]
                    for line in pair.decode.log_text().splitlines()
                    if "KV Transfer metrics: " in line
                ]
                entry["kv_transfer_metrics_lines"] = lines[-3:]
                report[mode] = entry
            finally:
                pair.stop()
    finally:
        unified.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
