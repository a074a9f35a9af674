"""One process of ``kvxfer bench --tp``: a prefill rank or the decode rank.

Each process owns one TP rank's head-major KV cache (described as the vLLM adapter
does by default, :meth:`~kvxfer.tools.bench.tp_cases.TPCase.per_head`, carved from
one allocation as an engine's pool is), a kvxfer Agent of the case's direction with
that TP identity, and a :class:`~kvxfer.tools.bench.raw_nixl.RawNixl` on the same
memory. Prefill rank *p* serves its side channel at the run's base port + *p*, under
one engine id for the group, as transfers across TP sizes expect.

Pull: the decode rank builds, once, the same :class:`~kvxfer.core.tp_plan.TPPlanner`
its agent builds, and raw NIXL posts, per request, that planner's ids on prepared lists
of the same tables: one READ per producer rank, posted together, as kvxfer's
sub-transfers are. Push: each prefill rank builds the planner its agent builds for
writes into the decode rank (restricted to its own part), and raw NIXL posts one WRITE
of it per rank, the decode rank waiting for each rank's notification. The parent
drives the processes with ``(command, payload)`` tuples as :mod:`.worker` is driven.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

import kvxfer.tools.bench.cases as bc
from kvxfer.tools.bench.data import MemcpyBench
from kvxfer.tools.bench.device import DeviceMemcpy, DevicePool
from kvxfer.tools.bench.measure import DONE_NOTICE
from kvxfer.tools.bench.raw_nixl import RawNixl
from kvxfer.tools.bench.tp_cases import PREFILL_ENGINE, TPCase

__all__ = ["FILL_SEED", "TPRankProc"]

FILL_SEED = 17
_SECRET = "kvxfer-bench-tp-secret"


def _tp_cache(case: TPCase, producer: bool, rank: int) -> tuple[Any, npt.NDArray[np.uint8]]:
    """The rank's cache, its buffers carved out of one (huge-page backed) allocation,
    filled with the provenance pattern on a prefill rank, pre-touched on decode; and
    that allocation."""
    from kvxfer.testing.tp_kvcache import TPHostCache

    heads = case.prefill_heads if producer else case.decode_heads
    cache = TPHostCache(
        heads,
        rank,
        layers=case.shape.layers,
        head_bytes=case.head_bytes,
        block_size=case.block_size,
        num_blocks=bc.num_blocks_for(case.base),
    )
    first = next(iter(cache.buffers.values()))
    size = first.nbytes
    pool = np.zeros(size * len(cache.buffers), dtype=np.uint8)
    for k, key in enumerate(list(cache.buffers)):
        cache.buffers[key] = pool[k * size : (k + 1) * size].reshape(first.shape)
    if producer:
        every = np.arange(cache.num_blocks)
        for (layer, part), buf in cache.buffers.items():
            for i, h in enumerate(cache.held):
                buf[:, i] = cache.pattern(FILL_SEED, layer, part, h, every)
    else:
        pool.fill(0)  # touch every page: no first-touch faults in the timings
    return cache, pool


class TPRankProc:
    """The commands of one TP rank's bench process."""

    def __init__(self, conn: Connection, raw: RawNixl) -> None:
        self.conn, self.raw = conn, raw
        self.case: TPCase | None = None
        self.producer = False
        self.rank = 0
        self.cache: Any = None
        self.agent: Any = None
        self.before: Any = None  # the agent's stats as its last hold began
        self.reg: Any = None
        self.memcpy: MemcpyBench | DeviceMemcpy | None = None
        self.on_device: DevicePool | None = None  # --device: the cache's copy there
        self.planner: Any = None
        self.dlists: tuple[Any, dict[int, Any]] | None = None
        self.raw_peers: dict[int, str] = {}
        self.blocks_mine: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self.blocks_theirs: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)

    # -- set-up -----------------------------------------------------------------------
    def cmd_cache(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Build the rank's cache and register it with raw NIXL."""
        self.case = case = msgspec.convert(payload["case"], TPCase)
        self.producer, self.rank = payload["role"] == "producer", int(payload["rank"])
        self.cache, pool = _tp_cache(case, self.producer, self.rank)
        self.on_device = None
        if payload.get("device") is not None:
            # Built and filled on the host as without a device, then moved there once.
            self.on_device = DevicePool(pool, str(payload["device"]))
        self.reg = self.raw.register(self.layout())
        mine, theirs = ("remote", "local") if self.producer else ("local", "remote")
        self.blocks_mine = bc.case_blocks(case.base, mine)
        self.blocks_theirs = bc.case_blocks(case.base, theirs)
        if not self.producer:
            nbytes = min(int(payload["nbytes"]), bc.MEMCPY_SCRATCH)
            if self.on_device is not None:
                self.memcpy = DeviceMemcpy([self.on_device.tensor], nbytes)
            else:
                regions = [
                    b.reshape(b.shape[0], -1).view(np.uint16) for b in self.cache.buffers.values()
                ]
                self.memcpy = MemcpyBench(regions, nbytes)
        return {"layout": msgspec.to_builtins(self.layout()), "raw": self.raw.metadata()}

    def layout(self) -> Any:
        """The rank's layout as the vLLM adapter describes it by default (on the
        device copy with ``--device``)."""
        assert self.case is not None
        layout = self.cache.layout(per_head=self.case.per_head(self.producer))
        return layout if self.on_device is None else self.on_device.rebase(layout)

    def cmd_agent(self, payload: dict[str, Any]) -> dict[str, Any]:
        """An Agent of ``direction`` with this rank's TP identity, serving at ``port``
        (0: any)."""
        from kvxfer.agent import Agent, AgentConfig
        from kvxfer.core.compat import Fingerprint
        from kvxfer.core.heads import TPRank
        from kvxfer.types import Direction, Role

        assert self.case is not None
        self._close_agent()
        heads = self.case.prefill_heads if self.producer else self.case.decode_heads
        direction, port = Direction(payload["direction"]), int(payload["port"])
        agent = Agent(
            AgentConfig(
                engine_id=PREFILL_ENGINE if self.producer else "bench-tp-decode",
                fingerprint=Fingerprint(
                    model=f"bench/{self.case.model}",
                    dtype="bfloat16",
                    kv_cache_dtype="bfloat16",
                    attention_backend="bench",
                    direction=direction,
                ),
                role=Role.PRODUCER if self.producer else Role.CONSUMER,
                direction=direction,
                backend=self.case.backend,
                side_channel_host="127.0.0.1",
                side_channel_port=port,
                lease_s=300.0,
                transfer_timeout_s=300.0,
                auth_secret=_SECRET,
                tp=TPRank(heads=heads, rank=self.rank),
            )
        )
        self.agent = agent
        agent.register(self.layout())
        host, bound = agent.serve()
        return {
            "host": host,
            "port": bound,
            "incarnation": agent.incarnation,
            "engine_id": agent.config.engine_id,
        }

    def _close_agent(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None

    def cmd_peers(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Decode rank: the producer ranks' raw peers; for a pull also one timed
        handshake per rank, the tables and planner kvxfer builds, and raw NIXL's
        prepared lists of them."""
        from kvxfer.core.descriptors import DescriptorTable, PlanOptions
        from kvxfer.core.heads import heads_per_region, pairing_heads, split_heads
        from kvxfer.core.layout import KVLayout
        from kvxfer.core.tp_plan import TPPlanner

        case = self.case
        assert case is not None and self.agent is not None
        opts = PlanOptions()
        # Cut as the agent cuts (kvxfer._agent.peers, kvxfer._agent.local): the producer ranks'
        # layouts to what this rank posts at, this rank's to one head if it must be.
        mine = self.layout()
        own = heads_per_region(mine, case.decode_heads, self.rank)
        remotes: dict[int, Any] = {}
        remote_dlists: dict[int, Any] = {}
        handshake: dict[str, float] = {}
        per = own
        for key, prod in payload["producers"].items():
            p = int(key)
            self.raw_peers[p] = self.raw.add_peer(prod["raw"])
            if case.direction == "push":
                # The prefill ranks handshake with this rank, plan and post (cmd_writer).
                continue
            t0 = time.perf_counter()
            self.agent.connect(prod["host"], prod["port"], PREFILL_ENGINE)
            handshake[key] = time.perf_counter() - t0
            theirs = msgspec.convert(prod["layout"], KVLayout)
            per = pairing_heads(own, heads_per_region(theirs, case.prefill_heads, p))
            remotes[p] = DescriptorTable.build(
                split_heads(theirs, case.prefill_heads, p, per), opts
            )
            remote_dlists[p] = self.raw.prep(self.raw_peers[p], remotes[p])
        if case.direction == "pull":
            local = DescriptorTable.build(
                split_heads(mine, case.decode_heads, self.rank, per), opts
            )
            self.planner = TPPlanner.build(
                local,
                remotes,
                local_heads=case.decode_heads,
                remote_heads=case.prefill_heads,
                local_rank=self.rank,
            )
            self.dlists = (self.raw.prep(None, local), remote_dlists)
        return {"handshake_s": handshake}

    # -- prefill ranks ----------------------------------------------------------------
    def cmd_hold(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Hold the request under the group's shared capability (and, for a pull,
        guard word). A push holds once the decode rank's registration is here (it
        opens the lease), as a real prefill finds it after computing the prompt, and
        returns at once: the write runs on the agent's writer."""
        assert self.case is not None
        if self.case.direction == "push":
            self.cmd_registered(payload)
        guard = tuple(payload["guard"]) if payload.get("guard") else None
        self.before = self.agent.stats()
        t0 = time.perf_counter()
        ticket = self.agent.hold(
            payload["rid"],
            self.blocks_mine,
            self.case.tokens,
            capability=payload["capability"],
            guard=guard,
        )
        t1 = time.perf_counter()
        return {"ticket": msgspec.to_builtins(ticket), "t0": t0, "hold_s": t1 - t0}

    def cmd_registered(self, payload: dict[str, Any]) -> bool:
        """Push: wait until the decode rank's registration of ``rid`` is here."""
        deadline = time.monotonic() + 60
        while payload["rid"] not in self.agent.holding():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the decode rank never registered {payload['rid']}")
            time.sleep(0.0005)
        return True

    def cmd_freed(self, payload: dict[str, Any]) -> bool:
        """Wait until the request is freed. ``release``: other decode ranks read this
        rank too and the bench runs one of them, so the bench releases their share."""
        if payload["release"]:
            self.agent.release(payload["rid"])
        deadline = time.monotonic() + 30
        while payload["rid"] not in self.agent.freed():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    # -- decode rank ------------------------------------------------------------------
    def zero(self) -> None:
        if self.on_device is not None:
            self.on_device.zero_blocks(
                len(self.cache.buffers), self.cache.num_blocks, self.blocks_mine
            )
            return
        for buf in self.cache.buffers.values():
            buf[self.blocks_mine] = 0

    def mismatches(self) -> int:
        """Wrong (layer, K/V, head, block, token) rows in the landed blocks (0: exact)."""
        if self.on_device is not None:
            self.on_device.download()  # the host buffers then hold what landed
        bad = 0
        for (layer, part), buf in self.cache.buffers.items():
            for i, h in enumerate(self.cache.held):
                want = self.cache.pattern(FILL_SEED, layer, part, h, self.blocks_theirs)
                bad += int(np.count_nonzero((buf[self.blocks_mine, i] != want).any(axis=2)))
        return bad

    def cmd_pull(self, payload: dict[str, Any]) -> dict[str, Any]:
        from kvxfer.agent import Ticket

        if payload["verify"]:
            self.zero()
        ticket = msgspec.convert(payload["ticket"], Ticket)
        t0 = time.perf_counter()
        transfer = self.agent.pull(ticket, self.blocks_mine)
        transfer.wait(300)
        s = time.perf_counter() - t0
        stats = transfer.stats
        return {
            "s": s,
            "bytes": stats.bytes,
            "descriptors": stats.descriptors,
            "bad": self.mismatches() if payload["verify"] else None,
            "handshakes": self.agent.stats().handshakes,
        }

    def cmd_raw_read(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Raw NIXL on identical descriptors, one READ per producer rank, the planner's
        output computed on the clock (as a NIXL user must per request): its ids on
        the prepared lists (what kvxfer posts), or with ``runs`` its merged address
        runs as per-request lists (``initialize_xfer``)."""
        assert self.case is not None and self.dlists is not None
        if payload["verify"]:
            self.zero()
        local, remotes = self.dlists
        t0 = time.perf_counter()
        plans = self.planner.plan([self.blocks_mine], [self.blocks_theirs], self.case.tokens)
        if payload.get("runs"):
            merged = [(rp.runs(), self.raw_peers[rp.rank]) for rp in plans]
            self.raw.xfer_runs_many("READ", merged, DONE_NOTICE, 300)
        else:
            posts = [
                (
                    local,
                    rp.plan.local_ids.astype(np.int32),
                    remotes[rp.rank],
                    rp.plan.remote_ids.astype(np.int32),
                )
                for rp in plans
            ]
            self.raw.xfer_many("READ", posts, DONE_NOTICE, 300)
        s = time.perf_counter() - t0
        return {
            "s": s,
            **self.counts(plans),
            "bad": self.mismatches() if payload["verify"] else None,
        }

    def counts(self, plans: Any, *, pushed: bool = False) -> dict[str, Any]:
        """Bytes, descriptors, units and runs of one request's rank plans (planned as
        the decode rank reads; ``pushed``: this is a prefill rank, its blocks the
        remote side of the plans)."""
        mine, theirs = self.blocks_mine, self.blocks_theirs
        posted, nixl_units = self._units(plans, *((theirs, mine) if pushed else (mine, theirs)))
        return {
            "bytes": sum(rp.plan.nbytes for rp in plans),
            "descriptors": sum(rp.plan.num_descriptors for rp in plans),
            "units_posted": posted,
            "nixl_units": nixl_units,
            "descriptors_per_rank": {str(rp.rank): rp.plan.num_descriptors for rp in plans},
            "runs": sum(len(rp.runs()) for rp in plans),
        }

    def _units(self, plans: Any, local_blocks: Any, remote_blocks: Any) -> tuple[int, int]:
        """Transfer units of the plans as kvxfer's NIXL backend posts them (rows of chain
        lists where the planner has them, :mod:`kvxfer.core.block_lists`; else per-request
        runs or prepared ids, :func:`kvxfer.core.merging.posted_units`), and as NIXL
        merges the prepared ids alone. ``local_blocks`` and ``remote_blocks`` are the
        plans' sides' (the decode rank's, the prefill rank's)."""
        from kvxfer.core.merging import joins, posted_units, transport_units

        local = self.planner.local
        posted = nixl_units = 0
        for rp in plans:
            remote = self.planner.remotes[rp.rank]
            lid, rid = rp.plan.local_ids, rp.plan.remote_ids
            joined = joins(
                local.addr[lid],
                remote.addr[rid],
                local.length[lid],
                local.device[lid],
                remote.device[rid],
            )
            nixl_units += transport_units(joined, lid, rid)
            lists = self.planner.chain_lists(rp.rank)
            if lists is None:
                posted += posted_units(joined, lid, rid)[0]
                continue
            # The agent posts rows of its chain lists (kvxfer.core.block_lists): NIXL
            # merges consecutive rows that continue on both sides.
            cp = lists.plan((local_blocks,), (remote_blocks,), rp.plan.num_tokens)
            rows = joins(
                lists.local[cp.local_ids, 0],
                lists.remote[cp.remote_ids, 0],
                lists.local[cp.local_ids, 1],
            )
            posted += transport_units(rows, cp.local_ids, cp.remote_ids)
        return posted, nixl_units

    def cmd_memcpy(self, nbytes: int) -> float:
        assert self.memcpy is not None
        return self.memcpy.run(nbytes)

    def close(self) -> None:
        """Drop the agent, raw lists and registration."""
        if self.dlists is not None:
            self.raw.release(self.dlists[0])
            for d in self.dlists[1].values():
                self.raw.release(d)
            self.dlists = None
        self._close_agent()
        if self.reg is not None:
            self.raw.deregister(self.reg)
            self.reg = None
        if self.memcpy is not None:
            self.memcpy.close()
            self.memcpy = None
