"""Hybrid (sliding-window + full attention) KV caches through the adapter, no engine.

The caches are shaped and shared as vLLM 0.32's hybrid KV cache manager allocates them
on CPU: one ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` tensor per layer
*pair*, used by a sliding-window layer for the blocks its group owns and by a
full-attention layer for the others. Real Agents over the fake backend move a prompt
with per-group block lists (the sliding group's list as vLLM gives it, with the null
block where the window dropped one); the test checks, per head and token, that every
byte decode needs arrived and, for swa_window_mode and chunk_mode, that the bytes the
algebra leaves out did not (so the per-head regions cut tokens exactly).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kvxfer.adapters.vllm.kv_transfer_config import parse_kv_transfer_config
from kvxfer.adapters.vllm.params import remote_ticket
from kvxfer.adapters.vllm.scheduler import LoadSpec, SchedulerSide, StepPlan
from kvxfer.adapters.vllm.worker import WorkerSide, describe_kv_caches, token_major_groups
from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.layout import Group, GroupKind, KVPart
from kvxfer.errors import ConfigError
from kvxfer.types import Direction, Role

from .test_adapter_offline import FakeRequest, _new_acc, _results, _until

BS, NUM_BLOCKS, HEADS, HEAD, WINDOW, STEP = 32, 24, 2, 8, 16, 16
#: vLLM's order for the tiny Gemma3: the sliding group first.
GROUPS = (Group(kind=GroupKind.SLIDING, window=WINDOW), Group(kind=GroupKind.FULL))
LAYER_GROUPS = {f"layers.{i}": 0 if i % 2 == 0 else 1 for i in range(4)}
MODES = {
    "whole": {},
    "swa": {"swa_window_mode": True},
    "chunk": {"chunk_mode": True, "chunk_tokens": STEP},
    "swa_chunk": {"swa_window_mode": True, "chunk_mode": True},
}
_ids = itertools.count()
_engine_ids: list[str] = []  # the engine id of each worker built, in order


def _caches(fill: bool) -> dict[str, Any]:
    """Four layers on two tensors: layers 2j (sliding) and 2j+1 (full) share tensor j."""
    gen = torch.Generator().manual_seed(5)
    tensors = []
    for _ in range(2):
        t = torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)
        if fill:
            t.copy_(torch.randn(t.shape, generator=gen))
        tensors.append(t)
    return {f"layers.{i}": tensors[i // 2] for i in range(4)}


def _options(extra: dict[str, Any]) -> PlanOptions:
    return PlanOptions(
        chunk_mode=bool(extra.get("chunk_mode")),
        chunk_tokens=extra.get("chunk_tokens"),
        prefill_step_tokens=STEP,
        swa_window_mode=bool(extra.get("swa_window_mode")),
    )


def _worker(role: str, direction: str, extra: dict[str, Any], caches: dict[str, Any]) -> WorkerSide:
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.backend import BackendOptions
    from kvxfer.core.compat import Fingerprint
    from kvxfer.testing.fake_backend import FakeBackend

    connector = "RblnNixlPushConnector" if direction == "push" else "RblnNixlPullConnector"
    cfg = parse_kv_transfer_config(
        {
            "kv_connector": connector,
            "kv_role": role,
            "kv_buffer_device": "rbln",
            "kv_connector_extra_config": extra,
        }
    )
    engine_id = f"{role}-{next(_ids)}"
    options = _options(extra)
    _engine_ids.append(engine_id)

    def factory(layout: Any, tensors: Any) -> Agent:
        return Agent(
            AgentConfig(
                engine_id=engine_id,
                fingerprint=Fingerprint(
                    model="tiny-hybrid",
                    dtype="bfloat16",
                    kv_cache_dtype="bfloat16",
                    attention_backend="CPU_ATTN",
                    direction=cfg.direction,
                ),
                role=cfg.role,
                direction=cfg.direction,
                plan=options,
                transfer_timeout_s=3.0,
                handshake_timeout_s=0.5,
                handshake_retries=0,
            ),
            backend=FakeBackend(BackendOptions(agent_name=f"{engine_id}#agent")),
        )

    return WorkerSide.from_kv_caches(
        cfg,
        caches,
        agent_factory=factory,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="LBHNC",
        groups=GROUPS,
        layer_groups=LAYER_GROUPS,
        plan_options=options,
    )


def _side(role: Role, direction: Direction, engine_id: str = "") -> SchedulerSide:
    return SchedulerSide(
        engine_id=engine_id or f"{role.value}-0",
        role=role,
        direction=direction,
        block_size=BS,
        windows=tuple(g.window for g in GROUPS),
    )


def _tokens(t: Any, block: int, head: int, part: int, lo: int, hi: int) -> Any:
    """Tokens ``[lo, hi)`` of one head's K (part 0) or V (part 1) in ``block``, in
    vLLM's CPU order (probed by tests/e2e/test_adapter_cpu_cache.py): K element-major
    (``[element][token]``), V token-major (``[token][element]``)."""
    if part == 0:
        return t.view(NUM_BLOCKS, HEADS, 2, HEAD, BS)[block, head, 0, :, lo:hi]
    return t.view(NUM_BLOCKS, HEADS, 2, BS, HEAD)[block, head, 1, lo:hi]


def _sent_tokens(mode: str, group: int, position: int, num_tokens: int) -> set[int]:
    """Tokens of the request's ``position``-th block the algebra sends (R-DESC-3/4):
    whole blocks; chunk_mode: of the last block only the chunks holding tokens;
    swa_window_mode: of a sliding group only the granules the window covers."""
    lo = position * BS
    tokens = set(range(lo, lo + BS))
    extra = MODES[mode]
    if extra.get("chunk_mode") and position == (num_tokens - 1) // BS:
        tokens = set(range(lo, lo + -(-(num_tokens - lo) // STEP) * STEP))
    if extra.get("swa_window_mode") and GROUPS[group].kind is GroupKind.SLIDING:
        g_lo, g_hi = max(num_tokens - WINDOW, 0) // WINDOW, (num_tokens - 1) // WINDOW
        tokens &= set(range(g_lo * WINDOW, (g_hi + 1) * WINDOW))
    return tokens


@pytest.mark.parametrize("direction", ["pull", "push"])
@pytest.mark.parametrize("mode", list(MODES))
def test_hybrid_prompt_moves_per_group_and_exactly_per_head(mode: str, direction: str) -> None:
    extra = MODES[mode]
    d = Direction(direction)
    p = _worker("kv_producer", direction, extra, _caches(fill=True))
    producer_id = _engine_ids[-1]
    c = _worker("kv_consumer", direction, extra, _caches(fill=False))
    try:
        ps, cs = _side(Role.PRODUCER, d, producer_id), _side(Role.CONSUMER, d)
        info = p.handshake_info()
        ps.set_endpoint(info["host"], info["port"], [info["incarnation"]])
        n = 70  # 3 blocks; the window [54, 70) spans blocks 1 and 2
        # vLLM's lists: the sliding group's first block was dropped (null block 0).
        prod_blocks = ([0, 8, 9], [4, 5, 6])
        cons_blocks = ([13, 14], [10, 11, 12])  # unhashed, nulls skipped (vLLM)
        done = FakeRequest(
            "cmpl-y-0-0000000a", {"do_remote_decode": True}, n, n, "FINISHED_STOPPED"
        )
        _, params = ps.request_finished(done, prod_blocks)
        assert params is not None and params["remote_block_ids"] == [[8, 9], [4, 5, 6]]
        req = FakeRequest("cmpl-y-0-0000000b", params, num_prompt_tokens=n)
        got, _ = cs.get_num_new_matched_tokens(req, 0)
        assert got == n  # bounded by the full group, not the sliding one's 2 blocks
        cs.update_state_after_alloc(req, [list(g) for g in cons_blocks], got, 0)
        c.start_step(cs.build_step_plan())
        plan = ps.build_step_plan()
        p.start_step(plan)
        p.after_forward(plan)
        acc = _new_acc()
        _until(lambda: "cmpl-y-0-0000000b" in _results(c, acc)["recving"], "load not done")
        assert not acc["failed"] and not acc["invalid"]
        for j, (src, dst) in enumerate(zip(p.tensors, c.tensors)):
            for g in range(2):
                first = 1 if GROUPS[g].kind is GroupKind.SLIDING else 0
                for pos in range(first, 3):
                    pb = prod_blocks[g][pos]
                    cb = cons_blocks[g][pos - first]
                    sent = _sent_tokens(mode, g, pos, n)
                    for h in range(HEADS):
                        for part in (0, 1):
                            for tok in range(pos * BS, (pos + 1) * BS):
                                a = _tokens(dst, cb, h, part, tok - pos * BS, tok - pos * BS + 1)
                                b = _tokens(src, pb, h, part, tok - pos * BS, tok - pos * BS + 1)
                                where = f"tensor {j} group {g} block {pos} head {h} token {tok}"
                                if tok in sent:
                                    assert torch.equal(a, b), where
                                else:
                                    assert not a.any(), f"{where}: not for this mode, but sent"
        stats = c.interval_stats()
        assert stats is not None
        assert stats["bytes"] == _plan_bytes(extra, n), stats
    finally:
        c.close()
        p.close()


def _plan_bytes(extra: dict[str, Any], n: int) -> int:
    options = _options(extra)
    caches = _caches(fill=False)
    layout = describe_kv_caches(
        caches,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="LBHNC",
        groups=GROUPS,
        layer_groups=LAYER_GROUPS,
        token_major_groups=token_major_groups(GROUPS, BS, options),
    )
    table = DescriptorTable.build(layout, options)
    blocks = [[13, 14], [10, 11, 12]]
    return build_plan(table, table, blocks, blocks, n).nbytes


def test_head_major_caches_split_per_head_only_where_blocks_are_cut() -> None:
    caches = _caches(fill=False)
    whole = describe_kv_caches(
        caches,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="LBHNC",
        groups=GROUPS,
        layer_groups=LAYER_GROUPS,
    )
    # One region per layer (two layers per tensor, one per group): whole blocks only.
    assert whole.kv_layout == "HND" and whole.num_regions == 4
    assert [r.group for r in whole.regions] == [0, 1, 0, 1]
    assert whole.regions[0].base == whole.regions[1].base  # the groups share a tensor
    swa = describe_kv_caches(
        caches,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="LBHNC",
        groups=GROUPS,
        layer_groups=LAYER_GROUPS,
        token_major_groups=token_major_groups(GROUPS, BS, _options(MODES["swa"])),
    )
    # Sliding layers: per head, one region per K element (K is element-major) and one
    # for V; full layers stay whole.
    per_head = HEAD + 1
    assert swa.kv_layout == "NHD" and swa.num_regions == 2 * HEADS * per_head + 2
    sliding = [r for r in swa.regions if r.group == 0]
    assert [(r.layer, r.head, r.part, r.lane) for r in sliding[: per_head + 1]] == [
        *((0, 0, KVPart.K, e) for e in range(HEAD)),
        (0, 0, KVPart.V, 0),
        (0, 1, KVPart.K, 0),
    ]
    elt = 2  # bfloat16
    block = HEADS * 2 * BS * HEAD * elt  # bytes of one block of one layer
    assert {r.stride for r in sliding} == {block}
    k_lane, v_head = sliding[0], sliding[HEAD]
    assert k_lane.block_len == BS * elt and v_head.block_len == BS * HEAD * elt
    offsets = [r.base - sliding[0].base for r in sliding[: per_head + 1]]
    assert offsets == [e * BS * elt for e in range(HEAD)] + [BS * HEAD * elt, 2 * BS * HEAD * elt]
    assert token_major_groups(GROUPS, BS, _options(MODES["chunk"])) == {0, 1}
    assert token_major_groups(GROUPS, BS, _options(MODES["whole"])) == frozenset()


def test_a_mode_the_layout_cannot_cut_fails_when_the_cache_is_registered() -> None:
    """The table is built at register_kv_caches (start-up), not at the first step."""
    with pytest.raises(ConfigError, match="swa_window_mode=True: group 0: block_size 32"):
        WorkerSide.from_kv_caches(
            parse_kv_transfer_config(
                {
                    "kv_connector": "RblnNixlPullConnector",
                    "kv_role": "kv_consumer",
                    "kv_buffer_device": "rbln",
                    "kv_connector_extra_config": {"swa_window_mode": True},
                }
            ),
            _caches(fill=False),
            agent_factory=lambda layout, tensors: pytest.fail("must fail before the Agent"),
            block_size=BS,
            num_blocks=NUM_BLOCKS,
            kv_layout="LBHNC",
            groups=(Group(kind=GroupKind.SLIDING, window=64), Group(kind=GroupKind.FULL)),
            layer_groups=LAYER_GROUPS,
            plan_options=_options(MODES["swa"]),
        )


def test_remote_lists_pair_by_block_index() -> None:
    params = {
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[8, 9], [4, 5, 6]],
        "remote_num_tokens": 70,
    }
    ticket = remote_ticket(
        params,
        tp_rank=0,
        transfer_id="t",
        local_blocks=((14,), (11, 12)),  # one local hit in the full group
        skip_blocks=1,
        num_tokens=70,
        block_size=BS,
    )
    assert ticket.block_ids == ((9,), (5, 6))
    # The producer no longer holds a block this load needs (its window moved on).
    with pytest.raises(ConfigError, match=r"\(group 0\): the ticket of 't' holds blocks 1\.\.2"):
        remote_ticket(
            params,
            tp_rank=0,
            transfer_id="t",
            local_blocks=((13, 14, 15), (10, 11, 12)),
            num_tokens=70,
            block_size=BS,
        )


def test_window_blocks_keep_what_the_last_token_attends() -> None:
    s = _side(Role.PRODUCER, Direction.PULL)
    # 70 tokens: the last token attends from 54 on -> the sliding group from block 1.
    assert s.window_blocks(([0, 8, 9], [4, 5, 6]), 70) == ((8, 9), (4, 5, 6))
    # 64 tokens: from 48 -> block 1 on; the full group ends at block 2 (2 blocks).
    assert s.window_blocks(([0, 8], [4, 5]), 64) == ((8,), (4, 5))
    # 48 tokens: from 32 (block 1); 47 tokens: from 31, still in block 0.
    assert s.window_blocks(([0, 8], [4, 5]), 48) == ((8,), (4, 5))
    assert s.window_blocks(([7, 8], [4, 5]), 47) == ((7, 8), (4, 5))
    assert s.window_blocks(([3], [4]), 11) == ((3,), (4,))
    assert s.full_group == 1


def test_decode_leaves_the_last_token_when_its_window_starts_on_a_block() -> None:
    """47 tokens, window 16: vLLM's sliding group allocated for 47 tokens skips block 0
    (tokens < 32) but recomputing token 46 attends token 31: load 46 tokens instead."""
    s = _side(Role.CONSUMER, Direction.PULL)
    for n, claimed in ((47, 46), (48, 48), (70, 70), (79, 78)):
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_block_ids": [[8, 9, 10][: -(-n // BS)], [4, 5, 6][: -(-n // BS)]],
            "remote_num_tokens": n,
        }
        req = FakeRequest(f"d-{n}", params, num_prompt_tokens=n)
        assert s.get_num_new_matched_tokens(req, 0) == (claimed, True), n


@pytest.mark.e2e
def test_the_cpu_cache_order_is_probed_with_vllms_own_write() -> None:
    """vLLM's "vec" CPU attention writes K element-major and V token-major (the order
    describe_kv_caches assumes by default and the tests above check bytes in)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvxfer.adapters.vllm.cpu_cache import probe_interior
    from kvxfer.adapters.vllm.worker import CPU_VEC_INTERIOR

    for head_size in (32, 64):
        got = probe_interior(
            num_kv_heads=2,
            block_size=BS,
            head_size=head_size,
            dtype=torch.bfloat16,
            kv_cache_dtype="auto",
        )
        if _get_attn_isa(torch.bfloat16, BS, head_size, "auto") == "vec":
            assert got == CPU_VEC_INTERIOR
        else:  # AMX and others pack K otherwise: recognised or refused, never guessed
            assert got is None or got == CPU_VEC_INTERIOR


