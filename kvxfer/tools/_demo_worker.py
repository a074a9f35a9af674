"""The two processes of ``kvxfer demo`` and the parent's script that pairs them.

Messages on the pipes are ``(command, payload)`` tuples of plain Python values.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from kvxfer.testing.kvcache import QWEN3_0_6B, HostKVCache
from kvxfer.tools import cma
from kvxfer.types import Direction, Role

__all__ = ["DemoParams", "consumer", "coordinate", "producer"]

PRODUCER_SEED = 1234


class DemoParams(msgspec.Struct, frozen=True, kw_only=True):
    """What both demo processes build."""

    tokens: int
    block_size: int
    layers: int
    backend: str
    repeat: int
    directions: tuple[str, ...]

    @property
    def request_blocks(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        # Room for the request at an offset, so local and remote ids differ.
        # Both block lists skip one block in 64, hence the slack.
        n = self.request_blocks
        return 2 * (n + n // 64 + 1) + 16


def _agent(params: DemoParams, engine_id: str, role: Role, direction: Direction) -> Any:
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.core.compat import Fingerprint

    fp = Fingerprint(
        model="demo/qwen3-0.6b-shaped",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="demo",
        direction=direction,
    )
    return Agent(
        AgentConfig(
            engine_id=engine_id,
            fingerprint=fp,
            role=role,
            direction=direction,
            backend=params.backend,
            side_channel_host="127.0.0.1",
            side_channel_port=0,
            auth_secret="kvxfer-demo-shared-secret",
        )
    )


def _shape(params: DemoParams) -> Any:
    return msgspec.structs.replace(QWEN3_0_6B, layers=params.layers)


def _blocks(params: DemoParams, offset: int) -> list[int]:
    # Contiguous runs with a hole every 64 blocks, as a paged allocator hands them out.
    n = params.request_blocks
    ids = np.arange(offset, offset + n + n // 64 + 1)
    ids = ids[(ids - offset) % 64 != 63][:n]
    return [int(b) for b in ids]


def producer(conn: Connection, params: DemoParams) -> None:
    """Prefill side: serves both a pull agent and a push agent."""
    cache = HostKVCache(
        _shape(params), params.block_size, params.num_blocks, fill_seed=PRODUCER_SEED
    )
    agents = {
        d: _agent(params, f"demo-prefill-{d}", Role.PRODUCER, Direction(d))
        for d in params.directions
    }
    try:
        for a in agents.values():
            a.register(cache.layout())
            a.serve()
        conn.send(("ready", {d: a.address for d, a in agents.items()}))
        while True:
            cmd, payload = conn.recv()
            if cmd == "stop":
                break
            if cmd == "hold":
                d, rid = payload
                t = agents[d].hold(rid, _blocks(params, 3), params.tokens)
                conn.send(("ticket", msgspec.to_builtins(t)))
            elif cmd == "freed":
                d, rid = payload
                deadline = time.monotonic() + 30
                while rid not in agents[d].freed() and time.monotonic() < deadline:
                    time.sleep(0.001)
                conn.send(("freed", time.monotonic() < deadline))
    finally:
        for a in agents.values():
            a.close()


def consumer(conn: Connection, params: DemoParams) -> None:
    """Decode side: pulls, or registers receiving blocks for a push; verifies bytes."""
    from kvxfer.agent import Ticket

    shape = _shape(params)
    cache = HostKVCache(shape, params.block_size, params.num_blocks)
    for r in cache.regions:
        r.fill(0)  # touch every page so timings do not include first-touch faults
    agents = {
        d: _agent(params, f"demo-decode-{d}", Role.CONSUMER, Direction(d))
        for d in params.directions
    }
    try:
        for a in agents.values():
            a.register(cache.layout())
            a.serve()
        conn.send(("ready", None))
        local = _blocks(params, params.request_blocks + 5)
        while True:
            cmd, payload = conn.recv()
            if cmd == "stop":
                break
            if cmd == "memcpy":
                src = np.ones(payload // 2, dtype=np.uint16)
                dst = np.zeros_like(src)
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    np.copyto(dst, src)
                    best = min(best, time.perf_counter() - t0)
                conn.send(("memcpy", payload / best / 1e9))
                continue
            d, raw = payload
            ticket = msgspec.convert(raw, Ticket)
            for r in cache.regions:
                r.fill(0)
            t0 = time.perf_counter()
            if cmd == "pull":
                transfer = agents[d].pull(ticket, local)
            else:  # "expect_push"
                transfer = agents[d].expect_push(ticket, local)
                conn.send(("registered", None))
            try:
                transfer.wait(60)
                ok, err = True, ""
            except Exception as exc:
                ok, err = False, f"{type(exc).__name__}: {exc}"
            wall = time.perf_counter() - t0
            bad = cache.mismatches(local, _blocks(params, 3), PRODUCER_SEED) if ok else -1
            conn.send(
                (
                    "done",
                    {
                        "ok": ok and bad == 0,
                        "error": err,
                        "mismatched_blocks": bad,
                        "bytes": transfer.stats.bytes,
                        "descriptors": transfer.stats.descriptors,
                        "transfer_s": transfer.stats.transfer_s,
                        "wall_s": wall,
                        "handshakes": agents[d].stats().handshakes,
                        "failure_stage": (
                            transfer.stats.stage.value if transfer.stats.stage else None
                        ),
                        "failures": agents[d].stats().failure_accounting(),
                    },
                )
            )
    finally:
        for a in agents.values():
            a.close()


def _recv(conn: Connection, expect: str, deadline: float) -> Any:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not conn.poll(remaining):
        raise TimeoutError(f"no {expect!r} from a demo process in time")
    try:
        cmd, payload = conn.recv()
    except EOFError:
        raise RuntimeError(f"a demo process exited before sending {expect!r}") from None
    if cmd != expect:
        raise RuntimeError(f"demo process sent {cmd!r}, expected {expect!r}")
    return payload


def coordinate(
    prod: Connection, cons: Connection, params: DemoParams, deadline: float
) -> dict[str, Any]:
    """Drive both processes through pull and push rounds; return the report dict."""
    addresses = _recv(prod, "ready", deadline)
    _recv(cons, "ready", deadline)
    shape = _shape(params)
    regions = shape.layers * 2
    out: dict[str, Any] = {
        "model": shape.name,
        "tokens": params.tokens,
        "block_size": params.block_size,
        "backend": params.backend,
        "regions": regions,
        "blocks": params.num_blocks,
    }
    total_ok = True
    memcpy_gbps = 0.0
    for d in params.directions:
        rounds = []
        for i in range(params.repeat + 1):
            rid = f"demo-{d}-{i}"
            if d == "pull":
                prod.send(("hold", (d, rid)))
                ticket = _recv(prod, "ticket", deadline)
                cons.send(("pull", (d, ticket)))
                res = _recv(cons, "done", deadline)
            else:
                host, port = addresses[d]
                stub = {
                    "engine_id": f"demo-prefill-{d}",
                    "host": host,
                    "port": port,
                    "request_id": rid,
                    "block_ids": [[]],
                    "num_tokens": params.tokens,
                }
                cons.send(("expect_push", (d, stub)))
                _recv(cons, "registered", deadline)
                prod.send(("hold", (d, rid)))
                _recv(prod, "ticket", deadline)
                res = _recv(cons, "done", deadline)
            prod.send(("freed", (d, rid)))
            res["freed"] = _recv(prod, "freed", deadline)
            rounds.append(res)
        first, timed = rounds[0], rounds[1:]
        nbytes = first["bytes"] or max(r["bytes"] for r in rounds)
        if not memcpy_gbps:
            cons.send(("memcpy", nbytes))
            memcpy_gbps = _recv(cons, "memcpy", deadline)
        best = min((r["wall_s"] if d == "push" else r["transfer_s"]) for r in timed)
        verified = all(r["ok"] for r in rounds)
        total_ok = total_ok and verified and all(r["freed"] for r in rounds)
        gbps = nbytes / best / 1e9 if best > 0 else 0.0
        out["descriptors"] = first["descriptors"] or out.get("descriptors", 0)
        out[d] = {
            "verified": verified,
            "bytes": nbytes,
            "seconds": best,
            "gbps": gbps,
            "memcpy_ratio": gbps / memcpy_gbps if memcpy_gbps else 0.0,
            "handshake_s": max(0.0, first["wall_s"] - best),
            "descriptors": first["descriptors"],
            "errors": [r["error"] for r in rounds if r["error"]],
            "blocks_released": all(r["freed"] for r in rounds),
            # The consumer's failure accounting after the last round (issue 16).
            "failure_stages": [r["failure_stage"] for r in rounds if r["failure_stage"]],
            "failures": rounds[-1]["failures"],
        }
    out["memcpy_gbps"] = memcpy_gbps
    if "pull" in out and "push" in out and out["pull"]["gbps"]:
        out["push_over_pull"] = out["push"]["gbps"] / out["pull"]["gbps"]
        # The kernel's own write-over-read between two processes: where push trails
        # pull on one host, this says how much of it is the transport's (UCX over CMA).
        out["cache_pages"] = cma.numpy_pages()
        out["ucx_tls"] = os.environ.get("UCX_TLS") or None
        if cma.ucx_uses_cma(out["ucx_tls"]):
            out["cma"] = cma.by_page_size(cma.sample_bytes(out["pull"]["bytes"]))
    out["ok"] = total_ok
    return out
