"""A decode engine embedding kvxfer: pull a prompt's KV from the producer's ticket.

python examples/consumer.py ticket.json      (or the ticket JSON on stdin)
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import numpy as np

from kvxfer import Agent, AgentConfig, Direction, Fingerprint, Role, Ticket
from kvxfer.core.layout import KVLayout, KVPart, Region

BLOCK_SIZE, NUM_BLOCKS, LAYERS, TOKEN_BYTES = 16, 256, 4, 8 * 128 * 2

caches = [np.zeros((NUM_BLOCKS, BLOCK_SIZE * TOKEN_BYTES), np.uint8) for _ in range(LAYERS * 2)]
layout = KVLayout(
    block_size=BLOCK_SIZE,
    regions=tuple(
        Region(
            base=a.ctypes.data,
            num_blocks=NUM_BLOCKS,
            stride=a.strides[0],
            block_len=a.strides[0],
            layer=i // 2,
            part=KVPart.K if i % 2 == 0 else KVPart.V,
        )
        for i, a in enumerate(caches)
    ),
)
fingerprint = Fingerprint(
    model="example/model",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="example",
    direction=Direction.PULL,
)

raw = Path(sys.argv[1]).read_text() if len(sys.argv) > 1 else sys.stdin.readline()
ticket = msgspec.json.decode(raw, type=Ticket)

with Agent(AgentConfig(engine_id="decode-0", fingerprint=fingerprint, role=Role.CONSUMER)) as agent:
    agent.register(layout)
    local_blocks = [40, 41, 42, 43, 44, 45, 46]  # where our allocator wants the prompt
    transfer = agent.pull(ticket, local_blocks)
    transfer.wait(timeout=30)  # or transfer.poll() from the engine's step loop, or await it
    expected = np.arange(len(local_blocks), dtype=np.uint8)[:, None] + 1
    assert all((a[local_blocks] == expected).all() for a in caches), "KV bytes differ"
    print(f"pulled {transfer.stats.bytes} bytes in {transfer.stats.transfer_s * 1e3:.1f} ms: OK")
