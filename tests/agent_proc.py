"""A kvxfer Agent in a real child process, driven over a pipe (for multi-process tests).

The child owns a model-shaped :class:`~kvxfer.testing.kvcache.HostKVCache`, an Agent on
a real backend and a real side channel. The parent sends ``(command, args)`` and gets
``("ok", value)`` or ``("error", "Type: message")`` back.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec


class ProcSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the child builds."""

    engine_id: str
    role: str = "kv_both"
    direction: str = "pull"
    backend: str = "ucx"
    block_size: int = 16
    num_blocks: int = 64
    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 32
    fill_seed: int | None = None
    port: int = 0
    lease_s: float = 30.0
    transfer_timeout_s: float = 10.0
    model: str = "test/model"
    auth_secret: str | None = None
    chunk_mode: bool = False
    chunk_tokens: int | None = None
    prefill_step_tokens: int | None = None
    swa_window_mode: bool = False
    sliding_window: int = 0
    push_stream: bool = False
    handshake_timeout_s: float = 2.0
    rbln_emulated: bool = False
    shards: int = 1
    tp_size: int = 0  # > 0: a TP rank (kvxfer.core.heads.TPRank), head-major per-head cache
    tp_rank: int = 0
    netns: str = ""  # a network namespace the child enters first (a host of its own)
    host: str = "127.0.0.1"  # the side channel's address (the namespace's own)
    ucx_tls: str = ""  # UCX_TLS for the child ("tcp": over the veth, not CMA)
    env: tuple[tuple[str, str], ...] = ()  # more environment for the child


def _serve(conn: Connection, spec: ProcSpec) -> None:
    if spec.netns:
        from kvxfer.tools.bench.netns import enter_netns

        enter_netns(spec.netns)  # first, before any socket or thread exists
    if spec.ucx_tls:
        os.environ["UCX_TLS"] = spec.ucx_tls
    os.environ.update(dict(spec.env))
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if spec.rbln_emulated:
        os.environ["KVXFER_RBLN_ADAPTER"] = "emulated"
    from kvxfer.agent import Agent, AgentConfig, Ticket
    from kvxfer.core.compat import Fingerprint
    from kvxfer.core.descriptors import PlanOptions
    from kvxfer.testing.kvcache import HostKVCache, ModelShape
    from kvxfer.types import Direction, Role

    shape = ModelShape(
        name="test",
        layers=spec.layers,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        sliding_window=spec.sliding_window,
    )
    cache: Any
    tp = None
    if spec.tp_size:
        from kvxfer.core.heads import HeadLayout, TPRank
        from kvxfer.testing.tp_kvcache import TPHostCache

        heads = HeadLayout(num_kv_heads=spec.kv_heads, tp_size=spec.tp_size)
        tp = TPRank(heads=heads, rank=spec.tp_rank)
        cache = TPHostCache(
            heads,
            spec.tp_rank,
            layers=spec.layers,
            head_bytes=spec.head_dim * 2,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            fill_seed=spec.fill_seed,
        )
    else:
        cache = HostKVCache(
            shape, spec.block_size, spec.num_blocks, fill_seed=spec.fill_seed, shards=spec.shards
        )
    direction = Direction(spec.direction)
    agent = Agent(
        AgentConfig(
            engine_id=spec.engine_id,
            fingerprint=Fingerprint(
                model=spec.model,
                dtype="bfloat16",
                kv_cache_dtype="bfloat16",
                attention_backend="test",
                direction=direction,
            ),
            role=Role(spec.role),
            direction=direction,
            backend=spec.backend,
            side_channel_host=spec.host,
            side_channel_port=spec.port,
            lease_s=spec.lease_s,
            transfer_timeout_s=spec.transfer_timeout_s,
            handshake_timeout_s=spec.handshake_timeout_s,
            handshake_retries=1,
            auth_secret=spec.auth_secret,
            push_stream=spec.push_stream,
            plan=PlanOptions(
                chunk_mode=spec.chunk_mode,
                chunk_tokens=spec.chunk_tokens,
                prefill_step_tokens=spec.prefill_step_tokens,
                swa_window_mode=spec.swa_window_mode,
            ),
            tp=tp,
        )
    )
    agent.register(cache.layout())
    host, port = agent.serve()
    conn.send(("ok", {"host": host, "port": port, "incarnation": agent.incarnation}))
    transfers: dict[str, Any] = {}
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "exit":
                agent.close()
                conn.send(("ok", None))
                break
            if cmd == "crash":
                os._exit(9)
            if cmd == "hold":
                # optional: the request's capability, and its guard (slot, generation)
                rid, blocks, tokens, *extra = args
                cap = extra[0] if extra else ""
                guard = tuple(extra[1]) if len(extra) > 1 else None
                held = agent.hold(rid, blocks, tokens, capability=cap, guard=guard)
                value: Any = msgspec.to_builtins(held)
            elif cmd == "stream":
                rid, blocks, tokens = args
                agent.stream(rid, blocks, tokens)
                value = None
            elif cmd == "release":
                value = agent.release(args)
            elif cmd == "freed":
                value = agent.freed()
            elif cmd == "holding":
                value = agent.holding()
            elif cmd in ("pull", "expect_push"):
                ticket_raw, local, tokens = args
                ticket = msgspec.convert(ticket_raw, Ticket)
                method = agent.pull if cmd == "pull" else agent.expect_push
                transfers[ticket.request_id] = method(ticket, local, num_tokens=tokens)
                value = None
            elif cmd == "wait":
                rid, timeout = args
                t = transfers[rid]
                t0 = time.monotonic()
                try:
                    t.wait(timeout)
                except Exception as exc:
                    value = {
                        "ok": False,
                        "error": f"{type(exc).__name__}: {exc}",
                        "invalid_blocks": list(t.invalid_blocks),
                        "failure": t.stats.failure.value if t.stats.failure else None,
                        "waited_s": time.monotonic() - t0,
                    }
                else:
                    value = {"ok": True, "bytes": t.stats.bytes, "descriptors": t.stats.descriptors}
            elif cmd == "state":
                value = transfers[args].poll().value  # pending, done or failed
            elif cmd == "check":
                local, remote, seed = args
                value = cache.mismatches(local, remote, seed)
                value = len(value) if isinstance(value, list) else value
            elif cmd == "check_tokens":
                # mismatched tokens among the request's first `tokens` tokens
                local, remote, seed, tokens = args
                value = _token_mismatches(cache, local, remote, seed, tokens)
            elif cmd == "token_map":
                local, remote, seed = args
                value = _token_map(cache, local, remote, seed)
            elif cmd == "abort":
                agent.abort(msgspec.convert(args, Ticket))
                value = None
            elif cmd == "abort_and_reuse":
                # An engine that aborts a request `delay` s from now and, the moment its
                # transfer is final, gives the blocks to another request (a sentinel).
                ticket_raw, delay, local, sentinel = args
                value = _abort_and_reuse(
                    agent,
                    cache,
                    transfers[ticket_raw["request_id"]],
                    msgspec.convert(ticket_raw, Ticket),
                    delay,
                    local,
                    sentinel,
                )
            elif cmd == "final_and_reuse":
                # An engine that waits for the transfer to be final and at once gives its
                # blocks to another request (a sentinel), as vLLM does after finished_recving.
                rid, local, sentinel, timeout = args
                t = transfers[rid]
                t0 = time.monotonic()
                while not t.done and time.monotonic() - t0 < timeout:
                    t.poll()
                    time.sleep(0.0005)
                for r in cache.regions:
                    r[list(local)] = sentinel
                value = {
                    "state": t.state.value,
                    "final_s": time.monotonic() - t0,
                    "failure": t.stats.failure.value if t.stats.failure else None,
                }
            elif cmd == "changed":
                # elements of the listed blocks that are not the sentinel any more
                local, sentinel = args
                value = sum(int((r[list(local)] != sentinel).sum()) for r in cache.regions)
            elif cmd == "stats":
                value = msgspec.to_builtins(agent.stats())
            elif cmd == "zero" and spec.tp_size:
                cache.zero()
                value = None
            elif cmd == "zero":
                for r in cache.regions:
                    r.fill(0)
                value = None
            elif cmd == "reuse":
                # the engine got these blocks back and wrote another request's KV
                for r in cache.regions:
                    r[list(args)] = 0xBEEF
                value = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", value))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _abort_and_reuse(
    agent: Any,
    cache: Any,
    transfer: Any,
    ticket: Any,
    delay: float,
    local: list[int],
    sentinel: int,
) -> dict[str, Any]:
    time.sleep(delay)
    t0 = time.monotonic()
    agent.abort(ticket)
    returned = time.monotonic() - t0
    doomed = getattr(transfer, "doomed", None)
    while not transfer.done and time.monotonic() - t0 < 120:
        transfer.poll()
        time.sleep(0.0005)
    final = time.monotonic() - t0
    for r in cache.regions:  # the engine reuses the blocks at once
        r[list(local)] = sentinel
    return {
        "state": transfer.state.value,
        "abort_returned_s": returned,
        "abort_to_final_s": final,
        "doomed_after_abort": doomed,
        "bytes": transfer.stats.bytes,
        "stats": msgspec.to_builtins(agent.stats()),
    }


