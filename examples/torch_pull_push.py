"""An engine's torch KV cache (on a GPU, or on the CPU) moved by kvxfer, pulled and pushed.

Two processes, each with a Qwen3-0.6B-shaped paged KV cache of per-layer torch tensors
``(2, num_blocks, block_size, kv_heads, head_dim)``, registered with
``Agent.register_tensors``. The producer "prefills" a prompt into its blocks (a seeded
pattern), the consumer receives it into other block ids, once by pull and once by push,
and compares every received block bit for bit with the producer's. Runs where torch
runs::

    python examples/torch_pull_push.py                 # cuda when torch sees a GPU
    python examples/torch_pull_push.py --device cpu --tokens 992

Between two processes of one GPU host UCX moves device memory with cuda_ipc (kvxfer
turns its GETs on for pulls: docs/OPERATIONS.md, "GPU hosts").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 8, 128, 16
SECRET = "the same secret on every instance"


def kv_caches(device: str, num_blocks: int, seeded: bool) -> list[Any]:
    """The engine's per-layer caches; ``seeded``: every word set from its position."""
    import torch

    caches = []
    for layer in range(LAYERS):
        t = torch.zeros(
            (2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device
        )
        if seeded:  # bit patterns (compared as int16 below: some are NaNs as bf16)
            words = torch.arange(t.numel(), device=device, dtype=torch.int64)
            mixed = (words * 2654435761 + layer * 7919).remainder(65536) - 32768
            t.view(torch.int16).copy_(mixed.to(torch.int16).view(t.shape))
        caches.append(t)
    return caches


def config(name: str, role: Any, direction: Any) -> Any:
    from kvxfer import AgentConfig, Fingerprint

    fingerprint = Fingerprint(
        model="example/qwen3-0.6b-shaped",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="example",
        direction=direction,
    )
    return AgentConfig(
        engine_id=name,
        fingerprint=fingerprint,
        role=role,
        direction=direction,
        auth_secret=SECRET,
        transfer_timeout_s=120,
    )


def producer(conn: Connection, device: str, num_blocks: int, prompt: list[int]) -> None:
    import msgspec
    import torch

    from kvxfer import Agent, Direction, Role

    caches = kv_caches(device, num_blocks, seeded=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # the "prefill" writes land before hold() names the blocks
    tokens = conn.recv()
    for direction in (Direction.PULL, Direction.PUSH):
        with Agent(config("prefill-0", Role.PRODUCER, direction)) as agent:
            agent.register_tensors(caches, block_size=BLOCK_SIZE)
            conn.send(agent.serve())
            rid = conn.recv()
            if direction is Direction.PUSH:
                # the consumer's registration is here
                _step_until(lambda r=rid, a=agent: r in a.holding(), f"{rid} registered")
            ticket = agent.hold(rid, prompt, num_tokens=tokens)
            conn.send(msgspec.to_builtins(ticket))
            # the engine's step loop; a lease or transfer timeout frees it at the latest
            _step_until(lambda r=rid, a=agent: r in a.freed(), f"{rid} freed")
            conn.send("freed")  # the blocks are the engine's again


def _step_until(done: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    """Poll ``done`` once a millisecond, as an engine's steps would, up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s:g} s")
        time.sleep(0.001)


def consumer(conn: Connection, device: str, num_blocks: int, prompt: list[int]) -> int:
    import msgspec
    import torch

    from kvxfer import Agent, Direction, Role, Ticket

    caches = kv_caches(device, num_blocks, seeded=False)
    expected = kv_caches(device, num_blocks, seeded=True)  # what the producer holds
    mine = [b + 3 for b in prompt]  # the decode engine's allocator chose other ids
    tokens = len(prompt) * BLOCK_SIZE
    conn.send(tokens)
    failures = 0
    for direction in (Direction.PULL, Direction.PUSH):
        for t in caches:
            t.zero_()
        with Agent(config("decode-0", Role.CONSUMER, direction)) as agent:
            agent.register_tensors(caches, block_size=BLOCK_SIZE)
            agent.serve()
            host, port = conn.recv()
            rid = f"request-{direction.value}"
            t0 = time.perf_counter()
            if direction is Direction.PULL:
                conn.send(rid)
                ticket = msgspec.convert(conn.recv(), Ticket)
                t0 = time.perf_counter()
                transfer = agent.pull(ticket, mine)
            else:
                # The producer's address is known ahead (a router tells it); the block
                # ids of its prompt come with its writes.
                stub = Ticket(
                    engine_id="prefill-0",
                    host=host,
                    port=port,
                    request_id=rid,
                    block_ids=((),),
                    num_tokens=tokens,
                )
                transfer = agent.expect_push(stub, mine)
                conn.send(rid)
                conn.recv()
            transfer.wait(timeout=120)
            seconds = time.perf_counter() - t0
            assert conn.recv() == "freed"  # close only once the producer let go
        src = torch.tensor(prompt, device=device)
        dst = torch.tensor(mine, device=device)
        same = all(
            torch.equal(
                c.view(torch.int16).index_select(1, dst), e.view(torch.int16).index_select(1, src)
            )
            for c, e in zip(caches, expected)
        )
        others = [b for b in range(num_blocks) if b not in set(mine)]
        untouched = all(
            not c.index_select(1, torch.tensor(others, device=device)).view(torch.int16).any()
            for c in caches
        )
        ok = same and untouched
        failures += not ok
        nbytes = transfer.stats.bytes
        print(
            f"{direction.value}: {nbytes / 1e6:.1f} MB of {len(prompt)} blocks in "
            f"{seconds * 1e3:.1f} ms (the first transfer, handshake included) on {device}: "
            + ("bit-exact" if ok else "MISMATCH"),
            flush=True,
        )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present)"
    )
    parser.add_argument("--tokens", type=int, default=4000, help="prompt tokens (whole blocks)")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    blocks = -(-args.tokens // BLOCK_SIZE)
    prompt = list(range(5, 5 + blocks))
    num_blocks = blocks + 16
    ctx = mp.get_context("spawn")  # CUDA does not survive a fork
    here, there = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(there, device, num_blocks, prompt))
    proc.start()
    try:
        failures = consumer(here, device, num_blocks, prompt)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return 1 if failures or proc.exitcode else 0


if __name__ == "__main__":
    sys.exit(main())
