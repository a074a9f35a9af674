"""The progress thread's pace: short sleeps while transfers are in flight, long ones
when idle, so an idle agent costs nothing (NIXL's own progress thread would spin a
core).

:class:`ProgressLoop` runs the agent's ticks on one daemon thread, sleeping between
them by what is in flight: 0.2 ms (``progress_interval_s``) while a handle is polled,
:data:`RECEPTION_TICK_S` while only push receptions await notices,
:data:`WAITED_TICK_S` while a thread waits on every transfer (it polls them itself),
:data:`LEASE_TICK_S` while a pull producer holds leases, :data:`IDLE_NAP_S` otherwise.
Any thread that polls shares the rounds (:meth:`ProgressLoop.poll`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvxfer._agent.leases import LeaseBook
from kvxfer.agent_config import AgentConfig
from kvxfer.transfer import Transfer
from kvxfer.types import Direction

__all__ = [
    "IDLE_NAP_S",
    "LEASE_TICK_S",
    "RECEPTION_TICK_S",
    "WAITED_TICK_S",
    "WIREUP_S",
    "ProgressLoop",
]

log = logging.getLogger("kvxfer.agent")

# Progress interval while leases are held and nothing is in flight (see _run).
LEASE_TICK_S = 0.001
# The progress thread's pace while a thread waits on every in-flight transfer (the
# waiters poll them every 0.2 ms): a backstop for a waiter that gives up.
WAITED_TICK_S = 0.005
# The progress thread's pace while the only transfers in flight are push receptions
# (awaiting the producer's notice, no handle to poll). They wait as long as the remote
# prefill runs; at the in-flight pace (0.2 ms) a waiting decode instance burned 0.4 of
# a core draining notices and waking up, which on a small host slowed that very
# prefill by 10-15%. A reception is settled at most this much after its notice came
# (and an engine polling it each step sees it sooner).
RECEPTION_TICK_S = 0.005
# The progress thread's sleep when nothing is in flight (an idle agent costs nothing).
IDLE_NAP_S = 0.05
# How long after a handshake (either side) the thread keeps the lease pace while idle.
# NIXL connects a new peer's UCX endpoint at the handshake, but the wire-up messages
# are answered only as each side's worker progresses: at the idle nap an 8-byte READ
# right after the handshake took 130-210 ms (a few round trips of 50 ms naps), and the
# first transfer paid what was left of it. A tick costs a few µs.
WIREUP_S = 1.0


class ProgressLoop:
    """The agent's progress thread (internal).

    Args:
        config: The agent's configuration (its progress interval, direction).
        tick: One round of progress (the runtime's).
        transfers: The transfers in flight (read for the pace, never written).
        leases: The producer's leases (a pull producer's make the pace faster).
        closed: Whether the agent closed (the thread then ends).
    """

    def __init__(
        self,
        config: AgentConfig,
        tick: Callable[[], None],
        transfers: dict[int, Transfer],
        leases: LeaseBook,
        closed: Callable[[], bool],
    ) -> None:
        self._config = config
        self._tick = tick
        self._transfers = transfers
        self._leases = leases
        self._closed = closed
        self._wake = threading.Event()
        self._idle_nap = True  # the progress thread sleeps its long idle interval
        self._nap_s = IDLE_NAP_S  # the progress thread's current sleep between rounds
        self._thread: threading.Thread | None = None
        self.started = False  # whether the thread was started (read on every transfer)
        self._start_lock = threading.Lock()
        self.last_tick = 0.0  # monotonic time of the latest tick, by any thread
        self._wireup_until = 0.0  # monotonic: the lease pace while idle until then

    def start(self) -> None:
        """Start the progress thread (once, unless closed)."""
        with self._start_lock:
            if self._thread is None and not self._closed():
                self._thread = threading.Thread(
                    target=self._run, name="kvxfer-progress", daemon=True
                )
                self._thread.start()
                self.started = True

    def stop(self) -> None:
        """Once closed: wake the thread and wait for it to end (not from itself)."""
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def wake(self) -> None:
        """Run a round of progress soon, from any sleep."""
        self._wake.set()

    def nudge(self) -> None:
        """Wake the progress thread only from its long idle sleep: waking it costs a GIL
        hand-off (a few hundred µs on a busy host) on every hold and pull, and from the
        short sleeps it comes back within a millisecond anyway."""
        if self._idle_nap:
            self._wake.set()

    def wiring_up(self) -> None:
        """A peer handshook with this agent, or this agent with it: keep the lease pace
        for :data:`WIREUP_S` so that its transport connection is wired up now rather
        than inside the first transfer."""
        self._wireup_until = max(self._wireup_until, time.monotonic() + WIREUP_S)
        self.nudge()

    def in_flight(self) -> None:
        """A transfer went in flight: wake the thread if it sleeps longer than the
        in-flight pace."""
        if self._nap_s > self._config.progress_interval_s:
            self._wake.set()

    def ticking(self) -> None:
        """A round of progress starts now (on any thread)."""
        self.last_tick = time.monotonic()

    def poll(self) -> None:
        """What a :meth:`Transfer.poll` drives: a round of progress, unless any thread
        ran one within half the progress interval. An engine polls each of its
        transfers once a step (the vLLM adapter does); one round serves them all,
        instead of one round of notices, statuses and deadlines per transfer. (Half:
        a waiter polling at the interval itself must never see its round skipped.)"""
        if time.monotonic() - self.last_tick >= 0.5 * self._config.progress_interval_s:
            self._tick()

    def _run(self) -> None:
        # Sleeps between ticks: short while anything is in flight, long when idle, so
        # an idle agent costs nothing (NIXL's own progress thread would spin a core).
        interval, woken = 0.0, True
        config = self._config
        while not self._closed():
            # Skip a round that was not asked for when another thread (a waiter in
            # Transfer.wait, the engine's freed()) ticked within it: it would add only
            # lock and GIL traffic, which on a small host delays that very thread.
            if woken or time.monotonic() - self.last_tick >= interval:
                try:
                    self._tick()
                except Exception:  # never let the progress thread die silently
                    log.exception("kvxfer progress thread")
            self._idle_nap = True  # before reading the state: see nudge
            live = [t for t in list(self._transfers.values()) if not t.meta.posting]
            unwaited = [t for t in live if not t.waited_on]
            if any(t.meta.handle is not None for t in unwaited):
                # In flight. Transfers still inside their post are left out: polling
                # them is of no use, and on a small host it takes CPU from the very
                # copy the post is doing.
                interval = config.progress_interval_s
            elif unwaited:
                # Only push receptions, awaiting their producers' notices.
                interval = max(config.progress_interval_s, RECEPTION_TICK_S)
            elif live:
                # Every one has a thread in wait() polling it at the fast pace already;
                # a second poller would double the wakeups, and on a small host those
                # take CPU from the copy being waited for. This one stays a backstop.
                interval = max(config.progress_interval_s, WAITED_TICK_S)
            elif self._leases.held and config.direction is Direction.PULL:
                # Held blocks may be being read: NIXL completes a consumer's READ only
                # after this side's worker progressed, so the 50 ms idle sleep used to
                # add up to 50 ms to a pull. A tick costs a few µs. (A push producer's
                # leases wait for its own writes, which are transfers, above.)
                interval = LEASE_TICK_S
            elif time.monotonic() < self._wireup_until:
                interval = LEASE_TICK_S  # a new peer's connection is being wired up
            else:
                interval = IDLE_NAP_S
            self._idle_nap = interval == IDLE_NAP_S
            self._nap_s = interval
            woken = self._wake.wait(interval)
            self._wake.clear()
