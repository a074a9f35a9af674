"""Readers behind :mod:`kvxfer.io.rails`: sysfs, iproute2, pyverbs and ``rbln-smi``.

Each reader takes its root (a sysfs directory, a command runner, a pyverbs module) as
a parameter so that a test can point it at a fake tree, at commands run inside a
network namespace, or at a fake pyverbs, on a machine without RDMA. Readers never
raise on missing or odd data; they return what they found plus human-readable notes,
because an operator debugging a host wants every finding, not the first exception.
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from kvxfer.errors import RailError

__all__ = [
    "CommandRunner",
    "HostNetwork",
    "LinkLayer",
    "NumaNode",
    "PortState",
    "PyverbsModule",
    "RdmaPort",
    "VerbsPort",
    "accelerator_numa",
    "command_runner",
    "parse_ip_addr",
    "parse_ip_route_default",
    "parse_rbln_smi",
    "read_host_network",
    "read_pyverbs",
    "read_sysfs_ports",
]

CommandRunner = Callable[[Sequence[str]], str]
"""Runs a command line and returns its stdout; raises ``OSError`` or
``subprocess.SubprocessError`` when the command is missing or fails."""


def command_runner(prefix: Sequence[str] = (), *, timeout_s: float = 10.0) -> CommandRunner:
    """Build a :data:`CommandRunner` that runs commands as subprocesses.

    Args:
        prefix: Words put before every command, e.g. ``("ip", "netns", "exec", "ns0")``
            to read the addresses and routes of a network namespace.
        timeout_s: Deadline of one command; a hung ``ip`` must not hang start-up.
    """
    words = tuple(prefix)

    def run(argv: Sequence[str]) -> str:
        done = subprocess.run(
            [*words, *argv], capture_output=True, text=True, check=True, timeout=timeout_s
        )
        return done.stdout

    return run


class PortState(enum.Enum):
    """State of an RDMA port (``enum ib_port_state``; sysfs prints ``"4: ACTIVE"``)."""

    NOP = "nop"
    DOWN = "down"
    INIT = "init"
    ARMED = "armed"
    ACTIVE = "active"
    ACTIVE_DEFER = "active_defer"
    UNKNOWN = "unknown"

    @classmethod
    def from_number(cls, number: int) -> PortState:
        """Map the kernel's numeric port state (``IBV_PORT_*``) to the enum."""
        return _PORT_STATES.get(number, cls.UNKNOWN)

    @classmethod
    def from_sysfs(cls, text: str) -> PortState:
        """Parse a sysfs ``ports/<p>/state`` file such as ``"4: ACTIVE"``."""
        head, _, name = text.strip().partition(":")
        try:
            return cls.from_number(int(head))
        except ValueError:
            by_name = name.strip() or head.strip()
            return _PORT_STATE_NAMES.get(by_name.upper(), cls.UNKNOWN)

    @property
    def label(self) -> str:
        """The kernel's spelling, as ``rdma link show`` and sysfs print it."""
        return self.name


_PORT_STATES = {
    0: PortState.NOP,
    1: PortState.DOWN,
    2: PortState.INIT,
    3: PortState.ARMED,
    4: PortState.ACTIVE,
    5: PortState.ACTIVE_DEFER,
}
_PORT_STATE_NAMES = {state.name: state for state in PortState}


class LinkLayer(enum.Enum):
    """Link layer of an RDMA port: RoCE ports say ETHERNET."""

    ETHERNET = "ethernet"
    INFINIBAND = "infiniband"
    UNSPECIFIED = "unspecified"

    @classmethod
    def from_number(cls, number: int) -> LinkLayer:
        """Map ``IBV_LINK_LAYER_*`` (0 unspecified, 1 InfiniBand, 2 Ethernet)."""
        return {1: cls.INFINIBAND, 2: cls.ETHERNET}.get(number, cls.UNSPECIFIED)

    @classmethod
    def from_sysfs(cls, text: str) -> LinkLayer:
        """Parse a sysfs ``link_layer`` file (``"Ethernet"`` / ``"InfiniBand"``)."""
        return {"ethernet": cls.ETHERNET, "infiniband": cls.INFINIBAND}.get(
            text.strip().lower(), cls.UNSPECIFIED
        )


