"""Two Agent processes on two "hosts" for the process tests: network namespaces joined
by a veth pair shaped with ``tc tbf``, NIXL over UCX's TCP transport (not CMA), and a
Qwen3-0.6B-shaped cache (28 layers x 8 KV heads x 128, bf16: 112 KiB a token)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator

import pytest

from kvxfer.tools.bench.netns import NetnsPair, netns_pair, netns_unavailable
from tests.agent_proc import ProcSpec

BLOCK = 16


def qwen_spec(
    engine_id: str, direction: str, role: str, ns: str, host: str, *, num_blocks: int
) -> ProcSpec:
    """One side, in namespace ``ns`` with its side channel on ``host``."""
    return ProcSpec(
        engine_id=engine_id,
        role=role,
        direction=direction,
        layers=28,
        kv_heads=8,
        head_dim=128,
        block_size=BLOCK,
        num_blocks=num_blocks,
        fill_seed=7 if role == "kv_producer" else None,
        transfer_timeout_s=60.0,
        lease_s=120.0,
        netns=ns,
        host=host,
        ucx_tls="tcp",
        handshake_timeout_s=10.0,
    )


@contextlib.contextmanager
def shaped_hosts(rate: str, latency: str) -> Iterator[NetnsPair]:
    """Two namespaces (named after this process: runs side by side never clash), the
    veth shaped to ``rate`` each way, removed on exit."""
    why = netns_unavailable()
    if why is not None:  # CI runs as root with iproute2: a missing piece is a failure
        pytest.fail(f"two-host tests need network namespaces: {why}")
    with netns_pair() as pair:
        ends = ((pair.producer_ns, pair.producer_dev), (pair.consumer_ns, pair.consumer_dev))
        for ns, dev in ends:
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", rate, "burst", "256kb", "latency", latency],
                check=True,
                capture_output=True,
            )  # fmt: skip
        yield pair
