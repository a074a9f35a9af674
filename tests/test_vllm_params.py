"""kvxfer tickets <-> vLLM's ``kv_transfer_params`` (kvxfer.adapters.vllm.params)."""

from __future__ import annotations

from typing import Any

import pytest

from kvxfer.adapters.vllm.params import (
    across_tp,
    is_remote_prefill,
    pairing_error,
    release_ticket,
    remote_block_groups,
    remote_ticket,
    ticket_params,
)
from kvxfer.agent import Ticket
from kvxfer.errors import ConfigError
from kvxfer.types import Direction

PRODUCED = Ticket(
    engine_id="prefill-0",
    host="10.0.0.1",
    port=5600,
    request_id="cmpl-a-0-0123abcd",
    block_ids=((4, 5, 6, 7),),
    num_tokens=120,
    incarnation=11,
    lease_expiry=1234.5,
    tp_size=2,
    capability="ab" * 16,
    guard_slot=0,
    generation=77,
)


def _params(**over: Any) -> dict[str, Any]:
    return {**ticket_params(PRODUCED, direction=Direction.PULL, incarnations=(11, 12)), **over}


def test_upstream_keys_and_kvxfer_extras() -> None:
    p = _params()
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False
    assert (p["remote_engine_id"], p["remote_host"], p["remote_port"]) == (
        "prefill-0",
        "10.0.0.1",
        5600,
    )
    assert p["remote_request_id"] == "cmpl-a-0-0123abcd"
    assert p["remote_block_ids"] == [[4, 5, 6, 7]] and p["tp_size"] == 2
    assert p["transfer_mode"] == "pull" and p["remote_num_tokens"] == 120
    assert p["remote_incarnations"] == [11, 12] and p["lease_expiry"] == 1234.5
    assert is_remote_prefill(p, Direction.PULL)


def test_round_trip_per_rank_cuts_blocks_to_the_local_ones() -> None:
    for rank, incarnation in ((0, 11), (1, 12)):
        t = remote_ticket(
            _params(),
            tp_rank=rank,
            transfer_id="t-1",
            local_blocks=((20, 21),),
            skip_blocks=1,
            num_tokens=96,
        )
        assert (t.engine_id, t.host, t.port) == ("prefill-0", "10.0.0.1", 5600 + rank)
        assert t.incarnation == incarnation and t.request_id == "t-1"
        assert t.block_ids == ((5, 6),) and t.num_tokens == 96
        assert t.tp_size == 2 and t.lease_expiry == 1234.5
        # the hold's capability and guard word travel both ways (slot 0 is a slot)
        assert (t.capability, t.guard_slot, t.generation) == ("ab" * 16, 0, 77)


def test_upstream_params_without_kvxfer_keys_make_an_unguarded_ticket() -> None:
    bare = {k: v for k, v in _params().items() if not k.startswith("kvxfer_")}
    t = remote_ticket(bare, tp_rank=0, transfer_id="t", local_blocks=((1, 2),))
    assert (t.capability, t.guard_slot, t.generation) == ("", -1, 0)
    assert release_ticket(_params(), tp_rank=0, transfer_id="t").capability == "ab" * 16


def test_a_flat_block_list_is_one_group_and_push_tickets_may_carry_none() -> None:
    assert remote_block_groups({"remote_block_ids": [3, 4]}) == ((3, 4),)
    assert remote_block_groups({"remote_block_ids": [[3], [4]]}) == ((3,), (4,))
    assert remote_block_groups({}) == ()
    t = remote_ticket(
        _params(remote_block_ids=None), tp_rank=0, transfer_id="x", local_blocks=((1, 2),)
    )
    assert t.block_ids == ((),)


@pytest.mark.parametrize(
    ("over", "key", "rule"),
    [
        ({"remote_block_ids": [[4, "5"]]}, "remote_block_ids", "must be an integer"),
        ({"remote_block_ids": [[4, 4]]}, "remote_block_ids", "repeated"),
        ({"remote_block_ids": [[4], [5]]}, "remote_block_ids", "2 KV group(s)"),
        ({"remote_block_ids": [-1]}, "remote_block_ids", "out of range"),
        ({"remote_host": None}, "remote_host", "is required"),
        ({"remote_engine_id": 7}, "remote_engine_id", "non-empty string"),
        ({"remote_port": True}, "remote_port", "integer >= 1"),
        ({"remote_port": 65535}, "remote_port", "> 65535"),
        ({"remote_incarnations": ["a"]}, "remote_incarnations", "list of integers"),
        ({"remote_num_tokens": 1.5}, "remote_num_tokens", "integer >= 0"),
        ({"tp_size": 0}, "tp_size", "integer >= 1"),
        ({"lease_expiry": "soon"}, "lease_expiry", "must be a number"),
        ({"kvxfer_capability": "XYZ"}, "kvxfer_capability", "lowercase hex"),
        ({"kvxfer_guard_slot": -2}, "kvxfer_guard_slot", "integer >= -1"),
        ({"kvxfer_generation": "7"}, "kvxfer_generation", "integer >= 0"),
    ],
)
def test_bad_params_name_key_value_and_rule(over: dict[str, Any], key: str, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        remote_ticket(_params(**over), tp_rank=1, transfer_id="t", local_blocks=((1, 2),))
    assert err.value.key == f"kv_transfer_params.{key}"
    assert err.value.value == over[key] and rule in err.value.rule


def test_pairing_refuses_another_connector_by_name_and_pairs_any_tp_sizes() -> None:
    assert pairing_error(_params(), Direction.PULL, 2) is None
    why = pairing_error(_params(), Direction.PUSH, 2)
    assert why is not None and "transfer_mode 'pull'" in why
    # Pull and push both cross TP sizes (the Agent plans them per head).
    assert pairing_error(_params(), Direction.PULL, 1) is None
    assert pairing_error(_params(), Direction.PULL, 4) is None
    assert pairing_error(_params(transfer_mode="push"), Direction.PUSH, 1) is None
    assert pairing_error(_params(transfer_mode="push"), Direction.PUSH, 2) is None
    assert across_tp(_params(), 1) and not across_tp(_params(), 2)
    assert not across_tp(_params(tp_size=None), 1)


def test_a_ticket_across_tp_sizes_names_rank_0_and_every_incarnation() -> None:
    t = remote_ticket(_params(), tp_rank=0, transfer_id="t", local_blocks=((1, 2, 3, 4),))
    assert (t.port, t.incarnation, t.incarnations, t.tp_size) == (5600, 11, (11, 12), 2)
    r = release_ticket(_params(), tp_rank=0, transfer_id="t")
    assert (r.port, r.tp_size, r.incarnations, r.capability) == (5600, 2, (11, 12), "ab" * 16)


def test_release_ticket_names_the_producer_rank() -> None:
    t = release_ticket(_params(), tp_rank=1, transfer_id="t-9")
    assert (t.port, t.request_id, t.block_ids) == (5601, "t-9", ((),))
    with pytest.raises(ConfigError, match="remote_port"):
        release_ticket(_params(remote_port=None), tp_rank=0, transfer_id="t")
