"""``kvxfer bench`` (R-CLI-3): the pure parts directly, then one tiny real two-process run.

Nothing here asserts a speed: the machines are shared and noisy. Timings only have to
exist and be positive.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from kvxfer.agent_config import DEFAULT_PROGRESS_INTERVAL_S
from kvxfer.backends._nixl import list_writes
from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.testing.kvcache import HostKVCache
from kvxfer.tools.bench import cases as bc
from kvxfer.tools.bench import cli as bench
from kvxfer.tools.bench import report
from kvxfer.tools.bench.data import MemcpyBench, fill_regions, verify_regions, zero_rows
from kvxfer.tools.bench.runner import RESULT_FIELDS, assemble, failed

ALL: dict[str, Any] = {
    "models": list(bc.SHAPES),
    "block_sizes": [16, 128, 1024],
    "tokens": [1000, 4000],
    "patterns": list(bc.PATTERNS),
    "directions": list(bc.DIRECTIONS),
    "backends": list(bc.BACKENDS),
    "modes": list(bc.MODES),
}


def _case(**kw: Any) -> bc.Case:
    base: dict[str, Any] = {
        "model": bc.QWEN,
        "block_size": 16,
        "tokens": 1000,
        "pattern": "contiguous",
        "direction": "pull",
        "backend": "ucx",
    }
    base.update(kw)
    if base.get("mode") == "chunk" and "chunk_tokens" not in kw:
        base["chunk_tokens"] = bc.chunk_tokens_for(base["block_size"])
    return bc.Case(**base)


def _options(case: bc.Case) -> PlanOptions:
    if case.mode == "chunk":
        return PlanOptions(chunk_mode=True, chunk_tokens=case.chunk_tokens)
    if case.mode == "window":
        return PlanOptions(swa_window_mode=True)
    return PlanOptions()


# -- the case matrix ---------------------------------------------------------------------
def test_matrix_modes_only_where_the_backend_and_model_allow() -> None:
    cases, impossible = bc.build_matrix(**ALL)
    assert cases
    for c in cases:
        if c.mode != "whole":
            assert c.backend == "nixl_rbln"  # chunk/window need device-to-device
        if c.mode == "window":
            assert c.shape.sliding_window and c.block_size % c.shape.sliding_window == 0
        assert (c.chunk_tokens > 0) == (c.mode == "chunk")
    # A 128-token window does not divide 16-token blocks: listed with the reason.
    assert impossible
    for c, why in impossible:
        assert c.mode == "window" and c.block_size == 16 and "multiple" in why
    labels = [c.label for c in cases]
    assert len(labels) == len(set(labels))


def test_matrix_groups_caches_and_agent_pairs_contiguously() -> None:
    cases, _ = bc.build_matrix(**ALL)
    shuffled = [cases[i] for i in np.random.default_rng(3).permutation(len(cases))]
    for ordered in (cases, bc.order_cases(shuffled)):
        seen_cache: list[Any] = []
        seen_agents: list[Any] = []
        for c in ordered:
            if not seen_cache or seen_cache[-1] != c.cache_key:
                assert c.cache_key not in seen_cache
                seen_cache.append(c.cache_key)
            if not seen_agents or seen_agents[-1] != c.agent_key:
                assert c.agent_key not in seen_agents
                seen_agents.append(c.agent_key)
    assert sorted(bc.order_cases(shuffled), key=lambda c: c.label) == sorted(
        cases, key=lambda c: c.label
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [("models", ["llama-7b"]), ("backends", ["rdma"]), ("modes", ["half"]), ("tokens", [0])],
)
def test_matrix_rejects_unknown_values(key: str, value: list[Any]) -> None:
    with pytest.raises(ValueError):
        bc.build_matrix(**{**ALL, key: value})


def test_quick_preset_covers_the_bar_and_every_backend_and_mode() -> None:
    args = bench.parser().parse_args(["--quick", "--mem-budget", "64"])
    cases, skipped = bench.plan_cases(args)
    assert not [r for r in skipped if r["status"] == "skipped"]
    assert len(cases) <= 16
    assert {c.mode for c in cases} == set(bc.MODES)
    assert {c.direction for c in cases} == set(bc.DIRECTIONS)
    assert any(c.block_size == 16 and c.pattern == "contiguous" for c in cases)
    assert len({c.block_size for c in cases}) >= 2  # something to plot
    backends = {c.backend for c in cases} | {r["backend"] for r in skipped}
    assert backends == set(bc.BACKENDS)


def test_selectors_override_the_preset() -> None:
    args = bench.parser().parse_args(
        ["--quick", "--backends", "ucx", "--directions", "pull", "--mem-budget", "64"]
    )
    cases, _ = bench.plan_cases(args)
    assert cases and {(c.backend, c.direction) for c in cases} == {("ucx", "pull")}


# -- block lists and the algebra ----------------------------------------------------------
@pytest.mark.parametrize("pattern", bc.PATTERNS)
@pytest.mark.parametrize(("bs", "tokens"), [(16, 1000), (16, 4000), (128, 1000), (1024, 32000)])
def test_block_lists(pattern: str, bs: int, tokens: int) -> None:
    case = _case(pattern=pattern, block_size=bs, tokens=tokens)
    n, total = bc.request_blocks(case), bc.num_blocks_for(case)
    local, remote = bc.case_blocks(case, "local"), bc.case_blocks(case, "remote")
    for ids in (local, remote):
        assert len(ids) == n == len(np.unique(ids))
        assert ids.min() >= 0 and ids.max() < total
    assert np.array_equal(local, bc.case_blocks(case, "local"))  # deterministic
    joint = np.count_nonzero((np.diff(local) == 1) & (np.diff(remote) == 1))
    if pattern == "contiguous" and n > 64:
        assert joint > n // 2  # mostly runs contiguous on both sides
    if pattern == "scattered" and n > 64:
        assert joint < n // 8


@pytest.mark.parametrize(
    "case",
    [
        _case(),
        _case(tokens=4000, block_size=128, mode="chunk", backend="nixl_rbln"),
        _case(tokens=1000, mode="chunk", backend="nixl_rbln"),
        _case(tokens=32000, block_size=1024, mode="chunk", backend="nixl_rbln"),
        _case(model="gpt-oss-20b", tokens=4000, block_size=1024, mode="window"),
        _case(model="gpt-oss-20b", tokens=1000, block_size=128, mode="window"),
        _case(model="gpt-oss-20b", tokens=100, block_size=128, mode="window"),
        _case(model="gpt-oss-20b", tokens=4000, block_size=16),
    ],
    ids=lambda c: c.label,
)
def test_expected_bytes_match_kvxfers_plan(case: bc.Case) -> None:
    """The bench's independent restatement of the algebra equals kvxfer's plan."""
    cache = HostKVCache(case.shape, case.block_size, bc.num_blocks_for(case))
    table = DescriptorTable.build(cache.layout(), _options(case))
    groups = len(cache.layout().groups)
    plan = build_plan(
        table,
        table,
        [bc.case_blocks(case, "local")] * groups,
        [bc.case_blocks(case, "remote")] * groups,
        case.tokens,
    )
    moved, whole = bc.expected_bytes(case)
    assert plan.nbytes == moved <= whole
    assert whole == 2 * case.shape.layers * bc.request_blocks(case) * (
        case.block_size * case.shape.token_bytes()
    )
    if case.mode == "window" and case.tokens > case.shape.sliding_window:
        assert moved < whole


def test_chunk_mode_saves_the_unfilled_chunks_of_the_last_block() -> None:
    # 32000 tokens in 1024-token blocks: the last block holds 256 tokens, one chunk of 4.
    case = _case(tokens=32000, block_size=1024, mode="chunk", backend="nixl_rbln")
    moved, whole = bc.expected_bytes(case)
    per_region_chunk = 256 * case.shape.token_bytes()
    assert whole - moved == 2 * case.shape.layers * 3 * per_region_chunk


# -- memory budget -----------------------------------------------------------------------------
def test_memory_estimate_and_trimming() -> None:
    small = _case()
    big = _case(model="qwen2.5-32b", tokens=32000)
    bounce = _case(backend="host_bounce")
    region = bc.num_blocks_for(small) * 16 * small.shape.token_bytes()
    assert bc.case_memory(small) >= 2 * 2 * small.shape.layers * region
    assert bc.case_memory(bounce) > bc.case_memory(small)  # staging doubles each side
    assert bc.case_memory(big) > 15 * 2**30
    keep, skipped = bc.trim_to_budget([small, big, bounce], 4 * 2**30)
    assert keep == [small, bounce]
    assert [c for c, _ in skipped] == [big]
    assert "memory budget 4.0 GiB" in skipped[0][1]


def test_plan_cases_reports_what_will_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "unavailable_backends", lambda names: {"host_bounce": "gone"})
    args = bench.parser().parse_args(
        [
            "--models",
            "qwen2.5-32b,gpt-oss-20b",
            "--block-sizes",
            "16",
            "--tokens",
            "32000",
            "--mem-budget",
            "10",
        ]
    )
    cases, skipped = bench.plan_cases(args)
    assert all(c.backend != "host_bounce" and c.model != "qwen2.5-32b" for c in cases)
    by = {(r["status"], r["backend"]) for r in skipped}
    assert ("unavailable", "host_bounce") in by and ("skipped", "ucx") in by
    for r in skipped:
        assert r["reason"] and r["kind"] == "transfer" and r["label"]


# -- ratio math and the JSON object --------------------------------------------------------
def test_ratio_math() -> None:
    assert bc.median([3.0, 1.0, 2.0]) == 2.0
    assert bc.median([]) is None
    assert bc.gbps(2_000_000_000, 0.5) == 4.0
    assert bc.gbps(1, 0.0) is None and bc.gbps(1, None) is None
    assert bc.ratio(3.0, 4.0) == 0.75
    assert bc.ratio(None, 1.0) is None and bc.ratio(1.0, 0.0) is None


def _fake_run(
    case: bc.Case, *, bad: int = 0, descriptors: int = 100, memcpy_2t: tuple[float, ...] = ()
) -> dict[str, Any]:
    moved, _ = bc.expected_bytes(case)
    stats = {
        "bytes": moved,
        "descriptors": 100,
        "plan_s": 0.001,
        "post_s": 0.01,
        "transfer_s": 0.02,
    }
    first = {"s": 0.5, "bad": bad, "stats": stats, "handshakes": 1}
    raw_first = {"s": 0.4, "bad": 0, "descriptors": descriptors, "runs": 10}
    details = [
        {"s": t, "s_strict": t + 0.1, "stats": stats, "hold_s": 0.1, "handshakes": 1}
        for t in (0.2, 0.1, 0.3)
    ]
    raw_details = [
        {"s": t, "s_prepped": t - 0.05, "ids_s": 0.05, "xfer_s": t - 0.06} for t in (0.1, 0.1, 0.3)
    ]
    return assemble(
        case,
        first,
        raw_first,
        [{**d, "freed": True} for d in details],
        [0.2, 0.1, 0.3],
        [0.1, 0.1, 0.3],
        [0.15, 0.08, 0.25],
        0.01,
        raw_details,
        memcpy_2t,
    )


def test_assemble_medians_paired_ratios_and_schema() -> None:
    case = _case()
    r = _fake_run(case)
    for key in (*RESULT_FIELDS, "model", "block_size", "tokens", "label", "layers"):
        assert key in r, key
    assert r["status"] == "ok" and r["verified"] is True
    assert r["kvxfer_s"] == 0.2 and r["nixl_s"] == 0.1 and r["memcpy_s"] == 0.15
    assert r["kvxfer_gbps"] == pytest.approx(r["bytes_moved"] / 0.2 / 1e9)
    assert r["kvxfer_vs_nixl_of_medians"] == pytest.approx(0.5)
    # paired per rep: 0.1/0.2, 0.1/0.1, 0.3/0.3 -> median 1.0
    assert r["kvxfer_vs_nixl"] == pytest.approx(1.0)
    # strict: hold on kvxfer's clock, ids off raw's: 0.05/0.3, 0.05/0.2, 0.25/0.4
    assert r["kvxfer_vs_nixl_strict"] == pytest.approx(0.25)
    assert r["nixl_ids_s"] == pytest.approx(0.05)
    assert r["nixl_post_s"] == pytest.approx(0.04)  # raw's transfer alone, beside post_s
    assert r["kvxfer_vs_memcpy"] == pytest.approx(0.8)  # 0.75, 0.8, 0.833
    assert r["handshakes_in_timed_reps"] == 0
    assert r["bytes_moved"] == r["bytes_expected"] == r["whole_block_bytes"]
    json.dumps(r)  # plain JSON


def test_assemble_fails_a_case_that_did_not_verify_or_differs_from_nixl() -> None:
    assert _fake_run(_case(), bad=3)["reason"] == "bytes did not verify"
    assert "descriptor" in _fake_run(_case(), descriptors=99)["reason"]
    gone = failed(_case(), "the producer process exited", "failed")
    assert gone["status"] == "failed" and gone["label"] == _case().label


def test_relate_and_bars() -> None:
    direct = _fake_run(_case(block_size=16))
    bounce = _fake_run(_case(backend="host_bounce"), memcpy_2t=(0.1, 0.3, 0.2))
    bounce["kvxfer_s"] = 0.3
    whole = _fake_run(_case(model="gpt-oss-20b", block_size=1024, backend="nixl_rbln"))
    window = _fake_run(
        _case(model="gpt-oss-20b", block_size=1024, backend="nixl_rbln", mode="window")
    )
    window["kvxfer_s"] = 0.15
    pushed = _fake_run(_case(block_size=16, direction="push"))  # as fast as direct's pull
    results = [direct, pushed, bounce, whole, window, failed(_case(tokens=7), "x")]
    report.relate(results)
    assert bounce["bounce_vs_direct"] == pytest.approx(1.5)
    assert bounce["bounce_floor"] == pytest.approx(1 + 2 * direct["kvxfer_vs_memcpy"])
    # Three copies at the two-thread rate (median 0.2 s per copy) over direct's 0.2 s.
    assert bounce["memcpy_2t_s"] == 0.2 and direct["memcpy_2t_s"] is None
    assert bounce["bounce_bw_floor"] == pytest.approx(3.0)
    assert bounce["bounce_vs_floor"] == pytest.approx(0.5)
    assert window["time_saved_s"] == pytest.approx(0.05)
    assert window["whole_mode_s"] == 0.2
    bars = {b["bar"]: b for b in report.check_bars(results)}
    assert all(b["holds"] is True for b in bars.values()), bars
    bounce["kvxfer_s"] = 0.5
    report.relate(results)
    bars = {b["bar"]: b for b in report.check_bars(results)}
    missed = [b for b in bars.values() if b["holds"] is False]
    assert [b["worst_case"] for b in missed] == [bounce["label"]]
    text = report.format_table(results, list(bars.values()))
    assert "MISSED" in text and direct["label"] in text and "FAILED" in text
    # The first transfer over the steady median, per case.
    row = next(line for line in text.splitlines() if line.startswith(direct["label"]))
    first_over = direct["first_transfer_s"] / direct["kvxfer_s"]
    assert "1st/st" in text and row.split()[-1] == f"{first_over:.2f}"
    # The bounce bar says where the machine puts the floor (3 copies x 0.2 s / 0.2 s direct).
    note = bars["host_bounce time vs direct ucx"]["note"]
    assert "floor" in note and "median 3.00x direct" in note and "in 1 of 1 cases" in note
    assert note in text


def test_push_is_set_against_the_same_case_pulled_beside_raw_nixls_write_over_read() -> None:
    pull = _fake_run(_case())
    push = _fake_run(_case(direction="push"))
    lone = _fake_run(_case(direction="push", block_size=1024))  # no pull of its own
    push["kvxfer_s"], push["nixl_s"] = 0.25, 0.125  # pull's are 0.2 and 0.1
    results = [pull, push, lone]
    report.relate(results)
    assert push["push_vs_pull"] == pytest.approx(0.8) and push["pull_s"] == 0.2
    assert push["nixl_write_vs_read"] == pytest.approx(0.8)
    assert "push_vs_pull" not in lone and "push_vs_pull" not in pull
    small = {"write_over_read": 1.09, "read_gbps": 6.4, "write_gbps": 7.0}
    cma = {"thp": "madvise", "huge": {"error": "errno 1"}, "small": small}
    bars = {b["bar"]: b for b in report.check_bars(results, cma)}
    bar = bars["push vs pull, same case (GB/s)"]
    assert bar["holds"] is False and bar["worst"] == pytest.approx(0.8)
    assert bar["worst_case"] == push["label"]
    assert "WRITE over its READ in the same cases: median 0.80" in bar["note"]
    assert "process_vm_writev over readv" in bar["note"]
    assert "huge pages not measured: errno 1, 1.09 on 4 KiB pages (7.0 / 6.4 GB/s)" in bar["note"]
    text = report.format_table(results, list(bars.values()))
    assert "push against pull" in text and f"{push['label']:<58} 0.80  raw NIXL 0.80" in text
    push["kvxfer_s"] = 0.21  # 0.952: at the bar
    report.relate(results)
    assert report.check_bars(results)[-2]["holds"] is True


def test_plot_without_matplotlib_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = report.plot([_fake_run(_case())], str(tmp_path / "x.png"))
    assert err is not None and "matplotlib" in err
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_a_png(tmp_path: Any) -> None:
    rs = [_fake_run(_case(block_size=b)) for b in (16, 1024)]
    assert report.plot(rs, str(tmp_path / "p.png")) is None
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# -- bytes: fill, verify, memcpy -----------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        _case(pattern="scattered"),
        _case(model="gpt-oss-20b", block_size=128, mode="window"),
        _case(block_size=128, tokens=1000, mode="chunk", backend="nixl_rbln"),
    ],
    ids=lambda c: c.label,
)
def test_verify_is_exact_and_catches_corruption(case: bc.Case) -> None:
    shape = bc.SHAPES[case.model]
    nb = bc.num_blocks_for(case)
    prod = HostKVCache(shape, case.block_size, nb)
    cons = HostKVCache(shape, case.block_size, nb)
    fill_regions(prod.regions)
    lt = DescriptorTable.build(cons.layout(), _options(case))
    rt = DescriptorTable.build(prod.layout(), _options(case))
    groups = len(cons.layout().groups)
    local, remote = bc.case_blocks(case, "local"), bc.case_blocks(case, "remote")
    plan = build_plan(lt, rt, [local] * groups, [remote] * groups, case.tokens)
    runs = plan.runs(lt, rt, merge=False)

    def check() -> int:
        rows = [local] * len(cons.regions)
        return verify_regions(
            cons.regions, runs.local_addr, runs.remote_addr, runs.length, prod.layout(), rows
        )

    assert check() > 0  # nothing moved yet
    for la, ra, n in zip(runs.local_addr.tolist(), runs.remote_addr.tolist(), runs.length.tolist()):
        ctypes.memmove(la, ra, n)
    assert check() == 0
    cons.regions[3][local[2], 17] ^= 1
    assert check() == 1
    cons.regions[3][local[2], 17] ^= 1
    a, b = cons.regions[0][local[0]].copy(), cons.regions[0][local[1]].copy()
    cons.regions[0][local[0]], cons.regions[0][local[1]] = b, a  # two blocks swapped
    assert check() > 0
    zero_rows(cons.regions, local)
    assert check() > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--engine-busy-ms", "-1"], "--engine-busy-ms -1: must be 0 or more"),
        (["--engine-busy-ms", "1e9"], "under 60000"),
    ],
)
def test_bad_engine_busy_is_refused(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main([*argv, "--quick"]) == 2
    assert needle in capsys.readouterr().err


def test_push_post_choices_are_the_agents() -> None:
    args = bench.parser().parse_args(["--push-post", "writer", "--engine-busy-ms", "2.5"])
    assert args.push_post == "writer" and args.engine_busy_ms == 2.5
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["--push-post", "inline"])


def test_memcpy_bench_copies_the_bytes_asked() -> None:
    src = [np.arange(1 << 16, dtype=np.uint16).reshape(16, -1) for _ in range(3)]
    m = MemcpyBench(src, scratch_bytes=1 << 15)
    assert m.run(5 * (1 << 17) + 123) > 0
    assert m.run(5 * (1 << 17) + 123, threads=2) > 0
    m.close()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_memcpy_bench_threads_share_the_same_bytes(threads: int) -> None:
    rng = np.random.default_rng(threads)
    src = [rng.integers(0, 1 << 16, size=(8, 1000), dtype=np.uint16) for _ in range(2)]
    stream = np.concatenate([r.reshape(-1).view(np.uint8) for r in src])
    nbytes = len(stream) - 7  # not a multiple of anything
    m = MemcpyBench(src, scratch_bytes=nbytes + 2)  # room for every part: no wrap-around
    m.run(nbytes, threads=threads)
    m.close()
    cap = len(m._scratch) // threads
    share = [nbytes // threads + (nbytes % threads > k) for k in range(threads)]
    landed = np.concatenate([m._scratch[k * cap : k * cap + n] for k, n in enumerate(share)])
    assert np.array_equal(landed, stream[:nbytes])


# -- one real run ---------------------------------------------------------------------------
@pytest.mark.proc
def test_smoke_tiny_case_through_two_processes(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvxfer.cli",
            "bench",
            "--models",
            bc.QWEN,
            "--block-sizes",
            "16",
            "--tokens",
            "100",
            "--patterns",
            "contiguous",
            "--directions",
            "pull,push",
            "--backends",
            "ucx,host_bounce",
            "--reps",
            "2",
            "--max-reps",
            "2",
            "--no-planning",
            "--engine-busy-ms",  # the producer's engine thread stays busy after a push
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    objs = [json.loads(line) for line in out.stdout.splitlines()]
    assert objs[0]["kind"] == "run" and objs[0]["cpus"]
    assert objs[0]["nixl_ucx_sgl"] is list_writes(os.environ)  # as its agents started
    assert objs[0]["progress_interval_s"] == DEFAULT_PROGRESS_INTERVAL_S
    cases = [o for o in objs if o["kind"] == "transfer"]
    assert sorted((r["backend"], r["direction"]) for r in cases) == [
        ("host_bounce", "pull"),
        ("host_bounce", "push"),
        ("ucx", "pull"),
        ("ucx", "push"),
    ]
    for r in cases:
        assert r["status"] == "ok", r
        for key in (
            "kvxfer_gbps",
            "nixl_gbps",
            "memcpy_gbps",
            "kvxfer_vs_nixl",
            "kvxfer_vs_memcpy",
            "descriptors_posted",
            *RESULT_FIELDS,
        ):
            assert key in r, key
        assert r["verified"] is True and r["mismatched_words"] == {"kvxfer": 0, "nixl": 0}
        assert r["bytes_moved"] == bc.expected_bytes(_case(tokens=100))[0]
        assert r["descriptors_posted"] == r["nixl_descriptors"] == 7 * 2 * 28
        assert r["reps"] == 2 and r["handshakes_in_timed_reps"] == 0
        for key in (
            "kvxfer_gbps",
            "nixl_gbps",
            "memcpy_gbps",
            "handshake_s",
            "first_transfer_s",
            "post_s",
            "nixl_post_s",
        ):
            assert r[key] > 0, key
        # A pull's transfer is timed inside its whole request, in the one process that
        # pulls, on both sides. A push is not ordered so: the writer's DONE (raw NIXL's
        # post time polls to it) can come after the reader already saw the notice.
        if r["direction"] == "pull":
            assert r["nixl_post_s"] < r["nixl_s"] and r["post_s"] < r["kvxfer_s"]
        if r["backend"] == "host_bounce":  # against its ucx sibling, with the machine's floor
            assert r["memcpy_2t_gbps"] > 0 and r["bounce_vs_direct"] > 0
            assert r["bounce_bw_floor"] >= 1 and r["bounce_vs_floor"] > 0
        else:
            assert r["memcpy_2t_s"] is None and "bounce_vs_direct" not in r
    bars = {o["bar"]: o for o in objs if o["kind"] == "bar"}
    assert "floor" in bars["host_bounce time vs direct ucx"]["note"]
    # --tables: the Markdown tables of docs/PERFORMANCE.md from the saved run.
    saved = tmp_path / "run.jsonl"
    saved.write_text(out.stdout)
    assert bench.main(["--tables", str(saved)]) == 0
    md = capsys.readouterr().out
    assert "4 cases verified byte for byte, 0 failed, 0 skipped." in md
    assert md.count("#### ") == 9
    pulls = md.split("#### Every ucx pull")[1].split("#### ")[0]
    ucx_pull = next(r for r in cases if (r["backend"], r["direction"]) == ("ucx", "pull"))
    assert ucx_pull["label"] in pulls and "host_bounce" not in pulls
    assert bench.main(["--tables", str(tmp_path / "missing.jsonl")]) == 2


def test_from_json_reports_a_saved_run(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [_fake_run(_case(block_size=b)) for b in (16, 1024)]
    saved = tmp_path / "run.jsonl"
    header = {"kind": "run", "date": "2026-01-01 00:00 UTC", "cpus": 2, "network": "loopback"}
    saved.write_text("\n".join(json.dumps(o) for o in [header, *rows, {"kind": "bar"}]) + "\n")
    assert bench.main(["--from-json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "2026-01-01" in out and rows[0]["label"] in out and "bar:" in out
    assert bench.main(["--from-json", str(saved), "--json"]) == 0
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert objs[0] == header
    assert [o["kind"] for o in objs].count("bar") == len(report.check_bars(rows))
    assert bench.main(["--from-json", str(tmp_path / "missing.jsonl")]) == 2
    # A run with UCX told to leave CMA out says so beside the network.
    saved.write_text("\n".join(json.dumps(o) for o in [{**header, "ucx_tls": "tcp,self"}, *rows]))
    assert bench.main(["--from-json", str(saved)]) == 0
    assert ", loopback (UCX_TLS=tcp,self: no CMA), " in capsys.readouterr().out


def test_plan_micro_bench_times_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    from kvxfer.tools.bench import plan_micro

    assert plan_micro.main(["--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert len(lines) == 3 * 5  # three (tokens, block size) cases, five planning steps
    for line in lines:
        tokens, bs, descs, *_, runs, us, ns = line.split()
        assert int(descs) == -(-int(tokens) // int(bs)) * 56
        assert 1 <= int(runs) <= int(descs) and float(us) > 0 and float(ns) > 0


def test_noisy_cases_get_more_reps_until_the_ratio_is_settled() -> None:
    assert bc.median_ci([1.0] * 4) is None  # too few to say
    lo, hi = bc.median_ci([0.9, 1.0, 1.1, 1.0, 0.95, 1.05, 1.0]) or (0.0, 0.0)
    assert lo <= 1.0 <= hi
    steady = [0.1] * 7
    assert bc.settled(steady, [0.1, 0.101, 0.099, 0.1, 0.1, 0.1, 0.1])
    assert not bc.settled(steady, [0.05, 0.2, 0.1, 0.07, 0.15, 0.1, 0.12])
    assert not bc.settled(steady[:3], steady[:3])


def test_raw_nixl_background_polls_pause_during_kvxfers_turn() -> None:
    """Raw NIXL's background poller serves raw NIXL's transfers only: paused while a
    rep's kvxfer transfer runs (its wakeups were load on kvxfer's copy that raw NIXL's
    did not carry), polling again once resumed. No step depends on an idle host: the
    waits for polls have long deadlines, and pause() is final when it returns."""
    from kvxfer.tools.bench.raw_nixl import RawNixl

    def polls_past(count: int) -> bool:
        deadline = time.monotonic() + 30.0
        while raw.polls <= count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    raw = RawNixl("bench-raw-pause-test")
    try:
        assert polls_past(0), "the background poller never polled in 30 s"
        raw.pause()
        paused_at = raw.polls
        time.sleep(0.1)  # 100 poll intervals
        assert raw.polls == paused_at, f"{raw.polls - paused_at} polls while paused"
        raw.resume()
        assert polls_past(paused_at + 2), "no polls in 30 s after resume"
    finally:
        raw.close()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--progress-interval-us", "0"], "progress_interval_s=0.0: must be a number of seconds"),
        (["--progress-interval-us", "2e6"], "at most 1"),
        (["--tp", "--progress-interval-us", "20"], "applies to the matrix, not --tp"),
    ],
)
def test_a_bad_progress_interval_is_refused_before_any_process_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvxfer bench: --progress-interval-us") and says in err