class RdmaPort(msgspec.Struct, frozen=True, kw_only=True):
    """One port of one RDMA device, as discovery saw it.

    Attributes:
        device: RDMA device name (``mlx5_0``).
        port: Port number, 1-based as in verbs.
        state: Port state.
        link_layer: Ethernet for RoCE.
        netdev: The netdev the port is bound to (``rdma link show``'s ``netdev``), or
            None when none could be found.
        gid_netdevs: Every netdev named by the port's GID table (VLANs show up here).
        numa: ``device/numa_node`` of the device's PCI function; ``-1`` is the kernel's
            "no affinity reported"; None when unreadable.
        notes: What discovery noticed about this port (cross-check mismatches...).
    """

    device: str
    port: int
    state: PortState
    link_layer: LinkLayer = LinkLayer.UNSPECIFIED
    netdev: str | None = None
    gid_netdevs: tuple[str, ...] = ()
    numa: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """``device:port``, the spelling UCX and NCCL use (``mlx5_0:1``)."""
        return f"{self.device}:{self.port}"


class HostNetwork(msgspec.Struct, frozen=True, kw_only=True):
    """IPv4 addresses and default route of the host (or of one network namespace).

    Attributes:
        ipv4: netdev → its IPv4 addresses in CIDR form (``10.0.0.2/24``).
        ifindex: ifindex → netdev name, for every link (maps pyverbs' GID netdevs).
        default_route: The netdevs that carry a default route.
        addresses_known: False when the addresses could not be read.
        routes_known: False when the default route could not be read.
    """

    ipv4: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    ifindex: dict[int, str] = msgspec.field(default_factory=dict)
    default_route: tuple[str, ...] = ()
    addresses_known: bool = True
    routes_known: bool = True


# --------------------------------------------------------------------------- sysfs


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        # Unpopulated GID slots answer EINVAL on read; a vanished device ENOENT.
        return None


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _sorted_numeric(entries: Iterable[Path]) -> list[Path]:
    return sorted((p for p in entries if p.name.isdigit()), key=lambda p: int(p.name))


def _port_netdevs(dev_dir: Path, port: int) -> tuple[str | None, tuple[str, ...], list[str]]:
    """The port's netdev: first from its GID table, else from ``device/net``."""
    notes: list[str] = []
    gid_netdevs: list[str] = []
    ndevs = dev_dir / "ports" / str(port) / "gid_attrs" / "ndevs"
    if ndevs.is_dir():
        for entry in _sorted_numeric(ndevs.iterdir()):
            name = (_read(entry) or "").strip()
            if name and name not in gid_netdevs:
                gid_netdevs.append(name)
    if gid_netdevs:
        # GID 0 is the default GID built from the port's own netdev; later entries can
        # belong to VLAN netdevs stacked on it.
        return gid_netdevs[0], tuple(gid_netdevs), notes
    net = dev_dir / "device" / "net"
    candidates = sorted(p for p in net.iterdir() if p.is_dir()) if net.is_dir() else []
    if len(candidates) > 1:
        # A dual-port function lists one netdev per port; dev_port is 0-based.
        matching = [p for p in candidates if _as_int(_read(p / "dev_port")) == port - 1]
        if len(matching) == 1:
            return matching[0].name, (), notes
        notes.append(
            f"device/net lists {', '.join(p.name for p in candidates)}; took {candidates[0].name}"
        )
    if candidates:
        return candidates[0].name, (), notes
    return None, (), notes


