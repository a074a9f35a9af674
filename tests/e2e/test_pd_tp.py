"""Prefill and decode of different tensor-parallel sizes on real vLLM engines, through
the pull and the push connector (R-TP-4): greedy output equal to a unified instance, a
negative control, decode's prompt tokens all over the connector, the KV that landed in
every decode rank's blocks equal byte for byte to the producer ranks' (per layer, K/V,
global KV head and token: tests/e2e/verify_connector.py digests both sides inside the
engines), and a producer rank killed before decode's read (or registration) failing
that request cleanly while decode keeps serving.

Across TP sizes the unified reference and the pair run in float32: in bf16 a TP2 and
a TP1 instance of the same random-weight model already disagree with no transfer
involved (the all-reduce sums in another order), in float32 they agree.

``make test`` runs prefill TP1 -> decode TP2 (llm-d's direction: a small prefill
feeding a wider decode), with nothing but the connector in either instance's config
(no per-head setting: the pairing cuts the tables, issue 26): a pull through host
bounce, and a push device to device (the emulated nixl-rbln adapter) of a model with
four KV heads, whose writes go as chain lists (issue 27).
``KVXFER_E2E_TP4=1`` adds llm-d's layout, prefill TP1 -> decode TP4, pull and push
(four decode workers, a prefill and a unified instance fit two cores: about 2 minutes
each; out of ``make test`` for that time, see SELECTED).
``KVXFER_E2E_TP_ALL=1`` adds those, the TP1 -> TP2 push through host bounce and pull
device to device, prefill TP2 -> decode TP1 and the
equal pair TP2 -> TP2 in bf16 against a unified TP2 instance, each pull and push, and
the same unequal pairs of a model with one KV head, which a TP2 instance replicates on
both ranks (each pair starts three or four engine processes; about a minute each on
two cores). Push runs the toy router's order here: prefill answers first, then decode
registers and each producer rank writes its heads into the decode ranks that hold
them.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxfer.core.heads import HeadLayout, needed_ranks, peer_ranks
from tests import ports

from . import kv_digests
from .model import TinyModelSpec, build_tiny_model
from .pd import PD_ENV, PDPair, decode, kv_config, prefill, prompt_ids, reference, through_pd
from .servers import (
    E2E_BLOCK_SIZE,
    HttpError,
    VllmServer,
    sampling,
    start_server,
    wait_all_healthy,
)
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e

SOURCE = "vllm:prompt_tokens_by_source_total"
ALL = os.environ.get("KVXFER_E2E_TP_ALL") == "1"
TP4 = ALL or os.environ.get("KVXFER_E2E_TP4") == "1"

#: (prefill TP, decode TP, dtype, connector, model KV heads); the first two run in
#: make test. With one KV head a TP2 instance replicates it on both ranks (each decode
#: rank receives the whole head; a TP2 producer's second replica is released unread).
PAIRS = [
    (p, d, dtype, mode, kv)
    for p, d, dtype, kv in [
        (1, 2, "float32", 2),
        (2, 1, "float32", 2),
        (2, 2, "bfloat16", 2),
        (1, 2, "float32", 1),
        (2, 1, "float32", 1),
    ]
    for mode in ("pull", "push")
]
#: llm-d's layout: prefill TP1, decode TP4 (the tiny model's two KV heads each on two
#: decode ranks).
PAIRS_TP4 = [(1, 4, "float32", mode, 2) for mode in ("pull", "push")]
#: Device-to-device (``kv_buffer_device: rbln``, the emulated nixl-rbln adapter: UCX
#: over the engine's own KV tensors, test_pd_d2d_emulated.py) with four KV heads: each
#: decode rank holds two heads that lie side by side in every block on both sides, so
#: the posting side's transfers go as chain lists (kvxfer.core.block_lists), which host
#: bounce never posts.
PAIRS_D2D = [(1, 2, "float32", mode, 4) for mode in ("pull", "push")]
# llm-d's TP1 -> TP4 is not in `make test` for its time: both pairs (8 tests) took
# 4 min 14 s on 2 cores (2026-12-02), which `make test`'s 15 minutes do not leave. A
# TP1 producer starved of CPU at its first loads is docs/RELIABILITY.md 4.5; every pair
# runs with the default 10 s deadline.
# `make test` runs the TP1 -> TP2 pull through host bounce (the CPU default) and the
# push device to device: a third pair took 1.5 min of a 16-minute CI run (2026-12-03).
SELECTED = [
    *((*p, "cpu") for p in (PAIRS if ALL else PAIRS[:1]) + (PAIRS_TP4 if TP4 else [])),
    *((*p, "rbln") for p in (PAIRS_D2D if ALL else PAIRS_D2D[1:])),
]


def _pair_id(p: tuple[Any, ...]) -> str:
    return f"p{p[0]}-d{p[1]}-{p[2]}-{p[3]}-kv{p[4]}" + ("-d2d" if p[5] == "rbln" else "")


#: kvxfer's connectors plus the digests of the byte-level check (same behaviour, same
#: class names); they write only where ``kv_digests.ENV`` is set.
VERIFY_MODULE = "tests.e2e.verify_connector"


def _tp_args(tp: int, dtype: str) -> list[str]:
    args = ["--dtype", dtype]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    return args


def _side_channel_port(tp: int) -> int:
    # Rank r listens on the base port + r: every rank's port is reserved, so that no
    # server of this process is handed one of them.
    return ports.free_base_port(span=tp)


@pytest.fixture(scope="module")
def kv_digest_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where both sides of every pair of this module write their KV digests (records
    are keyed by transfer id, so pairs can share it)."""
    return tmp_path_factory.mktemp("kv-digests")


