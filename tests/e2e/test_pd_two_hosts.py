"""Prefill and decode on two hosts, behind llm-d's routing-sidecar flow (R-VLLM-3,
R-VLLM-6, R-VLLM-7; issue 26 items 3 and 4, issue 25's vLLM test).

Two network namespaces joined by a veth pair stand for the prefill and the decode pod
(tests/e2e/hosts.py): each engine's side channel on its own address, port 5600, its
KV over UCX's TCP transport across the veth; decode's routing sidecar
(tests/e2e/sidecar.py, llm-d's flow, parsing JSON numbers as float64 as Go does) on
the decode host in front of decode's vLLM. Pull and push, the tiny model in float32
against a unified float32 instance on the test host:

- greedy output through the sidecar equals unified (whole and streamed), prefill made
  one token per request, decode computed no prompt token itself, and at least the KV
  bytes decode counted crossed the veth;
- a negative control across the hosts;
- the link taken down mid-transfer (bytes already crossing a veth shaped to a few
  Mbit/s) fails that request with an HTTP error within ``transfer_timeout_s``; decode
  keeps serving; with the link back up the next request through the sidecar succeeds,
  nothing restarted. A push's blocks stay quarantined past the request's failure,
  until the producer can say its write ended (its bytes still land when the link
  returns);
- clients that hang up while their KV moves, interleaved with normal requests at
  concurrency 8 for a bounded time: every completed request equals unified, none
  hangs, and decode's ``vllm:kvxfer_quarantined`` is back at 0.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvxfer.adapters.vllm.ahead import MAX_RETRY_S

from . import netns_http
from .hosts import (
    SERVICE,
    SIDE_CHANNEL_PORT,
    TRANSFER_TIMEOUT_S,
    Site,
    start_site,
    through_sidecar,
    two_hosts,
)
from .pd import MAX_TOKENS, decode, divergence, prefill, prompt_ids, reference
from .servers import HttpError, VllmServer
from .sidecar import PREFILL_HEADER
from .test_unified_baseline import PROMPTS

# Three engines start with the first test of each mode (~30 s on a quiet host, ~110 s
# seen on a loaded one); the link-down test can wait for the link's return.
pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.timeout(600)]

SOURCE = "vllm:prompt_tokens_by_source_total"
TIMEOUT_S = float(TRANSFER_TIMEOUT_S)


@pytest.fixture(scope="module")
def unified32(unified_f32: VllmServer) -> VllmServer:
    """The float32 reference on the test host (the session's, shared with
    test_pd_tp); waited for with the first site."""
    return unified_f32


@pytest.fixture(scope="module", params=["pull", "push"])
def site(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    e2e_log_dir: Path,
    unified32: VllmServer,
) -> Iterator[Site]:
    mode = str(request.param)
    with two_hosts({"pull": "hl", "push": "hs"}[mode]) as hosts:
        s = start_site(mode, tiny_model_dir, e2e_log_dir, hosts, also_wait=[unified32])
        try:
            # One-off costs (first handshake, UCX wire-up, kernel selection) first.
            through_sidecar(s, "warm up the two hosts", max_tokens=2)
            unified32.complete("warm up", max_tokens=2)
            yield s
        finally:
            s.stop()


def _stream_text(site: Site, prompt: str) -> str:
    body = site.sidecar.completion_body(prompt, stream=True, logprobs=None)
    req = urllib.request.Request(
        site.sidecar.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", PREFILL_HEADER: site.prefill_target},
    )
    text = ""
    with site.sidecar.open(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                text += json.loads(line[5:])["choices"][0].get("text") or ""
    return text


def test_sidecar_output_equals_unified_and_the_kv_crossed_the_veth(
    site: Site, unified32: VllmServer
) -> None:
    p, d, hosts = site.prefill, site.decode, site.hosts
    veth0, kv0 = hosts.veth_bytes(), d.metric("vllm:kvxfer_bytes_total")
    local0 = d.metric(SOURCE, source="local_compute")
    remote0 = d.metric(SOURCE, source="external_kv_transfer")
    made0 = p.metric("vllm:generation_tokens_total")
    prompts = [f"{site.mode} across hosts: {text}" for text in PROMPTS.values()]
    for prompt in prompts:
        assert through_sidecar(site, prompt, max_tokens=MAX_TOKENS) == reference(
            unified32, prompt
        ), prompt
    # Streamed: the client's stream flag reached decode (prefill ran with stream false).
    streamed = f"{site.mode} streamed across hosts: {PROMPTS['multi_block_partial']}"
    whole = unified32.complete(streamed, max_tokens=MAX_TOKENS, logprobs=None)
    assert _stream_text(site, streamed) == whole["choices"][0]["text"]
    prompts.append(streamed)

    # Prefill ran each request for one token (max_tokens 1 from the sidecar).
    assert p.metric("vllm:generation_tokens_total") - made0 == len(prompts)
    # Decode computed no prompt token but each request's last (vLLM needs its logits).
    lengths = [len(prompt_ids(unified32, q)) for q in prompts]
    assert d.metric(SOURCE, source="local_compute") - local0 <= len(prompts)
    remote = d.metric(SOURCE, source="external_kv_transfer") - remote0
    assert remote >= sum(lengths) - len(prompts), (remote, lengths)
    # The KV went over the veth (UCX over TCP), not through shared memory.
    moved = d.metric("vllm:kvxfer_bytes_total") - kv0
    crossed = hosts.veth_bytes() - veth0
    assert moved > 0
    assert crossed >= moved, f"{moved} KV bytes moved but only {crossed} crossed the veth"
    # Side channels on the hosts' own addresses: the initiator of the data plane names
    # its peer's address (decode for pull, prefill for push).
    initiator, peer_addr = (
        (d, hosts.prefill_addr) if site.mode == "pull" else (p, hosts.decode_addr)
    )
    assert re.search(
        rf"remote descriptor\(s\) for engine \S+ at {re.escape(peer_addr)}:", initiator.log_text()
    ), initiator.log_text()[-3000:]
    # It connected ahead to the other pod found under its Service name (hosts.py). The
    # other pod may have answered its side channel only after these requests (each then
    # handshook itself): connect_ahead retries with a pause growing to MAX_RETRY_S, so
    # its line may come that much later.
    service = SERVICE["prefill" if site.mode == "pull" else "decode"]
    ahead = (
        rf"kvxfer: connected ahead to {re.escape(peer_addr)}:{SIDE_CHANNEL_PORT} \(tp_size 1\), "
        rf"ranks at ports \[{SIDE_CHANNEL_PORT}\], after [\d.]+ s "
        rf"\(found under {re.escape(service)}:{SIDE_CHANNEL_PORT}\)"
    )
    until = time.monotonic() + 3 * MAX_RETRY_S
    while not re.search(ahead, initiator.log_text()) and time.monotonic() < until:
        time.sleep(0.2)
    assert re.search(ahead, initiator.log_text()), initiator.log_text()[-3000:]
    print(f"{site.mode}: {moved / 1e3:.0f} kB of KV, {crossed / 1e3:.0f} kB over the veth")


def test_negative_control_across_hosts(site: Site, unified32: VllmServer) -> None:
    """Decode asked for prompt A with B's ticket continues B: it used the KV that came
    across, it did not recompute A."""
    text = f"Silver harbor lanterns on the {site.mode} host follow the quiet river " * 2
    a = prompt_ids(unified32, text)
    b = [(a[0] + 1) % 500 or 1, *a[1:]]
    ref_a, ref_b = reference(unified32, a), reference(unified32, b)
    assert ref_a != ref_b
    rid = f"neg-{uuid.uuid4().hex[:8]}"
    params = prefill(site.prefill, b, rid)
    assert params["remote_host"] == site.hosts.prefill_addr
    assert decode(site.decode, a, params, request_id=rid) == ref_b


def test_link_down_mid_transfer_fails_in_time_and_recovers(
    site: Site, unified32: VllmServer
) -> None:
    """R-VLLM-7 with R-SAFE-5: a request whose transfer a dead link cut fails within
    ``transfer_timeout_s``, and its blocks stay quarantined until no byte of it can
    land. Pull: UCX's TCP keepalive (kvxfer's default, ~4 s) fails the READ's endpoint
    while the link is down, and the READ is over. Push: the request fails at its
    deadline, its blocks held until the producer says its WRITE ended. The link back, the next
    request succeeds without a restart (the peer is handshaken and connected anew)."""
    hosts, d = site.hosts, site.decode
    prompt = f"The link goes down under the {site.mode} transfer: {PROMPTS['long']}"
    n = len(prompt_ids(unified32, prompt))
    assert 300 < n < 512 - MAX_TOKENS, n
    failed0 = d.metric("vllm:kvxfer_failed_transfers_total")
    outcome: dict[str, Any] = {}
    # ~1 KiB of KV a token in float32: ~0.35 MB, over a second at 2 Mbit/s.
    with hosts.shaped("2mbit"):
        rid = f"down-{uuid.uuid4().hex[:8]}"
        params = prefill(site.prefill, prompt, rid)

        def run() -> None:
            try:
                out = d.complete(
                    prompt,
                    max_tokens=MAX_TOKENS,
                    logprobs=None,
                    kv_transfer_params=params,
                    headers={"X-Request-Id": rid},
                    timeout=300,
                )
                outcome["tokens"] = out["choices"][0]["text"]
            except HttpError as exc:
                outcome["status"] = exc.status
            except OSError as exc:
                outcome["error"] = exc
            outcome["t"] = time.monotonic()

        before = hosts.veth_bytes()
        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 20
        while hosts.veth_bytes() - before < 64 << 10:  # the transfer is under way
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.02)
        hosts.set_link(False)
        down_at = time.monotonic()
        try:
            thread.join(timeout=TIMEOUT_S + 5)
            in_time = not thread.is_alive()
            # Decode keeps serving (on its own: prefill is unreachable).
            assert d.complete("decode still serves", max_tokens=4)["choices"][0]["text"]
            # The gauge reaches the metrics with the next stats interval (1 s).
            held = d.metric("vllm:kvxfer_quarantined")
            for _ in range(20 if site.mode == "push" else 0):
                if held:
                    break
                time.sleep(0.25)
                held = d.metric("vllm:kvxfer_quarantined")
        finally:
            hosts.set_link(True)
            up_at = time.monotonic()
    thread.join(timeout=240)
    assert not thread.is_alive(), "the request still hangs 240 s after the link came back"
    took = outcome["t"] - down_at
    # The cut transfer is final once no byte of it can land: pull, with its READ;
    # push, once the producer's WRITE ended (TCP resumes it on its retransmission
    # timer after the link came back) and the producer said so.
    settle_s = _wait_quarantine_empty(d)
    print(
        f"{site.mode}: link down -> {outcome} {took:.2f} s after it went down "
        f"({outcome['t'] - up_at:.2f} s after it came back up); quarantined while down: "
        f"{held}, final {settle_s:.1f} s after the link came back"
    )
    assert "tokens" not in outcome, "a transfer cut mid-way answered 200"
    assert outcome.get("status") == 500, outcome
    if site.mode == "push":
        # R-SAFE-5: the request failed, its blocks did not go back to vLLM (the
        # producer's WRITE goes on in its TCP retransmissions; no word from it yet).
        assert held == 1, f"push: {held} loads quarantined while the link was down"
    assert d.metric("vllm:kvxfer_failed_transfers_total") - failed0 == 1
    # The link is back: a request through the sidecar succeeds, nothing restarted (the
    # route may take a moment to come back with the carrier).
    again = f"After the link came back ({site.mode}): {PROMPTS['multi_block_partial']}"
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while True:
        try:
            got = through_sidecar(site, again, max_tokens=MAX_TOKENS)
            break
        except HttpError:  # the route comes back with the carrier
            assert time.monotonic() < deadline, "no request succeeded after the link came back"
            time.sleep(0.5)
    assert got == reference(unified32, again)
    _wait_quarantine_empty(d)
    # R-VLLM-7: the failure came within transfer_timeout_s of the link going down.
    assert in_time, f"the request failed {took:.1f} s after the link went down"


def _wait_quarantine_empty(d: VllmServer, timeout_s: float = 90.0) -> float:
    """Seconds until decode holds no quarantined load. A push reception waits for its
    producer's word; an aborted one whose release did not reach the producer waits for
    the producer's lease to expire (30 s): 37.5 s after the load was seen on a loaded
    host."""
    t0 = time.monotonic()
    while d.metric("vllm:kvxfer_quarantined") != 0:
        assert time.monotonic() - t0 < timeout_s, "transfers still quarantined"
        time.sleep(0.5)
    return time.monotonic() - t0


# --- issue 25: clients that hang up while their KV moves --------------------------------

SOAK_S = 30.0
CONCURRENCY = 8


def _hang_up_during_decode(site: Site, prompt: str, delay_s: float) -> None:
    """Prefill, then a decode request whose client closes its connection after
    ``delay_s`` (the KV is moving then: the link is shaped)."""
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    params = prefill(site.prefill, prompt, rid)
    body = site.decode.completion_body(
        prompt, logprobs=None, max_tokens=MAX_TOKENS, kv_transfer_params=params
    )
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = netns_http.connect(site.decode.netns or "", "127.0.0.1", site.decode.port, 10.0)
    try:
        sock.sendall(head + data)
        time.sleep(delay_s)
    finally:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def test_clients_hanging_up_while_kv_moves(site: Site, unified32: VllmServer) -> None:
    d, hosts = site.decode, site.hosts
    rng = random.Random(25)
    words = " ".join(PROMPTS.values()).split()
    counter = itertools.count()
    lock = threading.Lock()
    done: list[tuple[str, list[int], float]] = []
    failed: list[tuple[str, str]] = []
    gone: list[float] = []
    metrics0 = {
        name: d.metric(name)
        for name in (
            "vllm:kvxfer_transfers_total",
            "vllm:kvxfer_failed_transfers_total",
            "vllm:kvxfer_quarantines_total",
        )
    }
    log0 = len(d.log_text())

    def next_prompt() -> tuple[int, str]:
        with lock:
            i = next(counter)
            n = rng.randrange(20, 140)  # ~60-420 tokens
            start = rng.randrange(len(words))
        return i, f"Soak {site.mode} {i}: " + " ".join(
            words[(start + k) % len(words)] for k in range(n)
        )

    def worker(end: float) -> None:
        while time.monotonic() < end:
            i, prompt = next_prompt()
            t0 = time.monotonic()
            if i % 3 == 2:
                delay = rng.uniform(0.0, 0.6)
                try:
                    _hang_up_during_decode(site, prompt, delay)
                except (OSError, HttpError) as exc:
                    with lock:
                        failed.append((prompt, f"hang-up request: {exc}"))
                with lock:
                    gone.append(delay)
                continue
            try:
                got = through_sidecar(site, prompt, max_tokens=MAX_TOKENS, timeout=90)
            except (OSError, HttpError) as exc:
                with lock:
                    failed.append((prompt, str(exc)))
                continue
            with lock:
                done.append((prompt, got, time.monotonic() - t0))

    t_start = time.monotonic()
    with hosts.shaped("16mbit"):
        threads = [
            threading.Thread(target=worker, args=(t_start + SOAK_S,)) for _ in range(CONCURRENCY)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=SOAK_S + 120)
        assert not any(t.is_alive() for t in threads), "requests still running (a hang)"
    # Nothing left behind on decode: no request running or waiting, nothing quarantined.
    deadline = time.monotonic() + 60
    while d.metric("vllm:num_requests_running") + d.metric("vllm:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "decode still has requests after the load"
        time.sleep(0.5)
    settle_s = _wait_quarantine_empty(d)
    assert "vllm:kvxfer_quarantined" in d.metrics()
    assert "vllm:kvxfer_quarantines_total" in d.metrics()
    assert not failed, f"{len(failed)} requests failed: {failed[:3]}"
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        refs = list(pool.map(lambda item: reference(unified32, item[0]), done))
    wrong = [(p, got) for (p, got, _), ref in zip(done, refs, strict=True) if got != ref]
    assert not wrong, f"{len(wrong)} of {len(done)} outputs differ from unified: " + "; ".join(
        f"{p!r}: {divergence(unified32, p, got)}" for p, got in wrong[:2]
    )
    delta = {name: d.metric(name) - v for name, v in metrics0.items()}
    # Loads cut because vLLM aborted the request (its client hung up): the hang-ups
    # reached kvxfer's transfers, which were then held until their READ or write ended.
    aborted = len(re.findall(r"KV load of \S+ failed \(aborted\)", d.log_text()[log0:]))
    slowest = max((s for *_, s in done), default=0.0)
    print(
        f"{site.mode}: {len(done)} answered (slowest {slowest:.2f} s), {len(gone)} clients "
        f"hung up, {aborted} loads aborted by decode; kvxfer transfers "
        f"{delta['vllm:kvxfer_transfers_total']:.0f}, failed "
        f"{delta['vllm:kvxfer_failed_transfers_total']:.0f}, quarantined "
        f"{delta['vllm:kvxfer_quarantines_total']:.0f}; quarantine empty "
        f"{settle_s:.1f} s after the load"
    )
    assert len(done) >= CONCURRENCY and len(gone) >= CONCURRENCY
    assert aborted >= 1, "no hang-up reached a transfer: the test did not test that"
