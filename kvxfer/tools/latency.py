"""Small-request pull latency: kvxfer against raw NIXL and an in-process gather.

Engines pull many small prefixes, where latency, not bandwidth, is the cost. For each
request size (1 to 64 blocks by default) this measures, between two real processes on
this host over NIXL's UCX plugin:

- **kvxfer**: ``Agent.pull(ticket, blocks)`` until ``Transfer.poll()`` says DONE (the
  producer has ``hold()``-ed the blocks; the ticket's trip is not timed), and when
  ``pull()`` returned;
- **raw NIXL**: a bare ``nixl_agent`` per process registering the very same memory,
  with descriptor lists prepared from the same :class:`DescriptorTable` and the same
  index arrays :func:`build_plan` gives kvxfer: ``make_prepped_xfer`` + ``transfer``,
  busy-polled to DONE, carrying a notification of the same size as kvxfer's DONE
  notice (as kvxfer's read does);
- **raw NIXL, no notification**: the same read without one, the transport's floor.
  Each raw variant has its own pair of NIXL agents (its own endpoint): on UCX, after a
  notification went out, the next transfer on that endpoint completes only once the
  *producer's* worker has progressed (the raw producer agents progress every
  ``raw_passive_poll_s``; kvxfer's producer every 1 ms while it holds leases), which
  a read without notifications never waits for;
- **gather**: the same blocks copied inside one process (numpy fancy indexing, one
  array per region): the floor without any transport.

The three run interleaved, rep by rep, so that host noise lands on all of them. The
first rep of each size is not timed: it zeroes the receiving blocks and checks the bytes
that landed against the producer's seeded pattern (a failed check raises).

    python -m kvxfer.tools.latency [--blocks 1 2 4 8 16 32 64] [--reps 200] [--json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.types import Direction, Role

__all__ = [
    "LatencyRow",
    "LatencySpec",
    "check_landed",
    "empty_regions",
    "format_rows",
    "main",
    "measure_latency",
    "pattern",
]

DEFAULT_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
_RAW_KEYS = ("raw", "bare")  # raw NIXL with kvxfer's notification, and without


class LatencySpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to measure.

    Attributes:
        blocks: request sizes in blocks.
        reps: timed repetitions per size and method.
        layers: model layers (each a K and a V region).
        block_size: tokens per block.
        token_bytes: bytes of one token in one region (kv_heads x head_dim x dtype).
        backend: kvxfer backend (``ucx``; raw NIXL always uses UCX).
        raw_passive_poll_s: how often the producer's raw NIXL agent progresses
            (0: spins). kvxfer's producer progresses every 1 ms while it holds leases.
        gap_s: idle time before each rep (untimed): 0 is a burst of back-to-back
            requests; a few ms lets the producer progress between them.
        seed: pattern and block-choice seed.
    """

    blocks: tuple[int, ...] = DEFAULT_BLOCKS
    reps: int = 200
    layers: int = 2
    block_size: int = 16
    token_bytes: int = 256
    backend: str = "ucx"
    raw_passive_poll_s: float = 0.001
    gap_s: float = 0.0
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return 2 * max(self.blocks) + 8

    @property
    def block_len(self) -> int:
        return self.block_size * self.token_bytes


class LatencyRow(msgspec.Struct, kw_only=True):
    """One request size; times in microseconds (median, 10th and 90th percentile)."""

    blocks: int
    bytes: int
    descriptors: int
    kvxfer_us: tuple[float, float, float]
    pull_return_us: tuple[float, float, float]
    post_us: tuple[float, float, float]
    raw_nixl_us: tuple[float, float, float]
    raw_bare_us: tuple[float, float, float]
    gather_us: tuple[float, float, float]

    @property
    def overhead_us(self) -> float:
        """kvxfer's median minus raw NIXL's."""
        return self.kvxfer_us[0] - self.raw_nixl_us[0]


def empty_regions(spec: LatencySpec) -> list[npt.NDArray[np.uint8]]:
    """One zeroed ``(num_blocks, block_len)`` array per region (K and V per layer)."""
    return [np.zeros((spec.num_blocks, spec.block_len), np.uint8) for _ in range(2 * spec.layers)]