@dataclasses.dataclass
class TPPair(PDPair):
    """A pair and the decode side's TP size and the model's KV heads."""

    decode_tp: int = 1
    kv_heads: int = 2
    prefill_tp: int = 1
    ports: tuple[int, int] = (0, 0)  # prefill's and decode's rank 0 side channel
    device: str = "cpu"  # kv_buffer_device: "cpu" (host bounce) or "rbln" (emulated D2D)


@pytest.fixture(scope="module")
def unified_servers(
    tiny_model_dir: Path, unified_f32: VllmServer
) -> Iterator[dict[str, VllmServer]]:
    """Unified reference instances by (TP, dtype, model), started on first use and
    shared by the pull and the push pair that compare against them. The TP1 float32
    one of the tiny model is the session's (test_pd_two_hosts compares against it
    too); this module stops only those it started."""
    shared = _unified_name(1, "float32", tiny_model_dir)
    started: dict[str, VllmServer] = {shared: unified_f32}
    yield started
    for name, s in started.items():
        if name != shared:
            s.stop()


def _unified_name(tp: int, dtype: str, model: Path) -> str:
    return f"unified-tp{tp}-{dtype}-{model.name}"


def _unified(
    started: dict[str, VllmServer], tp: int, dtype: str, model: Path, logs: Path
) -> VllmServer:
    name = _unified_name(tp, dtype, model)
    if name not in started:
        started[name] = start_server(name, model, logs, extra_args=_tp_args(tp, dtype), wait=False)
    return started[name]


