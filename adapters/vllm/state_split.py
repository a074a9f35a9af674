"""How vLLM's tensor parallelism splits a model's recurrent-state slots (issue 53).

A pull of Mamba2 or Gated DeltaNet state across TP sizes reads each decode rank's
heads and groups out of the producer ranks' slots; the core plans it from a
:class:`~kvxfer.core.state_split.StateSplit` (per segment: global units and the bytes
one unit takes in a slot). vLLM never states that split, so it is derived here from
the model's config, the way vLLM's own layers shard their projections, and checked
against the state shapes vLLM allocated (``MambaSpec.shapes`` and ``dtypes``, which
``MambaStateShapeCalculator`` computed for this rank):

* Mamba2 (``MambaMixer2``: Granite-4 hybrid, Nemotron-H, Falcon-H1, Zamba2, Mamba2):
  conv channels ``[x | B | C]``, ``x`` split by SSM heads (``head_dim`` channels
  each), ``B`` and ``C`` by groups (``state_size`` channels each). vLLM allows groups
  not divisible by the TP size only for a single group, which it then replicates on
  every rank (``extra_groups_for_head_shards``): the core's replication rule for
  units fewer than ranks holds exactly that. SSM state ``(heads, head_dim,
  state_size)`` per rank, split by heads.
* Gated DeltaNet (Qwen3-Next, Qwen3.5): conv channels ``[q | k | v]``, ``q`` and
  ``k`` split by key heads (``head_k_dim`` channels each), ``v`` by value heads
  (``head_v_dim``); temporal state ``(v_heads, head_v_dim, head_k_dim)`` by value
  heads. vLLM cuts the conv weights by channel (``key_dim / tp``), which cuts whole
  heads only when the TP size divides both head counts: anything else is not derived.

A conv unit's bytes are its channels x the conv state length (``conv_kernel - 1``
plus speculative tokens, read off the allocated shape) x the conv dtype's size; an
SSM unit's the elements of one head x the SSM dtype's size (the two dtypes may
differ: ``mamba_ssm_cache_dtype``). Anything this module does not know (another
state backend, a config without the fields, extra state tensors such as ReplaySSM's
ring, shapes that do not match the derivation) gives no split and a reason: state
groups then pair between equal TP sizes only.

Importable without vLLM or torch: specs and configs are duck-typed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvxfer.core.layout import ConvLayout, KVPart
from kvxfer.core.state_split import StateSegment, StateSplit

__all__ = ["derive_state_split", "model_config_of"]

#: hf config field names per Mamba2 parameter, first found wins: the ``mamba_*``
#: names come first because hybrids also carry attention's ``num_heads``/``head_dim``
#: (GraniteMoeHybrid and Falcon-H1: ``mamba_n_heads``...; Nemotron-H:
#: ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``, ``ssm_state_size``; Zamba2:
#: ``n_mamba_heads``, ``mamba_headdim``, ``mamba_ngroups``; Mamba2 itself: plain
#: ``num_heads``, ``head_dim``, ``n_groups``, ``state_size``). A wrong pick cannot
#: pass unnoticed: the derived shapes must equal the ones vLLM allocated.
_MAMBA2_FIELDS: dict[str, tuple[str, ...]] = {
    "heads": ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads"),
    "head_dim": ("mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim"),
    "groups": ("mamba_n_groups", "mamba_ngroups", "n_groups"),
    "state_size": ("mamba_d_state", "ssm_state_size", "state_size"),
}
#: Qwen3-Next / Qwen3.5 (text config) field names, as vLLM's GDN layer reads them.
_GDN_FIELDS: dict[str, tuple[str, ...]] = {
    "k_heads": ("linear_num_key_heads",),
    "v_heads": ("linear_num_value_heads",),
    "k_dim": ("linear_key_head_dim",),
    "v_dim": ("linear_value_head_dim",),
}


def model_config_of(vllm_config: Any) -> Any:
    """The hf config a model's layers read: the text config of a multimodal model
    (Qwen3.5), else ``hf_config``."""
    mc = vllm_config.model_config
    return getattr(mc, "hf_text_config", None) or mc.hf_config


def _fields(config: Any, names: dict[str, tuple[str, ...]]) -> dict[str, int] | str:
    out: dict[str, int] = {}
    for key, candidates in names.items():
        value = next(
            (getattr(config, n) for n in candidates if getattr(config, n, None) is not None),
            None,
        )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"the model config has no positive int {'/'.join(candidates)} ({key})"
        out[key] = value
    return out


def _shape(spec: Any, i: int) -> tuple[int, ...]:
    return tuple(int(d) for d in spec.shapes[i])


def _conv_dims(shape: tuple[int, ...], layout: ConvLayout) -> tuple[int, int]:
    """(channels, state length) of a conv state shape in ``layout`` order."""
    return (shape[0], shape[1]) if layout is ConvLayout.DS else (shape[1], shape[0])


def _per_rank(units: int, tp_size: int) -> int:
    """How many of ``units`` one of ``tp_size`` ranks holds (the core's rule)."""
    return 1 if units < tp_size else units // tp_size


def _split(
    spec: Any,
    layout: ConvLayout,
    sizes: tuple[int, int],
    conv: Sequence[tuple[str, int, int]],
    ssm: tuple[str, str, int, tuple[int, int, int]],
    tp: int,
    why: str,
) -> StateSplit | str:
    """The split of one rank's state slot from its sub-projections: ``conv`` lists
    each conv segment as (name, units, channels per unit), ``ssm`` the temporal state
    as (what the error calls it, segment name, units, this rank's shape, whose last
    two dims make one unit); checked
    against the shapes vLLM allocated (``spec``), else the reason (``why`` says where
    the expected channel count comes from)."""
    channels, length = _conv_dims(_shape(spec, 0), layout)
    want = sum(_per_rank(units, tp) * per for _, units, per in conv)
    if channels != want:
        return f"the conv state has {channels} channels per rank, the config gives {want} ({why})"
    label, name, units, ssm_want = ssm
    if _shape(spec, 1) != ssm_want:
        return f"the {label} state is {_shape(spec, 1)} per rank, the config gives {ssm_want}"
    conv_b, ssm_b = sizes
    return StateSplit(
        conv=tuple(
            StateSegment(name=n, units=units, unit_bytes=per * length * conv_b)
            for n, units, per in conv
        ),
        ssm=(StateSegment(name=name, units=units, unit_bytes=ssm_want[1] * ssm_want[2] * ssm_b),),
    )


def _mamba2(
    config: Any, spec: Any, tp: int, layout: ConvLayout, sizes: tuple[int, int]
) -> StateSplit | str:
    f = _fields(config, _MAMBA2_FIELDS)
    if isinstance(f, str):
        return f
    heads, head_dim, groups, n = f["heads"], f["head_dim"], f["groups"], f["state_size"]
    if heads % tp:
        return f"{heads} SSM heads do not split over tp_size={tp}"
    # vLLM extends groups to the TP size only from a single group (MambaMixer2 asserts
    # n_groups % tp == 0 or n_groups == 1); each rank then holds that one group.
    if groups % tp and groups != 1:
        return f"{groups} groups do not split over tp_size={tp} (vLLM replicates 1 group only)"
    return _split(
        spec,
        layout,
        sizes,
        conv=(("x", heads, head_dim), ("B", groups, n), ("C", groups, n)),
        ssm=("SSM", "heads", heads, (heads // tp, head_dim, n)),
        tp=tp,
        why=f"x: {heads} heads x {head_dim} / tp {tp}, B and C: {groups} groups x {n}",
    )


def _gdn(
    config: Any, spec: Any, tp: int, layout: ConvLayout, sizes: tuple[int, int]
) -> StateSplit | str:
    f = _fields(config, _GDN_FIELDS)
    if isinstance(f, str):
        return f
    kh, vh, dk, dv = f["k_heads"], f["v_heads"], f["k_dim"], f["v_dim"]
    # vLLM cuts q, k and v by channel; whole heads per rank only when tp divides both.
    if kh % tp or vh % tp:
        return f"{kh} key and {vh} value heads do not both split over tp_size={tp}"
    return _split(
        spec,
        layout,
        sizes,
        conv=(("q", kh, dk), ("k", kh, dk), ("v", vh, dv)),
        ssm=("temporal", "v_heads", vh, (vh // tp, dv, dk)),
        tp=tp,
        why=f"q, k: {kh} heads x {dk}, v: {vh} heads x {dv}, / tp {tp}",
    )


_DERIVE = {"MAMBA2": _mamba2, "GDN_ATTN": _gdn}


def derive_state_split(
    config: Any, specs: Sequence[Any], tp_size: int, layout: ConvLayout
) -> tuple[StateSplit | None, str]:
    """The state split of a model whose state groups have ``specs`` (vLLM
    ``MambaSpec``, this rank's shapes), and why not when None.

    Args:
        config: the hf (text) config the model's layers read (:func:`model_config_of`).
        specs: every state group's spec; they must agree (one split per model).
        tp_size: this instance's tensor-parallel size (the shapes are its rank's).
        layout: the conv-state order the shapes are in.

    Returns:
        ``(split, "")``, or ``(None, reason)`` naming what is not known or what
        disagrees (sizes included). The split's held bytes per rank equal the
        allocated state sizes whenever it is returned.
    """
    if not specs:
        return None, "the model has no state groups"
    first = specs[0]
    backend = getattr(getattr(first, "mamba_type", None), "name", None)
    for spec in specs[1:]:
        other = getattr(getattr(spec, "mamba_type", None), "name", None)
        if other != backend or list(spec.shapes) != list(first.shapes):
            return None, "the state groups' specs differ (one split per model is stated)"
        if list(spec.dtypes) != list(first.dtypes):
            return None, "the state groups' dtypes differ (one split per model is stated)"
    derive = _DERIVE.get(str(backend))
    if derive is None:
        return None, f"mamba_type {backend} has no known TP split (Mamba2 and GDN have)"
    shapes, dtypes = list(first.shapes or ()), list(first.dtypes or ())
    if len(shapes) != 2 or len(dtypes) != 2 or any(len(s) < 2 for s in shapes):
        # ReplaySSM's ring and other extra per-slot tensors are not split here.
        return None, f"a state slot of {len(shapes)} tensors (shapes {shapes}); 2 are split"
    if len(shapes[0]) != 2:
        return None, f"the conv state shape {tuple(shapes[0])} is not 2-d"
    sizes = (int(getattr(dtypes[0], "itemsize", 0)), int(getattr(dtypes[1], "itemsize", 0)))
    if not all(sizes):
        return None, f"state dtypes {dtypes} have no itemsize"
    got = derive(config, first, tp_size, layout, sizes)
    if isinstance(got, str):
        return None, f"{backend}: {got}"
    # The derivation matched the shapes field by field; the bytes are checked too, so
    # that a split is never stated for a slot it does not describe.
    for i, part in enumerate((KVPart.CONV, KVPart.SSM)):
        allocated = math.prod(_shape(first, i)) * sizes[i]
        held = got.region_bytes(part, tp_size)
        if held != allocated:
            names = "+".join(s.name for s in got.segments(part))
            return None, (
                f"{backend}: the {part.name} state holds {allocated} bytes per slot on a "
                f"rank of tp_size={tp_size}, the split ({names}) {held}"
            )
    return got, ""
