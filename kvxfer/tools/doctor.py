"""``kvxfer doctor``: is this host ready to move KV over RoCE? (R-CLI-1)

Runs, in one go, the checks the vendor manual has operators type by hand::

    rbln-smi -j                                      # accelerator NUMA node
    rdma link show                                   # RDMA port state, netdevs
    ip route show default                            # interface excluded from rails
    ip -4 -brief addr show                           # netdevs with IPv4
    grep . /sys/class/infiniband/*/device/numa_node  # NIC NUMA nodes

plus NIXL's plugins, nixl-rbln, on a GPU host whether pulls of GPU memory use cuda_ipc,
whether the side-channel port is free and whether the side channel is authenticated (a
WARN when it is not on a non-loopback address); then prints every NIC with its verdict
and the rails that would be used. Exit status 0 means ready, 1 not ready, 2 a usage
error. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import enum
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from kvxfer.core.handshake import MIN_SECRET_BYTES
from kvxfer.errors import RailError
from kvxfer.io.rails import (
    Discovery,
    NumaNode,
    Rail,
    Reason,
    Selection,
    accelerator_numa,
    command_runner,
    discover,
    evaluate,
    ucx_env,
)

__all__ = [
    "Check",
    "NicRow",
    "Report",
    "Status",
    "cuda_ipc_check",
    "list_writes_check",
    "main",
    "run_checks",
]

DEFAULT_SIDE_CHANNEL_PORT = 5600
#: The shared secret's environment variable, as the vLLM adapter reads it
#: (``kvxfer.adapters.vllm.startup.AUTH_SECRET_ENV``; a test keeps the two equal).
AUTH_SECRET_ENV = "KVXFER_AUTH_SECRET"
_PROBE_MARK = "KVXFER-DOCTOR:"

# Runs in a child process: NIXL agents start threads and can crash at interpreter
# exit, neither of which may take the doctor down with them. No progress thread, no
# backend instantiated: only the plugin directory is scanned.
_NIXL_PROBE = """
import json, os, sys
out = {}
try:
    from importlib import metadata
    from kvxfer.backends.ucx import import_nixl  # kvxfer's one NIXL edge
    nixl_agent, nixl_agent_config = import_nixl()
    version = ""
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            pass
    conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = nixl_agent("kvxfer-doctor", conf)
    out["nixl"] = {"ok": True, "version": version, "plugins": sorted(agent.get_plugin_list())}
    del agent
