"""TCP ports for the suite's servers and side channels, picked below the kernel's
ephemeral range.

A port the kernel picked (``bind(0)``) can be handed by it to any other socket before
the server binds it: UCX and ZMQ open many. Below the range only another picker can
take it, and the suite has two: CI runs two pytest processes side by side
(``scripts/run_tests.sh``), and a vLLM server of one half, still importing, once found
its port bound by the other half's ZMQ side channel and answered its health checks
with ZMTP bytes. So each process picks only from its own part of the range,
``KVXFER_TEST_PORTS`` (``LOW-HIGH``, both included), which the script gives each half;
unset, the whole range. Within a process no port is handed out twice.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ENV", "free_base_port", "free_port", "port_range"]

ENV = "KVXFER_TEST_PORTS"
_LOW = 20000
_HANDED_OUT: set[int] = set()


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """``(low, high)``, both included: where this process picks ports."""
    top = min(_ephemeral_floor(), 32768) - 1
    spec = os.environ.get(ENV, "")
    if not spec:
        return _LOW, top
    try:
        low, high = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: must be LOW-HIGH, two port numbers") from None
    if not 1024 <= low <= high <= top:
        raise ValueError(f"{ENV}={spec!r}: must lie within 1024-{top}, low first")
    return low, high


def free_base_port(span: int = 1, hosts: Sequence[str] = ("127.0.0.1",)) -> int:
    """A base port whose ``span`` ports all bind on every host in ``hosts`` right now
    and were never handed out by this process."""
    low, high = port_range()
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, high - span + 2)
        ports = range(base, base + span)
        if any(p in _HANDED_OUT for p in ports):
            continue
        socks: list[socket.socket] = []
        try:
            for host in hosts:
                for port in ports:
                    socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    socks[-1].bind((host, port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        _HANDED_OUT.update(ports)
        return base
    raise RuntimeError(f"no {span} free consecutive port(s) in {low}-{high} on {list(hosts)}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now and never handed out by this process."""
    return free_base_port(1, (host,))
