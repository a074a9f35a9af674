"""Every class of bad input to build_plan fails with its error class (R-DESC-1, R-DESC-7).

Stated over :func:`kvxfer.testing.strategies.bad_requests` (one flaw per request),
:func:`~kvxfer.testing.strategies.adversarial_ids` and
:func:`~kvxfer.testing.strategies.mismatched`: bad block ids and token counts are
:class:`~kvxfer.errors.PlanError` naming the rule, layouts of another shape are
:class:`~kvxfer.errors.LayoutMismatch` naming the field. Nothing is ever planned from
a bad input, and no other exception type escapes.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan, chunk_size
from kvxfer.core.layout import Group, GroupKind, KVLayout, Region
from kvxfer.errors import ConfigError, LayoutMismatch, PlanError
from kvxfer.testing import strategies as kst

#: What the message must say for each flaw (the rule broken).
RULE = {
    kst.Flaw.WRONG_TYPE: "integer",
    kst.Flaw.REPEATED: "repeated",
    kst.Flaw.OUT_OF_RANGE: "out of range",
    kst.Flaw.GROUP_COUNT: r"group\(s\) given|flat list",
    kst.Flaw.LENGTH_MISMATCH: "must match",
    kst.Flaw.TOO_MANY_BLOCKS: "fill only",
    kst.Flaw.BAD_NUM_TOKENS: "num_tokens",
}


@st.composite
def _bad_cases(
    draw: st.DrawFn, flaw: kst.Flaw
) -> tuple[DescriptorTable, DescriptorTable, kst.BadRequest]:
    case = draw(kst.plan_cases())
    local = DescriptorTable.build(case.local, case.options)
    remote = DescriptorTable.build(case.remote, case.options)
    return local, remote, draw(kst.bad_requests(case.local, case.remote, flaws=(flaw,)))


#: Seven flaw classes share the profile's budget (each still gets 60 examples in ci).
PER_FLAW = settings(max_examples=max(8, settings().max_examples // 5))


@pytest.mark.parametrize("flaw", list(kst.Flaw), ids=lambda f: f.value)
@PER_FLAW
@given(data=st.data())
def test_each_flaw_is_a_plan_error_naming_the_rule_and_side(
    flaw: kst.Flaw, data: st.DataObject
) -> None:
    # Regressions: repeated ids were planned (a byte written twice), 2.7 and True were
    # converted to blocks 2 and 1, and 2**70 escaped as a bare OverflowError.
    local, remote, bad = data.draw(_bad_cases(flaw))
    with pytest.raises(PlanError, match=RULE[flaw]) as info:
        build_plan(local, remote, bad.local_blocks, bad.remote_blocks, bad.num_tokens)
    if bad.side != "both":
        assert bad.side in str(info.value)


@given(data=st.data())
def test_an_adversarial_id_anywhere_is_refused_by_position(data: st.DataObject) -> None:
    case = data.draw(kst.plan_cases())
    req = case.request
    local = DescriptorTable.build(case.local, case.options)
    remote = DescriptorTable.build(case.remote, case.options)
    g = data.draw(st.integers(0, len(req.local_blocks) - 1))
    ids = list(req.local_blocks[g])
    if not ids:
        return
    pos = data.draw(st.integers(0, len(ids) - 1))
    ids[pos] = data.draw(kst.adversarial_ids(case.local.num_blocks))
    mine = [list(b) for b in req.local_blocks]
    mine[g] = ids
    with pytest.raises(PlanError, match=rf"local block_ids \(group {g}\)\[{pos}\]="):
        build_plan(local, remote, mine, req.remote_blocks, req.num_tokens)


@given(data=st.data())
def test_layouts_of_another_shape_raise_layout_mismatch_naming_the_field(
    data: st.DataObject,
) -> None:
    local = data.draw(kst.layouts())
    other = data.draw(kst.mismatched(local))
    field = local.first_difference(other)
    assert field is not None
    # As the peer's layout arrives: through the wire.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(other), type=KVLayout)
    mine, theirs = DescriptorTable.build(local), DescriptorTable.build(wire)
    with pytest.raises(LayoutMismatch) as info:
        build_plan(mine, theirs, [[]] * len(local.groups), [[]] * len(other.groups), 0)
    assert info.value.field == field[0]


@given(data=st.data())
def test_tables_built_with_other_options_do_not_pair(data: st.DataObject) -> None:
    case = data.draw(kst.plan_cases())
    other = data.draw(kst.plan_options(case.local).filter(lambda o: o != case.options))
    local = DescriptorTable.build(case.local, case.options)
    remote = DescriptorTable.build(case.remote, other)
    req = case.request
    with pytest.raises(PlanError, match="PlanOptions"):
        build_plan(local, remote, req.local_blocks, req.remote_blocks, req.num_tokens)
    plan = build_plan(local, local, req.local_blocks, req.local_blocks, req.num_tokens)
    with pytest.raises(PlanError, match="differ in shape"):
        plan.runs(local, remote)


@given(
    st.sampled_from(("chunk_tokens", "prefill_step_tokens")),
    st.sampled_from((0, -1, -(2**70), True, False, 1.5, "4", 4.0)),
)
def test_bad_option_counts_are_config_errors_naming_key_value_and_rule(
    name: str, value: object
) -> None:
    with pytest.raises(ConfigError) as info:
        PlanOptions(**{name: value})  # type: ignore[arg-type]
    assert (info.value.key, info.value.value) == (name, value)
    assert str(info.value) == f"{name}={value!r}: must be a positive int or unset"


@given(
    st.sampled_from(("chunk_mode", "swa_window_mode", "coalesce")),
    st.sampled_from((0, 1, "yes", None, 1.0, np.bool_(True))),
)
def test_bad_option_flags_are_config_errors(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        PlanOptions(**{name: value})  # type: ignore[arg-type]
    assert (info.value.key, info.value.value) == (name, value)
    assert str(info.value) == f"{name}={value!r}: must be a bool"


@given(st.integers(1, 4096), st.integers(1, 4096))
def test_chunks_below_one_prefill_step_and_unbounded_chunks_are_refused(
    chunk: int, step: int
) -> None:
    if chunk < step:
        with pytest.raises(ConfigError) as info:
            PlanOptions(chunk_tokens=chunk, prefill_step_tokens=step)
        assert (info.value.key, info.value.value) == ("chunk_tokens", chunk)
        assert info.value.rule == (
            f"below one prefill step ({step} tokens): a step must close at most one chunk"
        )
    else:
        assert PlanOptions(chunk_tokens=chunk, prefill_step_tokens=step).chunk_bound == chunk
    with pytest.raises(ConfigError) as info:
        PlanOptions(chunk_mode=True)
    assert str(info.value) == (
        "chunk_tokens=None: chunk_mode needs chunk_tokens or prefill_step_tokens"
    )


@given(kst.plan_cases())
def test_sub_block_units_on_a_layout_that_is_not_token_major_are_refused(
    case: kst.PlanCase,
) -> None:
    # Oracle (R-DESC-3/4): the first group whose unit is smaller than a descriptor names
    # the mode that cut it: chunk_mode when the unit is the chunk, else swa_window_mode.
    layout = msgspec.structs.replace(case.local, kv_layout="HND")
    opts, tokens = case.options, layout.tokens_per_desc
    bound = opts.chunk_bound
    chunk = chunk_size(tokens, bound) if opts.chunk_mode and bound is not None else tokens
    key = None
    for group in layout.groups:
        unit = chunk
        if opts.swa_window_mode and group.kind is GroupKind.SLIDING:
            unit = math.gcd(group.window, tokens, chunk)
        if unit != tokens:
            key = "chunk_mode" if unit == chunk else "swa_window_mode"
            break
    if key is None:
        DescriptorTable.build(layout, opts)
        return
    with pytest.raises(ConfigError) as info:
        DescriptorTable.build(layout, opts)
    assert (info.value.key, info.value.value) == (key, True)
    assert info.value.rule == "needs a token-major kv_layout, not 'HND'"


@given(st.sampled_from(kst.BLOCK_SIZES), st.integers(1, 100), st.booleans())
def test_a_window_that_does_not_divide_the_block_is_refused_when_windows_are_cut(
    block_size: int, window: int, reverse: bool
) -> None:
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=window))
    groups = groups[::-1] if reverse else groups
    regions = tuple(
        Region(
            base=4096 * i, num_blocks=2, stride=block_size, block_len=block_size, layer=i, group=i
        )
        for i in range(2)
    )
    layout = KVLayout(block_size=block_size, regions=regions, groups=groups)
    DescriptorTable.build(layout)  # fine while the mode is off
    if block_size % window == 0:
        DescriptorTable.build(layout, PlanOptions(swa_window_mode=True))
        return
    with pytest.raises(ConfigError) as info:
        DescriptorTable.build(layout, PlanOptions(swa_window_mode=True))
    assert (info.value.key, info.value.value) == ("swa_window_mode", True)
    assert info.value.rule == (
        f"group {int(reverse is False)}: block_size {block_size} is not a multiple of the "
        f"sliding window {window}"
    )
