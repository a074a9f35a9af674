"""HTTP from the test process to servers inside other network namespaces ("hosts").

The test process stays in the host's namespace; only a socket it opens for a request
to a namespaced server is made inside that namespace: the opening thread joins it
(``setns``, which moves one thread only), creates and connects the socket, and goes
back. A socket keeps the namespace it was created in, so the request then runs like
any other, from any thread. This is a client's view from inside the namespace (its
``127.0.0.1`` is the namespace's loopback), with nothing routed through the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

__all__ = ["connect", "netns_opener", "thread_in_netns"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


@contextlib.contextmanager
def thread_in_netns(name: str) -> Iterator[None]:
    """Run the body with the calling thread (only) in network namespace ``name``."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
        try:
            _setns(target, name)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home, "the thread's own namespace")
    finally:
        os.close(home)


def connect(netns: str, host: str, port: int, timeout: float | None = None) -> socket.socket:
    """A TCP connection to ``host:port`` as seen from inside ``netns``."""
    with thread_in_netns(netns):
        return socket.create_connection((host, port), timeout=timeout)


class _NetnsHandler(urllib.request.HTTPHandler):
    def __init__(self, netns: str) -> None:
        super().__init__()
        self._netns = netns

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        netns = self._netns

        class Connection(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = connect(netns, self.host, self.port, self.timeout)

        return self.do_open(Connection, req)


def netns_opener(netns: str) -> urllib.request.OpenerDirector:
    """A urllib opener whose HTTP connections are made inside ``netns``."""
    return urllib.request.build_opener(_NetnsHandler(netns))


def urlopen(netns: str | None, req: urllib.request.Request, timeout: float) -> Any:
    """``urllib.request.urlopen`` from the host, or from inside ``netns`` when given."""
    if netns is None:
        return urllib.request.urlopen(req, timeout=timeout)
    return netns_opener(netns).open(req, timeout=timeout)
