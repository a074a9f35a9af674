"""Rank layouts with state regions and the state splits they hold, shared by the
state-plan tests (tests/test_state_tp_properties.py, tests/test_state_plan_contracts.py,
tests/test_state_plan_pieces.py)."""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, KVPart, Region
from kvxfer.core.state_plan import StatePiece, plan_slots
from kvxfer.core.state_split import StateSegment, StateSplit

#: TP sizes the strategies draw from.
TPS = (1, 2, 3, 4, 6, 8)

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


def _splits(units: int, tp: int) -> bool:
    return (units % tp if units >= tp else tp % units) == 0


@st.composite
def state_cases(draw: st.DrawFn) -> tuple[StateSplit, int, int, int]:
    """A model's state split and two TP sizes it allows (consumer, producer), and a
    consumer rank."""
    local_tp, remote_tp = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    ok = [u for u in range(1, 25) if _splits(u, local_tp) and _splits(u, remote_tp)]
    assume(ok)

    def segment(name: str) -> StateSegment:
        return StateSegment(
            name=name, units=draw(st.sampled_from(ok)), unit_bytes=draw(st.integers(1, 5))
        )

    conv = tuple(segment(n) for n in draw(st.sampled_from((("x", "B", "C"), ("q", "k", "v")))))
    split = StateSplit(conv=conv, ssm=(segment("heads"),))
    return split, local_tp, remote_tp, draw(st.integers(0, local_tp - 1))


def planned(
    case: tuple[StateSplit, int, int, int],
    *,
    layers: int,
    nbs: tuple[int, int],
    pads: tuple[int, int],
    salt: int,
    spacing: int,
) -> tuple[tuple[StatePiece, ...], KVLayout, dict[int, KVLayout]]:
    """A case's consumer layout, its producer ranks' layouts (``spacing`` bytes apart)
    and the consumer rank's :func:`plan_slots` pieces."""
    split, local_tp, remote_tp, rank = case
    local = state_layout(split, local_tp, layers, nbs[0], pads[0], base=1000)
    remotes = {
        p: state_layout(split, remote_tp, layers, nbs[1], pads[1], base=50_000 + spacing * p)
        for p in range(remote_tp)
    }
    pieces = plan_slots(
        local,
        remotes,
        split=split,
        local_tp=local_tp,
        local_rank=rank,
        remote_tp=remote_tp,
        salt=salt,
    )
    return pieces, local, remotes
