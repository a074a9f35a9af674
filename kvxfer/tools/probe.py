"""``kvxfer probe HOST:PORT``: ask a running instance who it is and whether we could pair.

It sends a ``Ping`` over the side channel and prints the instance's engine id, role,
direction, protocol version, compatibility hash and KV layout. Given a local model
description (``--model``, ``--dtype`` …) it computes the local hash and says whether
the two would pair, naming every difference: the seed's "registered but never
handshakes" case, diagnosed from one host without reading two engines' logs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvxfer._version import PROTOCOL_VERSION
from kvxfer.adapters.vllm.kv_transfer_config import CONNECTORS
from kvxfer.core import wire
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import KvxferError
from kvxfer.types import Direction

__all__ = ["main", "probe"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvxfer probe", description=__doc__.split("\n\n")[0])
    p.add_argument("address", help="the instance's side channel, HOST:PORT")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per try (3)")
    p.add_argument("--retries", type=int, default=1, help="further tries after a timeout (1)")
    p.add_argument("--secret", help="side-channel shared secret, if the instance uses one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    local = p.add_argument_group("local config to check compatibility against")
    local.add_argument("--model", help="model name (as both engines resolve it)")
    local.add_argument("--revision", default="", help="model revision")
    local.add_argument("--dtype", default="bfloat16", help="model dtype (bfloat16)")
    local.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype (auto: --dtype)")
    local.add_argument("--attention-backend", default="", help="attention backend name")
    local.add_argument("--draft-model", default="", help="speculative-decoding draft model")
    local.add_argument(
        "--kv-connector",
        default="RblnNixlPullConnector",
        help="connector name; picks the direction (RblnNixlPullConnector)",
    )
    local.add_argument("--block-size", type=int, help="local block_size")
    local.add_argument("--engine-id", help="the engine id a consumer would expect")
    return p


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvxferError(f"address {address!r}: expected HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def probe(
    host: str, port: int, *, timeout_s: float = 3.0, retries: int = 1, secret: str | None = None
) -> wire.Pong:
    """Ping the side channel at ``host:port`` and return its answer.

    Raises:
        HandshakeTimeout: nothing answered (the message names the address and setting).
        HandshakeRejected: the instance refused the ping (e.g. authentication).
        ProtocolVersionError: it speaks another kvxfer protocol version.
    """
    from kvxfer.io.control import SideChannelClient

    key = secret.encode() if secret else None
    frame = wire.encode(wire.Ping(engine_id="kvxfer-probe"), "", auth_key=key)
    client = SideChannelClient(timeout_s=timeout_s, retries=retries)
    reply = wire.decode(client.request(host, port, frame))
    message = reply.message
    if isinstance(message, wire.Reject):
        from kvxfer.errors import HandshakeRejected

        raise HandshakeRejected(message.code.value, f"peer at {host}:{port}: {message.reason}")
    if not isinstance(message, wire.Pong):
        raise KvxferError(f"peer at {host}:{port} answered a ping with {type(message).__name__}")
    return message


def _compatibility(pong: wire.Pong, args: argparse.Namespace) -> dict[str, Any]:
    problems: list[str] = []
    direction = CONNECTORS.get(args.kv_connector)
    if direction is None:
        problems.append(f"unknown --kv-connector {args.kv_connector!r}")
        direction = Direction.PULL
    local_hash = None
    if args.model:
        fp = Fingerprint(
            model=args.model,
            revision=args.revision,
            dtype=args.dtype,
            # vLLM hashes the resolved name: "auto" is the model dtype.
            kv_cache_dtype=args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
            attention_backend=args.attention_backend,
            direction=direction,
            draft_model=args.draft_model,
        )
        local_hash = fp.digest()
        if local_hash != pong.compat_hash:
            problems.append(
                "compatibility hash differs: model, revision, dtype, KV cache dtype, attention "
                "backend, direction, draft model or kvxfer protocol differ "
                f"(local {local_hash[:16]}…, remote {pong.compat_hash[:16]}…)"
            )
    if pong.protocol_version != PROTOCOL_VERSION:
        problems.append(f"protocol {pong.protocol_version} vs local {PROTOCOL_VERSION}")
    if pong.direction is not None and pong.direction is not direction:
        problems.append(
            f"the instance is a {pong.direction.value} instance, local is {direction.value}"
        )
    if pong.layout is None:
        problems.append("the instance has not registered its KV memory yet (deferred or failed)")
    elif args.block_size is not None and pong.layout.block_size != args.block_size:
        problems.append(f"block_size {pong.layout.block_size} vs local {args.block_size}")
    if args.engine_id is not None and pong.engine_id != args.engine_id:
        problems.append(f"engine id is {pong.engine_id!r}, expected {args.engine_id!r}")
    return {"compatible": not problems, "local_compat_hash": local_hash, "problems": problems}


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 when the instance answered (and, with a local config, is compatible)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.model and args.dtype.strip().lower() == "auto":
        # The instance hashed its resolved dtype; "auto" here can never match it.
        parser.error("--dtype must be the model's resolved dtype (e.g. bfloat16), not auto")
    try:
        host, port = _split(args.address)
        t0 = time.perf_counter()
        pong = probe(host, port, timeout_s=args.timeout, retries=args.retries, secret=args.secret)
        rtt = time.perf_counter() - t0
    except KvxferError as exc:
        if args.json:
            print(json.dumps({"reachable": False, "error": str(exc)}))
        else:
            print(f"kvxfer probe: {exc}", file=sys.stderr)
        return 1
    check = _compatibility(pong, args)
    checked = bool(args.model or args.block_size or args.engine_id)
    result = {
        "reachable": True,
        "address": f"{host}:{port}",
        "rtt_s": rtt,
        "engine_id": pong.engine_id,
        "incarnation": f"{pong.incarnation:016x}",
        "role": pong.role.value if pong.role else None,
        "direction": pong.direction.value if pong.direction else None,
        "protocol_version": pong.protocol_version,
        "software_version": pong.software_version,
        "compat_hash": pong.compat_hash,
        "registered": pong.layout is not None,
        "layout": msgspec.to_builtins(pong.layout) if pong.layout is not None else None,
        "layout_summary": pong.layout_summary,
        **check,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{host}:{port} answered in {rtt * 1000:.1f} ms")
        for key in (
            "engine_id",
            "incarnation",
            "role",
            "direction",
            "protocol_version",
            "software_version",
            "compat_hash",
        ):
            print(f"  {key:<17} {result[key]}")
        print(f"  {'layout':<17} {pong.layout_summary or 'not registered yet'}")
        if checked:
            verdict = "compatible" if check["compatible"] else "NOT compatible"
            print(f"  {'local config':<17} {verdict}")
            for problem in check["problems"]:
                print(f"    - {problem}")
    return 0 if (check["compatible"] or not checked) else 1
