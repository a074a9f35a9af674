"""The vLLM adapter's pieces without a running engine.

* the scheduler state machine (pure Python, plain request objects);
* the worker side on real kvxfer Agents over the in-process ``fake`` backend, with
  KV caches shaped as vLLM 0.32 allocates them on CPU (torch tensors): pull, push with
  local prefix hits, a release before the transfer, a producer that vanished;
* (marked ``e2e``: vLLM imported, no server) the plugin's idempotent registration,
  loading by ``kv_connector_module_path``, start-up refusals and the stats class.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch  # a required dependency (scripts/setup_env.sh), never skipped

from kvxfer.adapters.vllm.kv_transfer_config import parse_kv_transfer_config
from kvxfer.adapters.vllm.params import remote_ticket
from kvxfer.adapters.vllm.scheduler import (
    LoadSpec,
    SchedulerSide,
    StepPlan,
    base_request_id,
    is_remote_prefill,
)
from kvxfer.adapters.vllm.startup import (
    check_model_support,
    check_parallelism,
    data_plane_rails,
    kv_groups,
    positive_seconds,
    push_post,
    warm_up_descriptors,
)
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.agent import PushPost
from kvxfer.agent_config import DEFAULT_WARM_UP_DESCRIPTORS
from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVPart
from kvxfer.errors import ConfigError, KvxferError, RailError
from kvxfer.testing.fake_backend import Faults
from kvxfer.types import Direction, Role
from tests.faultkit import record_posts
from tests.railfakes import FakeNic, build_sysfs

BS = 32


@dataclasses.dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int = 100
    num_computed_tokens: int = 0
    status: str = "WAITING"


def _ticket(blocks: list[int], tokens: int = 100) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "cmpl-x-0-abcdef12",
        "remote_block_ids": [blocks],
        "remote_num_tokens": tokens,
        "tp_size": 1,
    }


def _side(
    role: Role, direction: Direction = Direction.PULL, engine_id: str = "", **kw: Any
) -> SchedulerSide:
    return SchedulerSide(
        engine_id=engine_id or f"{role.value}-0",
        role=role,
        direction=direction,
        block_size=BS,
        **kw,
    )


# --- scheduler side ---------------------------------------------------------------------


def test_base_request_id_strips_only_vllms_random_suffix() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0-xyz12345") == "cmpl-abc-0-xyz12345"


def test_consumer_claims_once_and_loads_into_unhashed_blocks() -> None:
    s = _side(Role.CONSUMER)
    req = FakeRequest("d-1", _ticket([7, 8, 9, 10]))
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)  # side-effect free
    s.update_state_after_alloc(req, [[1, 2, 3, 4]], 100, 0)
    plan = s.build_step_plan()
    (load,) = plan.loads
    assert load.local_blocks == ((1, 2, 3, 4),) and load.skip_blocks == 0
    assert load.num_tokens == 100 and load.transfer_id == "cmpl-x-0-abcdef12"
    assert s.build_step_plan().empty()
    # vLLM asks again after the load and calls again with 0 external tokens.
    assert s.get_num_new_matched_tokens(req, 99) == (0, False)
    s.update_state_after_alloc(req, [[4]], 0, 99)
    assert s.build_step_plan().empty()


def test_consumer_claim_is_bounded_by_what_the_producer_holds() -> None:
    s = _side(Role.CONSUMER)
    # The producer computed 70 tokens in 3 blocks; the decode prompt is longer.
    req = FakeRequest("d-1", _ticket([7, 8, 9], tokens=70), num_prompt_tokens=100)
    assert s.get_num_new_matched_tokens(req, 0) == (70, True)
    # Two blocks cover 64 tokens only.
    short = FakeRequest("d-2", _ticket([7, 8], tokens=70), num_prompt_tokens=100)
    assert s.get_num_new_matched_tokens(short, 0) == (64, True)


def test_consumer_local_prefix_hit_skips_leading_remote_blocks() -> None:
    s = _side(Role.CONSUMER)
    req = FakeRequest("d-2", _ticket([7, 8, 9, 10]))
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (100 - 2 * BS, True)
    s.update_state_after_alloc(req, [[3, 4]], 100 - 2 * BS, 2 * BS)
    (load,) = s.build_step_plan().loads
    assert load.skip_blocks == 2 and load.local_blocks == ((3, 4),)
    assert load.num_tokens == 100  # the request's tokens, where the blocks end


def test_consumer_releases_the_producer_when_nothing_is_pulled() -> None:
    s = _side(Role.CONSUMER)
    aborted = FakeRequest("d-3", _ticket([1, 2, 3, 4]))
    assert s.request_finished(aborted, [[]]) == (False, None)
    assert s.request_finished(aborted, [[]]) == (False, None)  # reported twice: one release
    full_hit = FakeRequest("d-4", _ticket([1, 2, 3, 4]))
    s.update_state_after_alloc(full_hit, [[5]], 0, 96)
    plan = s.build_step_plan()
    assert [(r.request_id, r.transfer_id) for r in plan.releases] == [
        ("d-3", "cmpl-x-0-abcdef12"),
        ("d-4", "cmpl-x-0-abcdef12"),
    ]
    assert not plan.loads
    # A request whose load started is not released when it finishes (the load ends it).
    loading = FakeRequest("d-5", _ticket([1, 2, 3, 4]))
    s.update_state_after_alloc(loading, [[6, 7, 8, 9]], 100, 0)
    s.build_step_plan()
    assert s.request_finished(loading, [[6, 7, 8, 9]]) == (False, None)
    assert s.build_step_plan().empty()


def test_consumer_ignores_incomplete_params_and_producer_requests() -> None:
    s = _side(Role.CONSUMER)
    partial = _ticket([1])
    del partial["remote_host"]
    assert not is_remote_prefill(partial, Direction.PULL)
    assert s.get_num_new_matched_tokens(FakeRequest("d-5", partial), 0) == (0, False)
    p_req = FakeRequest("d-6", {"do_remote_decode": True})
    assert s.get_num_new_matched_tokens(p_req, 0) == (0, False)
    assert s.request_finished(p_req, [[1]]) == (False, None)


def test_push_consumer_needs_only_the_producers_address_and_matches_on_base_ids() -> None:
    s = _side(Role.CONSUMER, Direction.PUSH)
    address = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "h",
        "remote_port": 1,
    }
    assert is_remote_prefill(address, Direction.PUSH)
    assert not is_remote_prefill(address, Direction.PULL)
    req = FakeRequest("cmpl-r7-0-0a0b0c0d", dict(address), num_prompt_tokens=40)
    assert s.get_num_new_matched_tokens(req, 0) == (40, True)
    s.update_state_after_alloc(req, [[5, 6]], 40, 0)
    (load,) = s.build_step_plan().loads
    assert load.transfer_id == "cmpl-r7-0"  # decode's own id, suffix stripped
    # With the producer's ticket, its request id (stripped) is the match key.
    seq = FakeRequest("cmpl-r8-0-11111111", _ticket([1, 2]))
    assert s.transfer_id(seq) == "cmpl-x-0"


def test_producer_holds_normally_finished_requests_only() -> None:
    s = _side(Role.PRODUCER)
    s.set_endpoint("10.0.0.1", 5601, [42, 43])
    done = FakeRequest("p-1", {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED")
    s.on_new_request(done)
    delay, params = s.request_finished(done, [[4, 5, 6]])
    assert delay is True and params is not None
    # Upstream's keys, so upstream's toy proxy and llm-d forward them unchanged.
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[4, 5, 6]]
    assert params["remote_host"] == "10.0.0.1" and params["remote_port"] == 5601
    assert params["remote_engine_id"] == "kv_producer-0"
    assert params["remote_request_id"] == "p-1" and params["remote_num_tokens"] == 70
    assert params["tp_size"] == 1 and params["transfer_mode"] == "pull"
    # 64-bit values as hex strings: a float64 router (Go, JavaScript) keeps them exact
    assert params["remote_incarnations"] == [f"{42:016x}", f"{43:016x}"]
    assert params["remote_incarnation"] == f"{42:016x}" and params["lease_expiry"] > time.time()
    aborted = FakeRequest("p-2", {"do_remote_decode": True}, 70, 10, "FINISHED_ABORTED")
    assert s.request_finished(aborted, [[7]]) == (False, None)
    (hold,) = s.build_step_plan().holds
    assert (hold.request_id, hold.lease_id, hold.block_ids) == ("p-1", "p-1", ((4, 5, 6),))
    assert not s.has_pending_push_work()  # pull
    assert s.num_held == 1
    s.update_connector_output({"p-1"}, set())
    assert s.num_held == 0


def test_push_producer_holds_under_the_routers_capability_or_one_unpinned_token() -> None:
    """Push: the router's token (also in decode's params) pins the hold; without one
    the scheduler mints one that every rank's hold shares, unpinned (the first
    registration wins; a decode rank's Release of an unread replica shows it); a
    malformed one holds nothing."""
    s = _side(Role.PRODUCER, Direction.PUSH)
    s.set_endpoint("10.0.0.1", 5601, [42])
    token = "0123456789abcdef" * 2
    cases = {
        "cmpl-r-0-abcdef12": {"do_remote_decode": True, "kvxfer_capability": token},
        "cmpl-n-0-abcdef12": {"do_remote_decode": True},
        "cmpl-x-0-abcdef12": {"do_remote_decode": True, "kvxfer_capability": "NOT HEX"},
    }
    out = {}
    for rid, kv in cases.items():
        req = FakeRequest(rid, kv, 70, 70, "FINISHED_LENGTH_CAPPED")
        s.on_new_request(req)
        out[rid] = s.request_finished(req, [[4, 5, 6]])
    holds = {h.request_id: h for h in s.build_step_plan().holds}
    assert holds["cmpl-r-0-abcdef12"].capability == token
    assert holds["cmpl-r-0-abcdef12"].pinned
    assert out["cmpl-r-0-abcdef12"][1]["kvxfer_capability"] == token
    minted = holds["cmpl-n-0-abcdef12"]
    assert len(minted.capability) == 32 and not minted.pinned
    assert out["cmpl-n-0-abcdef12"][1]["kvxfer_capability"] == minted.capability
    assert out["cmpl-x-0-abcdef12"] == (False, None) and "cmpl-x-0-abcdef12" not in holds


def test_producer_mints_capability_and_guard_slots_reused_only_once_freed() -> None:
    """The ticket leaves the scheduler before the worker's hold: the scheduler mints
    the capability and guard word, and never gives a held request's slot to another."""
    s = _side(Role.PRODUCER)
    s.set_endpoint("10.0.0.1", 5601, [42])
    params = {}
    for rid in ("a", "b"):
        req = FakeRequest(rid, {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED")
        s.on_new_request(req)
        _, params[rid] = s.request_finished(req, [[4, 5, 6]])
    a, b = params["a"], params["b"]
    assert (a["kvxfer_guard_slot"], b["kvxfer_guard_slot"]) == (0, 1)
    assert a["kvxfer_capability"] != b["kvxfer_capability"] and len(a["kvxfer_capability"]) == 32
    gen_a, gen_b = int(a["kvxfer_generation"], 16), int(b["kvxfer_generation"], 16)
    assert re.fullmatch(r"[0-9a-f]{16}", a["kvxfer_generation"])  # 56 bits, as hex
    assert gen_a > 0 and gen_a != gen_b
    holds = {h.request_id: h for h in s.build_step_plan().holds}
    assert (holds["a"].guard_slot, holds["a"].generation) == (0, gen_a)
    assert holds["a"].capability == a["kvxfer_capability"]
    s.update_connector_output({"a"}, set())  # every rank freed "a": its slot comes back
    c = FakeRequest("c", {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED")
    s.on_new_request(c)
    _, pc = s.request_finished(c, [[7]])
    assert pc is not None and pc["kvxfer_guard_slot"] == 0


def test_host_bounce_producer_stages_a_prompt_after_its_last_forward() -> None:
    s = _side(Role.PRODUCER, stage_early=True)
    req = FakeRequest("p-1", {"do_remote_decode": True}, num_prompt_tokens=70)
    s.on_new_request(req)
    blocks = {"p-1": [[4, 5, 6, 9]]}  # one block more than the prompt fills
    assert not s.build_step_plan({"p-1": 64}, blocks.__getitem__).stages  # chunked prefill
    req.num_computed_tokens = 64
    (stage,) = s.build_step_plan({"p-1": 6}, blocks.__getitem__).stages
    assert stage.block_ids == ((4, 5, 6),)
    req.num_computed_tokens = 70
    assert not s.build_step_plan({"p-1": 1}, blocks.__getitem__).stages  # once
    push = _side(Role.PRODUCER, Direction.PUSH, stage_early=True)
    push.on_new_request(FakeRequest("p-2", {"do_remote_decode": True}, 70))
    assert not push.build_step_plan({"p-2": 70}, blocks.get).stages  # push stages on hold


def test_push_stream_producer_streams_closed_blocks_until_the_last_step() -> None:
    s = _side(Role.PRODUCER, Direction.PUSH, push_stream=True)
    req = FakeRequest("cmpl-s-0-01234567", {"do_remote_decode": True}, num_prompt_tokens=150)
    s.on_new_request(req)
    blocks = {req.request_id: [[10, 11, 12, 13, 14]]}
    (first,) = s.build_step_plan({req.request_id: 64}, blocks.__getitem__).streams
    assert (first.lease_id, first.block_ids, first.num_tokens) == ("cmpl-s-0", ((10, 11),), 64)
    req.num_computed_tokens = 64
    (second,) = s.build_step_plan({req.request_id: 64}, blocks.__getitem__).streams
    assert second.block_ids == ((10, 11, 12, 13),) and second.num_tokens == 128
    req.num_computed_tokens = 128
    # The step that completes the prompt streams nothing: the hold writes the rest.
    assert not s.build_step_plan({req.request_id: 22}, blocks.__getitem__).streams
    pull = _side(Role.PRODUCER, Direction.PULL, push_stream=True)
    pull.on_new_request(FakeRequest("p", {"do_remote_decode": True}, num_prompt_tokens=150))
    assert not pull.build_step_plan({"p": 64}, blocks.get).streams


def test_push_producer_holds_under_the_base_id_and_keeps_stepping_until_sent() -> None:
    s = _side(Role.PRODUCER, Direction.PUSH)
    done = FakeRequest("cmpl-q-0-89abcdef", {"do_remote_decode": True}, 70, 70, "FINISHED_STOPPED")
    _, params = s.request_finished(done, [[4, 5, 6]])
    assert params is not None and params["transfer_mode"] == "push"
    (hold,) = s.build_step_plan().holds
    assert hold.lease_id == "cmpl-q-0" and hold.request_id == "cmpl-q-0-89abcdef"
    assert s.has_pending_push_work()
    s.update_connector_output({"cmpl-q-0-89abcdef"}, set())
    assert not s.has_pending_push_work()


def test_remote_ticket_per_rank_port_incarnation_and_block_cut() -> None:
    params = {**_ticket([7, 8, 9, 10, 11]), "remote_incarnations": [5, 6]}
    load = LoadSpec(
        request_id="d",
        transfer_id="t",
        remote_params=params,
        local_blocks=((1, 2),),
        skip_blocks=2,
        num_tokens=100,
    )
    t0, t1 = (
        remote_ticket(
            params,
            tp_rank=rank,
            transfer_id=load.transfer_id,
            local_blocks=load.local_blocks,
            skip_blocks=load.skip_blocks,
            num_tokens=load.num_tokens,
        )
        for rank in (0, 1)
    )
    assert (t0.port, t0.incarnation, t1.port, t1.incarnation) == (5600, 5, 5601, 6)
    # Skip the local hits, and stop where the local blocks stop (the producer decoded on).
    assert t0.block_ids == ((9, 10),) and t0.request_id == "t"


# --- worker side on real Agents (fake backend, vLLM's CPU cache shape) -----------------

NUM_BLOCKS, HEADS, HEAD = 16, 2, 8
_ids = itertools.count()


def _caches(fill: bool) -> dict[str, Any]:
    """Two layers as vLLM 0.32 allocates them on CPU: views of one buffer, each
    ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``."""
    per_layer = NUM_BLOCKS * HEADS * BS * 2 * HEAD
    gen = torch.Generator().manual_seed(3)
    buf = torch.zeros(2 * per_layer, dtype=torch.bfloat16)
    if fill:
        buf.copy_(torch.randn(2 * per_layer, generator=gen))
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
            NUM_BLOCKS, HEADS, BS, 2 * HEAD
        )
        for i in range(2)
    }


def _worker(
    role: str,
    direction: str,
    caches: dict[str, Any],
    *,
    stages: bool = False,
    timeout_s: float = 3.0,
) -> WorkerSide:
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.backend import BackendOptions
    from kvxfer.core.compat import Fingerprint
    from kvxfer.testing.fake_backend import FakeBackend

    connector = "RblnNixlPushConnector" if direction == "push" else "RblnNixlPullConnector"
    cfg = parse_kv_transfer_config(
        {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu"}
    )
    engine_id = f"{role}-{next(_ids)}"
    fingerprint = Fingerprint(
        model="tiny",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="CPU_ATTN",
        direction=cfg.direction,
    )

    def factory(layout: Any, tensors: Any) -> Agent:
        return Agent(
            AgentConfig(
                engine_id=engine_id,
                fingerprint=fingerprint,
                role=cfg.role,
                direction=cfg.direction,
                transfer_timeout_s=timeout_s,
                handshake_timeout_s=0.5,
                handshake_retries=0,
            ),
            backend=FakeBackend(
                BackendOptions(agent_name=f"{engine_id}#agent"), stages_through_host=stages
            ),
        )

    return WorkerSide.from_kv_caches(
        cfg,
        caches,
        agent_factory=factory,
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="LBHNC",
    )


def _pair(
    direction: str, producer_timeout_s: float = 3.0
) -> tuple[WorkerSide, WorkerSide, SchedulerSide, SchedulerSide]:
    p = _worker("kv_producer", direction, _caches(fill=True), timeout_s=producer_timeout_s)
    c = _worker("kv_consumer", direction, _caches(fill=False))
    d = Direction(direction)
    # The scheduler sides name their workers' engines (a pull's handshake checks it).
    ps = _side(Role.PRODUCER, d, engine_id=p.agent.config.engine_id)
    cs = _side(Role.CONSUMER, d, engine_id=c.agent.config.engine_id)
    info = p.handshake_info()
    ps.set_endpoint(info["host"], info["port"], [info["incarnation"]])
    return p, c, ps, cs


def _blocks(tensors: list[Any], ids: list[int]) -> list[Any]:
    return [t[ids].clone() for t in tensors]


def _until(pred: Any, what: str, timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _drive(p: WorkerSide, c: WorkerSide, ps: SchedulerSide, cs: SchedulerSide) -> None:
    c.start_step(cs.build_step_plan())
    plan = ps.build_step_plan()
    p.start_step(plan)
    p.after_forward(plan)


def _results(w: WorkerSide, acc: dict[str, set[str]]) -> dict[str, set[str]]:
    sending, recving, failed = w.transfer_results()
    acc["sending"] |= sending
    acc["recving"] |= recving
    acc["failed"] |= failed
    acc["invalid"] |= {str(b) for b in w.block_ids_with_load_errors()}
    return acc


def _new_acc() -> dict[str, set[str]]:
    return {"sending": set(), "recving": set(), "failed": set(), "invalid": set()}


@pytest.mark.parametrize("direction", ["pull", "push"])
def test_worker_moves_a_prompt_exactly_and_frees_the_producer(direction: str) -> None:
    p, c, ps, cs = _pair(direction)
    try:
        # Producer: a 70-token prompt in blocks 4, 5, 6 finished; decode prompt identical.
        prod_req = FakeRequest(
            "cmpl-z-0-00000001", {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED"
        )
        _, params = ps.request_finished(prod_req, [[4, 5, 6]])
        assert params is not None
        cons_req = FakeRequest("cmpl-z-0-00000002", params, num_prompt_tokens=70)
        n, is_async = cs.get_num_new_matched_tokens(cons_req, 0)
        assert (n, is_async) == (70, True)
        cs.update_state_after_alloc(cons_req, [[9, 10, 11]], n, 0)
        _drive(p, c, ps, cs)
        cacc, pacc = _new_acc(), _new_acc()
        _until(lambda: "cmpl-z-0-00000002" in _results(c, cacc)["recving"], "load not done")
        assert not cacc["failed"] and not cacc["invalid"]
        for got, want in zip(_blocks(c.tensors, [9, 10, 11]), _blocks(p.tensors, [4, 5, 6])):
            assert torch.equal(got, want)
        _until(lambda: "cmpl-z-0-00000001" in _results(p, pacc)["sending"], "producer not freed")
        stats = c.interval_stats()
        assert stats is not None and stats["num_transfers"] == 1 and stats["bytes"] > 0
        assert len(stats["transfer_s"]) == 1
    finally:
        c.close()
        p.close()


def test_push_with_local_prefix_hits_writes_only_the_missing_blocks() -> None:
    p, c, ps, cs = _pair("push")
    try:
        prod_req = FakeRequest(
            "cmpl-h-0-00000001", {"do_remote_decode": True}, 100, 100, "FINISHED_STOPPED"
        )
        _, params = ps.request_finished(prod_req, [[1, 2, 3, 4]])
        assert params is not None
        cons_req = FakeRequest("cmpl-h-0-00000002", params, num_prompt_tokens=100)
        # Decode already has the first two blocks (a local prefix hit).
        n, _ = cs.get_num_new_matched_tokens(cons_req, 2 * BS)
        cs.update_state_after_alloc(cons_req, [[12, 13]], n, 2 * BS)
        _drive(p, c, ps, cs)
        acc = _new_acc()
        _until(lambda: "cmpl-h-0-00000002" in _results(c, acc)["recving"], "push not done")
        assert not acc["failed"]
        for got, want in zip(_blocks(c.tensors, [12, 13]), _blocks(p.tensors, [3, 4])):
            assert torch.equal(got, want)
        assert all(not t[[0, 1, 2]].any() for t in c.tensors)
    finally:
        c.close()
        p.close()


def test_release_before_the_transfer_frees_the_producer_at_once() -> None:
    p, c, ps, cs = _pair("pull")
    try:
        prod_req = FakeRequest("p-9", {"do_remote_decode": True}, 40, 40, "FINISHED_STOPPED")
        _, params = ps.request_finished(prod_req, [[2, 3]])
        assert params is not None
        aborted = FakeRequest("d-9", params, num_prompt_tokens=40)
        assert cs.request_finished(aborted, [[]]) == (False, None)  # aborted while waiting
        _drive(p, c, ps, cs)
        acc = _new_acc()
        t0 = time.monotonic()
        _until(lambda: "p-9" in _results(p, acc)["sending"], "producer not released")
        assert time.monotonic() - t0 < 2.0  # not the 30 s lease
        assert not p.agent.holding()
    finally:
        c.close()
        p.close()


def test_a_pull_request_waiting_past_the_lease_with_no_steps_is_kept_alive() -> None:
    """Decode's step loop stalls (one long step) while a P/D request waits: the
    agent's keep-alive renews the hold anyway, and the load reads it exactly."""
    lease = 1.5
    p = _worker("kv_producer", "pull", _caches(fill=True))
    c = _worker("kv_consumer", "pull", _caches(fill=False))
    ps = _side(Role.PRODUCER, engine_id=p.agent.config.engine_id, lease_s=lease)
    cs = _side(Role.CONSUMER, engine_id=c.agent.config.engine_id)
    info = p.handshake_info()
    ps.set_endpoint(info["host"], info["port"], [info["incarnation"]])
    try:
        prod_req = FakeRequest("p-k", {"do_remote_decode": True}, 40, 40, "FINISHED_STOPPED")
        _, params = ps.request_finished(prod_req, [[2, 3]])
        assert params is not None
        cons_req = FakeRequest("d-k", params, num_prompt_tokens=40)
        cs.on_new_request(cons_req)
        _drive(p, c, ps, cs)  # the producer holds; decode's plan starts the keep-alive
        time.sleep(2.5 * lease)  # no step on either side meanwhile
        assert p.agent.holding() == ["p-k"]
        n, _ = cs.get_num_new_matched_tokens(cons_req, 0)
        cs.update_state_after_alloc(cons_req, [[9, 10]], n, 0)
        _drive(p, c, ps, cs)
        acc = _new_acc()
        _until(lambda: "d-k" in _results(c, acc)["recving"], "load not done")
        assert not acc["failed"] and not acc["invalid"]
        for got, want in zip(_blocks(c.tensors, [9, 10]), _blocks(p.tensors, [2, 3])):
            assert torch.equal(got, want)
        stats = c.agent.stats()
        assert stats.renewals_sent >= 3 and stats.renewals_lapsed == 0
        assert p.agent.stats().leases_expired == 0
    finally:
        c.close()
        p.close()


def test_a_load_from_a_vanished_producer_fails_with_its_blocks_invalid() -> None:
    p, c, ps, cs = _pair("pull")
    try:
        prod_req = FakeRequest("p-7", {"do_remote_decode": True}, 40, 40, "FINISHED_STOPPED")
        _, params = ps.request_finished(prod_req, [[2, 3]])
        assert params is not None
        p.start_step(ps.build_step_plan())
        p.close()  # the producer process is gone
        cons_req = FakeRequest("d-7", params, num_prompt_tokens=40)
        cs.update_state_after_alloc(cons_req, [[6, 7]], 40, 0)
        c.start_step(cs.build_step_plan())
        acc = _new_acc()
        _until(lambda: "d-7" in _results(c, acc)["recving"], "failure not reported", 10)
        # vLLM's contract: the failed request in both sets, its blocks invalid.
        assert acc["failed"] == {"d-7"} and acc["invalid"] == {"6", "7"}
        stats = c.interval_stats()
        assert stats is not None and stats["num_failed"] == 1
    finally:
        c.close()


def _stalled_push(n: str) -> tuple[WorkerSide, WorkerSide, SchedulerSide, dict[str, Any]]:
    """A push pair whose producer's WRITE of ``p-n`` into the consumer's ``d-n`` (blocks
    6, 7) is posted and moves nothing, and cannot be cancelled (as over UCX): the two
    workers, the consumer's scheduler side and the producer's ticket. The producer's
    own deadline is longer than the consumer's 3 s: only the consumer's is under test.
    Returns once the WRITE was posted (the consumer's registration goes from a worker
    thread: on a loaded host it could reach the producer after what the test does
    next, CI run of 03534c4)."""
    p, c, ps, cs = _pair("push", producer_timeout_s=30.0)
    prod_req = FakeRequest(f"p-{n}", {"do_remote_decode": True}, 40, 40, "FINISHED_STOPPED")
    _, params = ps.request_finished(prod_req, [[2, 3]])
    assert params is not None
    p.agent.backend.faults = Faults(stall=True, uncancellable=True)
    posted = record_posts(p.agent.backend)
    cs.update_state_after_alloc(
        FakeRequest(f"d-{n}", params, num_prompt_tokens=40), [[6, 7]], 40, 0
    )
    _drive(p, c, ps, cs)
    _until(lambda: posted, "the producer never posted its write", 10)
    return p, c, cs, params


def test_a_push_that_fails_while_its_write_may_land_fails_now_and_frees_blocks_later() -> None:
    """R-VLLM-7 with R-SAFE-5: a push past its deadline whose producer's WRITE is still
    in flight (the link down: its bytes land when it returns) is reported failed at
    once, without ``finished_recving``: vLLM ends the request and keeps its blocks.
    ``finished_recving`` comes once the producer says its write ended."""
    p, c, _, _ = _stalled_push("5")
    try:
        acc = _new_acc()
        t0 = time.monotonic()
        _until(lambda: "d-5" in _results(c, acc)["failed"], "no failure at the deadline", 10)
        assert time.monotonic() - t0 < 3.0 + 2.0  # transfer_timeout_s, not the write's end
        assert acc["invalid"] == {"6", "7"} and "d-5" not in acc["recving"]
        acc = _new_acc()
        for _ in range(20):  # held: a stalled write may still land
            time.sleep(0.01)
            _results(c, acc)
        assert acc == _new_acc()  # nothing more while the quarantine lasts
        assert c.agent.stats().quarantined == 1
        p.agent.backend.faults = Faults()  # the write ends; the producer says so
        _until(lambda: "d-5" in _results(c, acc)["recving"], "blocks never freed", 10)
        assert acc["invalid"] == set()  # vLLM has them already (the request is over)
        assert c.agent.stats().quarantined == 0
        stats = c.interval_stats()
        assert stats is not None and stats["num_failed"] == 1
    finally:
        c.close()
        p.close()


def test_a_load_its_engine_aborted_is_reported_once_final_not_early() -> None:
    """A release (vLLM ended the request) dooms the load of the same producer request,
    whichever vLLM id it came with; that request is over, so the load is reported
    only once final, failed and in ``finished_recving`` together."""
    p, c, cs, params = _stalled_push("6")
    try:
        # Aborted under another id, before its own load: its release names p-6.
        assert cs.request_finished(FakeRequest("d-6-alias", dict(params)), [[]]) == (False, None)
        c.start_step(cs.build_step_plan())
        acc = _new_acc()
        for _ in range(30):  # doomed, quarantined: the write may still land
            time.sleep(0.01)
            assert not _results(c, acc)["failed"]
        p.agent.backend.faults = Faults()
        _until(lambda: "d-6" in _results(c, acc)["recving"], "abort never final", 10)
        assert acc["failed"] == {"d-6"} and acc["invalid"] == {"6", "7"}
    finally:
        c.close()
        p.close()


def test_a_load_that_cannot_start_is_a_failed_load_not_an_exception() -> None:
    c = _worker("kv_consumer", "pull", _caches(fill=False))
    try:
        bad = LoadSpec(
            request_id="d-1",
            transfer_id="t",
            remote_params={"remote_engine_id": "x"},  # no address: cannot even start
            local_blocks=((1, 2),),
            skip_blocks=0,
            num_tokens=40,
        )
        c.start_step(StepPlan(loads=[bad]))
        _, recving, failed = c.transfer_results()
        assert recving == failed == {"d-1"} and c.block_ids_with_load_errors() == {1, 2}
    finally:
        c.close()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_block_ids", [[1, "2"]]),
        ("remote_block_ids", [[1, 1]]),
        ("remote_block_ids", [True, 2]),
        ("remote_num_tokens", "40"),
        ("remote_port", "5600"),
        # an older producer's integers, which a float64 router (Go, JS) may have rounded
        ("remote_incarnation", 0x13E0F7F3125A8DF8),
        ("kvxfer_generation", 2**55 + 1),
    ],
)
def test_bad_kv_transfer_params_fail_that_request_and_name_the_key(
    key: str, value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The scheduler claims the prompt without raising into vLLM; the worker refuses the
    # load with the key, value and rule, and reports it as a failed load.
    s = _side(Role.CONSUMER)
    req = FakeRequest("d-9", {**_ticket([1, 2], 40), key: value}, num_prompt_tokens=40)
    n, is_async = s.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (40, True)
    s.update_state_after_alloc(req, [[3, 4]], n, 0)
    c = _worker("kv_consumer", "pull", _caches(fill=False))
    try:
        c.start_step(s.build_step_plan())
        _, recving, failed = c.transfer_results()
        assert recving == failed == {"d-9"} and c.block_ids_with_load_errors() == {3, 4}
    finally:
        c.close()
    assert f"kv_transfer_params.{key}=" in caplog.text


def test_a_producer_of_another_tp_size_is_refused_by_name_without_a_tp_identity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A decode whose layout does not split by head (here: no TP identity) cannot read
    a head slice: the load fails at once, naming both TP sizes and what is missing."""
    c = _worker("kv_consumer", "pull", _caches(fill=False))
    try:
        load = LoadSpec(
            request_id="d-2",
            transfer_id="t",
            remote_params={**_ticket([1, 2], 40), "tp_size": 2},
            local_blocks=((3, 4),),
            skip_blocks=0,
            num_tokens=40,
        )
        c.start_step(StepPlan(loads=[load]))
        _, recving, failed = c.transfer_results()
        assert recving == failed == {"d-2"} and c.block_ids_with_load_errors() == {3, 4}
    finally:
        c.close()
    assert "tensor-parallel size 2, this instance 1" in caplog.text
    assert "which KV heads they hold" in caplog.text


# --- start-up checks ---------------------------------------------------------------------


def _cfg(**extra: Any) -> Any:
    return parse_kv_transfer_config(
        {
            "kv_connector": "RblnNixlPullConnector",
            "kv_role": "kv_producer",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": extra,
        }
    )


def test_rails_none_without_rdma_devices_and_r_rail_2_when_none_qualifies(
    tmp_path: Path,
) -> None:
    no_rdma = tmp_path / "empty"
    no_rdma.mkdir()
    assert data_plane_rails(_cfg(), sysfs_root=str(no_rdma), runner=_no_ip, pyverbs=False) == ()
    # One RoCE NIC, but on the wrong NUMA node and with its port down.
    root = build_sysfs(
        tmp_path / "sys", [FakeNic(device="mlx5_0", netdev="eth9", numa=1, state="DOWN")]
    )
    with pytest.raises(RailError, match=r"no usable data-plane RoCE NIC on numa=0"):
        data_plane_rails(_cfg(), sysfs_root=str(root), runner=_no_ip, pyverbs=False, numa_node=0)


def _no_ip(args: Any) -> str:
    return "[]"


@dataclasses.dataclass
class FullAttentionSpec:  # named like vLLM's: kv_groups reads the spec's class name
    pass


@dataclasses.dataclass
class SlidingWindowSpec:
    sliding_window: int


class _MambaType(enum.Enum):  # vLLM's MambaAttentionBackendEnum members, by name
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    SHORT_CONV = "short_conv"
    LINEAR = "linear"
    GDN_ATTN = "gdn"


@dataclasses.dataclass
class MambaSpec:
    mamba_type: _MambaType = _MambaType.MAMBA2
    num_speculative_blocks: int = 0
    # The tiny Mamba2 hybrid of tests/e2e/model.py: conv (3, 320) bf16, SSM (8, 32, 16)
    # float32 (vLLM's CPU build keeps SSM state in float32).
    shapes: tuple[tuple[int, ...], ...] = ((3, 320), (8, 32, 16))
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)


@dataclasses.dataclass
class MLAAttentionSpec:
    pass


@dataclasses.dataclass
class ChunkedLocalAttentionSpec:
    pass


@dataclasses.dataclass
class _KVGroup:
    kv_cache_spec: Any
    layer_names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _KVCacheConfig:
    kv_cache_groups: list[_KVGroup]


def _hybrid(window: int = 16) -> _KVCacheConfig:
    return _KVCacheConfig(
        [
            _KVGroup(FullAttentionSpec(), ["l.1", "l.3"]),
            _KVGroup(SlidingWindowSpec(window), ["l.0", "l.2"]),
        ]
    )


def test_kv_groups_read_full_and_sliding_groups_and_refuse_others() -> None:
    found = kv_groups(_hybrid())
    assert found.windows == (0, 16) and found.hybrid
    assert found.layer_groups == {"l.1": 0, "l.3": 0, "l.0": 1, "l.2": 1}
    assert not kv_groups(_KVCacheConfig([_KVGroup(FullAttentionSpec())])).hybrid
    with pytest.raises(ConfigError, match=r"kv_cache_groups\[1\]='ChunkedLocalAttentionSpec'"):
        kv_groups(
            _KVCacheConfig([_KVGroup(FullAttentionSpec()), _KVGroup(ChunkedLocalAttentionSpec())])
        )


def test_kv_groups_read_mamba2_and_gdn_state_and_mla_and_refuse_other_state() -> None:
    for kind in (_MambaType.MAMBA2, _MambaType.GDN_ATTN):
        found = kv_groups(
            _KVCacheConfig(
                [
                    _KVGroup(MambaSpec(kind, num_speculative_blocks=2), ["l.0"]),
                    _KVGroup(FullAttentionSpec(), ["l.1"]),
                ]
            )
        )
        assert [g.kind for g in found.groups] == [GroupKind.STATE, GroupKind.FULL]
        assert found.has_state and not found.hybrid and found.spec_slots == (2, 0)
        assert found.state_parts == {0: (3 * 320 * 2, 8 * 32 * 16 * 4)}
        assert found.groups[0].conv_layout is ConvLayout.SD  # vLLM's CPU default
    mla = kv_groups(_KVCacheConfig([_KVGroup(MLAAttentionSpec(), ["l.0"])]))
    assert mla.groups == (Group(kind=GroupKind.FULL),)
    for kind in (_MambaType.MAMBA1, _MambaType.SHORT_CONV, _MambaType.LINEAR):
        with pytest.raises(
            ConfigError, match=rf"kv_cache_groups\[0\].mamba_type='{kind.name}': .*Mamba2"
        ):
            kv_groups(_KVCacheConfig([_KVGroup(MambaSpec(kind))]))


def _d2d_cfg(connector: str = "RblnNixlPullConnector", **extra: Any) -> Any:
    return parse_kv_transfer_config(
        {
            "kv_connector": connector,
            "kv_role": "kv_producer",
            "kv_buffer_device": "rbln",
            "kv_connector_extra_config": extra,
        }
    )


def test_model_support_checks_modes_against_the_groups_at_start_up() -> None:
    check_model_support(_cfg(), _hybrid(), 32)
    check_model_support(_d2d_cfg(swa_window_mode=True), _hybrid(16), 32)
    plain = _KVCacheConfig([_KVGroup(FullAttentionSpec())])
    with pytest.raises(ConfigError, match=r"swa_window_mode=True: needs a sliding-window"):
        check_model_support(_d2d_cfg(swa_window_mode=True), plain, 32)
    with pytest.raises(ConfigError, match=r"swa_window_mode=True: block_size 32 is not a mult"):
        check_model_support(_d2d_cfg(swa_window_mode=True), _hybrid(64), 32)
    push = _d2d_cfg("RblnNixlPushConnector", push_stream=True)
    check_model_support(push, plain, 32)
    with pytest.raises(ConfigError, match=r"push_stream=True: not with sliding-window"):
        check_model_support(push, _hybrid(), 32)


@pytest.mark.parametrize("value", [0, -1, True, "30", None])
def test_adapter_keys_are_type_checked(value: Any) -> None:
    cfg = _cfg(transfer_timeout_s=value)
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.transfer_timeout_s"):
        positive_seconds(cfg, "transfer_timeout_s", 30.0)
    assert positive_seconds(_cfg(transfer_timeout_s=2), "transfer_timeout_s", 30.0) == 2.0


def test_warm_up_descriptors_is_read_from_the_extra_config() -> None:
    assert warm_up_descriptors(_cfg()) == DEFAULT_WARM_UP_DESCRIPTORS == 65536
    assert warm_up_descriptors(_cfg(warm_up_descriptors=250_000)) == 250_000
    for bad in (0, -5, 2**20 + 1, True, 1.5, "4096", None):
        with pytest.raises(ConfigError) as err:
            warm_up_descriptors(_cfg(warm_up_descriptors=bad))
        assert str(err.value) == (
            f"kv_connector_extra_config.warm_up_descriptors={bad!r}: "
            "must be an integer from 1 to 1048576"
        )


def test_push_post_is_read_from_the_extra_config() -> None:
    assert push_post(_cfg()) is PushPost.AUTO
    assert push_post(_cfg(push_post="writer")) is PushPost.WRITER
    for bad in ("inline", 1, None):
        with pytest.raises(ConfigError, match=r"kv_connector_extra_config.push_post") as err:
            push_post(_cfg(push_post=bad))
        assert "'engine'" in str(err.value) and repr(bad) in str(err.value)


# --- with vLLM imported (no server) ---------------------------------------------------


@pytest.mark.e2e
def test_plugin_registers_idempotently() -> None:
    import vllm  # noqa: F401  (the vllm extra is part of the test environment)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvxfer.adapters.vllm import CONNECTOR_NAMES
    from kvxfer.adapters.vllm.plugin import register

    register()
    assert register() == []  # second call: nothing new, no error
    for name in CONNECTOR_NAMES:
        cls = KVConnectorFactory.get_connector_class_by_name(name)
        assert cls.__name__ == name


@pytest.mark.e2e
def test_module_path_loads_each_connector() -> None:
    import vllm  # noqa: F401  (the vllm extra is part of the test environment)
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in ("RblnNixlPullConnector", "RblnNixlPushConnector", "RblnNixlConnector"):
        cfg = KVTransferConfig(
            kv_connector=name,
            kv_role="kv_consumer",
            kv_connector_module_path="kvxfer.adapters.vllm",
        )
        assert KVConnectorFactory.get_connector_class(cfg).__name__ == name


@pytest.mark.e2e
def test_stats_aggregate_across_ranks_and_reduce() -> None:
    import vllm  # noqa: F401  (the vllm extra is part of the test environment)

    from kvxfer.adapters.vllm.connector import KvxferConnectorStats, RblnNixlPullConnector

    rank0 = {"num_transfers": 2, "bytes": 3 << 20, "transfer_s": [0.002, 0.004]}
    rank1 = {"num_transfers": 1, "num_failed": 1, "failed_timeout": 1}
    stats = RblnNixlPullConnector.build_kv_connector_stats(rank0)
    assert stats is not None
    merged = stats.aggregate(KvxferConnectorStats(data=rank1))
    out = merged.reduce()
    assert out["num_transfers"] == 3 and out["num_failed"] == 1 and out["failed_timeout"] == 1
    assert out["MiB"] == 3.0 and out["avg_transfer_ms"] == 3.0 and out["max_transfer_ms"] == 4.0
    assert not merged.is_empty() and KvxferConnectorStats(data={}).is_empty()


@pytest.mark.e2e
def test_the_quarantine_gauge_moves_by_the_summed_changes_of_ranks_and_steps() -> None:
    """R-SAFE-5's gauge: each rank ships how its quarantined count changed; vLLM sums
    ranks and steps, and the gauge moves by the sum (back to 0 once all ended)."""
    from prometheus_client import CollectorRegistry, Gauge

    from kvxfer.adapters.vllm.stats import KvxferPromMetrics, SeriesKind
    from kvxfer.adapters.vllm.worker import _Interval

    class _Quarantine:
        def __init__(self) -> None:
            self.quarantined = self.quarantines = 0

    ranks = [_Interval(), _Interval()]
    agents = [_Quarantine(), _Quarantine()]
    registry = CollectorRegistry()

    def gauge(**kw: Any) -> Any:
        kw.pop("multiprocess_mode", None)
        return Gauge(registry=registry, **kw)

    metrics = KvxferPromMetrics.__new__(KvxferPromMetrics)
    metrics.series = {
        "delta_quarantined": (SeriesKind.GAUGE, {0: gauge(name="q", documentation="q")})
    }
    shown = []
    for levels in ((2, 1), (1, 1), (0, 0)):
        merged: dict[str, Any] = {}
        for interval, agent, level in zip(ranks, agents, levels):
            agent.quarantined = level
            interval.producer(agent)
            for key, value in (interval.take() or {}).items():
                merged[key] = merged.get(key, 0) + value
        metrics.observe(merged)
        shown.append(registry.get_sample_value("q"))
    assert shown == [3.0, 2.0, 0.0]


@pytest.mark.e2e
def test_cpu_kv_cache_shape_describes_as_one_region_per_layer() -> None:
    from kvxfer.adapters.vllm.worker import describe_kv_caches

    caches = _caches(fill=False)
    caches["shared"] = caches["model.layers.1.self_attn.attn"]  # KV sharing: once
    layout = describe_kv_caches(caches, block_size=BS, num_blocks=NUM_BLOCKS, kv_layout="HND")
    assert layout.num_regions == 2
    block_bytes = HEADS * BS * 2 * HEAD * 2
    assert {(r.block_len, r.stride, r.num_blocks) for r in layout.regions} == {
        (block_bytes, block_bytes, NUM_BLOCKS)
    }
    assert layout.regions[1].base - layout.regions[0].base == NUM_BLOCKS * block_bytes


@pytest.mark.e2e
def test_head_regions_describe_one_region_per_global_head_that_tp_planning_accepts() -> None:
    """Pulls across TP sizes read head slices: with head_regions each layer is one
    region per KV head (its K and V parts of every block), numbered globally on a
    tensor-parallel rank, and the TP algebra takes that layout as the rank's heads."""
    from kvxfer.adapters.vllm.worker import describe_kv_caches
    from kvxfer.core.heads import HeadLayout, region_heads

    caches = _caches(fill=False)
    whole = describe_kv_caches(caches, block_size=BS, num_blocks=NUM_BLOCKS, kv_layout="HND")
    for rank in (0, 1):
        layout = describe_kv_caches(
            caches,
            block_size=BS,
            num_blocks=NUM_BLOCKS,
            kv_layout="HND",
            tp_rank=rank,
            head_regions=True,
        )
        assert layout.num_regions == 2 * HEADS
        assert [r.head for r in layout.regions] == [rank * HEADS + h for h in range(HEADS)] * 2
        head_bytes = BS * 2 * HEAD * 2
        assert {(r.block_len, r.stride) for r in layout.regions} == {
            (head_bytes, HEADS * head_bytes)
        }
        # the same bytes as the whole-block description, per head
        assert layout.regions[1].base - layout.regions[0].base == head_bytes
        assert layout.regions[0].base == whole.regions[0].base
        heads = HeadLayout(num_kv_heads=2 * HEADS, tp_size=2)
        assert region_heads(layout, heads, rank)[0] == range(rank * HEADS, rank * HEADS + 1)
    with pytest.raises(KvxferError):
        region_heads(whole, HeadLayout(num_kv_heads=2 * HEADS, tp_size=2), 1)
    # Issue 26: the default description (one region per layer) cut per head at
    # pairing is exactly this one, region for region: no setting needed.
    from kvxfer.core.heads import place_heads, split_heads

    heads = HeadLayout(num_kv_heads=2 * HEADS, tp_size=2)
    for rank in (0, 1):
        placed = place_heads(
            describe_kv_caches(
                caches, block_size=BS, num_blocks=NUM_BLOCKS, kv_layout="HND", tp_rank=rank
            ),
            heads,
            rank,
        )
        per_head = describe_kv_caches(
            caches,
            block_size=BS,
            num_blocks=NUM_BLOCKS,
            kv_layout="HND",
            tp_rank=rank,
            head_regions=True,
        )
        cut = split_heads(placed, heads, rank, 1)
        assert cut.regions == per_head.regions


@pytest.mark.e2e
def test_replicated_heads_are_numbered_by_the_head_a_rank_holds() -> None:
    """Fewer KV heads than ranks: vLLM gives each rank one head, replicated on
    tp_size / heads ranks (rank r holds head r // replicas). Numbering by
    ``tp_rank * heads`` would name a head the model does not have; the connector passes
    the rank's first head from its TP identity."""
    from kvxfer.adapters.vllm.worker import describe_kv_caches
    from kvxfer.core.heads import HeadLayout, region_heads

    caches = {
        name: t[:, :1].contiguous() for name, t in _caches(fill=False).items()
    }  # one KV head per rank
    heads = HeadLayout(num_kv_heads=2, tp_size=4)  # each head on two ranks
    for rank in range(4):
        layout = describe_kv_caches(
            caches,
            block_size=BS,
            num_blocks=NUM_BLOCKS,
            kv_layout="HND",
            tp_rank=rank,
            head_regions=True,
            first_head=heads.heads_of(rank).start,
        )
        assert [r.head for r in layout.regions] == [rank // 2] * 2
        assert region_heads(layout, heads, rank)[0] == range(rank // 2, rank // 2 + 1)
    wrong = describe_kv_caches(
        caches, block_size=BS, num_blocks=NUM_BLOCKS, kv_layout="HND", tp_rank=3, head_regions=True
    )
    with pytest.raises(KvxferError):
        region_heads(wrong, heads, 3)


def test_host_bounce_hold_does_not_restage_what_was_staged_after_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a backend that stages through host memory (host bounce): stage_out copies
    p = _worker("kv_producer", "pull", _caches(fill=True), stages=True)
    ps = _side(Role.PRODUCER, stage_early=True)
    info = p.handshake_info()
    ps.set_endpoint(info["host"], info["port"], [info["incarnation"]])
    copies: list[list[Any]] = []
    holds: list[bool] = []
    real_stage, real_hold = p.agent.backend.stage_out, p.agent.hold
    monkeypatch.setattr(
        p.agent.backend, "stage_out", lambda ids: copies.append(ids) or real_stage(ids)
    )

    def hold(*args: Any, staged: bool = False, **kw: Any) -> Any:
        holds.append(staged)
        return real_hold(*args, staged=staged, **kw)

    monkeypatch.setattr(p.agent, "hold", hold)
    try:
        for rid, blocks in (("p-a", [[4, 5, 6]]), ("p-b", [[7, 8, 9]])):
            req = FakeRequest(rid, {"do_remote_decode": True}, num_prompt_tokens=70)
            ps.on_new_request(req)
            plan = ps.build_step_plan({rid: 70}, {rid: blocks}.__getitem__)
            p.start_step(plan)
            if rid == "p-a":
                p.after_forward(plan)  # staged after its last forward
            req.num_computed_tokens, req.status = 70, "FINISHED_LENGTH_CAPPED"
            ps.request_finished(req, blocks)
            p.start_step(ps.build_step_plan())
        # p-a: one copy (after the forward), its hold skips it; p-b was never staged
        # early (its forward's after_forward did not run), so its hold copies.
        assert holds == [True, False]
        assert len(copies) == 2
    finally:
        p.close()


def test_a_state_layers_byte_pages_are_described_as_its_conv_and_ssm_regions() -> None:
    from kvxfer.adapters.vllm.worker import describe_kv_caches

    conv, ssm = 3 * 320 * 2, 8 * 32 * 16 * 4
    page = 32768  # the attention layer's page: the state slot sits at its start
    raw = torch.zeros(NUM_BLOCKS * page, dtype=torch.int8)
    # vLLM 0.32's views over one backing buffer: the state layer's (B, 1, 1, bytes)
    # pages, and the attention layer's (B, heads, block, 2 * head) pages, sharing it.
    state = torch.as_strided(raw, (NUM_BLOCKS, 1, 1, conv + ssm), (page, page, page, 1))
    attn = raw.view(torch.bfloat16).view(NUM_BLOCKS, 2, BS, page // (2 * BS * 2))
    groups = (Group(kind=GroupKind.STATE, conv_layout=ConvLayout.SD), Group(kind=GroupKind.FULL))
    describe = functools.partial(
        describe_kv_caches,
        {"l.0.mixer": state, "l.1.attn": attn},
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        kv_layout="NHD",
        groups=groups,
        layer_groups={"l.0.mixer": 0, "l.1.attn": 1},
    )
    layout = describe(state_parts={0: (conv, ssm)})
    by_part = {(r.layer, r.part): r for r in layout.regions}
    assert by_part[(0, KVPart.CONV)].block_len == conv
    assert by_part[(0, KVPart.SSM)].block_len == ssm
    assert by_part[(0, KVPart.SSM)].base == by_part[(0, KVPart.CONV)].base + conv
    assert {r.stride for r in layout.regions} == {page}
    assert "parts=conv/kv/ssm" in layout.summary() and "state(conv=SD)" in layout.summary()
    # Without the sizes the slot is one region (moved whole all the same).
    whole = describe()
    assert [r.block_len for r in whole.regions if r.layer == 0] == [conv + ssm]
    with pytest.raises(
        ConfigError, match=r"kv_caches\['l.0.mixer'\]=.*states' \[1920, 16000\] bytes"
    ):
        describe(state_parts={0: (conv, 16000)})


@dataclasses.dataclass
class _Parallel:
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    tensor_parallel_size: int = 4


def test_pipeline_and_context_parallelism_are_refused_at_start_up() -> None:
    check_parallelism(_Parallel())  # TP alone is fine
    for key in (
        "pipeline_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        with pytest.raises(ConfigError) as err:
            check_parallelism(_Parallel(**{key: 2}))
        assert str(err.value).startswith(f"{key}=2: "), err.value
    # An older vLLM without the context-parallel keys is not refused for lacking them.
    check_parallelism(object())
