"""Per-request timestamps of the connectors (off by default; a benchmark's raw data).

With ``KVXFER_TIMELINE=<path>`` in an instance's environment, the connector appends
one line per event to ``<path>`` through the ``kvxfer.timeline`` logger at DEBUG::

    TL <event> <request id> <CLOCK_MONOTONIC seconds> [key=value ...]

The clock is the host's monotonic clock, shared by every process on it, so the lines
of a prefill instance, a decode instance and a proxy on one host line up (across hosts
they do not). Events:

========================  ==========================================================
``p_new``                 producer scheduler: a ``do_remote_decode`` request arrived
``p_finished``            producer scheduler: its prefill finished (ticket handed out)
``p_hold``                producer worker: the blocks held (a push's write queued)
``push_post``             producer agent: a push WRITE posted (``end=`` when the post
                          returned: with UCX over CMA the bytes moved in between)
``d_new``                 consumer scheduler: a remote-prefill request first scheduled
``d_alloc``               consumer scheduler: blocks allocated, its load queued
``d_load``                consumer worker: ``pull()`` / ``expect_push()`` called
``d_landed``              consumer worker: the load settled (``ok=``), seen by a poll
``d_loaded``              consumer scheduler: the step that learned it finished
========================  ==========================================================

When the variable is unset, :func:`mark` costs one ``isEnabledFor`` check.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["ENV", "enable_from_env", "enabled", "mark"]

#: The environment variable naming the file the timeline goes to.
ENV = "KVXFER_TIMELINE"

log = logging.getLogger("kvxfer.timeline")


def enable_from_env() -> bool:
    """Send the timeline to the file ``$KVXFER_TIMELINE`` names (idempotent).

    Returns:
        Whether the timeline is on.
    """
    path = os.environ.get(ENV)
    if not path:
        return False
    if not any(isinstance(h, logging.FileHandler) for h in log.handlers):
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # not into the server's own log
    return True


def enabled() -> bool:
    """Whether timeline lines are written."""
    return log.isEnabledFor(logging.DEBUG)


def mark(event: str, request_id: str, t: float | None = None, **fields: object) -> None:
    """Write one timeline line (a no-op unless the timeline is on)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    now = time.monotonic() if t is None else t
    extra = "".join(f" {k}={v}" for k, v in fields.items())
    log.debug("TL %s %s %.6f%s", event, request_id, now, extra)
