"""Opt-in pytest plugin that reorders the agents' background work: every call handed
to an io worker (handshakes, push registrations, Releases, liveness probes) or to the
push writer starts after a random delay.

On an idle host these calls run in the order they were submitted, and a test can pass
for months on that order alone; on a loaded CI host they need not (CI run of 03534c4:
a consumer's abort reached the producer before its own push registration). Running a
test file under this plugin shows such orderings in seconds::

    KVXFER_CHAOS_MAX_S=0.3 .venv/bin/python -m pytest -p tests.chaos tests/test_faults.py

``KVXFER_CHAOS_MAX_S`` (default 0.3) bounds each delay; ``KVXFER_CHAOS_SEED`` (default
0) with the test's node id seeds its delays, so a failing test replays with the same
seed. Timing bounds asserted by tests (a settle "within 2 s") can fail under large
delays without a bug: read the failure before calling it one.
"""

from __future__ import annotations

import os
import random
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvxfer._agent.workers import IoPool
from kvxfer.io.serial import SerialWorker

MAX_S = float(os.environ.get("KVXFER_CHAOS_MAX_S", "0.3"))
SEED = int(os.environ.get("KVXFER_CHAOS_SEED", "0"))


def pytest_report_header() -> str:
    return f"chaos: io-worker and push-writer calls delayed up to {MAX_S:g} s (seed {SEED})"


def _delaying(submit: Callable[..., Any], rng: random.Random) -> Callable[..., Any]:
    def delayed_submit(self: Any, fn: Callable[..., Any], *args: Any) -> Any:
        delay = rng.random() * MAX_S

        def late(*call_args: Any) -> Any:
            time.sleep(delay)
            return fn(*call_args)

        return submit(self, late, *args)

    return delayed_submit


@pytest.fixture(autouse=True)
def _chaos(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    rng = random.Random(SEED ^ zlib.crc32(request.node.nodeid.encode()))
    monkeypatch.setattr(IoPool, "submit", _delaying(IoPool.submit, rng))
    monkeypatch.setattr(SerialWorker, "submit", _delaying(SerialWorker.submit, rng))
    yield