except Exception as exc:
    out["nixl"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
try:
    import nixl_rbln
    out["nixl_rbln"] = {"ok": True, "version": str(getattr(nixl_rbln, "__version__", ""))}
except Exception as exc:
    out["nixl_rbln"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
sys.stdout.write("\\n%s%s\\n" % (sys.argv[1], json.dumps(out)))
sys.stdout.flush()
os._exit(0)
"""


class Status(enum.Enum):
    """Outcome of one check; any FAIL makes the host not ready."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    INFO = "info"


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One prerequisite check: what was looked at and what it showed."""

    name: str
    status: Status
    detail: str


class NicRow(msgspec.Struct, frozen=True, kw_only=True):
    """One RDMA port in the NIC table."""

    nic: str
    state: str
    link_layer: str
    netdev: str | None
    ipv4: tuple[str, ...]
    numa: int | None
    default_route: bool
    rail: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...]


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``kvxfer doctor`` found; ``--json`` prints it as is."""

    ready: bool
    summary: str
    numa_node: int | None
    numa_source: str
    checks: tuple[Check, ...]
    nics: tuple[NicRow, ...]
    rails: tuple[Rail, ...]
    ucx_net_devices: str | None
    nixl_plugins: tuple[str, ...]
    notes: tuple[str, ...]


# ------------------------------------------------------------------------- checks


class _Probe(msgspec.Struct, frozen=True, kw_only=True):
    """What the NIXL probe subprocess reports for one package."""

    ok: bool
    version: str = ""
    plugins: tuple[str, ...] = ()
    error: str = ""


def _probe_nixl(timeout_s: float) -> tuple[_Probe, _Probe]:
    """(nixl, nixl_rbln) as seen by a child Python."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _NIXL_PROBE, _PROBE_MARK],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        err = _Probe(ok=False, error=f"probe timed out after {timeout_s:g} s")
        return err, err
    for line in done.stdout.splitlines():
        if line.startswith(_PROBE_MARK):
            found = msgspec.json.decode(line[len(_PROBE_MARK) :], type=dict[str, _Probe])
            missing = _Probe(ok=False, error="not probed")
            return found.get("nixl", missing), found.get("nixl_rbln", missing)
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    err = _Probe(ok=False, error=f"probe exited {done.returncode}: {tail[0]}")
    return err, err


def _side_channel_check(host: str, port: int) -> Check:
    name = "side-channel port"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return Check(name=name, status=Status.FAIL, detail=f"cannot resolve {host}: {exc}")
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            # ZMQ sets SO_REUSEADDR on its listeners too: TIME_WAIT leftovers are no
            # obstacle, a live listener is.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(1)
    except OSError as exc:
        return Check(
            name=name,
            status=Status.FAIL,
            detail=f"{host}:{port} cannot be bound ({exc.strerror or exc}); another instance "
            "may hold it: give each instance its own VLLM_NIXL_SIDE_CHANNEL_PORT",
        )
    detail = f"{host}:{port} is free"
    if host in ("localhost", "127.0.0.1", "::1"):
        detail += (
            "; peers on other hosts cannot reach localhost: set VLLM_NIXL_SIDE_CHANNEL_HOST "
            "to a routable address for two-host P/D"
        )
    return Check(name=name, status=Status.OK, detail=detail)


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (unresolvable: no)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _auth_check(host: str, port: int, secret: str | None) -> Check:
    """Is the side channel authenticated? Without a secret, anyone who reaches the port
    can release another request's lease, register for its KV or fill tables (issue 16's
    threat model, docs/RELIABILITY.md): harmless on loopback, a WARN elsewhere."""
    name = "side-channel auth"
    if secret:
        if len(secret.encode()) < MIN_SECRET_BYTES:
            return Check(
                name=name,
                status=Status.FAIL,
                detail=f"{AUTH_SECRET_ENV} is {len(secret.encode())} bytes; kvxfer refuses "
                f"secrets under {MIN_SECRET_BYTES} bytes",
            )
        return Check(
            name=name,
            status=Status.OK,
            detail=f"HMAC-SHA256 with the shared secret in {AUTH_SECRET_ENV}",
        )
    if _is_loopback(host):
        return Check(
            name=name,
            status=Status.INFO,
            detail=f"unauthenticated, but {host} is loopback: only this host can reach it",
        )
    return Check(
        name=name,
        status=Status.WARN,
        detail=f"UNAUTHENTICATED on {host}:{port}, a non-loopback address: anyone who "
        "reaches it can release leases, redirect pushes and grow tables; set "
        f"{AUTH_SECRET_ENV} to the same secret (>= {MIN_SECRET_BYTES} bytes) on every instance",
    )


def _link_check(found: Discovery) -> Check:
    name = "RDMA link state"
    if not found.ports:
        return Check(
            name=name,
            status=Status.FAIL,
            detail="no RDMA devices: " + "; ".join(found.notes[:1] or ("none found",)),
        )
    active = sum(p.state.label == "ACTIVE" for p in found.ports)
    parts = [f"{p.name} {p.state.label} ({p.netdev or 'no netdev'})" for p in found.ports]
    status = Status.OK if active else Status.FAIL
    return Check(name=name, status=status, detail=f"{active} ACTIVE: " + ", ".join(parts))


def _network_checks(found: Discovery) -> list[Check]:
    net = found.network
    failed_route = [] if net.routes_known else [p for p in found.problems if "route" in p]
    failed_addr = [] if net.addresses_known else [p for p in found.problems if "addr" in p]
    if failed_route:
        route = Check(name="default route", status=Status.FAIL, detail="; ".join(failed_route))
    elif net.default_route:
        route = Check(
            name="default route",
            status=Status.OK,
            detail=f"via {', '.join(net.default_route)} (never a rail)",
        )
    else:
        route = Check(name="default route", status=Status.OK, detail="none (nothing excluded)")
    if failed_addr:
        return [
            route,
            Check(name="IPv4 addresses", status=Status.FAIL, detail="; ".join(failed_addr)),
        ]
    rdma_netdevs = [p.netdev for p in found.ports if p.netdev]
    shown = rdma_netdevs or sorted(net.ipv4)
    text = ", ".join(f"{n} {' '.join(net.ipv4.get(n, ())) or '(none)'}" for n in shown)
    prefix = "RDMA netdevs: " if rdma_netdevs else "host (no RDMA netdevs): "
    return [route, Check(name="IPv4 addresses", status=Status.OK, detail=prefix + (text or "none"))]


def _numa_checks(found: Discovery, numa: NumaNode | None) -> Check:
    name = "NIC NUMA nodes"
    if not found.ports:
        return Check(name=name, status=Status.FAIL, detail="no RDMA NICs")
    text = ", ".join(f"{p.device}={'?' if p.numa is None else p.numa}" for p in found.ports)
    if numa is None:
        return Check(name=name, status=Status.INFO, detail=f"{text} (accelerator node unknown)")
    local = sum(p.numa == numa.node for p in found.ports)
    status = Status.OK if local else Status.FAIL
    return Check(name=name, status=status, detail=f"{text}; {local} on numa={numa.node}")


def _nixl_checks(nixl: _Probe, rbln: _Probe) -> list[Check]:
    if not nixl.ok:
        first = Check(
            name="NIXL plugins",
            status=Status.FAIL,
            detail=f"nixl unusable ({nixl.error}); pip install 'kvxfer[nixl]'",
        )
    else:
        has_ucx = "UCX" in nixl.plugins
        first = Check(
            name="NIXL plugins",
            status=Status.OK if has_ucx else Status.FAIL,
            detail=f"nixl {nixl.version or '?'}: {', '.join(nixl.plugins) or 'none'}"
            + ("" if has_ucx else " (no UCX plugin)"),
        )
    if not rbln.ok:
        second = Check(
            name="nixl-rbln",
            status=Status.WARN,
            detail=f"not available ({rbln.error}): device-to-device "
            '(kv_buffer_device "rbln") is refused; host bounce falls back to UCX',
        )
    elif "RBLN" not in nixl.plugins:
        second = Check(
            name="nixl-rbln",
            status=Status.WARN,
            detail=f"nixl_rbln {rbln.version} imports, but NIXL lists no RBLN plugin",
        )
    else:
        second = Check(name="nixl-rbln", status=Status.OK, detail=f"nixl_rbln {rbln.version}")
    return [first, second]


#: The values UCX reads as on.
_ON = frozenset({"y", "yes", "on", "1"})


def cuda_ipc_check(environ: Mapping[str, str], gpus: Path | None = None) -> Check | None:
    """Whether kvxfer's agents read GPU memory over cuda_ipc, on a host whose NVIDIA
    driver lists a GPU (``gpus``: that listing; default ``/proc/driver/nvidia/gpus``);
    None on any other host."""
    from kvxfer.backends._nixl import CUDA_IPC_GET_ZCOPY as _GET_ZCOPY
    from kvxfer.backends._nixl import ucx_defaults

    default = ucx_defaults(gpus).get(_GET_ZCOPY)
    if default is None:
        return None
    name, value = "cuda_ipc GETs", environ.get(_GET_ZCOPY)
    uses = "pulls of GPU memory between processes of this host read it over cuda_ipc"
    if value is None:
        return Check(
            name=name, status=Status.OK, detail=f"{_GET_ZCOPY}={default} (kvxfer's default): {uses}"
        )
    if value.strip().lower() in _ON:
        return Check(name=name, status=Status.OK, detail=f"{_GET_ZCOPY}={value} (set): {uses}")
    return Check(
        name=name,
        status=Status.WARN,
        detail=f"{_GET_ZCOPY}={value} (set): UCX may turn cuda_ipc GETs off (it does on "
        "GPUs without active NVLink), and pulls of GPU memory between processes of this "
        "host then go through host memory over TCP (0.5 GB/s against 130 on an H200); "
        "unset it or set y",
    )


def list_writes_check(environ: Mapping[str, str]) -> Check | None:
    """What NIXL's UCX backend does with a push's writes, when the operator set
    ``NIXL_UCX_SGL_ENABLE`` (None when unset: one UCX put per descriptor, NIXL's
    default). A value NIXL cannot read fails: its UCX backend would not start."""
    from kvxfer.backends._nixl import LIST_WRITES, list_writes
    from kvxfer.errors import ConfigError

    value = environ.get(LIST_WRITES)
    if value is None:
        return None
    name = "UCX list writes"
    try:
        on = list_writes(environ)
    except ConfigError as exc:
        return Check(name=name, status=Status.FAIL, detail=str(exc))
    if not on:
        detail = f"{LIST_WRITES}={value}: one UCX put per descriptor"
        return Check(name=name, status=Status.INFO, detail=detail)
    return Check(
        name=name,
        status=Status.INFO,
        detail=f"{LIST_WRITES}={value}: each WRITE (a push) is one UCX put of a list, which "
        "UCX can hand to RDMA (mlx5) and, with nixl-cu13, to cuda_ipc in one call, and "
        "emulates one element at a time elsewhere; READs (pulls) are unchanged",
    )


def _nic_rows(selection: Selection, numa_known: bool) -> tuple[NicRow, ...]:
    rows = []
    for v in selection.verdicts:
        reasons = tuple(
            r.detail for r in v.rejections if numa_known or r.reason is not Reason.WRONG_NUMA
        )
        rows.append(
            NicRow(
                nic=v.port.name,
                state=v.port.state.label,
                link_layer=v.port.link_layer.value,
                netdev=v.port.netdev,
                ipv4=v.ipv4,
                numa=v.port.numa,
                default_route=v.default_route,
                rail=numa_known and v.usable,
                reasons=reasons,
                notes=v.port.notes,
            )
        )
    return tuple(rows)


def _rails_check(
    found: Discovery, numa: NumaNode | None, selection: Selection, rails: tuple[Rail, ...]
) -> Check:
    if rails:
        detail = ", ".join(f"{r.name} ({r.netdev} {r.ipv4})" for r in rails)
        return Check(name="rails", status=Status.OK, detail=detail)
    if not found.ports:
        detail = "none: no RDMA NIC on this host"
    elif numa is None:
        detail = "none: the accelerator's NUMA node is unknown"
    else:
        detail = selection.error_message().splitlines()[0]
    return Check(name="rails", status=Status.FAIL, detail=detail)


def run_checks(
    *,
    sysfs_root: str = "/sys",
    numa_node: int | None = None,
    pci_address: str | None = None,
    netns: str | None = None,
    host: str = "localhost",
    port: int = DEFAULT_SIDE_CHANNEL_PORT,
    nixl_timeout_s: float = 60.0,
    auth_secret: str | None = None,
) -> Report:
    """Run every check and build the report (what ``main`` prints).

    Args:
        sysfs_root: The directory that plays ``/sys``.
        numa_node: The accelerator's NUMA node; found through ``rbln-smi -j`` if None.
        pci_address: The accelerator's PCI address, read from sysfs when given.
        netns: Read addresses and routes inside this network namespace.
        host: Side-channel host to bind.
        port: Side-channel port to bind.
        nixl_timeout_s: Deadline of the NIXL probe subprocess.
        auth_secret: The side channel's shared secret (``main`` reads
            ``$KVXFER_AUTH_SECRET``); None or empty: unauthenticated.
    """
    runner = command_runner(("ip", "netns", "exec", netns) if netns else ())
    checks: list[Check] = []
    numa: NumaNode | None = None
    try:
        numa = accelerator_numa(numa_node=numa_node, pci_address=pci_address, sysfs_root=sysfs_root)
        checks.append(
            Check(
                name="accelerator NUMA node",
                status=Status.OK,
                detail=f"{numa.node} ({numa.source})",
            )
        )
    except RailError as exc:
        checks.append(Check(name="accelerator NUMA node", status=Status.FAIL, detail=str(exc)))

    found = discover(sysfs_root=sysfs_root, runner=runner)
    checks.append(_link_check(found))
    checks += _network_checks(found)
    checks.append(_numa_checks(found, numa))
    checks.append(Check(name="pyverbs", status=Status.INFO, detail=found.notes[-1]))

    nixl, rbln = _probe_nixl(nixl_timeout_s)
    checks += _nixl_checks(nixl, rbln)
    gpu = cuda_ipc_check(os.environ)
    if gpu is not None:  # a GPU host only
        checks.append(gpu)
    writes = list_writes_check(os.environ)
    if writes is not None:  # set by the operator only
        checks.append(writes)
    checks.append(_side_channel_check(host, port))
    checks.append(_auth_check(host, port, auth_secret))

    # Without the accelerator's node only the other three rules can be judged.
    selection = evaluate(found, numa.node if numa is not None else -(2**31))
    rails = selection.rails if numa is not None else ()
    checks.append(_rails_check(found, numa, selection, rails))

    failed = [c for c in checks if c.status is Status.FAIL]
    if not failed:
        summary = f"READY: {len(rails)} rail(s) on numa={numa.node if numa is not None else '?'}"
    elif not found.ports:
        why = found.notes[0] if found.notes else "no RDMA device found"
        summary = f"NOT READY: this host has no RDMA NIC ({why})"
    else:
        summary = "NOT READY: " + "; ".join(f"{c.name}: {c.detail}" for c in failed[:3])
    return Report(
        ready=not failed,
        summary=summary,
        numa_node=numa.node if numa is not None else None,
        numa_source=numa.source if numa is not None else "",
        checks=tuple(checks),
        nics=_nic_rows(selection, numa is not None),
        rails=rails,
        ucx_net_devices=ucx_env(rails) if rails else None,
        nixl_plugins=nixl.plugins,
        notes=found.notes + found.problems,
    )


# ------------------------------------------------------------------------ output


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def render(report: Report) -> str:
    """The human-readable report."""
    lines = [f"kvxfer doctor: {report.summary}", ""]
    lines += _table(
        ("CHECK", "STATUS", "DETAIL"),
        [(c.name, c.status.value.upper(), c.detail) for c in report.checks],
    )
    node = "?" if report.numa_node is None else str(report.numa_node)
    lines += ["", f"NICs (accelerator on numa={node}):"]
    if report.nics:
        rows = [
            (
                n.nic,
                n.state,
                n.link_layer,
                n.netdev or "-",
                ",".join(n.ipv4) or "-",
                "?" if n.numa is None else str(n.numa),
                "RAIL" if n.rail else "reject: " + "; ".join(n.reasons or ("NUMA not checked",)),
            )
            for n in report.nics
        ]
        lines += [
            "  " + line
            for line in _table(("NIC", "STATE", "LINK", "NETDEV", "IPV4", "NUMA", "VERDICT"), rows)
        ]
    else:
        lines.append("  none")
    rails = ", ".join(r.name for r in report.rails) or "none"
    lines += ["", f"rails: {rails}"]
    if report.ucx_net_devices:
        lines.append(f"UCX_NET_DEVICES={report.ucx_net_devices}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    env_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
    p = argparse.ArgumentParser(
        prog="kvxfer doctor",
        description="Check RDMA NICs, routes, NIXL and the side channel; exit 0 only when ready.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sysfs-root", default="/sys", help="directory that plays /sys")
    p.add_argument("--numa-node", type=int, help="accelerator NUMA node (else rbln-smi -j)")
    p.add_argument("--pci", dest="pci_address", help="accelerator PCI address, read from sysfs")
    p.add_argument("--netns", help="read addresses and routes inside this network namespace")
    p.add_argument(
        "--host",
        default=os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
        help="side-channel host (default: $VLLM_NIXL_SIDE_CHANNEL_HOST or localhost)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env_port) if env_port.isdigit() else DEFAULT_SIDE_CHANNEL_PORT,
        help="side-channel port (default: $VLLM_NIXL_SIDE_CHANNEL_PORT or 5600)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvxfer doctor``; returns 0 when ready, 1 when not."""
    args = _parser().parse_args(argv)
    report = run_checks(
        sysfs_root=args.sysfs_root,
        numa_node=args.numa_node,
        pci_address=args.pci_address,
        netns=args.netns,
        host=args.host,
        port=args.port,
        auth_secret=os.environ.get(AUTH_SECRET_ENV) or None,
    )
    if args.json:
        print(msgspec.json.encode(report).decode())
    else:
        print(render(report))
    return 0 if report.ready else 1
