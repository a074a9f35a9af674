"""Prefill/decode through the push connector (experimental) on real vLLM engines:
the producer WRITEs the prompt's KV into blocks the consumer registered.

Two dispatch orders: sequential (the toy proxy's: prefill first, its returned
``kv_transfer_params`` go to decode, which registers its blocks) and concurrent (both
at once with one ``X-Request-Id``; decode knows only the producer's address and the
engines match on the request id without vLLM's random suffix). Also here: a pull
instance paired with a push instance fails at the handshake, on the decode side.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import Any

import pytest

from .pd import PDPair, decode, prefill, prompt_ids, reference, through_pd
from .servers import HttpError, VllmServer
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e

SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.mark.parametrize("name", list(PROMPTS))
def test_push_output_equals_unified(
    name: str, push_pair: PDPair, unified_server: VllmServer
) -> None:
    prompt = PROMPTS[name]
    assert through_pd(push_pair, prompt, prompt) == reference(unified_server, prompt)


def test_push_decode_does_not_recompute_and_producer_announces_descriptors(
    push_pair: PDPair, unified_server: VllmServer
) -> None:
    p, d = push_pair.prefill, push_pair.decode
    prompt = "Bright northern islands follow the slow golden river into the evening " * 3
    ids = prompt_ids(unified_server, prompt)
    local0 = d.metric(SOURCE, source="local_compute")
    remote0 = d.metric(SOURCE, source="external_kv_transfer")
    assert through_pd(push_pair, prompt, prompt) == reference(unified_server, prompt)
    assert d.metric(SOURCE, source="local_compute") - local0 <= 1
    assert d.metric(SOURCE, source="external_kv_transfer") - remote0 >= len(ids) - 1
    # In push the producer initiates the data plane: it logs the consumer's descriptors.
    d_engine = re.search(r"for engine (\S+) at", p.log_text())
    assert d_engine, "no 'remote descriptor(s) for engine' line on the push producer"
    # The producer connected to the consumer at start-up (connect_ahead, tests/e2e/pd.py).
    ahead = r"kvxfer: connected ahead to localhost:(\d+) \(tp_size 1\), ranks at ports \[\1\]"
    deadline = time.monotonic() + 15  # a peer not up yet is tried again within 5 s
    while not re.search(ahead, p.log_text()) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert re.search(ahead, p.log_text()), "no connect_ahead line on the push producer"
    assert p.metric("vllm:kvxfer_leases_released_total") >= 1


def test_push_negative_control(push_pair: PDPair, unified_server: VllmServer) -> None:
    text = "Quiet western valleys carry the ancient memory of the silver harbor " * 2
    a = prompt_ids(unified_server, text)
    b = [(a[0] + 1) % 500 or 1, *a[1:]]
    ref_a, ref_b = reference(unified_server, a), reference(unified_server, b)
    assert ref_a != ref_b
    assert through_pd(push_pair, b, a) == ref_b, "decode did not use the pushed KV"


def test_push_concurrent_dispatch_matches_on_the_request_id(
    push_pair: PDPair, unified_server: VllmServer
) -> None:
    """Decode is asked first, with only the producer's address; it registers its
    blocks under the shared request id, prefill's request finishes later and the
    producer writes into the registered blocks."""
    p, d = push_pair.prefill, push_pair.decode
    first = prefill(p, "who is the producer")  # a router knows its producers
    decode(d, "who is the producer", first, max_tokens=1)
    address = {k: first[k] for k in ("remote_engine_id", "remote_host", "remote_port")}
    prompt = PROMPTS["long"]
    rid = f"e2e-concurrent-{uuid.uuid4().hex[:8]}"
    result: dict[str, Any] = {}

    def run_decode() -> None:
        try:
            result["tokens"] = decode(
                d, prompt, {"do_remote_prefill": True, "tp_size": 1, **address}, request_id=rid
            )
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=run_decode)
    thread.start()
    # Let decode register first (the harder order: the producer has nothing yet).
    thread.join(timeout=1.0)
    prefill(p, prompt, rid)
    thread.join(timeout=60)
    assert "error" not in result, result.get("error")
    assert result["tokens"] == reference(unified_server, prompt)


# --- a pull instance paired with a push instance: refused at the handshake -------------


MIX = "runs the {p} connector (transfer_mode '{p}') but this instance runs the {d} connector"


@pytest.mark.parametrize("keep_mode", [True, False], ids=["named", "unnamed"])
def test_pull_decode_refuses_a_push_producer(
    keep_mode: bool, push_pair: PDPair, pull_pair: PDPair
) -> None:
    """Refused by name when the ticket says its mode (upstream's ``transfer_mode``), at
    the handshake otherwise (a router that drops the key): the request fails (vLLM's
    load-failure policy) and decode says why."""
    d = pull_pair.decode
    params = prefill(push_pair.prefill, "pull meets push")
    if not keep_mode:
        del params["transfer_mode"]
    with pytest.raises(HttpError) as err:
        decode(d, "pull meets push", params)
    assert err.value.status == 500
    log = d.log_text()
    if keep_mode:
        assert MIX.format(p="push", d="pull") in log, log[-3000:]
    else:
        assert re.search(r"KV load of \S+ failed \(handshake\).*compatibility hash", log)


@pytest.mark.parametrize("keep_mode", [True, False], ids=["named", "unnamed"])
def test_push_decode_refuses_a_pull_producer(
    keep_mode: bool, push_pair: PDPair, pull_pair: PDPair
) -> None:
    d = push_pair.decode
    params = prefill(pull_pair.prefill, "push meets pull")
    if not keep_mode:
        del params["transfer_mode"]
    with pytest.raises(HttpError) as err:
        decode(d, "push meets pull", params)
    assert err.value.status == 500
    log = d.log_text()
    if keep_mode:
        assert MIX.format(p="pull", d="push") in log, log[-3000:]
    else:
        assert re.search(r"KV load of \S+ failed \(handshake\).*compatibility hash", log)
