"""One backend endpoint for the conformance suite, in this process or a spawned child.

An :class:`Endpoint` owns one backend and the memory it registered (a
:class:`~kvxfer.testing.patterns.PatternCache`). A :class:`SpawnedEndpoint` runs one in
a child process started with the ``spawn`` method and drives it over a pipe; the child
keeps polling its backend for notifications while idle, as an agent's progress thread
would. Code that starts spawned endpoints from a script needs the usual
``if __name__ == "__main__":`` guard of the ``spawn`` start method.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.backend import Backend, BackendOptions, Capabilities, PeerHandle, XferOp, XferStatus
from kvxfer.core.descriptors import DescriptorTable, PlanOptions
from kvxfer.core.layout import KVLayout, MemKind
from kvxfer.errors import BackendError, TransferTimeout
from kvxfer.registry import get_backend
from kvxfer.testing.patterns import CacheShape, PatternCache

__all__ = [
    "BackendSpec",
    "Collected",
    "Endpoint",
    "EndpointInfo",
    "EndpointLike",
    "SpawnedEndpoint",
]

IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]
Groups = Sequence[Sequence[int]]


class BackendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the backend under test, in this process or a child.

    Attributes:
        name: The backend's registry name (``kvxfer.backends`` entry point).
        extra: ``BackendOptions.extra`` for every endpoint.
        mem: The memory kind the test cache claims (host memory either way).
        in_process: Peers live in the test process (backends with an in-process
            fabric); otherwise the peer runs in a spawned child process.
        env: Environment variables set in a child before its backend is built.
    """

    name: str
    extra: dict[str, str] = msgspec.field(default_factory=dict)
    mem: MemKind = MemKind.DRAM
    in_process: bool = False
    env: dict[str, str] = msgspec.field(default_factory=dict)

    def create(self, agent_name: str) -> Backend:
        """Build one backend instance through the registry."""
        cls = get_backend(self.name)
        return cls(BackendOptions(agent_name=agent_name, extra=dict(self.extra)))


class EndpointInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a peer needs to connect to an endpoint."""

    agent_name: str
    metadata: bytes
    layout: KVLayout
    capabilities: Capabilities
    pid: int


class Collected(msgspec.Struct, kw_only=True):
    """Notifications received since the last collect, and memory at the first arrival."""

    notifications: list[tuple[str, bytes]]
    snapshot: ByteArray | None = None


class EndpointLike(Protocol):
    """The operations a harness drives on an endpoint, wherever it lives."""

    def info(self) -> EndpointInfo: ...
    def configure(self, options: PlanOptions) -> None: ...
    def connect(self, peer: EndpointInfo) -> PeerHandle: ...
    def disconnect(self, peer: PeerHandle) -> None: ...
    def fill(self, seed: int) -> None: ...
    def snapshot(self) -> ByteArray: ...
    def stage_out(self, groups: Groups) -> None: ...
    def stage_in(self, groups: Groups) -> None: ...
    def arm(self, stage_in: Groups | None) -> None: ...
    def collect(self) -> Collected: ...
    def notify(self, peer: PeerHandle, payload: bytes) -> None: ...
    def read_from(self, peer: EndpointInfo, count: int) -> XferStatus: ...
    def abandon(self) -> int | None: ...
    def close(self) -> int | None: ...


def _groups(groups: Groups) -> list[IntArray]:
    return [np.asarray(g, dtype=np.int64) for g in groups]


class Endpoint:
    """One backend with its registered :class:`PatternCache` (see the module docstring)."""

    def __init__(self, spec: BackendSpec, agent_name: str, shape: CacheShape) -> None:
        self.spec = spec
        self.cache = PatternCache(shape)
        self.backend = spec.create(agent_name)
        try:
            self.exposed = self.backend.register(self.cache.layout)
            self.options = PlanOptions()
            self.table = DescriptorTable.build(self.exposed, self.options)
            self.backend.prepare_local(self.table)
        except BaseException:
            self.backend.close()
            raise
        # Keyed by the backend's own handle, kept opaque (never converted).
        self.peer_tables: dict[PeerHandle, DescriptorTable] = {}
        self._by_name: dict[str, PeerHandle] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._armed: list[IntArray] | bool | None = False
        self.closed = False
        self._arrival: ByteArray | None = None

    def info(self) -> EndpointInfo:
        """Metadata, exposed layout and capabilities of this endpoint."""
        return EndpointInfo(
            agent_name=self.backend.agent_name,
            metadata=self.backend.metadata(),
            layout=self.exposed,
            capabilities=self.backend.capabilities,
            pid=os.getpid(),
        )

    def configure(self, options: PlanOptions) -> None:
        """Rebuild and prepare the local table for ``options`` (peers must reconnect)."""
        self.options = options
        self.table = DescriptorTable.build(self.exposed, options)
        self.backend.prepare_local(self.table)

    def connect(self, peer: EndpointInfo) -> PeerHandle:
        """Add ``peer`` with its table built for the current options; returns the handle."""
        old = self._by_name.get(peer.agent_name)
        if old is not None:
            self.disconnect(old)
        table = DescriptorTable.build(peer.layout, self.options)
        handle = self.backend.add_peer(peer.metadata, table)
        self.peer_tables[handle] = table
        self._by_name[peer.agent_name] = handle
        return handle

    def disconnect(self, peer: PeerHandle) -> None:
        """Remove a peer."""
        self.backend.remove_peer(peer)
        self.peer_tables.pop(peer, None)
        self._by_name = {k: v for k, v in self._by_name.items() if v != peer}

    def fill(self, seed: int) -> None:
        """Reset the engine memory to the pattern of ``seed``."""
        self.cache.fill(seed)

    def snapshot(self) -> ByteArray:
        """A copy of the engine memory."""
        return self.cache.snapshot()

    def stage_out(self, groups: Groups) -> None:
        """Call the backend's ``stage_out`` (producer side, before peers read)."""
        self.backend.stage_out(_groups(groups))

    def stage_in(self, groups: Groups) -> None:
        """Call the backend's ``stage_in`` (consumer side, after blocks landed)."""
        self.backend.stage_in(_groups(groups))

    def arm(self, stage_in: Groups | None) -> None:
        """At the next notification: stage ``stage_in`` blocks in (if given), snapshot."""
        self._armed = None if stage_in is None else _groups(stage_in)
        self._arrival = None

    def pump(self) -> None:
        """Drain the backend's notifications into the inbox (an agent's progress step)."""
        notifs = self.backend.drain_notifications()
        if not notifs:
            return
        self._inbox.extend(notifs)
        if self._armed is not False:
            # Snapshot in the same step that saw the notification: anything the peer
            # wrote must already be there (the backend promised bytes-before-notice).
            if isinstance(self._armed, list):
                self.backend.stage_in(self._armed)
            self._arrival = self.cache.snapshot()
            self._armed = False

    def collect(self) -> Collected:
        """Notifications since the last call, with the memory snapshot taken at arrival."""
        self.pump()
        out = Collected(notifications=self._inbox, snapshot=self._arrival)
        self._inbox, self._arrival = [], None
        return out

    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        """Send a notification outside any transfer."""
        self.backend.notify(peer, payload)

    def read_from(self, peer: EndpointInfo, count: int) -> XferStatus:
        """Connect to ``peer`` and READ ``count`` descriptors, leaving the handle unreleased."""
        handle = self.connect(peer)
        ids = np.arange(count, dtype=np.int64)
        xfer = self.backend.post(XferOp.READ, handle, ids, ids, b"")
        deadline = time.monotonic() + 20
        state = self.backend.status(xfer)
        while state is XferStatus.PENDING and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = self.backend.status(xfer)
        return state

    def abandon(self) -> int | None:
        """In this process a backend can only be closed (see :meth:`SpawnedEndpoint.abandon`)."""
        self.close()
        return None

    def close(self) -> None:
        """Close the backend (idempotent); nothing to wait for in this process."""
        self.closed = True
        self.backend.close()


