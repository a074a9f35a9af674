"""The byte-level check's own machinery, without engines: the digests the verifying
connector takes (tests/e2e/verify_connector.py) and their comparison
(tests/e2e/kv_digests.py). The e2e TP pairs rely on both to call a transfer exact, so
each must be able to fail."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from . import kv_digests
from .kv_digests import DigestRecord, compare

BS = 32


def _record(
    side: str, rank: int, tp: int, heads: list[int], start: int, end: int, salt: str = ""
) -> DigestRecord:
    """A record whose digest of (layer, part, head, token) is a function of the key
    (and ``salt``): producer and consumer records made alike agree."""
    digests = {
        (layer, part, h): [f"{layer}{part}{h}{t}{salt}" for t in range(start, end)]
        for layer in ("l0", "l1")
        for part in ("K", "V")
        for h in heads
    }
    return DigestRecord(
        side=side,
        request_id=f"{side}-req",
        transfer_id="t",
        tp_rank=rank,
        tp_size=tp,
        start=start,
        end=end,
        heads=tuple(heads),
        digests=digests,
    )


def _with_digest(
    rec: DigestRecord, key: tuple[str, str, int], token: int, value: str
) -> DigestRecord:
    """``rec`` with one token's digest replaced."""
    digests = {k: list(v) for k, v in rec.digests.items()}
    digests[key][token - rec.start] = value
    return dataclasses.replace(rec, digests=digests)


def test_equal_digests_over_every_head_pass_and_count_every_key() -> None:
    prod = [_record("producer", 0, 1, [0, 1], 0, 70)]
    cons = [_record("consumer", 0, 2, [0], 0, 70), _record("consumer", 1, 2, [1], 0, 70)]
    result = compare(prod, cons)
    assert result.ok, result.summary()
    assert result.compared == result.expected == 2 * 2 * 2 * 70
    assert result.token_range == (0, 70)


def test_the_comparison_fails_on_each_kind_of_wrong_transfer() -> None:
    prod = [_record("producer", 0, 2, [0], 0, 70), _record("producer", 1, 2, [1], 0, 70)]
    one = _record("consumer", 0, 1, [0, 1], 0, 70)
    # One token of one head differs.
    bad = _with_digest(one, ("l1", "V", 1), 33, "other bytes")
    result = compare(prod, [bad])
    assert not result.ok and result.mismatches == [("l1", "V", 1, 33)]
    # A head no consumer rank reported.
    half = _record("consumer", 0, 1, [0], 0, 70)
    assert compare(prod, [half]).missing
    # A head two consumer ranks reported.
    twice = [_record("consumer", 0, 2, [0, 1], 0, 70), _record("consumer", 1, 2, [1], 0, 70)]
    assert compare(prod, twice).repeated
    # Consumer ranks that loaded different ranges; tokens the producer never held.
    ranges = [_record("consumer", 0, 2, [0], 0, 70), _record("consumer", 1, 2, [1], 0, 69)]
    assert compare(prod, ranges).problems
    assert compare(prod, [_record("consumer", 0, 1, [0, 1], 0, 71)]).not_on_producer
    # Another prompt's producer.
    other = [_record("producer", 0, 1, [0, 1], 0, 70, salt="B")]
    assert len(compare(other, [one]).mismatches) == 2 * 2 * 2 * 70
    # Nothing to compare is not a pass.
    assert not compare(prod, []).ok


def test_records_round_trip_through_the_files(tmp_path: Path) -> None:
    line = {
        "side": "consumer",
        "request_id": "r",
        "transfer_id": "cmpl-x-0-0123abcd",
        "tp_rank": 0,
        "tp_size": 1,
        "start": 32,
        "end": 34,
        "heads": [0],
        "digests": {"model.layers.0.self_attn.attn|K|0": ["a", "b"]},
    }
    # A second line still being written (no newline yet: seen as a JSON error in a
    # TP2 run) is left for a later read.
    text = json.dumps(line) + "\n" + json.dumps(line)[:40]
    (tmp_path / "consumer-e-r0-1.jsonl").write_text(text)
    (rec,) = kv_digests.read_records(tmp_path)
    assert dict(rec.items()) == {
        ("model.layers.0.self_attn.attn", "K", 0, 32): "a",
        ("model.layers.0.self_attn.attn", "K", 0, 33): "b",
    }
    assert kv_digests.transfer_id({"remote_request_id": "cmpl-x-0-0123abcd"}) == line["transfer_id"]
    push = {"remote_request_id": "cmpl-x-0-0123abcd", "transfer_mode": "push"}
    assert kv_digests.transfer_id(push) == "cmpl-x-0"


@pytest.mark.e2e
def test_digests_hash_each_tokens_bytes_where_vllms_cache_write_puts_them() -> None:
    """Against vLLM's own CPU cache write: a token written into a block by vLLM's op
    is digested from exactly the elements the op wrote, per (layer, K/V, global head),
    and tokens follow the request's block list."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    from .verify_connector import DIGEST_BYTES, _LayerDigests

    heads, hs, dtype = 2, 32, torch.float32
    cache = torch.randn(8, heads, BS, 2 * hs).to(dtype)
    digests = _LayerDigests(
        {"layer": cache},
        layer_groups={},
        full_groups={0},
        block_size=BS,
        tp_rank=1,  # this rank holds global heads 2 and 3
        kv_cache_dtype="auto",
    )
    assert digests.heads == [2, 3]
    key = torch.randn(1, heads, hs).to(dtype)
    value = torch.randn(1, heads, hs).to(dtype)
    # Token 40 of a request whose blocks are [5, 3]: block 3, slot 8.
    isa = cpu_attn._get_attn_isa(dtype, BS, hs, "auto")
    key_cache, value_cache = cache.view(8, heads, 2 * BS, hs).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, torch.tensor([3 * BS + 8]), isa
    )
    out = digests.digest(((5, 3),), 0, 39, 41)
    assert (out["start"], out["end"], out["heads"]) == (39, 41, [2, 3])

    def h(x: torch.Tensor) -> str:
        raw = x.contiguous().view(torch.uint8).numpy().tobytes()
        return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).hexdigest()

    for local in range(heads):
        assert out["digests"][f"layer|K|{2 + local}"][1] == h(key[0, local])
        assert out["digests"][f"layer|V|{2 + local}"][1] == h(value[0, local])
        # Token 39 (slot 7 of block 3) was not written: another digest.
        assert out["digests"][f"layer|K|{2 + local}"][0] != h(key[0, local])
