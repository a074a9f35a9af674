"""The delays of :mod:`tests.chaos`, for kvxfer's child processes.

Python imports a ``sitecustomize`` module from ``sys.path`` as it starts; the chaos
plugin puts this folder on ``PYTHONPATH``, so every Python process a test starts (an
agent in ``tests/agent_proc.py``, the TP ranks, the CLI, a vLLM engine and its workers)
delays its io-worker and push-writer calls as the test process does. A child takes its
seed from ``KVXFER_CHAOS_SEED`` and the test pytest says is running
(``PYTEST_CURRENT_TEST``, which children inherit).
"""

from __future__ import annotations

import os
import random
import time
import zlib
from collections.abc import Callable
from typing import Any


def delaying(submit: Callable[..., Any], rng: random.Random, max_s: float) -> Callable[..., Any]:
    """``submit`` of a worker, with each handed call starting up to ``max_s`` late."""

    def delayed_submit(self: Any, fn: Callable[..., Any], *args: Any) -> Any:
        delay = rng.random() * max_s

        def late(*call_args: Any) -> Any:
            time.sleep(delay)
            return fn(*call_args)

        return submit(self, late, *args)

    return delayed_submit


def _install() -> None:
    max_s = float(os.environ.get("KVXFER_CHAOS_MAX_S", "0") or 0)
    if max_s <= 0:
        return
    try:  # a process that cannot import kvxfer (pip, a bare interpreter) runs as it is
        from kvxfer._agent.workers import IoPool
        from kvxfer.io.serial import SerialWorker
    except Exception:
        return
    seed = int(os.environ.get("KVXFER_CHAOS_SEED", "0"))
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    rng = random.Random(seed ^ zlib.crc32(f"child {test}".encode()))
    IoPool.submit = delaying(IoPool.submit, rng, max_s)  # type: ignore[method-assign]
    SerialWorker.submit = delaying(SerialWorker.submit, rng, max_s)  # type: ignore[method-assign]


if __name__ == "sitecustomize":
    _install()