def read_sysfs_ports(sysfs_root: str | os.PathLike[str]) -> tuple[list[RdmaPort], list[str]]:
    """Read every RDMA port under ``<sysfs_root>/class/infiniband``.

    Args:
        sysfs_root: The directory that plays ``/sys``.

    Returns:
        The ports found, and notes on what was missing (no RDMA subsystem...).
    """
    base = Path(sysfs_root) / "class" / "infiniband"
    if not base.is_dir():
        return [], [
            f"{base} does not exist: this kernel has no RDMA subsystem or no RDMA NIC "
            "driver is loaded"
        ]
    ports: list[RdmaPort] = []
    notes: list[str] = []
    devices = sorted(base.iterdir())
    if not devices:
        notes.append(f"{base} is empty: no RDMA device is registered")
    for dev_dir in devices:
        numa = _as_int(_read(dev_dir / "device" / "numa_node"))
        port_dirs = (
            _sorted_numeric((dev_dir / "ports").iterdir()) if (dev_dir / "ports").is_dir() else []
        )
        if not port_dirs:
            notes.append(f"{dev_dir.name}: no ports in sysfs")
        for port_dir in port_dirs:
            port = int(port_dir.name)
            state_text = _read(port_dir / "state")
            netdev, gid_netdevs, port_notes = _port_netdevs(dev_dir, port)
            if numa is None:
                port_notes.append("device/numa_node is unreadable")
            ports.append(
                RdmaPort(
                    device=dev_dir.name,
                    port=port,
                    state=PortState.UNKNOWN
                    if state_text is None
                    else PortState.from_sysfs(state_text),
                    link_layer=LinkLayer.from_sysfs(_read(port_dir / "link_layer") or ""),
                    netdev=netdev,
                    gid_netdevs=gid_netdevs,
                    numa=numa,
                    notes=tuple(port_notes),
                )
            )
    return ports, notes


# ------------------------------------------------------------------------ iproute2


def parse_ip_addr(text: str) -> tuple[dict[str, tuple[str, ...]], dict[int, str]]:
    """Parse ``ip -j addr show`` into (netdev → IPv4 CIDRs, ifindex → netdev).

    Raises:
        ValueError: The text is not iproute2's JSON.
    """
    links = json.loads(text or "[]")
    if not isinstance(links, list):
        raise ValueError("ip -j addr: expected a JSON list")
    ipv4: dict[str, tuple[str, ...]] = {}
    ifindex: dict[int, str] = {}
    for link in links:
        name = link.get("ifname")
        if not isinstance(name, str):
            continue
        if isinstance(link.get("ifindex"), int):
            ifindex[link["ifindex"]] = name
        addrs = tuple(
            f"{a['local']}/{a.get('prefixlen', 32)}"
            for a in link.get("addr_info", ())
            if a.get("family") == "inet" and "local" in a
        )
        if addrs:
            ipv4[name] = addrs
    return ipv4, ifindex


def parse_ip_route_default(text: str) -> tuple[str, ...]:
    """Parse ``ip -j route show default`` into the netdevs carrying a default route.

    Multipath routes name their devices under ``nexthops``; each one counts.

    Raises:
        ValueError: The text is not iproute2's JSON.
    """
    routes = json.loads(text or "[]")
    if not isinstance(routes, list):
        raise ValueError("ip -j route: expected a JSON list")
    devs: list[str] = []
    for route in routes:
        if route.get("dst", "default") != "default":
            continue
        hops = [route, *route.get("nexthops", ())]
        for hop in hops:
            dev = hop.get("dev")
            if isinstance(dev, str) and dev not in devs:
                devs.append(dev)
    return tuple(devs)


