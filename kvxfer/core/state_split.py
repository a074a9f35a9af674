"""How tensor parallelism shards a recurrent-state slot (Mamba2, Gated DeltaNet).

A state layer's slot (:attr:`~kvxfer.core.layout.GroupKind.STATE`) holds a
convolution state and an SSM (temporal) state, each a region of its own
(:attr:`~kvxfer.core.layout.KVPart.CONV`, :attr:`~kvxfer.core.layout.KVPart.SSM`).
Under TP each state is the concatenation of *segments*, each split over the ranks by
*units* (heads or groups), the way vLLM shards the layer's projections:

* Mamba2 conv channels are ``[x | B | C]``: ``x`` split by SSM heads
  (``head_dim`` channels each), ``B`` and ``C`` by groups (``state_size`` channels
  each; with a single group every rank holds it); its SSM state is
  ``(heads, head_dim, state_size)``, split by heads;
* Gated DeltaNet conv channels are ``[q | k | v]``: ``q`` and ``k`` split by key
  heads, ``v`` by value heads; its temporal state ``(v_heads, v_dim, k_dim)`` by
  value heads.

A :class:`StateSplit` says this once for a model, independent of the TP size: per
segment the global unit count and the bytes one unit takes in one slot. Rank *r* of a
TP group of ``tp`` ranks holds units as KV heads are held
(:class:`~kvxfer.core.heads.HeadLayout`): ``units / tp`` consecutive units from
``r * units / tp`` when ``tp`` divides them, else (``units < tp``, ``tp`` a multiple)
unit ``r // (tp / units)``, replicated. Its region of a state then holds, segment
after segment, its units of each, consecutively: one unit's bytes are contiguous only
when the conv state is dim-major (``ConvLayout.DS``, vLLM's
``VLLM_SSM_CONV_STATE_LAYOUT=DS``; the SSM state always is), which a pull across TP
sizes therefore requires (:func:`check_conv_order`).

Pure: no torch, no numpy.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvxfer.core.layout import ConvLayout, Group, KVPart
from kvxfer.errors import ConfigError

__all__ = ["StateSegment", "StateSplit", "check_conv_order", "unit_ranks", "units_of"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_units(units: int, tp_size: int, what: str) -> None:
    if (units % tp_size if units >= tp_size else tp_size % units) != 0:
        raise ConfigError(
            "tp_size",
            tp_size,
            f"must divide the {units} {what} (each rank holds units / tp_size) or be a "
            "multiple of them (each replicated on tp_size / units ranks)",
        )


def units_of(units: int, tp_size: int, rank: int) -> range:
    """The global units rank ``rank`` of ``tp_size`` ranks holds (module doc's rule).

    Raises:
        ConfigError: ``tp_size`` neither divides ``units`` nor is a multiple of it, or
            ``rank`` is not in ``[0, tp_size)``.
    """
    _check_units(units, tp_size, "units")
    if not _is_int(rank) or not 0 <= rank < tp_size:
        raise ConfigError("tp_rank", rank, f"must be an int in [0, {tp_size})")
    if units < tp_size:
        unit = rank // (tp_size // units)
        return range(unit, unit + 1)
    per = units // tp_size
    return range(rank * per, (rank + 1) * per)


def unit_ranks(units: int, tp_size: int, unit: int) -> range:
    """The ranks of ``tp_size`` ranks holding global unit ``unit`` (consecutive).

    Raises:
        ConfigError: as :func:`units_of`, or ``unit`` not in ``[0, units)``.
    """
    _check_units(units, tp_size, "units")
    if not _is_int(unit) or not 0 <= unit < units:
        raise ConfigError("unit", unit, f"must be an int in [0, {units})")
    if units < tp_size:
        replicas = tp_size // units
        return range(unit * replicas, (unit + 1) * replicas)
    rank = unit // (units // tp_size)
    return range(rank, rank + 1)


class StateSegment(msgspec.Struct, frozen=True, kw_only=True):
    """One TP-sharded piece of a state, in slot order.

    Attributes:
        name: what it is, for messages (``"x"``, ``"B"``, ``"q"``, ``"heads"``).
        units: how many heads or groups it has, all ranks together.
        unit_bytes: bytes one unit takes in one slot, on any rank (channels per unit
            x state length x element bytes for a conv segment).
    """

    name: str
    units: int
    unit_bytes: int

    def __post_init__(self) -> None:
        for key in ("units", "unit_bytes"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise ConfigError(f"StateSegment.{key}", value, "must be a positive int")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("StateSegment.name", self.name, "must be a non-empty str")

    def held_bytes(self, tp_size: int) -> int:
        """Bytes of this segment one rank of ``tp_size`` holds per slot."""
        return len(units_of(self.units, tp_size, 0)) * self.unit_bytes


class StateSplit(msgspec.Struct, frozen=True, kw_only=True):
    """How every state layer's slot of a model splits over TP ranks.

    The same on every rank of both instances (it describes the model, not a rank):
    the handshake compares it (:meth:`first_difference`).

    Attributes:
        conv: the conv state's segments in slot order (Mamba2 ``x, B, C``; GDN
            ``q, k, v``).
        ssm: the SSM / temporal state's segments (one: its heads).
    """

    conv: tuple[StateSegment, ...]
    ssm: tuple[StateSegment, ...]

    def __post_init__(self) -> None:
        for key in ("conv", "ssm"):
            segments = getattr(self, key)
            if not segments or not all(isinstance(s, StateSegment) for s in segments):
                raise ConfigError(
                    f"StateSplit.{key}", segments, "must be a non-empty tuple of StateSegment"
                )

    def segments(self, part: KVPart) -> tuple[StateSegment, ...]:
        """The segments of the region holding ``part`` (CONV or SSM).

        Raises:
            ConfigError: ``part`` is not a state part.
        """
        if part is KVPart.CONV:
            return self.conv
        if part is KVPart.SSM:
            return self.ssm
        raise ConfigError("part", part, "a state region holds CONV or SSM state")

    def check(self, tp_size: int) -> None:
        """Raise unless ``tp_size`` ranks can split every segment.

        Raises:
            ConfigError: naming the segment, its units and the rule.
        """
        if not _is_int(tp_size) or tp_size < 1:
            raise ConfigError("tp_size", tp_size, "must be a positive int")
        for part, segments in ((KVPart.CONV, self.conv), (KVPart.SSM, self.ssm)):
            for s in segments:
                _check_units(s.units, tp_size, f"{part.name} {s.name!r} units (heads/groups)")

    def region_bytes(self, part: KVPart, tp_size: int) -> int:
        """Bytes per slot of the region holding ``part`` on one rank of ``tp_size``."""
        return sum(s.held_bytes(tp_size) for s in self.segments(part))

    def first_difference(self, other: StateSplit) -> tuple[str, Any, Any] | None:
        """The first field where two splits differ, or None."""
        for key in ("conv", "ssm"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if len(mine) != len(theirs):
                return f"state.{key} (segments)", len(mine), len(theirs)
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if a != b:
                    return f"state.{key}[{i}]", a, b
        return None


def check_conv_order(groups: tuple[Group, ...]) -> None:
    """Raise unless every state group's conv state is dim-major (``DS``): a unit of a
    token-major (``SD``, ``(state_len, dim)``) conv state lies in ``state_len``
    strided pieces, so a rank's share of another TP size's slot is no byte range.

    Raises:
        ConfigError: naming the group, its conv layout and the rule.
    """
    for g, group in enumerate(groups):
        if group.is_state and group.conv_layout is not ConvLayout.DS:
            value = None if group.conv_layout is None else group.conv_layout.value
            raise ConfigError(
                f"groups[{g}].conv_layout",
                value,
                "state pulls across TP sizes cut conv state by channel and need it "
                "dim-major (DS): start both instances with VLLM_SSM_CONV_STATE_LAYOUT=DS",
            )
