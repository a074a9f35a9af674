"""`kvxfer proxy`: the pure policies, then the HTTP behaviour against fake vLLM servers.

The fakes are aiohttp servers on 127.0.0.1 ephemeral ports (real sockets) that speak the
part of vLLM's OpenAI surface the proxy uses (``/v1/completions``,
``/v1/chat/completions``, ``/health``, ``/v1/models``) and record what they received.
A fake prefill answers ``kv_transfer_params`` like vLLM's producer; a fake decode
streams tokens, and in push mode waits until "its" prefill (same X-Request-Id)
finished, as a push receiver waits for the producer's writes. A fake may stand behind
a float64 JSON router (Go, JavaScript): what it reads and answers went through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvxfer.adapters.vllm import proxy as proxy_mod
from kvxfer.adapters.vllm.params import remote_ticket, ticket_params
from kvxfer.adapters.vllm.proxy import Proxy, start_proxy
from kvxfer.adapters.vllm.proxy.messages import (
    PREFILL_PARAMS,
    SseScanner,
    learn_endpoint,
    prefill_body,
    push_receiver_params,
)
from kvxfer.adapters.vllm.proxy.metrics import Counter, Histogram
from kvxfer.adapters.vllm.proxy.options import ProxyConfig, load_tokenizer, normalize_url, options
from kvxfer.adapters.vllm.proxy.routing import (
    AffinityResult,
    Decider,
    DecodePolicy,
    Instance,
    InstanceKind,
    InstanceState,
    PrefillPolicy,
    PrefixIndex,
    PromptInfo,
    Reason,
    Route,
    TokenEstimator,
    extract_prompt,
)
from kvxfer.agent import Ticket
from kvxfer.errors import ConfigError
from kvxfer.types import Direction
from tests.float64_json import float64_router

EST = TokenEstimator(4.0)
LONG = "The quick brown fox jumps over the lazy dog. " * 40  # ~1800 chars, 7 blocks


def _inst(url: str, kind: InstanceKind = InstanceKind.PREFILL, **kw: Any) -> Instance:
    return Instance(url, kind, state=InstanceState.HEALTHY, **kw)


# -- prompts and estimates -------------------------------------------------------------


def test_extract_prompt_shapes() -> None:
    p = extract_prompt({"prompt": "abcdefgh"}, chat=False, estimator=EST)
    assert (p.text, p.tokens, p.num_prompts, p.token_ids) == ("abcdefgh", 2, 1, None)
    ids = extract_prompt({"prompt": [5, 6, 7]}, chat=False, estimator=EST)
    assert ids.token_ids == (5, 6, 7) and ids.tokens == 3
    one = extract_prompt({"prompt": ["x" * 40]}, chat=False, estimator=EST)
    assert one.num_prompts == 1 and one.tokens == 10
    batch = extract_prompt({"prompt": ["a" * 8, "b" * 8]}, chat=False, estimator=EST)
    assert batch.num_prompts == 2 and batch.tokens == 4
    ids_batch = extract_prompt({"prompt": [[1, 2], [3]]}, chat=False, estimator=EST)
    assert ids_batch.num_prompts == 2 and ids_batch.tokens == 3
    chat = extract_prompt(
        {
            "messages": [
                {"role": "system", "content": "x" * 40},
                {"role": "user", "content": [{"type": "text", "text": "y" * 40}]},
            ]
        },
        chat=True,
        estimator=EST,
    )
    assert chat.text.startswith("system") and "y" * 40 in chat.text
    assert chat.tokens > 20  # content plus template framing
    for bad in ({}, {"prompt": 3}, {"prompt": []}, {"prompt": [1, "a"]}):
        with pytest.raises(ValueError):
            extract_prompt(bad, chat=False, estimator=EST)
    with pytest.raises(ValueError):
        extract_prompt({"messages": []}, chat=True, estimator=EST)


def test_token_estimator_with_tokenizer() -> None:
    est = TokenEstimator(tokenizer=lambda text: len(text.split()))
    assert est.count("a b c") == 3 and est.count("") == 0
    assert TokenEstimator(2.0).count("abcd") == 2
    with pytest.raises(ValueError):
        TokenEstimator(0)


def test_tokenizer_file_gives_exact_counts(tmp_path: Any) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, "[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    count = load_tokenizer(str(tmp_path))  # the directory holding tokenizer.json
    assert count("a b a zzz") == 4
    cfg = ProxyConfig(decode=("d:1",), tokenizer=str(tmp_path), health_interval_s=0)
    px = Proxy(cfg)
    assert px.dispatcher.estimator.count("a b") == 2
    with pytest.raises(ConfigError):
        load_tokenizer(str(tmp_path / "missing.json"))


# -- decider ---------------------------------------------------------------------------


def test_decider() -> None:
    short = PromptInfo(text="hi", tokens=10)
    long = PromptInfo(text=LONG, tokens=500)
    d = Decider(short_prompt_tokens=100)
    assert d.decide(short, {}).reason is Reason.SHORT_PROMPT
    assert d.decide(short, {}).route is Route.DECODE_ONLY
    assert d.decide(long, {}).route is Route.PD
    assert d.decide(PromptInfo(tokens=100), {}).route is Route.PD  # "under", not "up to"
    assert d.decide(long, {"n": 2}).reason is Reason.PARALLEL_SAMPLING
    assert d.decide(long, {"best_of": 3}).reason is Reason.PARALLEL_SAMPLING
    assert d.decide(PromptInfo(tokens=900, num_prompts=2), {}).reason is Reason.MULTI_PROMPT
    assert d.decide(long, {}, have_prefill=False).reason is Reason.NO_PREFILL
    assert Decider(0).decide(short, {}).route is Route.PD  # 0 disables the length rule
    with pytest.raises(ValueError):
        Decider(-1)


# -- prefix index and policies ---------------------------------------------------------


def test_prefix_index_chains_and_forgets() -> None:
    idx = PrefixIndex(block_chars=10, block_tokens=4, max_blocks=3, capacity=100)
    a = idx.keys(PromptInfo(text="a" * 35))
    assert len(a) == 3  # 3 whole blocks (the 4th is partial... and capped anyway)
    assert idx.keys(PromptInfo(text="a" * 9)) == []
    b = idx.keys(PromptInfo(text="a" * 10 + "b" * 25))
    assert a[0] == b[0] and a[1] != b[1]  # shared first block, then the chain differs
    ids = idx.keys(PromptInfo(token_ids=tuple(range(9))))
    assert len(ids) == 2
    idx.record(a, "p1")
    idx.record(b[:1], "p2")
    assert idx.match(a) == {"p1": 3, "p2": 1}
    assert idx.match(b) == {"p1": 1, "p2": 1}
    idx.forget("p1")
    assert idx.match(a) == {"p2": 1}
    small = PrefixIndex(block_chars=1, capacity=2)
    small.record(small.keys(PromptInfo(text="xyz")), "p")
    assert len(small) == 2  # LRU bound


def test_prefill_policy_least_tokens_and_affinity() -> None:
    p1, p2 = _inst("p1"), _inst("p2")
    idx = PrefixIndex(block_chars=10)
    pol = PrefillPolicy(idx, slack_tokens=100)
    keys = idx.keys(PromptInfo(text="k" * 30))
    p1.outstanding_tokens, p2.outstanding_tokens = 50, 0
    first = pol.pick([p1, p2], keys)
    assert first is not None and first.instance is p2 and first.affinity is AffinityResult.MISS
    # p2 now holds the prefix: it keeps winning while within the slack ...
    p2.outstanding_tokens = 120  # 120 <= 50 + 100
    again = pol.pick([p1, p2], keys)
    assert again is not None and again.instance is p2 and again.affinity is AffinityResult.HIT
    assert again.depth == 3
    # ... and loses to the least loaded beyond it.
    p2.outstanding_tokens = 151
    over = pol.pick([p1, p2], keys)
    assert over is not None and over.instance is p1
    assert over.affinity is AffinityResult.OVERLOADED
    # No keys (short prompt): pure least outstanding tokens.
    plain = pol.pick([p1, p2], [])
    assert plain is not None and plain.instance is p1 and plain.affinity is AffinityResult.NONE


def test_policies_never_pick_unhealthy_and_spread_ties() -> None:
    p1, p2, p3 = _inst("p1"), _inst("p2"), _inst("p3")
    p2.state = InstanceState.UNHEALTHY
    pol = PrefillPolicy(None)
    picks = [pol.pick([p1, p2, p3]) for _ in range(4)]
    assert [c.instance.url for c in picks if c] == ["p1", "p3", "p1", "p3"]
    p1.state = p3.state = InstanceState.UNHEALTHY
    assert pol.pick([p1, p2, p3]) is None
    d1, d2 = _inst("d1", InstanceKind.DECODE), _inst("d2", InstanceKind.DECODE)
    dpol = DecodePolicy()
    d1.active = 2
    assert dpol.pick([d1, d2]) is d2
    d2.active = 3
    assert dpol.pick([d1, d2]) is d1
    d1.state = InstanceState.UNHEALTHY
    assert dpol.pick([d1, d2]) is d2
    d2.state = InstanceState.UNHEALTHY
    assert dpol.pick([d1, d2]) is None


def test_instance_health_state_machine() -> None:
    i = Instance("p", InstanceKind.PREFILL)
    assert not i.healthy and i.last_error  # out until a check passed
    assert i.observe(True, rise=1) and i.healthy and i.last_error == ""
    i.kv_endpoint = {"remote_engine_id": "e"}
    assert not i.observe(False, "boom", fall=2) and i.healthy
    assert i.observe(False, "boom again", fall=2) and not i.healthy
    assert i.last_error == "boom again" and i.kv_endpoint is None
    assert not i.observe(True, rise=2) and not i.healthy
    assert i.observe(True, rise=2) and i.healthy
    i.acquire(10)
    i.acquire(5)
    i.release(10)
    assert (i.active, i.outstanding_tokens, i.requests_total) == (1, 5, 2)


# -- wire shapes -----------------------------------------------------------------------


def test_prefill_body_and_push_params() -> None:
    body = {
        "prompt": "x",
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 5,
        "temperature": 0,
    }
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p and p["temperature"] == 0
    assert p["kv_transfer_params"] == dict(PREFILL_PARAMS)
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and body["stream"] is True  # the original is untouched
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"})
    ticket = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[1, 2]],
        "remote_request_id": "cmpl-r-0-abcdefgh",
        "tp_size": 1,
        "remote_incarnation": 7,
    }
    endpoint = learn_endpoint(ticket)
    assert endpoint == {
        "remote_engine_id": "P",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_incarnation": 7,
    }
    assert learn_endpoint({"remote_engine_id": "P"}) is None
    push = push_receiver_params(endpoint)
    assert "kvxfer_capability" not in push
    assert push_receiver_params(endpoint, "ab12")["kvxfer_capability"] == "ab12"
    assert prefill_body(body, "ab12")["kv_transfer_params"]["kvxfer_capability"] == "ab12"
    assert "kvxfer_capability" not in PREFILL_PARAMS
    assert push["do_remote_prefill"] is True and push["do_remote_decode"] is False
    assert push["remote_block_ids"] is None and push["remote_request_id"] is None
    assert push["transfer_mode"] == "push" and push["remote_port"] == 5600


def test_sse_scanner_counts_token_events_across_chunks() -> None:
    def ev(obj: object) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    role = ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    tok = ev({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    text = ev({"choices": [{"index": 0, "text": " there"}]})
    usage = ev({"choices": [], "usage": {"completion_tokens": 2}})
    stream = role + tok + text + usage + b"data: [DONE]\n\n"
    s = SseScanner()
    counts = [s.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)]
    assert sum(counts) == 2
    assert SseScanner().feed(tok.replace(b"\n", b"\r\n")) == 1
    assert SseScanner().feed(b"data: {not json}\n\n") == 0


def test_config_rules_and_urls() -> None:
    ProxyConfig(decode=("http://d:1",)).validate()
    cases = [
        (ProxyConfig(), "decode"),
        (ProxyConfig(decode=("d:1", "http://d:1/")), "decode"),
        (ProxyConfig(decode=("d:1",), prefill_timeout_s=0), "prefill_timeout_s"),
        (ProxyConfig(decode=("d:1",), retries=-1), "retries"),
        (ProxyConfig(decode=("d:1",), port=70000), "port"),
        (ProxyConfig(decode=("d:1",), health_fall=0), "health_fall"),
    ]
    for config, key in cases:
        with pytest.raises(ConfigError) as err:
            config.validate()
        assert err.value.key == key
    assert normalize_url("127.0.0.1:8100") == "http://127.0.0.1:8100"
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    for bad in ("ftp://h:1", "http://", "http://h:notaport"):
        with pytest.raises(ConfigError):
            normalize_url(bad)


def test_metric_primitives_render_prometheus_text() -> None:
    h = Histogram("x_seconds", "help", ["instance"], buckets=(0.1, 1.0))
    h.observe(0.05, 'a"b')
    h.observe(0.5, 'a"b')
    h.observe(5.0, 'a"b')
    text = "\n".join(h.render())
    assert 'x_seconds_bucket{instance="a\\"b",le="0.1"} 1' in text
    assert 'x_seconds_bucket{instance="a\\"b",le="1"} 2' in text
    assert 'x_seconds_bucket{instance="a\\"b",le="+Inf"} 3' in text
    assert 'x_seconds_count{instance="a\\"b"} 3' in text
    st = h.stats()
    assert st.all is not None and st.all.count == 3 and st.all.max_s == 5.0
    c = Counter("y_total", "help", ["code"])
    c.inc("200")
    c.inc("200")
    assert "\n".join(c.render()).endswith('y_total{code="200"} 2')


# -- fake vLLM servers -----------------------------------------------------------------


@dataclasses.dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: Any  # case-insensitive multidict
    t: float


class Cluster:
    """What the fakes share: an arrival log and "KV ready" events per request id."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []  # (engine name, X-Request-Id)
        self.kv_ready: dict[str, asyncio.Event] = {}

    def ready(self, rid: str) -> asyncio.Event:
        return self.kv_ready.setdefault(rid, asyncio.Event())


