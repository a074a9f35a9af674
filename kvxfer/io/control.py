"""The side channel: ZMQ over TCP, carrying handshakes and small control messages.

This module is kvxfer's only zmq user. It moves opaque byte frames; what they mean is
:mod:`kvxfer.core.wire` and :mod:`kvxfer.core.handshake`'s business. Everything is bounded: the
server drops frames over a hard size cap before reading them, and the client has a
receive timeout, a fixed number of retries with backoff, and a fresh socket per try (a
REQ socket that timed out cannot be reused).

The server answers cheap requests (a liveness Ping) on its own thread at once, and runs
the slow ones (a handshake's Welcome, a registration, a release: they take locks that
a long transfer call can hold) on a few worker threads (R-SAFE-6): a busy handler never
delays a Ping, so a slow peer is not taken for a dead one. zmq sockets are not
thread-safe, so a worker hands its reply back to the server thread, which sends it.

Nothing here delays the process's exit: the server's thread is a daemon, and a client's
pending requests wait in short slices that :meth:`SideChannelClient.close` cuts short
(a request towards a dead peer would otherwise keep its caller, often a worker thread
the interpreter joins at exit, for every try: 3 × 5 s by default).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeAlias

from kvxfer.errors import ConfigError, HandshakeError, HandshakeTimeout, missing_dependency

__all__ = [
    "PROBE_TIMEOUT_S",
    "Deferred",
    "SideChannelClient",
    "SideChannelServer",
    "dead",
    "format_address",
    "probe_port",
]

log = logging.getLogger("kvxfer.io.control")

# A pending request checks for close() this often; also the longest a closed client's
# request keeps its thread.
_SLICE_S = 0.05

#: The slow part of answering a request, run off the server thread; returns the reply.
Deferred: TypeAlias = Callable[[], bytes]
#: Threads that run the deferred work of one server: handshakes of several peers (a
#: TP consumer's ranks all arrive at once) proceed side by side.
SLOW_WORKERS = 4
#: A deferred request answered later than this, or a server thread held up this long
#: between two polls (its poll wakes every 0.1 s), is logged with where the time went:
#: waiting for a worker, inside the handler, or the whole thread not running (a
#: process-wide stall or starved GIL), so a slow answer seen by a peer can be traced.
SLOW_S = 1.0
#: ``KVXFER_STALL_DUMP_S``: when the server thread is held up this many seconds (at
#: times already at two thirds of it), Python's fault handler writes every thread's stack to
#: stderr *during* the stall (from its own C thread, which needs no GIL), naming the
#: thread that holds the process up. A diagnostic for tests and operators chasing a
#: stall: off when unset. Each arming joins the fault handler's previous thread and
#: starts a new one while holding the GIL (CPython's faulthandler), so the server thread
#: re-arms it only every third of that time, not every round (a round is 0.1 s: ten
#: thread starts a second, each a chance for a loaded host to stall the process).
STALL_DUMP_ENV = "KVXFER_STALL_DUMP_S"


def _stall_dump_s() -> float:
    raw = os.environ.get(STALL_DUMP_ENV, "")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        log.warning("%s=%r: not a number of seconds; no stall dumps", STALL_DUMP_ENV, raw)
        return 0.0
    return value if value > 0 else 0.0


#: Deferred requests waiting beyond this are refused with ``busy_reply`` (a flood of
#: handshakes cannot grow memory without bound, R-SAFE-3).
MAX_DEFERRED = 256

SIDE_CHANNEL_HINT = (
    "check that the peer is running and that its side-channel host/port "
    "(VLLM_NIXL_SIDE_CHANNEL_HOST / VLLM_NIXL_SIDE_CHANNEL_PORT, or AgentConfig."
    "side_channel_host/port) is routable from here"
)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError as exc:
        raise missing_dependency("pyzmq", "zmq", exc) from exc
    return zmq


def format_address(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 literals bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


#: How long a probe's TCP connect to a side-channel port may take (refused at once
#: when nobody listens; a timeout says nothing).
PROBE_TIMEOUT_S = 0.5


def dead(exc: OSError) -> bool:
    """Whether a connect's failure is evidence that the peer's process is gone: its
    port refuses (nobody listens) or the connection was reset. A timeout is not."""
    return isinstance(exc, ConnectionRefusedError | ConnectionResetError)


def probe_port(host: str, port: int) -> socket.socket | OSError:
    """A TCP connection to the peer's side-channel port, or why there is none.

    Raises:
        ConfigError: ``host`` can never name a host (IDNA cannot encode it: an empty
            label, a label over 63 characters), so no retry could reach it.
    """
    try:
        return socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S)
    except OSError as exc:
        return exc
    except UnicodeError as exc:  # getaddrinfo encodes the name first
        raise ConfigError("host", host, f"not a host name ({exc})") from None


class SideChannelServer:
    """A ROUTER socket served by one daemon thread, slow requests by a few more.

    Args:
        host: Interface to bind (``0.0.0.0`` for all).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        handler: Turns a request frame into a reply frame, or into a
            :data:`Deferred` that computes it on a worker thread (what may block on a
            lock or take long must be deferred: the server thread answers everyone
            else). Neither may raise; if one does anyway, the error is logged and the
            client gets no reply (it times out).
        max_bytes: Frames above this are answered by ``oversize_reply`` without parsing.
        oversize_reply: Reply for oversized frames (a wire ``Reject``).
        busy_reply: Reply to a request deferred while :data:`MAX_DEFERRED` wait already
            (a wire ``Reject`` saying retry); None drops it (the client times out).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[bytes], bytes | Deferred],
        *,
        max_bytes: int,
        oversize_reply: Callable[[int], bytes],
        busy_reply: Callable[[], bytes] | None = None,
    ) -> None:
        zmq = _zmq()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A hard cap far above any legal frame protects memory; frames between
        # max_bytes and this cap still get a readable "too large" rejection.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(max_bytes * 4, 1 << 16))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._handler = handler
        self._max_bytes = max_bytes
        self._oversize = oversize_reply
        self._busy = busy_reply
        bind_host = "*" if host in ("0.0.0.0", "") else host
        try:
            if port == 0:
                self.port = int(self._sock.bind_to_random_port(format_address(bind_host, 0)[:-2]))
            else:
                self._sock.bind(format_address(bind_host, port))
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise HandshakeError(
                f"cannot bind the side channel on {host}:{port}: {exc} "
                "(is another instance using this port? set a distinct side-channel port)"
            ) from exc
        self.host = host
        self._stop = threading.Event()
        # Deferred work goes out on _jobs; replies come back on _done, and a byte on
        # the pipe wakes the server thread's poll (it polls the pipe with the socket).
        self._jobs: queue.SimpleQueue[tuple[list[bytes], Deferred, float] | None] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[tuple[list[bytes], bytes]] = queue.SimpleQueue()
        self._waiting = 0  # deferred requests not answered yet (server thread only)
        # Socket objects rather than raw fds: a late worker's send after close() raises
        # instead of writing into whatever file reused the number.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # The workers start here, before anything is served, never from the server
        # thread: Thread.start() waits until the new thread runs, which needs the GIL
        # and the OS's scheduling, and a loaded producer once held its server thread
        # there for more than 3 s (docs/RELIABILITY.md 4.5), answering no Ping meanwhile.
        self._workers = [
            threading.Thread(target=self._work, name=f"kvxfer-side-channel-{i}", daemon=True)
            for i in range(SLOW_WORKERS)
        ]
        for worker in self._workers:
            worker.start()
        self._thread = threading.Thread(target=self._run, name="kvxfer-side-channel", daemon=True)
        self._thread.start()

    def _reply(self, frames: list[bytes], payload: bytes) -> None:
        # REQ clients put an empty delimiter after the identity; DEALER clients do not.
        envelope = frames[:2] if len(frames) >= 3 and frames[1] == b"" else frames[:1]
        try:
            self._sock.send_multipart([*envelope, payload], flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError as exc:  # client gone or its queue full: drop
            log.debug("side channel: reply dropped: %s", exc)

    def _defer(self, frames: list[bytes], work: Deferred) -> None:
        if self._waiting >= MAX_DEFERRED:
            log.warning("side channel: %d slow requests waiting; refused one", self._waiting)
            if self._busy is not None:
                self._reply(frames, self._busy())
            return
        self._waiting += 1
        self._jobs.put((frames, work, time.monotonic()))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            frames, work, queued = job
            started = time.monotonic()
            try:
                reply: bytes | None = work()
            except Exception:
                log.exception("side channel: handler failed; no reply sent")
                reply = None
            ended = time.monotonic()
            if ended - queued > SLOW_S:
                log.warning(
                    "side channel: a request answered %.1fs after it came (%.1fs waiting "
                    "for a worker, %.1fs in its handler)",
                    ended - queued,
                    started - queued,
                    ended - started,
                )
            # Counted even without a reply, so that _waiting comes back down.
            self._done.put((frames, b"" if reply is None else reply))
            # OSError: full (a wake is pending anyway) or closed (the server is gone).
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _send_done(self) -> None:
        with contextlib.suppress(OSError):  # raised once drained
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                frames, reply = self._done.get_nowait()
            except queue.Empty:
                return
            self._waiting -= 1
            if reply:
                self._reply(frames, reply)

    def _serve(self, frames: list[bytes]) -> None:
        payload = frames[-1]
        if len(payload) > self._max_bytes:
            log.warning(
                "side channel: rejected a %d-byte frame (limit %d)", len(payload), self._max_bytes
            )
            self._reply(frames, self._oversize(len(payload)))
            return
        try:
            answer = self._handler(payload)
        except Exception:
            log.exception("side channel: handler failed; no reply sent")
            return
        if isinstance(answer, bytes):
            self._reply(frames, answer)
        else:
            self._defer(frames, answer)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        wake = self._wake_r.fileno()
        poller.register(wake, zmq.POLLIN)
        last = time.monotonic()
        dump_s = _stall_dump_s()
        armed = -dump_s
        while not self._stop.is_set():
            now = time.monotonic()
            if dump_s and now - armed >= dump_s / 3:
                # It fires only when the thread is not back to re-arm it in time.
                faulthandler.dump_traceback_later(dump_s, exit=False, file=sys.stderr)
                armed = now
            if now - last > SLOW_S:
                log.warning(
                    "side channel: one round of the server thread (a 0.1 s poll and the "
                    "inline answers) took %.1fs: the process or its GIL did not run it",
                    now - last,
                )
            last = now
            try:
                ready = dict(poller.poll(100))
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.debug("side channel: poll failed: %s", exc)
                continue
            if wake in ready:
                self._send_done()
            if self._sock not in ready:
                continue
            # Everything queued, then back to the poll (replies of deferred work).
            for _ in range(64):
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    log.debug("side channel: receive failed: %s", exc)
                    break
                if len(frames) >= 2:
                    self._serve(frames)
        if dump_s:
            faulthandler.cancel_dump_traceback_later()
        for _ in self._workers:
            self._jobs.put(None)
        self._sock.close(0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def close(self) -> None:
        """Stop serving and release the socket; idempotent. A worker still inside a
        handler is a daemon thread and ends with it (its reply is dropped)."""
        if not self._stop.is_set():
            self._stop.set()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=5)

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SideChannelClient:
    """Request/reply over short-lived REQ sockets with timeouts and retries.

    Thread-safe: every request has its own socket. :meth:`close` cancels the requests
    in flight (each raises within about 50 ms) and refuses new ones.

    Args:
        timeout_s: How long one try waits for the reply.
        retries: Further tries after the first one times out.
        backoff_s: Pause before the first retry, doubled on each further one.
        max_bytes: Replies larger than this are refused by the socket.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        max_bytes: int = 1 << 22,
    ) -> None:
        self._zmq = _zmq()
        self._ctx = self._zmq.Context.instance()
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_bytes = max_bytes
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._closed.is_set()

    def close(self) -> None:
        """Cancel every pending request and refuse new ones; idempotent, never blocks.

        Sockets are closed by the threads that own them (zmq sockets are not
        thread-safe), each within one wait slice (~50 ms).
        """
        self._closed.set()

    def _cancelled(self, address: str) -> HandshakeError:
        return HandshakeError(f"side channel {address}: request cancelled (the client was closed)")

    def request(
        self,
        host: str,
        port: int,
        payload: bytes,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> bytes:
        """Send one frame and return the reply frame.

        Args:
            host: The peer's side-channel host.
            port: The peer's side-channel port.
            payload: The request frame.
            timeout_s: This request's per-try timeout (default :attr:`timeout_s`), e.g. a
                liveness probe's short one.
            retries: This request's further tries (default :attr:`retries`).
            cancel: Asked in every wait slice (~50 ms); True ends the request with a
                HandshakeError (a liveness probe stops waiting once its watch
                connection to the peer broke).

        Raises:
            HandshakeTimeout: no reply after every try (names the address and the setting).
            HandshakeError: the address is malformed, the client was closed (before
                or during the request), or ``cancel`` said so.
        """
        zmq = self._zmq
        address = format_address(host, port)
        if self._closed.is_set():
            raise self._cancelled(address)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        delay = self.backoff_s
        tries = (self.retries if retries is None else retries) + 1
        for attempt in range(1, tries + 1):
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
            try:
                sock.connect(address)
                sock.send(payload)
                reply = self._receive(sock, time.monotonic() + timeout, address, cancel)
                if reply is not None:
                    return reply
                log.info("side channel %s: no reply (try %d of %d)", address, attempt, tries)
            except zmq.Again:
                log.info("side channel %s: could not send (try %d of %d)", address, attempt, tries)
            except zmq.ZMQError as exc:
                raise HandshakeError(f"side channel {address}: {exc}; {SIDE_CHANNEL_HINT}") from exc
            finally:
                sock.close(0)
            if attempt < tries:
                if self._closed.wait(delay):
                    raise self._cancelled(address)
                delay *= 2
        raise HandshakeTimeout(
            f"no answer from the side channel at {address} after {tries} tries of "
            f"{timeout:g}s; {SIDE_CHANNEL_HINT}"
        )

    def _receive(
        self, sock: Any, deadline: float, address: str, cancel: Callable[[], bool] | None
    ) -> bytes | None:
        """The reply, or None at the deadline; waits in slices so close() cuts it short."""
        zmq = self._zmq
        while True:
            if self._closed.is_set():
                raise self._cancelled(address)
            if cancel is not None and cancel():
                raise HandshakeError(f"side channel {address}: request cancelled by its caller")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if sock.poll(max(1, int(min(left, _SLICE_S) * 1000)), zmq.POLLIN):
                reply: bytes = sock.recv(flags=zmq.NOBLOCK)
                return reply
