"""A test routing sidecar that does what llm-d's decode sidecar does (its NIXL v2 flow).

llm-d puts a routing sidecar in front of each decode vLLM, in the decode pod: clients
(the gateway, after the EPP picked a prefill pod) send it the OpenAI request with the
header ``x-prefiller-host-port: <prefill pod IP>:<port>``. The sidecar then

1. sends prefill the client's body with ``kv_transfer_params`` replaced by
   ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}``, ``stream``
   false, ``stream_options`` removed, ``max_tokens`` and ``max_completion_tokens`` 1,
   and a fresh ``x-request-id``;
2. answers a non-2xx prefill with that status (and no body);
3. sends its local decode vLLM the client's body (``stream``, ``stream_options``,
   ``max_tokens``, ``max_completion_tokens`` as the client gave them, or absent) with
   ``kv_transfer_params`` as prefill returned them, under the same ``x-request-id``,
   and relays decode's answer (streamed or not) to the client as it comes.

Without the header the request goes to decode as it is. The sidecar is written in Go:
it parses both bodies into generic maps, so every JSON number is a float64, and writes
them back with Go's encoder; this one does the same (tests/float64_json.py), so a value
in ``kv_transfer_params`` that a float64 cannot hold arrives changed, as it does in
llm-d. A client that hangs up makes the sidecar close its upstream connection (Go's
reverse proxy cancels the upstream request), so vLLM aborts the request.

Written for the tests from the flow above (clean room). Run it as
``python -m tests.e2e.sidecar --port 8000 --decoder 127.0.0.1:8200``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import select
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.float64_json import go_marshal, parse_float64

log = logging.getLogger("sidecar")

PREFILL_HEADER = "x-prefiller-host-port"
REQUEST_ID_HEADER = "x-request-id"
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: The fields the prefill request overrides and the decode request restores.
CLIENT_FIELDS = ("stream", "stream_options", "max_tokens", "max_completion_tokens")
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
        "host",
        REQUEST_ID_HEADER,
    }
)


class ClientGone(Exception):
    """The client hung up before the answer was complete."""


def prefill_body(client: dict[str, Any]) -> dict[str, Any]:
    """The body prefill gets (step 1 of the flow)."""
    body = dict(client)
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = 1
    body["max_completion_tokens"] = 1
    return body


def decode_body(client: Mapping[str, Any], params: Any) -> dict[str, Any]:
    """The body decode gets: the client's, with prefill's ``kv_transfer_params``."""
    body = dict(client)
    body["kv_transfer_params"] = params
    return body


def _exchange(
    client: socket.socket,
    upstream: tuple[str, int],
    request: bytes,
    sink: Callable[[bytes], None] | None,
) -> bytes:
    """Send one request upstream (``Connection: close``) and read the answer to its end:
    into ``sink`` as it comes, or returned whole. A client that hangs up first raises
    :class:`ClientGone`, with the upstream connection closed (the engine aborts)."""
    up = socket.create_connection(upstream, timeout=30.0)
    try:
        up.sendall(request)
        chunks: list[bytes] = []
        watch_client = True
        while True:
            wanted = [up, client] if watch_client else [up]
            ready, _, _ = select.select(wanted, [], [], 1.0)
            if client in ready:
                try:
                    peek = client.recv(1, socket.MSG_PEEK)
                except OSError:
                    peek = b""
                if not peek:
                    raise ClientGone
                watch_client = False  # the client sent more: not ours to read
            if up in ready:
                data = up.recv(1 << 16)
                if not data:
                    return b"".join(chunks)
                if sink is None:
                    chunks.append(data)
                    continue
                try:
                    sink(data)
                except OSError as exc:
                    raise ClientGone from exc
    finally:
        up.close()


@dataclasses.dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_response(raw: bytes) -> Response:
    """An HTTP/1.1 response read to the connection's end."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    if not lines or len(lines[0].split()) < 2:
        raise ValueError(f"not an HTTP response: {raw[:80]!r}")
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body)
    elif "content-length" in headers:
        body = body[: int(headers["content-length"])]
    return Response(int(lines[0].split()[1]), headers, body)


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.index(b"\r\n", pos)
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SidecarServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer(200, b"")
        else:
            self._to_decoder(b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        target = self.headers.get(PREFILL_HEADER)
        if self.path.split("?")[0] in COMPLETION_PATHS and target:
            self._disaggregated(body, target)
        else:
            self._to_decoder(body)

    # -- the flow ----------------------------------------------------------------------
    def _disaggregated(self, raw: bytes, target: str) -> None:
        t0 = time.monotonic()
        try:
            client = parse_float64(raw)
            if not isinstance(client, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as exc:
            self._answer(400, go_marshal({"error": {"message": str(exc), "type": "invalid"}}))
            return
        rid = str(uuid.uuid4())
        host, _, port = target.rpartition(":")
        try:
            prefill = (host.strip("[]"), int(port))
        except ValueError:
            self._answer(400, go_marshal({"error": {"message": f"bad {PREFILL_HEADER}"}}))
            return
        try:
            raw_prefill = _exchange(
                self.connection, prefill, self._request(target, rid, prefill_body(client)), None
            )
            answer = parse_response(raw_prefill)
        except ClientGone:
            log.info("rid=%s client gone during prefill at %s", rid, target)
            self.close_connection = True
            return
        except (OSError, ValueError) as exc:
            log.warning("rid=%s prefill %s failed: %s", rid, target, exc)
            self._answer(502, b"")
            return
        t1 = time.monotonic()
        if not 200 <= answer.status < 300:
            log.warning("rid=%s prefill %s answered %d", rid, target, answer.status)
            self._answer(answer.status, b"")
            return
        try:
            params = parse_float64(answer.body).get("kv_transfer_params")
        except (ValueError, AttributeError):
            self._answer(502, b"")
            return
        if params is None:
            log.warning("rid=%s no kv_transfer_params in prefill's answer", rid)
        decoder = self.server.decoder
        request = self._request(f"{decoder[0]}:{decoder[1]}", rid, decode_body(client, params))
        relayed = [0]

        def to_client(data: bytes) -> None:
            self.connection.sendall(data)
            relayed[0] += len(data)

        try:
            _exchange(self.connection, decoder, request, to_client)
            outcome = "done"
        except ClientGone:
            # Before any byte of decode's answer: the request was cut; after: the client
            # closed once it had what it wanted (a stream's last event, a whole body).
            outcome = f"client closed after {relayed[0]} bytes" if relayed[0] else "client gone"
        except OSError as exc:
            outcome = f"decoder failed: {exc}"
            self._answer(502, b"")
        self.close_connection = True
        log.info(
            "rid=%s prefill %s %.3fs, decode %.3fs: %s",
            rid,
            target,
            t1 - t0,
            time.monotonic() - t1,
            outcome,
        )

    def _to_decoder(self, body: bytes) -> None:
        decoder = self.server.decoder
        head = self._head(self.command, f"{decoder[0]}:{decoder[1]}", None, len(body))
        try:
            _exchange(self.connection, decoder, head + body, self.connection.sendall)
        except ClientGone:
            pass
        except OSError:
            self._answer(502, b"")
        self.close_connection = True

    # -- HTTP --------------------------------------------------------------------------
    def _request(self, host: str, rid: str, body: dict[str, Any]) -> bytes:
        data = go_marshal(body)
        return self._head("POST", host, rid, len(data)) + data

    def _head(self, method: str, host: str, rid: str | None, length: int) -> bytes:
        lines = [f"{method} {self.path} HTTP/1.1", f"Host: {host}"]
        lines += [f"{k}: {v}" for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        if rid is not None:
            lines.append(f"X-Request-Id: {rid}")
        elif self.headers.get(REQUEST_ID_HEADER):
            lines.append(f"X-Request-Id: {self.headers[REQUEST_ID_HEADER]}")
        lines += [f"Content-Length: {length}", "Connection: close", "", ""]
        return "\r\n".join(lines).encode("latin-1")

    def _answer(self, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


class SidecarServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], decoder: tuple[str, int]) -> None:
        super().__init__(address, Handler)
        self.decoder = decoder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--decoder", default="127.0.0.1:8200", help="decode vLLM host:port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, _, port = args.decoder.rpartition(":")
    server = SidecarServer((args.host, args.port), (host, int(port)))
    log.info("listening on %s:%d, decoder %s", args.host, args.port, args.decoder)
    server.serve_forever()


def command(port: int, decoder: str, netns: str | None = None) -> list[str]:
    """The command line that runs the sidecar (inside ``netns``, if given)."""
    return [
        *(["ip", "netns", "exec", netns] if netns else []),
        sys.executable,
        "-m",
        "tests.e2e.sidecar",
        "--port",
        str(port),
        "--decoder",
        decoder,
    ]


if __name__ == "__main__":
    main()
