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
seed. Every Python process a test starts delays its calls the same way: the plugin puts
``tests/chaos_site`` on ``PYTHONPATH``, whose ``sitecustomize`` patches the workers as
the child starts (agents in child processes, TP ranks, vLLM engines). Timing bounds
asserted by tests (a settle "within 2 s") can fail under large delays without a bug:
read the failure before calling it one.
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxfer._agent.workers import IoPool
from kvxfer.io.serial import SerialWorker
from tests.chaos_site.sitecustomize import delaying

MAX_S = float(os.environ.get("KVXFER_CHAOS_MAX_S", "0.3"))
SEED = int(os.environ.get("KVXFER_CHAOS_SEED", "0"))


def pytest_configure(config: pytest.Config) -> None:
    """Child processes delay their calls too (``tests/chaos_site/sitecustomize.py``)."""
    os.environ["KVXFER_CHAOS_MAX_S"] = repr(MAX_S)
    os.environ["KVXFER_CHAOS_SEED"] = str(SEED)
    site = str(Path(__file__).parent / "chaos_site")
    rest = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = site if not rest else os.pathsep.join((site, rest))


def pytest_report_header() -> str:
    return f"chaos: io-worker and push-writer calls delayed up to {MAX_S:g} s (seed {SEED})"


@pytest.fixture(autouse=True)
def _chaos(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    rng = random.Random(SEED ^ zlib.crc32(request.node.nodeid.encode()))
    monkeypatch.setattr(IoPool, "submit", delaying(IoPool.submit, rng, MAX_S))
    monkeypatch.setattr(SerialWorker, "submit", delaying(SerialWorker.submit, rng, MAX_S))
    yield
