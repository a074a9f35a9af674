"""Compatibility between two instances: the fingerprint hash and the layout check.

Two instances may exchange KV only when they run the same model (and revision), dtype,
KV cache dtype and attention backend, speak the same kvxfer protocol, move bytes in the
same direction (a pull instance never pairs with a push one) and, with speculative
decoding, use the same draft model. :class:`Fingerprint` folds these into one digest
that travels in every side-channel frame.

The KV layout is deliberately *not* in the digest: the handshake compares it field by
field (:func:`check_layout`) so that a mismatch names the first differing field
instead of showing two opaque hashes.
"""

from __future__ import annotations

import hashlib

import msgspec

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core.heads import TPRank, check_head_layouts
from kvxfer.core.layout import KVLayout
from kvxfer.core.ratio import at_unit, check_ratio
from kvxfer.core.state_plan import check_state_pair
from kvxfer.errors import ConfigError, LayoutMismatch
from kvxfer.types import Direction

__all__ = ["Fingerprint", "check_layout", "check_pair"]


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """What two instances must agree on before any KV moves.

    Pass resolved, canonical names (``"bfloat16"``, not ``"auto"``; the KV cache dtype
    after resolving ``"auto"`` to the model dtype): the digest compares strings, not
    meanings.

    Attributes:
        model: Model name or path as both instances know it.
        revision: Model revision (commit, tag); empty when not pinned.
        dtype: Model weights dtype.
        kv_cache_dtype: KV cache element dtype.
        attention_backend: Attention backend name.
        protocol_version: kvxfer side-channel protocol version.
        direction: Pull or push; the two never pair.
        draft_model: Speculative-decoding draft model; empty without one.
    """

    model: str
    revision: str = ""
    dtype: str
    kv_cache_dtype: str
    attention_backend: str
    protocol_version: int = PROTOCOL_VERSION
    direction: Direction
    draft_model: str = ""

    def __post_init__(self) -> None:
        # "auto" means "whatever the model dtype resolves to": two instances that both
        # say "auto" may hold different bytes, and an instance that resolved it does
        # not hash equal to one that did not. Refused so the mistake shows here.
        for key in ("dtype", "kv_cache_dtype"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"Fingerprint.{key}", value, "must be a non-empty dtype name")
            if value.strip().lower() == "auto":
                raise ConfigError(
                    f"Fingerprint.{key}",
                    value,
                    "must be a resolved dtype name (e.g. 'bfloat16'); resolve 'auto' to the "
                    "model's dtype first",
                )

    def canonical(self) -> bytes:
        """Return the canonical encoding the digest is taken over.

        JSON with keys sorted, enums as their values: independent of field declaration
        order, process, host and Python version.
        """
        return msgspec.json.encode(self, order="sorted")

    def digest(self) -> str:
        """Return the compatibility hash: SHA-256 hex of :meth:`canonical`."""
        return hashlib.sha256(self.canonical()).hexdigest()


def check_layout(local: KVLayout, remote: KVLayout) -> None:
    """Raise if two KV layouts cannot exchange blocks.

    ``block_size`` is checked first and on its own: it is the one difference operators
    hit most (the seed requires equal block sizes), and it must be refused whatever the
    layout comparison does. Addresses, strides and block counts may differ.

    Raises:
        LayoutMismatch: Naming the first differing field and both values.
    """
    if local.block_size != remote.block_size:
        raise LayoutMismatch("block_size", local.block_size, remote.block_size)
    difference = local.first_difference(remote)
    if difference is not None:
        raise LayoutMismatch(*difference)


def check_pair(
    local: KVLayout,
    remote: KVLayout,
    *,
    local_tp: TPRank | None = None,
    remote_tp: TPRank | None = None,
) -> None:
    """Raise if two ranks cannot exchange KV: the handshake's layout check.

    Block sizes may differ where one divides the other
    (:func:`~kvxfer.core.ratio.check_ratio`, which names what else a ratio needs); the
    rest is then compared as if both blocks held the smaller size's tokens. Pulls and
    pushes both move such pairs (a push's writes: :mod:`kvxfer.core.ratio_write`).

    When both sides say where they sit in their TP groups, their *global head
    layouts* are compared (:func:`~kvxfer.core.heads.check_head_layouts`: the same model
    heads and bytes per head; TP sizes and regions may differ). When either side
    does not (a peer of an earlier build, an engine without TP), the layouts must
    agree region by region (:func:`check_layout`), which pairs rank *r* with rank *r*.

    Raises:
        LayoutMismatch: naming the first differing field and both values.
        LayoutError: a layout disagrees with its own head layout.
    """
    if local.block_size != remote.block_size:
        # Different block sizes (kvxfer.core.ratio): compared at the smaller one.
        unit = check_ratio(
            local,
            remote,
            local_tp_size=1 if local_tp is None else local_tp.heads.tp_size,
            remote_tp_size=1 if remote_tp is None else remote_tp.heads.tp_size,
        )
        local, remote = at_unit(local, unit), at_unit(remote, unit)
    if local_tp is None or remote_tp is None:
        check_layout(local, remote)
        return
    check_head_layouts(
        local,
        remote,
        local_heads=local_tp.heads,
        remote_heads=remote_tp.heads,
        local_rank=local_tp.rank,
        remote_rank=remote_tp.rank,
    )
    check_state_pair(
        local,
        remote,
        local_split=local_tp.state,
        remote_split=remote_tp.state,
        local_tp=local_tp.heads.tp_size,
        remote_tp=remote_tp.heads.tp_size,
    )
