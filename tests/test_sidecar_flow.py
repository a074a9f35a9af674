"""The test routing sidecar (tests/e2e/sidecar.py) does llm-d's decode-sidecar flow:
checked here against recording stand-ins for prefill and decode on loopback (the e2e
tests run it in front of real engines on two hosts)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.e2e.sidecar import PREFILL_HEADER, SidecarServer
from tests.float64_json import go_marshal, parse_float64

BIG = 2**60 + 1  # a 64-bit integer a float64 cannot hold


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answer: dict[str, Any], delay_s: float = 0.0) -> None:
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.answer = answer
        self.delay_s = delay_s
        self.hung_up = threading.Event()
        super().__init__(("127.0.0.1", 0), _Recorder)

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _Recorder(BaseHTTPRequestHandler):
    server: _Upstream

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append(({k.lower(): v for k, v in self.headers.items()}, json.loads(raw)))
        if self.server.delay_s:
            # A slow engine: notice the sidecar closing the connection (vLLM aborts then).
            self.connection.settimeout(self.server.delay_s)
            try:
                if self.connection.recv(1) == b"":
                    self.server.hung_up.set()
                    return
            except TimeoutError:
                pass
        body = json.dumps(self.server.answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(server: ThreadingHTTPServer) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


@pytest.fixture
def deployment() -> Iterator[tuple[str, _Upstream, _Upstream]]:
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_incarnation": BIG}
    prefill = _Upstream({"choices": [{"text": "x"}], "kv_transfer_params": params})
    decode = _Upstream({"choices": [{"text": "the decoded text"}]})
    sidecar = SidecarServer(("127.0.0.1", 0), ("127.0.0.1", decode.server_address[1]))
    for s in (prefill, decode, sidecar):
        _serve(s)
    try:
        yield f"http://127.0.0.1:{sidecar.server_address[1]}", prefill, decode
    finally:
        for s in (sidecar, prefill, decode):
            s.shutdown()
            s.server_close()


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


CLIENT = {
    "model": "tiny",
    "prompt": "a <b> & c",
    "max_tokens": 16,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.0,
}


def test_prefill_then_decode_as_llm_d_does(deployment: tuple[str, _Upstream, _Upstream]) -> None:
    url, prefill, decode = deployment
    out = _post(url, CLIENT, {PREFILL_HEADER: prefill.hostport})
    assert out["choices"][0]["text"] == "the decoded text"
    (p_headers, p_body), (d_headers, d_body) = prefill.seen[0], decode.seen[0]
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1
    assert p_body["stream"] is False and "stream_options" not in p_body
    # Decode: the client's own fields back, and prefill's kv_transfer_params as a Go
    # router passes them on (every number through a float64: BIG arrives changed).
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert d_body["max_tokens"] == 16 and "max_completion_tokens" not in d_body
    assert d_body["prompt"] == "a <b> & c"
    assert d_body["kv_transfer_params"]["remote_host"] == "10.0.0.7"
    assert d_body["kv_transfer_params"]["remote_incarnation"] == 1152921504606847000 != BIG
    # One fresh request id for both legs.
    assert p_headers["x-request-id"] == d_headers["x-request-id"]


def test_without_the_header_the_request_goes_to_decode_unchanged(
    deployment: tuple[str, _Upstream, _Upstream],
) -> None:
    url, prefill, decode = deployment
    _post(url, CLIENT, {})
    assert not prefill.seen
    assert decode.seen[0][1] == CLIENT


def test_a_client_hanging_up_closes_the_decode_connection(
    deployment: tuple[str, _Upstream, _Upstream],
) -> None:
    url, prefill, decode = deployment
    decode.delay_s = 10.0
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(CLIENT).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{PREFILL_HEADER}: {prefill.hostport}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 5
        while not decode.seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert decode.hung_up.wait(5), "decode's connection stayed open after the client left"


def test_go_marshal_writes_what_go_writes() -> None:
    doc = parse_float64('{"b": 9007199254740993, "a": [1, 2.5, 0.0], "s": "<&>"}')
    assert go_marshal(doc) == b'{"a":[1,2.5,0],"b":9007199254740992,"s":"\\u003c\\u0026\\u003e"}'
