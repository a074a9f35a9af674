"""Time to first token through a P/D pair of real vLLM engines: kvxfer pull and push
beside upstream's NixlConnector and one unified instance, with a per-request
decomposition from the engines' own timestamps.

    python -m examples.vllm.pd_ttft [--setups pull push nixl-tuned nixl]
        [--together pull push nixl-tuned] [--sizes 256 1024 3072] [--reps 5]
        [--json out.json]
    python -m examples.vllm.pd_ttft --from-json out.json [more.json]   # re-report
    python -m examples.vllm.pd_ttft --wait-cost   # CPU of a decode awaiting a push

Run it from the repository root: it starts its engines with the end-to-end test bed
(``tests/e2e``: the offline model builder and the server starter), which is not part
of the installed package (so this is an example, not a ``kvxfer bench`` mode). It is
not part of ``make test``: ~4 min on a quiet 2-core box, far longer under load.

What runs: one unified instance throughout, and per setup a prefill and a decode
instance of an 8-layer Qwen2 with 8 KV heads x 64 in bf16 (16 KiB of KV per token),
random weights, block size 128. The ``--together`` setups run at the same time (7
engines) and their requests are interleaved, so they see the same background load;
the others (upstream as shipped, whose progress thread spins a core) run alone
afterwards. Per repetition and prompt size, in an order that rotates: a fresh prompt
(never a prefix hit) through each flow of each setup, prefill alone on each setup's
prefill instance, and the unified instance. Every request asks for one token
(``max_tokens: 1``, streamed; TTFT is the first token's arrival at the client).
``P/D - prefill`` pairs each P/D request with prefill alone of the same repetition.

Flows: ``toy`` is upstream's toy proxy's flow driven by this client (prefill with
``do_remote_decode``, then decode with the returned ``kv_transfer_params``, one
``X-Request-Id`` for both); ``proxy`` goes through ``kvxfer proxy`` (run in this
process, its own event loop thread; push mode dispatches decode first).

Upstream's NixlConnector (``nixl``: as shipped, ``kv_role: kv_both``,
``kv_buffer_device: cpu``) busy-polls a core with NIXL's progress thread and pins its
worker to the last core; ``nixl-tuned`` runs it with the progress thread off
(:mod:`examples.vllm.upstream_nixl_noprog`) and every thread's affinity reset to all
cores once the server is up.

kvxfer's instances write a timeline (``KVXFER_TIMELINE``, see
:mod:`kvxfer.adapters.vllm.timeline`); per request the report splits TTFT into:
``front`` client to prefill's scheduler (HTTP, tokenisation, the proxy), ``prefill``,
``hand_off`` prefill finished to the transfer's start (pull: the answer's way back
through the client/proxy to decode, decode's queueing; push: the producer's next
step), ``transfer`` first byte to last (pull: the READ on decode; push: the WRITE's
post on prefill), ``notice`` bytes landed to decode's scheduler learning it, ``tail``
that step to the first token at the client (the first decode step, detokenisation,
the stream, the proxy's relay). ``p_cpu``/``d_cpu`` are each server's CPU seconds
over the request.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tests.e2e.model import TinyModelSpec, build_tiny_model
from tests.e2e.pd import kv_config
from tests.e2e.servers import VllmServer, free_port, start_server, wait_all_healthy

#: 8 layers x 8 KV heads x 64 x 2 (K, V) x 2 bytes = 16 KiB of KV per token.
MODEL = TinyModelSpec(
    num_hidden_layers=8,
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=1024,
    max_position_embeddings=8192,
)
KV_BYTES_PER_TOKEN = 8 * 8 * 64 * 2 * 2
SETUPS = ("pull", "push", "nixl", "nixl-tuned")
UPSTREAM_SHIM = "examples.vllm.upstream_nixl_noprog"
Sample = dict[str, Any]


def _server_args(max_tokens: int) -> list[str]:
    return [
        "--max-model-len",
        str(max_tokens + 512),
        "--max-num-batched-tokens",
        str(max_tokens + 512),  # one prefill step per prompt (no chunking)
        "--kv-cache-memory-bytes",
        str(512 << 20),
    ]


def _stream(url: str, prompt: list[int], rid: str, params: dict[str, Any] | None = None) -> float:
    """Stream a one-token completion; returns the monotonic time of its first token."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
    )
    first: float | None = None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if (
                first is None
                and line.startswith("data:")
                and line != "data: [DONE]"
                and (json.loads(line[5:]).get("choices") or [{}])[0].get("text") is not None
            ):
                first = time.monotonic()
    return first if first is not None else time.monotonic()


