"""The test bed itself: a unified vLLM instance on the tiny model is deterministic
under greedy decoding and its output depends on the prompt.

Every P/D equality test builds on these two properties; without the second, a
decode instance that ignored the transferred KV could still match.
"""

from __future__ import annotations

from typing import Any

import pytest

from .servers import E2E_BLOCK_SIZE, VllmServer

pytestmark = pytest.mark.e2e

# Shorter than one block, several whole blocks plus a partial one, and long.
PROMPTS = {
    "sub_block": "The quick river",
    "multi_block_partial": (
        "North winter morning: the golden harbor city remembers seven quiet islands, "
        "and the ancient forest follows a slow blue river to the western ocean. "
        "Eight small villages carry bright silver lanterns across the valley"
    ),
    "long": " ".join(
        f"{w} block {i} of the decode engine follows the prefill agent"
        for i, w in enumerate(["alpha", "beta", "gamma", "delta", "sigma", "omega"] * 3)
    ),
}
MAX_TOKENS = 16


def _greedy(server: VllmServer, prompt: str) -> tuple[list[int], list[int]]:
    out: dict[str, Any] = server.complete(
        prompt, max_tokens=MAX_TOKENS, return_token_ids=True, logprobs=None
    )
    choice = out["choices"][0]
    return list(choice["prompt_token_ids"]), list(choice["token_ids"])


def test_prompts_cover_block_boundaries(unified_server: VllmServer) -> None:
    lengths = {name: len(_greedy(unified_server, p)[0]) for name, p in PROMPTS.items()}
    assert lengths["sub_block"] < E2E_BLOCK_SIZE, lengths
    assert lengths["multi_block_partial"] > 2 * E2E_BLOCK_SIZE, lengths
    assert lengths["multi_block_partial"] % E2E_BLOCK_SIZE != 0, lengths
    assert lengths["long"] > 4 * E2E_BLOCK_SIZE, lengths


def test_greedy_is_deterministic_and_prompt_dependent(unified_server: VllmServer) -> None:
    outputs: dict[str, list[int]] = {}
    for name, prompt in PROMPTS.items():
        _, first = _greedy(unified_server, prompt)
        _, second = _greedy(unified_server, prompt)
        assert first == second, f"{name}: greedy output changed between two calls"
        assert len(first) == MAX_TOKENS
        # Not degenerate: random-weight models with tiny init collapse into a
        # two-token cycle; this one must keep producing varied tokens.
        assert len(set(first)) >= 4, f"{name}: degenerate output {first}"
        outputs[name] = first
    distinct = {tuple(v) for v in outputs.values()}
    assert len(distinct) == len(outputs), f"outputs do not depend on the prompt: {outputs}"


def test_continuation_depends_on_the_whole_prompt(unified_server: VllmServer) -> None:
    """Changing only the first word changes the continuation: the output depends on
    KV far from the end of the prompt, which is what a P/D negative control needs."""
    base = PROMPTS["multi_block_partial"]
    _, a = _greedy(unified_server, base)
    _, b = _greedy(unified_server, "South" + base[len("North") :])
    assert a != b
