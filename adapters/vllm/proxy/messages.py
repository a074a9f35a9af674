"""What the proxy says to instances and clients: P/D request parameters, error bodies, SSE.

Pure message shaping, no I/O: the prefill copy of a request (:func:`prefill_body`), the
push receiver's ``kv_transfer_params`` (:func:`push_receiver_params`), the producer
coordinates learned from a prefill answer (:func:`learn_endpoint`), the OpenAI-shaped
error every proxy failure becomes (:class:`ProxyError`) and the counter of token-bearing
events in a relayed stream (:class:`SseScanner`). :mod:`.dispatch` drives requests with
them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

__all__ = [
    "ENDPOINT_KEYS",
    "PREFILL_PARAMS",
    "ErrorBody",
    "ErrorDetail",
    "ProxyError",
    "SseScanner",
    "Stage",
    "learn_endpoint",
    "prefill_body",
    "push_receiver_params",
]

#: ``kv_transfer_params`` of every prefill request (the shape upstream's toy proxy sends).
PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Keys of a prefill response's ``kv_transfer_params`` that name the producer (not one
#: request); push mode hands them to decode before prefill has run.
ENDPOINT_KEYS: tuple[str, ...] = (
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "pp_size",
    "dcp_size",
    "remote_incarnation",
    "remote_incarnations",
)
_ERROR_TYPES = {
    400: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


class Stage(enum.Enum):
    """Where a request is (error bodies and logs name it)."""

    ROUTE = "route"
    PREFILL = "prefill"
    DECODE = "decode"


class ErrorDetail(msgspec.Struct, omit_defaults=True, kw_only=True):
    """OpenAI-style error, plus where it happened."""

    message: str
    type: str
    code: int
    stage: str | None = None
    instance: str | None = None
    request_id: str | None = None


class ErrorBody(msgspec.Struct):
    """The JSON body of every error the proxy itself produces."""

    error: ErrorDetail


class ProxyError(Exception):
    """A request failure with its HTTP answer.

    Args:
        status: HTTP status for the client.
        message: Human-readable cause (names the instance when one is involved).
        stage: Where it happened.
        instance: The instance URL involved, if any.
        passthrough: ``(body, content_type)`` of an instance's own 4xx answer, returned
            unchanged.
        retryable: The request never reached an instance's handler (connection
            failure); it may be re-sent.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        stage: Stage | None = None,
        instance: str | None = None,
        passthrough: tuple[bytes, str] | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.stage = stage
        self.instance = instance
        self.passthrough = passthrough
        self.retryable = retryable

    def body(self, request_id: str | None = None) -> bytes:
        """The JSON error body."""
        detail = ErrorDetail(
            message=self.message,
            type=_ERROR_TYPES.get(self.status, "error"),
            code=self.status,
            stage=self.stage.value if self.stage else None,
            instance=self.instance,
            request_id=request_id,
        )
        return msgspec.json.encode(ErrorBody(detail))

    def response(self, request_id: str | None = None) -> web.Response:
        """The HTTP answer for the client."""
        headers = {"X-Request-Id": request_id} if request_id else None
        if self.passthrough is not None:
            payload, ctype = self.passthrough
            resp = web.Response(status=self.status, body=payload, headers=headers)
            resp.content_type = ctype.split(";")[0] or "application/json"
            return resp
        return web.Response(
            status=self.status,
            body=self.body(request_id),
            content_type="application/json",
            headers=headers,
        )


def prefill_body(body: Mapping[str, Any], capability: str = "") -> dict[str, Any]:
    """The prefill instance's copy of a request: one token, no stream, P/D params
    (push: with the ``capability`` decode shows when it registers)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    if capability:
        out["kv_transfer_params"]["kvxfer_capability"] = capability
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    # A prefill-only request cannot honour a minimum output length.
    out.pop("min_tokens", None)
    out.pop("min_completion_tokens", None)
    return out


def push_receiver_params(endpoint: Mapping[str, Any], capability: str = "") -> dict[str, Any]:
    """``kv_transfer_params`` of a push-mode decode request sent before prefill ran.

    Upstream's push connector reads exactly these on the decode side: a remote prefill
    is coming (``do_remote_prefill``) from the producer named by ``remote_engine_id``,
    ``remote_host``, ``remote_port`` and ``tp_size``; the block ids are unknown yet
    (the producer learns the decode blocks from decode's registration and matches the
    two requests by their common ``X-Request-Id``). kvxfer adds ``capability``, the
    token the router minted for this request and gives prefill too: the producer then
    writes only to the registration that shows it (docs/RELIABILITY.md).
    """
    params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
    params.update(endpoint)
    params.update(remote_block_ids=None, remote_request_id=None, transfer_mode="push")
    if capability:
        params["kvxfer_capability"] = capability
    return params


def learn_endpoint(params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The producer coordinates in a prefill response's ``kv_transfer_params``."""
    endpoint = {k: params[k] for k in ENDPOINT_KEYS if params.get(k) is not None}
    needed = ("remote_engine_id", "remote_host", "remote_port")
    return endpoint if all(k in endpoint for k in needed) else None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []


_chunk_decoder = msgspec.json.Decoder(_Chunk)


class SseScanner:
    """Counts token-bearing events in an OpenAI server-sent-event stream.

    Fed the raw bytes as they pass through (the relay never waits on it). An event
    bears tokens when one of its choices has non-empty ``text`` (completions) or a
    ``delta`` with content, reasoning or tool calls (chat); the chat role preamble,
    usage chunks, errors and ``[DONE]`` do not.
    """

    _MAX_PENDING = 1 << 20

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> int:
        """Token-bearing events completed by ``chunk``."""
        buf = self._buf + chunk.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        if len(self._buf) > self._MAX_PENDING:
            self._buf = b""  # not SSE as we know it; stop accumulating
        return sum(1 for event in events if self._bears_tokens(event))

    @staticmethod
    def _bears_tokens(event: bytes) -> bool:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            try:
                parsed = _chunk_decoder.decode(payload)
            except msgspec.DecodeError:
                continue
            for choice in parsed.choices:
                if choice.text:
                    return True
                d = choice.delta
                if d is not None and (
                    d.content or d.reasoning_content or d.reasoning or d.tool_calls
                ):
                    return True
        return False
