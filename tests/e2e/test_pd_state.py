"""Recurrent-state hybrids through P/D on real vLLM engines (R-HYB-4).

Two tiny random-weight hybrids of :mod:`tests.e2e.model`, each with recurrent-state
layers at 0 and 2 and full attention at 1 and 3, vLLM's hybrid KV cache manager on
(a state group and a full-attention group sharing pages):

* ``mamba2``: a GraniteMoeHybrid-style dense Mamba2 hybrid (Granite-4 hybrid,
  Nemotron-H, Falcon-H1 are the same layer kind), float32. vLLM's CPU build fails its
  own unified run of this model with prefix caching on (an IndexError in
  ``mamba_mixer2``), so every instance runs with ``--no-enable-prefix-caching``.
* ``gdn``: a Qwen3-Next-style Gated DeltaNet hybrid (Qwen3.5's layer kind), bf16,
  prefix caching on.

vLLM sizes the attention block from the state page: 128 tokens for both models
(``block_size=None``). Each case runs one prefill/decode pair beside one unified
instance of the same model and checks: the hybrid manager stayed on and kvxfer
described a ``state`` group; greedy output equals unified's for prompts shorter than
a block, one token either side of a block boundary and over two blocks; two negative
controls (decode asked for prompt A with B's KV and state continues B; one element
of the moved SSM state corrupted on arrival changes the output, see
:mod:`tests.e2e.state_connector`). For ``gdn``, a prompt whose first block decode
already holds in its own prefix cache loads only the rest, and still equals unified.

The default run takes ``gdn/pull`` and ``mamba2/push``; ``KVXFER_E2E_STATE_ALL=1``
adds the other two. The four cases are the same code; the default covers both layer
kinds and both directions.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .model import GDN_SPEC, MAMBA2_SPEC, TinyModelSpec, build_tiny_model
from .pd import (
    PD_ENV,
    PDPair,
    decode,
    divergence,
    kv_config,
    prefill,
    random_prompt,
    tokens,
    untied,
)
from .servers import F32_ARGS, VllmServer, free_port, start_server, wait_all_healthy
from .state_connector import ENV as FLIP_ENV
from .state_connector import FLIP_MARK

# e2e_half: with the engine processes forked the other half is the longer path
# (17:08 vs 15:09 in a fresh clone); these two pairs (~85 s) even the halves.
pytestmark = [pytest.mark.e2e, pytest.mark.own_servers, pytest.mark.e2e_half]

SPECS: dict[str, TinyModelSpec] = {"mamba2": MAMBA2_SPEC, "gdn": GDN_SPEC}
#: Per model, the arguments every instance (unified, prefill, decode) runs with.
ARGS: dict[str, tuple[str, ...]] = {
    "mamba2": (*F32_ARGS, "--no-enable-prefix-caching"),
    "gdn": (),
}
#: How kvxfer logs a state group (the conv-state order vLLM's CPU build picks: SD).
STATE = r"state\(conv=SD\)"
BLOCK = 128  # what vLLM picks for both models on CPU (asserted from the log)
DEFAULT_CASES = {("gdn", "pull"), ("mamba2", "push")}
ALL = os.environ.get("KVXFER_E2E_STATE_ALL") == "1"
CASES = [
    pytest.param(
        (model, direction),
        id=f"{model}-{direction}",
        marks=()
        if ALL or (model, direction) in DEFAULT_CASES
        else pytest.mark.skip(reason="set KVXFER_E2E_STATE_ALL=1 for every state case"),
    )
    for model in SPECS
    for direction in ("pull", "push")
]
#: Shorter than a block, one token either side of a block boundary, over two blocks.
LENGTHS = (5, 127, 128, 129, 257)
NEW_TOKENS = 8
MODULE = "tests.e2e.state_connector"


class StateCase:
    """One model's unified instance and one prefill/decode pair."""

    def __init__(self, model: str, direction: str, unified: VllmServer, pair: PDPair) -> None:
        self.model, self.direction = model, direction
        self.unified, self.pair = unified, pair
        self.spec = SPECS[model]

    def prompt(self, length: int, seed: int) -> list[int]:
        return random_prompt(self.spec.vocab_size, length, seed)

    def untied(self, length: int, seed: int) -> tuple[list[int], list[int]]:
        """A prompt and its unified continuation with no near-tied greedy pick."""
        return untied(self.unified, self.spec.vocab_size, length, seed, NEW_TOKENS)

    def through_pd(
        self, prefill_prompt: list[int], decode_prompt: list[int], tag: str = ""
    ) -> list[int]:
        rid = f"e2e-state-{tag}{uuid.uuid4().hex[:12]}"
        params = prefill(self.pair.prefill, prefill_prompt, rid)
        # The producer stops one token short; its ticket says so.
        assert params.get("remote_num_tokens") == len(prefill_prompt) - 1, params
        return decode(
            self.pair.decode, decode_prompt, params, request_id=rid, max_tokens=NEW_TOKENS
        )


