"""How TP splits Mamba2 and Gated DeltaNet state slots, derived by the vLLM adapter
from the model's config (issue 53), no engine.

The expected shapes come from vLLM's own ``MambaStateShapeCalculator`` (what its
layers allocate per rank), so a split that disagrees with what the kernels store
fails; the segment sizes are also written out by hand. Then the refusals: what the
derivation does not know gives no split and a reason; a split whose bytes do not
match the described regions, or a token-major (SD) conv state, leaves the rank
without ``TPRank.state`` and a load across TP sizes is refused by name; a push of
state across TP sizes is refused by name.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from typing import Any

import pytest
import torch

from kvxfer.adapters.vllm import startup
from kvxfer.adapters.vllm.kv_transfer_config import parse_kv_transfer_config
from kvxfer.adapters.vllm.scheduler import LoadSpec, StepPlan
from kvxfer.adapters.vllm.state_split import derive_state_split
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.core.heads import HeadLayout, TPRank
from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, KVPart, Region
from kvxfer.core.state_split import StateSegment, StateSplit, units_of

from .test_adapter_offline import _ticket

vllm_mamba = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
Calc = vllm_mamba.MambaStateShapeCalculator

F32, BF16 = torch.float32, torch.bfloat16


@dataclasses.dataclass
class MambaSpec:  # named like vLLM's: the adapter reads the spec's class name
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    mamba_type: Any


def _kind(name: str) -> Any:
    return types.SimpleNamespace(name=name)


def _mamba2_config(heads: int = 8, head_dim: int = 32, groups: int = 2, n: int = 16) -> Any:
    # GraniteMoeHybrid's names, plus attention's head_dim that must not be read.
    return types.SimpleNamespace(
        mamba_n_heads=heads,
        mamba_d_head=head_dim,
        mamba_n_groups=groups,
        mamba_d_state=n,
        mamba_d_conv=4,
        head_dim=999,
    )


def _orient(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    # vLLM reads VLLM_SSM_CONV_STATE_LAYOUT once per process (cached): the calculator's
    # orientation is patched instead.
    monkeypatch.setattr(vllm_mamba, "is_conv_state_dim_first", lambda: layout == "DS")


def _mamba2_spec(
    monkeypatch: pytest.MonkeyPatch, cfg: Any, tp: int, layout: str, dtypes: tuple[Any, ...]
) -> MambaSpec:
    _orient(monkeypatch, layout)
    shapes = Calc.mamba2_state_shape(
        tp_world_size=tp,
        intermediate_size=cfg.mamba_n_heads * cfg.mamba_d_head,
        n_groups=cfg.mamba_n_groups,
        num_heads=cfg.mamba_n_heads,
        head_dim=cfg.mamba_d_head,
        state_size=cfg.mamba_d_state,
        conv_kernel=cfg.mamba_d_conv,
    )
    return MambaSpec(shapes=shapes, dtypes=dtypes, mamba_type=_kind("MAMBA2"))


def _gdn_config(kh: int = 4, vh: int = 8, dk: int = 16, dv: int = 32) -> Any:
    return types.SimpleNamespace(
        linear_num_key_heads=kh,
        linear_num_value_heads=vh,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
    )


def _gdn_spec(
    monkeypatch: pytest.MonkeyPatch, cfg: Any, tp: int, layout: str, dtypes: tuple[Any, ...]
) -> MambaSpec:
    _orient(monkeypatch, layout)
    shapes = Calc.gated_delta_net_state_shape(
        tp,
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel_dim,
    )
    return MambaSpec(shapes=shapes, dtypes=dtypes, mamba_type=_kind("GDN_ATTN"))


def _bytes(spec: MambaSpec, i: int) -> int:
    return int(math.prod(spec.shapes[i]) * spec.dtypes[i].itemsize)


def _check_against_vllm(split: StateSplit, spec: MambaSpec, tp: int) -> None:
    """Every rank of ``tp`` holds exactly the bytes vLLM allocates per slot."""
    assert split.region_bytes(KVPart.CONV, tp) == _bytes(spec, 0)
    assert split.region_bytes(KVPart.SSM, tp) == _bytes(spec, 1)
    for r in range(tp):  # and the rule gives every rank whole units
        for s in (*split.conv, *split.ssm):
            assert len(units_of(s.units, tp, r)) * s.unit_bytes == s.held_bytes(tp)


@pytest.mark.parametrize("layout", ["DS", "SD"])
@pytest.mark.parametrize(("groups", "tp"), [(2, 1), (2, 2), (1, 2), (1, 4), (4, 4), (4, 2), (8, 4)])
def test_mamba2_split_matches_the_shapes_vllm_allocates(
    monkeypatch: pytest.MonkeyPatch, layout: str, groups: int, tp: int
) -> None:
    cfg = _mamba2_config(groups=groups)
    # bf16 conv state, float32 SSM state (mamba_ssm_cache_dtype=float32)
    spec = _mamba2_spec(monkeypatch, cfg, tp, layout, (BF16, F32))
    split, why = derive_state_split(cfg, [spec], tp, ConvLayout(layout))
    assert why == "" and split is not None
    length = 3  # conv_kernel - 1
    # By hand: x 32 channels per head, B and C 16 per group, 3 positions, 2 bytes; an
    # SSM head 32 x 16 float32.
    assert split == StateSplit(
        conv=(
            StateSegment(name="x", units=8, unit_bytes=32 * length * 2),
            StateSegment(name="B", units=groups, unit_bytes=16 * length * 2),
            StateSegment(name="C", units=groups, unit_bytes=16 * length * 2),
        ),
        ssm=(StateSegment(name="heads", units=8, unit_bytes=32 * 16 * 4),),
    )
    _check_against_vllm(split, spec, tp)
    # vLLM extends a single group to one per rank: each rank's B holds that group.
    held_groups = groups // tp if groups >= tp else 1
    assert split.conv[1].held_bytes(tp) == held_groups * 16 * length * 2
    # The split describes the model: the same at every TP size.
    other = _mamba2_spec(monkeypatch, cfg, 1, layout, (BF16, F32))
    assert derive_state_split(cfg, [other], 1, ConvLayout(layout))[0] == split


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_split_matches_the_shapes_vllm_allocates(
    monkeypatch: pytest.MonkeyPatch, tp: int
) -> None:
    cfg = _gdn_config()
    spec = _gdn_spec(monkeypatch, cfg, tp, "DS", (BF16, F32))
    split, why = derive_state_split(cfg, [spec], tp, ConvLayout.DS)
    assert why == "" and split is not None
    assert split == StateSplit(
        conv=(
            StateSegment(name="q", units=4, unit_bytes=16 * 3 * 2),
            StateSegment(name="k", units=4, unit_bytes=16 * 3 * 2),
            StateSegment(name="v", units=8, unit_bytes=32 * 3 * 2),
        ),
        ssm=(StateSegment(name="v_heads", units=8, unit_bytes=32 * 16 * 4),),
    )
    _check_against_vllm(split, spec, tp)
    # By hand, per rank: (2 * 4 * 16 + 8 * 32) / tp channels x 3 x 2 bytes.
    assert split.region_bytes(KVPart.CONV, tp) == (2 * 4 * 16 + 8 * 32) // tp * 3 * 2


def test_what_the_derivation_does_not_know_gives_no_split_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = _mamba2_config()
    spec = _mamba2_spec(monkeypatch, cfg, 2, "DS", (F32, F32))

    def why(config: Any, specs: list[Any], tp: int = 2) -> str:
        split, reason = derive_state_split(config, specs, tp, ConvLayout.DS)
        assert split is None
        return reason

    assert "mamba_type MAMBA1" in why(cfg, [dataclasses.replace(spec, mamba_type=_kind("MAMBA1"))])
    assert "mamba_n_heads/mamba_num_heads/n_mamba_heads/num_heads (heads)" in why(
        types.SimpleNamespace(mamba_d_head=32), [spec]
    )
    # A spec of another TP size than the instance's (or of another model).
    assert "the conv state has 160 channels per rank, the config gives 320" in why(
        cfg, [spec], tp=1
    )
    assert "the SSM state is (8, 32, 16) per rank, the config gives (4, 32, 16)" in why(
        cfg, [dataclasses.replace(spec, shapes=(spec.shapes[0], (8, 32, 16)))]
    )
    # ReplaySSM's ring: more tensors per slot than the two split here.
    assert "a state slot of 3 tensors" in why(
        cfg, [dataclasses.replace(spec, shapes=(*spec.shapes, (4, 4)), dtypes=(F32,) * 3)]
    )
    assert "specs differ" in why(
        cfg, [spec, dataclasses.replace(spec, mamba_type=_kind("GDN_ATTN"))]
    )
    assert "dtypes differ" in why(cfg, [spec, dataclasses.replace(spec, dtypes=(BF16, F32))])
    assert "3 groups do not split over tp_size=2" in why(_mamba2_config(groups=3), [spec])
    assert "1 key and 8 value heads do not both split over tp_size=2" in why(
        _gdn_config(kh=1), [_gdn_spec(monkeypatch, _gdn_config(), 2, "DS", (F32, F32))]
    )


# --- wiring: the rank's TPRank, its check against the regions, the worker's refusals ---


def _vllm_config(hf: Any, tp: int) -> Any:
    model = types.SimpleNamespace(
        hf_config=hf, hf_text_config=hf, use_mla=False, get_total_num_kv_heads=lambda: 2
    )
    return types.SimpleNamespace(
        model_config=model, parallel_config=types.SimpleNamespace(tensor_parallel_size=tp)
    )


def _kv_cache_config(spec: Any) -> Any:
    full = types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace())
    return types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec), full])


def _state_layout(conv: int, ssm: int, order: ConvLayout) -> KVLayout:
    regions = tuple(
        Region(
            base=(1 << 20) * (i + 1),
            num_blocks=4,
            stride=1 << 16,
            block_len=length,
            layer=layer,
            part=part,
            group=group,
            head=head,
        )
        for i, (layer, part, group, length, head) in enumerate(
            [
                (0, KVPart.CONV, 0, conv, 0),
                (0, KVPart.SSM, 0, ssm, 0),
                (1, KVPart.K, 1, 4096, 0),
                (1, KVPart.V, 1, 4096, 0),
            ]
        )
    )
    groups = (Group(kind=GroupKind.STATE, conv_layout=order), Group(kind=GroupKind.FULL))
    return KVLayout(block_size=16, regions=regions, groups=groups, kv_layout="HND")


def test_a_rank_states_its_split_only_where_its_regions_hold_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvxfer.adapters.vllm")
    monkeypatch.setattr(startup, "conv_state_layout", lambda: ConvLayout.DS)
    cfg = _mamba2_config()
    spec = _mamba2_spec(monkeypatch, cfg, 2, "DS", (F32, F32))
    tp, why = startup.state_tp_identity(_vllm_config(cfg, 2), 1, _kv_cache_config(spec))
    assert why == "" and tp.state is not None and tp.rank == 1
    assert tp.heads == HeadLayout(num_kv_heads=2, tp_size=2)
    conv, ssm = _bytes(spec, 0), _bytes(spec, 1)
    assert startup._tp_for(_state_layout(conv, ssm, ConvLayout.DS), tp) == tp
    # Token-major conv state: no TP identity, and the log names the setting.
    assert startup._tp_for(_state_layout(conv, ssm, ConvLayout.SD), tp) is None
    assert "VLLM_SSM_CONV_STATE_LAYOUT=DS" in caplog.text
    # Regions that do not hold the split's bytes: named with both sizes.
    assert startup._tp_for(_state_layout(conv, ssm + 4, ConvLayout.DS), tp) is None
    assert f"block_len={ssm + 4}" in caplog.text and f"holds {ssm} bytes" in caplog.text
    # Nothing derived: the start-up line says why.
    bad = _vllm_config(types.SimpleNamespace(), 2)
    tp, why = startup.state_tp_identity(bad, 0, _kv_cache_config(spec))
    assert tp.state is None and "mamba_n_heads" in why
    assert startup._tp_for(_state_layout(conv, ssm, ConvLayout.DS), tp, why) is None
    assert "Mamba/GDN state across TP sizes: the TP split of kv_cache_groups[0]" in caplog.text
    # No state group: no split and no reason.
    plain = types.SimpleNamespace(kv_cache_groups=[])
    assert startup.state_tp_identity(_vllm_config(cfg, 2), 0, plain) == (
        TPRank(heads=HeadLayout(num_kv_heads=2, tp_size=2), rank=0),
        "",
    )


NB, PAGE = 8, 16384


def _state_worker(direction: str, tp: TPRank | None) -> WorkerSide:
    """A TP2 decode rank of a state hybrid (one Mamba2-like layer, one attention
    layer) over the fake backend, its Agent given ``tp``."""
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.backend import BackendOptions
    from kvxfer.core.compat import Fingerprint
    from kvxfer.testing.fake_backend import FakeBackend

    connector = "RblnNixlPushConnector" if direction == "push" else "RblnNixlPullConnector"
    cfg = parse_kv_transfer_config(
        {"kv_connector": connector, "kv_role": "kv_consumer", "kv_buffer_device": "cpu"}
    )
    conv, ssm = 3 * 160 * 4, 4 * 32 * 16 * 4
    raw = torch.zeros(NB * PAGE, dtype=torch.int8)
    state = torch.as_strided(raw, (NB, 1, 1, conv + ssm), (PAGE, PAGE, PAGE, 1))
    attn = raw.view(torch.bfloat16).view(NB, 1, 16, PAGE // (16 * 2))
    fingerprint = Fingerprint(
        model="tiny",
        dtype="float32",
        kv_cache_dtype="float32",
        attention_backend="CPU_ATTN",
        direction=cfg.direction,
    )

    def factory(layout: Any, tensors: Any) -> Any:
        return Agent(
            AgentConfig(
                engine_id=f"decode-state-tp-{direction}",
                fingerprint=fingerprint,
                role=cfg.role,
                direction=cfg.direction,
                tp=tp,
                handshake_timeout_s=0.5,
                handshake_retries=0,
            ),
            backend=FakeBackend(BackendOptions(agent_name=f"state-tp-{direction}")),
        )

    return WorkerSide.from_kv_caches(
        cfg,
        {"l.0.mixer": state, "l.1.attn": attn},
        agent_factory=factory,
        block_size=16,
        num_blocks=NB,
        kv_layout="NHD",
        tp_rank=0,
        tp_size=2,
        first_head=0,
        groups=(Group(kind=GroupKind.STATE, conv_layout=ConvLayout.DS), Group(kind=GroupKind.FULL)),
        layer_groups={"l.0.mixer": 0, "l.1.attn": 1},
        state_parts={0: (conv, ssm)},
    )


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_a_state_load_across_tp_sizes_that_is_not_served_is_refused_by_name(
    direction: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Without this rank's state split, a load from another TP size is refused by
    name, pulled or pushed (both plan the consumer rank's units from that split)."""
    words = "this rank's is not available (the start-up log line 'kvxfer: Mamba/GDN state"
    w = _state_worker(direction, None)
    try:
        load = LoadSpec(
            request_id="d-st",
            transfer_id="t",
            remote_params={**_ticket([1], 16), "tp_size": 1},
            local_blocks=((3,), (4,)),
            skip_blocks=0,
            num_tokens=15,
        )
        w.start_step(StepPlan(loads=[load]))
        _, recving, failed = w.transfer_results()
        assert recving == failed == {"d-st"}
    finally:
        w.close()
    assert "tp_size=1 (the producer's; this instance runs 2)" in caplog.text
    assert words in caplog.text
