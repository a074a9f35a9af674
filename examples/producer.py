"""A prefill engine embedding kvxfer: register the KV cache, serve, hold a finished prompt.

Run it, then give the ticket it prints to ``consumer.py``::

    python examples/producer.py > ticket.json &
    python examples/consumer.py ticket.json
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import numpy as np

from kvxfer import Agent, AgentConfig, Direction, Fingerprint, Role
from kvxfer.core.layout import KVLayout, KVPart, Region

BLOCK_SIZE, NUM_BLOCKS, LAYERS, TOKEN_BYTES = 16, 256, 4, 8 * 128 * 2  # 8 heads × 128 × bf16

# The engine's paged KV cache: one array per (layer, K|V); block b is row b.
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

with Agent(
    AgentConfig(engine_id="prefill-0", fingerprint=fingerprint, role=Role.PRODUCER)
) as agent:
    agent.register(layout)
    agent.serve()
    # "prefill" a 100-token prompt into blocks 10..16 (the engine's allocator chose them)
    blocks = list(range(10, 17))
    for a in caches:
        a[blocks] = np.arange(len(blocks), dtype=np.uint8)[:, None] + 1
    ticket = agent.hold("request-1", blocks, num_tokens=100)
    print(json.dumps(msgspec.to_builtins(ticket)), flush=True)
    # step loop: free the blocks once the consumer has pulled them (or the lease expired)
    while "request-1" not in agent.freed():
        time.sleep(0.01)
    print("request-1 pulled; blocks freed", file=sys.stderr)
