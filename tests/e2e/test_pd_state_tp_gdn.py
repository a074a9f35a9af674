"""Gated DeltaNet state pulled from prefill TP1 into decode TP2, checked byte for byte
on real vLLM engines (issue 53).

The model is the tiny Qwen3-Next-style hybrid with 2 key and 2 value heads per GDN
layer (:data:`tests.e2e.model.GDN_TP_SPEC`), bfloat16 (vLLM's CPU GDN kernels need it),
both instances with ``VLLM_SSM_CONV_STATE_LAYOUT=DS``. Output equality cannot be the
check here: TP1 and TP2 unified instances of this random-weight model disagree with no
transfer involved (tests/e2e/test_pd_state_tp.py's docstring has the numbers). So the
consumer's state is compared with the producer's directly: the test connector
(:mod:`tests.e2e.state_connector`, ``KVXFER_E2E_DUMP_STATE``) saves each marked
request's running slot (every GDN layer's conv and temporal state) when prefill holds
it and when each decode rank's load has landed, before decode's first forward.

The oracle is how vLLM shards a GDN layer, stated here from vLLM's own code, not from
kvxfer's planner: rank *r* of 2 holds the *r*-th half of each of the q, k and v conv
channel blocks (``mamba_v2_sharded_weight_loader`` over ``[key_dim, key_dim,
value_dim]``), in that order, and the *r*-th half of the value heads of the temporal
state (``gated_delta_net_state_shape``). Every consumer rank's slot must equal that
slice of the producer's, bit for bit, for a prompt shorter than a block and one over a
block boundary. Negative control: the same check over a load whose first SSM element
was corrupted on arrival (``KVXFER_E2E_FLIP_STATE``) finds exactly that element
changed on each rank, so the comparison can fail.

The default run pulls; ``KVXFER_E2E_STATE_ALL=1`` adds the push (the prefill rank
writes each decode rank's pieces, planned from the split the decode rank announced),
which tests/e2e/test_pd_state_tp.py runs by default for Mamba2.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import ports

from .model import GDN_TP_SPEC, build_tiny_model
from .pd import PD_ENV, PDPair, decode, kv_config, prefill, random_prompt
from .servers import start_server, wait_all_healthy
from .state_connector import DUMP_ENV, DUMP_MARK, FLIP_MARK
from .state_connector import ENV as FLIP_ENV
from .test_pd_state import MODULE

# e2e_half: it waits on its engines more than it computes (see test_pd_state_tp.py).
pytestmark = [pytest.mark.e2e, pytest.mark.own_servers, pytest.mark.e2e_half]

ARGS = ("--no-enable-prefix-caching",)
TP2 = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
DS_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
#: Shorter than a block, and over a block boundary (vLLM picks 256-token blocks here, so
#: that one page holds a state slot).
LENGTHS = (5, 300)
HEADS, HEAD_K, HEAD_V = GDN_TP_SPEC.linear_heads, 128, 128
KEY_DIM, VALUE_DIM = HEADS * HEAD_K, HEADS * HEAD_V


ALL = os.environ.get("KVXFER_E2E_STATE_ALL") == "1"
DIRECTIONS = [
    pytest.param("pull", id="pull"),
    pytest.param(
        "push",
        id="push",
        marks=()
        if ALL
        else pytest.mark.skip(reason="set KVXFER_E2E_STATE_ALL=1 for every state case"),
    ),
]


@pytest.fixture(scope="module", params=DIRECTIONS)
def gdn_tp_pair(
    request: pytest.FixtureRequest, e2e_log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    direction = request.param
    model_dir = build_tiny_model(GDN_TP_SPEC)
    dumps = tmp_path_factory.mktemp(f"gdn-state-dumps-{direction}")
    pair = []
    try:
        p_port, d_port = ports.free_base_port(span=1), ports.free_base_port(span=2)
        for role, kv_role, port, tp_args in (
            ("prefill", "kv_producer", p_port, ()),
            ("decode", "kv_consumer", d_port, TP2),
        ):
            env = {
                **PD_ENV,
                **DS_ENV,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                DUMP_ENV: str(dumps),
            }
            if role == "decode":
                env[FLIP_ENV] = "1"
            pair.append(
                start_server(
                    f"{role}-state-tp-gdn-{direction}",
                    model_dir,
                    e2e_log_dir,
                    block_size=None,
                    kv_transfer_config=kv_config(
                        kv_role, direction, kv_connector_module_path=MODULE
                    ),
                    env=env,
                    extra_args=(*ARGS, *tp_args),
                    wait=False,
                )
            )
        wait_all_healthy(pair)
    except BaseException:
        for s in pair:
            s.stop()
        raise
    try:
        yield PDPair(f"gdn-tp-{direction}", *pair), dumps
    finally:
        for s in pair:
            s.stop()


def _load(dumps: Path, rid: str, side: str, rank: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """The slots saved for ``rid`` (waited for: a consumer rank saves its own as its
    load lands, which may be after decode answered on the other rank's word)."""
    deadline = time.monotonic() + 60
    while True:
        found = sorted(dumps.glob(f"*{rid}*.{side}.rank{rank}.pt"))
        if found:
            assert len(found) == 1, found
            out: dict[str, tuple[torch.Tensor, ...]] = torch.load(found[0])
            return out
        assert time.monotonic() < deadline, f"no {side} rank {rank} state saved for {rid}"
        time.sleep(0.2)


def _rank_slice(conv: torch.Tensor, ssm: torch.Tensor, rank: int, tp: int) -> tuple[Any, Any]:
    """What TP rank ``rank`` of ``tp`` holds of a TP1 slot (vLLM's GDN sharding)."""
    dim = conv.shape.index(2 * KEY_DIM + VALUE_DIM)  # DS: channels first
    q, k, v = conv.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=dim)
    parts = [t.chunk(tp, dim=dim)[rank] for t in (q, k, v)]
    return torch.cat(parts, dim=dim), ssm.chunk(tp, dim=0)[rank]


