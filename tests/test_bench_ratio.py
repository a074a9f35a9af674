"""``kvxfer bench --block-ratios``: pulls between block sizes beside raw NIXL, memcpy and
the equal-size pull of the same bytes (kvxfer.tools.bench.block_ratio). Fields and
bytes are checked here, never timings."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvxfer.core.descriptors import Runs
from kvxfer.testing.kvcache import HostKVCache
from kvxfer.tools.bench import block_ratio, report
from kvxfer.tools.bench import cases as bc
from kvxfer.tools.bench import cli as bench
from kvxfer.tools.bench.data import WORD_FACTOR, fill_regions, verify_regions
from kvxfer.tools.bench.runner import RESULT_FIELDS, assemble
from tests.benchkit import rereport


def _ratio(p: int, c: int, **kw: Any) -> bc.Case:
    base: dict[str, Any] = {
        "model": bc.QWEN,
        "block_size": p,
        "consumer_block_size": c,
        "tokens": 300,
        "pattern": "contiguous",
        "direction": "pull",
        "backend": "ucx",
    }
    return bc.Case(**{**base, **kw})


def test_the_option_takes_whole_multiples_either_way() -> None:
    assert block_ratio.parse_ratios("128:16, 128:64,16:128,128:16") == [
        (128, 16),
        (128, 64),
        (16, 128),
    ]
    for text, says in (
        ("48:32", "neither size divides the other"),
        ("16:16", "equal sizes"),
        ("128-16", "not P:C"),
        ("0:16", "must be positive"),
        (",", "no P:C pair"),
    ):
        with pytest.raises(ValueError, match=says):
            block_ratio.parse_ratios(text)


def test_every_ratio_comes_with_the_equal_pull_of_the_same_bytes() -> None:
    cases = block_ratio.build_cases(
        ratios=[(128, 16), (128, 64), (16, 128)],
        models=[bc.QWEN],
        tokens=[4000],
        patterns=["contiguous"],
    )
    assert [c.label for c in cases] == [
        "qwen3-0.6b bs128:16 4000t contiguous pull ucx",
        "qwen3-0.6b bs16 4000t contiguous pull ucx",
        "qwen3-0.6b bs128:64 4000t contiguous pull ucx",
        "qwen3-0.6b bs64 4000t contiguous pull ucx",
        "qwen3-0.6b bs16:128 4000t contiguous pull ucx",
    ]
    by = {c.label: c for c in cases}
    for c in cases:
        if c.is_ratio:
            equal = by[c.label.replace(f"bs{c.block_size}:{c.consumer_block_size}", f"bs{c.unit}")]
            assert bc.expected_bytes(c) == bc.expected_bytes(equal)
            assert c.fields()["block_ratio"] == f"{c.block_size}:{c.consumer_block_size}"
            assert c.cache_key != equal.cache_key and c.agent_key != equal.agent_key
    case = by["qwen3-0.6b bs128:16 4000t contiguous pull ucx"]
    assert len(bc.case_blocks(case, "remote")) == 32  # 4000 tokens in blocks of 128
    assert len(bc.case_blocks(case, "local")) == 250  # ... and of 16
    with pytest.raises(ValueError, match="unknown model"):
        block_ratio.build_cases(
            ratios=[(128, 16)], models=["x"], tokens=[1], patterns=["contiguous"]
        )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tp"], "not with --tp"),
        (["--backends", "host_bounce"], "not with --backends"),
        (["--block-sizes", "16", "--directions", "push"], "--block-sizes, --directions"),
    ],
)
def test_what_a_ratio_case_fixes_is_refused_before_any_process_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--block-ratios", "128:16", *argv]) == 2
    assert says in capsys.readouterr().err


def test_a_pair_neither_of_which_divides_the_other_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.main(["--block-ratios", "128:48", "--no-planning"]) == 2
    assert "128:48: neither size divides the other" in capsys.readouterr().err


@pytest.mark.parametrize(("p", "c", "tokens"), [(128, 16, 300), (16, 128, 300), (64, 32, 1)])
def test_the_planned_runs_move_every_token_to_its_position_and_verify(
    p: int, c: int, tokens: int
) -> None:
    case = _ratio(p, c, tokens=tokens, pattern="scattered")
    shape = case.shape
    prod = HostKVCache(shape, p, bc.num_blocks_for(case, "remote"))
    cons = HostKVCache(shape, c, bc.num_blocks_for(case, "local"))
    fill_regions(prod.regions)
    local, remote = bc.case_blocks(case, "local"), bc.case_blocks(case, "remote")
    runs = block_ratio.pull_runs(case, cons.layout(), prod.layout(), local, remote)
    assert runs.nbytes == bc.expected_bytes(case)[0]
    addrs = block_ratio.split_at_regions(runs, cons.layout(), prod.layout())

    def check() -> int:
        return verify_regions(cons.regions, *addrs, prod.layout(), [local] * len(cons.regions))

    assert check() > 0  # nothing moved yet
    for la, ra, n in zip(*(a.tolist() for a in addrs)):
        ctypes.memmove(la, ra, n)
    assert check() == 0
    # Independently of the planner: token t of the request sits at its position in the
    # consumer's block list, holding the producer's word ids of the same token.
    words = shape.token_bytes() // 8
    t = np.arange(tokens)
    for r, region in enumerate(cons.regions):
        got = region.view(np.uint64).reshape(-1, c, words)[local[t // c], t % c]
        ids = (remote[t // p] * p + t % p)[:, None] * words + np.arange(words)
        want = (ids.astype(np.uint64) + np.uint64(r << 40)) * np.uint64(WORD_FACTOR)
        assert (got == want).all(), f"region {r}"
    cons.regions[1][local[0], 5] ^= 1
    assert check() == 1


def test_runs_merged_across_back_to_back_regions_are_cut_for_the_check() -> None:
    case = _ratio(32, 16, tokens=32)
    a, b = HostKVCache(case.shape, 16, 4), HostKVCache(case.shape, 32, 4)
    la, lb = a.layout(), b.layout()
    end = la.regions[0].end
    one = np.array([8], dtype=np.uint64)
    runs = Runs(
        np.array([end - 8], dtype=np.uint64),
        np.array([lb.regions[0].base], dtype=np.uint64),
        np.array([16], dtype=np.uint64),
        np.zeros(1, dtype=np.int64),
        np.zeros(1, dtype=np.int64),
    )
    got = block_ratio.split_at_regions(runs, la, lb)
    assert [x.tolist() for x in got] == [
        [end - 8, end],
        [lb.regions[0].base, lb.regions[0].base + 8],
        (one.tolist() * 2),
    ]


def _measured(case: bc.Case, seconds: float, memcpy: float | None = None) -> dict[str, Any]:
    moved, _ = bc.expected_bytes(case)
    stats = {"bytes": moved, "descriptors": 10, "plan_s": 0.001, "post_s": 0.01}
    first = {"s": 0.5, "bad": 0, "stats": stats, "handshakes": 1}
    raw_first = {"s": 0.4, "bad": 0, "descriptors": 10, "runs": 10}
    details = [{"s": seconds, "stats": stats, "hold_s": 0.0, "handshakes": 1, "freed": True}]
    raw = [{"s": seconds, "s_prepped": seconds, "ids_s": 0.0, "xfer_s": seconds}]
    mc = [memcpy or seconds]
    return assemble(case, first, raw_first, details, [seconds], [seconds], mc, 0.01, raw)


def test_a_ratio_is_set_against_its_equal_pull_in_the_report() -> None:
    ratio = _measured(_ratio(128, 16), 0.2)
    equal = _measured(_ratio(16, 0), 0.1)
    other = _measured(_ratio(128, 64), 0.2)  # its equal pull (bs64) is not in the run
    # Producer blocks of 16: its far slower memcpy would be the bs16 bar's worst.
    small = _measured(_ratio(16, 128), 0.2, memcpy=0.01)
    results = [ratio, equal, other, small]
    report.relate(results)
    assert ratio["kind"] == block_ratio.KIND and equal["kind"] == "transfer"
    for key in RESULT_FIELDS[1:]:
        assert key in ratio, key
    assert ratio["vs_equal"] == pytest.approx(0.5)
    assert ratio["nixl_vs_equal"] == pytest.approx(0.5)
    assert ratio["equal_label"] == equal["label"] and ratio["equal_descriptors"] == 10
    assert "vs_equal" not in other
    text = report.format_table(results, report.check_bars(results))
    section = text.split("block-size ratios")[1]
    assert ratio["label"] in section and "0.50" in section
    # The matrix's summary and its bs16 bar leave ratio cases out.
    summary = text.split("summary over")[1].split("bar:")[0].strip().splitlines()[2:]
    assert [line.split()[3:5] for line in summary] == [["16", "1"]]
    bars = {b["bar"]: b for b in report.check_bars(results)}
    assert bars["contiguous bs16 vs memcpy (coalescing)"]["worst_case"] == equal["label"]
    assert bars["handshakes after the first transfer"]["worst_case"] in {
        r["label"] for r in results
    }


# -- one real run ---------------------------------------------------------------------------
@pytest.mark.proc
def test_block_ratios_through_two_processes(tmp_path: Any) -> None:
    argv = ["--block-ratios", "32:16,16:32", "--tokens", "100", "--reps", "2", "--max-reps", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "bench", *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    objs = [json.loads(line) for line in out.stdout.splitlines()]
    assert objs[0]["kind"] == "run"
    ratios = [o for o in objs if o["kind"] == block_ratio.KIND]
    equal = [o for o in objs if o["kind"] == "transfer"]
    assert [r["block_ratio"] for r in ratios] == ["32:16", "16:32"]
    assert [r["label"] for r in equal] == ["qwen3-0.6b bs16 100t contiguous pull ucx"]
    assert not [o for o in objs if o["kind"] == "planning"]
    for r in ratios:
        assert r["status"] == "ok", r
        assert r["verified"] is True and r["mismatched_words"] == {"kvxfer": 0, "nixl": 0}
        assert (
            r["bytes_moved"]
            == equal[0]["bytes_moved"]
            == bc.expected_bytes(_ratio(32, 16, tokens=100))[0]
        )
        assert r["descriptors_posted"] == r["nixl_descriptors"] == r["runs"] > 0
        assert r["reps"] == 2 and r["handshakes_in_timed_reps"] == 0
        for key in ("kvxfer_gbps", "nixl_gbps", "memcpy_gbps", "equal_gbps", "vs_equal"):
            assert r[key] > 0, key
        assert r["equal_label"] == equal[0]["label"]
    again = rereport(tmp_path, out.stdout)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "block-size ratios" in again.stdout and "bs32:16" in again.stdout
