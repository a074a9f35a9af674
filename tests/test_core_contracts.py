"""Contracts of the pure core the descriptor properties lean on (layout, wire), stated
exactly: every error names its owner, field, value and rule; size limits count bytes;
the auth MAC is the documented length-prefixed HMAC; timestamps skew at the documented
bounds. Added to kill mutants `make mutation` found alive (docs/TESTING.md)."""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest
import torch  # the torch extra is part of the test environment
from hypothesis import given
from hypothesis import strategies as st

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core import wire
from kvxfer.core.layout import Group, GroupKind, KVLayout, Region, SplitAxis, split_kv
from kvxfer.errors import AuthError, LayoutError, WireError
from kvxfer.testing import strategies as kst

# --- layout ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Group(kind="full"), "Group.kind='full': must be a GroupKind"),  # type: ignore[arg-type]
        (lambda: Group(kind=GroupKind.FULL, window=1.5), "Group.window=1.5: must be an int"),  # type: ignore[arg-type]
        (lambda: Group(kind=GroupKind.FULL, window=-1), "Group.window=-1: must be >= 0"),
        (
            lambda: Group(kind=GroupKind.SLIDING, window=0),
            "Group.window=0: must be > 0 iff kind is sliding",
        ),
        (
            lambda: KVLayout(block_size=4, regions=(_region(),), split_axis="head"),  # type: ignore[arg-type]
            "KVLayout.split_axis='head': must be a SplitAxis",
        ),
        (
            lambda: KVLayout(block_size=4, regions=(_region(),), groups=()),
            "KVLayout.groups=(): must not be empty",
        ),
        (lambda: split_kv(None, kv_dim=2), "split_kv.kv_dim=2: must be 0 or 1"),
        (
            lambda: KVLayout.from_tensors([], block_size=4),
            "KVLayout.from_tensors.tensors=[]: must not be empty",
        ),
        (
            lambda: KVLayout.from_tensors([torch.zeros(2, 4)] * 2, block_size=4, region_groups=[0]),
            "KVLayout.from_tensors.region_groups=1: needs one per tensor (2)",
        ),
        (
            lambda: KVLayout.from_tensors(
                [torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float16)], block_size=4
            ),
            "KVLayout.from_tensors.tensors=['torch.float16', 'torch.float32']: mixed dtypes",
        ),
        (
            lambda: KVLayout.from_tensors([torch.tensor(1.0)], block_size=4),
            "KVLayout.from_tensors.tensors[0].shape=(): needs a block dimension",
        ),
    ],
)
def test_layout_errors_name_owner_field_value_and_rule(build: object, message: str) -> None:
    with pytest.raises(LayoutError) as info:
        build()  # type: ignore[operator]
    assert str(info.value) == message


def _region() -> Region:
    return Region(base=0, num_blocks=2, stride=16, block_len=16)


def test_from_kv_caches_defaults_to_one_unsplit_shard() -> None:
    layout = KVLayout.from_kv_caches([torch.zeros(2, 3, 4, 2)], block_size=4)
    assert (layout.num_shards, layout.split_axis) == (1, SplitAxis.HEAD)


@given(kst.layouts())
def test_summary_states_parts_and_block_lengths(layout: KVLayout) -> None:
    text = layout.summary()
    parts = "/".join(sorted({r.part.value for r in layout.regions}))
    lens = sorted({r.block_len for r in layout.regions})
    block_len = str(lens[0]) if len(lens) == 1 else f"{lens[0]}..{lens[-1]}"
    assert f"parts={parts})" in text
    assert f" block_len={block_len} " in text


# --- wire ------------------------------------------------------------------------------

notices = st.builds(
    wire.Notice,
    kind=st.sampled_from(wire.NoticeKind),
    request_id=st.text("abc-", min_size=1, max_size=12),
    engine_id=st.text("xyz", min_size=1, max_size=8),
    incarnation=st.integers(0, 2**31),
)


@given(st.sampled_from((7, "frame", None, [1, 2], 1.5)))
def test_decode_refuses_what_is_not_bytes_naming_its_type(data: object) -> None:
    with pytest.raises(WireError) as info:
        wire.decode(data)
    assert str(info.value) == f"frame must be bytes, not {type(data).__name__}"


@given(st.integers(1, 64))
def test_the_size_limit_counts_bytes_not_items(words: int) -> None:
    view = memoryview(bytes(4 * words)).cast("I")  # len() counts 4-byte items
    with pytest.raises(
        WireError, match=rf"frame of {4 * words} bytes exceeds the {4 * words - 1}-byte"
    ):
        wire.decode(view, max_bytes=4 * words - 1)


@given(notices)
def test_decode_notice_honours_max_bytes(notice: wire.Notice) -> None:
    data = wire.encode_notice(notice)
    assert wire.decode_notice(data, max_bytes=len(data)) == notice
    with pytest.raises(WireError, match="exceeds"):
        wire.decode_notice(data, max_bytes=len(data) - 1)


@given(notices, st.binary(min_size=1, max_size=32), st.text(max_size=16), st.binary(max_size=8))
def test_the_mac_is_the_documented_length_prefixed_hmac(
    notice: wire.Notice, key: bytes, compat: str, reply_to: bytes
) -> None:
    frame = wire.decode(wire.encode(notice, compat, auth_key=key, reply_to=reply_to))
    auth = frame.auth
    assert auth is not None
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (
        b"kvxfer-auth-v1",
        PROTOCOL_VERSION.to_bytes(4, "big"),
        compat.encode(),
        frame.body,
        auth.nonce,
        auth.ts_ms.to_bytes(8, "big"),
        reply_to,
    ):
        mac.update(len(part).to_bytes(8, "big") + part)
    assert auth.mac == mac.digest()


@given(notices, st.floats(0.5, 200.0))
def test_timestamps_skew_up_to_30s_by_default_and_300s_for_notices(
    notice: wire.Notice, age: float
) -> None:
    key = b"secret"
    data = wire.encode_notice(notice, auth_key=key)
    old = wire.encode(notice, "", auth_key=key, now=time.time() - 30 - age)
    with pytest.raises(AuthError, match="limit 30s"):
        wire.verify(wire.decode(old), key, now=time.time())
    wire.verify(wire.decode(data), key, now=time.time())
    assert wire.decode_notice(old, auth_key=key) == notice  # within 300 s
    older = wire.encode(notice, "", auth_key=key, now=time.time() - 300 - age)
    with pytest.raises(AuthError, match="limit 300s"):
        wire.decode_notice(older, auth_key=key)