class FakeEngine:
    """One fake vLLM instance (prefill or decode)."""

    def __init__(self, name: str, cluster: Cluster, *, side_port: int = 5600) -> None:
        self.name, self.cluster, self.side_port = name, cluster, side_port
        self.seen: list[Seen] = []
        self.health = 200
        self.hold: asyncio.Event | None = None  # completions wait for it when set
        self.delay_s = 0.0
        self.fail: tuple[int, dict[str, Any]] | None = None
        self.drop = False  # close the connection instead of answering
        self.tokens = ["Hel", "lo", " wor", "ld"]
        self.token_gap_s = 0.0
        self.aborted: list[str] = []
        self.ticket: dict[str, Any] | None = None  # the producer's kv_transfer_params
        # Behind a Go/JavaScript router (llm-d's sidecar is in front of decode): what it
        # reads and what it answers went through a float64 JSON parser (tests.float64_json).
        self.float64 = False
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.float64:
            body = float64_router(body)  # as the router in front of it passed it on
        rid = request.headers.get("X-Request-Id", "")
        self.seen.append(Seen(request.path, body, request.headers.copy(), time.monotonic()))
        self.cluster.log.append((self.name, rid))
        try:
            return await self._answer(request, body, rid)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise

    async def _answer(
        self, request: web.Request, body: dict[str, Any], rid: str
    ) -> web.StreamResponse:
        if self.drop:
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if self.hold is not None:
            await self.hold.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            return web.json_response(self.fail[1], status=self.fail[0])
        params = body.get("kv_transfer_params") or {}
        chat = request.path.endswith("/chat/completions")
        if params.get("do_remote_decode"):  # producer: one token and a ticket
            self.cluster.ready(rid).set()
            answer = {
                "id": f"cmpl-{rid}",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": self.ticket
                or {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": f"engine-{self.name}",
                    "remote_host": "127.0.0.1",
                    "remote_port": self.side_port,
                    "remote_block_ids": [[1, 2, 3]],
                    "remote_request_id": f"cmpl-{rid}-0-abcdef12",
                    "tp_size": 1,
                },
            }
            return web.json_response(float64_router(answer) if self.float64 else answer)
        if params.get("do_remote_prefill") and params.get("remote_block_ids") is None:
            # push receiver: nothing to emit before the producer wrote the KV
            await asyncio.wait_for(self.cluster.ready(rid).wait(), 5)
        if not body.get("stream"):
            text = "".join(self.tokens)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            )
            return web.json_response(
                {"id": f"cmpl-{rid}", "engine": self.name, "choices": [choice]}
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if chat:
            await out.write(
                _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            )
        for tok in self.tokens:
            if self.token_gap_s:
                await asyncio.sleep(self.token_gap_s)
            piece = {"delta": {"content": tok}} if chat else {"text": tok}
            await out.write(_sse({"engine": self.name, "choices": [{"index": 0, **piece}]}))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def engines(
    n_prefill: int, n_decode: int
) -> AsyncIterator[tuple[list[FakeEngine], list[FakeEngine], Cluster]]:
    cluster = Cluster()
    ps = [await FakeEngine(f"P{i}", cluster, side_port=5600 + i).start() for i in range(n_prefill)]
    ds = [await FakeEngine(f"D{i}", cluster).start() for i in range(n_decode)]
    try:
        yield ps, ds, cluster
    finally:
        for e in ps + ds:
            await e.stop()


def _config(ps: list[FakeEngine], ds: list[FakeEngine], **kw: Any) -> ProxyConfig:
    kw.setdefault("health_interval_s", 0)  # checks off unless a test wants them
    return ProxyConfig(
        prefill=tuple(e.url for e in ps), decode=tuple(e.url for e in ds), port=0, **kw
    )


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


async def post(
    s: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    path: str = "/v1/completions",
    **kw: Any,
) -> tuple[int, dict[str, Any], Any]:
    async with s.post(url + path, json=body, **kw) as r:
        data = await r.read()
        return r.status, json.loads(data) if data else {}, r.headers


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# -- HTTP: pull ------------------------------------------------------------------------


def test_pull_prefill_then_decode_with_the_ticket() -> None:
    async def body() -> None:
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds)) as px,
            aiohttp.ClientSession() as s,
        ):
            req = {
                "model": "tiny",
                "prompt": LONG,
                "max_tokens": 16,
                "min_tokens": 4,
                "max_completion_tokens": 16,
                "temperature": 0,
            }
            status, out, headers = await post(s, px.url, req, headers={"X-Request-Id": "req-42"})
            assert status == 200 and out["choices"][0]["text"] == "Hello world"
            assert headers["X-Request-Id"] == "req-42"
            (p,) = ps[0].seen
            assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
            assert p.body["stream"] is False and "min_tokens" not in p.body
            assert p.body["kv_transfer_params"]["do_remote_decode"] is True
            assert p.body["kv_transfer_params"]["do_remote_prefill"] is False
            (d,) = ds[0].seen
            assert d.body["max_tokens"] == 16 and d.body["min_tokens"] == 4
            ticket = d.body["kv_transfer_params"]
            assert ticket["remote_engine_id"] == "engine-P0" and ticket["remote_block_ids"] == [
                [1, 2, 3]
            ]
            assert ticket["do_remote_prefill"] is True
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"] == "req-42"
            assert p.t <= d.t
            # a request without an id gets one, the same on both sides
            await post(s, px.url, {"prompt": LONG})
            assert ps[0].seen[1].headers["X-Request-Id"] == ds[0].seen[1].headers["X-Request-Id"]
            assert px.prefill[0].kv_endpoint == {
                "remote_engine_id": "engine-P0",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }

    run(body())


