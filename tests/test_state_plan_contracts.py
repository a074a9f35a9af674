"""The handshake's check of two state layouts (``kvxfer.core.state_plan.check_state_pair``)
in its whole words: every refusal names the side, the key, the value and the rule, and
each of its checks is reached in the order the docstring gives. Written against the
mutants the descriptor properties (tests/test_state_tp_properties.py) left alive."""

from __future__ import annotations

import re

import pytest

from kvxfer.core.layout import KVLayout, KVPart, Region
from kvxfer.core.state_plan import check_state_pair
from kvxfer.core.state_split import StateSegment, StateSplit
from kvxfer.errors import ConfigError, KvxferError, LayoutError, LayoutMismatch
from tests.state_layouts import state_layout

SPLIT = StateSplit(
    conv=(StateSegment(name="x", units=4, unit_bytes=2),),
    ssm=(StateSegment(name="heads", units=4, unit_bytes=3),),
)
TP1 = state_layout(SPLIT, 1, 1, 2, 0, base=0)
TP2 = state_layout(SPLIT, 2, 1, 2, 0, base=9_000)
TWO_LAYERS = state_layout(SPLIT, 1, 2, 2, 0, base=0)


def _refusal(
    kind: type[KvxferError], words: str, local: KVLayout, remote: KVLayout, **kw: object
) -> None:
    with pytest.raises(kind, match=f"^{re.escape(words)}$"):
        check_state_pair(local, remote, **kw)  # type: ignore[arg-type]


def _splits(
    local_tp: int, remote_tp: int, local: object = SPLIT, remote: object = SPLIT
) -> dict[str, object]:
    return {
        "local_split": local,
        "remote_split": remote,
        "local_tp": local_tp,
        "remote_tp": remote_tp,
    }


def test_a_state_region_on_one_side_only_is_named_with_the_side_that_has_it() -> None:
    _refusal(
        LayoutMismatch,
        "KV layout mismatch at layer 2 CONV state region: local=False remote=True",
        TP1,
        TWO_LAYERS,
        **_splits(1, 1),
    )
    _refusal(
        LayoutMismatch,
        "KV layout mismatch at layer 2 CONV state region: local=True remote=False",
        TWO_LAYERS,
        TP1,
        **_splits(1, 1),
    )


def test_equal_tp_sizes_need_no_split_and_equal_bytes_per_slot() -> None:
    check_state_pair(TP1, TP1, **_splits(1, 1, None, None))  # type: ignore[arg-type]
    check_state_pair(TP2, TP2, **_splits(2, 2, None, None))  # type: ignore[arg-type]
    _refusal(
        LayoutMismatch,
        "KV layout mismatch at layer 1 CONV state bytes per slot: local=8 remote=4",
        TP1,
        TP2,
        **_splits(2, 2, None, None),
    )
    # The SSM region alone differs: named as SSM, with its two sizes.
    ssm = tuple(
        Region(
            base=r.base,
            num_blocks=r.num_blocks,
            stride=r.stride + 1,
            block_len=r.block_len + 1,
            layer=r.layer,
            part=r.part,
            group=r.group,
        )
        if r.part is KVPart.SSM
        else r
        for r in TP1.regions
    )
    wider = KVLayout(block_size=TP1.block_size, regions=ssm, groups=TP1.groups)
    _refusal(
        LayoutMismatch,
        "KV layout mismatch at layer 1 SSM state bytes per slot: local=12 remote=13",
        TP1,
        wider,
        **_splits(1, 1, None, None),
    )


def test_layouts_without_state_pass_whatever_the_splits() -> None:
    plain = KVLayout(block_size=16, regions=TP1.regions[:1], groups=TP1.groups[:1])
    check_state_pair(plain, plain, **_splits(1, 4, None, None))  # type: ignore[arg-type]


def test_other_tp_sizes_need_both_splits_each_side_named() -> None:
    rule = (
        "tp.state=None: state groups between TP sizes 1 and 2 need both instances to "
        "state how TP splits their state slots (TPRank.state)"
    )
    _refusal(ConfigError, f"local {rule}", TP1, TP2, **_splits(1, 2, None, SPLIT))
    _refusal(ConfigError, f"remote {rule}", TP1, TP2, **_splits(1, 2, SPLIT, None))
    _refusal(ConfigError, f"local {rule}", TP1, TP2, **_splits(1, 2, None, None))
    check_state_pair(TP1, TP2, **_splits(1, 2))  # type: ignore[arg-type]
    check_state_pair(TP2, TP1, **_splits(2, 1))  # type: ignore[arg-type]


def test_a_region_that_does_not_hold_its_share_is_named_with_its_side() -> None:
    claimed = state_layout(SPLIT, 1, 1, 2, 0, base=9_000)  # a TP1 layout said to be a TP2 rank's
    share = (
        "KVLayout.regions[1].block_len=8: layer 1 CONV state of a rank of tp_size=2 "
        "holds 4 bytes per slot (x as the state split says)"
    )
    _refusal(LayoutError, f"remote {share}", TP1, claimed, **_splits(1, 2))
    _refusal(LayoutError, f"local {share}", claimed, TP1, **_splits(2, 1))
