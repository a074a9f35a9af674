"""Prefill/decode pairs on real vLLM engines, driven the way upstream's toy proxy does.

The proxy's flow (R-VLLM-3): send the request to prefill with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, copy the ``kv_transfer_params``
it returns into the decode request, return decode's output. Push mode can also
dispatch both at once (decode learns only the producer's address; the two engines
match on the shared ``X-Request-Id``).
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .servers import VllmServer, free_port, start_server, wait_all_healthy

MAX_TOKENS = 16

CONNECTORS = {"pull": "RblnNixlPullConnector", "push": "RblnNixlPushConnector"}

# Every P/D instance logs stats each second, so the "KV Transfer metrics" line shows
# up within a test; transfers that fail are not left waiting for the default 30 s.
PD_ENV = {"VLLM_LOG_STATS_INTERVAL": "1"}
PD_EXTRA = {"transfer_timeout_s": 10}


def kv_config(
    role: str,
    mode: str = "pull",
    *,
    buffer_device: str | None = "cpu",
    extra: Mapping[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for one of kvxfer's connectors."""
    cfg: dict[str, Any] = {"kv_connector": CONNECTORS[mode], "kv_role": role, **top}
    if buffer_device is not None:
        cfg["kv_buffer_device"] = buffer_device
    cfg["kv_connector_extra_config"] = {**PD_EXTRA, **(extra or {})}
    return cfg


@dataclasses.dataclass
class PDPair:
    """A prefill and a decode instance of one mode."""

    mode: str
    prefill: VllmServer
    decode: VllmServer

    def stop(self) -> None:
        for s in (self.prefill, self.decode):
            s.stop()


def start_prefill(
    name: str,
    mode: str,
    model_dir: Path,
    log_dir: Path,
    *,
    wait: bool = True,
    port: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> VllmServer:
    return start_server(
        name,
        model_dir,
        log_dir,
        kv_transfer_config=kv_config("kv_producer", mode, extra=extra),
        env={**PD_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port or free_port())},
        wait=wait,
    )


def start_pair(mode: str, model_dir: Path, log_dir: Path) -> PDPair:
    """Start both instances at once (cold start overlaps) and wait for both. The side
    that posts (pull: decode, push: prefill) connects ahead to the other
    (``connect_ahead``, at vLLM's default side-channel host, the one tickets name)."""
    p_port, d_port = free_port(), free_port()
    ahead = {"connect_ahead": [{"host": "localhost", "port": p_port if mode == "pull" else d_port}]}
    prefill = start_prefill(
        f"prefill-{mode}",
        mode,
        model_dir,
        log_dir,
        wait=False,
        port=p_port,
        extra=ahead if mode == "push" else None,
    )
    decode = start_server(
        f"decode-{mode}",
        model_dir,
        log_dir,
        kv_transfer_config=kv_config("kv_consumer", mode, extra=ahead if mode == "pull" else None),
        env={**PD_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_port)},
        wait=False,
    )
    wait_all_healthy([prefill, decode])
    pair = PDPair(mode, prefill, decode)
    try:
        # One-off costs (first handshake, kernel selection) outside the tests' timings.
        through_pd(pair, "warm up the pair", "warm up the pair", max_tokens=2)
    except BaseException:
        pair.stop()
        raise
    return pair


def tokens(out: Mapping[str, Any]) -> list[int]:
    return list(out["choices"][0]["token_ids"])


def prompt_ids(unified: VllmServer, prompt: str) -> list[int]:
    out = unified.complete(prompt, max_tokens=1, logprobs=None, return_token_ids=True)
    return list(out["choices"][0]["prompt_token_ids"])


