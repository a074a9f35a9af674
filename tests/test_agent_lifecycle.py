"""The request lifecycle as a hypothesis state machine: holds, pulls, aborts, releases
and injected transport faults between two in-process Agents on the fake backend.

Invariants after every step: the producer holds exactly the requests nobody settled;
every request is freed once at most; a DONE pull delivered exactly the producer's
bytes; a FAILED one reports exactly its local blocks as invalid.
"""

from __future__ import annotations

import contextlib
import itertools
import time

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvxfer.agent import Agent, AgentConfig, Ticket
from kvxfer.backend import BackendOptions
from kvxfer.core.compat import Fingerprint
from kvxfer.testing.fake_backend import FakeBackend, Faults
from kvxfer.testing.kvcache import HostKVCache, ModelShape
from kvxfer.transfer import TransferState
from kvxfer.types import Direction, Role

SHAPE = ModelShape(name="sm", layers=1, kv_heads=1, head_dim=8)
FP = Fingerprint(
    model="m",
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    attention_backend="t",
    direction=Direction.PULL,
)
NUM_BLOCKS = 24
SEED = 9
_names = itertools.count()


def _agent(engine_id: str, role: Role, cache: HostKVCache) -> Agent:
    name = f"{engine_id}-{next(_names)}"
    backend = FakeBackend(BackendOptions(agent_name=name))
    agent = Agent(
        AgentConfig(engine_id=engine_id, fingerprint=FP, role=role, transfer_timeout_s=0.3),
        backend=backend,
    )
    agent.register(cache.layout())
    agent.serve()
    return agent


class Lifecycle(RuleBasedStateMachine):
    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.prod_cache = HostKVCache(SHAPE, 16, NUM_BLOCKS, fill_seed=SEED)
        self.cons_cache = HostKVCache(SHAPE, 16, NUM_BLOCKS)
        self.prod = _agent("prefill-sm", Role.PRODUCER, self.prod_cache)
        self.cons = _agent("decode-sm", Role.CONSUMER, self.cons_cache)
        self.ids = itertools.count()
        self.pending: set[str] = set()
        self.settled: set[str] = set()
        self.freed: list[str] = []

    def teardown(self) -> None:
        self.cons.close()
        self.prod.close()

    def _drain(self) -> None:
        self.freed += self.prod.freed()

    @rule(
        target=tickets,
        blocks=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=4, unique=True),
        extra=st.integers(0, 15),
    )
    def hold(self, blocks: list[int], extra: int) -> Ticket:
        rid = f"r{next(self.ids)}"
        ticket = self.prod.hold(rid, blocks, (len(blocks) - 1) * 16 + 1 + extra)
        self.pending.add(rid)
        return ticket

    def _settle(self, rid: str) -> None:
        self.pending.discard(rid)
        self.settled.add(rid)

    @precondition(lambda self: bool(self.pending))
    @rule(
        ticket=tickets,
        fault=st.sampled_from([None, "midway", "never", "post"]),
        offset=st.integers(0, NUM_BLOCKS - 4),
    )
    def pull(self, ticket: Ticket, fault: str | None, offset: int) -> None:
        if ticket.request_id not in self.pending:
            return
        n = len(ticket.block_ids[0])
        local = list(range(offset, offset + n))
        self.cons.backend.faults = {  # type: ignore[attr-defined]
            None: Faults(),
            "midway": Faults(fail_midway=0.5),
            "never": Faults(never_complete=True),
            "post": Faults(fail_post=True),
        }[fault]
        for region in self.cons_cache.regions:
            region[local] = 0
        transfer = self.cons.pull(ticket, local)
        with contextlib.suppress(Exception):
            transfer.wait(5)
        self.cons.backend.faults = Faults()  # type: ignore[attr-defined]
        if fault is None:
            assert transfer.state is TransferState.DONE, transfer.error
            assert self.cons_cache.mismatches(local, ticket.block_ids[0], SEED) == 0
            self._settle(ticket.request_id)
        else:
            assert transfer.state is TransferState.FAILED
            assert transfer.invalid_blocks == tuple(sorted(local))
            # A failed pull tells the producer to release at once (issue 16, R-SAFE-4):
            # post refused, READ failed midway, or never completed by its deadline.
            self._settle(ticket.request_id)

    @precondition(lambda self: bool(self.pending))
    @rule(ticket=tickets)
    def abort(self, ticket: Ticket) -> None:
        if ticket.request_id in self.pending:
            self.cons.abort(ticket)
            self._settle(ticket.request_id)

    @precondition(lambda self: bool(self.pending))
    @rule(ticket=tickets)
    def release(self, ticket: Ticket) -> None:
        was_pending = ticket.request_id in self.pending
        released = self.prod.release(ticket.request_id)
        self._drain()
        if was_pending and ticket.request_id not in self.freed:
            assert released
        if was_pending:
            self._settle(ticket.request_id)

    @invariant()
    def leases_match(self) -> None:
        # Settlement travels as a notification or a side-channel message: let it arrive.
        # "At once" is told from the lease's fallback (30 s), with room for a loaded CI
        # host, where settling has taken over a second.
        deadline = time.monotonic() + 10.0
        while True:
            self._drain()
            if {r for r in self.settled if r not in self.freed} == set():
                break
            if time.monotonic() > deadline:
                break
            self.prod.progress()
            time.sleep(0.005)
        assert len(self.freed) == len(set(self.freed)), "a request was freed twice"
        assert self.settled <= set(self.freed), self.settled - set(self.freed)
        assert set(self.prod.holding()) == self.pending


Lifecycle.TestCase.settings = settings(max_examples=25, stateful_step_count=12, deadline=None)
TestLifecycle = Lifecycle.TestCase
