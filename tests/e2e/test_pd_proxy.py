"""``kvxfer proxy`` in front of real vLLM prefill/decode instances (pull and push):
greedy output through the proxy equals the unified instance's, whole and streamed,
and decode's prompt tokens came over the connector."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvxfer.adapters.vllm.proxy import start_proxy

from .pd import MAX_TOKENS, PDPair, reference
from .servers import VllmServer
from .test_unified_baseline import PROMPTS

pytestmark = pytest.mark.e2e

SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(params=["pull", "push"])
def proxied(
    request: pytest.FixtureRequest, pull_pair: PDPair, push_pair: PDPair
) -> Iterator[tuple[str, PDPair]]:
    pair = pull_pair if request.param == "pull" else push_pair
    url, stop = start_proxy(
        [pair.prefill.url], [pair.decode.url], mode=pair.mode, health_interval_s=1.0
    )
    try:
        yield url, pair
    finally:
        stop()


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=60)


def _body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        **kw,
    }


def test_proxy_output_equals_unified(
    proxied: tuple[str, PDPair], unified_server: VllmServer
) -> None:
    url, pair = proxied
    d = pair.decode
    remote0 = d.metric(SOURCE, source="external_kv_transfer")
    # Two requests: in push mode the proxy's first request to a producer runs
    # prefill-first, the next ones dispatch decode and prefill together.
    # Prompts this decode instance has not seen (no local prefix-cache hits).
    for name in ("multi_block_partial", "long"):
        prompt = f"Through the {pair.mode} proxy: {PROMPTS[name]}"
        with _post(url, _body(prompt)) as resp:
            out = json.loads(resp.read())
        assert out["choices"][0]["token_ids"] == reference(unified_server, prompt), name
    assert d.metric(SOURCE, source="external_kv_transfer") - remote0 > 4 * 32
    # Streamed: the same text, chunk by chunk.
    whole = unified_server.complete(PROMPTS["sub_block"], max_tokens=MAX_TOKENS, logprobs=None)
    text = ""
    with _post(url, _body(PROMPTS["sub_block"], stream=True, return_token_ids=False)) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                text += json.loads(line[5:])["choices"][0].get("text") or ""
    assert text == whole["choices"][0]["text"]
