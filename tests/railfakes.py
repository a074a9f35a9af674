"""Test doubles for rails: a fake ``class/infiniband`` tree, network namespaces with
veth pairs (real addresses and routes), and a fake ``pyverbs.device``.

The kernel these tests run on has no RDMA subsystem, so only sysfs is faked; the
addresses and routes that selection reads are real iproute2 output from a network
namespace the test creates (10.90.x.0/24 inside the namespace only; nothing leaves it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvxfer.io.rails import CommandRunner, command_runner

_STATE_NUMBERS = {"NOP": 0, "DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}


@dataclass(frozen=True)
class FakeNic:
    """One RDMA device with one port, as sysfs would show it."""

    device: str
    netdev: str | None
    numa: int
    state: str = "ACTIVE"
    port: int = 1
    link_layer: str = "Ethernet"
    extra_gid_netdevs: tuple[str, ...] = ()


def set_port_state(root: Path, device: str, port: int, state: str) -> None:
    """Write ``ports/<p>/state`` atomically, the way the kernel presents it."""
    path = root / "class" / "infiniband" / device / "ports" / str(port) / "state"
    tmp = path.with_name(".state.tmp")
    tmp.write_text(f"{_STATE_NUMBERS[state]}: {state}\n")
    os.replace(tmp, path)


def set_numa(root: Path, device: str, numa: int) -> None:
    """Rewrite a device's ``device/numa_node``."""
    (root / "class" / "infiniband" / device / "device" / "numa_node").write_text(f"{numa}\n")


