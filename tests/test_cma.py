"""The kernel's copy between two processes (``kvxfer.tools.cma``), as the bench and demo take it."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from kvxfer.io import pages
from kvxfer.tools import cma

pytestmark = pytest.mark.proc


@pytest.mark.parametrize("huge", [True, False])
def test_measure_copies_real_bytes_both_ways_against_a_child(huge: bool) -> None:
    rates = cma.measure(nbytes=8 << 20, segment=1 << 20, reps=2, huge_pages=huge)
    assert isinstance(rates, cma.CmaRates), rates  # a refusal here is a failure, not a skip
    assert rates.read_gbps > 0 and rates.write_gbps > 0
    assert rates.write_over_read > 0
    assert (rates.nbytes, rates.segment, rates.huge_pages) == (8 << 20, 1 << 20, huge)
    assert rates.far_huge_pages is huge  # the child's buffer asks as this one does
    assert rates.thp == cma.thp_mode() and rates.thp in ("always", "madvise", "never")


@pytest.mark.parametrize(("here", "far"), [(True, False), (False, True)])
def test_each_side_gets_the_pages_it_asked_for(here: bool, far: bool) -> None:
    rates = cma.measure(nbytes=8 << 20, reps=1, huge_pages=here, far_huge_pages=far)
    assert isinstance(rates, cma.CmaRates), rates
    assert (rates.huge_pages, rates.far_huge_pages) == (here, far)
    # MADV_NOHUGEPAGE is a refusal the kernel always honours; a huge-page ask is
    # granted where the THP mode and free memory allow, and the share says how much.
    small_share = rates.far_huge_share if here else rates.huge_share
    huge_share = rates.huge_share if here else rates.far_huge_share
    assert small_share == 0.0
    assert 0.0 <= huge_share <= 1.0
    if cma.thp_mode() == "never":
        assert huge_share == 0.0


def test_huge_page_share_reads_what_the_kernel_granted_per_mapping() -> None:
    n = 8 << 20
    huge = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
    small = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
    huge.madvise(mmap.MADV_HUGEPAGE)
    small.madvise(mmap.MADV_NOHUGEPAGE)
    huge.write(b"h" * n)
    small.write(b"s" * n)
    h = ctypes.c_char.from_buffer(huge)
    s = ctypes.c_char.from_buffer(small)
    try:
        at_h, at_s = ctypes.addressof(h), ctypes.addressof(s)
        assert pages.huge_page_share([(at_s, at_s + n)]) == 0.0
        share = pages.huge_page_share([(at_h, at_h + n)])
        assert 0.0 <= share <= 1.0
        if pages.thp_mode() == "never":
            assert share == 0.0
        # Both: each range credited with its own mapping's share, weighted by its bytes
        # (read between two reads of the huge one: khugepaged may change it meanwhile).
        both = pages.huge_page_share([(at_s, at_s + n), (at_h, at_h + n // 2)])
        after = pages.huge_page_share([(at_h, at_h + n)])
        assert min(share, after) / 3 - 1e-9 <= both <= max(share, after) / 3 + 1e-9
        # The same for another process's maps, read by pid.
        assert pages.huge_page_share([(at_s, at_s + n)], os.getpid()) == 0.0
    finally:
        del h, s
        huge.close()
        small.close()


def test_huge_page_share_says_unknown_for_what_proc_does_not_show() -> None:
    assert pages.huge_page_share([(4096, 8192)], 2**22 + 12345) == -1.0  # no such process
    assert pages.huge_page_share([(8, 4096)]) == -1.0  # nothing is mapped there
    assert pages.huge_page_share([]) == -1.0
    assert pages.huge_page_share([(4096, 4096)]) == -1.0  # empty ranges say nothing


def test_by_side_measures_every_pairing_of_page_kinds_and_tabulates_them() -> None:
    rows = cma.by_side(nbytes=4 << 20)
    assert [(r["here"], r["far"]) for r in rows] == [
        ("huge", "huge"),
        ("huge", "small"),
        ("small", "huge"),
        ("small", "small"),
    ]
    for r in rows:
        assert "error" not in r, r
        assert (r["huge_pages"], r["far_huge_pages"]) == (r["here"] == "huge", r["far"] == "huge")
    lines = cma.side_table(rows).splitlines()
    assert len(lines) == 5 and lines[0].startswith("this side")
    assert lines[2].startswith("huge pages   4 KiB pages")
    failed = cma.side_table([{"here": "small", "far": "huge", "error": "refused"}])
    assert failed.splitlines()[1].endswith("not measured: refused")


def test_both_page_sizes_as_json_and_one_line() -> None:
    out = cma.by_page_size(nbytes=4 << 20)
    assert out["huge"]["huge_pages"] is True and out["small"]["huge_pages"] is False
    line = cma.describe(out)
    assert "on huge pages (" in line and "on 4 KiB pages (" in line
    assert cma.describe({}) == (
        "huge pages not measured: no figures, 4 KiB pages not measured: no figures"
    )


@pytest.mark.parametrize(
    ("moved", "sample"),
    [
        (0, 16 << 20),
        (2_490_368, 16 << 20),  # the demo test's 300 tokens, 2 layers
        ((16 << 20) + 1, 17 << 20),  # rounded up to whole MiB (the measurement's iovecs)
        (100 << 20, 100 << 20),
        (469_762_048, 128 << 20),  # the demo's default 4096 tokens, 28 layers
    ],
)
def test_the_kernels_sample_follows_the_transfer_within_bounds(moved: int, sample: int) -> None:
    assert cma.sample_bytes(moved) == sample
    assert sample % (1 << 20) == 0  # tiles measure()'s 1 MiB iovecs


@pytest.mark.parametrize(
    ("nbytes", "segment", "reps"), [(0, 1, 1), (10, 3, 1), (8, 4, 0), (8, -4, 1)]
)
def test_measure_rejects_sizes_that_do_not_tile(nbytes: int, segment: int, reps: int) -> None:
    with pytest.raises(ValueError, match="multiple of segment"):
        cma.measure(nbytes=nbytes, segment=segment, reps=reps)


@pytest.mark.parametrize(
    ("thp", "env", "pages"),
    [
        ("always", "0", "huge"),
        ("never", None, "small"),
        ("madvise", None, "huge"),
        ("madvise", "0", "small"),
        ("madvise", "1", "huge"),
    ],
)
def test_numpy_pages_follow_the_kernels_mode_and_numpys_switch(
    monkeypatch: pytest.MonkeyPatch, thp: str, env: str | None, pages: str
) -> None:
    monkeypatch.setattr(cma, "thp_mode", lambda: thp)
    if env is None:
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    else:
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", env)
    assert cma.numpy_pages() == pages


@pytest.mark.parametrize(
    ("tls", "uses"),
    [
        (None, True),
        ("", True),
        ("tcp,self", False),
        ("rc,ud,self", False),
        ("cma,tcp", True),
        ("sm,self", True),
        ("shm", True),
        ("all", True),
        (" TCP , CMA ", True),
        ("^cma", False),
        ("^sm", False),
        ("^tcp", True),
    ],
)
def test_ucx_uses_cma_reads_ucx_tls_as_ucx_does(tls: str | None, uses: bool) -> None:
    assert cma.ucx_uses_cma(tls) is uses


def test_tls_note_names_ucx_tls_and_whether_cma_is_left_out() -> None:
    assert cma.tls_note(None) == ""
    assert cma.tls_note("cma,tcp") == " (UCX_TLS=cma,tcp)"
    assert cma.tls_note("tcp,self") == " (UCX_TLS=tcp,self: no CMA)"
