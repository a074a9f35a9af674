"""The kernel's copy between two processes (``kvxfer.tools.cma``), as the bench and demo take it."""

from __future__ import annotations

import pytest

from kvxfer.tools import cma

pytestmark = pytest.mark.proc


@pytest.mark.parametrize("huge", [True, False])
def test_measure_copies_real_bytes_both_ways_against_a_child(huge: bool) -> None:
    rates = cma.measure(nbytes=8 << 20, segment=1 << 20, reps=2, huge_pages=huge)
    assert isinstance(rates, cma.CmaRates), rates  # a refusal here is a failure, not a skip
    assert rates.read_gbps > 0 and rates.write_gbps > 0
    assert rates.write_over_read > 0
    assert (rates.nbytes, rates.segment, rates.huge_pages) == (8 << 20, 1 << 20, huge)
    assert rates.thp == cma.thp_mode() and rates.thp in ("always", "madvise", "never")


def test_both_page_sizes_as_json_and_one_line() -> None:
    out = cma.by_page_size(nbytes=4 << 20)
    assert out["huge"]["huge_pages"] is True and out["small"]["huge_pages"] is False
    line = cma.describe(out)
    assert "on huge pages (" in line and "on 4 KiB pages (" in line
    assert cma.describe({}) == (
        "huge pages not measured: no figures, 4 KiB pages not measured: no figures"
    )


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
