"""Request flows of ``kvxfer proxy``: P/D pull, P/D push and decode-only, over aiohttp.

One :class:`Dispatcher` serves ``/v1/completions`` and ``/v1/chat/completions``:

pull
    The prefill instance gets the request with ``max_tokens: 1``, ``stream: false`` and
    ``kv_transfer_params: {"do_remote_decode": true, ...}``; the ``kv_transfer_params``
    of its response go into the decode request, whose response is relayed to the
    client (streamed when the client asked for a stream).
push
    The decode request goes first, its ``kv_transfer_params`` marking it a push
    receiver and naming the prefill instance's side channel (learned from earlier
    prefill responses); once it is on the wire the prefill request follows. Decode's
    response is relayed after prefill answered. Until the prefill instance's side
    channel is known (its first request) the request runs prefill-first instead.
decode-only
    The request goes unchanged to a decode instance (decider's verdict).

Both instances get the same ``X-Request-Id`` (push matches the two engines' requests
by it). Errors become JSON bodies in OpenAI's error shape with the stage and the
instance named: 400 bad request, 502 an instance failed (4xx answers of an instance
are the client's and pass through unchanged), 503 no healthy instance, 504 timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvxfer.adapters.vllm.proxy.messages import (
    ProxyError,
    SseScanner,
    Stage,
    learn_endpoint,
    prefill_body,
    push_receiver_params,
)
from kvxfer.adapters.vllm.proxy.metrics import ProxyMetrics
from kvxfer.adapters.vllm.proxy.options import ProxyConfig
from kvxfer.adapters.vllm.proxy.routing import (
    Decider,
    Decision,
    DecodePolicy,
    Instance,
    InstanceKind,
    PrefillPolicy,
    PrefixIndex,
    PromptInfo,
    Reason,
    Route,
    TokenEstimator,
    extract_prompt,
)
from kvxfer.types import Direction

__all__ = ["Dispatcher"]

log = logging.getLogger("kvxfer.proxy")

_FORWARDED_HEADERS = ("Authorization", "traceparent", "tracestate")


@dataclasses.dataclass
class _Exchange:
    """One client request on its way through the proxy."""

    request_id: str
    t0: float
    api: str
    headers: dict[str, str]
    route: Route | None = None  # set once the decider ran


def _task_error(task: asyncio.Task[Any] | None) -> BaseException | None:
    if task is None or not task.done() or task.cancelled():
        return None
    return task.exception()


async def _discard(task: asyncio.Task[Any] | None) -> None:
    """Stop a task; close the response it produced, if any."""
    if task is None:
        return
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, aiohttp.ClientResponse):
            result.close()


class Dispatcher:
    """Serves the OpenAI completion endpoints through prefill and decode instances.

    Args:
        config: The proxy's configuration.
        prefill: Prefill instances (shared with the health checker).
        decode: Decode instances.
        metrics: Where stage timings and counts go.
        estimator: Prompt token estimate.
        index: Prefix affinity index (None: affinity off).
        on_down: Called with an instance and the reason when a request could not
            connect to it (passive health: the checker puts it back).
    """

    def __init__(
        self,
        config: ProxyConfig,
        prefill: Sequence[Instance],
        decode: Sequence[Instance],
        *,
        metrics: ProxyMetrics,
        estimator: TokenEstimator,
        index: PrefixIndex | None,
        on_down: Callable[[Instance, str], None],
    ) -> None:
        self.config = config
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.metrics = metrics
        self.estimator = estimator
        self.index = index
        self.decider = Decider(config.short_prompt_tokens)
        self.prefill_policy = PrefillPolicy(index, config.affinity_slack_tokens)
        self.decode_policy = DecodePolicy()
        self.on_down = on_down
        self.session: aiohttp.ClientSession | None = None
        self._warned: set[str] = set()  # prefill URLs already warned about missing params
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout_s, sock_connect=config.connect_timeout_s
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.decode_timeout_s
        )

    # -- entry -----------------------------------------------------------------------------
    async def handle(self, request: web.Request, api: str) -> web.StreamResponse:
        """Serve one ``/v1{api}`` request (``api`` is ``/completions`` or ``/chat/completions``)."""
        t0 = time.monotonic()
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = {"Content-Type": "application/json", "X-Request-Id": rid}
        for name in _FORWARDED_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        ex = _Exchange(request_id=rid, t0=t0, api=api, headers=headers)
        self.metrics.in_flight += 1
        status = 500
        try:
            resp = await self._serve(request, ex)
            status = resp.status
            return resp
        except ProxyError as exc:
            status = exc.status
            log.warning("kvxfer proxy: request %s -> %d: %s", rid, exc.status, exc.message)
            return exc.response(rid)
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            self.metrics.in_flight -= 1
            self.metrics.responses.inc(str(status))
            route = ex.route.value if ex.route is not None else "none"
            self.metrics.request.observe(time.monotonic() - t0, route)

    async def _serve(self, request: web.Request, ex: _Exchange) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise ProxyError(400, f"request body is not JSON: {exc}", stage=Stage.ROUTE) from None
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object", stage=Stage.ROUTE)
        try:
            prompt = extract_prompt(
                body, chat=ex.api == "/chat/completions", estimator=self.estimator
            )
        except ValueError as exc:
            raise ProxyError(400, str(exc), stage=Stage.ROUTE) from None
        decision = self.decider.decide(prompt, body, have_prefill=bool(self.prefill))
        keys = self.index.keys(prompt) if self.index is not None else []
        choice = None
        if decision.route is Route.PD:
            choice = self.prefill_policy.pick(self.prefill, keys)
            if choice is None:
                if not self.config.prefill_fallback:
                    raise ProxyError(
                        503, self._none_healthy(InstanceKind.PREFILL), stage=Stage.ROUTE
                    )
                decision = Decision(Route.DECODE_ONLY, Reason.PREFILL_UNAVAILABLE)
        if not any(d.healthy for d in self.decode):
            raise ProxyError(503, self._none_healthy(InstanceKind.DECODE), stage=Stage.ROUTE)
        ex.route = decision.route
        self.metrics.decisions.inc(decision.route.value, decision.reason.value)
        if choice is not None:
            self.metrics.affinity.inc(choice.affinity.value)
        self.metrics.routing.observe(time.monotonic() - ex.t0)
        if choice is None:
            return await self._serve_decode_only(request, ex, body)
        if self.config.mode is Direction.PUSH:
            return await self._serve_push(request, ex, body, prompt, choice.instance, keys)
        return await self._serve_pull(request, ex, body, prompt, choice.instance, keys)

    def _none_healthy(self, kind: InstanceKind) -> str:
        pool = self.prefill if kind is InstanceKind.PREFILL else self.decode
        detail = "; ".join(f"{i.url}: {i.last_error or i.state.value}" for i in pool)
        return f"no healthy {kind.value} instance ({len(pool)} configured: {detail})"

    # -- flows -----------------------------------------------------------------------------
    async def _serve_decode_only(
        self, request: web.Request, ex: _Exchange, body: dict[str, Any]
    ) -> web.StreamResponse:
        inst, upstream, t_sent = await self._open_decode(ex, body, retries=self.config.retries)
        try:
            return await self._relay(request, ex, inst, upstream, t_sent=t_sent, kv_start=None)
        finally:
            inst.release()

    async def _serve_pull(
        self,
        request: web.Request,
        ex: _Exchange,
        body: dict[str, Any],
        prompt: PromptInfo,
        first: Instance,
        keys: Sequence[bytes],
        *,
        retries: int | None = None,
    ) -> web.StreamResponse:
        retries = self.config.retries if retries is None else retries
        p_inst, answer = await self._prefill(ex, body, prompt, first, keys, retries=retries)
        t_prefilled = time.monotonic()
        d_body = dict(body)
        params = answer.get("kv_transfer_params")
        if isinstance(params, dict) and params:
            d_body["kv_transfer_params"] = params
            self._learn(p_inst, params)
        else:
            self.metrics.missing_params.inc(p_inst.url)
            warn = log.debug if p_inst.url in self._warned else log.warning
            self._warned.add(p_inst.url)
            warn(
                "kvxfer proxy: prefill %s returned no kv_transfer_params for %s; decode "
                "will recompute the prompt (is the prefill instance's KV connector set?)",
                p_inst.url,
                ex.request_id,
            )
        inst, upstream, t_sent = await self._open_decode(ex, d_body, retries=retries)
        try:
            kv_start = max(t_sent, t_prefilled)
            return await self._relay(request, ex, inst, upstream, t_sent=t_sent, kv_start=kv_start)
        finally:
            inst.release()

    async def _serve_push(
        self,
        request: web.Request,
        ex: _Exchange,
        body: dict[str, Any],
        prompt: PromptInfo,
        p_inst: Instance,
        keys: Sequence[bytes],
    ) -> web.StreamResponse:
        if p_inst.kv_endpoint is None:
            # Its side channel is unknown until it answered once: prefill first; the
            # decode request then carries the returned ticket (push still writes).
            self.metrics.push_sequential.inc(p_inst.url)
            return await self._serve_pull(request, ex, body, prompt, p_inst, keys, retries=0)
        d_inst = self.decode_policy.pick(self.decode)
        if d_inst is None:
            raise ProxyError(503, self._none_healthy(InstanceKind.DECODE), stage=Stage.ROUTE)
        # The request's capability, minted here and given to the two instances only: a
        # stranger who reaches prefill's side channel cannot know it, so cannot take
        # the KV by registering for this request id first.
        token = secrets.token_hex(16)
        d_body = dict(body)
        d_body["kv_transfer_params"] = push_receiver_params(p_inst.kv_endpoint, token)
        p_payload = msgspec.json.encode(prefill_body(body, token))
        on_wire = asyncio.Event()
        d_inst.acquire()
        t_sent = time.monotonic()
        d_task: asyncio.Task[aiohttp.ClientResponse] = asyncio.create_task(
            self._send(
                d_inst,
                ex,
                msgspec.json.encode(d_body),
                Stage.DECODE,
                self._decode_timeout,
                trace=on_wire,
            )
        )
        p_task: asyncio.Task[dict[str, Any]] | None = None
        gate: asyncio.Task[Any] = asyncio.create_task(on_wire.wait())
        relayed = False
        p_inst.acquire(prompt.tokens)
        p_held = True
        try:
            await asyncio.wait(
                {d_task, gate}, timeout=self.config.push_gate_s, return_when="FIRST_COMPLETED"
            )
            err = _task_error(d_task)
            if err is not None:
                raise err
            t_p = time.monotonic()
            p_task = asyncio.create_task(self._post_json(p_inst, ex, p_payload))
            while not p_task.done():
                waiting: set[asyncio.Task[Any]] = {p_task}
                if not d_task.done():
                    waiting.add(d_task)
                await asyncio.wait(waiting, return_when="FIRST_COMPLETED")
                err = _task_error(d_task)
                if err is not None:
                    raise err  # decode failed: the finally clause aborts prefill
            answer = p_task.result()
            t_prefilled = time.monotonic()
            p_inst.release(prompt.tokens)
            p_held = False
            self.metrics.prefill.observe(t_prefilled - t_p, p_inst.url)
            params = answer.get("kv_transfer_params")
            if isinstance(params, dict):
                self._learn(p_inst, params)
            upstream = await d_task
            relayed = True
            kv_start = max(t_sent, t_prefilled)
            return await self._relay(
                request, ex, d_inst, upstream, t_sent=t_sent, kv_start=kv_start
            )
        finally:
            if p_held:
                p_inst.release(prompt.tokens)
            await _discard(gate)
            await _discard(p_task)
            if not relayed:
                # Closing decode's connection makes vLLM abort the waiting request.
                await _discard(d_task)
            d_inst.release()

    # -- stages ----------------------------------------------------------------------------
    async def _prefill(
        self,
        ex: _Exchange,
        body: dict[str, Any],
        prompt: PromptInfo,
        first: Instance,
        keys: Sequence[bytes],
        *,
        retries: int,
    ) -> tuple[Instance, dict[str, Any]]:
        payload = msgspec.json.encode(prefill_body(body))
        tried: list[Instance] = []
        inst = first
        while True:
            cur = inst
            cur.acquire(prompt.tokens)
            t = time.monotonic()
            try:
                answer = await self._post_json(cur, ex, payload)
            except ProxyError as exc:
                tried.append(cur)
                if not exc.retryable or len(tried) > retries:
                    raise
                nxt = self.prefill_policy.pick([i for i in self.prefill if i not in tried], keys)
                if nxt is not None:
                    inst = nxt.instance
                elif not cur.healthy:
                    raise
                self.metrics.retries.inc(InstanceKind.PREFILL.value)
                log.info("kvxfer proxy: %s: retrying prefill on %s", ex.request_id, inst.url)
                continue
            finally:
                cur.release(prompt.tokens)
            self.metrics.prefill.observe(time.monotonic() - t, cur.url)
            return cur, answer

    async def _post_json(self, inst: Instance, ex: _Exchange, payload: bytes) -> dict[str, Any]:
        """Send a prefill request and read its whole JSON answer."""
        resp = await self._send(inst, ex, payload, Stage.PREFILL, self._prefill_timeout)
        try:
            raw = await resp.read()
        except asyncio.TimeoutError:
            raise self._failure(
                inst, Stage.PREFILL, "timeout", 504, f"timed out reading prefill {inst.url}"
            ) from None
        except aiohttp.ClientError as exc:
            raise self._failure(
                inst, Stage.PREFILL, "protocol", 502, f"prefill {inst.url} broke off: {exc}"
            ) from None
        finally:
            resp.release()
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise self._failure(
                inst, Stage.PREFILL, "protocol", 502, f"prefill {inst.url} answered non-JSON"
            )
        return answer

    async def _open_decode(
        self, ex: _Exchange, body: dict[str, Any], *, retries: int
    ) -> tuple[Instance, aiohttp.ClientResponse, float]:
        """Send the decode request; returns once its response headers arrived.

        The returned instance has been acquired: the caller releases it.
        """
        payload = msgspec.json.encode(body)
        tried: list[Instance] = []
        last: ProxyError | None = None
        while True:
            inst = self.decode_policy.pick([i for i in self.decode if i not in tried])
            if inst is None and last is not None and tried and tried[-1].healthy:
                inst = tried[-1]  # only one instance, a stale connection: try it again
            if inst is None:
                if last is not None:
                    raise last
                raise ProxyError(503, self._none_healthy(InstanceKind.DECODE), stage=Stage.ROUTE)
            if last is not None:
                self.metrics.retries.inc(InstanceKind.DECODE.value)
                log.info("kvxfer proxy: %s: retrying decode on %s", ex.request_id, inst.url)
            inst.acquire()
            t_sent = time.monotonic()
            try:
                resp = await self._send(inst, ex, payload, Stage.DECODE, self._decode_timeout)
            except ProxyError as exc:
                inst.release()
                tried.append(inst)
                if not exc.retryable or len(tried) > retries:
                    raise
                last = exc
                continue
            except BaseException:
                inst.release()
                raise
            return inst, resp, t_sent

    async def _send(
        self,
        inst: Instance,
        ex: _Exchange,
        payload: bytes,
        stage: Stage,
        timeout: aiohttp.ClientTimeout,
        *,
        trace: asyncio.Event | None = None,
    ) -> aiohttp.ClientResponse:
        """POST ``payload`` to ``inst``; map every failure to a :class:`ProxyError`."""
        assert self.session is not None, "Dispatcher used before the proxy started"
        url = f"{inst.url}/v1{ex.api}"
        try:
            resp = await self.session.post(
                url, data=payload, headers=ex.headers, timeout=timeout, trace_request_ctx=trace
            )
        except asyncio.TimeoutError:
            raise self._failure(
                inst, stage, "timeout", 504, f"{stage.value} instance {inst.url} timed out"
            ) from None
        except aiohttp.ClientConnectorError as exc:
            self.on_down(inst, f"cannot connect: {exc}")
            raise self._failure(
                inst,
                stage,
                "connect",
                502,
                f"cannot connect to {stage.value} instance {inst.url}: {exc}",
                retryable=True,
            ) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise self._failure(
                inst,
                stage,
                "disconnect",
                502,
                f"{stage.value} instance {inst.url} closed the connection: {exc}",
                retryable=True,
            ) from None
        except aiohttp.ClientError as exc:
            raise self._failure(
                inst, stage, "protocol", 502, f"{stage.value} instance {inst.url}: {exc}"
            ) from None
        if resp.status < 400:
            return resp
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            raw = b""
        finally:
            resp.release()
        ctype = resp.headers.get("Content-Type", "application/json")
        if resp.status < 500:
            raise ProxyError(
                resp.status,
                f"{stage.value} instance {inst.url} refused the request ({resp.status})",
                stage=stage,
                instance=inst.url,
                passthrough=(raw, ctype),
            )
        excerpt = raw[:300].decode("utf-8", "replace")
        raise self._failure(
            inst,
            stage,
            "status",
            502,
            f"{stage.value} instance {inst.url} answered {resp.status}: {excerpt}",
        )

    def _failure(
        self,
        inst: Instance,
        stage: Stage,
        kind: str,
        status: int,
        message: str,
        *,
        retryable: bool = False,
    ) -> ProxyError:
        self._count_error(inst, kind)
        return ProxyError(status, message, stage=stage, instance=inst.url, retryable=retryable)

    def _count_error(self, inst: Instance, kind: str) -> None:
        inst.errors_total += 1
        self.metrics.errors.inc(inst.kind.value, inst.url, kind)

    def _learn(self, inst: Instance, params: Mapping[str, Any]) -> None:
        endpoint = learn_endpoint(params)
        if endpoint is not None:
            inst.kv_endpoint = endpoint

    # -- relay -----------------------------------------------------------------------------
    async def _relay(
        self,
        request: web.Request,
        ex: _Exchange,
        inst: Instance,
        upstream: aiohttp.ClientResponse,
        *,
        t_sent: float,
        kv_start: float | None,
    ) -> web.StreamResponse:
        """Pass decode's answer to the client, timing first token, gaps and the end."""
        ctype = upstream.headers.get("Content-Type", "application/json")
        if "text/event-stream" not in ctype:
            try:
                raw = await upstream.read()
            except asyncio.TimeoutError:
                upstream.close()
                raise self._failure(
                    inst, Stage.DECODE, "timeout", 504, f"decode instance {inst.url} timed out"
                ) from None
            except aiohttp.ClientError as exc:
                upstream.close()
                raise self._failure(
                    inst, Stage.DECODE, "protocol", 502, f"decode {inst.url} broke off: {exc}"
                ) from None
            upstream.release()
            self.metrics.decode.observe(time.monotonic() - t_sent, inst.url)
            resp = web.Response(
                status=upstream.status, body=raw, headers={"X-Request-Id": ex.request_id}
            )
            resp.content_type = ctype.split(";")[0]
            return resp

        out = web.StreamResponse(
            status=upstream.status,
            headers={
                "Content-Type": ctype,
                "Cache-Control": "no-cache",
                "X-Request-Id": ex.request_id,
            },
        )
        scanner = SseScanner()
        first: float | None = None
        last_token = 0.0
        complete = False
        try:
            try:
                await out.prepare(request)
            except ConnectionError:
                log.info("kvxfer proxy: %s: client went away", ex.request_id)
                upstream.close()
                return out
            async for chunk in upstream.content.iter_any():
                now = time.monotonic()
                tokens = scanner.feed(chunk)
                try:
                    await out.write(chunk)
                except ConnectionError:
                    log.info("kvxfer proxy: %s: client went away", ex.request_id)
                    break
                if tokens:
                    if first is None:
                        first = now
                        route = ex.route.value if ex.route is not None else "none"
                        self.metrics.ttft.observe(now - ex.t0, route)
                        if kv_start is not None:
                            self.metrics.kv_wait.observe(now - kv_start, inst.url)
                    else:
                        self.metrics.itl.observe(now - last_token, inst.url)
                    last_token = now
            else:
                complete = True
        except asyncio.TimeoutError:
            self._count_error(inst, "timeout")
            await self._stream_error(out, ex, f"decode instance {inst.url} timed out", 504)
        except aiohttp.ClientError as exc:
            self._count_error(inst, "protocol")
            await self._stream_error(out, ex, f"decode instance {inst.url} broke off: {exc}", 502)
        finally:
            if complete:
                upstream.release()
            else:
                upstream.close()  # vLLM aborts the request when its client goes away
        end = time.monotonic()
        self.metrics.decode.observe(end - (first if first is not None else t_sent), inst.url)
        if complete:
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
        return out

    async def _stream_error(
        self, out: web.StreamResponse, ex: _Exchange, message: str, status: int
    ) -> None:
        """An error after the stream began: one SSE error event, then the end."""
        log.warning("kvxfer proxy: %s: %s", ex.request_id, message)
        err = ProxyError(status, message, stage=Stage.DECODE)
        with contextlib.suppress(ConnectionError):
            await out.write(b"data: " + err.body(ex.request_id) + b"\n\n")
            await out.write_eof()
