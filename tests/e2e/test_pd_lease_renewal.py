"""A decode request that waits in decode's queue longer than the producer's lease still
gets its KV (issue 54): the pull consumer's agent keeps the hold alive while the
request waits, renewing it from its own timer (``Agent.keep_alive``), not decode's step
loop.

Prefill holds each prompt for ``kv_lease_duration: 5`` seconds (a CI host at load 8
on 2 cores once failed a 3 s one with HTTP 500, while decode still renewed from its
step loop; failure reports now carry the servers' warnings). Decode runs one
sequence at a time (``--max-num-seqs 1``) and is kept busy by plain requests queued
ahead of the P/D one, which the test hangs up (vLLM aborts them) once the P/D request
has waited two and a half leases.
Checked: decode's output equals what the same engine computes from the prompt itself
(the reference); prefill renewed the hold and none of its leases expired; decode sent
renewals, none refused or lapsed. Without renewals the same wait fails the load
(``tests/test_lease_renewal.py`` shows the expiry and the refusal at the Agent).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import random
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .model import TinyModelSpec, build_tiny_model
from .pd import PD_ENV, PDPair, decode, kv_config, prefill, tokens
from .servers import VllmServer, free_port, start_server, wait_all_healthy

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers]

LEASE_S = 5.0
#: How long the P/D request waits in decode's queue, in leases.
WAIT_LEASES = 2.5
NEW_TOKENS = 8
#: Tokens each blocking request decodes at most (within the test bed's max model length).
BLOCKER_TOKENS = 480


@pytest.fixture(scope="module")
def lease_pair(e2e_log_dir: Path) -> Iterator[PDPair]:
    model = build_tiny_model(TinyModelSpec())
    servers = []
    for role, kv_role, args in (
        ("prefill", "kv_producer", ()),
        ("decode", "kv_consumer", ("--max-num-seqs", "1")),
    ):
        servers.append(
            start_server(
                f"{role}-lease-renewal",
                model,
                e2e_log_dir,
                kv_transfer_config=kv_config(kv_role, extra={"kv_lease_duration": LEASE_S}),
                env={**PD_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                extra_args=args,
                wait=False,
            )
        )
    try:
        wait_all_healthy(servers)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    pair = PDPair("lease", servers[0], servers[1])
    try:
        yield pair
    finally:
        pair.stop()


class _Blocker:
    """A plain request on decode that keeps its one sequence slot busy until
    :meth:`abort` hangs up (vLLM aborts a completion whose client disconnected)."""

    def __init__(self, server: VllmServer, prompt: list[int]) -> None:
        self.conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
        body = server.completion_body(prompt, max_tokens=BLOCKER_TOKENS, logprobs=None)
        self.conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


def _queued_pd_request(pair: PDPair, prompt: list[int], count: int) -> tuple[list[int], float]:
    """Prefill ``prompt``, queue ``count`` blockers on decode, then ask decode for the
    P/D request behind them; hang the blockers up once it waited :data:`WAIT_LEASES`
    leases. Its tokens and how long after prefill's hold it answered."""
    p, d = pair.prefill, pair.decode
    rid = f"e2e-lease-{uuid.uuid4().hex[:12]}"
    # Prefill first, so that the hold starts before the blockers: the time prefill
    # takes under load cannot eat into their head start.
    params = prefill(p, prompt, rid)
    held = time.time()
    rng = random.Random(rid)
    blockers = [_Blocker(d, [rng.randrange(1, 500) for _ in range(20)]) for _ in range(count)]
    try:
        time.sleep(0.5)  # the blockers reach decode's queue first

        def answered() -> tuple[list[int], float]:
            got = decode(d, prompt, params, request_id=rid, max_tokens=NEW_TOKENS, timeout=300)
            return got, time.time() - held

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(answered)
            time.sleep(max(0.0, held + WAIT_LEASES * LEASE_S - time.time()))
            for b in blockers:
                b.abort()  # decode schedules the P/D request next
            return answer.result()
    finally:
        for b in blockers:
            b.abort()


@pytest.mark.timeout(600)
def test_a_request_queued_past_twice_the_lease_still_loads_its_kv(lease_pair: PDPair) -> None:
    p, d = lease_pair.prefill, lease_pair.decode
    rng = random.Random(54)
    renewed_before = p.metric("vllm:kvxfer_leases_renewed_total")
    waits = []
    # Blockers enough to keep decode busy past the wait on any host (one runs at a
    # time, each up to BLOCKER_TOKENS steps); the wait is this test's precondition, not
    # what it checks: where they all ended first it goes once more (a new prompt, so
    # decode's prefix cache holds none of it) with three times as many.
    count = 12
    for _ in range(2):
        prompt = [rng.randrange(1, 500) for _ in range(70)]
        ref = tokens(
            d.complete(prompt, max_tokens=NEW_TOKENS, logprobs=None, return_token_ids=True)
        )
        got, waited = _queued_pd_request(lease_pair, prompt, count)
        waits.append((count, round(waited, 1)))
        assert got == ref, "decode did not load the held KV"
        if waited > 2 * LEASE_S:
            break
        count *= 3
    assert waited > 2 * LEASE_S, f"the request never waited two leases: (blockers, s) {waits}"
    assert p.metric("vllm:kvxfer_leases_renewed_total") > renewed_before
    assert p.metric("vllm:kvxfer_leases_expired_total") == 0
    assert d.metric("vllm:kvxfer_lease_renewals_total") > 0
    assert d.metric("vllm:kvxfer_lease_renewals_refused_total") == 0
    assert d.metric("vllm:kvxfer_lease_renewals_lapsed_total") == 0
    assert d.metric("vllm:kvxfer_failed_transfers_total") == 0