def test_streaming_passes_through_and_times_stages() -> None:
    async def body() -> None:
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds)) as px,
            aiohttp.ClientSession() as s,
        ):
            ds[0].token_gap_s = 0.01
            req = {
                "model": "tiny",
                "messages": [{"role": "user", "content": LONG}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with s.post(px.url + "/v1/chat/completions", json=req) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                raw = await r.read()
            events = [e for e in raw.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            contents = [
                json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]
            ]
            assert contents == ["", "Hel", "lo", " wor", "ld"]
            assert ps[0].seen[0].path == "/v1/chat/completions"
            assert ps[0].seen[0].body["stream"] is False
            assert "stream_options" not in ps[0].seen[0].body
            assert ds[0].seen[0].body["stream"] is True and ds[0].seen[0].body["stream_options"]
            m = px.metrics
            assert m.ttft.count("pd") == 1 and m.kv_wait.count(ds[0].url) == 1
            assert m.itl.count(ds[0].url) == 3 and m.decode.count(ds[0].url) == 1
            assert m.prefill.count(ps[0].url) == 1
            st = m.itl.stats().all
            assert st is not None and st.p50_s >= 0.005

    run(body())


def test_decode_routing_by_active_requests() -> None:
    async def body() -> None:
        async with (
            engines(1, 2) as (ps, ds, _),
            Proxy(_config(ps, ds)) as px,
            aiohttp.ClientSession() as s,
        ):
            gate = ds[0].hold = asyncio.Event()
            ds[1].hold = gate
            first = asyncio.create_task(post(s, px.url, {"prompt": LONG}))
            await until(lambda: sum(len(d.seen) for d in ds) == 1)
            busy = next(d for d in ds if d.seen)
            idle = next(d for d in ds if not d.seen)
            second = asyncio.create_task(post(s, px.url, {"prompt": LONG}))
            await until(lambda: len(idle.seen) == 1)
            assert len(busy.seen) == 1  # the busy one was skipped
            assert {i.url: i.active for i in px.decode} == {busy.url: 1, idle.url: 1}
            gate.set()
            assert (await first)[0] == 200 and (await second)[0] == 200
            assert all(i.active == 0 for i in px.decode)

    run(body())


def test_prefill_routing_by_outstanding_tokens() -> None:
    async def body() -> None:
        cfg = dict(prefix_affinity=False)
        async with (
            engines(2, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            gate = asyncio.Event()
            ps[0].hold = ps[1].hold = gate
            big = asyncio.create_task(post(s, px.url, {"prompt": "z" * 8000}))  # ~2000 tokens
            await until(lambda: sum(len(p.seen) for p in ps) == 1)
            loaded = next(p for p in ps if p.seen)
            other = next(p for p in ps if not p.seen)
            assert next(i for i in px.prefill if i.url == loaded.url).outstanding_tokens == 2000
            small = [asyncio.create_task(post(s, px.url, {"prompt": "y" * 400})) for _ in range(3)]
            await until(lambda: len(other.seen) == 3)  # 3 x 100 tokens < 2000: all to the other
            assert len(loaded.seen) == 1
            gate.set()
            for t in [big, *small]:
                assert (await t)[0] == 200
            assert all(i.outstanding_tokens == 0 and i.active == 0 for i in px.prefill)

    run(body())


def test_prefix_affinity_keeps_a_prompt_on_its_prefill() -> None:
    async def body() -> None:
        async with (
            engines(2, 1) as (ps, ds, _),
            Proxy(_config(ps, ds)) as px,
            aiohttp.ClientSession() as s,
        ):
            a = LONG + " question one"
            b = "Completely different text. " * 40
            await post(s, px.url, {"prompt": a})
            home = next(p for p in ps if p.seen)
            for _ in range(3):  # ties would rotate; affinity keeps them home
                await post(s, px.url, {"prompt": a.replace("one", "two")})
            assert len(home.seen) == 4
            await post(s, px.url, {"prompt": b})
            b_home = next(p for p in ps if len(p.seen) == (1 if p is not home else 5))
            await post(s, px.url, {"prompt": b + " and more"})
            assert len(b_home.seen) == (2 if b_home is not home else 6)
            aff = px.metrics.affinity
            assert aff.get("hit") == 4 and aff.get("miss") == 2
        # Without affinity the same prompt spreads over tied instances.
        async with (
            engines(2, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, prefix_affinity=False)) as px,
            aiohttp.ClientSession() as s,
        ):
            for _ in range(4):
                await post(s, px.url, {"prompt": a})
            assert [len(p.seen) for p in ps] == [2, 2]

    run(body())


def test_short_prompts_skip_prefill() -> None:
    async def body() -> None:
        cfg = dict(short_prompt_tokens=100)
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            status, out, _ = await post(s, px.url, {"prompt": "Hello there", "max_tokens": 5})
            assert status == 200 and out["choices"][0]["text"] == "Hello world"
            assert ps[0].seen == [] and "kv_transfer_params" not in ds[0].seen[0].body
            assert ds[0].seen[0].body["max_tokens"] == 5
            await post(s, px.url, {"prompt": LONG})
            await post(s, px.url, {"prompt": ["a", "b"]})  # batch: decode serves it whole
            await post(s, px.url, {"prompt": LONG, "n": 2})
            assert len(ps[0].seen) == 1
            dec = px.metrics.decisions
            assert dec.get("decode_only", "short_prompt") == 1 and dec.get("pd", "pd") == 1
            assert dec.get("decode_only", "multi_prompt") == 1
            assert dec.get("decode_only", "parallel_sampling") == 1

    run(body())


# -- HTTP: health ----------------------------------------------------------------------


def test_health_checks_take_instances_out_and_back() -> None:
    async def body() -> None:
        cfg = dict(health_interval_s=0.02, health_fall=2, health_rise=1)
        async with (
            engines(2, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            assert px.ready  # the first round ran before listening
            sick = px.prefill[0]
            ps[0].health = 503
            await until(lambda: not sick.healthy)
            assert "503" in sick.last_error
            for i in range(4):
                await post(s, px.url, {"prompt": LONG + str(i)})
            assert len(ps[0].seen) == 0 and len(ps[1].seen) == 4  # never to the sick one
            async with s.get(px.url + "/stats") as r:
                stats = await r.json()
            states = {i["url"]: i["state"] for i in stats["instances"]}
            assert states[ps[0].url] == "unhealthy" and states[ps[1].url] == "healthy"
            ps[0].health = 200
            await until(lambda: sick.healthy)
            m = px.metrics.health_transitions
            assert m.get("prefill", ps[0].url, "unhealthy") == 1
            assert m.get("prefill", ps[0].url, "healthy") == 2  # start-up, then recovery

    run(body())


def test_all_unhealthy_is_503_with_a_clear_error() -> None:
    async def body() -> None:
        cfg = dict(health_interval_s=0.02, health_fall=1)
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            ds[0].health = 500
            await until(lambda: not px.decode[0].healthy)
            status, out, _ = await post(s, px.url, {"prompt": LONG})
            assert status == 503
            err = out["error"]
            assert err["type"] == "service_unavailable" and err["code"] == 503
            assert "no healthy decode instance" in err["message"] and ds[0].url in err["message"]
            async with s.get(px.url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "unavailable"
            assert ps[0].seen == []  # nothing was prefilled for nothing

    run(body())


def test_no_healthy_prefill_falls_back_or_fails() -> None:
    async def body() -> None:
        for fallback in (True, False):
            cfg = dict(health_interval_s=0.02, health_fall=1, prefill_fallback=fallback)
            async with (
                engines(1, 1) as (ps, ds, _),
                Proxy(_config(ps, ds, **cfg)) as px,
                aiohttp.ClientSession() as s,
            ):
                ps[0].health = 503
                await until(lambda: not px.prefill[0].healthy)
                status, out, _ = await post(s, px.url, {"prompt": LONG})
                if fallback:
                    assert status == 200 and "kv_transfer_params" not in ds[0].seen[0].body
                    assert px.metrics.decisions.get("decode_only", "prefill_unavailable") == 1
                    async with s.get(px.url + "/health") as r:
                        assert r.status == 200 and (await r.json())["status"] == "degraded"
                else:
                    assert status == 503 and "no healthy prefill" in out["error"]["message"]
                assert ps[0].seen == []

    run(body())


# -- HTTP: failures --------------------------------------------------------------------


def test_timeouts_are_504_naming_stage_and_instance() -> None:
    async def body() -> None:
        cfg = dict(prefill_timeout_s=0.2, decode_timeout_s=0.2)
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            ps[0].delay_s = 1.0
            status, out, _ = await post(s, px.url, {"prompt": LONG})
            assert status == 504 and out["error"]["stage"] == "prefill"
            assert out["error"]["instance"] == ps[0].url and ds[0].seen == []
            ps[0].delay_s = 0
            ds[0].delay_s = 1.0
            status, out, _ = await post(s, px.url, {"prompt": LONG})
            assert status == 504 and out["error"]["stage"] == "decode"
            assert out["error"]["instance"] == ds[0].url
            await until(lambda: len(ds[0].aborted) == 1)  # decode's request was dropped
            # a stream that stalls after it began ends with an SSE error event
            ds[0].delay_s, ds[0].token_gap_s = 0, 0.5
            async with s.post(
                px.url + "/v1/completions", json={"prompt": LONG, "stream": True}
            ) as r:
                assert r.status == 200
                raw = await r.read()
            assert b'"gateway_timeout"' in raw and b"[DONE]" not in raw
            errs = px.metrics.errors
            assert errs.get("prefill", ps[0].url, "timeout") == 1
            assert errs.get("decode", ds[0].url, "timeout") == 2

    run(body())


def test_instance_errors_map_to_502_or_pass_through() -> None:
    async def body() -> None:
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds)) as px,
            aiohttp.ClientSession() as s,
        ):
            ps[0].fail = (500, {"error": "engine dead"})
            status, out, _ = await post(s, px.url, {"prompt": LONG})
            assert status == 502 and out["error"]["stage"] == "prefill"
            assert ps[0].url in out["error"]["message"] and "engine dead" in out["error"]["message"]
            assert ds[0].seen == []
            ps[0].fail = (400, {"object": "error", "message": "prompt too long"})
            status, out, _ = await post(s, px.url, {"prompt": LONG})
            assert status == 400 and out == {"object": "error", "message": "prompt too long"}
            ps[0].fail = None
            ds[0].fail = (500, {"error": "KV load failed"})
            status, out, _ = await post(s, px.url, {"prompt": LONG})
            assert status == 502 and out["error"]["stage"] == "decode"
            status, out, _ = await post(s, px.url, {"prompt": 5})
            assert status == 400 and out["error"]["type"] == "invalid_request_error"
            async with s.post(px.url + "/v1/completions", data=b"{oops") as r:
                assert r.status == 400

    run(body())


def test_connection_failures_retry_elsewhere_and_eject() -> None:
    async def body() -> None:
        cfg = dict(health_interval_s=5.0, retries=1)  # checks on, but slow: passive only
        async with (
            engines(2, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            ps[0].drop = ps[1].drop = False
            bad = ps[0]
            bad.drop = True
            results = [await post(s, px.url, {"prompt": LONG + str(i)}) for i in range(4)]
            assert all(r[0] == 200 for r in results)
            assert len(ps[1].seen) == 4 and px.metrics.retries.get("prefill") >= 1
            # connection refused: out of rotation at once, the request lands elsewhere
            await bad.stop()
            bad_inst = next(i for i in px.prefill if i.url == bad.url)
            good_inst = next(i for i in px.prefill if i is not bad_inst)
            bad_inst.state = InstanceState.HEALTHY
            good_inst.outstanding_tokens = 10**6  # least loaded: the dead one goes first
            assert (await post(s, px.url, {"prompt": "Q" * 900}))[0] == 200
            assert not bad_inst.healthy and "cannot connect" in bad_inst.last_error
            assert len(ps[1].seen) == 5
            assert px.metrics.errors.get("prefill", bad.url, "connect") == 1

    run(body())


# -- HTTP: push ------------------------------------------------------------------------


def test_push_mode_decode_first_then_prefill() -> None:
    async def body() -> None:
        cfg = dict(mode=Direction.PUSH, push_gate_s=2.0)
        async with (
            engines(1, 1) as (ps, ds, cl),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            # First request: the prefill side channel is unknown yet -> prefill first.
            status, _, _ = await post(s, px.url, {"prompt": LONG}, headers={"X-Request-Id": "r1"})
            assert status == 200 and cl.log == [("P0", "r1"), ("D0", "r1")]
            assert px.metrics.push_sequential.get(ps[0].url) == 1
            # Now it is known: decode is registered first, prefill follows.
            req = {"prompt": LONG, "stream": True, "max_tokens": 9}
            t = time.monotonic()
            async with s.post(
                px.url + "/v1/completions", json=req, headers={"X-Request-Id": "r2"}
            ) as r:
                assert r.status == 200
                raw = await r.read()
            assert raw.endswith(b"data: [DONE]\n\n")
            # prefill went out once decode's request was on the wire, not after the gate
            assert time.monotonic() - t < 1.0
            assert cl.log[2:] == [("D0", "r2"), ("P0", "r2")]
            d = ds[0].seen[1]
            params = d.body["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["transfer_mode"] == "push"
            assert params["remote_engine_id"] == "engine-P0" and params["remote_port"] == 5600
            assert params["remote_block_ids"] is None and d.body["max_tokens"] == 9
            p = ps[0].seen[1]
            assert p.body["kv_transfer_params"]["do_remote_decode"] is True
            assert p.body["max_tokens"] == 1
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"] == "r2"
            # One fresh capability per request, given to both instances only.
            token = params["kvxfer_capability"]
            assert re.fullmatch(r"[0-9a-f]{32}", token)
            assert p.body["kv_transfer_params"]["kvxfer_capability"] == token
            assert ds[0].seen[0].body["kv_transfer_params"].get("kvxfer_capability") != token
            assert px.metrics.kv_wait.count(ds[0].url) == 1

    run(body())


def test_push_mode_prefill_failure_aborts_decode() -> None:
    async def body() -> None:
        cfg = dict(mode=Direction.PUSH)
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, **cfg)) as px,
            aiohttp.ClientSession() as s,
        ):
            await post(s, px.url, {"prompt": LONG})  # learn the side channel
            ps[0].fail = (503, {"error": "overloaded"})
            status, out, _ = await post(
                s, px.url, {"prompt": LONG, "stream": True}, headers={"X-Request-Id": "doomed"}
            )
            assert status == 502 and out["error"]["stage"] == "prefill"
            await until(lambda: "doomed" in ds[0].aborted)  # decode was not left waiting
            assert px.decode[0].active == 0 and px.prefill[0].outstanding_tokens == 0

    run(body())


# -- observability ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [Direction.PULL, Direction.PUSH])
def test_tickets_pass_float64_routers_around_the_proxy_exactly(mode: Direction) -> None:
    """A Go/JavaScript router on each side of the proxy (prefill's answer and decode's
    request pass one, which parses JSON numbers as float64): decode still reads the
    producer's ticket exactly, its 64-bit incarnations and 56-bit generation included
    (as JSON integers they came back rounded and every load was refused)."""
    incarnations = (0x13E0F7F3125A8DA4, 2**64 - 1)  # issue 26's, and the largest
    produced = Ticket(
        engine_id="engine-P0",
        host="127.0.0.1",
        port=5600,
        request_id="cmpl-r1-0-abcdef12",
        block_ids=((1, 2, 3),),
        num_tokens=48,
        incarnation=incarnations[0],
        lease_expiry=time.time() + 30.0,
        tp_size=2,
        capability="c0" * 16,
        guard_slot=3,
        generation=2**56 - 1,
    )

    async def body() -> None:
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds, mode=mode, push_gate_s=2.0)) as px,
            aiohttp.ClientSession() as s,
        ):
            ps[0].ticket = ticket_params(produced, direction=mode, incarnations=incarnations)
            ps[0].float64 = ds[0].float64 = True
            for rid in ("r1", "r2"):  # push: r1 prefills first (endpoint unknown), r2 not
                status, out, _ = await post(
                    s, px.url, {"prompt": LONG}, headers={"X-Request-Id": rid}
                )
                assert status == 200 and out["choices"][0]["text"] == "Hello world"
            first, second = (d.body["kv_transfer_params"] for d in ds[0].seen)
            for rank in (0, 1):
                t = remote_ticket(first, tp_rank=rank, transfer_id="t", local_blocks=((7, 8),))
                assert (t.incarnation, t.incarnations) == (incarnations[rank], incarnations)
                assert (t.port, t.tp_size, t.block_ids) == (5600 + rank, 2, ((1, 2),))
                assert (t.generation, t.guard_slot) == (2**56 - 1, 3)
                assert (t.lease_expiry, t.capability) == (produced.lease_expiry, "c0" * 16)
                # push: the endpoint the proxy learnt from r1, handed to decode before r2's
                # prefill ran, names the producer's incarnations exactly too
                t2 = remote_ticket(second, tp_rank=rank, transfer_id="t", local_blocks=((7, 8),))
                assert (t2.incarnation, t2.incarnations) == (incarnations[rank], incarnations)
                assert t2.port == 5600 + rank
            if mode is Direction.PUSH:
                assert second["remote_block_ids"] is None and second["transfer_mode"] == "push"
                assert second["kvxfer_capability"] != "c0" * 16  # the proxy's own token

    run(body())


def test_metrics_stats_and_health_endpoints() -> None:
    async def body() -> None:
        async with (
            engines(1, 1) as (ps, ds, _),
            Proxy(_config(ps, ds)) as px,
            aiohttp.ClientSession() as s,
        ):
            async with s.post(
                px.url + "/v1/completions", json={"prompt": LONG, "stream": True}
            ) as r:
                assert (await r.read()).endswith(b"[DONE]\n\n")
            async with s.get(px.url + "/metrics") as r:
                assert r.status == 200 and r.content_type == "text/plain"
                text = await r.text()
            for line in (
                f'kvxfer_proxy_prefill_seconds_count{{instance="{ps[0].url}"}} 1',
                f'kvxfer_proxy_kv_wait_seconds_count{{instance="{ds[0].url}"}} 1',
                f'kvxfer_proxy_decode_seconds_count{{instance="{ds[0].url}"}} 1',
                'kvxfer_proxy_ttft_seconds_count{route="pd"} 1',
                f'kvxfer_proxy_instance_healthy{{role="decode",instance="{ds[0].url}"}} 1',
                'kvxfer_proxy_decisions_total{route="pd",reason="pd"} 1',
                'kvxfer_proxy_responses_total{code="200"} 1',
            ):
                assert line in text, line
            assert "# TYPE kvxfer_proxy_itl_seconds histogram" in text
            async with s.get(px.url + "/stats") as r:
                stats = await r.json()
            assert stats["mode"] == "pull" and stats["requests"] == 1
            assert stats["stages"]["prefill"]["all"]["count"] == 1
            assert stats["stages"]["kv_wait"]["by"][ds[0].url]["count"] == 1
            assert {i["role"] for i in stats["instances"]} == {"prefill", "decode"}
            async with s.get(px.url + "/health") as r:
                h = await r.json()
            assert r.status == 200 and h["status"] == "ok" and h["decode_healthy"] == 1
            async with s.get(px.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "tiny"

    run(body())


# -- embedding and CLI -----------------------------------------------------------------


class LoopThread:
    """An event loop on a thread, for sync tests that need fakes running."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Awaitable[Any]) -> Any:
        async def wrap() -> Any:
            return await coro

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_start_proxy_from_sync_code() -> None:
    lt = LoopThread()
    try:
        cluster = Cluster()
        p = lt.call(FakeEngine("P0", cluster).start())
        d = lt.call(FakeEngine("D0", cluster).start())
        url, stop = start_proxy([p.url], [d.url], health_interval_s=0.05)
        try:
            req = urllib.request.Request(
                url + "/v1/completions",
                data=json.dumps({"prompt": LONG, "max_tokens": 4}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert json.loads(resp.read())["choices"][0]["text"] == "Hello world"
            assert len(p.seen) == 1 and len(d.seen) == 1
        finally:
            stop()
            stop()  # idempotent
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)
        d.health = 503
        with pytest.raises(TimeoutError, match="not healthy"):
            start_proxy([], [d.url], health_interval_s=0.05, wait_ready_s=0.3)
        lt.call(p.stop())
        lt.call(d.stop())
    finally:
        lt.close()


def test_cli_parses_flags_and_rejects_bad_ones(capsys: pytest.CaptureFixture[str]) -> None:
    args = proxy_mod.build_parser().parse_args(
        [
            "--prefill",
            "127.0.0.1:8100",
            "http://h:8101/v1",
            "--decode",
            "http://h:8200",
            "--decode",
            "h:8201",
            "--mode",
            "push",
            "--short-prompt-tokens",
            "256",
            "--prefill-timeout",
            "30",
            "--no-prefix-affinity",
            "--health-interval",
            "0",
        ]
    )
    cfg = proxy_mod.config_from_args(args)
    assert cfg.prefill == ("http://127.0.0.1:8100", "http://h:8101")
    assert cfg.decode == ("http://h:8200", "http://h:8201")
    assert cfg.mode is Direction.PUSH and cfg.short_prompt_tokens == 256
    assert cfg.prefill_timeout_s == 30 and not cfg.prefix_affinity
    assert cfg.keepalive_timeout_s > 90  # above llm-d's sidecar idle timeout
    with pytest.raises(SystemExit) as exit_:
        proxy_mod.main(["--prefill", "http://h:1"])
    assert exit_.value.code == 2 and "decode" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        proxy_mod.main(["--decode", "h:1", "--tokenizer", "/nonexistent"])
    assert exit_.value.code == 2 and "tokenizer" in capsys.readouterr().err


def test_cli_serves_and_stops_cleanly_on_sigterm() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvxfer.cli",
        "proxy",
        "--decode",
        "http://127.0.0.1:9",
        "--port",
        "0",
        "--health-interval",
        "0",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("kvxfer proxy: http://127.0.0.1:"), line
        url = line.split()[2]
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_defaults_are_the_config_defaults_and_every_field_has_a_flag() -> None:
    # One declaration: the parser's defaults are ProxyConfig's, and each CLI field
    # comes back from config_from_args under its own name.
    parser = proxy_mod.build_parser()
    cfg = proxy_mod.config_from_args(parser.parse_args(["--decode", "http://h:1"]))
    assert cfg == ProxyConfig(decode=("http://h:1",))
    flags = {a.dest for a in parser._actions}
    fields = {f.name for f, opt, _ in options() if opt.cli}
    assert fields <= flags and "max_body_bytes" not in flags
    cfg = proxy_mod.config_from_args(
        parser.parse_args(["--decode", "h:1", "--no-prefill-fallback", "--upstream-keepalive", "2"])
    )
    assert not cfg.prefill_fallback and cfg.upstream_keepalive_s == 2.0
