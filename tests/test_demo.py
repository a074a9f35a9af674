"""`kvxfer demo` as a user runs it: two processes, real NIXL, verified bytes, JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.proc


def test_demo_json_reports_verified_pull_and_push() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxfer.cli",
            "demo",
            "--tokens",
            "300",
            "--layers",
            "2",
            "--repeat",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] is True
    for direction in ("pull", "push"):
        r = report[direction]
        assert r["verified"] is True
        assert r["blocks_released"] is True
        # 19 blocks (300 tokens, the last partial, sent whole) × 2 layers × K,V × 16 × 8 × 128 × 2B
        assert r["bytes"] == 19 * 2 * 2 * 16 * 8 * 128 * 2
        for key in ("seconds", "gbps", "memcpy_ratio"):
            assert r[key] > 0
    assert report["memcpy_gbps"] > 0
    assert report["push_over_pull"] == pytest.approx(
        report["push"]["gbps"] / report["pull"]["gbps"]
    )
    # The kernel's own copy into and out of another process, measured in the same run.
    for pages in ("huge", "small"):
        rates = report["cma"][pages]
        assert rates["read_gbps"] > 0 and rates["write_gbps"] > 0, rates
        assert rates["write_over_read"] > 0 and rates["huge_pages"] is (pages == "huge")
        # Sized after the bytes the demo moved (2.5 MB here: the 16 MiB floor).
        assert rates["nbytes"] == 16 << 20
    assert report["cache_pages"] in ("huge", "small")


def test_demo_host_bounce_backend() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxfer.cli",
            "demo",
            "--tokens",
            "100",
            "--layers",
            "1",
            "--repeat",
            "1",
            "--backend",
            "host_bounce",
            "--direction",
            "pull",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["pull"]["verified"] is True


def test_demo_rejects_bad_arguments() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "demo", "--tokens", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--tokens" in out.stderr


def test_demo_text_sets_push_over_pull_beside_the_kernels_write_over_read() -> None:
    from kvxfer.tools import demo

    huge = {"write_over_read": 0.72, "write_gbps": 12.4, "read_gbps": 17.2}
    rates = {"thp": "madvise", "huge": huge, "small": {"error": "errno 1"}}
    both = {"push_over_pull": 0.7, "cma": rates, "cache_pages": "huge"}
    text = "\n".join(demo._push_lines(both))
    assert "push over pull: 0.70 (caches on huge pages)" in text
    assert "process_vm_writev over readv" in text
    assert "0.72 on huge pages (12.4 / 17.2 GB/s)" in text
    assert "4 KiB pages not measured: errno 1" in text
    assert demo._push_lines({"cma": rates}) == []  # one direction only: nothing to set beside


def test_demo_text_leaves_the_kernels_copy_out_where_ucx_does() -> None:
    from kvxfer.tools import demo

    tcp = {"push_over_pull": 1.4, "cache_pages": "huge", "ucx_tls": "tcp,self"}
    assert demo._push_lines(tcp) == ["  push over pull: 1.40 (UCX_TLS=tcp,self: no CMA)"]
