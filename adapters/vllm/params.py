"""kvxfer tickets <-> vLLM's ``kv_transfer_params``: the one place that maps them.

A producer's scheduler side hands the consumer a :class:`~kvxfer.agent.Ticket` as
upstream-shaped ``kv_transfer_params`` (:func:`ticket_params`), so routers written
for vLLM's NIXL connector forward it untouched; a consumer's worker side reads it back
per tensor-parallel rank (:func:`remote_ticket`, :func:`release_ticket`). Every read
checks its key and fails with :class:`~kvxfer.errors.ConfigError` naming the key, the
value and the rule; block lists go through :func:`kvxfer.core.blocks.block_groups`
(integers only, no repeats; a flat list is one KV group).

Keys, upstream's first::

    do_remote_prefill, do_remote_decode   what the instance receiving the params does
    remote_engine_id, remote_host,        the producer and rank 0's side channel
    remote_port                           (rank r listens on remote_port + r)
    remote_request_id                     the producer's vLLM request id
    remote_block_ids                      one list per KV group (or one flat list)
    tp_size, pp_size                      the producer's parallel sizes
    remote_num_tokens                     kvxfer: tokens the held blocks end at
    transfer_mode                         kvxfer: "pull" or "push" (which connector)
    remote_incarnation(s)                 kvxfer: rank 0's / every rank's incarnation
                                          (64-bit: 16-hex-digit string(s))
    lease_expiry                          kvxfer: wall-clock end of the producer's lease
                                          (seconds since the epoch, a finite number)
    kvxfer_capability                     kvxfer: the hold's token (frees / asks about it);
                                          push: minted by the router, sent to both
                                          instances, pins the hold to decode's
                                          registration
    kvxfer_guard_slot, kvxfer_generation  kvxfer: the hold's guard word (fail-closed
                                          pulls, docs/RELIABILITY.md); same on every rank;
                                          the generation (56-bit) a 16-hex-digit string

Routers parse JSON: one written in Go (llm-d's routing sidecar and EPP) or JavaScript
reads every number as a float64 and writes back the nearest one, so an integer at or
above 2**53 may come back changed (a producer's incarnation off by a few hundred, and
the consumer refuses the load as if the producer had restarted). Every value here
therefore survives a float64 round trip exactly: the integers are small (upstream's
keys, ``remote_num_tokens``, ``kvxfer_guard_slot``; below 2**53), ``lease_expiry`` is a
float64 already, and the 64-bit values (incarnations, generation) are lowercase
16-hex-digit strings. The read side takes back what such a router may write: an
integral float (``5600.0``) for an integer below 2**53. It refuses, naming the key: a
JSON number at or above 2**53 where an integer is read (an older producer's integer
incarnation: a float64 parser may have rounded it, so it cannot be trusted), a
fractional, infinite or NaN number where an integer is, and a NaN or infinite
``lease_expiry``.

No vLLM or torch imports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvxfer.agent import Ticket
from kvxfer.core.blocks import block_groups, from_wire, pair_remote, to_wire
from kvxfer.errors import ConfigError, PlanError
from kvxfer.types import Direction

__all__ = [
    "PULL_KEYS",
    "PUSH_KEYS",
    "WireGroups",
    "across_tp",
    "is_remote_prefill",
    "pairing_error",
    "release_ticket",
    "remote_block_groups",
    "remote_block_size",
    "remote_num_tokens",
    "remote_ticket",
    "router_capability",
    "ticket_params",
]

#: Block ids as tickets carry them: one tuple of ints per KV group.
WireGroups = tuple[tuple[int, ...], ...]

#: Keys a pull consumer needs to reach the producer's blocks.
PULL_KEYS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
#: Keys a push consumer needs: the producer's address (it learns nothing else first).
PUSH_KEYS = ("remote_engine_id", "remote_host", "remote_port")

_WHERE = "kv_transfer_params"

#: Every integer of magnitude below this is a float64 exactly, so a Go or JavaScript
#: router's JSON round trip gives it back unchanged; at 2**53 and above neighbours
#: collapse (2**53 + 1 reads as 2**53), so a value received there may be a rounded one.
_EXACT_LIMIT = 2**53
#: Bits of an incarnation (the Agent draws 63) and of a guard generation (_guard.py).
_INCARNATION_BITS = 64
_GENERATION_BITS = 56
_HEX16 = re.compile(r"[0-9a-f]{16}")
_ROUNDED = (
    "is a JSON number >= 2**53, which a float64 JSON parser (a Go or JavaScript "
    "router) may have rounded; kvxfer producers send it as a 16-hex-digit string "
    "(an older producer sent an integer: upgrade it)"
)


def _hex16(value: int) -> str:
    # Zero-padded, so every value has one spelling (logs print incarnations the same
    # way: "inc=%016x").
    return f"{value:016x}"


def ticket_params(
    ticket: Ticket, *, direction: Direction, incarnations: Sequence[int] = ()
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a producer returns for ``ticket``.

    Every value survives a float64 JSON parser (a Go or JavaScript router) exactly:
    incarnations and the guard generation are 16-hex-digit strings, every number is
    an integer below 2**53 or ``lease_expiry``'s float.

    Args:
        ticket: Rank 0's ticket (its port and incarnation are rank 0's).
        direction: The producer's connector (``transfer_mode``).
        incarnations: Every rank's incarnation, in rank order (rank r's ticket uses
            entry r).
    """
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": ticket.engine_id,
        "remote_host": ticket.host,
        "remote_port": ticket.port,
        "remote_request_id": ticket.request_id,
        "remote_block_ids": [list(g) for g in ticket.block_ids],
        "remote_num_tokens": ticket.num_tokens,
        **({"remote_block_size": ticket.block_size} if ticket.block_size else {}),
        "tp_size": ticket.tp_size,
        "pp_size": 1,
        "transfer_mode": direction.value,
        # Strings: a float64 router would round these 64- and 56-bit values.
        "remote_incarnation": _hex16(ticket.incarnation),
        "remote_incarnations": [_hex16(i) for i in incarnations],
        "lease_expiry": ticket.lease_expiry,
        "kvxfer_capability": ticket.capability,
        "kvxfer_guard_slot": ticket.guard_slot,
        "kvxfer_generation": _hex16(ticket.generation),
    }


