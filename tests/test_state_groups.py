"""Recurrent-state (Mamba2 / Gated DeltaNet) groups in the pure core and the scheduler.

The descriptor algebra's state properties (every slot whole, each byte once, from the
slot at the same position) are in tests/test_descriptor_properties.py; these are the
rules around them: block counts, remote pairing, the conv-state order in the
handshake, and the scheduler's running slot, held-back token and refusals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
import pytest

from kvxfer.adapters.vllm.scheduler import SchedulerSide, hold_back_last_token, running_slot
from kvxfer.core import blocks as kblocks
from kvxfer.core.compat import check_layout
from kvxfer.core.layout import ConvLayout, Group, GroupKind, KVLayout, KVPart, Region
from kvxfer.errors import LayoutError, LayoutMismatch, PlanError
from kvxfer.types import Direction, Role

BS = 16
STATE = (True, False)  # a state group, then a full-attention group


def _groups(*lists: list[int]) -> kblocks.Groups:
    return tuple(np.array(x, dtype=np.int64) for x in lists)


# --- block counts and pairing -----------------------------------------------------------


def test_a_state_group_lists_its_slots_whatever_the_token_count() -> None:
    for slots in ([3], [3, 9]):
        n = kblocks.check_counts(
            _groups(slots, [1, 2, 4]), num_tokens=40, block_size=BS, state=STATE
        )
        assert n == 3
    # A prefix hit cuts the attention list, never the state slot.
    kblocks.check_counts(
        _groups([3], [4]), num_tokens=40, block_size=BS, cached_blocks=2, state=STATE
    )
    for n, attention in ((40, [1, 2, 4]), (BS, [1]), (1, [1])):
        with pytest.raises(PlanError, match=r"group 0.*no block given; a state group lists"):
            kblocks.check_counts(_groups([], attention), num_tokens=n, block_size=BS, state=STATE)
    # Every block cached (nothing to move): no slot needed either.
    kblocks.check_counts(
        _groups([], []), num_tokens=BS, block_size=BS, cached_blocks=1, state=STATE
    )
    # Without the state flag the same list is an attention list and must fill the tokens.
    with pytest.raises(PlanError, match=r"1 block\(s\) given; num_tokens=40 fills 3"):
        kblocks.check_counts(_groups([3], [1, 2, 4]), num_tokens=40, block_size=BS)


def test_state_slots_pair_one_to_one_and_attention_blocks_by_position() -> None:
    local = _groups([5], [7])  # decode hit blocks 0-1 in its prefix cache
    remote = _groups([11], [20, 21, 22])
    paired = kblocks.pair_remote(
        local, remote, num_tokens=40, remote_num_tokens=40, block_size=BS, state=STATE
    )
    assert [p.tolist() for p in paired] == [[11], [22]]
    with pytest.raises(PlanError, match=r"holds 2 state slot\(s\), the local state group lists 1"):
        kblocks.pair_remote(
            _groups([5], [1, 2, 3]),
            _groups([11, 12], [20, 21, 22]),
            num_tokens=40,
            remote_num_tokens=40,
            block_size=BS,
            state=STATE,
        )


# --- the conv-state order in the handshake ----------------------------------------------


def _state_layout(conv: ConvLayout | None) -> KVLayout:
    regions = tuple(
        Region(
            base=(1 << 20) * (i + 1),
            num_blocks=4,
            stride=4096,
            block_len=length,
            layer=layer,
            part=part,
            group=group,
        )
        for i, (layer, part, group, length) in enumerate(
            [(0, KVPart.CONV, 0, 960), (0, KVPart.SSM, 0, 2048), (1, KVPart.KV, 1, 4096)]
        )
    )
    groups = (Group(kind=GroupKind.STATE, conv_layout=conv), Group(kind=GroupKind.FULL))
    return KVLayout(block_size=BS, regions=regions, groups=groups)


def test_peers_with_other_conv_state_orders_are_refused_at_the_handshake() -> None:
    sd, ds = _state_layout(ConvLayout.SD), _state_layout(ConvLayout.DS)
    check_layout(sd, _state_layout(ConvLayout.SD))
    with pytest.raises(LayoutMismatch) as err:
        check_layout(sd, ds)
    assert err.value.field == "groups" and "DS" in str(err.value) and "SD" in str(err.value)
    # It crosses the wire with the layout, and shows in the log line.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ds), type=KVLayout)
    assert wire.groups[0].conv_layout is ConvLayout.DS
    assert "groups=[state(conv=DS),full]" in ds.summary()


def test_only_a_state_group_states_a_conv_layout() -> None:
    with pytest.raises(LayoutError, match=r"Group.conv_layout=<ConvLayout.SD.*only on a state"):
        Group(kind=GroupKind.FULL, conv_layout=ConvLayout.SD)
    with pytest.raises(LayoutError, match=r"only on a state group"):
        Group(kind=GroupKind.SLIDING, window=4, conv_layout=ConvLayout.DS)
    with pytest.raises(LayoutError, match=r"Group.conv_layout='SD': must be a ConvLayout"):
        Group(kind=GroupKind.STATE, conv_layout="SD")  # type: ignore[arg-type]


# --- the scheduler ----------------------------------------------------------------------


def test_the_running_slot_is_the_last_before_the_speculative_scratch() -> None:
    assert running_slot([]) == ()
    assert running_slot([7]) == (7,)
    assert running_slot([0, 0, 7]) == (7,)  # leading null / superseded slots (align mode)
    assert running_slot([0, 7, 8, 9], spec_slots=2) == (7,)
    assert running_slot([7, 8], spec_slots=5) == (7,)  # never past the list's start


@dataclasses.dataclass
class _Request:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    status: str = "WAITING"
    max_tokens: int = 16
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    _all_token_ids: list[int] = dataclasses.field(default_factory=list)


def _prompt_request(rid: str, n: int, params: dict[str, Any]) -> _Request:
    ids = list(range(1, n + 1))
    return _Request(rid, params, n, prompt_token_ids=ids, _all_token_ids=list(ids))


def test_a_state_producer_computes_all_but_the_last_prompt_token_once() -> None:
    req = _prompt_request("p-1", 40, {"do_remote_decode": True})
    assert hold_back_last_token(req)
    assert req.num_prompt_tokens == 39 and len(req.prompt_token_ids) == 39
    assert len(req._all_token_ids) == 39 and req.max_tokens == 1
    assert not hold_back_last_token(req)  # rescheduled after preemption: not cut twice
    assert req.num_prompt_tokens == 39
    one = _prompt_request("p-2", 1, {"do_remote_decode": True})
    assert not hold_back_last_token(one) and one.num_prompt_tokens == 1
    s = SchedulerSide(
        engine_id="p", role=Role.PRODUCER, direction=Direction.PULL, block_size=BS, state=STATE
    )
    seen = _prompt_request("p-3", 40, {"do_remote_decode": True})
    s.on_new_request(seen)
    assert seen.num_prompt_tokens == 39
    plain = SchedulerSide(
        engine_id="p", role=Role.PRODUCER, direction=Direction.PULL, block_size=BS
    )
    attention_only = _prompt_request("p-4", 40, {"do_remote_decode": True})
    plain.on_new_request(attention_only)
    assert attention_only.num_prompt_tokens == 40


def _ticket(
    tokens: int, state_slot: int = 9, blocks: tuple[int, ...] = (1, 2, 3)
) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "cmpl-x-0-abcdef12",
        "remote_block_ids": [[state_slot], list(blocks)],
        "remote_num_tokens": tokens,
        "tp_size": 1,
    }


def _consumer() -> SchedulerSide:
    return SchedulerSide(
        engine_id="d",
        role=Role.CONSUMER,
        direction=Direction.PULL,
        block_size=BS,
        windows=(0, 0),
        state=STATE,
        spec_slots=(1, 0),
    )


def test_a_state_consumer_loads_exactly_the_tokens_the_producer_computed() -> None:
    s = _consumer()
    req = _Request("d-1", _ticket(39), num_prompt_tokens=40)
    assert s.get_num_new_matched_tokens(req, 0) == (39, True)
    # The state list is cut to the running slot (the spare speculative slot dropped).
    s.update_state_after_alloc(req, [[0, 5, 6], [11, 12, 13]], 39, 0)
    (load,) = s.build_step_plan().loads
    assert load.local_blocks == ((5,), (11, 12, 13)) and load.num_tokens == 39
    # A local prefix hit of one block: the state slot still moves, attention after it.
    hit = _Request("d-2", _ticket(39), num_prompt_tokens=40)
    assert s.get_num_new_matched_tokens(hit, BS) == (39 - BS, True)
    # A shorter ticket (a router that cut it) is h(30): decode computes tokens 31..40.
    cut = _Request("d-3", _ticket(30, blocks=(1, 2)), num_prompt_tokens=40)
    assert s.get_num_new_matched_tokens(cut, 0) == (30, True)


@pytest.mark.parametrize(
    ("tokens", "blocks", "why"),
    [
        (40, (1, 2, 3), "the whole prompt: decode would recompute the last token over h(N)"),
        (39, (1, 2), "blocks that hold fewer tokens than the state saw"),
    ],
)
def test_a_state_consumer_computes_the_prompt_itself_when_the_state_does_not_fit(
    tokens: int, blocks: tuple[int, ...], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    req = _Request("d-1", _ticket(tokens, blocks=blocks), num_prompt_tokens=40)
    assert _consumer().get_num_new_matched_tokens(req, 0) == (0, False), why
    assert "a Mamba/GDN state can only be loaded for fewer tokens" in caplog.text