def pattern(spec: LatencySpec, region: int) -> npt.NDArray[np.uint8]:
    """The producer's seeded bytes of ``region`` (the consumer recomputes them)."""
    rng = np.random.default_rng([spec.seed, region])
    return rng.integers(0, 256, (spec.num_blocks, spec.block_len), dtype=np.uint8)


def _layout(spec: LatencySpec, regions: Sequence[npt.NDArray[np.uint8]]) -> Any:
    from kvxfer.core.layout import KVLayout, KVPart, Region

    return KVLayout(
        block_size=spec.block_size,
        regions=tuple(
            Region(
                base=a.ctypes.data,
                num_blocks=spec.num_blocks,
                stride=a.strides[0],
                block_len=spec.block_len,
                layer=i // 2,
                part=KVPart.K if i % 2 == 0 else KVPart.V,
            )
            for i, a in enumerate(regions)
        ),
    )


def _agent(spec: LatencySpec, engine_id: str, role: Role, layout: Any) -> Any:
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.core.compat import Fingerprint

    fingerprint = Fingerprint(
        model="latency/synthetic",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="none",
        direction=Direction.PULL,
    )
    agent = Agent(
        AgentConfig(engine_id=engine_id, fingerprint=fingerprint, role=role, backend=spec.backend)
    )
    agent.register(layout)
    return agent


class _RawNixl:
    """A bare NIXL agent (UCX) on the same memory, polled by a thread when passive."""

    def __init__(self, name: str, layout: Any, poll_s: float | None) -> None:
        from kvxfer.backends.ucx import import_nixl
        from kvxfer.core.descriptors import DescriptorTable

        nixl_agent, nixl_agent_config = import_nixl()

        conf = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        self.agent: Any = nixl_agent(name, conf)
        spans = sorted((r.base, r.end) for r in layout.regions)
        self.agent.register_memory([(s, e - s, 0, "") for s, e in spans], "DRAM", ["UCX"])
        self.table = DescriptorTable.build(layout)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.rows(self.table), "DRAM")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._peer = ""
        self._remote: Any = None
        if poll_s is not None:
            self._thread = threading.Thread(target=self._poll, args=(poll_s,), daemon=True)
            self._thread.start()

    @staticmethod
    def rows(table: Any) -> npt.NDArray[np.uint64]:
        rows = np.stack([table.addr, table.length, table.device.astype(np.uint64)], axis=1)
        return np.ascontiguousarray(rows, dtype=np.uint64)

    def _poll(self, interval: float) -> None:
        # The passive side's worker must progress for the reader's request to complete
        # (and its notification to arrive), as kvxfer's progress thread does.
        while not self._stop.is_set():
            with self._lock:
                self.agent.get_new_notifs()
            if interval:
                time.sleep(interval)

    def connect(self, metadata: bytes, remote_table: Any) -> Any:
        """Add the peer; returns its prepared descriptor list of ``remote_table``."""
        name = self.agent.add_remote_agent(metadata)
        self._peer = name.decode() if isinstance(name, bytes) else str(name)
        self._remote = self.agent.prep_xfer_dlist(self._peer, self.rows(remote_table), "DRAM")
        return self._remote

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._remote is not None:
            self._remote.release()
            self.agent.remove_remote_agent(self._peer)
            self._remote = None


# -- the producer process ------------------------------------------------------------
def _producer(conn: Connection, spec_bytes: bytes) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=LatencySpec)
    regions = empty_regions(spec)
    for i, a in enumerate(regions):
        a[:] = pattern(spec, i)
    layout = _layout(spec, regions)
    agent = _agent(spec, "latency-prefill", Role.PRODUCER, layout)
    host, port = agent.serve()
    raws = [
        _RawNixl(f"latency-raw-prefill-{key}", layout, spec.raw_passive_poll_s) for key in _RAW_KEYS
    ]
    metas = [raw.agent.get_agent_metadata() for raw in raws]
    conn.send((host, port, metas, msgspec.msgpack.encode(layout)))
    try:
        while True:
            # An engine between prefill steps: it frees what was pulled now and then.
            if not conn.poll(0.01):
                agent.freed()
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            _, request_id, blocks, tokens = cmd
            ticket = agent.hold(request_id, blocks, num_tokens=tokens)
            conn.send_bytes(msgspec.msgpack.encode(ticket))
    finally:
        for raw in raws:
            raw.close()
        agent.close()