@pytest.fixture(scope="module", params=CASES)
def state_case(request: pytest.FixtureRequest, e2e_log_dir: Path) -> Iterator[StateCase]:
    model, direction = request.param
    model_dir = build_tiny_model(SPECS[model])
    args = ARGS[model]
    unified = start_server(
        f"unified-state-{model}-{direction}",
        model_dir,
        e2e_log_dir,
        block_size=None,
        extra_args=args,
        wait=False,
    )
    servers = [unified]
    try:
        for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            config = kv_config(kv_role, direction, kv_connector_module_path=MODULE)
            env = {**PD_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            if role == "decode":
                env[FLIP_ENV] = "1"
            servers.append(
                start_server(
                    f"{role}-state-{model}-{direction}",
                    model_dir,
                    e2e_log_dir,
                    block_size=None,
                    kv_transfer_config=config,
                    env=env,
                    extra_args=args,
                    wait=False,
                )
            )
        wait_all_healthy(servers)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    pair = PDPair(f"{model}-{direction}", servers[1], servers[2])
    try:
        yield StateCase(model, direction, unified, pair)
    finally:
        for s in servers:
            s.stop()


@pytest.mark.timeout(1500)  # three cold starts and ~12 P/D requests on 2 shared cores
def test_state_hybrid_pd_equals_unified_with_negative_controls(state_case: StateCase) -> None:
    case = state_case
    p, d = case.pair.prefill, case.pair.decode
    for server in (p, d):
        log = server.log_text()
        assert "Turning off hybrid kv cache manager" not in log, server.name
        assert re.search(rf"block_size={BLOCK}\b.*groups=\[({STATE},full|full,{STATE})\]", log), (
            f"{server.name}: no state hybrid layout with {BLOCK}-token blocks in the log"
        )
    for i, length in enumerate(LENGTHS):
        prompt, ref = case.untied(length, seed=1000 * i + len(case.model))
        got = case.through_pd(prompt, prompt)
        assert got == ref, f"{length}-token prompt: {divergence(case.unified, prompt, got)}"

    # Negative control 1: prompts A and B differ in their first token only; decode
    # asked for A with B's KV and state continues B (it computed only the last token).
    b, ref_b = case.untied(150, seed=7 + len(case.model))
    a = [b[0] % (case.spec.vocab_size - 1) + 1, *b[1:]]
    ref_a = tokens(
        case.unified.complete(a, max_tokens=NEW_TOKENS, logprobs=None, return_token_ids=True)
    )
    assert ref_a != ref_b, "the control needs differing continuations"
    assert case.through_pd(b, a) == ref_b, "decode did not use the transferred KV and state"

    # Negative control 2: the same request with one SSM state element corrupted on
    # arrival (only the state: attention KV lands intact) no longer equals unified.
    assert case.through_pd(b, b) == ref_b
    assert case.through_pd(b, b, tag=FLIP_MARK) != ref_b, "decode ignored the moved state"
    assert "SSM state of slot" in d.log_text(), "the corrupting connector did not run"

    if case.model == "gdn":
        _prefix_hit_on_decode(case)


def _prefix_hit_on_decode(case: StateCase) -> None:
    """Decode serves a 2-block prompt itself, then loads a longer prompt that starts
    with it: vLLM's local hit covers those blocks and kvxfer moves the rest, with the
    state after the longer prompt. (vLLM's "align" mode caches a state only at the
    last token of a step that ends on a block boundary: the first prompt is exactly
    two blocks, prefilled in one step.)"""
    d = case.pair.decode
    shared, _ = case.untied(2 * BLOCK, seed=4242)
    d.complete(shared, max_tokens=1, logprobs=None)  # fills decode's own prefix cache
    longer = [*shared, *case.prompt(100, seed=4343)]
    ref = tokens(
        case.unified.complete(longer, max_tokens=NEW_TOKENS, logprobs=None, return_token_ids=True)
    )
    hits = d.metric("vllm:prefix_cache_hits_total")
    moved = d.metric("vllm:kvxfer_bytes_total")
    got = case.through_pd(longer, longer)
    assert got == ref, divergence(case.unified, longer, got)
    assert d.metric("vllm:prefix_cache_hits_total") - hits >= BLOCK, "no local prefix hit"
    assert d.metric("vllm:kvxfer_bytes_total") > moved, "nothing was loaded"