def _direct(server: VllmServer, prompt: list[int], rid: str) -> float:
    return _stream(server.url, prompt, rid)


def _prefill(url: str, prompt: list[int], rid: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": rid},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        params = json.loads(resp.read()).get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise RuntimeError(f"prefill returned no ticket: {params!r}")
    return params


class Setup:
    """A prefill and a decode instance of one connector, and how to drive them."""

    def __init__(self, name: str, model: Path, logs: Path, block_size: int, max_len: int) -> None:
        self.name = name
        self.logs = logs
        self.timelines = {r: logs / f"{name}-{r}.tl" for r in ("prefill", "decode")}
        servers = []
        for role in ("prefill", "decode"):
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if name in ("pull", "push"):
                kvc = kv_config("kv_producer" if role == "prefill" else "kv_consumer", name)
                env["KVXFER_TIMELINE"] = str(self.timelines[role])
            else:
                kvc = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
                kvc["kv_buffer_device"] = "cpu"
                if name == "nixl-tuned":
                    kvc["kv_connector_module_path"] = UPSTREAM_SHIM
            servers.append(
                start_server(
                    f"{name}-{role}",
                    model,
                    logs,
                    extra_args=_server_args(max_len),
                    block_size=block_size,
                    env=env,
                    kv_transfer_config=kvc,
                    wait=False,
                )
            )
        wait_all_healthy(servers)
        self.prefill, self.decode = servers
        self.pinned = {s.name: _pinned_threads(s) for s in servers}
        if name == "nixl-tuned":
            for s in servers:
                _unpin(s)
        self.proxy_url: str | None = None
        self._stop_proxy: Callable[[], None] | None = None

    def start_proxy(self) -> None:
        from kvxfer.adapters.vllm.proxy import start_proxy

        mode = "push" if self.name == "push" else "pull"
        self.proxy_url, self._stop_proxy = start_proxy(
            [self.prefill.url], [self.decode.url], mode=mode
        )

    def flows(self) -> dict[str, Callable[[list[int], str], float]]:
        out: dict[str, Callable[[list[int], str], float]] = {"toy": self._toy}
        if self.proxy_url is not None:
            url = self.proxy_url
            out["proxy"] = lambda prompt, rid: _stream(url, prompt, rid)
        return out

    def _toy(self, prompt: list[int], rid: str) -> float:
        params = _prefill(self.prefill.url, prompt, rid)
        return _stream(self.decode.url, prompt, rid, params)

    def stop(self) -> None:
        if self._stop_proxy is not None:
            self._stop_proxy()
        for s in (self.prefill, self.decode):
            s.stop()


def _pinned_threads(server: VllmServer) -> int:
    every = set(range(os.cpu_count() or 1))
    return sum(1 for cpus in server.thread_affinities().values() if cpus != every)


def _unpin(server: VllmServer) -> None:
    every = set(range(os.cpu_count() or 1))
    for tid in server.thread_affinities():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, every)


def _timeline(paths: Sequence[Path]) -> dict[str, dict[str, float]]:
    """{request tag: {event: monotonic time}} from timeline files (first of each event;
    ``push_post``'s ``end`` and ``d_landed``'s ``settled`` as events of their own)."""
    out: dict[str, dict[str, float]] = {}
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) < 4 or parts[0] != "TL":
                continue
            m = re.search(r"ttft-([0-9a-f]{12})", parts[2])
            if m is None:
                continue
            events = out.setdefault(m.group(1), {})
            events.setdefault(parts[1], float(parts[3]))
            for kv in parts[4:]:
                key, _, value = kv.partition("=")
                if key in ("end", "settled"):
                    events.setdefault(f"{parts[1]}.{key}", float(value))
    return out


