"""The proxy's server: :class:`Proxy` (aiohttp app, health checks, lifecycle),
:func:`start_proxy` (a proxy on a background thread, for tests and the e2e suite) and
:func:`main` (``kvxfer proxy``). Request handling lives in
:mod:`~kvxfer.adapters.vllm.proxy.dispatch`, instance choice in
:mod:`~kvxfer.adapters.vllm.proxy.routing`, the options in
:mod:`~kvxfer.adapters.vllm.proxy.options`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import msgspec

from kvxfer.errors import ConfigError, missing_dependency

try:
    import aiohttp
    from aiohttp import web
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise missing_dependency("aiohttp", "proxy", _exc) from _exc

from kvxfer.adapters.vllm.proxy.dispatch import Dispatcher
from kvxfer.adapters.vllm.proxy.messages import ProxyError, Stage
from kvxfer.adapters.vllm.proxy.metrics import ProxyMetrics
from kvxfer.adapters.vllm.proxy.options import (
    ProxyConfig,
    build_parser,
    config_from_args,
    load_tokenizer,
    normalize_url,
)
from kvxfer.adapters.vllm.proxy.routing import (
    Instance,
    InstanceKind,
    InstanceState,
    PrefixIndex,
    TokenEstimator,
)
from kvxfer.types import Direction

__all__ = ["Proxy", "main", "start_proxy"]

log = logging.getLogger("kvxfer.proxy")


class HealthBody(msgspec.Struct, frozen=True, kw_only=True):
    """The body of the proxy's own ``GET /health``."""

    status: str  # "ok", "degraded" (no prefill: decode-only) or "unavailable"
    mode: str
    prefill_healthy: int
    prefill_total: int
    decode_healthy: int
    decode_total: int


async def _on_chunk_sent(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
) -> None:
    """Trace hook: a request carrying an Event as its trace context sets it once its
    body is on the wire (push mode sends prefill only then)."""
    event = getattr(ctx, "trace_request_ctx", None)
    if isinstance(event, asyncio.Event):
        event.set()


