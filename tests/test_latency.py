"""kvxfer.tools.latency: two real processes, kvxfer vs raw NIXL vs a gather, checked bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer.tools import latency


def test_small_request_latency_rows_for_every_size() -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    spec = latency.LatencySpec(blocks=(1, 3), reps=3, layers=1, token_bytes=64)
    rows = latency.measure_latency(spec)
    assert [r.blocks for r in rows] == [1, 3]
    for r in rows:
        # every block is whole: one descriptor per region, block_len bytes each
        assert r.descriptors == 2 * r.blocks
        assert r.bytes == 2 * r.blocks * spec.block_len
        for cell in (r.kvxfer_us, r.pull_return_us, r.raw_nixl_us, r.raw_bare_us, r.gather_us):
            assert 0 < cell[1] <= cell[0] <= cell[2]
        assert r.pull_return_us[0] <= r.kvxfer_us[0] * 1.5
    text = latency.format_rows(rows)
    assert len(text.splitlines()) == 3 and "raw, no notif" in text


def test_bytes_that_did_not_land_are_an_error() -> None:
    spec = latency.LatencySpec(blocks=(2,), layers=1)
    regions = latency.empty_regions(spec)
    local, remote = np.array([0, 1]), np.array([4, 5])
    for i, a in enumerate(regions):
        a[local] = latency.pattern(spec, i)[remote]
    latency.check_landed(spec, regions, local, remote, "test")
    regions[1][1, 7] ^= 1
    with pytest.raises(RuntimeError, match="region 1 does not hold"):
        latency.check_landed(spec, regions, local, remote, "test")


def test_cli_refuses_nonsense() -> None:
    with pytest.raises(SystemExit):
        latency.main(["--reps", "0"])
    with pytest.raises(SystemExit):
        latency.main(["--blocks", "0"])