# -- the consumer (measuring) side ------------------------------------------------------
def _stats(samples: Sequence[float]) -> tuple[float, float, float]:
    us = np.asarray(samples) * 1e6
    return (
        round(float(np.median(us)), 1),
        round(float(np.percentile(us, 10)), 1),
        round(float(np.percentile(us, 90)), 1),
    )


def check_landed(
    spec: LatencySpec,
    regions: Sequence[npt.NDArray[np.uint8]],
    local: npt.NDArray[np.int64],
    remote: npt.NDArray[np.int64],
    what: str,
) -> None:
    """Raise unless ``regions[local]`` holds the producer's ``remote`` blocks.

    Raises:
        RuntimeError: naming ``what`` moved them and the first region that differs.
    """
    for i, a in enumerate(regions):
        if not np.array_equal(a[local], pattern(spec, i)[remote]):
            raise RuntimeError(f"{what}: region {i} does not hold the producer's blocks")


def _raw_read(
    raw: _RawNixl,
    local_ids: npt.NDArray[np.int32],
    remote_dl: Any,
    remote_ids: npt.NDArray[np.int32],
    notif: bytes,
) -> float:
    """One raw NIXL read, busy-polled to DONE; returns its seconds."""
    t0 = time.perf_counter()
    xfer = raw.agent.make_prepped_xfer("READ", raw.local, local_ids, remote_dl, remote_ids, notif)
    state = raw.agent.transfer(xfer)
    while state == "PROC":
        state = raw.agent.check_xfer_state(xfer)
    seconds = time.perf_counter() - t0
    xfer.release()
    if state != "DONE":
        raise RuntimeError(f"raw NIXL read of {len(local_ids)} descriptors ended {state}")
    return seconds


def measure_latency(spec: LatencySpec | None = None) -> list[LatencyRow]:
    """Run the producer in a child process and measure every size of ``spec``.

    Raises:
        RuntimeError: bytes that landed differ from the producer's, or a raw NIXL
            transfer did not complete.
    """
    from kvxfer.agent import Ticket
    from kvxfer.core.descriptors import build_plan
    from kvxfer.core.layout import KVLayout
    from kvxfer.transfer import TransferState

    spec = spec or LatencySpec()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(
        target=_producer, args=(child_conn, msgspec.msgpack.encode(spec)), daemon=True
    )
    child.start()
    regions = empty_regions(spec)
    sources = [pattern(spec, i) for i in range(len(regions))]  # for the in-process gather
    gathered = empty_regions(spec)
    layout = _layout(spec, regions)
    agent = _agent(spec, "latency-decode", Role.CONSUMER, layout)
    raws = {key: _RawNixl(f"latency-raw-decode-{key}", layout, None) for key in _RAW_KEYS}
    rows: list[LatencyRow] = []
    try:
        if not conn.poll(120):
            raise RuntimeError("the producer process did not start")
        _host, _port, metas, remote_layout_bytes = conn.recv()
        remote_layout = msgspec.msgpack.decode(remote_layout_bytes, type=KVLayout)
        from kvxfer.core.descriptors import DescriptorTable

        remote_table = DescriptorTable.build(remote_layout)
        remote_dls = {
            key: raws[key].connect(meta, remote_table) for key, meta in zip(_RAW_KEYS, metas)
        }
        rng = np.random.default_rng(spec.seed)
        serial = 0
        for n in spec.blocks:
            local = rng.permutation(spec.num_blocks)[:n].astype(np.int64)
            remote = rng.permutation(spec.num_blocks)[:n].astype(np.int64)
            tokens = n * spec.block_size
            plan = build_plan(raws["raw"].table, remote_table, local, remote, tokens)
            local_ids = np.ascontiguousarray(plan.local_ids, dtype=np.int32)
            remote_ids = np.ascontiguousarray(plan.remote_ids, dtype=np.int32)
            times: dict[str, list[float]] = {
                k: [] for k in ("kv", "ret", "post", "raw", "bare", "ga")
            }
            notif = b""
            for rep in range(spec.reps + 1):
                check = rep == 0
                if spec.gap_s:
                    time.sleep(spec.gap_s)
                # -- kvxfer: hold on the producer (untimed), then pull to DONE
                serial += 1
                conn.send(("hold", f"lat-{serial}", remote.tolist(), tokens))
                ticket = msgspec.msgpack.decode(conn.recv_bytes(), type=Ticket)
                if check:
                    for a in regions:
                        a[local] = 0
                t0 = time.perf_counter()
                transfer = agent.pull(ticket, local)
                t1 = time.perf_counter()
                while transfer.poll() is TransferState.PENDING:
                    pass
                t2 = time.perf_counter()
                if transfer.state is not TransferState.DONE:
                    raise RuntimeError(f"kvxfer pull of {n} blocks failed: {transfer.error}")
                if check:
                    check_landed(spec, regions, local, remote, "kvxfer")
                    notif = b"n" * 64  # about the size of kvxfer's DONE notice
                else:
                    times["kv"].append(t2 - t0)
                    times["ret"].append(t1 - t0)
                    times["post"].append(transfer.stats.post_s)
                # -- raw NIXL on the same descriptors and index arrays
                for key, note in (("raw", notif), ("bare", b"")):
                    if check:
                        for a in regions:
                            a[local] = 0
                    seconds = _raw_read(raws[key], local_ids, remote_dls[key], remote_ids, note)
                    if check:
                        check_landed(spec, regions, local, remote, f"raw NIXL ({key})")
                    else:
                        times[key].append(seconds)
                # -- the same blocks gathered inside this process
                t0 = time.perf_counter()
                for dst, src in zip(gathered, sources):
                    dst[local] = src[remote]
                t2 = time.perf_counter()
                if check:
                    check_landed(spec, gathered, local, remote, "gather")
                else:
                    times["ga"].append(t2 - t0)
            rows.append(
                LatencyRow(
                    blocks=n,
                    bytes=plan.nbytes,
                    descriptors=plan.num_descriptors,
                    kvxfer_us=_stats(times["kv"]),
                    pull_return_us=_stats(times["ret"]),
                    post_us=_stats(times["post"]),
                    raw_nixl_us=_stats(times["raw"]),
                    raw_bare_us=_stats(times["bare"]),
                    gather_us=_stats(times["ga"]),
                )
            )
    finally:
        conn.send(("stop",))
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        for raw in raws.values():
            raw.close()
        agent.close()
    return rows