def is_remote_prefill(params: Mapping[str, Any] | None, direction: Direction) -> bool:
    """True when ``params`` ask this (decode) instance to take the prompt's KV remotely
    and name the producer completely enough for ``direction``."""
    if not params or not params.get("do_remote_prefill"):
        return False
    keys = PUSH_KEYS if direction is Direction.PUSH else PULL_KEYS
    return all(params.get(k) is not None for k in keys)


def _bad(key: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{_WHERE}.{key}", value, rule)


def _required(params: Mapping[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise _bad(key, value, "is required for a remote prefill")
    return value


def _is_big(value: Any) -> bool:
    """A JSON number at or beyond 2**53 in magnitude (a float64 may have rounded it)."""
    if type(value) is float:
        return math.isfinite(value) and abs(value) >= _EXACT_LIMIT
    return type(value) is int and abs(value) >= _EXACT_LIMIT


def _exact(value: Any) -> int | None:
    """``value`` as the integer it is when a float64 JSON round trip cannot have
    changed it, else None.

    An integral float counts (a float64 router may write ``5600`` back as
    ``5600.0``); ``bool`` does not (JSON ``true`` is not a number).
    """
    kind = type(value)
    if kind is int:
        return value if -_EXACT_LIMIT < value < _EXACT_LIMIT else None
    if kind is float and value.is_integer() and -_EXACT_LIMIT < value < _EXACT_LIMIT:
        return int(value)
    return None


def _int(params: Mapping[str, Any], key: str, default: int, *, minimum: int = 0) -> int:
    value = params.get(key)
    if value is None:
        return default
    if _is_big(value):
        raise _bad(
            key,
            value,
            f"must be an integer >= {minimum} below 2**53: a float64 JSON parser (a Go "
            "or JavaScript router) rounds larger ones",
        )
    exact = _exact(value)
    if exact is None or exact < minimum:
        raise _bad(key, value, f"must be an integer >= {minimum}")
    return exact


def _float(params: Mapping[str, Any], key: str) -> float:
    value = params.get(key)
    if value is None:
        return 0.0
    if type(value) is int:
        # An integer beyond 2**53 is not the number the producer meant (and one beyond
        # float's range does not convert at all).
        if _exact(value) is None:
            raise _bad(key, value, "must be a finite number below 2**53")
        return float(value)
    if type(value) is not float or not math.isfinite(value):
        # An infinite lease would never expire; NaN compares false with every clock.
        raise _bad(key, value, "must be a finite number")
    return value


def _u64(value: Any, bits: int) -> int | str:
    """A 64-bit value (``bits`` wide) as the producer sent it, or why not (a rule).

    kvxfer writes 16 lowercase hex digits; an integer below 2**53 (a hand-made ticket,
    an older producer's small value) is exact and taken as is.
    """
    if type(value) is str:
        if not _HEX16.fullmatch(value):
            return f"must be 16 lowercase hex digits (a {bits}-bit value)"
        number = int(value, 16)
        return number if number < 1 << bits else f"must be below 2**{bits}"
    if _is_big(value):
        return _ROUNDED
    exact = _exact(value)
    if exact is None or exact < 0:
        return f"must be 16 lowercase hex digits (a {bits}-bit value), or an integer >= 0"
    return exact


def _hex_key(params: Mapping[str, Any], key: str, bits: int) -> int:
    value = params.get(key)
    if value is None:
        return 0
    got = _u64(value, bits)
    if isinstance(got, str):
        raise _bad(key, value, got)
    return got


def _str(params: Mapping[str, Any], key: str) -> str:
    value = _required(params, key)
    if not isinstance(value, str) or not value:
        raise _bad(key, value, "must be a non-empty string")
    return value


def remote_block_groups(params: Mapping[str, Any]) -> WireGroups:
    """``remote_block_ids`` as one tuple per KV group (empty when absent: push).

    Raises:
        ConfigError: not a list of integer ids (or of such lists), or an id repeated.
    """
    raw = params.get("remote_block_ids")
    if raw is None or (isinstance(raw, list | tuple) and not raw):
        return ()
    nested = isinstance(raw, list | tuple) and isinstance(raw[0], list | tuple)
    num_groups = len(raw) if nested else 1
    try:
        groups = block_groups(raw, num_groups, side="remote")
    except PlanError as exc:
        # Only a refused list pays for the second pass: ids a float64 router wrote
        # back as integral floats (``12.0``) are the ids the producer sent.
        ints = _integral_ids(raw, nested)
        if ints is None:
            raise _bad("remote_block_ids", raw, str(exc)) from None
        try:
            groups = block_groups(ints, num_groups, side="remote")
        except PlanError as again:
            raise _bad("remote_block_ids", raw, str(again)) from None
    for g, ids in enumerate(groups):
        if ids.size and int(ids.max()) >= _EXACT_LIMIT:
            raise _bad(
                "remote_block_ids",
                raw,
                f"group {g} has an id >= 2**53, which a float64 JSON parser (a Go or "
                "JavaScript router) may have rounded",
            )
    return to_wire(groups)


def _integral_ids(raw: Any, nested: bool) -> list[Any] | None:
    """``raw`` with every integral float below 2**53 made an int (None when it holds
    no float: nothing to retry)."""
    if not isinstance(raw, list | tuple):
        return None
    rows = raw if nested else [raw]
    if not all(isinstance(r, list | tuple) for r in rows):
        return None
    if not any(type(i) is float for r in rows for i in r):
        return None
    out = [[_from_float(i) for i in r] for r in rows]
    return out if nested else out[0]


def _from_float(item: Any) -> Any:
    # Anything else stays as it was, for block_groups to name in its refusal.
    exact = _exact(item) if type(item) is float else None
    return item if exact is None else exact


def remote_num_tokens(params: Mapping[str, Any]) -> int | None:
    """``remote_num_tokens`` when given and > 0 (older producers leave it out).

    Raises:
        ConfigError: not an integer >= 0.
    """
    value = _int(params, "remote_num_tokens", 0)
    return value or None


def remote_block_size(params: Mapping[str, Any], local: int) -> int:
    """The producer's tokens per block (``remote_block_size``; ``local`` when an older
    producer leaves it out).

    Raises:
        ConfigError: not an integer >= 0.
    """
    return _int(params, "remote_block_size", 0) or local


def pairing_error(params: Mapping[str, Any], direction: Direction, tp_size: int) -> str | None:
    """Why this instance cannot take the producer's KV at all (None when it can).

    Upstream's ``transfer_mode`` names the producer's connector: a pull/push mix is
    refused by name here (without the key the handshake refuses it, on the
    compatibility hash). Across TP sizes a decode rank reads (pull) or receives
    (push) from the producer ranks holding its heads; that is not refused here.
    """
    mode = params.get("transfer_mode")
    if mode is not None and mode != direction.value:
        return (
            f"the producer {params.get('remote_engine_id')} runs the {mode} connector "
            f"(transfer_mode {mode!r}) but this instance runs the {direction.value} "
            "connector: pair pull with pull, push with push"
        )
    return None


def across_tp(params: Mapping[str, Any], tp_size: int) -> bool:
    """Whether the producer's ``tp_size`` differs from this instance's ``tp_size``
    (a float64 router's ``2.0`` is 2; a malformed one is refused by :func:`remote_ticket`)."""
    remote_tp = _exact(params.get("tp_size"))
    return remote_tp is not None and remote_tp != tp_size


def _incarnations(params: Mapping[str, Any]) -> tuple[int, ...]:
    many = params.get("remote_incarnations")
    if many is None:
        return ()
    if not isinstance(many, list | tuple):
        raise _bad("remote_incarnations", many, "must be a list, one incarnation per rank")
    out = []
    for rank, value in enumerate(many):
        got = _u64(value, _INCARNATION_BITS)
        if isinstance(got, str):
            raise _bad("remote_incarnations", many, f"rank {rank}'s entry {value!r} {got}")
        out.append(got)
    return tuple(out)


def _rank_incarnation(params: Mapping[str, Any], tp_rank: int) -> int:
    many = _incarnations(params)
    # Checked on every rank: a bad rank-0 value is the same ticket's fault everywhere.
    first = _hex_key(params, "remote_incarnation", _INCARNATION_BITS)
    if tp_rank < len(many):
        return many[tp_rank]
    return first if tp_rank == 0 else 0


def _address(params: Mapping[str, Any], tp_rank: int) -> tuple[str, str, int]:
    engine_id = _str(params, "remote_engine_id")
    host = _str(params, "remote_host")
    _required(params, "remote_port")
    port = _int(params, "remote_port", 0, minimum=1) + tp_rank
    if port > 65535:
        raise _bad("remote_port", params["remote_port"], f"rank {tp_rank}'s port {port} > 65535")
    return engine_id, host, port


def remote_ticket(
    params: Mapping[str, Any],
    *,
    tp_rank: int,
    transfer_id: str,
    local_blocks: WireGroups,
    skip_blocks: int = 0,
    num_tokens: int = 0,
    block_size: int = 0,
    state: Sequence[bool] = (),
) -> Ticket:
    """The :class:`~kvxfer.agent.Ticket` rank ``tp_rank`` pulls (or expects a push) with.

    Upstream's convention: the producer advertises rank 0's side channel and rank *r*
    listens on ``remote_port + r``; kvxfer adds each rank's incarnation in
    ``remote_incarnations``. The remote blocks are cut to what this request needs: the
    leading ``skip_blocks`` are local prefix hits, and the producer may hold more
    blocks than the prompt fills (it decoded further). A push ticket may carry no
    blocks at all (the producer's are matched by id there).

    Args:
        params: The producer's ``kv_transfer_params``.
        tp_rank: This worker's tensor-parallel rank.
        transfer_id: The id the producer's Agent knows the request by.
        local_blocks: The consumer's blocks receiving the KV, one tuple per group.
        skip_blocks: Leading remote blocks that are local prefix-cache hits.
        num_tokens: The token count the local blocks end at.
        block_size: Tokens per block. With it (and ``num_tokens`` and the producer's
            ``remote_num_tokens``) each group's lists are paired by the request's
            block index, both ending at their last token's block: a sliding-window
            group's lists hold only the window's blocks (R-HYB-1). Without it, the
            lists pair from the front after ``skip_blocks``.
        state: Per group, True for a recurrent-state group: its lists name state
            slots, which pair one to one and are never skipped.

    Raises:
        ConfigError: a key missing or malformed (named with its value and rule).
    """
    engine_id, host, port = _address(params, tp_rank)
    remote = remote_block_groups(params)
    remote_num_tokens(params)  # checked here too: the scheduler side relies on it
    if remote:
        if len(remote) != len(local_blocks):
            raise _bad(
                "remote_block_ids",
                params.get("remote_block_ids"),
                f"{len(remote)} KV group(s), this instance has {len(local_blocks)}",
            )
        remote_tokens = remote_num_tokens(params)
        theirs = remote_block_size(params, block_size)
        if block_size > 0 and theirs != block_size:
            # Another block size at the producer: its lists from block 0, cut to the
            # blocks of this request's tokens; the Agent pairs them unit by unit
            # (kvxfer.core.ratio), a prefix hit shortening the local lists only.
            filled = -(-num_tokens // theirs)
            blocks = tuple(r[:filled] for r in remote)
        elif block_size > 0 and num_tokens > 0 and remote_tokens:
            blocks = _by_block_index(
                params,
                remote,
                local_blocks,
                remote_tokens,
                num_tokens,
                block_size,
                transfer_id,
                tuple(state),
            )
        else:
            blocks = tuple(
                r[: len(g)] if g_state else r[skip_blocks : skip_blocks + len(g)]
                for r, g, g_state in zip(
                    remote, local_blocks, _state_flags(state, len(remote)), strict=True
                )
            )
    else:
        blocks = tuple(() for _ in local_blocks)
    return Ticket(
        engine_id=engine_id,
        host=host,
        port=port,
        request_id=transfer_id,
        block_ids=blocks,
        num_tokens=num_tokens,
        incarnation=_rank_incarnation(params, tp_rank),
        lease_expiry=_float(params, "lease_expiry"),
        tp_size=_int(params, "tp_size", 1, minimum=1),
        incarnations=_incarnations(params),
        capability=_capability(params),
        guard_slot=_int(params, "kvxfer_guard_slot", -1, minimum=-1),
        generation=_hex_key(params, "kvxfer_generation", _GENERATION_BITS),
        block_size=remote_block_size(params, block_size) if block_size > 0 else 0,
    )


def _by_block_index(
    params: Mapping[str, Any],
    remote: WireGroups,
    local: WireGroups,
    remote_tokens: int,
    num_tokens: int,
    block_size: int,
    transfer_id: str,
    state: tuple[bool, ...] = (),
) -> WireGroups:
    """Pair each group's remote and local lists by the request's block index, with the
    core's one pairing routine (:func:`kvxfer.core.blocks.pair_remote`): both lists end at
    their request's last block. A remote list longer than the prompt's blocks (a
    producer that does not cut: it decoded further) starts at block 0."""
    held = -(-remote_tokens // block_size)
    try:
        paired = pair_remote(
            from_wire(local),
            from_wire(
                tuple(
                    r if g_state else r[:held]
                    for r, g_state in zip(remote, _state_flags(state, len(remote)), strict=True)
                )
            ),
            num_tokens=num_tokens,
            remote_num_tokens=remote_tokens,
            block_size=block_size,
            request_id=transfer_id,
            state=state,
        )
    except PlanError as exc:
        raise _bad("remote_block_ids", params.get("remote_block_ids"), str(exc)) from exc
    return to_wire(paired)


def _state_flags(state: Sequence[bool], num_groups: int) -> tuple[bool, ...]:
    """``state`` padded with False to ``num_groups`` entries."""
    return tuple(bool(state[g]) if g < len(state) else False for g in range(num_groups))


def router_capability(params: Mapping[str, Any]) -> str:
    """A push request's ``kvxfer_capability`` as the router minted it for both
    instances ("" when absent).

    Raises:
        ConfigError: the value is not a lowercase hex token of at most 64 digits.
    """
    return _capability(params)


def _capability(params: Mapping[str, Any]) -> str:
    value = params.get("kvxfer_capability") or ""
    if not isinstance(value, str) or len(value) > 64 or value.strip("0123456789abcdef"):
        raise _bad("kvxfer_capability", value, "must be a lowercase hex token of <= 64 digits")
    return value


def release_ticket(
    params: Mapping[str, Any], *, tp_rank: int, transfer_id: str, expiry: bool = False
) -> Ticket:
    """The ticket a consumer aborts to tell rank ``tp_rank`` of the producer to free
    ``transfer_id`` now (it names the producer, no blocks), or, with ``expiry``, keeps
    alive (it also carries the lease's ``lease_expiry``). Across TP sizes pass
    ``tp_rank=0``: the ticket then carries the producer's ``tp_size`` and
    ``Agent.abort`` tells every producer rank this decode rank reads.

    Raises:
        ConfigError: the producer's address keys missing or malformed, or (with
            ``expiry``) ``lease_expiry`` malformed; an abort never reads it.
    """
    engine_id, host, port = _address(params, tp_rank)
    return Ticket(
        engine_id=engine_id,
        host=host,
        port=port,
        request_id=transfer_id,
        block_ids=((),),
        num_tokens=0,
        lease_expiry=_float(params, "lease_expiry") if expiry else 0.0,
        tp_size=_int(params, "tp_size", 1, minimum=1),
        incarnations=_incarnations(params),
        capability=_capability(params),
    )
