"""What an :class:`~kvxfer.agent.Agent` is built from and what it counts.

:class:`AgentConfig` (every setting of one agent), :class:`PushPost` (which thread
posts a push producer's writes) and :class:`AgentStats` (the counters an engine
exports). Re-exported by :mod:`kvxfer.agent`.
"""

from __future__ import annotations

import enum

import msgspec

from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.core.descriptors import PlanOptions
from kvxfer.core.gather_cost import GatherConfig
from kvxfer.core.heads import TPRank
from kvxfer.errors import ConfigError
from kvxfer.types import Direction, Role

__all__ = [
    "DEFAULT_PROGRESS_INTERVAL_S",
    "DEFAULT_WARM_UP_DESCRIPTORS",
    "MAX_PROGRESS_INTERVAL_S",
    "MAX_WARM_UP_DESCRIPTORS",
    "AgentConfig",
    "AgentStats",
    "PushPost",
    "check_progress_interval",
    "check_warm_up_descriptors",
]

#: :attr:`AgentConfig.warm_up_descriptors` unless set: a 4,000-token TP pull of a
#: Qwen3-0.6B-shaped cache at block size 16 posts 14,000-28,000 units.
DEFAULT_WARM_UP_DESCRIPTORS = 1 << 16

#: The largest :attr:`AgentConfig.warm_up_descriptors`: about 2 s of connect time at
#: the ~2 µs a descriptor the warm-up costs on one host.
MAX_WARM_UP_DESCRIPTORS = 1 << 20

#: :attr:`AgentConfig.progress_interval_s` unless set.
DEFAULT_PROGRESS_INTERVAL_S = 0.0002
#: The largest :attr:`AgentConfig.progress_interval_s`: a transfer nobody waits on is
#: settled (its blocks freed, a push's notice sent) up to this long after it ended.
MAX_PROGRESS_INTERVAL_S = 1.0


def check_progress_interval(key: str, value: object) -> float:
    """``value`` if it is a valid :attr:`AgentConfig.progress_interval_s` (seconds, more
    than 0 and at most :data:`MAX_PROGRESS_INTERVAL_S`); else a ConfigError naming
    ``key``. (0 would spin the progress thread.)"""
    top = MAX_PROGRESS_INTERVAL_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= top:
        raise ConfigError(
            key, value, f"must be a number of seconds more than 0 and at most {top:g}"
        )
    return float(value)


