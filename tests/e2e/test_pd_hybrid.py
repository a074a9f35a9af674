"""A hybrid sliding-window model through P/D on real vLLM engines (R-HYB-1..3).

The tiny Gemma3 of :data:`tests.e2e.model.HYBRID_SPEC` alternates 16-token sliding
window layers and full-attention layers; with kvxfer's connectors vLLM keeps its hybrid
KV cache manager on (two KV cache groups, the sliding one holding only its window's
blocks). Each mode runs as one prefill/decode pair against one unified instance:

* ``whole``: whole blocks over host bounce (``kv_buffer_device: cpu``);
* ``swa``: ``swa_window_mode`` on the emulated device-to-device path (16-token window
  granules of 32-token blocks);
* ``chunk``: ``chunk_mode`` with ``chunk_tokens: 16`` on the same path;
* ``swa_chunk``: both at once.

Every case checks: vLLM did not turn its hybrid manager off; greedy output equals the
unified instance's for prompts shorter and longer than the window, none
block-aligned; a negative control (decode asked for prompt A with B's KV continues B);
and the bytes decode reports (``vllm:kvxfer_bytes_total``) equal the descriptor
algebra's count for the same request on a cache described like vLLM's.

Every server runs with ``--max-num-batched-tokens 16`` (chunk_mode needs
``chunk_tokens`` >= one prefill step, and all instances must prefill alike for greedy
equality). The default run takes ``whole/pull`` and ``swa_chunk/pull``; set
``KVXFER_E2E_HYBRID_ALL=1`` for every mode in both directions. Measured on the 2-core
test bed shared with other jobs (load average ~15): the default run (unified + 2 pairs)
4.6 min, the 6 other cases 10.3 min more.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvxfer.adapters.vllm.worker import describe_kv_caches, token_major_groups
from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.layout import Group, GroupKind

from .model import HYBRID_SPEC, build_tiny_model
from .pd import PD_ENV, PDPair, decode, kv_config, prefill, tokens
from .servers import E2E_BLOCK_SIZE, VllmServer, free_port, start_server, wait_all_healthy

pytestmark = pytest.mark.e2e

WINDOW = HYBRID_SPEC.sliding_window
STEP_TOKENS = 16
# 16 MiB of KV cache (1024 blocks): token-granular tables grow with regions x blocks.
ARGS = ("--max-num-batched-tokens", str(STEP_TOKENS), "--kv-cache-memory-bytes", str(16 << 20))
#: Mode -> (kv_buffer_device, kv_connector_extra_config).
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "whole": ("cpu", {}),
    "swa": ("rbln", {"swa_window_mode": True}),
    "chunk": ("rbln", {"chunk_mode": True, "chunk_tokens": STEP_TOKENS}),
    "swa_chunk": ("rbln", {"swa_window_mode": True, "chunk_mode": True}),
}
DEFAULT_CASES = {("whole", "pull"), ("swa_chunk", "pull")}
ALL = os.environ.get("KVXFER_E2E_HYBRID_ALL") == "1"
CASES = [
    pytest.param(
        (mode, direction),
        id=f"{mode}-{direction}",
        marks=()
        if ALL or (mode, direction) in DEFAULT_CASES
        else pytest.mark.skip(reason="set KVXFER_E2E_HYBRID_ALL=1 for every hybrid case"),
    )
    for mode in MODES
    for direction in ("pull", "push")
]
#: Prompt lengths: below the window, and 1.4 to 4.7 blocks, none a multiple of 32; at
#: 47 the window of the token after the prompt starts on a block boundary (decode then
#: loads all but the last token, see SchedulerSide.get_num_new_matched_tokens).
LENGTHS = (11, 45, 47, 77, 150)
#: Tokens decoded per request (each is a step of every instance on 2 shared cores).
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hybrid_model_dir() -> Path:
    return build_tiny_model(HYBRID_SPEC)


@pytest.fixture(scope="module")
def hybrid_unified(hybrid_model_dir: Path, e2e_log_dir: Path) -> Iterator[VllmServer]:
    """Started without waiting: the first pair waits for it with its own two servers
    (three start-ups overlap instead of the reference starting alone after them)."""
    server = start_server(
        "unified-hybrid", hybrid_model_dir, e2e_log_dir, extra_args=ARGS, wait=False
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=CASES)
def hybrid_pair(
    request: pytest.FixtureRequest,
    hybrid_model_dir: Path,
    e2e_log_dir: Path,
    hybrid_unified: VllmServer,
) -> Iterator[PDPair]:
    mode, direction = request.param
    device, extra = MODES[mode]
    env = dict(PD_ENV)
    if device == "rbln":
        env["KVXFER_RBLN_ADAPTER"] = "emulated"
    servers = [
        start_server(
            f"{role}-hybrid-{mode}-{direction}",
            hybrid_model_dir,
            e2e_log_dir,
            kv_transfer_config=kv_config(kv_role, direction, buffer_device=device, extra=extra),
            env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
            extra_args=ARGS,
            wait=False,
        )
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"))
    ]
    try:
        wait_all_healthy([*servers, hybrid_unified])
    except BaseException:
        for s in servers:
            s.stop()
        raise
    pair = PDPair(f"{mode}-{direction}", servers[0], servers[1])
    try:
        yield pair
    finally:
        pair.stop()


def _reference(unified: VllmServer, prompt: list[int]) -> list[int]:
    out = unified.complete(prompt, max_tokens=NEW_TOKENS, logprobs=None, return_token_ids=True)
    return tokens(out)


def _untied(unified: VllmServer, length: int, seed: int) -> tuple[list[int], list[int]]:
    """A prompt of ``length`` tokens and its unified continuation, drawn from ``seed``
    on: random bf16 weights give exact logit ties now and then (two tokens with the
    same logprob), where greedy picks by kernel order and equality means nothing."""
    for attempt in range(8):
        prompt = _prompt(length, seed + 100_000 * attempt)
        out = unified.complete(
            prompt,
            max_tokens=NEW_TOKENS,
            logprobs=2,
            return_token_ids=True,
            return_tokens_as_token_ids=True,  # distinct keys for tokens decoding alike
        )
        top = out["choices"][0]["logprobs"]["top_logprobs"]
        if all(
            len(t) < 2 or abs(sorted(t.values())[-1] - sorted(t.values())[-2]) > 1e-4 for t in top
        ):
            return prompt, tokens(out)
    raise AssertionError(f"no untied {length}-token prompt from seed {seed}")


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, HYBRID_SPEC.vocab_size) for _ in range(length)]


def expected_bytes(mode: str, num_tokens: int) -> int:
    """The descriptor algebra's byte count for one request of ``num_tokens`` tokens,
    on a cache shaped and grouped like vLLM's CPU cache of the hybrid model."""
    import torch

    spec = HYBRID_SPEC
    bs, heads, hs = E2E_BLOCK_SIZE, spec.num_key_value_heads, spec.head_dim
    nb = 64
    # vLLM's hybrid manager: layers of the two groups share tensors, one per pair.
    tensors = [torch.zeros(nb, heads, bs, 2 * hs, dtype=torch.bfloat16) for _ in range(2)]
    caches = {f"layers.{i}": tensors[i // 2] for i in range(spec.num_hidden_layers)}
    layer_groups = {f"layers.{i}": 1 if i % 2 == 0 else 0 for i in range(spec.num_hidden_layers)}
    groups = (Group(kind=GroupKind.FULL), Group(kind=GroupKind.SLIDING, window=WINDOW))
    extra = MODES[mode][1]
    options = PlanOptions(
        chunk_mode=bool(extra.get("chunk_mode")),
        chunk_tokens=extra.get("chunk_tokens"),
        prefill_step_tokens=STEP_TOKENS,
        swa_window_mode=bool(extra.get("swa_window_mode")),
    )
    layout = describe_kv_caches(
        caches,
        block_size=bs,
        num_blocks=nb,
        kv_layout="NHD",
        groups=groups,
        layer_groups=layer_groups,
        token_major_groups=token_major_groups(groups, bs, options),
    )
    table = DescriptorTable.build(layout, options)
    end = -(-num_tokens // bs)
    first_sliding = max(num_tokens - WINDOW + 1, 0) // bs
    blocks = [list(range(1, end + 1)), list(range(1 + first_sliding, end + 1))]
    return build_plan(table, table, blocks, blocks, num_tokens).nbytes


@pytest.mark.timeout(1200)  # a pair's cold start plus 7 P/D requests, on 2 shared cores
def test_hybrid_pd_equals_unified_with_exact_bytes_and_negative_control(
    hybrid_pair: PDPair, hybrid_unified: VllmServer
) -> None:
    p, d = hybrid_pair.prefill, hybrid_pair.decode
    mode = hybrid_pair.mode.rsplit("-", 1)[0]
    for server in (p, d):
        log = server.log_text()
        assert "Turning off hybrid kv cache manager" not in log, server.name
        # vLLM orders the groups (sliding first here); kvxfer keeps vLLM's order.
        assert re.search(
            rf"groups=\[(full,sliding\(w={WINDOW}\)|sliding\(w={WINDOW}\),full)\]", log
        ), f"{server.name}: no hybrid layout in the log"
    whole = sum(expected_bytes("whole", n) for n in LENGTHS)
    for i, length in enumerate(LENGTHS):
        prompt, ref = _untied(hybrid_unified, length, seed=1000 * i + len(mode))
        rid = f"e2e-hybrid-{uuid.uuid4().hex[:12]}"
        before = d.metric("vllm:kvxfer_bytes_total")
        params = prefill(p, prompt, rid)
        assert len(params["remote_block_ids"]) == 2, params
        got = decode(d, prompt, params, request_id=rid, max_tokens=NEW_TOKENS)
        assert got == ref, f"{length}-token prompt"
        moved = d.metric("vllm:kvxfer_bytes_total") - before
        loaded = length - 1 if (length - WINDOW + 1) % E2E_BLOCK_SIZE == 0 else length
        assert moved == expected_bytes(mode, loaded), f"{length}-token prompt: {moved} bytes"
    if mode != "whole":  # the mode saves bytes over these prompts
        assert sum(expected_bytes(mode, n) for n in LENGTHS) < whole
    # Negative control: prompts A and B differ in their first token only.
    b, ref_b = _untied(hybrid_unified, 77, seed=7 + len(mode))
    a = [b[0] % (HYBRID_SPEC.vocab_size - 1) + 1, *b[1:]]
    assert _reference(hybrid_unified, a) != ref_b, "the control needs differing continuations"
    rid = f"e2e-hybrid-{uuid.uuid4().hex[:12]}"
    got = decode(d, a, prefill(p, b, rid), request_id=rid, max_tokens=NEW_TOKENS)
    assert got == ref_b, "decode did not use the transferred KV"
