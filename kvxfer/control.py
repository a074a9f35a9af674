"""The side channel: ZMQ over TCP, carrying handshakes and small control messages.

This module is kvxfer's only zmq user. It moves opaque byte frames; what they mean is
:mod:`kvxfer.wire` and :mod:`kvxfer.handshake`'s business. Everything is bounded: the
server drops frames over a hard size cap before reading them, answers each request
from one thread that never blocks on a client, and the client has a receive timeout,
a fixed number of retries with backoff, and a fresh socket per try (a REQ socket that
timed out cannot be reused).

Nothing here delays the process's exit: the server's thread is a daemon, and a client's
pending requests wait in short slices that :meth:`SideChannelClient.close` cuts short
(a request towards a dead peer would otherwise keep its caller, often a worker thread
the interpreter joins at exit, for every try: 3 × 5 s by default).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvxfer.errors import HandshakeError, HandshakeTimeout, missing_dependency

__all__ = ["SideChannelClient", "SideChannelServer", "format_address"]

log = logging.getLogger("kvxfer.control")

# A pending request checks for close() this often; also the longest a closed client's
# request keeps its thread.
_SLICE_S = 0.05

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


class SideChannelServer:
    """A ROUTER socket served by one daemon thread.

    Args:
        host: Interface to bind (``0.0.0.0`` for all).
        port: TCP port; 0 picks a free one (see :attr:`port`).
        handler: Turns a request frame into a reply frame. It must not raise; if it
            does anyway, the error is logged and the client gets no reply (it times out).
        max_bytes: Frames above this are answered by ``oversize_reply`` without parsing.
        oversize_reply: Reply for oversized frames (a wire ``Reject``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[bytes], bytes],
        *,
        max_bytes: int,
        oversize_reply: Callable[[int], bytes],
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
        self._thread = threading.Thread(target=self._run, name="kvxfer-side-channel", daemon=True)
        self._thread.start()

    def _reply(self, frames: list[bytes], payload: bytes) -> None:
        # REQ clients put an empty delimiter after the identity; DEALER clients do not.
        envelope = frames[:2] if len(frames) >= 3 and frames[1] == b"" else frames[:1]
        try:
            self._sock.send_multipart([*envelope, payload], flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError as exc:  # client gone or its queue full: drop
            log.debug("side channel: reply dropped: %s", exc)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.debug("side channel: receive failed: %s", exc)
                continue
            if len(frames) < 2:
                continue
            payload = frames[-1]
            if len(payload) > self._max_bytes:
                log.warning(
                    "side channel: rejected a %d-byte frame (limit %d)",
                    len(payload),
                    self._max_bytes,
                )
                self._reply(frames, self._oversize(len(payload)))
                continue
            try:
                reply = self._handler(payload)
            except Exception:
                log.exception("side channel: handler failed; no reply sent")
                continue
            self._reply(frames, reply)
        self._sock.close(0)
        self._ctx.term()

    def close(self) -> None:
        """Stop serving and release the socket; idempotent."""
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
    ) -> bytes:
        """Send one frame and return the reply frame.

        Args:
            host: The peer's side-channel host.
            port: The peer's side-channel port.
            payload: The request frame.
            timeout_s: This request's per-try timeout (default :attr:`timeout_s`), e.g. a
                liveness probe's short one.
            retries: This request's further tries (default :attr:`retries`).

        Raises:
            HandshakeTimeout: no reply after every try (names the address and the setting).
            HandshakeError: the address is malformed, or the client was closed (before
                or during the request).
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
                reply = self._receive(sock, time.monotonic() + timeout, address)
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

    def _receive(self, sock: Any, deadline: float, address: str) -> bytes | None:
        """The reply, or None at the deadline; waits in slices so close() cuts it short."""
        zmq = self._zmq
        while True:
            if self._closed.is_set():
                raise self._cancelled(address)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if sock.poll(max(1, int(min(left, _SLICE_S) * 1000)), zmq.POLLIN):
                reply: bytes = sock.recv(flags=zmq.NOBLOCK)
                return reply
