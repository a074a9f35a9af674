"""Direct or gathered: the per-request choice of issue 55's gather path.

A transfer posted directly costs one transport descriptor per merged run plus the
bytes at the link's rate; staged through contiguous buffers
(:mod:`kvxfer.core.gather_plan`) it costs one descriptor and one control round trip
per round, plus on each side one copy call per round, a small cost per piece and the
bytes at the local copy's rate::

    direct = runs * descriptor_s + bytes / link
    gather = rounds * (descriptor_s + round_s) + bytes / link
             + sum over both sides (rounds * copy_call_s + pieces * copy_piece_s
                                    + bytes / copy)

:func:`choose_path` picks the gather path only where its estimate is below
``margin`` times the direct one, and never for requests of fewer than ``min_runs``
runs, so contiguous requests keep today's direct path whatever the figures.
:class:`GatherConfig`'s defaults are this project's CPU figures, fitted to ``kvxfer
bench --gather`` on a 2-core host (UCX over CMA, 2026-12-07: 2.5 µs a descriptor,
11 GB/s for the link; gathered pulls 3.5 ms of control per round, two side-channel
round trips and a worker's hand-off; 0.5 µs a piece and 8 GB/s per side's copy), with
the gather path off (``staging_bytes=0``); :func:`fit_costs` turns measured transfers
(``kvxfer bench``: descriptors, bytes, seconds) into ``descriptor_s`` and the link's
rate. A device cache needs its own figures (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.core.descriptors import Runs
from kvxfer.core.gather_plan import StagingPlan, staging_rounds
from kvxfer.errors import ConfigError, PlanError

__all__ = [
    "Estimate",
    "GatherConfig",
    "PathChoice",
    "XferPath",
    "choose_path",
    "direct_seconds",
    "fit_costs",
    "gather_estimate",
    "gather_seconds",
]


class XferPath(enum.Enum):
    """How a request's bytes move."""

    DIRECT = "direct"  # the merged runs, engine memory to engine memory
    GATHER = "gather"  # staged in rounds through both sides' contiguous buffers


class GatherConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The gather path's staging size and the costs its choice weighs.

    Attributes:
        staging_bytes: each side's staging buffer, in the cache's own memory (device
            memory for a GPU cache: this many bytes of it per agent, plus as much
            registered); 0 turns the gather path off.
        descriptor_s: seconds the transport takes per descriptor it posts.
        link_gbps: the link's rate, decimal GB/s.
        copy_gbps: one side's local gather or scatter rate, decimal GB/s.
        copy_call_s: seconds per gather or scatter call (one per round and side: a
            kernel launch on a GPU).
        copy_piece_s: seconds per piece a gather or scatter copies.
        round_s: seconds of control per round (asking the producer to gather it).
        margin: the gather path is chosen only where its estimate is at most this
            share of the direct one (room for the figures' noise).
        min_runs: requests of fewer runs always go direct.
        slots: how many equal slots the staging buffer is cut into (one request
            holds one slot at a time; a request that finds none free goes direct);
            a round moves at most ``slot_bytes``.
        force: tests and the bench: DIRECT sends every request direct; GATHER
            gathers every request the path can serve (enabled, and fewer rounds
            than runs) whatever the estimates and ``min_runs`` say; None (the
            default) lets the estimates choose.
    """

    staging_bytes: int = 0
    descriptor_s: float = 2.5e-6
    link_gbps: float = 11.0
    copy_gbps: float = 8.0
    copy_call_s: float = 10e-6
    copy_piece_s: float = 0.5e-6
    round_s: float = 3.5e-3
    margin: float = 0.9
    min_runs: int = 64
    slots: int = 1
    force: XferPath | None = None

    def __post_init__(self) -> None:
        for key in ("staging_bytes", "min_runs"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"gather.{key}", value, "must be an int >= 0")
        positive = ("link_gbps", "copy_gbps")
        for key in (*positive, "descriptor_s", "copy_call_s", "copy_piece_s", "round_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"gather.{key}", value, "must be a number")
            low_ok = value > 0 if key in positive else value >= 0
            if not math.isfinite(value) or not low_ok:
                rule = "must be finite and > 0" if key in positive else "must be finite and >= 0"
                raise ConfigError(f"gather.{key}", value, rule)
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ConfigError("gather.slots", self.slots, "must be an int >= 1")
        if self.enabled and self.staging_bytes < self.slots:
            raise ConfigError(
                "gather.staging_bytes", self.staging_bytes, f"must be >= slots ({self.slots})"
            )
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 < m <= 1:
            raise ConfigError("gather.margin", m, "must be a number in (0, 1]")

    @property
    def enabled(self) -> bool:
        """Whether a request may take the gather path at all."""
        return self.staging_bytes > 0

    @property
    def slot_bytes(self) -> int:
        """Each slot's size, the most one round moves (0 when off)."""
        return self.staging_bytes // self.slots


class Estimate(NamedTuple):
    """Estimated seconds of one request on each path (``gather`` is inf where it
    was not considered)."""

    direct: float
    gather: float


class PathChoice(NamedTuple):
    """The path a request takes, why, and its rounds when gathered."""

    path: XferPath
    estimate: Estimate
    staging: StagingPlan | None


def direct_seconds(config: GatherConfig, runs: int, nbytes: int) -> float:
    """The direct path's estimate for ``runs`` merged runs of ``nbytes`` in all."""
    return runs * config.descriptor_s + nbytes / (config.link_gbps * 1e9)


def gather_seconds(config: GatherConfig, plan: StagingPlan) -> float:
    """The gather path's estimate for ``plan``'s rounds."""
    rounds, nbytes = len(plan.rounds), plan.nbytes
    copies = (
        2 * rounds * config.copy_call_s
        + (plan.local_pieces + plan.remote_pieces) * config.copy_piece_s
        + 2 * nbytes / (config.copy_gbps * 1e9)
    )
    return (
        rounds * (config.descriptor_s + config.round_s) + nbytes / (config.link_gbps * 1e9) + copies
    )


def gather_estimate(config: GatherConfig, runs: int, nbytes: int) -> float:
    """The gather path's estimate for ``runs`` merged runs of ``nbytes`` cut into
    rounds of ``config.slot_bytes``, before any round is planned: each side copies at
    most one piece per run plus one per cut between rounds, the count used here
    (planning the rounds costs as much as planning the request again, which a request
    that goes direct should not pay)."""
    rounds = -(-nbytes // config.slot_bytes)
    pieces = runs + rounds - 1
    copies = (
        2 * rounds * config.copy_call_s
        + 2 * pieces * config.copy_piece_s
        + 2 * nbytes / (config.copy_gbps * 1e9)
    )
    return (
        rounds * (config.descriptor_s + config.round_s) + nbytes / (config.link_gbps * 1e9) + copies
    )


def choose_path(runs: Runs, config: GatherConfig) -> PathChoice:
    """Direct or gathered for one request's merged ``runs`` (see the module docstring);
    the rounds are planned only for a request that is gathered."""
    nbytes = runs.nbytes
    direct = direct_seconds(config, len(runs), nbytes)
    # A request that fits no fewer rounds than it has runs cannot post fewer
    # descriptors staged: its copies would be pure cost.
    rounds_needed = -(-nbytes // config.slot_bytes) if config.enabled else len(runs)
    forced = config.force is XferPath.GATHER
    few = len(runs) < (1 if forced else max(config.min_runs, 1))
    if not config.enabled or config.force is XferPath.DIRECT or few or rounds_needed >= len(runs):
        return PathChoice(XferPath.DIRECT, Estimate(direct, math.inf), None)
    gather = gather_estimate(config, len(runs), nbytes)
    if forced or gather <= config.margin * direct:
        plan = staging_rounds(runs, config.slot_bytes)
        return PathChoice(XferPath.GATHER, Estimate(direct, gather), plan)
    return PathChoice(XferPath.DIRECT, Estimate(direct, gather), None)


def fit_costs(
    descriptors: npt.ArrayLike, nbytes: npt.ArrayLike, seconds: npt.ArrayLike
) -> tuple[float, float]:
    """Per-descriptor seconds and the link's GB/s fitted (least squares) to measured
    transfers ``seconds[i]`` of ``descriptors[i]`` descriptors and ``nbytes[i]`` bytes.

    Raises:
        PlanError: fewer than two transfers, arrays of different lengths, samples that
            do not separate the two costs (descriptors proportional to bytes), or a
            fit that is not positive for both.
    """
    d, b, t = (np.asarray(x, dtype=np.float64) for x in (descriptors, nbytes, seconds))
    if not (d.ndim == b.ndim == t.ndim == 1) or not (len(d) == len(b) == len(t)):
        raise PlanError("fit_costs: descriptors, nbytes and seconds must be 1-d and of one length")
    if len(d) < 2:
        raise PlanError(f"fit_costs: {len(d)} transfer(s); at least two are needed")
    a = np.stack([d, b], axis=1)
    if np.linalg.matrix_rank(a) < 2:
        raise PlanError(
            "fit_costs: the transfers do not separate per-descriptor from per-byte cost "
            "(measure two block sizes or patterns)"
        )
    (per_desc, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    if not (per_desc > 0 and per_byte > 0):
        raise PlanError(
            f"fit_costs: fitted {per_desc:g} s/descriptor and {per_byte:g} s/byte: "
            "both must be positive"
        )
    return float(per_desc), float(1e-9 / per_byte)
