"""The vLLM adapter's push between different ``--block-size`` values, without an engine
(issue 54): scheduler and worker sides on real Agents over the in-process ``fake``
backend, with KV caches shaped as vLLM 0.32 allocates them on CPU (K element-major
inside each head, V token-major). The producer's ``kv_transfer_params`` name its
block size; the decode side registers its own blocks, and the producer writes every
token into the consumer's block at its position. Nothing in the adapter refuses the
pair; the handshake checks the two layouts (kvxfer.core.compat.check_pair)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch  # a required dependency (scripts/setup_env.sh), never skipped

from kvxfer.adapters.vllm.kv_transfer_config import parse_kv_transfer_config
from kvxfer.adapters.vllm.scheduler import SchedulerSide
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.types import Direction, Role
from tests.e2e.test_adapter_offline import FakeRequest, _drive, _new_acc, _results, _until

NUM_BLOCKS, HEADS, HEAD = 16, 2, 8
_ids = itertools.count()


def _caches(bs: int, fill: bool) -> dict[str, Any]:
    """Two layers, views of one buffer, each ``(num_blocks, heads, bs, 2 * head)``."""
    per_layer = NUM_BLOCKS * HEADS * bs * 2 * HEAD
    buf = torch.zeros(2 * per_layer, dtype=torch.bfloat16)
    if fill:
        buf.copy_(torch.randn(2 * per_layer, generator=torch.Generator().manual_seed(5)))
    return {
        f"model.layers.{i}.self_attn.attn": buf[i * per_layer : (i + 1) * per_layer].view(
            NUM_BLOCKS, HEADS, bs, 2 * HEAD
        )
        for i in range(2)
    }


def _worker(role: str, bs: int, caches: dict[str, Any]) -> WorkerSide:
    from kvxfer.agent import Agent, AgentConfig
    from kvxfer.backend import BackendOptions
    from kvxfer.core.compat import Fingerprint
    from kvxfer.testing.fake_backend import FakeBackend

    cfg = parse_kv_transfer_config(
        {"kv_connector": "RblnNixlPushConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    )
    engine_id = f"{role}-ratio-{next(_ids)}"
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
                transfer_timeout_s=5.0,
                handshake_timeout_s=0.5,
                handshake_retries=0,
            ),
            backend=FakeBackend(BackendOptions(agent_name=f"{engine_id}#agent")),
        )

    return WorkerSide.from_kv_caches(
        cfg, caches, agent_factory=factory, block_size=bs, num_blocks=NUM_BLOCKS, kv_layout="NHD"
    )


def _token(t: torch.Tensor, block: int, bs: int, tok: int) -> torch.Tensor:
    """Token ``tok`` of ``block``: per head its K elements (element-major: element
    ``d`` at ``d * bs + tok``), then its V row (token-major)."""
    flat = t[block].reshape(HEADS, 2 * bs * HEAD)
    k = flat[:, tok : bs * HEAD : bs]
    v = flat[:, bs * HEAD + tok * HEAD : bs * HEAD + (tok + 1) * HEAD]
    return torch.cat((k, v), dim=1)


@pytest.mark.parametrize(("pbs", "cbs"), [(128, 32), (32, 64)])
def test_a_push_between_block_sizes_writes_each_token_to_its_position(pbs: int, cbs: int) -> None:
    n = 200  # across block boundaries, a partial last block on both sides
    p = _worker("kv_producer", pbs, _caches(pbs, fill=True))
    c = _worker("kv_consumer", cbs, _caches(cbs, fill=False))
    try:
        ps = SchedulerSide(
            engine_id=p.agent.config.engine_id,
            role=Role.PRODUCER,
            direction=Direction.PUSH,
            block_size=pbs,
        )
        cs = SchedulerSide(
            engine_id=c.agent.config.engine_id,
            role=Role.CONSUMER,
            direction=Direction.PUSH,
            block_size=cbs,
        )
        info = p.handshake_info()
        ps.set_endpoint(info["host"], info["port"], [info["incarnation"]])
        pb = list(range(9, 9 + -(-n // pbs)))[::-1]
        cb = list(range(2, 2 + -(-n // cbs)))
        prod_req = FakeRequest(
            "cmpl-r-0-00000001", {"do_remote_decode": True}, n, n, "FINISHED_STOPPED"
        )
        _, params = ps.request_finished(prod_req, [pb])
        assert params is not None and params["remote_block_size"] == pbs
        cons_req = FakeRequest("cmpl-r-0-00000002", params, num_prompt_tokens=n)
        got, _ = cs.get_num_new_matched_tokens(cons_req, 0)
        assert got == n
        cs.update_state_after_alloc(cons_req, [cb], got, 0)
        _drive(p, c, ps, cs)
        acc = _new_acc()
        _until(lambda: "cmpl-r-0-00000002" in _results(c, acc)["recving"], "push not done")
        assert not acc["failed"] and not acc["invalid"], acc
        for pt, ct in zip(p.tensors, c.tensors, strict=True):
            for tok in range(n):
                want = _token(pt, pb[tok // pbs], pbs, tok % pbs)
                assert torch.equal(_token(ct, cb[tok // cbs], cbs, tok % cbs), want), tok
            end = -(-n // min(pbs, cbs)) * min(pbs, cbs)  # the last unit's end
            last = len(cb) - 1
            for tok in range(end - last * cbs, cbs):  # past the last unit: never written
                assert not _token(ct, cb[last], cbs, tok).any(), tok
            others = [b for b in range(NUM_BLOCKS) if b not in cb]
            assert not ct[others].any(), "a block outside the request was written"
    finally:
        c.close()
        p.close()