def test_a_failed_deferred_registration_stops_the_engine() -> None:
    """Device-to-device registers at the first real step; if the backend refuses the
    memory then, the step raises (vLLM's engine core stops) instead of serving on
    unregistered."""
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.backend import BackendOptions
    from kvxfer.core.compat import Fingerprint
    from kvxfer.errors import RegistrationError
    from kvxfer.testing.fake_backend import FakeBackend

    class Refusing(FakeBackend):
        def register(self, layout: Any) -> Any:
            raise RegistrationError("the device refused 4 regions")

    cfg = parse_kv_transfer_config(
        {
            "kv_connector": "RblnNixlPullConnector",
            "kv_role": "kv_consumer",
            "kv_buffer_device": "rbln",
        }
    )

    def factory(layout: Any, tensors: Any) -> Agent:
        return Agent(
            AgentConfig(
                engine_id=f"refusing-{next(_ids)}",
                fingerprint=Fingerprint(
                    model="m",
                    dtype="bfloat16",
                    kv_cache_dtype="bfloat16",
                    attention_backend="CPU_ATTN",
                    direction=cfg.direction,
                ),
                role=cfg.role,
                direction=cfg.direction,
            ),
            backend=Refusing(BackendOptions(agent_name="refusing")),
        )

    worker = WorkerSide.from_kv_caches(
        cfg,
        _caches(fill=False),
        agent_factory=factory,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="LBHNC",
        groups=GROUPS,
        layer_groups=LAYER_GROUPS,
        defer_registration=True,
    )
    try:
        with pytest.raises(RegistrationError, match="deferred KV registration failed: the dev"):
            worker.start_step(
                SchedulerSide(
                    engine_id="x", role=Role.CONSUMER, direction=Direction.PULL, block_size=BS
                ).build_step_plan()
            )
    finally:
        worker.close()