def read_host_network(runner: CommandRunner) -> tuple[HostNetwork, list[str]]:
    """Read addresses and the default route through iproute2's JSON output.

    Args:
        runner: Runs ``ip`` (possibly inside a network namespace).

    Returns:
        What was read, and the problems met (``ip`` missing or failing).
    """
    # AttributeError: JSON of the wrong shape (a list of non-objects).
    failures = (OSError, subprocess.SubprocessError, ValueError, AttributeError)
    problems: list[str] = []
    ipv4: dict[str, tuple[str, ...]] = {}
    ifindex: dict[int, str] = {}
    default: tuple[str, ...] = ()
    addresses_known = routes_known = True
    try:
        ipv4, ifindex = parse_ip_addr(runner(["ip", "-j", "addr", "show"]))
    except failures as exc:
        addresses_known = False
        problems.append(f"`ip -j addr show` failed: {_describe(exc)}")
    try:
        default = parse_ip_route_default(runner(["ip", "-j", "route", "show", "default"]))
    except failures as exc:
        routes_known = False
        problems.append(f"`ip -j route show default` failed: {_describe(exc)}")
    network = HostNetwork(
        ipv4=ipv4,
        ifindex=ifindex,
        default_route=default,
        addresses_known=addresses_known,
        routes_known=routes_known,
    )
    return network, problems


