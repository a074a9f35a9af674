"""Rank layouts with state regions, shared by the state-plan tests
(tests/test_state_tp_properties.py, tests/test_state_plan_contracts.py)."""

from __future__ import annotations

from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, KVPart, Region
from kvxfer.core.state_split import StateSplit

#: The state parts, in the order each layer's regions are laid out.
STATE_PARTS = (KVPart.CONV, KVPart.SSM)


def state_layout(split: StateSplit, tp: int, layers: int, nb: int, pad: int, base: int) -> KVLayout:
    """One rank's layout: an attention region, then each state layer's conv and SSM
    regions (``nb`` slots each, ``pad`` bytes after each slot, 3 bytes between regions)."""
    regions = [Region(base=base, num_blocks=nb, stride=16, block_len=16, part=KVPart.KV)]
    at = base + nb * 16
    for layer in range(layers):
        for part in STATE_PARTS:
            n = split.region_bytes(part, tp)
            regions.append(
                Region(
                    base=at,
                    num_blocks=nb,
                    stride=n + pad,
                    block_len=n,
                    layer=layer + 1,
                    part=part,
                    group=1,
                )
            )
            at += nb * (n + pad) + 3
    return KVLayout(
        block_size=16,
        regions=tuple(regions),
        groups=(Group(kind=GroupKind.FULL), Group(kind=GroupKind.STATE, conv_layout=ConvLayout.DS)),
    )
