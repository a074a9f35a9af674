"""Prefill/decode through the pull connector on real vLLM engines, against the
unified instance (R-VLLM-5), with a negative control and recompute evidence.

This drives the two instances the way upstream's toy proxy does (prefill with
``max_tokens: 1`` and ``do_remote_decode``, copy the returned ``kv_transfer_params``
into the decode request); the proxy itself is tested elsewhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .servers import VllmServer, free_port, start_server, wait_all_healthy
from .test_unified_baseline import MAX_TOKENS, PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("kvxfer.agent") is None,
        reason="the kvxfer Agent (kvxfer.agent) is not in this tree yet",
    ),
]


def _kv_config(role: str, connector: str = "RblnNixlPullConnector") -> dict[str, Any]:
    return {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def pd_pair(tiny_model_dir: Path, e2e_log_dir: Path) -> Iterator[tuple[VllmServer, VllmServer]]:
    servers = [
        start_server(
            name,
            tiny_model_dir,
            e2e_log_dir,
            kv_transfer_config=_kv_config(role),
            env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            wait=False,
        )
        for name, role in (("prefill-pull", "kv_producer"), ("decode-pull", "kv_consumer"))
    ]
    wait_all_healthy(servers)
    try:
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()


def _tokens(out: dict[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


def _through_pd(
    pair: tuple[VllmServer, VllmServer], prefill_prompt: Any, decode_prompt: Any
) -> list[int]:
    prefill, decode = pair
    first = prefill.complete(
        prefill_prompt,
        max_tokens=1,
        logprobs=None,
        kv_transfer_params={"do_remote_decode": True},
    )
    params = first.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill"), f"prefill returned {params!r}"
    out = decode.complete(
        decode_prompt,
        max_tokens=MAX_TOKENS,
        logprobs=None,
        return_token_ids=True,
        kv_transfer_params=params,
    )
    return _tokens(out)


def _reference(unified: VllmServer, prompt: Any) -> list[int]:
    return _tokens(
        unified.complete(prompt, max_tokens=MAX_TOKENS, logprobs=None, return_token_ids=True)
    )


@pytest.mark.parametrize("name", list(PROMPTS))
def test_pd_output_equals_unified(
    name: str, pd_pair: tuple[VllmServer, VllmServer], unified_server: VllmServer
) -> None:
    prompt = PROMPTS[name]
    assert _through_pd(pd_pair, prompt, prompt) == _reference(unified_server, prompt)


def test_decode_does_not_recompute_the_prompt(
    pd_pair: tuple[VllmServer, VllmServer], unified_server: VllmServer
) -> None:
    decode = pd_pair[1]
    prompt = "Seven golden lanterns cross the quiet harbor while the engine decodes " * 3
    ids = unified_server.complete(prompt, max_tokens=1, logprobs=None, return_token_ids=True)[
        "choices"
    ][0]["prompt_token_ids"]
    name = "vllm:prompt_tokens_by_source_total"
    local0 = decode.metric(name, source="local_compute")
    remote0 = decode.metric(name, source="external_kv_transfer")
    assert _through_pd(pd_pair, prompt, prompt) == _reference(unified_server, prompt)
    local = decode.metric(name, source="local_compute") - local0
    remote = decode.metric(name, source="external_kv_transfer") - remote0
    # vLLM recomputes only the last prompt token itself (it needs its logits).
    assert local <= 1, f"decode computed {local} prompt tokens locally"
    assert remote >= len(ids) - 1, f"only {remote} of {len(ids)} prompt tokens came remotely"


def test_negative_control_decode_continues_the_transferred_prompt(
    pd_pair: tuple[VllmServer, VllmServer], unified_server: VllmServer
) -> None:
    """Decode asked for prompt A but given B's KV must continue B: proof that it used
    the transferred KV instead of recomputing A. A and B are token lists of equal
    length differing in their first token only, never sent to decode before (a local
    prefix-cache hit on A would legitimately win over the remote KV)."""
    text = "Ancient river valleys remember the northern harbor and its silver islands " * 2
    a = unified_server.complete(text, max_tokens=1, logprobs=None, return_token_ids=True)[
        "choices"
    ][0]["prompt_token_ids"]
    b = [(a[0] + 1) % 500 or 1, *a[1:]]
    ref_a, ref_b = _reference(unified_server, a), _reference(unified_server, b)
    assert ref_a != ref_b, "the control needs prompts whose continuations differ"
    out = _through_pd(pd_pair, b, a)
    assert out == ref_b, "decode did not continue the prompt whose KV it was given"
