"""``kvxfer bench --gather``: pulls direct, gathered and by the cost model's pick, in one
run (kvxfer.tools.bench.gather, issue 55). Fields, paths and bytes are checked here,
never timings: the report's arithmetic runs on made-up seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from kvxfer.core.gather_cost import XferPath
from kvxfer.tools.bench import cases as bc
from kvxfer.tools.bench import cli as bench
from kvxfer.tools.bench import gather, report
from kvxfer.tools.bench.runner import RESULT_FIELDS, assemble
from tests.benchkit import rereport


def _case(gather_mode: str, **kw: Any) -> bc.Case:
    base: dict[str, Any] = {
        "model": bc.QWEN,
        "block_size": 16,
        "tokens": 300,
        "pattern": "scattered",
        "direction": "pull",
        "backend": "ucx",
        "gather": gather_mode,
    }
    return bc.Case(**{**base, **kw})


def test_every_request_is_measured_three_ways_on_its_own_agents() -> None:
    cases = gather.build_cases(
        models=[bc.QWEN], block_sizes=[16, 128], tokens=[1000], patterns=["scattered"]
    )
    assert [(c.block_size, c.gather) for c in cases] == [
        (16, "off"),
        (16, "force"),
        (16, "auto"),
        (128, "off"),
        (128, "force"),
        (128, "auto"),
    ]
    assert {(c.direction, c.backend, c.mode) for c in cases} == {("pull", "ucx", "whole")}
    # One cache per request, one agent pair per way.
    assert len({c.cache_key for c in cases}) == 2
    assert len({c.agent_key for c in cases}) == 6
    assert cases[0].label == "qwen3-0.6b bs16 1000t scattered pull ucx"
    assert cases[1].label.endswith(" gather=force")
    with pytest.raises(ValueError, match="unknown pattern 'striped'"):
        gather.build_cases(models=[bc.QWEN], block_sizes=[16], tokens=[10], patterns=["striped"])


def test_the_agents_of_each_way_get_the_staging_and_the_force_it_names() -> None:
    off = gather.agent_config(_case("off"))
    assert not off.enabled and off.force is None
    force = gather.agent_config(_case("force"))
    assert force.staging_bytes == gather.STAGING_BYTES and force.force is XferPath.GATHER
    auto = gather.agent_config(_case("auto"))
    assert auto.staging_bytes == gather.STAGING_BYTES and auto.force is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--directions", "push"],
        ["--backends", "host_bounce"],
        ["--modes", "chunk"],
        ["--tp"],
        ["--block-ratios", "32:16"],
    ],
)
def test_what_a_gathered_case_fixes_is_refused_before_any_process_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--gather", *argv]) == 2
    assert "--gather" in capsys.readouterr().err


def _measured(case: bc.Case, seconds: float, path: str, descriptors: int = 40) -> dict[str, Any]:
    moved, _ = bc.expected_bytes(case)
    stats = {"bytes": moved, "descriptors": descriptors, "path": path, "plan_s": 0.001}
    stats["post_s"] = 0.01
    first = {"s": 0.5, "bad": 0, "stats": stats, "handshakes": 1}
    raw_first = {"s": 0.4, "bad": 0, "descriptors": 40, "runs": 40}
    details = [{"s": seconds, "stats": stats, "hold_s": 0.0, "handshakes": 1, "freed": True}]
    raw = [{"s": seconds, "s_prepped": seconds, "ids_s": 0.0, "xfer_s": seconds}]
    return assemble(case, first, raw_first, details, [seconds], [seconds], [seconds], 0.01, raw)


def test_gathered_cases_are_set_against_the_direct_pull_and_the_pick_is_judged() -> None:
    direct = _measured(_case("off"), 0.2, "direct")
    force = _measured(_case("force"), 0.1, "gather", descriptors=2)
    good = _measured(_case("auto"), 0.1, "gather", descriptors=2)
    results = [direct, force, good]
    report.relate(results)
    assert direct["kind"] == "transfer" and force["kind"] == good["kind"] == gather.KIND
    for key in RESULT_FIELDS[1:]:
        assert key in force, key
    # Fewer descriptors than raw NIXL's direct ones is what a gathered pull posts.
    assert force["status"] == "ok" and force["descriptors_posted"] == 2
    assert force["paths"] == ["gather", "gather"]
    assert force["vs_direct"] == pytest.approx(2.0) and force["direct_descriptors"] == 40
    assert good["faster"] == "gather" and good["auto_slower"] is False
    bars = {b["bar"]: b for b in report.check_bars(results)}
    pick = bars["gather model's pick vs the faster path (GB/s)"]
    assert pick["holds"] is True and pick["worst_case"] == good["label"]
    # The same run with auto going direct: half the faster path's GB/s, a slower pick.
    bad = _measured(_case("auto"), 0.2, "direct")
    results = [direct, force, bad]
    report.relate(results)
    assert bad["auto_slower"] is True and bad["vs_direct"] == pytest.approx(1.0)
    pick = {b["bar"]: b for b in report.check_bars(results)}[
        "gather model's pick vs the faster path (GB/s)"
    ]
    assert pick["holds"] is False and pick["worst"] == pytest.approx(0.5)
    text = report.format_table(results, report.check_bars(results))
    section = text.split("gather path against the direct pull")[1]
    assert bad["label"] in section and "YES" in section
    # Within noise of the faster path (gathered 5% faster, auto direct) is not slower.
    near = _measured(_case("auto"), 0.21, "direct")
    results = [direct, _measured(_case("force"), 0.2 * 0.95, "gather", 2), near]
    report.relate(results)
    assert near["faster"] == "gather" and near["auto_slower"] is False


def test_a_direct_pull_whose_descriptors_differ_from_raw_nixl_still_fails() -> None:
    r = _measured(_case("auto"), 0.1, "direct", descriptors=39)
    assert r["status"] == "failed" and "descriptor" in r["reason"]


def test_auto_taking_both_paths_is_not_judged() -> None:
    direct = _measured(_case("off"), 0.2, "direct")
    force = _measured(_case("force"), 0.1, "gather", 2)
    mixed = _measured(_case("auto"), 0.1, "gather", 2)
    mixed["paths"] = ["gather", "direct"]
    report.relate([direct, force, mixed])
    assert mixed["auto_slower"] is None
    pick = gather.check([direct, force, mixed])
    assert pick is not None and pick.holds is False and "both paths" in pick.note
    assert gather.check([direct]) is None


# -- one real run ---------------------------------------------------------------------------
@pytest.mark.proc
def test_gather_through_two_processes(tmp_path: Any) -> None:
    argv = ["--gather", "--block-sizes", "16", "--tokens", "200", "--reps", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "bench", *argv, "--max-reps", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # 1: a failed case; 0 otherwise (the pick's bar is reported, not checked).
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    objs = [json.loads(line) for line in out.stdout.splitlines()]
    cases = [o for o in objs if o["kind"] in ("transfer", gather.KIND)]
    assert not [o for o in objs if o["kind"] == "planning"]
    # Both patterns share a way's agents, so they run one after the other.
    assert [(o["pattern"], o["gather"]) for o in cases] == [
        (p, g) for g in gather.MODES for p in ("contiguous", "scattered")
    ]
    by = {(o["pattern"], o["gather"]): o for o in cases}
    for o in cases:
        assert o["status"] == "ok", o
        assert o["verified"] is True and o["mismatched_words"] == {"kvxfer": 0, "nixl": 0}
        assert o["bytes_moved"] == by[(o["pattern"], "off")]["bytes_moved"] > 0
        assert o["handshakes_in_timed_reps"] == 0
    for p in ("contiguous", "scattered"):
        assert set(by[(p, "off")]["paths"]) == {"direct"}
        forced = by[(p, "force")]
        assert set(forced["paths"]) == {"gather"}
        # The whole request in one staging slot: one READ (and fewer than direct's).
        assert forced["descriptors_posted"] < forced["nixl_descriptors"]
        assert forced["vs_direct"] > 0 and forced["direct_label"] == by[(p, "off")]["label"]
    scattered = by[("scattered", "off")]
    # The model's inputs are the request's runs: a scattered bs16 request has one run
    # per block and region, far more than the model's minimum; a contiguous one few.
    assert scattered["runs"] > by[("contiguous", "off")]["runs"]
    for p in ("contiguous", "scattered"):
        auto = by[(p, "auto")]
        assert len(set(auto["paths"])) == 1, auto["paths"]
        assert auto["paths"][0] == by[(p, "off")]["gather_model"]
        assert auto["auto_slower"] in (True, False)
    bars = [o for o in objs if o["kind"] == "bar"]
    assert "gather model's pick vs the faster path (GB/s)" in {b["bar"] for b in bars}
    again = rereport(tmp_path, out.stdout)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "gather path against the direct pull" in again.stdout
    assert "gather=auto" in again.stdout


def test_a_case_round_trips_through_json_with_its_gather() -> None:
    case = _case("force")
    assert msgspec.convert(msgspec.to_builtins(case), bc.Case) == case
    assert case.fields()["gather"] == "force"
