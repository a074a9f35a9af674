"""A KV cache whose attention kernel splits the scheduler's blocks (issue 54, item 2).

vLLM gives an attention backend that supports only smaller blocks than the KV cache
manager's (FlashInfer's 16/32/64 under llm-d's ``--block-size 128``; FlashMLA's 64) a
tensor of ``num_blocks * k`` kernel blocks, scheduler block *b* being kernel blocks
``b*k .. b*k+k-1``. kvxfer describes the blocks the tensor really has: each kernel
block of a scheduler block is a token shard of it (``SplitAxis.TOKEN``), so a pull
moves all of a block's tokens and a peer whose kernel splits its blocks differently is
refused at the handshake instead of being read at the wrong addresses."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvxfer.adapters.vllm.cache_layout import describe_kv_caches
from kvxfer.agent import Agent, AgentConfig
from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.core.layout import KVLayout, SplitAxis
from kvxfer.errors import ConfigError
from kvxfer.testing.fake_backend import FakeBackend
from kvxfer.types import Direction, Role

BLOCK, BLOCKS, HEADS, DIM, LAYERS = 128, 12, 2, 8, 2
FP = Fingerprint(
    model="m",
    dtype="float32",
    kv_cache_dtype="float32",
    attention_backend="t",
    direction=Direction.PULL,
)
_names = itertools.count()


# (name, the tensor's shape for k kernel blocks per block): FlashAttention's
# (2, blocks, tokens, heads, dim) and FlashInfer's (blocks, 2, tokens, heads, dim).
def _kv_first(k: int) -> tuple[int, ...]:
    return (2, BLOCKS * k, BLOCK // k, HEADS, DIM)


def _blocks_first(k: int) -> tuple[int, ...]:
    return (BLOCKS * k, 2, BLOCK // k, HEADS, DIM)


SHAPES: dict[str, Callable[[int], tuple[int, ...]]] = {
    "kv_first": _kv_first,
    "blocks_first": _blocks_first,
}


def _caches(shape: str, k: int, seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.rand(SHAPES[shape](k), generator=gen)
            if seed is not None
            else torch.zeros(SHAPES[shape](k))
        )
        for i in range(LAYERS)
    }


def _by_token(t: torch.Tensor, shape: str, k: int) -> torch.Tensor:
    """``[block, token, K|V, head, dim]``: the scheduler's view of one layer."""
    if shape == "kv_first":
        t = t.permute(1, 0, 2, 3, 4)  # kernel block, K|V, tokens, heads, dim
    t = t.reshape(BLOCKS, k, 2, BLOCK // k, HEADS, DIM).permute(0, 1, 3, 2, 4, 5)
    return t.reshape(BLOCKS, BLOCK, 2, HEADS, DIM)


def _layout(caches: dict[str, torch.Tensor]) -> KVLayout:
    return describe_kv_caches(caches, block_size=BLOCK, num_blocks=BLOCKS, kv_layout="NHD")


def _agent(role: Role, layout: KVLayout) -> Agent:
    agent = Agent(
        AgentConfig(engine_id=f"kb-{role.value}-{next(_names)}", fingerprint=FP, role=role),
        backend=FakeBackend(BackendOptions(agent_name=f"kb-{next(_names)}")),
    )
    agent.register(layout)
    agent.serve()
    return agent


def _wait(pull: Any) -> Any:
    deadline = time.monotonic() + 20
    while not pull.done and time.monotonic() < deadline:
        time.sleep(0.005)
    return pull


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_kernel_split_block_is_described_as_its_kernel_blocks(shape: str, k: int) -> None:
    layout = _layout(_caches(shape, k, None))
    assert layout.block_size == BLOCK
    assert layout.num_shards == k
    assert layout.split_axis is (SplitAxis.TOKEN if k > 1 else SplitAxis.HEAD)
    assert {r.num_blocks for r in layout.regions} == {BLOCKS}
    # Every byte of the tensors once: the kernel blocks of each block are its shards.
    assert sum(r.block_len * r.num_blocks for r in layout.regions) == sum(
        t.numel() * t.element_size() for t in _caches(shape, k, None).values()
    )


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("num_tokens", [1, 100, 128, 300])
def test_a_pull_moves_every_token_of_kernel_split_blocks(
    shape: str, k: int, num_tokens: int
) -> None:
    pcaches, ccaches = _caches(shape, k, 1), _caches(shape, k, None)
    producer = _agent(Role.PRODUCER, _layout(pcaches))
    consumer = _agent(Role.CONSUMER, _layout(ccaches))
    try:
        n = -(-num_tokens // BLOCK)
        pb, cb = [7, 2, 9][:n], [1, 5, 11][:n]
        pull = _wait(consumer.pull(producer.hold("q", pb, num_tokens), cb))
        assert pull.state.name == "DONE", (pull.state, pull.error)
        for name in pcaches:
            want = _by_token(pcaches[name], shape, k)[pb]
            got = _by_token(ccaches[name], shape, k)
            assert torch.equal(got[cb], want), name
            others = [b for b in range(BLOCKS) if b not in cb]
            assert not got[others].any(), f"{name}: a block outside the request was written"
    finally:
        consumer.close()
        producer.close()


def test_a_peer_whose_kernel_splits_blocks_otherwise_is_refused() -> None:
    producer = _agent(Role.PRODUCER, _layout(_caches("kv_first", 2, 1)))
    consumer = _agent(Role.CONSUMER, _layout(_caches("kv_first", 1, None)))
    try:
        pull = _wait(consumer.pull(producer.hold("q", [3], BLOCK), [4]))
        assert pull.state.name == "FAILED"
        assert "KV layout differs at split_axis" in str(pull.error), pull.error
    finally:
        consumer.close()
        producer.close()


def test_tensors_that_are_not_whole_blocks_or_split_unevenly_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"kv_caches\['a'\]\.shape.*whole multiple of .* 12"):
        describe_kv_caches(
            {"a": torch.zeros(2, 30, 64, HEADS, DIM)},
            block_size=BLOCK,
            num_blocks=BLOCKS,
            kv_layout="NHD",
        )
    mixed = {"a": torch.zeros(SHAPES["kv_first"](2)), "b": torch.zeros(SHAPES["kv_first"](4))}
    with pytest.raises(ConfigError, match=r"kv_caches=\[2, 4\].*split"):
        describe_kv_caches(mixed, block_size=BLOCK, num_blocks=BLOCKS, kv_layout="NHD")