def check_warm_up_descriptors(key: str, value: object) -> int:
    """``value`` if it is a valid :attr:`AgentConfig.warm_up_descriptors` (an int from 1
    to :data:`MAX_WARM_UP_DESCRIPTORS`, not a bool); else a ConfigError naming ``key``."""
    top = MAX_WARM_UP_DESCRIPTORS
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        raise ConfigError(key, value, f"must be an integer from 1 to {top}")
    return value


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
        direction: Pull (consumer reads) or push (producer writes); must equal
            ``fingerprint.direction`` (refused otherwise, naming both).
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
        renew_limit_s: The longest a consumer keeps renewing a hold it has not read
            (:meth:`~kvxfer.agent.Agent.keep_alive`): a request forgotten by its
            engine pins its producer's blocks no longer than this.
        progress_interval_s: Sleep of the progress thread while transfers are in flight
            (seconds; more than 0, at most 1). A push producer's write is seen done, and
            NIXL sends its notice to the consumer, at the next round after it ended.
        warm_up_descriptors: How many descriptors the agent's first warm-up transfer
            posts (:meth:`~kvxfer.agent.Agent.connect` of an agent that posts to the
            peer: a read of its guard word, or a push producer's write of its sink
            word; 1 to 1,048,576). A process's first post of many descriptors grows the
            allocator's heap and the transport's pools, and first TP pulls of a
            4,000-token prompt took up to 1.74x a steady one for it; a warm-up at
            least as large as a request moves that to the connect.
            For scale: such a pull of a Qwen3-0.6B-shaped cache posts 14,000 units
            from one producer rank, 28,000 from two. The default adds ~0.14 s to the
            first connect on the 2-core development host.
        push_post: Which thread posts a push producer's writes (see :class:`PushPost`).
        tp: Where this agent sits in its tensor-parallel group (the model's head layout
            and this rank), announced in the handshake; None: no TP identity (peers are
            then paired region by region, rank *r* with rank *r*). With it, a pull whose
            ticket names another ``tp_size`` reads from every producer rank holding
            this rank's heads (:mod:`kvxfer._agent.tp_pull`).
        gather: The gather path's staging size and costs (issue 55; see
            :class:`~kvxfer.core.gather_cost.GatherConfig`). Off by default
            (``staging_bytes == 0``); on, the agent registers and announces its
            staging buffer, serves gathered rounds to consumers, and gathers its own
            pulls from a producer that announced staging where ``choose_path`` (or
            ``force``) says so, host memory only; pushes go direct
            (docs/DESIGN.md, "Gather path").
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
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S
    warm_up_descriptors: int = DEFAULT_WARM_UP_DESCRIPTORS
    lease_guard_s: float = 0.5
    renew_limit_s: float = 600.0
    backend_extra: dict[str, str] = msgspec.field(default_factory=dict)
    push_post: PushPost = PushPost.AUTO
    tp: TPRank | None = None
    gather: GatherConfig = msgspec.field(default_factory=GatherConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.push_post, PushPost):
            raise ConfigError(
                "push_post",
                self.push_post,
                "must be a PushPost: " + ", ".join(repr(p.value) for p in PushPost),
            )
        if self.tp is not None and not isinstance(self.tp, TPRank):
            raise ConfigError("tp", self.tp, "must be a kvxfer.core.heads.TPRank or None")
        if not self.engine_id:
            raise ConfigError("engine_id", self.engine_id, "must be a non-empty string")
        for key in ("lease_s", "handshake_timeout_s", "transfer_timeout_s", "renew_limit_s"):
            value = getattr(self, key)
            if not value > 0:
                raise ConfigError(key, value, "must be a positive number of seconds")
        check_progress_interval("progress_interval_s", self.progress_interval_s)
        check_warm_up_descriptors("warm_up_descriptors", self.warm_up_descriptors)
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError("side_channel_port", self.side_channel_port, "must be 0..65535")
        if self.fingerprint.direction is not self.direction:
            # The fingerprint's direction goes into the compatibility hash, this one
            # decides the behaviour: two values would pair instances that cannot work.
            raise ConfigError(
                "direction",
                self.direction.value,
                f"must equal fingerprint.direction ({self.fingerprint.direction.value}); "
                "set both AgentConfig.direction and Fingerprint.direction to the same "
                "Direction",
            )
        if self.push_stream and self.direction is not Direction.PUSH:
            raise ConfigError("push_stream", True, "only valid with the push direction")

    @property
    def stall_limit_s(self) -> float | None:
        """How long this agent's connections may stall before its backend ends them
        (:attr:`BackendOptions.stall_limit_s`): ``transfer_timeout_s`` for a push
        producer (role producer or both), None (the transport's default) otherwise.

        A WRITE cut by a dead link then ends, its bytes with it, by the time its
        deadline passed, and its consumer can be told that no byte of it will land
        (R-SAFE-5); a consumer frozen for less is never taken for dead (R-SAFE-6). The
        consumer learns the value at its registration: a producer that dies mid-push
        leaves what its WRITE had queued in its kernel, which sends it on for at most
        this long (:mod:`kvxfer._agent.liveness`)."""
        if self.direction is Direction.PUSH and self.role is not Role.CONSUMER:
            return self.transfer_timeout_s
        return None

    def backend_options(self, agent_name: str) -> BackendOptions:
        """The options this agent's backend opens with, for ``agent_name`` (see
        :attr:`stall_limit_s`)."""
        return BackendOptions(
            agent_name=agent_name,
            rails=self.rails,
            stripe_width=self.stripe_width,
            stall_limit_s=self.stall_limit_s,
            extra=dict(self.backend_extra),
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
    #: Producer: holds whose lease a consumer's Renew extended (one per hold per Renew).
    leases_renewed: int = 0
    #: Consumer: holds this agent asked a producer to keep (one per hold per Renew),
    #: and of those the ones not renewed (no such hold there, or the Renew failed).
    renewals_sent: int = 0
    renewals_refused: int = 0
    #: Consumer: kept holds it stopped renewing before their read started (their lease
    #: ended unrenewed, or ``renew_limit_s`` passed); their loads fail closed.
    renewals_lapsed: int = 0
    failures: dict[str, int] = msgspec.field(default_factory=dict)
    #: Failed transfers by :class:`~kvxfer.transfer.FailureStage` value (R-SAFE-4).
    failures_by_stage: dict[str, int] = msgspec.field(default_factory=dict)
    #: Notifications ignored: undecodable, forged or without the right capability.
    notices_failed: int = 0
    #: Release, notices, registrations and probes refused for a wrong capability.
    capability_rejects: int = 0
    #: Pulls whose guard word said the producer no longer held the blocks.
    guard_failures: int = 0
    #: Guarded pulls read again because their producer had not held them yet.
    guard_rereads: int = 0
    #: Pulls of a producer without a guard table (only the lease_expiry check).
    unguarded_pulls: int = 0
    #: Liveness probes of quiet transfers (side-channel pings).
    liveness_probes: int = 0
    #: Guard-word reads posted and their total time (the fail-closed check's cost).
    guard_reads: int = 0
    guard_s_total: float = 0.0
    #: Failed transfers whose bytes may still land, their blocks held back from the
    #: engine until they cannot (R-SAFE-5): how many now (a gauge), how many ever,
    #: and how long they were held (total and longest, seconds).
    quarantined: int = 0
    quarantines: int = 0
    quarantine_s_total: float = 0.0
    quarantine_s_max: float = 0.0
    #: Gather path (issue 55), consumer: pulls started through the staging slots, the
    #: rounds they read (one descriptor each), and pulls sent direct instead because a
    #: side's slots were all lent (staging never grows).
    gathered_pulls: int = 0
    gather_rounds: int = 0
    gather_busy: int = 0
    #: Gather path, producer: rounds gathered, and rounds refused (a piece outside
    #: the hold, no such hold for the capability).
    gather_served: int = 0
    gather_refused: int = 0

    def copy(self) -> AgentStats:
        """A snapshot: the counters and copies of their dicts (taken under the agent lock)."""
        return msgspec.structs.replace(
            self, failures=dict(self.failures), failures_by_stage=dict(self.failures_by_stage)
        )

    def failure_accounting(self) -> dict[str, object]:
        """The failure counters (issue 16) as one JSON-able dict (``demo/bench --json``)."""
        return {
            "transfers_failed": self.transfers_failed,
            "failures_by_stage": dict(self.failures_by_stage),
            "notices_failed": self.notices_failed,
            "leases_expired": self.leases_expired,
            "capability_rejects": self.capability_rejects,
            "guard_failures": self.guard_failures,
            "guard_rereads": self.guard_rereads,
            "unguarded_pulls": self.unguarded_pulls,
            "liveness_probes": self.liveness_probes,
            "guard_reads": self.guard_reads,
            "quarantined": self.quarantined,
            "quarantines": self.quarantines,
            "quarantine_s_max": round(self.quarantine_s_max, 4),
            "guard_us_per_read": (
                round(1e6 * self.guard_s_total / self.guard_reads, 2) if self.guard_reads else None
            ),
        }