def prefill(
    server: VllmServer, prompt: str | Sequence[int], request_id: str | None = None
) -> dict[str, Any]:
    """The prefill step of the proxy flow; returns the ``kv_transfer_params``."""
    headers = {"X-Request-Id": request_id} if request_id else None
    first = server.complete(
        list(prompt) if not isinstance(prompt, str) else prompt,
        max_tokens=1,
        logprobs=None,
        kv_transfer_params={"do_remote_decode": True},
        headers=headers,
    )
    params = first.get("kv_transfer_params")
    assert isinstance(params, dict) and params.get("do_remote_prefill"), f"prefill: {params!r}"
    return params


def decode(
    server: VllmServer,
    prompt: str | Sequence[int],
    params: Mapping[str, Any],
    *,
    max_tokens: int = MAX_TOKENS,
    request_id: str | None = None,
    timeout: float = 60.0,
) -> list[int]:
    """The decode step of the proxy flow; returns the generated token ids."""
    headers = {"X-Request-Id": request_id} if request_id else None
    out = server.complete(
        list(prompt) if not isinstance(prompt, str) else prompt,
        max_tokens=max_tokens,
        logprobs=None,
        return_token_ids=True,
        kv_transfer_params=dict(params),
        headers=headers,
        timeout=timeout,
    )
    return tokens(out)


def through_pd(
    pair: PDPair,
    prefill_prompt: str | Sequence[int],
    decode_prompt: str | Sequence[int],
    *,
    max_tokens: int = MAX_TOKENS,
    tag: str = "",
) -> list[int]:
    """Prefill ``prefill_prompt`` on P, then decode ``decode_prompt`` on D with its KV;
    ``tag`` goes into the request id (the corrupting test connectors look for marks)."""
    rid = f"e2e-{tag}{uuid.uuid4().hex[:12]}"  # one id for both, as a proxy sends
    params = prefill(pair.prefill, prefill_prompt, rid)
    return decode(pair.decode, decode_prompt, params, max_tokens=max_tokens, request_id=rid)


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    """``length`` token ids drawn from ``seed`` (none is 0)."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab_size) for _ in range(length)]


def untied(
    unified: VllmServer, vocab_size: int, length: int, seed: int, new_tokens: int
) -> tuple[list[int], list[int]]:
    """A random ``length``-token prompt and ``unified``'s greedy continuation of it whose
    picks are no near ties (random weights give exact ties now and then; equality
    means nothing there): up to 8 prompts drawn from ``seed``."""
    for attempt in range(8):
        prompt = random_prompt(vocab_size, length, seed + 100_000 * attempt)
        out = unified.complete(
            prompt,
            max_tokens=new_tokens,
            logprobs=2,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
        )
        top = out["choices"][0]["logprobs"]["top_logprobs"]
        if all(
            len(t) < 2 or abs(sorted(t.values())[-1] - sorted(t.values())[-2]) > 1e-3 for t in top
        ):
            return prompt, tokens(out)
    raise AssertionError(f"no untied {length}-token prompt from seed {seed}")


def reference(unified: VllmServer, prompt: str | Sequence[int]) -> list[int]:
    p = list(prompt) if not isinstance(prompt, str) else prompt
    return tokens(unified.complete(p, max_tokens=MAX_TOKENS, logprobs=None, return_token_ids=True))


def divergence(unified: VllmServer, prompt: str | Sequence[int], got: Sequence[int]) -> str:
    """Where ``got`` leaves unified's greedy output for ``prompt``, and unified's top
    logprobs there: a wrong KV moves logits far, while two tokens within float noise
    of each other (a near tie) flip on a different batch alone. For failure messages."""
    p = list(prompt) if not isinstance(prompt, str) else prompt
    out = unified.complete(
        p,
        max_tokens=MAX_TOKENS,
        logprobs=5,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
    )
    ref = tokens(out)
    k = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
    if k is None:
        return f"got {list(got)}, unified {ref}: equal now"
    top = out["choices"][0]["logprobs"]["top_logprobs"][k]
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return (
        f"first differs at token {k} of {len(ref)}: got {got[k]}, unified {ref[k]}; "
        f"unified's top logprobs there {ranked}; got {list(got)}, unified {ref}"
    )