def _differences(producer: Any, consumer: Any, rank: int) -> dict[str, tuple[int, int]]:
    """Per GDN layer: how many conv and temporal-state elements of the consumer rank's
    slot differ (bitwise) from the producer's matching slice."""
    assert sorted(producer) == sorted(consumer)
    out = {}
    for layer, (conv, ssm) in producer.items():
        want_conv, want_ssm = _rank_slice(conv, ssm, rank, 2)
        got_conv, got_ssm = consumer[layer]
        assert got_conv.shape == want_conv.shape and got_ssm.shape == want_ssm.shape, layer
        out[layer] = tuple(
            int((got.view(_bits(got)) != want.view(_bits(want))).sum())
            for got, want in ((got_conv, want_conv), (got_ssm, want_ssm))
        )
    return out


def _bits(t: torch.Tensor) -> torch.dtype:
    return {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize]


def _through_pd(pair: PDPair, prompt: list[int], tag: str) -> str:
    rid = f"e2e-{tag}-{uuid.uuid4().hex[:12]}"
    params = prefill(pair.prefill, prompt, rid)
    assert params.get("remote_num_tokens") == len(prompt) - 1, params
    decode(pair.decode, prompt, params, request_id=rid, max_tokens=2)
    return rid


@pytest.mark.timeout(1200)  # two cold starts (one of two workers) on 2 shared cores
def test_gdn_state_moved_tp1_to_tp2_lands_bit_for_bit_on_every_rank(gdn_tp_pair: Any) -> None:
    pair, dumps = gdn_tp_pair
    for server in (pair.prefill, pair.decode):
        assert re.search(
            r"groups=\[(state\(conv=DS\),full|full,state\(conv=DS\))\]", server.log_text()
        ), f"{server.name}: no DS state group in the log"
    assert "Mamba/GDN state across TP sizes" not in pair.decode.log_text(), "no state split"
    vocab = GDN_TP_SPEC.vocab_size
    for i, length in enumerate(LENGTHS):
        rid = _through_pd(pair, random_prompt(vocab, length, 7100 + i), DUMP_MARK)
        producer = _load(dumps, rid, "producer", 0)
        assert producer and all(ssm.abs().sum() > 0 for _, ssm in producer.values())
        for rank in (0, 1):
            diffs = _differences(producer, _load(dumps, rid, "consumer", rank), rank)
            assert all(d == (0, 0) for d in diffs.values()), (length, rank, diffs)
    # Negative control: one SSM element of the first GDN layer corrupted on arrival on
    # each rank; the same comparison sees exactly it.
    rid = _through_pd(pair, random_prompt(vocab, LENGTHS[-1], 7199), f"{DUMP_MARK}-{FLIP_MARK}")
    producer = _load(dumps, rid, "producer", 0)
    first = sorted(producer)[0]
    for rank in (0, 1):
        diffs = _differences(producer, _load(dumps, rid, "consumer", rank), rank)
        assert diffs[first] == (0, 1), (rank, diffs)
        assert all(d == (0, 0) for layer, d in diffs.items() if layer != first), diffs