def _decompose(s: Sample, ev: dict[str, float], push: bool) -> None:
    """Add the decomposition (ms) of one request to ``s`` from its timeline events."""
    need = ["p_new", "p_finished", "d_loaded"]
    start = "push_post" if push else "d_load"
    end = "push_post.end" if push else "d_landed.settled"
    if any(k not in ev for k in [*need, start, end]):
        return
    landed = ev.get("d_landed.settled", ev[end])
    spans = {
        "front": ev["p_new"] - s["t0"],
        "prefill": ev["p_finished"] - ev["p_new"],
        "hand_off": ev[start] - ev["p_finished"],
        "transfer": ev[end] - ev[start],
        "notice": ev["d_loaded"] - max(landed, ev[end]),
        "landed_to_settled": landed - ev[end] if push else 0.0,
        "tail": s["t1"] - ev["d_loaded"],
    }
    if not push and "d_new" in ev:
        spans["d_queue"] = ev["d_load"] - ev["d_new"]
    s.update({k: round(1e3 * v, 2) for k, v in spans.items()})


def _prompts(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _cpu(servers: Sequence[VllmServer]) -> list[float]:
    return [s.cpu_seconds() for s in servers]


Job = tuple[str, str, Callable[[list[int], str], float], Setup | None]


def _run_setups(
    setups: Sequence[Setup],
    unified: VllmServer,
    sizes: Sequence[int],
    reps: int,
    rng: random.Random,
) -> list[Sample]:
    """Every flow of every setup, prefill alone on each setup's prefill instance and the
    unified instance, interleaved per size (the order rotates each rep), so the setups
    running together see the same background load."""
    samples: list[Sample] = []
    jobs: list[Job] = []
    for setup in setups:
        jobs += [(setup.name, kind, run, setup) for kind, run in setup.flows().items()]
        jobs.append((setup.name, "prefill_only", functools.partial(_direct, setup.prefill), setup))
    jobs.append(("unified", "unified", functools.partial(_direct, unified), None))
    for rep in range(-1, reps):  # rep -1 warms every path up and is not kept
        for size in sizes if rep >= 0 else sizes[-1:]:
            k = rep % len(jobs)
            for name, kind, run, owner in jobs[k:] + jobs[:k]:
                servers = [owner.prefill, owner.decode] if owner is not None else [unified]
                tag = uuid.uuid4().hex[:12]
                prompt = _prompts(rng, size)
                c0 = _cpu(servers)
                t0 = time.monotonic()
                t1 = run(prompt, f"ttft-{tag}")
                c1 = _cpu(servers)
                if rep >= 0:
                    samples.append(
                        {
                            "setup": name,
                            "flow": kind,
                            "tokens": size,
                            "rep": rep,
                            "tag": tag,
                            "t0": t0,
                            "t1": t1,
                            "ttft_ms": round(1e3 * (t1 - t0), 2),
                            "p_cpu": round(c1[0] - c0[0], 3),
                            "d_cpu": round(c1[-1] - c0[-1], 3),
                            "load": round(os.getloadavg()[0], 1),
                        }
                    )
                time.sleep(0.05)  # let the engines' post-request work settle
    for setup in setups:
        events = _timeline(list(setup.timelines.values()))
        for s in samples:
            if s["setup"] == setup.name and s["flow"] not in ("prefill_only", "unified"):
                _decompose(s, events.get(s["tag"], {}), push=setup.name == "push")
    return samples


def wait_cost(model: Path, logs: Path, block_size: int, seconds: float = 4.0) -> dict[str, float]:
    """CPU cores a push decode instance uses while a request waits for a push that
    never comes (prefill never runs it), against the same instance idle."""
    from kvxfer.adapters.vllm.proxy.messages import learn_endpoint, push_receiver_params

    setup = Setup("push", model, logs, block_size, 1024)
    try:
        rng = random.Random(1)
        warm = _prompts(rng, 256)
        params = _prefill(setup.prefill.url, warm, "ttft-000000000001")
        _stream(setup.decode.url, warm, "ttft-000000000001", params)
        endpoint = learn_endpoint(params)
        assert endpoint is not None, params
        never = push_receiver_params(endpoint)

        def waiter() -> None:
            with contextlib.suppress(Exception):  # fails at transfer_timeout_s: expected
                _stream(setup.decode.url, _prompts(rng, 1024), "ttft-0000000dead0", never)

        def cores() -> float:
            c0, t0 = setup.decode.cpu_seconds(), time.monotonic()
            time.sleep(seconds)
            return (setup.decode.cpu_seconds() - c0) / (time.monotonic() - t0)

        idle = cores()
        threading.Thread(target=waiter, daemon=True).start()
        time.sleep(1.0)
        return {"idle_cores": round(idle, 3), "waiting_cores": round(cores(), 3)}
    finally:
        setup.stop()


def _memcpy_gbps(nbytes: int = 48 << 20) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src
    times = []
    for _ in range(7):
        t = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _decode_step_ms(unified: VllmServer) -> float:
    """Median inter-token time of a 32-token greedy stream on the unified instance."""
    ttft, total, n = unified.stream_timed(_prompts(random.Random(7), 64), max_tokens=33)
    return 1e3 * (total - ttft) / max(n - 1, 1)


def _median(xs: Sequence[float]) -> float:
    return round(statistics.median(xs), 1) if xs else float("nan")


def summarise(samples: Sequence[Sample], sizes: Sequence[int]) -> dict[str, Any]:
    """Per (setup, flow, size): medians of TTFT, P/D - prefill (paired per rep), CPU
    seconds and the decomposition."""
    out: dict[str, Any] = {}
    keys = sorted({(s["setup"], s["flow"]) for s in samples if s["flow"] != "prefill_only"})
    spans = ("front", "prefill", "hand_off", "d_queue", "transfer", "notice", "tail")
    for setup, flow in keys:
        for size in sizes:
            mine = [
                s for s in samples if (s["setup"], s["flow"], s["tokens"]) == (setup, flow, size)
            ]
            alone = {
                s["rep"]: s["ttft_ms"]
                for s in samples
                if (s["setup"], s["flow"], s["tokens"]) == (setup, "prefill_only", size)
            }
            row: dict[str, Any] = {
                "ttft_ms": _median([s["ttft_ms"] for s in mine]),
                "prefill_alone_ms": _median(list(alone.values())),
                "pd_minus_prefill_ms": _median(
                    [s["ttft_ms"] - alone[s["rep"]] for s in mine if s["rep"] in alone]
                ),
                "p_cpu_s": _median([s["p_cpu"] for s in mine]),
                "d_cpu_s": _median([s["d_cpu"] for s in mine]),
            }
            for span in spans:
                vals = [s[span] for s in mine if span in s]
                if vals:
                    row[span + "_ms"] = _median(vals)
            out[f"{setup}/{flow}/{size}"] = row
    return out


def _table(summary: dict[str, Any], sizes: Sequence[int], bars: dict[int, float]) -> str:
    cols = sorted({k.rsplit("/", 1)[0] for k in summary})
    lines = [
        "| prompt | bar (ms) | " + " | ".join(cols) + " |",
        "|---:|---:|" + "---:|" * len(cols),
    ]
    for size in sizes:
        cells = []
        for col in cols:
            row = summary.get(f"{col}/{size}")
            if row is None:
                cells.append("")
            elif col.endswith("/unified"):
                cells.append(f"{row['ttft_ms']:.0f}")
            else:
                cells.append(f"{row['ttft_ms']:.0f} / {row['pd_minus_prefill_ms']:.0f}")
        lines.append(f"| {size} | {bars[size]:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _rereport(paths: Sequence[Path]) -> dict[str, Any]:
    """The table and decomposition of saved runs (several: their samples together,
    each setup named ``<setup>`` or, when two runs have one, ``<setup>@<commit>``)."""
    samples: list[Sample] = []
    runs = [json.loads(p.read_text()) for p in paths]
    per_run = [{s["setup"] for s in r["samples"]} for r in runs]
    for run in runs:
        for s in run["samples"]:
            if sum(s["setup"] in other for other in per_run) > 1:
                s = {**s, "setup": f"{s['setup']}@{run['commit']}"}
            samples.append(s)
    sizes = sorted({s["tokens"] for s in samples})
    bars = {n: float(runs[0].get("bar_ms", {}).get(str(n), float("nan"))) for n in sizes}
    summary = summarise(samples, sizes)
    print(json.dumps(summary, indent=1))
    print(_table(summary, sizes, bars))
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--sizes", nargs="+", type=int, default=[256, 1024, 3072])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--no-proxy", action="store_true", help="only the toy flow")
    ap.add_argument(
        "--together",
        nargs="*",
        default=["pull", "push", "nixl-tuned"],
        help="setups that run at the same time, their requests interleaved (the rest "
        "run one after the other: upstream as shipped spins a core and would slow them)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--from-json", type=Path, nargs="+", help="re-report saved runs")
    ap.add_argument(
        "--wait-cost",
        action="store_true",
        help="only: CPU of a push decode instance waiting for a push that never comes",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        return _rereport(args.from_json)
    if args.wait_cost:
        logs = Path(tempfile.mkdtemp(prefix="kvxfer-ttft-"))
        out = wait_cost(build_tiny_model(MODEL), logs, args.block_size)
        print(json.dumps(out))
        return out

    model = build_tiny_model(MODEL)
    logs = Path(tempfile.mkdtemp(prefix="kvxfer-ttft-"))
    rng = random.Random(args.seed)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "model": "qwen2 8 layers, 8 KV heads x 64, bf16, 16 KiB KV/token, random weights",
        "block_size": args.block_size,
        "cpus": os.cpu_count(),
        "load_start": os.getloadavg(),
        "logs": str(logs),
    }
    memcpy = _memcpy_gbps()
    max_len = max(args.sizes)
    samples: list[Sample] = []
    unified = start_server(
        "unified", model, logs, extra_args=_server_args(max_len), block_size=args.block_size
    )
    try:
        step_ms = _decode_step_ms(unified)
        # Groups of setups that run at once: the --together ones, then each other alone.
        together = [n for n in args.setups if n in args.together]
        groups = ([together] if together else []) + [
            [n] for n in args.setups if n not in args.together
        ]
        for group in groups:
            setups: list[Setup] = []
            try:
                for name in group:
                    setups.append(Setup(name, model, logs, args.block_size, max_len))
                    if not args.no_proxy and name in ("pull", "push"):
                        setups[-1].start_proxy()
                load0 = os.getloadavg()[0]
                samples += _run_setups(setups, unified, args.sizes, args.reps, rng)
                for setup in setups:
                    report.setdefault("setups", {})[setup.name] = {
                        "ran_with": group,
                        "pinned_threads_at_start": setup.pinned,
                        "load_1min": [load0, os.getloadavg()[0]],
                    }
            finally:
                for setup in setups:
                    setup.stop()
            if args.json:  # what ran so far survives an interrupted run
                args.json.write_text(json.dumps({**report, "samples": samples}, indent=1))
    finally:
        unified.stop()
    bars = {
        n: n * KV_BYTES_PER_TOKEN / (0.6 * memcpy * 1e9) * 1e3 + step_ms + 10 for n in args.sizes
    }
    summary = summarise(samples, args.sizes)
    report.update(
        memcpy_gbps=round(memcpy, 2),
        decode_step_ms=round(step_ms, 2),
        bar_ms={n: round(b, 1) for n, b in bars.items()},
        load_end=os.getloadavg(),
        summary=summary,
        samples=samples,
    )
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    print(
        "\nTTFT ms / (P/D - prefill alone) ms, medians; bar: bytes at 0.6x memcpy + "
        "one decode step + 10 ms"
    )
    print(_table(summary, args.sizes, bars))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