def _describe(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        err = (exc.stderr or "").strip() if isinstance(exc.stderr, str) else ""
        return f"exit status {exc.returncode}" + (f": {err}" if err else "")
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------- pyverbs


class PyverbsModule(Protocol):
    """The part of ``pyverbs.device`` discovery uses.

    ``get_device_list()`` returns objects with a ``name`` (bytes); ``Context(name=...)``
    opens a device whose ``query_device().phys_port_cnt``, ``query_port(p)`` (``state``
    and ``link_layer`` as verbs numbers), ``query_gid_table(n)`` (entries with
    ``port_num`` and ``ndev_ifindex``) and ``close()`` are used.
    """

    def get_device_list(self) -> Sequence[Any]: ...  # pragma: no cover - protocol

    def Context(self, *, name: str) -> Any: ...  # pragma: no cover - protocol


class VerbsPort(msgspec.Struct, frozen=True, kw_only=True):
    """A port as the verbs layer (pyverbs) reports it."""

    device: str
    port: int
    state: PortState
    link_layer: LinkLayer
    netdev_ifindexes: tuple[int, ...] = ()


def read_pyverbs(module: PyverbsModule, *, max_gids: int = 256) -> tuple[list[VerbsPort], str]:
    """Query every port through pyverbs.

    Args:
        module: ``pyverbs.device`` or a fake with the same shape.
        max_gids: Size of the GID table query.

    Returns:
        The ports, and one line saying what pyverbs reported. pyverbs raises from
        ``get_device_list()`` when the kernel has no RDMA subsystem; that means "no
        devices", never a crash.
    """
    try:
        devices = list(module.get_device_list())
    # pyverbs signals "no RDMA subsystem" with its own PyverbsRDMAError; any error
    # from the verbs layer means the same to us: verbs sees no device.
    except Exception as exc:
        return [], f"pyverbs: no RDMA devices ({type(exc).__name__}: {exc})"
    ports: list[VerbsPort] = []
    failures: list[str] = []
    for dev in devices:
        raw = dev.name
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        try:
            ports.extend(_verbs_device_ports(module, name, max_gids))
        except Exception as exc:  # one broken device must not hide the others
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    summary = f"pyverbs: {len(devices)} device(s)"
    if failures:
        summary += "; could not query " + "; ".join(failures)
    return ports, summary


def _verbs_device_ports(module: PyverbsModule, name: str, max_gids: int) -> list[VerbsPort]:
    ctx = module.Context(name=name)
    try:
        count = int(ctx.query_device().phys_port_cnt)
        try:
            gids = list(ctx.query_gid_table(max_gids))
        except Exception:
            gids = []  # older rdma-core without ibv_query_gid_table: state only
        out: list[VerbsPort] = []
        for port in range(1, count + 1):
            attr = ctx.query_port(port)
            ifindexes: list[int] = []
            for gid in gids:
                idx = int(gid.ndev_ifindex)
                if int(gid.port_num) == port and idx > 0 and idx not in ifindexes:
                    ifindexes.append(idx)
            out.append(
                VerbsPort(
                    device=name,
                    port=port,
                    state=PortState.from_number(int(attr.state)),
                    link_layer=LinkLayer.from_number(int(attr.link_layer)),
                    netdev_ifindexes=tuple(ifindexes),
                )
            )
        return out
    finally:
        ctx.close()


# ------------------------------------------------------------------------ rbln-smi


def parse_rbln_smi(text: str) -> list[int | None]:
    """Parse ``rbln-smi -j`` into the NUMA node of each NPU, by NPU index.

    The document holds a ``devices`` list whose entries carry ``pci.numa_node``
    (a number or a numeric string); an entry's ``npu`` field, when present, is its
    index, else its position is.

    Raises:
        ValueError: The text is not JSON with a ``devices`` list.
    """
    doc = json.loads(text)
    devices = doc.get("devices") if isinstance(doc, Mapping) else None
    if not isinstance(devices, list):
        raise ValueError("rbln-smi -j: no 'devices' list")
    by_index: dict[int, int | None] = {}
    for position, dev in enumerate(devices):
        if not isinstance(dev, Mapping):
            continue
        index = _as_int(str(dev["npu"])) if "npu" in dev else None
        pci = dev.get("pci")
        numa = _as_int(str(pci.get("numa_node"))) if isinstance(pci, Mapping) else None
        by_index[position if index is None else index] = numa
    size = max(by_index, default=-1) + 1
    return [by_index.get(i) for i in range(size)]


# ---------------------------------------------------------------- accelerator NUMA


class NumaNode(msgspec.Struct, frozen=True, kw_only=True):
    """The accelerator's NUMA node and where it was read."""

    node: int
    source: str


def accelerator_numa(
    *,
    numa_node: int | None = None,
    pci_address: str | None = None,
    npu_index: int | None = None,
    sysfs_root: str | os.PathLike[str] = "/sys",
    runner: CommandRunner | None = None,
) -> NumaNode:
    """Find the NUMA node of the accelerator this instance runs on.

    Sources, first match wins: ``numa_node`` given explicitly; the PCI function's
    ``<sysfs_root>/bus/pci/devices/<pci_address>/numa_node``; ``rbln-smi -j``'s
    ``pci.numa_node`` of NPU ``npu_index`` (default: the first of
    ``RBLN_VISIBLE_DEVICES``, else 0).

    Raises:
        RailError: No source answered; the message lists what was tried.
    """
    if numa_node is not None:
        return NumaNode(node=numa_node, source="configured")
    tried: list[str] = []
    if pci_address:
        path = Path(sysfs_root) / "bus" / "pci" / "devices" / pci_address / "numa_node"
        try:
            return NumaNode(node=int(path.read_text().strip()), source=str(path))
        except (OSError, ValueError) as exc:
            tried.append(f"{path}: {type(exc).__name__}")
    if npu_index is None:
        visible = os.environ.get("RBLN_VISIBLE_DEVICES", "").split(",")[0].strip()
        npu_index = int(visible) if visible.isdigit() else 0
    run = runner if runner is not None else command_runner()
    try:
        nodes = parse_rbln_smi(run(["rbln-smi", "-j"]))
    except FileNotFoundError:
        tried.append("rbln-smi not found")
    except Exception as exc:  # a broken driver tool must not abort start-up here
        tried.append(f"rbln-smi -j failed ({type(exc).__name__}: {exc})")
    else:
        node = nodes[npu_index] if 0 <= npu_index < len(nodes) else None
        if node is not None:
            return NumaNode(node=node, source=f"rbln-smi -j, npu {npu_index}")
        tried.append(f"rbln-smi -j lists no pci.numa_node for npu {npu_index}")
    raise RailError(
        "cannot tell the accelerator's NUMA node: "
        + "; ".join(tried)
        + "; pass it explicitly (numa_node=N, `kvxfer doctor --numa-node N`)"
    )