class Proxy:
    """The proxy server on the running event loop.

    Args:
        config: What to serve and how; checked with :meth:`ProxyConfig.validate`.
        tokenizer: Optional ``text -> token count`` (overrides ``config.tokenizer``).

    Raises:
        ConfigError: ``config`` breaks a rule.
    """

    def __init__(
        self, config: ProxyConfig, *, tokenizer: Callable[[str], int] | None = None
    ) -> None:
        config.validate()
        self.config = config
        self.checks = config.health_interval_s > 0
        start_state = InstanceState.UNHEALTHY if self.checks else InstanceState.HEALTHY
        self.prefill = [
            Instance(normalize_url(u), InstanceKind.PREFILL, state=start_state)
            for u in config.prefill
        ]
        self.decode = [
            Instance(normalize_url(u), InstanceKind.DECODE, state=start_state)
            for u in config.decode
        ]
        if not self.checks:
            for inst in self.instances:
                inst.last_error = ""
        if tokenizer is None and config.tokenizer:
            tokenizer = load_tokenizer(config.tokenizer)
        self.index = (
            PrefixIndex(
                block_chars=config.affinity_block_chars,
                block_tokens=max(1, round(config.affinity_block_chars / config.chars_per_token)),
                max_blocks=config.affinity_max_blocks,
                capacity=config.affinity_capacity,
            )
            if config.prefix_affinity
            else None
        )
        self.metrics = ProxyMetrics(config.mode.value)
        self.dispatcher = Dispatcher(
            config,
            self.prefill,
            self.decode,
            metrics=self.metrics,
            estimator=TokenEstimator(config.chars_per_token, tokenizer),
            index=self.index,
            on_down=self._passive_down,
        )
        self.port = config.port
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def instances(self) -> list[Instance]:
        """Prefill then decode instances."""
        return [*self.prefill, *self.decode]

    @property
    def url(self) -> str:
        """Where clients reach the proxy (valid after :meth:`start`)."""
        host = self.config.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def ready(self) -> bool:
        """A decode instance is healthy, and a prefill one too when any is configured."""
        decode_ok = any(i.healthy for i in self.decode)
        return decode_ok and (not self.prefill or any(i.healthy for i in self.prefill))

    async def start(self) -> None:
        """Open the client pool, run one health round, start listening.

        Raises:
            OSError: The address is in use or cannot be bound.
        """
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(_on_chunk_sent)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.config.max_connections,
                keepalive_timeout=self.config.upstream_keepalive_s,
            ),
            trace_configs=[trace],
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.dispatcher.session = self._session
        try:
            if self.checks:
                await self.check_health()
                self._health_task = asyncio.create_task(self._health_loop())
            app = web.Application(client_max_size=self.config.max_body_bytes)
            app.router.add_post("/v1/completions", self._completions)
            app.router.add_post("/v1/chat/completions", self._chat_completions)
            app.router.add_get("/v1/models", self._models)
            app.router.add_get("/health", self._health)
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/stats", self._stats)
            self._runner = web.AppRunner(
                app,
                handle_signals=False,
                access_log=None,
                keepalive_timeout=self.config.keepalive_timeout_s,
                handler_cancellation=True,
                shutdown_timeout=self.config.shutdown_grace_s,
            )
            await self._runner.setup()
            sock = _bind(self.config.host, self.config.port)
            self.port = int(sock.getsockname()[1])
            await web.SockSite(self._runner, sock).start()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "kvxfer proxy: listening on %s (mode %s; prefill %s; decode %s)",
            self.url,
            self.config.mode.value,
            ", ".join(i.url for i in self.prefill) or "none",
            ", ".join(i.url for i in self.decode),
        )

    async def stop(self) -> None:
        """Stop health checks, let in-flight requests finish (up to the grace), close."""
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- health --------------------------------------------------------------------------
    async def check_health(self) -> None:
        """One ``GET /health`` round over every instance, concurrently."""
        await asyncio.gather(*(self._check(i) for i in self.instances))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # pragma: no cover - a bug must not stop the checks
                log.exception("kvxfer proxy: health round failed")

    async def _check(self, inst: Instance) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        error = ""
        try:
            async with self._session.get(f"{inst.url}/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    error = f"/health answered {resp.status}"
        except asyncio.TimeoutError:
            error = f"/health timed out after {self.config.health_timeout_s:g}s"
        except aiohttp.ClientError as exc:
            error = f"/health failed: {exc}"
        changed = inst.observe(
            not error, error, fall=self.config.health_fall, rise=self.config.health_rise
        )
        if changed:
            self._transitioned(inst)

    def _passive_down(self, inst: Instance, reason: str) -> None:
        """A request could not connect: out of rotation now (checks put it back)."""
        if not self.checks:
            return
        if inst.observe(False, reason, fall=1, rise=self.config.health_rise):
            self._transitioned(inst)

    def _transitioned(self, inst: Instance) -> None:
        self.metrics.transition(inst)
        if inst.healthy:
            log.info("kvxfer proxy: %s %s in rotation", inst.kind.value, inst.url)
            return
        log.warning(
            "kvxfer proxy: %s %s out of rotation: %s", inst.kind.value, inst.url, inst.last_error
        )
        if inst.kind is InstanceKind.PREFILL and self.index is not None:
            self.index.forget(inst.url)  # a restarted engine has an empty prefix cache

    # -- endpoints -----------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatcher.handle(request, "/completions")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.dispatcher.handle(request, "/chat/completions")

    async def _models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models`` from a healthy decode instance."""
        inst = self.dispatcher.decode_policy.pick(self.decode)
        if inst is None:
            return ProxyError(503, "no healthy decode instance", stage=Stage.ROUTE).response()
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with self._session.get(f"{inst.url}/v1/models", timeout=timeout) as resp:
                body = await resp.read()
                out = web.Response(status=resp.status, body=body)
                out.content_type = resp.content_type
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            msg = f"decode instance {inst.url}: {exc or 'timed out'}"
            return ProxyError(502, msg, stage=Stage.DECODE, instance=inst.url).response()

    async def _health(self, request: web.Request) -> web.Response:
        p_ok = sum(i.healthy for i in self.prefill)
        d_ok = sum(i.healthy for i in self.decode)
        if self.ready:
            status = "ok"
        elif d_ok and self.config.prefill_fallback:
            status = "degraded"
        else:
            status = "unavailable"
        body = HealthBody(
            status=status,
            mode=self.config.mode.value,
            prefill_healthy=p_ok,
            prefill_total=len(self.prefill),
            decode_healthy=d_ok,
            decode_total=len(self.decode),
        )
        return web.Response(
            status=503 if status == "unavailable" else 200,
            body=msgspec.json.encode(body),
            content_type="application/json",
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics.render(self.instances)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _stats(self, request: web.Request) -> web.Response:
        body = msgspec.json.encode(self.metrics.stats(self.instances))
        return web.Response(body=body, content_type="application/json")


def _bind(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


# -- embedding (tests, e2e) ----------------------------------------------------------------


def start_proxy(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    mode: str | Direction = Direction.PULL,
    port: int = 0,
    wait_ready_s: float = 30.0,
    **options: Any,
) -> tuple[str, Callable[[], None]]:
    """Run a proxy on a background thread (its own event loop); returns ``(url, stop)``.

    Blocks until the proxy listens and, unless ``wait_ready_s`` is 0, until a decode
    instance (and a prefill one, when any is given) passed a health check.
    ``stop()`` is idempotent and waits for the thread.

    Args:
        prefill_urls: Prefill instance base URLs.
        decode_urls: Decode instance base URLs.
        mode: ``"pull"`` or ``"push"``.
        port: Port to listen on (0: a free one; the URL says which).
        wait_ready_s: Longest wait for healthy instances.
        **options: Any other :class:`ProxyConfig` field (e.g. ``short_prompt_tokens``,
            ``health_interval_s``, ``decode_timeout_s``).

    Raises:
        ConfigError: A bad option.
        TimeoutError: The instances did not become healthy in time (the message
            carries each one's last health error).
    """
    config = ProxyConfig(
        prefill=tuple(prefill_urls),
        decode=tuple(decode_urls),
        host=options.pop("host", "127.0.0.1"),
        port=port,
        mode=Direction(mode) if isinstance(mode, str) else mode,
        **options,
    )
    proxy = Proxy(config)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(proxy.start())
        except BaseException as exc:
            failure.append(exc)
            started.set()
            loop.close()
            return
        started.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(proxy.stop())
            loop.close()

    thread = threading.Thread(target=run, name="kvxfer-proxy", daemon=True)
    thread.start()
    started.wait()
    if failure:
        thread.join()
        raise failure[0]
    stopped = False

    def stop() -> None:
        nonlocal stopped
        if stopped:
            return
        stopped = True
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=config.shutdown_grace_s + 10)

    deadline = time.monotonic() + wait_ready_s
    while wait_ready_s and not proxy.ready:
        if time.monotonic() > deadline:
            states = "; ".join(
                f"{i.kind.value} {i.url}: {i.state.value} ({i.last_error})" for i in proxy.instances
            )
            stop()
            raise TimeoutError(
                f"kvxfer proxy: instances not healthy after {wait_ready_s}s: {states}"
            )
        time.sleep(0.02)
    return proxy.url, stop


# -- CLI -----------------------------------------------------------------------------------


async def _serve(proxy: Proxy) -> int:
    config = proxy.config
    try:
        await proxy.start()
    except OSError as exc:
        print(f"kvxfer proxy: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    print(
        f"kvxfer proxy: {proxy.url} (mode {config.mode.value}; "
        f"{len(proxy.prefill)} prefill, {len(proxy.decode)} decode)",
        flush=True,
    )
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        await done.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        log.info("kvxfer proxy: shutting down")
        await proxy.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvxfer proxy``; returns the exit status (2: bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=str(args.log_level).upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        proxy = Proxy(config_from_args(args))  # loads the tokenizer, if any
    except ConfigError as exc:
        parser.error(str(exc))  # exits with status 2
    return asyncio.run(_serve(proxy))