def test_host_bounce_stages_the_blocks_the_hold_will_name() -> None:
    """Pull over host bounce stages a prompt after its last forward; with a sliding
    group the staged lists are the window-cut ones the hold names a step later (so the
    hold does not copy again), never the null blocks vLLM lists for dropped blocks."""
    s = SchedulerSide(
        engine_id="p",
        role=Role.PRODUCER,
        direction=Direction.PULL,
        block_size=BS,
        stage_early=True,
        windows=tuple(g.window for g in GROUPS),
    )
    req = FakeRequest("p-1", {"do_remote_decode": True}, 70, 64, "RUNNING")
    s.on_new_request(req)
    plan = s.build_step_plan({"p-1": 6}, lambda rid: ([0, 8, 9], [4, 5, 6]))
    (stage,) = plan.stages
    assert stage.block_ids == ((8, 9), (4, 5, 6))
    done = FakeRequest("p-1", {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED")
    s.set_endpoint("127.0.0.1", 5600, [1])
    _, params = s.request_finished(done, ([0, 8, 9], [4, 5, 6]))
    (hold,) = s.build_step_plan().holds
    assert hold.block_ids == stage.block_ids
    assert params is not None and params["remote_block_ids"] == [[8, 9], [4, 5, 6]]


def test_a_failed_load_of_a_hybrid_model_is_reported_by_request_id_only() -> None:
    """vLLM refuses block-level load errors with more than one KV cache group (its
    ``_handle_invalid_blocks`` raises, which would stop the engine core): a hybrid
    model's failed load is reported through ``failed_recving`` alone."""
    c = _worker("kv_consumer", "pull", {}, _caches(fill=False))
    try:
        bad = LoadSpec(
            request_id="d-h",
            transfer_id="t",
            remote_params={"remote_engine_id": "x"},  # no address: cannot even start
            local_blocks=((1, 2), (3, 4)),
            skip_blocks=0,
            num_tokens=40,
        )
        c.start_step(StepPlan(loads=[bad]))
        _, recving, failed = c.transfer_results()
        assert recving == failed == {"d-h"}
        assert c.block_ids_with_load_errors() == set()
    finally:
        c.close()
