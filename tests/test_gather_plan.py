"""Properties of the gather path's staging rounds (kvxfer.core.gather_plan, issue 55).

For any request's runs (scattered or contiguous blocks of any sizes on both sides) and
any staging size, staging in rounds lands exactly the bytes the direct transfer lands:
each round is executed here on real host memory (the producer's gather into its
staging buffer, one move between the two buffers, the consumer's scatter), checked
against the direct runs copied one by one, with every byte outside them untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.core.descriptors import Runs
from kvxfer.core.gather_plan import Copies, staging_rounds
from kvxfer.errors import PlanError

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Request:
    """Runs over two host buffers: offsets into ``remote`` pair with ``local``'s."""

    remote_off: list[int]
    local_off: list[int]
    length: list[int]
    size: int  # bytes of each buffer

    def runs(self, remote_base: int, local_base: int) -> Runs:
        n = len(self.length)
        return Runs(
            local_addr=np.array(self.local_off, dtype=np.uint64) + np.uint64(local_base),
            remote_addr=np.array(self.remote_off, dtype=np.uint64) + np.uint64(remote_base),
            length=np.array(self.length, dtype=np.uint64),
            local_device=np.zeros(n, dtype=np.int64),
            remote_device=np.zeros(n, dtype=np.int64),
        )


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """Blocks of drawn sizes laid out in one order on the producer and in another
    (scattered, or contiguous runs of them) on the consumer, with gaps between."""
    sizes = draw(st.lists(st.integers(1, 40), min_size=0, max_size=40))
    gaps = st.integers(0, 3)

    def place(order: list[int]) -> tuple[list[int], int]:
        off, pos = [0] * len(sizes), 0
        for i in order:
            pos += draw(gaps)
            off[i] = pos
            pos += sizes[i]
        return off, pos

    idx = list(range(len(sizes)))
    remote, r_end = place(draw(st.permutations(idx)))
    local, l_end = place(draw(st.sampled_from([idx, draw(st.permutations(idx))])))
    return Request(remote, local, sizes, max(r_end, l_end, 1))


def _view(buf: Bytes, base: int, addr: int, n: int) -> Bytes:
    return buf[addr - base : addr - base + n]


def _run_staged(req: Request, staging: int) -> tuple[Bytes, int]:
    """The consumer's buffer after the staged transfer, and the rounds it took."""
    src = np.random.default_rng(1).integers(1, 256, req.size, dtype=np.uint8)
    dst = np.zeros(req.size, dtype=np.uint8)
    # Addresses as a transport sees them: far apart, the producer's above 2**40.
    rb, lb = 1 << 40, 1 << 20
    plan = staging_rounds(req.runs(rb, lb), staging)
    p_stage = np.zeros(staging, dtype=np.uint8)
    c_stage = np.zeros(staging, dtype=np.uint8)

    def check_cover(c: Copies, nbytes: int) -> None:
        # The round's copies tile its staging bytes [0, nbytes) in order, once each.
        ends = c.offset + c.length
        assert int(c.offset[0]) == 0 and int(ends[-1]) == nbytes
        assert (c.offset[1:] == ends[:-1]).all()
        # Maximal merging: no two neighbours continue each other's engine bytes.
        assert not (c.addr[1:] == c.addr[:-1] + c.length[:-1]).any()

    for rnd in plan.rounds:
        assert 0 < rnd.nbytes <= staging
        check_cover(rnd.remote, rnd.nbytes)
        check_cover(rnd.local, rnd.nbytes)
        p_stage[:] = 0  # a round never reads a byte an earlier round left behind
        for a, o, n in zip(
            *(x.tolist() for x in (rnd.remote.addr, rnd.remote.offset, rnd.remote.length))
        ):
            p_stage[o : o + n] = _view(src, rb, a, n)
        c_stage[: rnd.nbytes] = p_stage[: rnd.nbytes]  # the one run the transport moves
        for a, o, n in zip(
            *(x.tolist() for x in (rnd.local.addr, rnd.local.offset, rnd.local.length))
        ):
            _view(dst, lb, a, n)[:] = c_stage[o : o + n]
    direct = np.zeros(req.size, dtype=np.uint8)
    for r, loc, n in zip(req.remote_off, req.local_off, req.length):
        direct[loc : loc + n] = src[r : r + n]
    assert np.array_equal(dst, direct)
    return dst, len(plan.rounds)


@given(requests(), st.integers(1, 200))
def test_staged_rounds_land_exactly_the_direct_bytes(req: Request, staging: int) -> None:
    _, rounds = _run_staged(req, staging)
    assert rounds == -(-sum(req.length) // staging)


@given(requests(), st.integers(1, 200))
def test_pieces_are_bounded_by_runs_and_round_cuts(req: Request, staging: int) -> None:
    plan = staging_rounds(req.runs(1 << 40, 1 << 20), staging)
    runs = len(req.length)
    # Every piece starts at a run's start or at a round's start.
    assert plan.local_pieces <= runs + max(len(plan.rounds) - 1, 0)
    assert plan.remote_pieces <= runs + max(len(plan.rounds) - 1, 0)
    assert plan.nbytes == sum(req.length)
    assert plan.staging_bytes == staging


def test_contiguous_side_is_one_copy_per_round() -> None:
    # Consumer blocks contiguous, producer's scattered: the consumer scatters in one
    # piece per round, the producer gathers one per block.
    req = Request(
        remote_off=[300, 0, 200, 100], local_off=[0, 10, 20, 30], length=[10] * 4, size=400
    )
    plan = staging_rounds(req.runs(1 << 40, 1 << 20), 20)
    assert [len(r.local) for r in plan.rounds] == [1, 1]
    assert [len(r.remote) for r in plan.rounds] == [2, 2]


def test_a_run_longer_than_staging_goes_in_rounds() -> None:
    req = Request(remote_off=[0], local_off=[0], length=[100], size=100)
    plan = staging_rounds(req.runs(1 << 40, 1 << 20), 32)
    assert [r.nbytes for r in plan.rounds] == [32, 32, 32, 4]
    assert [int(r.local.addr[0]) - (1 << 20) for r in plan.rounds] == [0, 32, 64, 96]


def test_empty_request_has_no_rounds() -> None:
    assert staging_rounds(Request([], [], [], 1).runs(1 << 40, 1 << 20), 8).rounds == ()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "8"])
def test_staging_size_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(PlanError, match="staging_bytes"):
        staging_rounds(Request([0], [0], [4], 4).runs(1 << 40, 1 << 20), bad)  # type: ignore[arg-type]


def test_an_empty_run_is_refused() -> None:
    with pytest.raises(PlanError, match="run 1 is empty"):
        staging_rounds(Request([0, 4], [0, 4], [4, 0], 8).runs(1 << 40, 1 << 20), 8)
