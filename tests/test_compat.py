"""kvxfer.core.compat: the compatibility hash (R-COMPAT-1/2) and the layout check (R-COMPAT-3)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.core.compat import Fingerprint, check_layout
from kvxfer.core.layout import Group, GroupKind, KVLayout, KVPart, Region
from kvxfer.errors import ConfigError, LayoutMismatch
from kvxfer.testing import strategies as kst
from kvxfer.types import Direction

GOLDEN = Fingerprint(
    model="Qwen/Qwen3-0.6B",
    revision="c1899de",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="RBLN_ATTN",
    protocol_version=1,
    direction=Direction.PULL,
)
# Pinned on purpose: if this changes, every deployed instance stops pairing with the
# new build. Change it only together with PROTOCOL_VERSION.
GOLDEN_CANONICAL = (
    b'{"attention_backend":"RBLN_ATTN","direction":"pull","draft_model":"",'
    b'"dtype":"bfloat16","kv_cache_dtype":"bfloat16","model":"Qwen/Qwen3-0.6B",'
    b'"protocol_version":1,"revision":"c1899de"}'
)
GOLDEN_DIGEST = "a97ba74e460223c3eff59abe1bb42f457e3637885116ca3fc2709dc61d95fe3d"


def test_golden_canonical_encoding_and_digest() -> None:
    assert GOLDEN.canonical() == GOLDEN_CANONICAL
    assert GOLDEN.digest() == GOLDEN_DIGEST


def test_digest_is_the_same_in_another_process() -> None:
    code = (
        "from kvxfer.core.compat import Fingerprint\n"
        "from kvxfer.types import Direction\n"
        "print(Fingerprint(model='Qwen/Qwen3-0.6B', revision='c1899de', dtype='bfloat16',"
        " kv_cache_dtype='bfloat16', attention_backend='RBLN_ATTN', protocol_version=1,"
        " direction=Direction.PULL).digest())\n"
    )
    # A different hash seed: nothing may depend on dict/set iteration order.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == GOLDEN_DIGEST


def test_default_protocol_version_is_the_current_one() -> None:
    fp = Fingerprint(
        model="m",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="a",
        direction=Direction.PULL,
    )
    assert fp.protocol_version == PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "Qwen/Qwen3-1.7B"),
        ("revision", "main"),
        ("dtype", "float16"),
        ("kv_cache_dtype", "fp8"),
        ("attention_backend", "FLASH_ATTN"),
        ("protocol_version", 2),
        ("direction", Direction.PUSH),
        ("draft_model", "Qwen/Qwen3-0.6B-draft"),
    ],
)
def test_every_field_is_in_the_hash(field: str, value: Any) -> None:
    # R-COMPAT-1: pull and push never pair, nor do other models, dtypes, drafts, ...
    assert msgspec.structs.replace(GOLDEN, **{field: value}).digest() != GOLDEN.digest()


_text = st.text(max_size=12)


@given(a=_text, b=_text)
def test_field_boundaries_are_unambiguous(a: str, b: str) -> None:
    # JSON quoting keeps ("ab", "c") and ("a", "bc") apart.
    one = msgspec.structs.replace(GOLDEN, model=a + b, revision="")
    two = msgspec.structs.replace(GOLDEN, model=a, revision=b)
    assert (one.digest() == two.digest()) == (one == two)


@given(model=st.text(max_size=40), draft=st.text(max_size=10), push=st.booleans())
def test_canonical_form_is_sorted_json_of_the_fields(model: str, draft: str, push: bool) -> None:
    fp = msgspec.structs.replace(
        GOLDEN, model=model, draft_model=draft, direction=Direction.PUSH if push else Direction.PULL
    )
    decoded = msgspec.json.decode(fp.canonical())
    assert list(decoded) == sorted(decoded)
    assert msgspec.convert(decoded, Fingerprint) == fp
    assert len(fp.digest()) == 64


# -- check_layout (R-COMPAT-3) --------------------------------------------------------


def layout(**overrides: Any) -> KVLayout:
    region: dict[str, Any] = {"base": 1 << 20, "num_blocks": 8, "stride": 4096, "block_len": 4096}
    regions = tuple(
        Region(**region, layer=layer, part=part)
        for layer in range(2)
        for part in (KVPart.K, KVPart.V)
    )
    return KVLayout(**{"block_size": 16, "regions": regions, **overrides})


@pytest.mark.parametrize("key", ["dtype", "kv_cache_dtype"])
@pytest.mark.parametrize("value", ["auto", "AUTO", " auto", ""])
def test_unresolved_dtype_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        Fingerprint(**{**msgspec.structs.asdict(GOLDEN), key: value})
    assert info.value.key == f"Fingerprint.{key}"
    assert info.value.value == value
    assert "dtype name" in str(info.value)


def test_equal_shapes_pass() -> None:
    check_layout(layout(), layout())


def test_block_size_mismatch_rejected() -> None:
    with pytest.raises(LayoutMismatch) as info:
        check_layout(layout(block_size=16), layout(block_size=32))
    assert (info.value.field, info.value.local, info.value.remote) == ("block_size", 16, 32)
    assert "block_size" in str(info.value)


def test_first_difference_is_named() -> None:
    other = layout(dtype="float16", kv_layout="HND")
    with pytest.raises(LayoutMismatch) as info:
        check_layout(layout(), other)
    assert info.value.field == "dtype"


def test_region_count_and_block_len_differences_named() -> None:
    base = layout()
    fewer = KVLayout(block_size=16, regions=base.regions[:2])
    with pytest.raises(LayoutMismatch) as info:
        check_layout(base, fewer)
    # fewer regions because fewer layers: said in the engine's terms
    assert (info.value.field, info.value.local, info.value.remote) == ("num_layers", 2, 1)
    k_only = KVLayout(block_size=16, regions=(base.regions[0], base.regions[2]))
    with pytest.raises(LayoutMismatch) as info:
        check_layout(base, k_only)
    assert (info.value.field, info.value.local, info.value.remote) == ("num_regions", 4, 2)
    longer = KVLayout(
        block_size=16,
        regions=(
            *base.regions[:3],
            msgspec.structs.replace(base.regions[3], block_len=8192, stride=8192),
        ),
    )
    with pytest.raises(LayoutMismatch) as info:
        check_layout(base, longer)
    field = info.value.field
    assert field.startswith("regions[3] (layer 1 V).block_len"), field
    assert "256 vs 512 bytes per token" in field and "kv_heads x head_dim" in field
    assert (info.value.local, info.value.remote) == (4096, 8192)


def test_heads_and_head_dim_named_when_both_sides_know_them() -> None:
    with pytest.raises(LayoutMismatch) as info:
        check_layout(layout(num_kv_heads=2, head_dim=64), layout(num_kv_heads=4, head_dim=32))
    assert (info.value.field, info.value.local, info.value.remote) == (
        "num_kv_heads (per region)",
        2,
        4,
    )
    with pytest.raises(LayoutMismatch) as info:
        check_layout(layout(num_kv_heads=2, head_dim=64), layout(num_kv_heads=2, head_dim=32))
    assert info.value.field == "head_dim (per region)"
    # 0 is "not known" (a hand-built layout, an older peer): nothing to compare
    check_layout(layout(num_kv_heads=2, head_dim=64), layout())
    check_layout(layout(), layout(num_kv_heads=4, head_dim=128))


def test_layer_identity_is_compared_before_block_len() -> None:
    base = layout()
    moved = KVLayout(
        block_size=16,
        regions=tuple(
            msgspec.structs.replace(r, layer=r.layer + 1, block_len=8192, stride=8192)
            for r in base.regions
        ),
    )
    with pytest.raises(LayoutMismatch) as info:
        check_layout(base, moved)
    assert info.value.field == "regions[0] (layer 0 K).layer"


def test_dtype_named_before_the_bytes_it_changes() -> None:
    base = layout()
    wide = KVLayout(
        block_size=16,
        dtype="float32",
        regions=tuple(
            msgspec.structs.replace(r, block_len=8192, stride=8192) for r in base.regions
        ),
    )
    with pytest.raises(LayoutMismatch) as info:
        check_layout(base, wide)
    assert (info.value.field, info.value.local, info.value.remote) == (
        "dtype",
        "bfloat16",
        "float32",
    )


def test_groups_differ() -> None:
    sliding = KVLayout(
        block_size=16,
        regions=layout().regions,
        groups=(Group(kind=GroupKind.SLIDING, window=8),),
    )
    with pytest.raises(LayoutMismatch) as info:
        check_layout(layout(), sliding)
    assert info.value.field == "groups"


@given(st.data())
def test_relocated_layouts_are_compatible(data: st.DataObject) -> None:
    # Addresses, strides and block counts legitimately differ between two instances.
    local = data.draw(kst.layouts())
    remote = data.draw(kst.relocated(local))
    check_layout(local, remote)
    check_layout(remote, local)


@given(st.data())
def test_other_block_size_is_always_rejected(data: st.DataObject) -> None:
    local = data.draw(kst.layouts())
    remote = data.draw(kst.layouts())
    if remote.block_size == local.block_size:
        return
    with pytest.raises(LayoutMismatch) as info:
        check_layout(local, remote)
    assert info.value.field == "block_size"
