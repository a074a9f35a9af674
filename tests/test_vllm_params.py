"""kvxfer tickets <-> vLLM's ``kv_transfer_params`` (kvxfer.adapters.vllm.params)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

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
from tests.float64_json import as_float64, float64_router, numbers

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
    assert p["remote_incarnations"] == ["000000000000000b", "000000000000000c"]
    assert p["remote_incarnation"] == "000000000000000b" and p["lease_expiry"] == 1234.5
    assert p["kvxfer_generation"] == "000000000000004d" and p["kvxfer_guard_slot"] == 0
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
        ({"remote_port": 5600.5}, "remote_port", "integer >= 1"),
        ({"remote_incarnations": ["a"]}, "remote_incarnations", "16 lowercase hex digits"),
        ({"remote_incarnations": 11}, "remote_incarnations", "must be a list"),
        ({"remote_incarnations": [11, True]}, "remote_incarnations", "rank 1's entry True"),
        ({"remote_incarnation": "0B" * 8}, "remote_incarnation", "16 lowercase hex digits"),
        ({"remote_incarnation": -1}, "remote_incarnation", "an integer >= 0"),
        ({"remote_num_tokens": 1.5}, "remote_num_tokens", "integer >= 0"),
        ({"remote_num_tokens": "120"}, "remote_num_tokens", "integer >= 0"),
        ({"tp_size": 0}, "tp_size", "integer >= 1"),
        ({"tp_size": 2.5}, "tp_size", "integer >= 1"),
        ({"lease_expiry": "soon"}, "lease_expiry", "must be a finite number"),
        ({"lease_expiry": True}, "lease_expiry", "must be a finite number"),
        ({"lease_expiry": float("inf")}, "lease_expiry", "must be a finite number"),
        ({"lease_expiry": 10**400}, "lease_expiry", "below 2**53"),
        ({"kvxfer_capability": "XYZ"}, "kvxfer_capability", "lowercase hex"),
        ({"kvxfer_guard_slot": -2}, "kvxfer_guard_slot", "integer >= -1"),
        ({"kvxfer_guard_slot": 0.5}, "kvxfer_guard_slot", "integer >= -1"),
        ({"kvxfer_generation": "7"}, "kvxfer_generation", "16 lowercase hex digits"),
        ({"kvxfer_generation": "0100000000000000"}, "kvxfer_generation", "below 2**56"),
        ({"kvxfer_generation": 7.5}, "kvxfer_generation", "16 lowercase hex digits"),
        ({"remote_block_ids": [[4, 5.5]]}, "remote_block_ids", "must be an integer"),
        ({"remote_block_ids": [[4, 2**53]]}, "remote_block_ids", "id >= 2**53"),
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
    # With expiry, the lease's too (a keep-alive renews from it); an abort never reads
    # it, so a malformed one cannot keep the producer from hearing of the abort.
    assert t.lease_expiry == 0.0
    kept = release_ticket(_params(), tp_rank=1, transfer_id="t-9", expiry=True)
    assert kept.lease_expiry == _params()["lease_expiry"] > 0
    bad = _params(lease_expiry="soon")
    assert release_ticket(bad, tp_rank=0, transfer_id="t").lease_expiry == 0.0
    with pytest.raises(ConfigError, match="lease_expiry"):
        release_ticket(bad, tp_rank=0, transfer_id="t", expiry=True)
    with pytest.raises(ConfigError, match="remote_port"):
        release_ticket(_params(remote_port=None), tp_rank=0, transfer_id="t")


# -- float64 routers (Go, JavaScript) ---------------------------------------------------

#: A producer's incarnation from issue 26's refused loads ("producer ... restarted
#: (incarnation 13e0f7f3125a8df8 -> 13e0f7f3125a8da4)"): a Go or JavaScript router
#: writes it back as 1432417304860855800, which is ROUNDED_INCARNATION.
ISSUE_INCARNATION = 0x13E0F7F3125A8DA4
ROUNDED_INCARNATION = 0x13E0F7F3125A8DF8


def _router_ticket(incarnations: tuple[int, ...], generation: int) -> Ticket:
    return msgspec.structs.replace(
        PRODUCED,
        incarnation=incarnations[0],
        tp_size=len(incarnations),
        generation=generation,
    )


def test_a_float64_router_keeps_every_incarnation_and_the_generation() -> None:
    """The producer's 64-bit incarnations and 56-bit generation reach decode exactly
    through a Go/JavaScript router (before: as JSON integers, rounded; decode then
    refused every load as if the producer had restarted)."""
    incarnations = (ISSUE_INCARNATION, 2**64 - 1)
    produced = _router_ticket(incarnations, 2**56 - 1)
    params = ticket_params(produced, direction=Direction.PULL, incarnations=incarnations)
    assert float64_router([ISSUE_INCARNATION]) == [ROUNDED_INCARNATION]  # what went wrong
    for routed in (float64_router(params), as_float64(params)):
        for rank in (0, 1):
            t = remote_ticket(routed, tp_rank=rank, transfer_id="t", local_blocks=((5, 6, 7),))
            assert t.incarnation == incarnations[rank] and t.incarnations == incarnations
            assert t.generation == 2**56 - 1 and t.guard_slot == 0
            assert t.port == 5600 + rank and t.block_ids == ((4, 5, 6),)
            assert t.lease_expiry == 1234.5 and t.tp_size == 2


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_incarnation", ISSUE_INCARNATION),  # an older producer's, unrounded
        ("remote_incarnation", ROUNDED_INCARNATION),  # ... and as a router wrote it
        ("remote_incarnation", 2**53),
        ("remote_incarnation", float(ISSUE_INCARNATION)),  # a float64 parser's view
        ("remote_incarnations", [11, ISSUE_INCARNATION]),
        ("kvxfer_generation", 2**55 + 1),
    ],
)
def test_an_older_producers_big_integers_are_refused_naming_the_key(key: str, value: Any) -> None:
    """A JSON number >= 2**53 may be a rounded one: refused (never compared, which
    would blame a producer restart), naming the key, the value and the rule."""
    with pytest.raises(ConfigError) as err:
        remote_ticket(_params(**{key: value}), tp_rank=0, transfer_id="t", local_blocks=((1,),))
    assert err.value.key == f"kv_transfer_params.{key}" and err.value.value == value
    assert "2**53" in err.value.rule and "float64" in err.value.rule
    assert "16-hex-digit string" in err.value.rule
    assert f"kv_transfer_params.{key}=" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("remote_port", 2**53),
        ("remote_port", float(2**60)),
        ("remote_num_tokens", 2**53 + 2),
        ("kvxfer_guard_slot", 2**62),
        ("tp_size", float(2**53)),
    ],
)
def test_numbers_a_float64_parser_may_have_rounded_are_refused(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        remote_ticket(_params(**{key: value}), tp_rank=0, transfer_id="t", local_blocks=((1,),))
    assert err.value.key == f"kv_transfer_params.{key}" and err.value.value == value
    assert "below 2**53" in err.value.rule and "float64" in err.value.rule


def test_a_nan_lease_is_refused_and_small_integers_read_as_before() -> None:
    with pytest.raises(ConfigError, match=r"lease_expiry=nan: must be a finite number"):
        remote_ticket(
            _params(lease_expiry=math.nan), tp_rank=0, transfer_id="t", local_blocks=((1,),)
        )
    # Hand-made tickets (and older producers' small values) are exact: still read.
    old = _params(remote_incarnation=11, remote_incarnations=[11, 12], kvxfer_generation=77)
    t = remote_ticket(old, tp_rank=1, transfer_id="t", local_blocks=((1,),))
    assert (t.incarnation, t.incarnations, t.generation) == (12, (11, 12), 77)
    # A float64 parser's integral floats are the integers the producer sent.
    assert remote_block_groups({"remote_block_ids": [[3.0, 4.0], [5.0]]}) == ((3, 4), (5,))
    assert across_tp({"tp_size": 2.0}, 1) and not across_tp({"tp_size": 1.0}, 1)


_HEX = "0123456789abcdef"


@st.composite
def _tickets(draw: st.DrawFn) -> tuple[Ticket, tuple[int, ...], int]:
    """A producer's ticket over the full value ranges, its ranks' incarnations and a
    consumer rank."""
    tp = draw(st.integers(1, 8))
    incarnations = tuple(draw(st.lists(st.integers(0, 2**64 - 1), min_size=tp, max_size=tp)))
    ids = st.integers(0, 2**31 - 1)
    groups = draw(
        st.lists(st.lists(ids, min_size=1, max_size=6, unique=True), min_size=1, max_size=3)
    )
    ticket = Ticket(
        engine_id=draw(st.text(min_size=1, max_size=12)),
        host=draw(st.text(min_size=1, max_size=12)),
        port=draw(st.integers(1, 65536 - tp)),
        request_id=draw(st.text(max_size=12)),
        block_ids=tuple(tuple(g) for g in groups),
        num_tokens=draw(st.integers(0, 2**40)),
        incarnation=incarnations[0],
        lease_expiry=draw(st.floats(0, 4e9, allow_nan=False, allow_infinity=False)),
        tp_size=tp,
        capability=draw(st.text(_HEX, max_size=64)),
        guard_slot=draw(st.integers(-1, 2**20)),
        generation=draw(st.integers(0, 2**56 - 1)),
    )
    return ticket, incarnations, draw(st.integers(0, tp - 1))


@given(_tickets(), st.sampled_from([Direction.PULL, Direction.PUSH]))
def test_tickets_survive_float64_json_round_trips(
    case: tuple[Ticket, tuple[int, ...], int], direction: Direction
) -> None:
    """Property: whatever the producer's ticket, the consumer reads the same one back
    from ``kv_transfer_params`` that went through a float64 JSON parser, whether it
    hands on Python floats or writes them back as Go and JavaScript do."""
    ticket, incarnations, rank = case
    params = ticket_params(ticket, direction=direction, incarnations=incarnations)
    # Every number kvxfer writes is one float64 holds exactly.
    assert all(float(n) == n for n in numbers(params))
    local = tuple(tuple(range(len(g))) for g in ticket.block_ids)
    want = msgspec.structs.replace(
        ticket,
        port=ticket.port + rank,
        request_id="t",
        block_ids=ticket.block_ids,
        num_tokens=7,
        incarnation=incarnations[rank],
        incarnations=incarnations,
    )
    for routed in (params, as_float64(params), float64_router(params)):
        got = remote_ticket(routed, tp_rank=rank, transfer_id="t", local_blocks=local, num_tokens=7)
        assert got == want
        assert release_ticket(routed, tp_rank=rank, transfer_id="t") == msgspec.structs.replace(
            want,
            block_ids=((),),
            num_tokens=0,
            incarnation=0,
            lease_expiry=0.0,
            guard_slot=-1,
            generation=0,
        )
        assert across_tp(routed, ticket.tp_size + 1) and not across_tp(routed, ticket.tp_size)
        assert is_remote_prefill(routed, direction)
