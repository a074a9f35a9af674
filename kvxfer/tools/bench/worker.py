"""The two bench processes (producer and consumer) of ``kvxfer bench``.

Each owns a model-shaped host KV cache, the kvxfer agents of the current case group,
and one :class:`~kvxfer.tools.bench.raw_nixl.RawNixl` on the same memory, all held in a
:class:`~kvxfer.tools.bench.side.BenchSide` that the two command sets share: this
module's :class:`Worker` (set-up and kvxfer) and :class:`~.measure.Measure` (raw NIXL,
memcpy, planning). The parent sends ``(command, payload)`` tuples of plain values and
gets ``("ok", value)`` or ``("error", text)`` back; a command may send an intermediate
``("ok", ...)`` before its final reply (``expect_push`` and ``raw_expect`` say when
they are waiting).
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

import kvxfer.tools.bench.cases as bc
from kvxfer.agent_config import DEFAULT_PROGRESS_INTERVAL_S
from kvxfer.tools.bench.data import MemcpyBench, fill_regions
from kvxfer.tools.bench.measure import Measure
from kvxfer.tools.bench.procs import serve_commands
from kvxfer.tools.bench.side import BenchSide

__all__ = ["Worker", "worker_main"]

_SECRET = "kvxfer-bench-shared-secret"


def _options(case: bc.Case) -> Any:
    from kvxfer.core.descriptors import PlanOptions

    if case.mode == "chunk":
        return PlanOptions(chunk_mode=True, chunk_tokens=case.chunk_tokens)
    if case.mode == "window":
        return PlanOptions(swa_window_mode=True)
    return PlanOptions()


def _as_device(layout: Any) -> Any:
    """The layout with its regions marked device memory (the RBLN emulation's view)."""
    from kvxfer.core.layout import MemKind

    regions = tuple(msgspec.structs.replace(r, mem=MemKind.VRAM) for r in layout.regions)
    return msgspec.structs.replace(layout, regions=regions)


def _pool(cache: Any) -> None:
    """Carve the cache's regions out of one allocation, as an engine's KV pool is.

    An engine's per-layer KV tensors are large, so they get transparent huge pages;
    regions sized to one request (a few MB each) would get 4 KiB pages, which halves
    what UCX over CMA moves (it pins the peer's pages one by one). HostKVCache's own
    per-region arrays are never touched, so they cost nothing.
    """
    shape = cache.regions[0].shape
    size = cache.regions[0].nbytes
    pool = np.zeros(size * len(cache.regions), dtype=np.uint8)
    cache.regions = [
        pool[i * size : (i + 1) * size].view(np.uint16).reshape(shape)
        for i in range(len(cache.regions))
    ]


class Worker:
    """The set-up and kvxfer commands of one bench process (its raw NIXL, memcpy and
    planning commands are :class:`~kvxfer.tools.bench.measure.Measure`'s)."""

    def __init__(self, side: BenchSide, host: str) -> None:
        self.state, self.host = side, host
        self.cache_reg: Any = None
        self.case: bc.Case | None = None
        self.staging_reg: Any = None
        self._push_before: Any = None  # the push agent's stats as its last hold began
        self.push_post = "auto"  # AgentConfig.push_post of the push agents
        self.device: str | None = None  # --device: the cache in torch memory there
        self.progress_interval_s = DEFAULT_PROGRESS_INTERVAL_S  # --progress-interval-us

    def cmd_options(self, payload: dict[str, Any]) -> None:
        """Run-wide options (``--push-post``, ``--engine-busy-ms``, ``--device``,
        ``--progress-interval-us``)."""
        self.push_post = str(payload["push_post"])
        self.state.engine_busy_s = float(payload["engine_busy_s"])
        self.device = payload.get("device")
        interval = payload.get("progress_interval_s")
        self.progress_interval_s = DEFAULT_PROGRESS_INTERVAL_S if interval is None else interval

    # -- set-up -----------------------------------------------------------------------
    def cmd_cache(self, case: bc.Case) -> dict[str, Any]:
        from kvxfer.testing.kvcache import HostKVCache

        self.cmd_close_cache(None)
        moved, _ = bc.expected_bytes(case)
        scratch = min(moved, bc.MEMCPY_SCRATCH)
        # The two sides' block sizes differ in a pull between sizes (--block-ratios).
        side = self.state.own_side
        bs, nb = case.block_size_of(side), bc.num_blocks_for(case, side)
        if self.device is not None:
            from kvxfer.tools.bench.device import DeviceMemcpy, TorchKVCache

            cache = TorchKVCache(case.shape, bs, nb, self.device)
            self.state.cache = cache
            if self.state.side == "producer":
                cache.fill()
            else:
                self.state.memcpy = DeviceMemcpy(cache.regions, scratch)
        else:
            self.state.cache = HostKVCache(case.shape, bs, nb)
            _pool(self.state.cache)
            if self.state.side == "producer":
                fill_regions(self.state.cache.regions)
            else:
                for r in self.state.cache.regions:
                    r.fill(0)  # touch every page: no first-touch faults in the timings
                self.state.memcpy = MemcpyBench(self.state.cache.regions, scratch)
        self.cache_reg = self.state.raw.register(self.state.cache.layout())
        return {
            "layout": msgspec.to_builtins(self.state.cache.layout()),
            "raw": self.state.raw.metadata(),
        }

    def cmd_peer(self, payload: dict[str, Any]) -> None:
        from kvxfer.core.layout import KVLayout

        if payload.get("layout") is not None:
            self.state.peer_layout = msgspec.convert(payload["layout"], KVLayout)
        if self.state.raw_peer is not None:  # new registrations: the peer's metadata changed
            self.state.raw.remove_peer(self.state.raw_peer)
        self.state.raw_peer = self.state.raw.add_peer(payload["raw"])

    def cmd_agents(self, case: bc.Case) -> dict[str, Any]:
        import kvxfer.tools.bench.gather as gather
        from kvxfer.agent import Agent, AgentConfig, PushPost
        from kvxfer.core.compat import Fingerprint
        from kvxfer.types import Direction, Role

        self.cmd_close_agents(None)
        self.case = case
        layout = self.state.cache.layout()
        if case.backend == "nixl_rbln":
            layout = _as_device(layout)
        role = Role.PRODUCER if self.state.side == "producer" else Role.CONSUMER
        extra = {"rbln_adapter": "emulated"} if case.backend == "nixl_rbln" else {}
        if case.backend == "host_bounce":
            extra = {"transport": "ucx"}
        out: dict[str, Any] = {}
        for d in ("pull", "push"):
            direction = Direction(d)
            agent = Agent(
                AgentConfig(
                    engine_id=f"bench-{self.state.side}-{d}",
                    fingerprint=Fingerprint(
                        model=f"bench/{case.model}",
                        dtype="bfloat16",
                        kv_cache_dtype="bfloat16",
                        attention_backend="bench",
                        direction=direction,
                    ),
                    role=role,
                    direction=direction,
                    backend=case.backend,
                    side_channel_host=self.host,
                    plan=_options(case),
                    lease_s=300.0,
                    transfer_timeout_s=300.0,
                    auth_secret=_SECRET,
                    backend_extra=extra,
                    push_post=PushPost(self.push_post),
                    progress_interval_s=self.progress_interval_s,
                    gather=gather.agent_config(case),
                )
            )
            self.state.agents[d] = agent
            agent.register(layout)
            host, port = agent.serve()
            out[d] = {"host": host, "port": port, "engine_id": agent.config.engine_id}
        self.state.exposed = self.state.agents["pull"].exposed_layout
        if case.backend == "host_bounce":
            # Raw NIXL moves the same staging buffers the kvxfer backend moves.
            self.staging_reg = self.state.raw.register(self.state.exposed)
        out["exposed"] = msgspec.to_builtins(self.state.exposed)
        out["raw"] = self.state.raw.metadata()
        return out

    def cmd_agents_peer(self, payload: dict[str, Any]) -> None:
        from kvxfer.core.descriptors import DescriptorTable
        from kvxfer.core.layout import KVLayout

        assert self.case is not None and self.state.cache is not None
        self.cmd_peer({"raw": payload["raw"]})
        opts = _options(self.case)
        peer_exposed = msgspec.convert(payload["exposed"], KVLayout)
        local = DescriptorTable.build(self.state.exposed, opts)
        remote = DescriptorTable.build(peer_exposed, opts)
        self.state.tables = (local, remote)
        self.state.dlists = (
            self.state.raw.prep(None, local),
            self.state.raw.prep(self.state.raw_peer, remote),
        )
        if self.case.backend == "host_bounce":
            vt = (
                DescriptorTable.build(self.state.cache.layout(), opts),
                DescriptorTable.build(self.state.peer_layout, opts),
            )
            self.state.verify_tables = vt
        else:
            self.state.verify_tables = self.state.tables

    def cmd_connect(self, payload: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        self.state.agents[payload["direction"]].connect(
            payload["host"], payload["port"], payload["engine_id"]
        )
        return time.perf_counter() - t0

    def cmd_close_agents(self, _: Any) -> None:
        if self.state.dlists is not None:
            for d in self.state.dlists:
                self.state.raw.release(d)
            self.state.dlists = None
        for agent in self.state.agents.values():
            agent.close()
        self.state.agents = {}
        if self.staging_reg is not None:
            self.state.raw.deregister(self.staging_reg)
            self.staging_reg = None
        self.state.tables = self.state.verify_tables = None

    def cmd_close_cache(self, _: Any) -> None:
        self.cmd_close_agents(None)
        if self.state.raw_peer is not None:
            self.state.raw.remove_peer(self.state.raw_peer)
            self.state.raw_peer = None
        if self.cache_reg is not None:
            self.state.raw.deregister(self.cache_reg)
            self.cache_reg = None
        if self.state.memcpy is not None:
            self.state.memcpy.close()
        self.state.cache = self.state.memcpy = None

    # -- kvxfer -----------------------------------------------------------------------
    def cmd_hold(self, payload: dict[str, Any]) -> dict[str, Any]:
        case = msgspec.convert(payload["case"], bc.Case)
        agent = self.state.agents[payload["direction"]]
        if payload["direction"] == "push":
            # The consumer registers from a worker thread: start the clock only once
            # its registration is here (it opens the lease), as a real prefill would
            # find it after computing the prompt.
            deadline = time.monotonic() + 60
            while payload["rid"] not in agent.holding():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the consumer never registered {payload['rid']}")
                time.sleep(0.0005)
        blocks = self.state.blocks(case, own=True)
        before = agent.stats()
        t0 = time.perf_counter()
        ticket = agent.hold(payload["rid"], blocks, case.tokens)
        t1 = time.perf_counter()
        if payload["direction"] == "pull":
            return {"ticket": msgspec.to_builtins(ticket), "hold_s": t1 - t0}
        # Push: back to the runner at once. Polling freed() here while the write runs
        # would be the bench's own load on the producer (an engine looks once a step);
        # cmd_pushed collects the outcome after the consumer saw the data.
        self._push_before = before
        self.state.engine_busy()
        return {"t0": t0, "hold_s": t1 - t0}

    def cmd_pushed(self, rid: str) -> dict[str, Any]:
        """The producer's side of a finished push: its lease freed, its post time."""
        agent = self.state.agents["push"]
        deadline = time.monotonic() + 300
        while rid not in agent.freed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"push of {rid} did not complete")
            time.sleep(0.0005)
        after, before = agent.stats(), self._push_before
        return {
            "handshakes": after.handshakes,
            "post_s": after.post_s_total - before.post_s_total,
            "descriptors": after.descriptors_posted - before.descriptors_posted,
        }

    def cmd_freed(self, rid: str) -> bool:
        deadline = time.monotonic() + 30
        while rid not in self.state.agents["pull"].freed():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def cmd_pull(self, payload: dict[str, Any]) -> dict[str, Any]:
        from kvxfer.agent import Ticket

        case = msgspec.convert(payload["case"], bc.Case)
        ticket = msgspec.convert(payload["ticket"], Ticket)
        self.state.prepare_verify(case, payload["verify"])
        agent = self.state.agents["pull"]
        blocks = self.state.blocks(case, own=True)
        t0 = time.perf_counter()
        transfer = agent.pull(ticket, blocks)
        transfer.wait(300)
        s = time.perf_counter() - t0
        bad = self.state.verify(case) if payload["verify"] else None
        return {
            "s": s,
            "bad": bad,
            "stats": self._stats(transfer),
            "handshakes": agent.stats().handshakes,
            "failures": agent.stats().failure_accounting(),
        }

    def cmd_expect_push(self, payload: dict[str, Any]) -> dict[str, Any]:
        from kvxfer.agent import Ticket

        case = msgspec.convert(payload["case"], bc.Case)
        self.state.prepare_verify(case, payload["verify"])
        stub = Ticket(
            engine_id=payload["engine_id"],
            host=payload["host"],
            port=payload["port"],
            request_id=payload["rid"],
            block_ids=((),),
            num_tokens=case.tokens,
        )
        transfer = self.state.agents["push"].expect_push(stub, self.state.blocks(case, own=True))
        self.state.conn.send(("ok", "registered"))
        transfer.wait(300)
        t1 = time.perf_counter()
        bad = self.state.verify(case) if payload["verify"] else None
        return {"t1": t1, "bad": bad, "stats": self._stats(transfer)}

    @staticmethod
    def _stats(transfer: Any) -> dict[str, Any]:
        s = transfer.stats
        return {
            "bytes": s.bytes,
            "descriptors": s.descriptors,
            "path": s.path.value,  # direct, or gathered through the staging slots
            "plan_s": s.plan_s,
            "post_s": s.post_s,
            "transfer_s": s.transfer_s,
        }


#: Commands that start kvxfer's transfer of a rep. Raw NIXL's background poller pauses
#: from one of them to the process's next other command (after the transfer: the
#: producer's ``freed``/``pushed``, the consumer's ``memcpy`` or raw command), so it
#: never polls beside kvxfer's transfer (see RawNixl.pause).
_KVXFER_TRANSFER = frozenset({"hold", "pull", "expect_push"})


def worker_main(conn: Connection, side: str, netns: str | None, host: str) -> None:
    """Entry point of a bench process (``multiprocessing`` spawn target)."""
    if netns:
        from kvxfer.tools.bench.netns import enter_netns

        enter_netns(netns)  # first, before any socket or thread exists
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("KVXFER_RBLN_ADAPTER", "emulated")
    try:
        from kvxfer.tools.bench.raw_nixl import RawNixl

        state = BenchSide(conn, side, RawNixl(f"bench-raw-{side}-{os.getpid()}"))
        worker = Worker(state, host)
        measure = Measure(state)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return

    def handler_for(cmd: str) -> Any:
        return getattr(worker, f"cmd_{cmd}", None) or getattr(measure, f"cmd_{cmd}", None)

    def before(cmd: str, payload: Any) -> Any:
        if cmd in _KVXFER_TRANSFER:
            state.raw.pause()  # until this process's next other command
        else:
            state.raw.resume()
        return msgspec.convert(payload, bc.Case) if cmd in ("cache", "agents") else payload

    try:
        serve_commands(conn, handler_for, before)
    finally:
        try:
            worker.cmd_close_cache(None)
        finally:
            state.raw.close()