def format_rows(rows: Sequence[LatencyRow]) -> str:
    """A plain-text table: medians (p10-p90) in microseconds."""

    def cell(v: tuple[float, float, float]) -> str:
        return f"{v[0]:8.0f} ({v[1]:.0f}-{v[2]:.0f})"

    head = (
        f"{'blocks':>6} {'KiB':>6} {'descs':>5}  {'kvxfer pull->done':>22}  "
        f"{'pull() returns':>20}  {'raw NIXL':>20}  {'raw, no notif':>20}  {'gather':>18}  "
        f"{'kvxfer-raw':>10}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.blocks:>6} {r.bytes / 1024:>6.0f} {r.descriptors:>5}  {cell(r.kvxfer_us):>22}  "
            f"{cell(r.pull_return_us):>20}  {cell(r.raw_nixl_us):>20}  {cell(r.raw_bare_us):>20}  "
            f"{cell(r.gather_us):>18}  {r.overhead_us:>10.0f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvxfer.tools.latency``: print the small-request latency table."""
    parser = argparse.ArgumentParser(prog="python -m kvxfer.tools.latency", description=__doc__)
    parser.add_argument("--blocks", type=int, nargs="+", default=list(DEFAULT_BLOCKS))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--token-bytes", type=int, default=256)
    parser.add_argument("--backend", default="ucx")
    parser.add_argument(
        "--raw-passive-poll-ms",
        type=float,
        default=1.0,
        help="raw NIXL producer's progress interval (kvxfer's lease tick is 1 ms; 0 spins)",
    )
    parser.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle time before each rep (0: back to back)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    args = parser.parse_args(argv)
    for key in ("reps", "layers", "block_size", "token_bytes"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.blocks):
        parser.error("--blocks must be >= 1")
    spec = LatencySpec(
        blocks=tuple(args.blocks),
        reps=args.reps,
        layers=args.layers,
        block_size=args.block_size,
        token_bytes=args.token_bytes,
        backend=args.backend,
        raw_passive_poll_s=args.raw_passive_poll_ms / 1e3,
        gap_s=args.gap_ms / 1e3,
    )
    rows = measure_latency(spec)
    if args.json:
        for row in rows:
            print(msgspec.json.encode(row).decode())
    else:
        print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
