"""Link monitor and link_down_exit_s (R-RAIL-4)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvxfer.errors import ConfigError
from kvxfer.io.linkmon import LINK_DOWN_EXIT_STATUS, LinkMonitor, sysfs_link_probe
from kvxfer.io.rails import Rail
from tests.railfakes import FakeNic, build_sysfs, set_port_state


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Links:
    """A probe whose answer the test sets."""

    def __init__(self, **up: bool) -> None:
        self.up = dict(up)

    def __call__(self) -> dict[str, bool]:
        return dict(self.up)


def monitor(links: Links, clock: Clock, seconds: float = 1.0) -> tuple[LinkMonitor, list[str]]:
    exits: list[str] = []
    mon = LinkMonitor(links, seconds, clock=clock, on_exit=exits.append)
    return mon, exits


def test_all_links_down_for_the_deadline_exits_once() -> None:
    links, clock = Links(a=True, b=True), Clock()
    mon, exits = monitor(links, clock)
    assert mon.poll() is True
    links.up = {"a": False, "b": False}
    assert mon.poll() is False
    assert mon.down_since == 100.0
    clock.now = 100.99
    mon.poll()
    assert exits == []
    clock.now = 101.0
    mon.poll()
    assert len(exits) == 1 and mon.fired
    assert "every local link (a, b) has been down for 1.0 s" in exits[0]
    assert f"status {LINK_DOWN_EXIT_STATUS}" in exits[0]
    clock.now = 105.0
    mon.poll()
    assert len(exits) == 1


def test_one_link_up_keeps_the_producer() -> None:
    links, clock = Links(a=False, b=True), Clock()
    mon, exits = monitor(links, clock)
    for step in range(10):
        clock.now = 100.0 + step
        assert mon.poll() is True
    assert exits == [] and mon.down_since is None


def test_a_link_back_before_the_deadline_cancels_it() -> None:
    links, clock = Links(a=False), Clock()
    mon, exits = monitor(links, clock)
    mon.poll()  # down at 100.0
    clock.now = 100.5
    links.up["a"] = True
    mon.poll()  # back: cancelled
    assert mon.down_since is None
    clock.now = 100.8
    links.up["a"] = False
    mon.poll()  # down again: a new deadline at 101.8
    clock.now = 101.5
    mon.poll()
    assert exits == []
    clock.now = 101.8
    mon.poll()
    assert len(exits) == 1


def test_disabled_monitor_never_exits_and_starts_no_thread() -> None:
    links, clock = Links(a=False), Clock()
    mon, exits = monitor(links, clock, seconds=0)
    assert not mon.enabled
    for step in range(5):
        clock.now = 100.0 + 1000 * step
        mon.poll()
    before = threading.active_count()
    mon.start()
    assert exits == [] and threading.active_count() == before
    mon.stop()


def test_empty_or_failing_probe_counts_as_no_link_up() -> None:
    clock = Clock()
    exits: list[str] = []

    def broken() -> dict[str, bool]:
        raise OSError("sysfs went away")

    for probe in (Links(), broken):
        exits.clear()
        mon = LinkMonitor(probe, 1.0, clock=clock, on_exit=exits.append)
        clock.now = 100.0
        mon.poll()
        clock.now = 101.0
        mon.poll()
        assert len(exits) == 1


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_negative_deadline_is_a_config_error(bad: float) -> None:
    with pytest.raises(ConfigError, match="link_down_exit_s"):
        LinkMonitor(Links(), bad)


def test_poll_interval_is_capped_by_the_deadline() -> None:
    assert LinkMonitor(Links(), 0.5, poll_interval_s=2.0).poll_interval_s == pytest.approx(0.1)
    assert LinkMonitor(Links(), 60, poll_interval_s=0.5).poll_interval_s == 0.5


def test_sysfs_probe_reads_port_state(tmp_path: Path) -> None:
    root = build_sysfs(tmp_path, [FakeNic("mlx5_0", "r0", 0), FakeNic("mlx5_1", "r1", 0)])
    rails = [
        Rail(device="mlx5_0", port=1, netdev="r0", ipv4="10.90.0.1", numa=0),
        Rail(device="mlx5_1", port=1, netdev="r1", ipv4="10.90.1.1", numa=0),
        Rail(device="gone", port=1, netdev="r9", ipv4="10.90.9.1", numa=0),
    ]
    probe = sysfs_link_probe(rails, root)
    assert probe() == {"mlx5_0:1": True, "mlx5_1:1": True, "gone:1": False}
    set_port_state(root, "mlx5_1", 1, "DOWN")
    assert probe()["mlx5_1:1"] is False
    set_port_state(root, "mlx5_1", 1, "INIT")
    assert probe()["mlx5_1:1"] is False


def test_thread_fires_on_real_clock() -> None:
    links = Links(a=True)
    fired = threading.Event()
    reasons: list[str] = []

    def on_exit(reason: str) -> None:
        reasons.append(reason)
        fired.set()

    with LinkMonitor(links, 0.3, poll_interval_s=0.02, on_exit=on_exit) as mon:
        time.sleep(0.1)
        assert not fired.is_set()
        start = time.monotonic()
        links.up["a"] = False
        assert fired.wait(5.0)
        assert time.monotonic() - start >= 0.29
        assert mon.fired
    assert len(reasons) == 1


# ------------------------------------------------------------ a real producer

PRODUCER = """
import logging, sys
from kvxfer.io.linkmon import LinkMonitor, sysfs_link_probe
from kvxfer.io.rails import Rail

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
root, deadline = sys.argv[1], float(sys.argv[2])
rails = [Rail(device=d, port=1, netdev=d, ipv4="10.90.0.1", numa=0) for d in ("mlx5_0", "mlx5_1")]
LinkMonitor(sysfs_link_probe(rails, root), deadline, poll_interval_s=0.02).start()
print("serving", flush=True)
sys.stdin.read()  # the test closes stdin to end a producer that should keep serving
print("clean exit", flush=True)
"""

DEADLINE_S = 0.6


def start_producer(root: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(root), str(DEADLINE_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "serving\n"
    return proc


@pytest.fixture
def two_links(tmp_path: Path) -> Path:
    return build_sysfs(tmp_path, [FakeNic("mlx5_0", "r0", 0), FakeNic("mlx5_1", "r1", 0)])


def test_producer_exits_with_documented_status_when_every_link_stays_down(
    two_links: Path,
) -> None:
    proc = start_producer(two_links)
    try:
        set_port_state(two_links, "mlx5_0", 1, "DOWN")
        time.sleep(DEADLINE_S * 1.5)
        assert proc.poll() is None, "one link is still up"
        start = time.monotonic()
        set_port_state(two_links, "mlx5_1", 1, "DOWN")
        rc = proc.wait(timeout=10)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert proc.stderr is not None
    err = proc.stderr.read()
    assert rc == LINK_DOWN_EXIT_STATUS == 75
    assert DEADLINE_S * 0.95 <= elapsed < DEADLINE_S + 3.0
    assert "every local link is down (mlx5_0:1, mlx5_1:1)" in err
    assert "CRITICAL every local link (mlx5_0:1, mlx5_1:1) has been down" in err


def test_producer_survives_a_flap_shorter_than_the_deadline(two_links: Path) -> None:
    proc = start_producer(two_links)
    try:
        for device in ("mlx5_0", "mlx5_1"):
            set_port_state(two_links, device, 1, "DOWN")
        time.sleep(DEADLINE_S / 3)
        set_port_state(two_links, "mlx5_1", 1, "ACTIVE")
        time.sleep(DEADLINE_S * 2)
        assert proc.poll() is None
        out, err = proc.communicate(input="", timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0
    assert out.endswith("clean exit\n")
    assert "every local link is down" in err
    assert "link(s) back after" in err and "exit cancelled" in err
