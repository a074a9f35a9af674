"""Disaggregated prefill/decode of the toy engine with kvxfer, pull and push.

Two processes, each with its own :class:`~toy_engine.ToyEngine` (same weights,
different block ids): a prefill instance (a child process) and a decode instance (this
one). The "router" is a pipe between them: the prompt goes to prefill, the ticket comes
back. For every prompt the decode instance's greedy output must equal a single-process
run of the same engine (which itself must equal transformers' own no-cache forward); a
negative control decodes with the KV *not* transferred and must differ.

    python examples/engine/disagg.py [--prompts 6] [--steps 16] [--direction pull push]

Everything kvxfer here comes from ``kvxfer.__all__``; the glue is the functions
``make_agent``, ``prefill_instance`` and ``transfer_kv``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # toy_engine, next to us

from toy_engine import Sequence, ToyEngine, build_model, hf_greedy

from kvxfer import (
    Agent,
    AgentConfig,
    Direction,
    Fingerprint,
    Role,
    Ticket,
    Transfer,
    TransferState,
)


def make_agent(engine: ToyEngine, engine_id: str, role: Role, direction: Direction) -> Agent:
    """One Agent per engine process: identity, direction, and the engine's KV pools."""
    fingerprint = Fingerprint(
        model="toy-qwen2-seed0",
        dtype="float32",
        kv_cache_dtype="float32",  # a resolved name: never "auto"
        attention_backend="toy-paged",
        direction=direction,
    )
    agent = Agent(
        AgentConfig(
            engine_id=engine_id,
            fingerprint=fingerprint,
            role=role,
            direction=fingerprint.direction,  # must equal it: a contradiction is refused
            side_channel_host="127.0.0.1",  # on two hosts: this host's routable address
        )
    )
    # (2, num_blocks, block_size, kv_heads, head_dim) per layer -> a K and a V region
    # per layer. The agent keeps the tensors alive until close(); they must stay in
    # place (a re-allocated pool needs a new agent).
    agent.register_tensors(engine.kv_caches, block_size=engine.block_size)
    return agent


# -- prefill instance (child process) --------------------------------------------------
def prefill_instance(conn: Connection) -> None:
    """The prefill engine's loop: run prompts, hold their blocks, free what was sent."""
    engine = ToyEngine(build_model(), seed=11)
    agent: Agent | None = None
    held: dict[str, Sequence] = {}
    while True:
        if agent is not None:
            # Step-loop housekeeping: blocks the consumer has finished with come back.
            for request_id in agent.freed():
                engine.release(held.pop(request_id).blocks)
        if not conn.poll(0.005):
            continue
        msg = json.loads(conn.recv_bytes())
        if msg["op"] == "start":
            agent = make_agent(engine, "prefill-0", Role.PRODUCER, Direction(msg["direction"]))
            host, port = agent.serve()
            conn.send_bytes(
                json.dumps({"engine_id": "prefill-0", "host": host, "port": port}).encode()
            )
        elif msg["op"] == "prefill":
            assert agent is not None
            seq = Sequence(msg["request_id"], list(msg["tokens"]))
            first = engine.prefill(seq)  # KV of the prompt now in seq.blocks
            held[seq.request_id] = seq
            # CPU tensors: the writes above are complete. On a GPU, synchronise the
            # stream that wrote the KV before hold().
            ticket = agent.hold(seq.request_id, seq.blocks, num_tokens=len(seq.tokens))
            reply = {"ticket": msgspec.to_builtins(ticket), "first": first, "blocks": seq.blocks}
            conn.send_bytes(json.dumps(reply).encode())
        elif msg["op"] == "stop":
            assert agent is not None
            deadline = time.monotonic() + 10
            while held and time.monotonic() < deadline:
                for request_id in agent.freed():
                    engine.release(held.pop(request_id).blocks)
                time.sleep(0.002)
            agent.close()
            agent = None
            conn.send_bytes(json.dumps({"still_held": sorted(held)}).encode())
        elif msg["op"] == "exit":
            return


