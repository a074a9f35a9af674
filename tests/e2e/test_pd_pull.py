"""Prefill/decode through the pull connector on real vLLM engines, against the
unified instance (R-VLLM-5), with a negative control, recompute evidence, the
operator's log lines and metrics, and a prefill instance killed under decode.

This drives the two instances the way upstream's toy proxy does (see ``pd.py``); the
proxy itself is tested elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .pd import PDPair, decode, prefill, prompt_ids, reference, start_prefill, through_pd
from .servers import HttpError, VllmServer, wait_all_healthy
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e

SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.mark.parametrize("name", list(PROMPTS))
def test_pd_output_equals_unified(name: str, pull_pair: PDPair, unified_server: VllmServer) -> None:
    prompt = PROMPTS[name]
    assert through_pd(pull_pair, prompt, prompt) == reference(unified_server, prompt)


def test_decode_does_not_recompute_the_prompt(
    pull_pair: PDPair, unified_server: VllmServer
) -> None:
    d = pull_pair.decode
    prompt = "Seven golden lanterns cross the quiet harbor while the engine decodes " * 3
    ids = prompt_ids(unified_server, prompt)
    local0 = d.metric(SOURCE, source="local_compute")
    remote0 = d.metric(SOURCE, source="external_kv_transfer")
    loads0 = d.metric("vllm:kvxfer_transfers_total")
    assert through_pd(pull_pair, prompt, prompt) == reference(unified_server, prompt)
    local = d.metric(SOURCE, source="local_compute") - local0
    remote = d.metric(SOURCE, source="external_kv_transfer") - remote0
    # vLLM recomputes only the last prompt token itself (it needs its logits).
    assert local <= 1, f"decode computed {local} prompt tokens locally"
    assert remote >= len(ids) - 1, f"only {remote} of {len(ids)} prompt tokens came remotely"
    assert d.metric("vllm:kvxfer_transfers_total") - loads0 == 1


def test_negative_control_decode_continues_the_transferred_prompt(
    pull_pair: PDPair, unified_server: VllmServer
) -> None:
    """Decode asked for prompt A but given B's KV must continue B: proof that it used
    the transferred KV instead of recomputing A. A and B are token lists of equal
    length differing in their first token only, never sent to decode before (a local
    prefix-cache hit on A would legitimately win over the remote KV)."""
    text = "Ancient river valleys remember the northern harbor and its silver islands " * 2
    a = prompt_ids(unified_server, text)
    b = [(a[0] + 1) % 500 or 1, *a[1:]]
    ref_a, ref_b = reference(unified_server, a), reference(unified_server, b)
    assert ref_a != ref_b, "the control needs prompts whose continuations differ"
    assert through_pd(pull_pair, b, a) == ref_b, "decode did not use the transferred KV"


def test_operator_log_lines_and_transfer_metrics(pull_pair: PDPair) -> None:
    """R-VLLM-4 lines reach vLLM's log; per-request transfer stats reach vLLM's stats
    logger and Prometheus; the producer's blocks were all handed back."""
    p, d = pull_pair.prefill, pull_pair.decode
    p_log = p.log_text()
    assert "RBLN NIXL: nixl-rbln not available" in p_log  # host bounce fell back to UCX
    assert "kvxfer: registered" in p_log
    # Other modules' tests fail loads on this shared decode on purpose (a push ticket).
    failed_before = d.metric("vllm:kvxfer_failed_transfers_total")
    params = prefill(p, "A lease for the log lines")
    decode(d, "A lease for the log lines", params, max_tokens=2)
    engine = params["remote_engine_id"]
    # The initiating side of a pull (decode) announces the producer's descriptors.
    assert re.search(rf"remote descriptor\(s\) for engine {re.escape(engine)}\b", d.log_text())
    # It connected to the producer at start-up (connect_ahead, tests/e2e/pd.py).
    ahead = r"kvxfer: connected ahead to localhost:(\d+) \(tp_size 1\), ranks at ports \[(\d+)\]"
    deadline = time.monotonic() + 15  # a peer not up yet is tried again within 5 s
    while not re.search(ahead, d.log_text()) and time.monotonic() < deadline:
        time.sleep(0.25)
    got = re.search(ahead, d.log_text())
    assert got and got[1] == got[2] == str(params["remote_port"]), "no connect_ahead line"
    assert d.metric("vllm:kvxfer_transfer_time_seconds_count") >= 1
    assert d.metric("vllm:kvxfer_bytes_total") > 0
    assert d.metric("vllm:kvxfer_failed_transfers_total") == failed_before
    deadline = time.monotonic() + 10  # stats are logged each second (PD_ENV)
    while "KV Transfer metrics: num_transfers=" not in d.log_text():
        assert time.monotonic() < deadline, "no 'KV Transfer metrics' line on decode"
        time.sleep(0.25)
    # Fail-closed pulls (issue 16): the guard word was read back, nothing unguarded.
    assert d.metric("vllm:kvxfer_guard_reads_total") >= 1
    assert d.metric("vllm:kvxfer_unguarded_pulls_total") == 0
    assert d.metric("vllm:kvxfer_guard_failures_total") == 0
    # Every hold ended with the consumer's notice, none by lease expiry.
    assert p.metric("vllm:kvxfer_leases_released_total") >= 1
    assert p.metric("vllm:kvxfer_leases_expired_total") == 0