def _token_map(cache: Any, local: list[int], remote: list[int], seed: int) -> list[Any]:
    """Per region, per listed block, per token: does it hold the producer's bytes?"""
    import numpy as np

    saved, cache.fill_seed = cache.fill_seed, seed
    try:
        words = cache.block_bytes // 2 // cache.region_tokens
        out = []
        for i in range(len(cache.regions)):
            expected = cache.pattern(i, np.asarray(remote)).reshape(len(remote), -1, words)
            got = cache.regions[i][np.asarray(local)].reshape(len(local), -1, words)
            out.append((expected == got).all(axis=2).tolist())
        return out
    finally:
        cache.fill_seed = saved


def _token_mismatches(
    cache: Any, local: list[int], remote: list[int], seed: int, tokens: int
) -> int:
    """Tokens below ``tokens`` (request order) whose bytes differ from the producer's."""
    bad = 0
    for index, region in enumerate(_token_map(cache, local, remote, seed)):
        first = (index % cache.shards) * cache.region_tokens  # the shard's first token
        for j, block in enumerate(region):
            base = j * cache.block_size + first
            bad += sum(1 for k, ok in enumerate(block) if base + k < tokens and not ok)
    return bad


class AgentProc:
    """Parent-side handle of a child running an Agent."""

    def __init__(self, spec: ProcSpec, *, start_timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        info = self._reply(start_timeout)
        self.host: str = info["host"]
        self.port: int = info["port"]
        self.incarnation: int = info["incarnation"]

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"agent process {self.spec.engine_id} did not answer in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def send(self, cmd: str, *args: Any) -> None:
        """Send a command without waiting for its reply (see :meth:`reply`)."""
        self.conn.send((cmd, args[0] if len(args) == 1 else args))

    def reply(self, timeout: float = 60.0) -> Any:
        """The reply to the last :meth:`send`."""
        return self._reply(timeout)

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self.send(cmd, *args)
        return self._reply(timeout)

    def crash(self) -> None:
        self.conn.send(("crash", None))
        self.proc.join(10)

    def close(self) -> int | None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
                self.call("exit", None, timeout=20)
            self.proc.join(20)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        return self.proc.exitcode
