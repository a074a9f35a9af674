"""Two network namespaces joined by a veth pair, for ``kvxfer bench --netns``.

The bench creates them, moves one bench process into each (``setns`` in the child
before it opens any socket) and removes them at the end; deleting a namespace deletes
its end of the veth pair, and with it the pair. Addresses come from 10.77.0.0/16 and
exist only inside the namespaces. Needs root (CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import subprocess
from collections.abc import Iterator

import msgspec

__all__ = ["NetnsPair", "enter_netns", "netns_pair", "netns_unavailable"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


class NetnsPair(msgspec.Struct, frozen=True, kw_only=True):
    """The producer's and the consumer's namespace and address."""

    producer_ns: str
    consumer_ns: str
    producer_addr: str
    consumer_addr: str
    producer_dev: str = ""  # the veth end inside each namespace
    consumer_dev: str = ""


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@contextlib.contextmanager
def netns_pair(tag: str | None = None) -> Iterator[NetnsPair]:
    """Create the two namespaces and the veth pair; remove both on exit."""
    why = netns_unavailable()
    if why is not None:
        raise RuntimeError(f"--netns: {why}")
    tag = tag or f"{os.getpid() % 100000}"
    prod, cons = f"kvxb-{tag}-p", f"kvxb-{tag}-c"
    veth_p, veth_c = f"kvxb{tag}p"[:15], f"kvxb{tag}c"[:15]
    subnet = random.randrange(1, 250)
    pair = NetnsPair(
        producer_ns=prod,
        consumer_ns=cons,
        producer_addr=f"10.77.{subnet}.1",
        consumer_addr=f"10.77.{subnet}.2",
        producer_dev=veth_p,
        consumer_dev=veth_c,
    )
    made: list[str] = []
    try:
        for ns in (prod, cons):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", veth_p, "type", "veth", "peer", "name", veth_c)
        _ip("link", "set", veth_p, "netns", prod)
        _ip("link", "set", veth_c, "netns", cons)
        for ns, dev, addr in (
            (prod, veth_p, pair.producer_addr),
            (cons, veth_c, pair.consumer_addr),
        ):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        # Normally gone with the namespace; a failure between add and move leaves it here.
        subprocess.run(["ip", "link", "del", veth_p], capture_output=True, check=False)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter_netns(name: str) -> None:
    """Move the calling process (its main thread, before any other starts) into ``name``.

    Does what ``ip netns exec`` does: joins the namespace, then remounts ``/sys`` in a
    private mount namespace, because UCX lists network devices from
    ``/sys/class/net``, which otherwise still shows the root namespace's interfaces.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns({name})")
    finally:
        os.close(fd)
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # Keep our mounts from propagating back to the host, then a fresh sysfs for this
    # network namespace.
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    _check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    _check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs /sys")