@pytest.fixture(
    scope="module",
    params=[pytest.param(p, id=_pair_id(p)) for p in SELECTED],
)
def tp_setup(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    unified_servers: dict[str, VllmServer],
    kv_digest_dir: Path,
) -> Iterator[tuple[TPPair, VllmServer]]:
    p_tp, d_tp, dtype, mode, kv, device = request.param
    ref_tp = p_tp if p_tp == d_tp else 1
    tag = _pair_id(request.param)
    model = tiny_model_dir if kv == 2 else build_tiny_model(TinyModelSpec(num_key_value_heads=kv))
    unified = _unified(unified_servers, ref_tp, dtype, model, e2e_log_dir)
    p_port, d_port = _side_channel_port(p_tp), _side_channel_port(d_tp)
    # The side that posts (pull: decode, push: prefill) connects ahead to the other.
    posts = "kv_consumer" if mode == "pull" else "kv_producer"

    def start(role: str, tp: int, port: int, peer: tuple[int, int]) -> VllmServer:
        ahead = {"connect_ahead": [{"host": "localhost", "port": peer[0], "tp_size": peer[1]}]}
        return start_server(
            f"{'prefill' if role == 'kv_producer' else 'decode'}-tp-{tag}",
            model,
            e2e_log_dir,
            extra_args=_tp_args(tp, dtype),
            kv_transfer_config=kv_config(
                role,
                mode,
                buffer_device=device,
                kv_connector_module_path=VERIFY_MODULE,
                extra=ahead if role == posts else None,
            ),
            env={
                **PD_ENV,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                kv_digests.ENV: str(kv_digest_dir),
                **({"KVXFER_RBLN_ADAPTER": "emulated"} if device == "rbln" else {}),
            },
            wait=False,
        )

    prefill = start("kv_producer", p_tp, p_port, (d_port, d_tp))
    decode = start("kv_consumer", d_tp, d_port, (p_port, p_tp))
    try:
        wait_all_healthy([unified, prefill, decode])
        pair = TPPair(
            mode,
            prefill,
            decode,
            decode_tp=d_tp,
            kv_heads=kv,
            prefill_tp=p_tp,
            ports=(p_port, d_port),
            device=device,
        )
        # The first load is where a producer stalled (issue 25): the history of its
        # threads' activity goes with a failure.
        with sampling([prefill, decode]):
            through_pd(pair, "warm up the pair", "warm up the pair", max_tokens=2)
        unified.complete("warm up", max_tokens=2)
        yield pair, unified
    finally:
        for s in (prefill, decode):
            s.stop()