def _open_request(server: VllmServer, prompt: str, **params: Any) -> socket.socket:
    """Send a completion request and return its connection unread: closing it is the
    client hanging up (vLLM then aborts the request)."""
    data = json.dumps(server.completion_body(prompt, **params)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((server.host, server.port), timeout=10)
    sock.sendall(head + data)
    return sock


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _wait_metric(server: VllmServer, name: str, ok: Callable[[float], bool], what: str) -> None:
    deadline = time.monotonic() + 60  # generous: only a hang takes this long
    while not ok(server.metric(name)):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


_BUSY = 8  # decode's --max-num-seqs: these fill it


def _all_answered(socks: list[socket.socket]) -> bool:
    """Every request on ``socks`` has its response coming back (it finished)."""
    readable, _, _ = select.select(socks, [], [], 0)
    return len(readable) == len(socks)


def _decode_full(server: VllmServer, busy: list[socket.socket]) -> bool:
    """Wait until decode runs the ``_BUSY`` requests; False when they all finished
    before a poll saw them running together (on a fast host 8 x 400 tokens of the
    tiny model take ~1.5 s, and a poll of the metrics under load can take longer)."""
    deadline = time.monotonic() + 60  # generous: only a hang takes this long
    while server.metric("vllm:num_requests_running") < _BUSY:
        if _all_answered(busy):
            return False
        assert time.monotonic() < deadline, "not 8 running"
        time.sleep(0.05)
    return True


_RELEASED = "vllm:kvxfer_leases_released_total"
_ABORTED = "vllm:kvxfer_leases_aborted_total"


def _hang_up_while_waiting(
    p: VllmServer, d: VllmServer, prompt: str, params: dict[str, Any]
) -> str:
    """Send the P/D request behind the busy ones, hang up once decode has it waiting,
    and say what became of the producer's hold. When a busy request finished first
    (a loaded CI host polls the metrics slowly), the P/D request is scheduled before a
    poll saw it waiting: it is pulled or answered, and the round tests nothing."""
    aborted0, released0 = p.metric(_ABORTED), p.metric(_RELEASED)
    late = _open_request(d, prompt, kv_transfer_params=params, max_tokens=4)
    try:
        deadline = time.monotonic() + 60  # generous: only a hang takes this long
        while d.metric("vllm:num_requests_waiting") < 1:
            if p.metric(_RELEASED) > released0 or _all_answered([late]):
                return "scheduled before a poll saw it waiting"
            assert time.monotonic() < deadline, "nothing waiting, nothing pulled or answered"
            time.sleep(0.05)
        assert d.metric("vllm:num_requests_running") == _BUSY
    finally:
        _hang_up(late)
    deadline = time.monotonic() + 10
    while True:
        if p.metric(_ABORTED) > aborted0:
            return "aborted"
        if p.metric(_RELEASED) > released0:
            return "pulled before the hang-up reached vLLM"
        assert time.monotonic() < deadline, "the producer still holds the aborted request"
        time.sleep(0.2)


def test_request_aborted_before_its_transfer_frees_the_producer_at_once(
    pull_pair: PDPair,
) -> None:
    """Decode is full (--max-num-seqs 8 busy), so the P/D request waits unscheduled; the
    client gives up, vLLM aborts it, and the producer's blocks are freed now (a
    Release over the side channel), not at the 30 s lease expiry.

    Each step is waited for, not timed: the 8 busy requests running, then the P/D
    request waiting behind them, then its client hangs up (a fixed nap and a 0.5 s
    client timeout could, on a loaded host, let the P/D request be scheduled first or
    hang up before it reached the scheduler). The busy requests' clients hang up at
    the end, so decode is idle again at once instead of generating their tokens.

    On a quiet host the busy requests can finish their tokens before vLLM acts on the
    hang-up: the P/D request is then scheduled and pulled (the producer's lease is
    released, not aborted), which tests nothing here, so that round is tried again; so
    is one where a busy request finished before a poll saw the P/D request waiting
    (then it was scheduled at once). On a fast host they can also all finish before a
    poll sees decode full: that round is tried again with the same prefilled request
    (still held)."""
    p, d = pull_pair.prefill, pull_pair.decode
    expired0 = p.metric("vllm:kvxfer_leases_expired_total")
    outcomes: list[str] = []
    held: tuple[str, dict[str, Any]] | None = None  # a prefilled prompt, its params
    for round_ in range(5):
        if held is None:  # the last one was pulled or aborted: a new request
            prompt = f"a request nobody waits for, round {round_}"
            held = (prompt, prefill(p, prompt))
        busy = [_open_request(d, f"keep decode busy {i}", max_tokens=400) for i in range(_BUSY)]
        try:
            outcome = "the busy requests finished before decode was seen full"
            if _decode_full(d, busy):
                (prompt, params), held = held, None
                outcome = _hang_up_while_waiting(p, d, prompt, params)
        finally:
            for sock in busy:
                _hang_up(sock)
        outcomes.append(outcome)
        _wait_metric(d, "vllm:num_requests_running", lambda n: n == 0, "decode still busy")
        if outcome == "aborted":
            break
    assert outcomes[-1] == "aborted", outcomes
    assert p.metric("vllm:kvxfer_leases_expired_total") == expired0


def test_idle_instances_neither_spin_nor_pin_cpus(pull_pair: PDPair) -> None:
    """No busy-spinning progress thread and no CPU pinning (upstream's connector does
    both on CPU: ~5x slower decode on the test bed). A prefill instance that holds a
    request's blocks for a decode instance that has not come yet idles too: vLLM steps
    it for as long as it holds them, and it spun 1.5 CPU-seconds per 3 s before."""
    p, d = pull_pair.prefill, pull_pair.decode
    decode(d, "idle check", prefill(p, "idle check"), max_tokens=2)
    time.sleep(1.0)  # let the producer's lease settle and both engines go idle
    before = {s.name: s.cpu_seconds() for s in (p, d)}
    time.sleep(3.0)
    for s in (p, d):
        used = s.cpu_seconds() - before[s.name]
        assert used < 0.6, f"{s.name} burned {used:.2f} CPU-seconds in 3 s idle"
    late = prefill(p, "a decode that comes late")  # held for its 30 s lease
    time.sleep(0.5)
    before = {p.name: p.cpu_seconds()}
    time.sleep(3.0)
    used = p.cpu_seconds() - before[p.name]
    assert used < 0.6, f"{p.name} burned {used:.2f} CPU-seconds in 3 s holding blocks"
    decode(d, "a decode that comes late", late, max_tokens=2)  # still served, and frees
    every_cpu = set(os.sched_getaffinity(0))
    for s in (p, d):
        pinned = {t: c for t, c in s.thread_affinities().items() if c != every_cpu}
        assert not pinned, f"{s.name}: threads pinned to CPUs {pinned}"


# --- a prefill instance dies under its decode instance (keep these last) ---------------


@pytest.fixture(scope="module", autouse=True)
def doomed_prefill(
    tiny_model_dir: Path, e2e_log_dir: Path, pull_pair: PDPair
) -> Iterator[VllmServer]:
    """A second pull producer that the last test kills (the shared one stays up).
    Started, without waiting, once the shared pair is up (autouse: with this module's
    first test), so its start-up overlaps the tests before the one that kills it."""
    server = start_prefill("prefill-pull-doomed", "pull", tiny_model_dir, e2e_log_dir, wait=False)
    try:
        yield server
    finally:
        server.stop()


def test_killed_prefill_fails_the_load_and_decode_keeps_serving(
    doomed_prefill: VllmServer, pull_pair: PDPair, unified_server: VllmServer
) -> None:
    """kv_load_failure_policy "fail" (vLLM's default): the request whose producer died
    fails (HTTP 500), the failure is in decode's log and metrics, and decode serves
    the next requests, P/D ones included."""
    d = pull_pair.decode
    wait_all_healthy([doomed_prefill])
    prompt = PROMPTS["multi_block_partial"]
    # Decode has handshaken with the doomed producer once (a cached peer).
    assert decode(d, prompt, prefill(doomed_prefill, prompt)) == reference(unified_server, prompt)
    other = "Winter rivers carry a thousand silver lanterns to the quiet eastern harbor"
    params = prefill(doomed_prefill, other)
    doomed_prefill.kill()
    failed0 = d.metric("vllm:kvxfer_failed_transfers_total")
    t0 = time.monotonic()
    with pytest.raises(HttpError) as err:
        decode(d, other, params)
    assert err.value.status == 500
    assert time.monotonic() - t0 < 15, "the failed load took longer than transfer_timeout_s"
    log = d.log_text()
    assert "due to KV load failure" in log, "vLLM did not apply its load-failure policy"
    assert re.search(r"kvxfer: KV load of \S+ failed", log)
    assert d.metric("vllm:kvxfer_failed_transfers_total") - failed0 == 1
    # Decode keeps serving: a plain request and a P/D request through the live producer.
    assert d.complete("still serving", max_tokens=4)["choices"][0]["text"] is not None
    short = PROMPTS["sub_block"]
    assert through_pd(pull_pair, short, short) == reference(unified_server, short)
