"""Link monitor: a producer that lost every local link exits so it can be replaced.

R-RAIL-4. With ``link_down_exit_s > 0`` a producer (``kv_role: kv_producer``; the
config rejects the key for other roles, because decode instances are replaced from
outside while keeping their in-flight requests) runs a :class:`LinkMonitor`. When
**every** local rail has been down for ``link_down_exit_s`` seconds, the monitor logs
why and ends the process with :data:`LINK_DOWN_EXIT_STATUS` (75, ``EX_TEMPFAIL`` in
``sysexits.h``: "temporary failure, retry"), which the deployment (Kubernetes, systemd)
sees as "start a new instance". A link that comes back before the deadline cancels it;
one rail left up is enough to keep serving.

The exit is ``os._exit`` after logging: ``sys.exit`` from a daemon thread only ends
that thread, and a process stuck on a dead fabric may never reach a clean shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from kvxfer.errors import ConfigError
from kvxfer.io._rail_sources import PortState
from kvxfer.io.rails import Rail

__all__ = [
    "LINK_DOWN_EXIT_STATUS",
    "LinkMonitor",
    "LinkProbe",
    "exit_process",
    "sysfs_link_probe",
]

LINK_DOWN_EXIT_STATUS = 75
"""Exit status of a producer whose every local link stayed down for link_down_exit_s."""

LinkProbe = Callable[[], Mapping[str, bool]]
"""Returns rail name (``mlx5_0:1``) → link up, for every local rail."""

log = logging.getLogger("kvxfer.io.linkmon")


def sysfs_link_probe(
    rails: Sequence[Rail], sysfs_root: str | os.PathLike[str] = "/sys"
) -> LinkProbe:
    """A probe reading each rail's ``class/infiniband/<dev>/ports/<p>/state``.

    A rail is up when its port is ACTIVE; an unreadable state file (device gone) is
    down.

    Args:
        rails: The local rails to watch.
        sysfs_root: The directory that plays ``/sys``.
    """
    base = Path(sysfs_root) / "class" / "infiniband"
    paths = {r.name: base / r.device / "ports" / str(r.port) / "state" for r in rails}

    def probe() -> dict[str, bool]:
        up: dict[str, bool] = {}
        for name, path in paths.items():
            try:
                up[name] = PortState.from_sysfs(path.read_text()) is PortState.ACTIVE
            except OSError:
                up[name] = False
        return up

    return probe


def exit_process(reason: str) -> None:
    """Default exit action: flush logs and streams, then ``os._exit(75)``."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream must not stop the exit.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(LINK_DOWN_EXIT_STATUS)


class LinkMonitor:
    """Watches the local rails and ends the process when all stay down too long.

    Use it as a context manager or call :meth:`start` / :meth:`stop`; the watcher is a
    daemon thread. :meth:`poll` is one step of the loop, callable directly with an
    injected clock (tests need neither threads nor sleeps).

    Args:
        probe: Returns rail name → up; an empty answer or an exception counts as "no
            link up" (nothing can be shown to carry traffic).
        link_down_exit_s: Seconds every link must stay down before exiting; 0 (the
            default of the config key) disables the monitor.
        poll_interval_s: Seconds between probes; capped at a fifth of
            link_down_exit_s so the exit is not late by more than that.
        clock: Monotonic seconds.
        on_exit: Called once with the reason when the deadline passes; default
            :func:`exit_process` (status :data:`LINK_DOWN_EXIT_STATUS`).
    """

    def __init__(
        self,
        probe: LinkProbe,
        link_down_exit_s: float,
        *,
        poll_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        on_exit: Callable[[str], None] = exit_process,
    ) -> None:
        if not link_down_exit_s >= 0:  # also catches NaN
            raise ConfigError("link_down_exit_s", link_down_exit_s, "must be >= 0 (0 = never)")
        if not poll_interval_s > 0:
            raise ConfigError("poll_interval_s", poll_interval_s, "must be > 0")
        self._probe = probe
        self.link_down_exit_s = float(link_down_exit_s)
        self.poll_interval_s = (
            min(poll_interval_s, self.link_down_exit_s / 5)
            if self.link_down_exit_s > 0
            else poll_interval_s
        )
        self._clock = clock
        self._on_exit = on_exit
        self._down_since: float | None = None
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        """False when link_down_exit_s is 0 (never exit)."""
        return self.link_down_exit_s > 0

    @property
    def down_since(self) -> float | None:
        """Clock time since when every link has been down, or None."""
        return self._down_since

    @property
    def fired(self) -> bool:
        """True once the exit action has been called."""
        return self._fired

    def poll(self) -> bool:
        """Probe once and act: start, cancel or fire the deadline.

        Returns:
            True while at least one link is up.
        """
        now = self._clock()
        try:
            links = dict(self._probe())
        except Exception as exc:  # a broken probe must not kill the watcher thread
            log.warning(
                "link probe failed (%s: %s); counting no link as up", type(exc).__name__, exc
            )
            links = {}
        up = sorted(name for name, ok in links.items() if ok)
        if up:
            if self._down_since is not None:
                log.warning(
                    "link(s) back after %.1f s: %s; exit cancelled",
                    now - self._down_since,
                    ", ".join(up),
                )
            self._down_since = None
            return True
        if self._down_since is None:
            self._down_since = now
            log.error(
                "every local link is down (%s); exiting in %.1f s unless one comes back",
                ", ".join(sorted(links)) or "no rails reported",
                self.link_down_exit_s,
            )
        elif self.enabled and not self._fired and now - self._down_since >= self.link_down_exit_s:
            self._fired = True
            reason = (
                f"every local link ({', '.join(sorted(links)) or 'none reported'}) has been "
                f"down for {now - self._down_since:.1f} s (link_down_exit_s="
                f"{self.link_down_exit_s:g}); exiting with status {LINK_DOWN_EXIT_STATUS} "
                "so the deployment starts a new producer"
            )
            log.critical(reason)
            self._on_exit(reason)
        return False

    def _run(self) -> None:
        while not self._fired and not self._stop.wait(self.poll_interval_s):
            self.poll()

    def start(self) -> None:
        """Start the daemon watcher thread (no-op when disabled or already running)."""
        if not self.enabled or self._thread is not None:
            return
        self.poll()
        self._thread = threading.Thread(target=self._run, name="kvxfer-linkmon", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the watcher thread; idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> LinkMonitor:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