def test_output_equals_unified_and_every_prompt_token_came_over(
    tp_setup: tuple[TPPair, VllmServer],
) -> None:
    pair, unified = tp_setup
    d = pair.decode
    for name in ("multi_block_partial", "long", "sub_block"):
        prompt = f"Across TP sizes: {PROMPTS[name]}"
        ids = prompt_ids(unified, prompt)
        local0 = d.metric(SOURCE, source="local_compute")
        remote0 = d.metric(SOURCE, source="external_kv_transfer")
        assert through_pd(pair, prompt, prompt) == reference(unified, prompt), name
        local = d.metric(SOURCE, source="local_compute") - local0
        remote = d.metric(SOURCE, source="external_kv_transfer") - remote0
        # vLLM recomputes only the last prompt token itself (it needs its logits).
        assert local <= 1 and remote >= len(ids) - 1, (name, local, remote, len(ids))
    assert not re.search(r"kvxfer: KV load of \S+ (failed|refused)", d.log_text())
    # Chain lists (issue 27): posted device to device where two heads or more of a
    # rank lie side by side on both sides, never by host bounce (it stages per block id).
    kv, tps = pair.kv_heads, (pair.prefill_tp, pair.decode_tp)
    chained = pair.device == "rbln" and tps[0] != tps[1] and min(kv // t for t in tps) >= 2
    poster = pair.decode if pair.mode == "pull" else pair.prefill
    logged = re.findall(r"chain lists prepared with .*: (\d+) chain\(s\)", poster.log_text())
    assert bool(logged) == chained, (pair.device, pair.mode, kv, tps, logged)


def test_the_posting_side_connected_ahead_to_the_ranks_holding_its_heads(
    tp_setup: tuple[TPPair, VllmServer],
) -> None:
    """``connect_ahead`` (this module's pairs give the posting side the other's rank 0
    address and TP size): every posting rank handshook at start-up with exactly the
    peer ranks holding its heads (``Agent.connect_group``)."""
    pair, _ = tp_setup
    kv, (p_port, d_port) = pair.kv_heads, pair.ports
    p_heads = HeadLayout(num_kv_heads=kv, tp_size=pair.prefill_tp)
    d_heads = HeadLayout(num_kv_heads=kv, tp_size=pair.decode_tp)
    if pair.mode == "pull":  # decode ranks read prefill ranks
        poster, mine, base, peer_tp, reads = pair.decode, d_heads, p_port, pair.prefill_tp, True
    else:  # prefill ranks write into decode ranks
        poster, mine, base, peer_tp, reads = pair.prefill, p_heads, d_port, pair.decode_tp, False
    want = sorted(
        [base + p for p in peer_ranks(mine, r, peer_tp, reads=reads)] for r in range(mine.tp_size)
    )
    line = (
        rf"kvxfer: connected ahead to localhost:{base} \(tp_size {peer_tp}\), "
        r"ranks at ports \[([\d, ]+)\]"
    )
    # A peer not up yet is tried again after a pause of at most 5 s (adapters/vllm/ahead.py).
    deadline = time.monotonic() + 15
    while len(re.findall(line, poster.log_text())) < len(want) and time.monotonic() < deadline:
        time.sleep(0.25)
    got = sorted([int(x) for x in m.split(", ")] for m in re.findall(line, poster.log_text()))
    assert got == want, poster.log_text()[-3000:]


def test_negative_control_decode_continues_the_transferred_prompt(
    tp_setup: tuple[TPPair, VllmServer],
) -> None:
    """Decode asked for prompt A but given B's KV continues B: every decode rank used
    the heads it read from the producer ranks, not a recomputation of A."""
    pair, unified = tp_setup
    text = "Northern islands across the TP group remember the silver harbor " * 2
    a = prompt_ids(unified, text)
    b = [(a[0] + 1) % 500 or 1, *a[1:]]
    ref_a, ref_b = reference(unified, a), reference(unified, b)
    assert ref_a != ref_b, "the control needs prompts whose continuations differ"
    assert through_pd(pair, b, a) == ref_b, "decode did not use the transferred KV"


def _transfer(pair: PDPair, prompt: str | list[int]) -> str:
    """Prefill then decode ``prompt`` (two tokens: only the load matters here); the
    transfer id both sides' digest records carry."""
    params = prefill(pair.prefill, prompt)
    decode(pair.decode, prompt, params, max_tokens=2)
    return kv_digests.transfer_id(params)


def test_kv_bytes_landed_equal_the_producers_per_head_and_token(
    tp_setup: tuple[TPPair, VllmServer], kv_digest_dir: Path
) -> None:
    """Issue 18: for every (layer, K/V, global KV head, token) decode loaded, the
    bytes in the decode rank's blocks once the load completed equal the bytes in the
    producer rank's blocks when it held them; the decode ranks together cover every
    head of every transferred token exactly once (as often as decode replicates it);
    and the comparison can fail (the negative control's two prompts give different
    digests)."""
    pair, unified = tp_setup
    d = pair.decode
    heads = set(range(pair.kv_heads))
    replicas = HeadLayout(num_kv_heads=pair.kv_heads, tp_size=pair.decode_tp).replicas
    prompts = {
        "multi_block_partial": f"Byte for byte: {PROMPTS['multi_block_partial']}",
        "long": f"Byte for byte: {PROMPTS['long']}",
    }
    for name, prompt in prompts.items():
        ids = prompt_ids(unified, prompt)
        remote0 = d.metric(SOURCE, source="external_kv_transfer")
        tid = _transfer(pair, prompt)
        remote = d.metric(SOURCE, source="external_kv_transfer") - remote0
        prod, cons = kv_digests.wait_for_records(kv_digest_dir, tid)
        assert {h for r in prod for h in r.heads} == heads, (name, [r.heads for r in prod])
        assert {h for r in cons for h in r.heads} == heads, (name, [r.heads for r in cons])
        result = kv_digests.compare(prod, cons, replicas=replicas)
        assert result.ok, f"{name}: {result.summary()}"
        start, end = result.token_range
        # The digested range is the load's, and what vLLM counted as transferred.
        assert start == 0 and len(ids) - 1 <= end <= len(ids), (name, result.token_range)
        assert remote == end - start, (name, remote, result.token_range)
        layers = {key[0] for r in prod for key in r.digests}
        assert result.expected == len(layers) * 2 * len(heads) * (end - start) > 0
        assert result.compared == replicas * result.expected, result.summary()
    assert len(prompt_ids(unified, prompts["multi_block_partial"])) % E2E_BLOCK_SIZE

    # Not vacuous: prompt B differs from A in its first token only; B's producer
    # digests must not pass for A's landed KV (every later token of a later layer
    # attends to token 0, so all of them differ).
    a = prompt_ids(unified, "The byte check's control: islands remember the harbor " * 3)
    b = [(a[0] + 1) % 500 or 1, *a[1:]]
    tid_a, tid_b = _transfer(pair, a), _transfer(pair, b)
    prod_a, cons_a = kv_digests.wait_for_records(kv_digest_dir, tid_a)
    prod_b, _ = kv_digests.wait_for_records(kv_digest_dir, tid_b)
    assert kv_digests.compare(prod_a, cons_a, replicas=replicas).ok
    crossed = kv_digests.compare(prod_b, cons_a, replicas=replicas)
    assert not crossed.ok and not crossed.missing and not crossed.repeated
    last = list(prod_a[0].digests)[-1][0]  # records keep the engine's layer order
    start, end = crossed.token_range
    mismatched = set(crossed.mismatches)
    for part in ("K", "V"):
        for head in heads:
            for token in range(start, end):
                assert (last, part, head, token) in mismatched, (last, part, head, token)


def _worker_pid(server: VllmServer, rank: int) -> int | None:
    """The pid of tensor-parallel worker ``rank`` of ``server`` (vLLM titles its
    processes ``VLLM::Worker_TP<rank>``), found in the server's process group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if os.getpgid(int(entry.name)) != server.pid:
                continue
        except (OSError, ProcessLookupError):
            continue
        if f"Worker_TP{rank}" in title:
            return int(entry.name)
    return None


def _ranks_read(pair: TPPair, params: dict[str, Any]) -> set[int]:
    """The producer ranks the decode instance reads this request from (every rank
    unless heads are replicated there: then one replica per head, salted by the id
    the producer's agents hold it under, as kvxfer._agent.tp_pull picks it)."""
    p_tp, d_tp, kv = int(params["tp_size"]), pair.decode_tp, pair.kv_heads
    salt = zlib.crc32(kv_digests.transfer_id(params).encode())
    p_heads = HeadLayout(num_kv_heads=kv, tp_size=p_tp)
    d_heads = HeadLayout(num_kv_heads=kv, tp_size=d_tp)
    if p_tp == d_tp:
        return set(range(p_tp))
    return {p for r in range(d_tp) for p in needed_ranks(d_heads, r, p_heads, salt=salt)}


def test_a_killed_producer_rank_fails_the_load_cleanly_and_decode_keeps_serving(
    tp_setup: tuple[TPPair, VllmServer],
) -> None:
    """Last in this module (it kills the pair's prefill): a producer rank that decode
    reads (the last such rank) dies between prefill and decode's pull or
    registration; decode's request fails (HTTP 500, vLLM's default
    kv_load_failure_policy) well before transfer_timeout_s, and decode keeps serving.
    With replicated heads decode reads one replica of each head, chosen by the request
    id: the rank killed is one it reads."""
    pair, _ = tp_setup
    d = pair.decode
    prompt = "A rank of the prefill group dies before decode reads its heads " * 2
    params = prefill(pair.prefill, prompt)
    tp = int(params["tp_size"])
    pid = _worker_pid(pair.prefill, max(_ranks_read(pair, params))) if tp > 1 else None
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    else:
        pair.prefill.kill()
    t0 = time.monotonic()
    with pytest.raises(HttpError) as err:
        decode(d, prompt, params)
    assert err.value.status == 500
    assert time.monotonic() - t0 < 15, "the failed load waited for transfer_timeout_s"
    assert re.search(r"kvxfer: KV load of \S+ failed", d.log_text())
    assert d.complete("still serving", max_tokens=4)["choices"][0]["text"] is not None