def build_sysfs(root: Path, nics: Sequence[FakeNic]) -> Path:
    """Create ``<root>/class/infiniband`` for these NICs and return ``root``."""
    for nic in nics:
        dev = root / "class" / "infiniband" / nic.device
        port = dev / "ports" / str(nic.port)
        ndevs = port / "gid_attrs" / "ndevs"
        ndevs.mkdir(parents=True)
        (dev / "device").mkdir(exist_ok=True)
        (dev / "device" / "numa_node").write_text(f"{nic.numa}\n")
        (port / "link_layer").write_text(f"{nic.link_layer}\n")
        set_port_state(root, nic.device, nic.port, nic.state)
        names = ([nic.netdev] if nic.netdev else []) + list(nic.extra_gid_netdevs)
        for i, name in enumerate(names):
            (ndevs / str(i)).write_text(f"{name}\n")
        if nic.netdev:
            (dev / "device" / "net" / nic.netdev).mkdir(parents=True)
    (root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
    return root


# The standard host of these tests: one NIC per rule, numa 0 is the accelerator's.
#   mlx5_0 r0  numa 0 ACTIVE 10.90.0.1  default route  -> rejected (default route)
#   mlx5_1 r1  numa 0 ACTIVE 10.90.1.1                 -> the rail
#   mlx5_2 r2  numa 1 ACTIVE 10.90.2.1                 -> rejected (NUMA)
#   mlx5_3 r3  numa 0 DOWN   10.90.3.1                 -> rejected (port state)
#   mlx5_4 r4  numa 0 ACTIVE (no IPv4)                 -> rejected (IPv4)
STANDARD_NICS = (
    FakeNic("mlx5_0", "r0", 0),
    FakeNic("mlx5_1", "r1", 0),
    FakeNic("mlx5_2", "r2", 1),
    FakeNic("mlx5_3", "r3", 0, state="DOWN"),
    FakeNic("mlx5_4", "r4", 0),
)


@dataclass
class NetNs:
    """A network namespace owned by one test."""

    name: str
    runner: CommandRunner = field(init=False)

    def __post_init__(self) -> None:
        self.runner = command_runner(("ip", "netns", "exec", self.name))

    def ip(self, *args: str) -> str:
        """Run ``ip -n <ns> ARGS`` and return stdout."""
        done = subprocess.run(
            ["ip", "-n", self.name, *args], capture_output=True, text=True, check=True
        )
        return done.stdout

    def batch(self, commands: Sequence[str]) -> None:
        """Run several ``ip`` commands in one process (fast set-up)."""
        subprocess.run(
            ["ip", "-n", self.name, "-batch", "-"],
            input="\n".join(commands) + "\n",
            text=True,
            check=True,
            capture_output=True,
        )

    def ifindex(self, netdev: str) -> int:
        """The ifindex of a link inside the namespace."""
        info: list[dict[str, Any]] = json.loads(self.ip("-j", "link", "show", netdev))
        return int(info[0]["ifindex"])

    def standard(self) -> NetNs:
        """Links r0..r4 (veth pairs, peers r0p..r4p), addresses on r0..r3, default via r0."""
        cmds = []
        for i in range(5):
            cmds += [
                f"link add r{i} type veth peer name r{i}p",
                f"link set r{i} up",
                f"link set r{i}p up",
            ]
        cmds += [f"addr add 10.90.{i}.1/24 dev r{i}" for i in range(4)]
        cmds.append("route add default via 10.90.0.254 dev r0 onlink")
        self.batch(cmds)
        return self


_counter = itertools.count()


def netns_available() -> str | None:
    """None when namespaces can be created here, else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


@contextlib.contextmanager
def netns_context() -> Iterator[NetNs]:
    """A fresh network namespace, deleted (with its veths) on exit.

    Where namespaces cannot be created the test fails (CI runs as root; a skip would
    hide that the NIC-selection rules went untested)."""
    why = netns_available()
    if why:
        pytest.fail(f"network namespace tests need root and iproute2: {why}")
    name = f"kvxt{os.getpid()}n{next(_counter)}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.fail(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        yield NetNs(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


# ---------------------------------------------------------------- fake pyverbs


class PyverbsRDMAError(Exception):
    """Same name and message shape as ``pyverbs.pyverbs_error.PyverbsRDMAError``."""


@dataclass(frozen=True)
class VerbsPortSpec:
    """What the fake verbs layer reports for one port."""

    state: int = 4  # IBV_PORT_ACTIVE
    link_layer: int = 2  # IBV_LINK_LAYER_ETHERNET
    ifindexes: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Device:
    name: bytes
    node_type: int = 1
    transport_type: int = 0
    guid: int = 0


@dataclass(frozen=True)
class _Attr:
    phys_port_cnt: int = 0
    state: int = 0
    link_layer: int = 0


@dataclass(frozen=True)
class _GidEntry:
    gid_index: int
    port_num: int
    gid_type: int
    ndev_ifindex: int


class _Context:
    def __init__(self, ports: Sequence[VerbsPortSpec]) -> None:
        self._ports = list(ports)
        self.closed = False

    def query_device(self) -> _Attr:
        return _Attr(phys_port_cnt=len(self._ports))

    def query_port(self, port_num: int) -> _Attr:
        spec = self._ports[port_num - 1]
        return _Attr(state=spec.state, link_layer=spec.link_layer)

    def query_gid_table(self, max_entries: int, flags: int = 0) -> list[_GidEntry]:
        out = []
        for port_num, spec in enumerate(self._ports, start=1):
            for i, idx in enumerate(spec.ifindexes):
                out.append(_GidEntry(i, port_num, 1, idx))
        return out[:max_entries]

    def close(self) -> None:
        self.closed = True


class FakePyverbs:
    """A stand-in for the ``pyverbs.device`` module.

    Args:
        devices: device name → its ports; None makes ``get_device_list`` raise the way
            pyverbs does on a kernel without an RDMA subsystem.
    """

    PyverbsRDMAError = PyverbsRDMAError

    def __init__(self, devices: dict[str, Sequence[VerbsPortSpec]] | None) -> None:
        self._devices = devices
        self.opened: list[_Context] = []

    def get_device_list(self) -> list[_Device]:
        if self._devices is None:
            # pyverbs/device.pyx: ibv_get_device_list() returned NULL
            raise PyverbsRDMAError("Failed to get devices list")
        return [_Device(name.encode()) for name in self._devices]

    def Context(self, *, name: str) -> _Context:  # pyverbs' spelling
        if self._devices is None or name not in self._devices:
            raise PyverbsRDMAError(f"Failed to find device {name}")
        ctx = _Context(self._devices[name])
        self.opened.append(ctx)
        return ctx