def _serve(
    conn: multiprocessing.connection.Connection,
    spec: BackendSpec,
    agent_name: str,
    shape: CacheShape,
) -> None:
    """Child process main: host an :class:`Endpoint` and answer calls over ``conn``."""
    os.environ.update(spec.env)
    try:
        ep = Endpoint(spec, agent_name, shape)
        conn.send(("ok", ep.info()))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    clean = True
    try:
        while True:
            if not conn.poll(0.001):
                ep.pump()  # keep the transport progressing, like an agent's thread
                continue
            msg = conn.recv()
            if msg is None:
                break
            if msg == "abandon":
                # Exit like an engine that forgets close(): the endpoint stays referenced
                # until interpreter exit, so the backend's atexit teardown has to work.
                _ABANDONED.append(ep)
                clean = False
                break
            method, args = msg
            try:
                conn.send(("ok", getattr(ep, method)(*args)))
            except Exception as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone: close and exit like any process would
    finally:
        if clean:
            ep.close()


_ABANDONED: list[Endpoint] = []


class SpawnedEndpoint:
    """An :class:`Endpoint` in a ``spawn``-ed child process, driven over a pipe."""

    def __init__(self, spec: BackendSpec, agent_name: str, shape: CacheShape) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, spec, agent_name, shape), daemon=True, name=agent_name
        )
        self.process.start()
        child.close()
        self._info: EndpointInfo | None = None
        self._closed = False
        #: Called while waiting for the child: a transfer the child initiates towards this
        #: process needs this process's transport to progress (UCX wire-up over TCP).
        self.while_waiting: Callable[[], None] | None = None

    def wait_ready(self, timeout: float = 60.0) -> EndpointInfo:
        """Wait until the child registered its memory; returns its info."""
        if self._info is None:
            info: EndpointInfo = self._receive(timeout, "start")
            self._info = info
        return self._info

    def _receive(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        try:
            while not self._conn.poll(0.0005 if self.while_waiting else timeout):
                if time.monotonic() > deadline or self.while_waiting is None:
                    raise TransferTimeout(f"peer process {self.process.name}: no answer to {what}")
                self.while_waiting()
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise BackendError(
                f"peer process {self.process.name} died (exit code {self.process.exitcode})"
            ) from exc
        if status != "ok":
            raise BackendError(f"peer process {self.process.name}: {what} failed: {value}")
        return value

    def call(self, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Run ``Endpoint.<method>(*args)`` in the child and return its result."""
        self.wait_ready()
        try:
            self._conn.send((method, args))
        except (OSError, ValueError) as exc:
            raise BackendError(f"peer process {self.process.name} is gone") from exc
        return self._receive(timeout, method)

    def info(self) -> EndpointInfo:
        return self.wait_ready()

    def configure(self, options: PlanOptions) -> None:
        self.call("configure", options)

    def connect(self, peer: EndpointInfo) -> PeerHandle:
        handle: PeerHandle = self.call("connect", peer)
        return handle

    def disconnect(self, peer: PeerHandle) -> None:
        self.call("disconnect", peer)

    def fill(self, seed: int) -> None:
        self.call("fill", seed)

    def snapshot(self) -> ByteArray:
        snap: ByteArray = self.call("snapshot")
        return snap

    def stage_out(self, groups: Groups) -> None:
        self.call("stage_out", [list(map(int, g)) for g in groups])

    def stage_in(self, groups: Groups) -> None:
        self.call("stage_in", [list(map(int, g)) for g in groups])

    def arm(self, stage_in: Groups | None) -> None:
        self.call("arm", None if stage_in is None else [list(map(int, g)) for g in stage_in])

    def collect(self) -> Collected:
        got: Collected = self.call("collect")
        return got

    def notify(self, peer: PeerHandle, payload: bytes) -> None:
        self.call("notify", peer, payload)

    def read_from(self, peer: EndpointInfo, count: int) -> XferStatus:
        state: XferStatus = self.call("read_from", peer, count)
        return state

    def abandon(self, timeout: float = 30.0) -> int | None:
        """Let the child exit *without* closing its backend; returns its exit code."""
        return self._finish("abandon", timeout)

    def close(self, timeout: float = 30.0) -> int | None:
        """Close the backend, let the child exit, and return its exit code."""
        return self._finish(None, timeout)

    def _finish(self, message: str | None, timeout: float) -> int | None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(message)
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            self._conn.close()
        return self.process.exitcode