# -- decode instance (this process) ------------------------------------------------------
def transfer_kv(
    agent: Agent, conn: Connection, prefill: dict[str, Any], seq: Sequence, direction: Direction
) -> tuple[int, Transfer, list[int]]:
    """Get ``seq``'s prompt KV into ``seq.blocks``; returns (first token, transfer, the
    producer's block ids)."""
    prompt = {"op": "prefill", "request_id": seq.request_id, "tokens": seq.tokens}
    if direction is Direction.PUSH:
        # Push: register our receiving blocks with the producer before its prefill
        # ends. The ticket names only where the producer is (the router knows it).
        ticket = Ticket.for_push(
            prefill["engine_id"], prefill["host"], prefill["port"], seq.request_id, len(seq.tokens)
        )
        transfer = agent.expect_push(ticket, seq.blocks)  # serves on first use
        conn.send_bytes(json.dumps(prompt).encode())
        reply = json.loads(conn.recv_bytes())
    else:
        conn.send_bytes(json.dumps(prompt).encode())
        reply = json.loads(conn.recv_bytes())
        ticket = msgspec.convert(reply["ticket"], Ticket)  # what a router forwards
        transfer = agent.pull(ticket, seq.blocks)
    while transfer.poll() is TransferState.PENDING:  # the engine's step loop
        time.sleep(0.0002)
    return int(reply["first"]), transfer, list(reply["blocks"])


def run_direction(
    direction: Direction,
    conn: Connection,
    prompts: list[list[int]],
    steps: int,
    reference: list[list[int]],
) -> dict[str, Any]:
    engine = ToyEngine(build_model(), seed=22)
    conn.send_bytes(json.dumps({"op": "start", "direction": direction.value}).encode())
    prefill = json.loads(conn.recv_bytes())
    agent = make_agent(engine, "decode-0", Role.CONSUMER, direction)
    equal = differ_without_kv = same_ids = recomputed = 0
    try:
        for i, (tokens, want) in enumerate(zip(prompts, reference)):
            seq = Sequence(f"{direction.value}-{i}", list(tokens))
            engine.allocate(seq, len(tokens))
            first, transfer, remote_blocks = transfer_kv(agent, conn, prefill, seq, direction)
            if transfer.state is TransferState.FAILED:
                # Failure handling: the blocks did not land (transfer.invalid_blocks);
                # an engine recomputes the prompt locally instead.
                recomputed += 1
                print(f"{seq.request_id}: {transfer.error}; recomputing", file=sys.stderr)
                engine.prefill(seq)
            same_ids += remote_blocks == seq.blocks
            got = engine.decode(seq, first, steps)
            equal += got == want
            engine.release(seq.blocks)

            # Negative control: the same decode with this prompt's KV absent (zeroed
            # blocks) must not reproduce the reference, or equality proves nothing.
            control = Sequence(f"control-{i}", list(tokens))
            engine.allocate(control, len(tokens))
            for cache in engine.kv_caches:
                cache[:, control.blocks] = 0
            differ_without_kv += engine.decode(control, first, steps) != want
            engine.release(control.blocks)
    finally:
        conn.send_bytes(json.dumps({"op": "stop"}).encode())
        stopped = json.loads(conn.recv_bytes())
        agent.close()
    return {
        "direction": direction.value,
        "prompts": len(prompts),
        "equal": equal,
        "differ_without_kv": differ_without_kv,
        "same_block_ids": same_ids,
        "recomputed": recomputed,
        "still_held": stopped["still_held"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--direction", nargs="+", default=["pull", "push"])
    args = parser.parse_args(argv)

    rng = random.Random(1234)
    lengths = [5, 16, 17, 31, 40, 57, 64, 3][: args.prompts]
    lengths += [rng.randrange(2, 80) for _ in range(args.prompts - len(lengths))]
    prompts = [[rng.randrange(512) for _ in range(n)] for n in lengths]

    # The single-process reference: the same engine prefills and decodes.
    model = build_model()
    ref_engine = ToyEngine(model, seed=33)
    reference = []
    for i, tokens in enumerate(prompts):
        seq = Sequence(f"ref-{i}", list(tokens))
        reference.append(ref_engine.decode(seq, ref_engine.prefill(seq), args.steps))
        ref_engine.release(seq.blocks)
    engine_ok = all(hf_greedy(model, p, args.steps) == r for p, r in zip(prompts, reference))

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=prefill_instance, args=(child_conn,), daemon=True)
    child.start()
    results = []
    try:
        for name in args.direction:
            results.append(run_direction(Direction(name), conn, prompts, args.steps, reference))
    finally:
        conn.send_bytes(json.dumps({"op": "exit"}).encode())
        child.join(timeout=10)
    ok = engine_ok
    for r in results:
        print(json.dumps(r))
        ok &= r["equal"] == r["prompts"] == r["differ_without_kv"]
        ok &= r["recomputed"] == 0 and not r["still_held"]
    print(f"engine equals transformers: {engine_ok}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
