"""The Agent's value types: its configuration, the ticket, counters and leases.

Kept apart from :mod:`kvxfer.agent` so the runtime modules can share them without
importing the Agent; :mod:`kvxfer.agent` re-exports the public ones.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer import wire
from kvxfer.compat import Fingerprint
from kvxfer.descriptors import PlanOptions
from kvxfer.errors import ConfigError
from kvxfer.transfer import Transfer
from kvxfer.types import Direction, Role

__all__ = [
    "AgentConfig",
    "AgentStats",
    "BlockIds",
    "Lease",
    "PushPost",
    "Ticket",
    "as_groups",
    "describe_blocks",
    "id_arrays",
]

BlockIds = Sequence[int] | npt.NDArray[np.integer[Any]] | Sequence[Sequence[int]]


class PushPost(enum.Enum):
    """Which thread posts a push producer's writes (:attr:`AgentConfig.push_post`)."""

    AUTO = "auto"
    """ENGINE on backends that move engine memory directly, WRITER on staging ones
    (host bounce), whose post also copies the blocks out on the CPU."""
    ENGINE = "engine"
    """The caller of :meth:`~kvxfer.agent.Agent.hold` (or ``stream``) posts the write
    itself when the consumer is already connected and no earlier write is queued; the
    first write to a consumer (a handshake) still goes to the writer thread. No thread
    hand-off on the write's path, and no waiting for the GIL behind an engine thread
    that keeps running Python (a background thread waits up to the interpreter's switch
    interval, 5 ms, at each step). The cost: a transport that copies inside its post
    (UCX over CMA on one host) copies on the caller's thread, as a pull's read does."""
    WRITER = "writer"
    """Every write goes to the agent's writer thread; hold() only queues it."""


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything an :class:`Agent` needs; build it directly or from a vLLM config.

    Attributes:
        engine_id: This instance's id; consumers check it against the one they expect.
        fingerprint: Model/dtype/backend identity folded into the compatibility hash.
        role: Producer, consumer or both.
        direction: Pull (consumer reads) or push (producer writes).
        backend: Backend name from the ``kvxfer.backends`` registry.
        side_channel_host: Address peers reach this instance at (must be routable).
        side_channel_port: Side-channel TCP port; 0 picks a free one.
        plan: Descriptor options (chunk_mode, swa_window_mode, coalescing).
        push_stream: Push blocks as prefill closes them (push + device-to-device only).
        enforce_handshake_compat: False skips the hash check (never the layout check).
        lease_s: How long a producer holds a request's blocks for its consumer.
        handshake_timeout_s: One side-channel try's receive timeout.
        handshake_retries: Further tries after a timeout (with backoff).
        transfer_timeout_s: A transfer not complete by then fails.
        max_message_bytes: Largest side-channel frame accepted.
        auth_secret: Shared secret authenticating the side channel (None: off, warned).
        rails: RDMA devices the data plane may use; stripe_width: see R-RAIL-3.
        backend_extra: Backend-specific options (``BackendOptions.extra``), e.g.
            ``{"rbln_adapter": "emulated"}`` or ``{"transport": "ucx"}``.
        lease_guard_s: A consumer refuses (or invalidates) a pull this close to the
            producer's lease expiry: clock skew between hosts must stay below it.
        progress_interval_s: Sleep of the progress thread while transfers are in flight.
        push_post: Which thread posts a push producer's writes (see :class:`PushPost`).
    """

    engine_id: str
    fingerprint: Fingerprint
    role: Role = Role.BOTH
    direction: Direction = Direction.PULL
    backend: str = "ucx"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    plan: PlanOptions = msgspec.field(default_factory=PlanOptions)
    push_stream: bool = False
    enforce_handshake_compat: bool = True
    lease_s: float = 30.0
    handshake_timeout_s: float = 5.0
    handshake_retries: int = 2
    transfer_timeout_s: float = 30.0
    max_message_bytes: int = 1 << 20
    auth_secret: str | None = None
    rails: tuple[str, ...] = ()
    stripe_width: int | None = None
    progress_interval_s: float = 0.0002
    lease_guard_s: float = 0.5
    backend_extra: dict[str, str] = msgspec.field(default_factory=dict)
    push_post: PushPost = PushPost.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.push_post, PushPost):
            raise ConfigError(
                "push_post",
                self.push_post,
                "must be a PushPost: " + ", ".join(repr(p.value) for p in PushPost),
            )
        if not self.engine_id:
            raise ConfigError("engine_id", self.engine_id, "must be a non-empty string")
        for key in ("lease_s", "handshake_timeout_s", "transfer_timeout_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(key, value, "must be a positive number of seconds")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError("side_channel_port", self.side_channel_port, "must be 0..65535")
        if self.push_stream and self.direction is not Direction.PUSH:
            raise ConfigError("push_stream", True, "only valid with the push direction")


class Ticket(msgspec.Struct, frozen=True, kw_only=True):
    """What a producer hands the router for the consumer: where and what to fetch.

    Maps one-to-one onto upstream vLLM's ``kv_transfer_params`` keys (so existing
    routers forward it untouched) plus kvxfer's own ``remote_incarnation``,
    ``remote_num_tokens`` and ``lease_expiry``.
    """

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    incarnation: int = 0
    lease_expiry: float = 0.0
    tp_size: int = 1

    def to_kv_transfer_params(self) -> dict[str, Any]:
        """The upstream ``kv_transfer_params`` dict (decode side of a pull)."""
        blocks: Any = (
            list(self.block_ids[0])
            if len(self.block_ids) == 1
            else [list(g) for g in self.block_ids]
        )
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": self.request_id,
            "remote_block_ids": blocks,
            "tp_size": self.tp_size,
            "remote_incarnation": self.incarnation,
            "remote_num_tokens": self.num_tokens,
            "lease_expiry": self.lease_expiry,
        }

    @classmethod
    def from_kv_transfer_params(cls, params: dict[str, Any], num_tokens: int = 0) -> Ticket:
        """Read a ticket back from ``kv_transfer_params``; missing keys raise ConfigError."""
        for key in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids"):
            if key not in params or params[key] is None:
                raise ConfigError(
                    f"kv_transfer_params.{key}", None, "is required for a remote prefill"
                )
        raw = params["remote_block_ids"]
        groups = (
            tuple(tuple(int(b) for b in g) for g in raw)
            if raw and isinstance(raw[0], (list, tuple))
            else (tuple(int(b) for b in raw),)
        )
        return cls(
            engine_id=str(params["remote_engine_id"]),
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            request_id=str(params.get("remote_request_id") or ""),
            block_ids=groups,
            num_tokens=int(params.get("remote_num_tokens") or num_tokens),
            incarnation=int(params.get("remote_incarnation") or 0),
            lease_expiry=float(params.get("lease_expiry") or 0.0),
            tp_size=int(params.get("tp_size") or 1),
        )


class AgentStats(msgspec.Struct, kw_only=True):
    """Counters an engine exports as metrics (monotonic since start)."""

    transfers_done: int = 0
    transfers_failed: int = 0
    bytes_moved: int = 0
    descriptors_posted: int = 0
    transfer_s_total: float = 0.0
    post_s_total: float = 0.0
    handshakes: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_aborted: int = 0
    failures: dict[str, int] = msgspec.field(default_factory=dict)


class Lease(msgspec.Struct, kw_only=True):
    """A producer's hold on a request's blocks (R-XFER-4)."""

    request_id: str
    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int
    expiry: float
    # push: where to write, once the consumer registered its blocks
    target: wire.PushRegister | None = None
    ready: bool = False  # prefill finished (hold() called), for push
    pushed_blocks: int = 0  # push_stream: leading blocks already written
    parts_posted: int = 0
    final_posted: bool = False
    writes: list[Transfer] = msgspec.field(default_factory=list)
    final_notice: tuple[float, bytes] | None = None  # push: encoded at registration


def as_groups(blocks: BlockIds, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """Normalise block ids to one tuple per KV group (one flat list serves every group)."""
    arr = blocks if isinstance(blocks, np.ndarray) else None
    if arr is None:
        seq: list[Any] = list(blocks)
        if seq and isinstance(seq[0], list | tuple | np.ndarray):
            groups = tuple(tuple(int(b) for b in g) for g in seq)
            if len(groups) != num_groups:
                raise ConfigError(
                    "block_ids", len(groups), f"needs one block list per KV group ({num_groups})"
                )
            return groups
        arr = np.asarray(seq, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ConfigError("block_ids", str(arr.dtype), "must be integer block ids")
    # tolist() converts in C: a generator over numpy scalars costs ~1 µs per block.
    if arr.ndim == 2:
        return tuple(tuple(row) for row in arr.tolist())
    one = tuple(arr.tolist())
    return (one,) * num_groups


def id_arrays(groups: tuple[tuple[int, ...], ...]) -> npt.NDArray[np.int64] | list[Any]:
    """Block ids as build_plan takes them fastest: one int64 array for one group."""
    if len(groups) == 1:
        return np.array(groups[0], dtype=np.int64)
    first = groups[0]
    if all(g == first for g in groups):
        # One list for every group (as engines pass it): one array, shared, which
        # build_plan turns into ids for all groups with a single broadcast.
        return [np.array(first, dtype=np.int64)] * len(groups)
    return [np.array(g, dtype=np.int64) for g in groups]


def describe_blocks(blocks: tuple[int, ...]) -> str:
    """A log-sized summary of a block list."""
    if len(blocks) <= 8:
        return f"invalid blocks: {list(blocks)}"
    return f"{len(blocks)} invalid blocks: {list(blocks[:4])} ... {list(blocks[-2:])}"
