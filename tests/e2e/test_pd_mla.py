"""MLA latent KV (DeepSeek-V2/V3 style) through P/D on real vLLM CPU engines.

The tiny dense DeepSeek-V3 of :mod:`tests.e2e.model` (``MLA_SPEC``: 2 layers, 4 heads,
``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, float32) on vLLM 0.32's reference CPU
MLA backend (``CPU_MLA``: SDPA prefill, ``mla_decode_kvcache`` decode). Each layer's
cache is one 576-element latent "head" per token, ``(num_blocks, 16, 576)``: vLLM's
CPU platform forces 16-token blocks for it and turns prefix caching and chunked
prefill off (so ``block_size=None`` here, and decode never holds a prompt itself).

Every instance names ``CPU_MLA`` and runs with vLLM's ``rotary_embedding`` custom op
off (:data:`MLA_ARGS`): its CPU kernel rotates a 3-D multi-head query wrongly (only the
first head is right), and MLA passes it the query's rope part as a 3-D strided view,
so with the op on, greedy output depends on which other requests share the batch
and differs from transformers'. The torch-native rope gives transformers' output.

One pull pair beside one unified instance: greedy output through kvxfer equals
unified's for prompts shorter than a block, one token either side of a block boundary
and over several blocks; a negative control (decode asked for prompt A with B's
ticket continues B) and a corrupted-block control (the first landed block negated
changes the output, :mod:`tests.e2e.state_connector`) show decode used the moved KV.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .model import MLA_SPEC, build_tiny_model
from .pd import PD_ENV, PDPair, decode, divergence, kv_config, prefill, tokens, untied
from .servers import F32_ARGS, VllmServer, free_port, start_server, wait_all_healthy
from .state_connector import FLIP_KV_MARK, KV_ENV

# e2e_half: with the engine processes forked (tests/e2e/servers.py) the other half is
# the longer path (15:51 vs 13:04 in a fresh clone); this pair's ~50 s evens them.
pytestmark = [pytest.mark.e2e, pytest.mark.own_servers, pytest.mark.e2e_half]

#: vLLM's CPU rope kernel mis-rotates MLA's 3-D query (see the module docstring);
#: ``CPU_MLA`` named, or a host with AMX tiles would get ``AMX_MLA`` (other blocks).
MLA_ARGS: tuple[str, ...] = (
    *F32_ARGS,
    "--attention-backend",
    "CPU_MLA",
    "--compilation-config",
    json.dumps({"custom_ops": ["all", "-rotary_embedding"]}),
)
BLOCK = 16  # what vLLM's CPU platform forces for CPU_MLA
#: Shorter than a block, one token either side of a block boundary, several blocks.
LENGTHS = (5, 15, 16, 17, 100)
NEW_TOKENS = 8
MODULE = "tests.e2e.state_connector"


class MlaCase:
    def __init__(self, unified: VllmServer, pair: PDPair) -> None:
        self.unified, self.pair = unified, pair

    def untied(self, length: int, seed: int) -> tuple[list[int], list[int]]:
        """A prompt and its unified continuation with no near-tied greedy pick."""
        return untied(self.unified, MLA_SPEC.vocab_size, length, seed, NEW_TOKENS)

    def through_pd(
        self, prefill_prompt: list[int], decode_prompt: list[int], tag: str = ""
    ) -> list[int]:
        rid = f"e2e-mla-{tag}{uuid.uuid4().hex[:12]}"
        params = prefill(self.pair.prefill, prefill_prompt, rid)
        return decode(
            self.pair.decode, decode_prompt, params, request_id=rid, max_tokens=NEW_TOKENS
        )


@pytest.fixture(scope="module")
def mla_case(e2e_log_dir: Path) -> Iterator[MlaCase]:
    model_dir = build_tiny_model(MLA_SPEC)
    unified = start_server(
        "unified-mla", model_dir, e2e_log_dir, block_size=None, extra_args=MLA_ARGS, wait=False
    )
    servers = [unified]
    try:
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            env = {**PD_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if role == "decode":
                env[KV_ENV] = "1"
            servers.append(
                start_server(
                    f"{role}-mla",
                    model_dir,
                    e2e_log_dir,
                    block_size=None,
                    kv_transfer_config=kv_config(kv_role, "pull", kv_connector_module_path=MODULE),
                    env=env,
                    extra_args=MLA_ARGS,
                    wait=False,
                )
            )
        wait_all_healthy(servers)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    try:
        yield MlaCase(unified, PDPair("mla-pull", servers[1], servers[2]))
    finally:
        for s in servers:
            s.stop()


@pytest.mark.timeout(900)  # three cold starts and ~10 P/D requests on 2 shared cores
def test_mla_pd_equals_unified_with_negative_controls(mla_case: MlaCase) -> None:
    case = mla_case
    p, d = case.pair.prefill, case.pair.decode
    for server in (case.unified, p, d):
        log = server.log_text()
        assert "Using CPU_MLA backend" in log, f"{server.name}: not on vLLM's CPU MLA backend"
        assert "MLA is enabled on a non-GPU platform" in log, server.name
    for server in (p, d):
        layout = re.search(r"kvxfer: KV layout (.*)", server.log_text())
        assert layout, f"{server.name}: kvxfer logged no KV layout"
        # A latent cache has no K and V halves to probe the order of.
        assert "could not probe the CPU KV cache order" not in server.log_text(), server.name

    for i, length in enumerate(LENGTHS):
        prompt, ref = case.untied(length, seed=1000 * i + 17)
        got = case.through_pd(prompt, prompt)
        assert got == ref, f"{length}-token prompt: {divergence(case.unified, prompt, got)}"
    assert d.metric("vllm:kvxfer_bytes_total") > 0, "decode loaded nothing through kvxfer"

    # Negative control 1: A and B differ in their first token only; decode asked for A
    # with B's ticket continues B (it computed only the last token itself).
    b, ref_b = case.untied(3 * BLOCK + 5, seed=7)
    a = [b[0] % (MLA_SPEC.vocab_size - 1) + 1, *b[1:]]
    ref_a = tokens(
        case.unified.complete(a, max_tokens=NEW_TOKENS, logprobs=None, return_token_ids=True)
    )
    assert ref_a != ref_b, "the control needs differing continuations"
    assert case.through_pd(b, a) == ref_b, "decode did not use the transferred KV"

    # Negative control 2: the first landed block of the first MLA layer negated on
    # arrival changes the output; the same request unmarked still equals unified.
    assert case.through_pd(b, b) == ref_b
    assert case.through_pd(b, b, tag=FLIP_KV_MARK) != ref_b, "decode ignored the moved KV"
    assert f"{FLIP_KV_MARK} of slot" in d.log_text(), "the corrupting connector did not run"
