"""Properties of the block-size-ratio planner (kvxfer.core.ratio, issue 54): for any
whole ratio either way, any in-block order kvxfer can cut (token-major, head-major,
vLLM CPU's K element-major), any prefix hit and any block ids, the runs a pull posts
write every consumer byte of the request's units exactly once, each from the producer
byte of the same token, head, element and part, and write nothing else.

The reference here addresses a token's bytes from the in-block orders' definitions
(kvxfer.core.layout.BlockInterior), not from the planner's slices, and checks by
copying real bytes; mutants of ratio.py die here (scripts/mutation.sh ratio)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvxfer.core.layout import (
    BlockInterior,
    Group,
    GroupKind,
    KVLayout,
    KVPart,
    Region,
    SplitAxis,
)
from kvxfer.core.ratio import (
    check_ratio,
    covered_blocks,
    pair_units,
    ratio_pieces,
    slices_per_unit,
    unit_runs,
)
from kvxfer.errors import LayoutMismatch, PlanError

#: One drawn case: shape, block sizes, token counts and block lists.
Case = dict[str, Any]
ORDERS = ["NHD", "HND", "KEM"]  # token-major, head-major, K element-major


@dataclass(frozen=True)
class Shape:
    order: str
    heads: int
    dim: int
    elem: int
    layers: int
    groups: int

    def parts(self) -> list[KVPart]:
        return [KVPart.KV] if self.order == "KEM" else [KVPart.K, KVPart.V]

    def block_len(self, bs: int) -> int:
        per_token = self.heads * self.dim * self.elem
        return per_token * bs * (2 if self.order == "KEM" else 1)

    def layout(self, bs: int, num_blocks: int, gap: int, device: int = 0) -> KVLayout:
        """Regions back to back in one buffer (``gap`` bytes between blocks); layer
        *i*'s on device ``device + i`` (the runs must carry each region's)."""
        regions, base = [], 0
        blen = self.block_len(bs)
        for layer in range(self.layers):
            for part in self.parts():
                regions.append(
                    Region(
                        base=base,
                        num_blocks=num_blocks,
                        stride=blen + gap,
                        block_len=blen,
                        layer=layer,
                        part=part,
                        group=layer % self.groups,
                        device_id=device + layer,
                    )
                )
                base += num_blocks * (blen + gap)
        return KVLayout(
            block_size=bs,
            regions=tuple(regions),
            groups=tuple(Group(kind=GroupKind.FULL) for _ in range(self.groups)),
            kv_layout="HND" if self.order == "HND" else "NHD",
            num_kv_heads=self.heads,
            head_dim=self.dim,
            interior=(
                BlockInterior.K_ELEMENT_MAJOR if self.order == "KEM" else BlockInterior.PLAIN
            ),
            dtype="float32",
        )

    def token_bytes(self, bs: int) -> npt.NDArray[np.int64]:
        """``[t, f]``: the offset in a block of byte ``f`` of token ``t`` (every head,
        element and, packed, both parts), from BlockInterior's definitions."""
        h, d, e = np.meshgrid(
            np.arange(self.heads), np.arange(self.dim), np.arange(self.elem), indexing="ij"
        )
        h, d, e = h.ravel(), d.ravel(), e.ravel()
        t = np.arange(bs)[:, None]
        if self.order == "NHD":  # token, head, element
            offsets = t * (self.heads * self.dim * self.elem) + (h * self.dim + d) * self.elem + e
        elif self.order == "HND":  # head, token, element
            offsets = (h * bs + t) * self.dim * self.elem + d * self.elem + e
        else:
            per_head = 2 * bs * self.dim * self.elem
            k = h * per_head + (d * bs + t) * self.elem + e  # keys: element rows of tokens
            v = h * per_head + (bs * self.dim + t * self.dim + d) * self.elem + e  # values
            offsets = np.concatenate((k, v), axis=1)
        return np.asarray(offsets, dtype=np.int64)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    shape = Shape(
        order=draw(st.sampled_from(ORDERS)),
        heads=draw(st.integers(1, 3)),
        dim=draw(st.integers(1, 3)),
        elem=draw(st.sampled_from([1, 2, 4])),
        layers=draw(st.integers(1, 2)),
        groups=draw(st.integers(1, 2)),
    )
    shape = Shape(**{**shape.__dict__, "groups": min(shape.groups, shape.layers)})
    g = draw(st.sampled_from([1, 2, 4]))
    k = draw(st.sampled_from([1, 2, 4, 8]))
    local_big = draw(st.booleans())
    lbs, rbs = (g * k, g) if local_big else (g, g * k)
    remote_tokens = draw(st.integers(1, 6 * g * k))
    num_tokens = draw(st.integers(1, remote_tokens))
    wanted = -(-num_tokens // lbs)
    held = -(-remote_tokens // rbs)
    lnb, rnb = wanted + draw(st.integers(0, 4)), held + draw(st.integers(0, 4))
    local_lists, remote_lists = [], []
    for _ in range(shape.groups):
        # A group may have all its blocks cached (nothing to move in it) unless it is
        # the only one.
        cached = draw(st.integers(0, wanted - (1 if shape.groups == 1 else 0)))
        # The producer may have dropped leading blocks no local unit needs.
        first_unit = cached * (lbs // g)
        dropped = draw(st.integers(0, first_unit // (rbs // g)))
        local_lists.append(tuple(draw(st.permutations(range(lnb)))[: wanted - cached]))
        remote_lists.append(tuple(draw(st.permutations(range(rnb)))[dropped:held]))
    return {
        "shape": shape,
        "lbs": lbs,
        "rbs": rbs,
        "num_tokens": num_tokens,
        "remote_tokens": remote_tokens,
        "lnb": lnb,
        "rnb": rnb,
        "local": tuple(local_lists),
        "remote": tuple(remote_lists),
        "gaps": (draw(st.integers(0, 3)), draw(st.integers(0, 3))),
    }


@given(cases())
def test_every_unit_byte_lands_once_from_the_same_token_and_nothing_else(c: Case) -> None:
    shape: Shape = c["shape"]
    lbs, rbs, n = c["lbs"], c["rbs"], c["num_tokens"]
    local = shape.layout(lbs, c["lnb"], c["gaps"][0])
    remote = shape.layout(rbs, c["rnb"], c["gaps"][1], device=5)
    assert check_ratio(local, remote) == min(lbs, rbs)
    pairing = pair_units(
        c["local"],
        c["remote"],
        num_tokens=n,
        remote_num_tokens=c["remote_tokens"],
        local_block_size=lbs,
        remote_block_size=rbs,
    )
    assert (pairing.local, pairing.remote, pairing.num_tokens) == (c["local"], c["remote"], n)
    assert (pairing.local_block_size, pairing.remote_block_size, pairing.unit) == (
        lbs,
        rbs,
        min(lbs, rbs),
    )
    for units in pairing.units:
        assert all(a.dtype == np.int64 for a in units)
    runs = unit_runs(local, remote, pairing)
    assert runs.local_addr.dtype == runs.remote_addr.dtype == runs.length.dtype == np.uint64
    assert runs.local_device.dtype == runs.remote_device.dtype == np.int64
    rng = np.random.default_rng(n)
    rmem = rng.integers(
        0, 256, size=remote.regions[-1].base + c["rnb"] * remote.regions[-1].stride, dtype=np.uint8
    )
    size = local.regions[-1].base + c["lnb"] * local.regions[-1].stride
    sentinel = rng.integers(0, 256, size=size, dtype=np.uint8)
    lmem = sentinel.copy()
    writes = np.zeros(size, dtype=np.int64)
    region_of = {(r.base, r.base + c["lnb"] * r.stride): r for r in local.regions}
    for la, ra, ln, ld, rd in zip(
        runs.local_addr,
        runs.remote_addr,
        runs.length,
        runs.local_device,
        runs.remote_device,
        strict=True,
    ):
        la, ra, ln = int(la), int(ra), int(ln)
        assert ln > 0
        (lr,) = [r for (lo, hi), r in region_of.items() if lo <= la < hi]
        assert (int(ld), int(rd)) == (lr.device_id, lr.device_id + 5), "a run's devices"
        lmem[la : la + ln] = rmem[ra : ra + ln]
        writes[la : la + ln] += 1
    assert writes.max(initial=0) <= 1, "a consumer byte written twice"

    g = min(lbs, rbs)
    end = -(-n // g) * g  # the last unit's end: the pull's tokens, rounded up to a unit
    ltok, rtok = shape.token_bytes(lbs), shape.token_bytes(rbs)
    expected_writes = 0
    wanted, held = -(-n // lbs), -(-c["remote_tokens"] // rbs)
    for lr, rr in zip(local.regions, remote.regions, strict=True):
        mine, theirs = c["local"][lr.group], c["remote"][lr.group]
        first_local, first_remote = wanted - len(mine), held - len(theirs)
        for i, block in enumerate(mine):
            for t in range(lbs):
                pos = (first_local + i) * lbs + t
                at = lr.base + block * lr.stride + ltok[t]
                if pos >= end:
                    assert (writes[at] == 0).all(), f"token {pos} past the units written"
                    continue
                rb = theirs[pos // rbs - first_remote]
                src = rr.base + rb * rr.stride + rtok[pos % rbs]
                assert (writes[at] == 1).all(), f"token {pos} of block {block} not written"
                assert (lmem[at] == rmem[src]).all(), f"token {pos} from the wrong bytes"
                expected_writes += len(at)
    assert int(writes.sum()) == expected_writes, "bytes written outside the request's tokens"
    # Between blocks (the stride's gap) and in unlisted blocks: untouched.
    assert (lmem[writes == 0] == sentinel[writes == 0]).all()
    # Runs are merged: no two are contiguous on both sides.
    order = np.argsort(runs.local_addr)
    la, ra, ln = runs.local_addr[order], runs.remote_addr[order], runs.length[order]
    ld, rd = runs.local_device[order], runs.remote_device[order]
    joined = (la[:-1] + ln[:-1] == la[1:]) & (ra[:-1] + ln[:-1] == ra[1:])
    assert not (joined & (ld[:-1] == ld[1:]) & (rd[:-1] == rd[1:])).any()
    # covered_blocks: the listed local blocks that receive bytes, in request order.
    for gi, blocks in enumerate(covered_blocks(pairing)):
        mine = c["local"][gi]
        first_local = wanted - len(mine)
        assert list(blocks) == [b for i, b in enumerate(mine) if (first_local + i) * lbs < end]


@given(cases())
def test_slices_per_unit_counts_the_ranges_one_unit_occupies(c: Case) -> None:
    shape: Shape = c["shape"]
    layout = shape.layout(c["lbs"], c["lnb"], 0)
    per_unit = {"NHD": 1, "HND": shape.heads, "KEM": shape.heads * (shape.dim + 1)}[shape.order]
    assert list(slices_per_unit(layout)) == [per_unit] * len(layout.regions)


@given(cases())
def test_a_remote_list_that_misses_needed_units_is_refused(c: Case) -> None:
    mine, theirs = c["local"][0], c["remote"][0]
    assume(len(theirs) >= 1 and len(mine) >= 1)
    lbs, rbs, n = c["lbs"], c["rbs"], c["num_tokens"]
    g = min(lbs, rbs)
    first_local = -(-n // lbs) - len(mine)
    first_remote = -(-c["remote_tokens"] // rbs) - len(theirs) + 1  # one more dropped

    def pair() -> object:
        return pair_units(
            c["local"],
            (theirs[1:], *c["remote"][1:]),
            num_tokens=n,
            remote_num_tokens=c["remote_tokens"],
            local_block_size=lbs,
            remote_block_size=rbs,
        )

    if first_local * lbs < first_remote * rbs:
        with pytest.raises(PlanError, match="remote group 0") as e:
            pair()
        assert f"blocks of {rbs}" in str(e.value) and f"of {lbs} need" in str(e.value)
    else:
        units = pair().units[0]  # type: ignore[attr-defined]
        assert len(units.local_block) == -(-n // g) - first_local * (lbs // g)


@given(st.integers(1, 512), st.integers(1, 512))
def test_ratio_pieces_serves_whole_multiples_and_names_both_sizes_otherwise(a: int, b: int) -> None:
    small, big = sorted((a, b))
    if big % small:
        with pytest.raises(LayoutMismatch) as e:
            ratio_pieces(a, b)
        assert str(a) in str(e.value) and str(b) in str(e.value)
        return
    g, ka, kb = ratio_pieces(a, b)
    assert g == small and ka * g == a and kb * g == b and min(ka, kb) == 1


@given(cases(), st.integers(1, 3))
def test_different_tp_sizes_and_shapes_are_refused(c: Case, other: int) -> None:
    shape: Shape = c["shape"]
    local = shape.layout(c["lbs"], c["lnb"], 0)
    remote = shape.layout(c["rbs"], c["rnb"], 0)
    with pytest.raises(LayoutMismatch, match="TP 1 with TP 2"):
        check_ratio(local, remote, local_tp_size=1, remote_tp_size=2)
    wider = Shape(**{**shape.__dict__, "dim": shape.dim + other}).layout(c["rbs"], c["rnb"], 0)
    with pytest.raises(LayoutMismatch):
        check_ratio(local, wider)


def _plain(bs: int, **kw: Any) -> KVLayout:
    regions = kw.pop("regions", None) or (
        Region(base=0, num_blocks=4, stride=bs * 16, block_len=bs * 16, part=KVPart.K),
        Region(base=1 << 20, num_blocks=4, stride=bs * 16, block_len=bs * 16, part=KVPart.V),
    )
    return KVLayout(block_size=bs, regions=regions, **{"dtype": "float32", **kw})


def _refusal(local: KVLayout, remote: KVLayout, **kw: Any) -> str:
    with pytest.raises(LayoutMismatch) as e:
        check_ratio(local, remote, **kw)
    assert e.value.field.startswith("block_size (")
    assert (e.value.local, e.value.remote) == (local.block_size, remote.block_size)
    return str(e.value)


def test_each_refusal_names_its_side_its_rule_and_both_sizes() -> None:
    """What check_ratio refuses, each with the side it found it on (examples: the
    properties above draw only layouts a ratio serves)."""
    state = (Group(kind=GroupKind.STATE),)
    assert "the local layout has a recurrent-state group" in _refusal(
        _plain(64, groups=state), _plain(16)
    )
    assert "the remote layout has a recurrent-state group" in _refusal(
        _plain(64), _plain(16, groups=state)
    )
    token2 = {"split_axis": SplitAxis.TOKEN, "num_shards": 2}
    assert "the remote layout splits blocks into 2 token shards" in _refusal(
        _plain(64), _plain(16, **token2)
    )
    assert "the local layout splits blocks into 2 token shards" in _refusal(
        _plain(64, **token2), _plain(16)
    )
    # One token shard, or head shards, are no split of the token range.
    assert (
        check_ratio(_plain(64, split_axis=SplitAxis.TOKEN), _plain(16, split_axis=SplitAxis.TOKEN))
        == 16
    )
    heads2 = {"split_axis": SplitAxis.HEAD, "num_shards": 2}
    regions = tuple(
        msgspec.structs.replace(r, shard=s) for r in _plain(16).regions for s in range(2)
    )
    assert (
        check_ratio(
            _plain(
                64,
                **heads2,
                regions=tuple(
                    msgspec.structs.replace(r, block_len=r.block_len * 4, stride=r.stride * 4)
                    for r in regions
                ),
            ),
            _plain(16, **heads2, regions=regions),
        )
        == 16
    )
    hnd = {"kv_layout": "HND"}
    assert "the local layout: a head-major block whose head count per region is not known" in (
        _refusal(_plain(64, **hnd), _plain(16))
    )
    # One head per region: head-major is token-major.
    assert check_ratio(_plain(64, **hnd, num_kv_heads=1), _plain(16, **hnd, num_kv_heads=1)) == 16
    packed = tuple(msgspec.structs.replace(r, part=KVPart.KV) for r in _plain(16).regions[:1])
    assert "head-major regions pack K and V per head in an order not stated" in _refusal(
        _plain(
            64,
            regions=tuple(
                msgspec.structs.replace(r, block_len=r.block_len * 4, stride=r.stride * 4)
                for r in packed
            ),
            **hnd,
            num_kv_heads=2,
        ),
        _plain(16, regions=packed, **hnd, num_kv_heads=2),
    )
    assert (
        check_ratio(
            _plain(
                64,
                regions=tuple(
                    msgspec.structs.replace(r, block_len=r.block_len * 4, stride=r.stride * 4)
                    for r in packed
                ),
                **hnd,
                num_kv_heads=1,
            ),
            _plain(16, regions=packed, **hnd, num_kv_heads=1),
        )
        == 16
    )
    assert "kv_layout 'XYZ' is not one whose token order is known" in _refusal(
        _plain(64, kv_layout="XYZ"), _plain(16)
    )
    assert "the remote layout: its in-block token order is not stated for every region" in (
        _refusal(_plain(64), _plain(16, interior=BlockInterior.OPAQUE))
    )
    kem = {"interior": BlockInterior.K_ELEMENT_MAJOR}
    for heads, dim in ((0, 2), (2, 0)):
        assert "interior k_element_major needs num_kv_heads and head_dim" in _refusal(
            _plain(64), _plain(16, **kem, num_kv_heads=heads, head_dim=dim)
        )
    # K and V regions (not packed), or a packed block that is not heads x 2 x tokens x dim.
    assert "region of layer 0 K is not 2 packed K/V heads of 2 elements" in _refusal(
        _plain(64), _plain(16, **kem, num_kv_heads=2, head_dim=2)
    )
    odd = (Region(base=0, num_blocks=4, stride=16 * 20, block_len=16 * 20),)
    assert "region of layer 0 KV is not 2 packed K/V heads of 2 elements" in _refusal(
        _plain(64), _plain(16, regions=odd, **kem, num_kv_heads=2, head_dim=2)
    )
    # Shapes that differ once described at the unit: the field and both values.
    with pytest.raises(LayoutMismatch) as e:
        check_ratio(_plain(64), _plain(16, dtype="bfloat16"))
    assert e.value.field == "dtype (described at 16 tokens per block)"
    assert (e.value.local, e.value.remote) == ("float32", "bfloat16")


def test_unit_runs_refuses_layouts_the_pairing_was_not_made_for() -> None:
    pairing = pair_units(
        ((0, 1),),
        ((2,),),
        num_tokens=30,
        remote_num_tokens=30,
        local_block_size=16,
        remote_block_size=32,
    )
    with pytest.raises(PlanError) as e:
        unit_runs(_plain(16), _plain(64), pairing)
    assert str(e.value) == (
        "unit pairing of blocks of 16 (local) and 32 (remote) planned on layouts of 16 and 64"
    )
    with pytest.raises(PlanError) as e:
        unit_runs(_plain(16), _plain(32, regions=_plain(32).regions[:1]), pairing)
    assert str(e.value) == "2 local and 1 remote regions do not pair"
    kem = _plain(
        32,
        interior=BlockInterior.K_ELEMENT_MAJOR,
        num_kv_heads=1,
        head_dim=2,
        regions=tuple(
            Region(base=b, num_blocks=4, stride=32 * 16, block_len=32 * 16, layer=b) for b in (0, 1)
        ),
    )
    with pytest.raises(PlanError) as e:
        unit_runs(_plain(16), kem, pairing)
    assert str(e.value) == "region of layer 0 K: 1 local and 3 remote slices per unit do not pair"


def test_pair_units_names_the_request_and_both_ranges() -> None:
    with pytest.raises(PlanError) as e:
        pair_units(
            ((0,),),
            ((0,), (1,)),
            num_tokens=8,
            remote_num_tokens=8,
            local_block_size=16,
            remote_block_size=32,
            request_id="r1",
        )
    assert str(e.value) == "remote block_ids of 'r1': 2 KV group(s), the local block_ids 1"
    with pytest.raises(PlanError) as e:
        pair_units(
            ((0,),),
            ((0,),),
            num_tokens=9,
            remote_num_tokens=8,
            local_block_size=16,
            remote_block_size=32,
            request_id="r1",
        )
    assert str(e.value) == "num_tokens=9: more than the ticket's 8 tokens (request 'r1')"
    with pytest.raises(PlanError) as e:
        pair_units(
            ((0, 1, 2, 3),),
            ((5,),),
            num_tokens=64,
            remote_num_tokens=64,
            local_block_size=16,
            remote_block_size=32,
            request_id="r1",
        )
    assert str(e.value) == (
        "remote group 0: the ticket of 'r1' holds tokens 32..64 in blocks of 32; the 4 local "
        "block(s) of 16 need tokens 0..64"
    )
    # Without an id the messages name the empty one; remote_num_tokens 0 is "as many".
    assert (
        len(
            pair_units(
                ((0,),),
                ((0,),),
                num_tokens=8,
                remote_num_tokens=0,
                local_block_size=16,
                remote_block_size=32,
            )
            .units[0]
            .local_block
        )
        == 1
    )
