"""The vLLM adapter's pieces without a running engine.

The scheduler state machine is pure Python; the plugin, factory and layout tests
import vLLM/torch (seconds, no server) and are marked ``e2e`` with the rest of the
vLLM-dependent tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvxfer.adapters.vllm.scheduler import SchedulerSide
from kvxfer.config import Direction, Role

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


def _consumer() -> SchedulerSide:
    return SchedulerSide(
        engine_id="decode-0", role=Role.CONSUMER, direction=Direction.PULL, block_size=BS
    )


def test_consumer_claims_once_and_loads_into_unhashed_blocks() -> None:
    s = _consumer()
    req = FakeRequest("d-1", _ticket([7, 8, 9, 10]))
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)
    assert s.get_num_new_matched_tokens(req, 0) == (100, True)  # side-effect free
    s.update_state_after_alloc(req, [[1, 2, 3, 4]], 100, 0)
    plan = s.build_step_plan()
    assert [ld.local_blocks for ld in plan.loads] == [((1, 2, 3, 4),)]
    assert plan.loads[0].skip_blocks == 0 and plan.loads[0].num_tokens == 100
    assert s.build_step_plan().empty()
    # After the load vLLM asks again (e.g. on retry); never claim twice.
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, [[4]], 0, 99)
    assert s.build_step_plan().empty()


def test_consumer_local_prefix_hit_skips_leading_remote_blocks() -> None:
    s = _consumer()
    req = FakeRequest("d-2", _ticket([7, 8, 9, 10]))
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (100 - 2 * BS, True)
    s.update_state_after_alloc(req, [[3, 4]], 100 - 2 * BS, 2 * BS)
    (load,) = s.build_step_plan().loads
    assert load.skip_blocks == 2 and load.local_blocks == ((3, 4),)


def test_consumer_releases_the_producer_when_nothing_is_pulled() -> None:
    s = _consumer()
    aborted = FakeRequest("d-3", _ticket([1, 2, 3, 4]))
    assert s.request_finished(aborted, [[]]) == (False, None)
    full_hit = FakeRequest("d-4", _ticket([1, 2, 3, 4]))
    s.update_state_after_alloc(full_hit, [[5]], 0, 96)
    plan = s.build_step_plan()
    assert [(r.request_id, r.reason) for r in plan.releases] == [
        ("d-3", "aborted"),
        ("d-4", "not needed"),
    ]
    assert not plan.loads


def test_consumer_ignores_incomplete_params_and_producer_requests() -> None:
    s = _consumer()
    partial = _ticket([1])
    del partial["remote_host"]
    assert s.get_num_new_matched_tokens(FakeRequest("d-5", partial), 0) == (0, False)
    p_req = FakeRequest("d-6", {"do_remote_decode": True})
    assert s.get_num_new_matched_tokens(p_req, 0) == (0, False)
    assert s.request_finished(p_req, [[1]]) == (False, None)


def test_producer_holds_normally_finished_requests_only() -> None:
    s = SchedulerSide(
        engine_id="prefill-0", role=Role.PRODUCER, direction=Direction.PULL, block_size=BS
    )
    s.set_endpoint("10.0.0.1", 5601, 42)
    done = FakeRequest("p-1", {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED")
    delay, params = s.request_finished(done, [[4, 5, 6]])
    assert delay is True and params is not None
    assert params["remote_block_ids"] == [[4, 5, 6]]
    assert params["remote_host"] == "10.0.0.1" and params["remote_port"] == 5601
    assert params["remote_request_id"] == "p-1" and params["remote_num_tokens"] == 70
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    aborted = FakeRequest("p-2", {"do_remote_decode": True}, 70, 10, "FINISHED_ABORTED")
    assert s.request_finished(aborted, [[7]]) == (False, None)
    (hold,) = s.build_step_plan().holds
    assert hold.request_id == "p-1" and hold.block_ids == ((4, 5, 6),)
    assert not s.has_pending_push_work()  # pull


def test_push_producer_keeps_stepping_until_sent() -> None:
    s = SchedulerSide(
        engine_id="prefill-0", role=Role.PRODUCER, direction=Direction.PUSH, block_size=BS
    )
    done = FakeRequest("p-1", {"do_remote_decode": True}, 70, 70, "FINISHED_STOPPED")
    s.request_finished(done, [[4, 5, 6]])
    assert s.has_pending_push_work()
    s.update_connector_output({"p-1"}, set())
    assert not s.has_pending_push_work()


# --- with vLLM/torch imported (no server) ---------------------------------------------


@pytest.mark.e2e
def test_plugin_registers_idempotently() -> None:
    pytest.importorskip("vllm")
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
    pytest.importorskip("vllm")
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
def test_cpu_kv_cache_shape_describes_as_one_region_per_layer() -> None:
    torch = pytest.importorskip("torch")
    from kvxfer.adapters.vllm.worker import describe_kv_caches

    # As vLLM 0.32 allocates it on CPU: one buffer, a contiguous view per layer of
    # (num_blocks, num_kv_heads, block_size, 2 * head_size), bf16.
    num_blocks, heads, head_size = 16, 2, 32
    per_layer = num_blocks * heads * BS * 2 * head_size
    buf = torch.zeros(2 * per_layer, dtype=torch.bfloat16)
    caches = {
        f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
            num_blocks, heads, BS, 2 * head_size
        )
        for i in range(2)
    }
    caches["shared"] = caches["model.layers.1.self_attn.attn"]  # KV sharing: once
    layout = describe_kv_caches(caches, block_size=BS, num_blocks=num_blocks, kv_layout="HND")
    assert layout.num_regions == 2
    block_bytes = heads * BS * 2 * head_size * 2
    assert {(r.block_len, r.stride, r.num_blocks) for r in layout.regions} == {
        (block_bytes, block_bytes, num_blocks)
    }
    assert layout.regions[1].base - layout.regions[0].base == per_layer * 2
