"""Configuration of ``kvxfer proxy`` (:class:`ProxyConfig`) and its checks."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvxfer.errors import ConfigError
from kvxfer.types import Direction

__all__ = ["ProxyConfig", "load_tokenizer", "normalize_url"]


class ProxyConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything ``kvxfer proxy`` can be told; the CLI flags map one to one.

    Attributes:
        prefill: Prefill instance base URLs (``http://host:port``). May be empty: the
            proxy then balances decode instances only.
        decode: Decode instance base URLs; at least one.
        host: Address to listen on.
        port: Port to listen on (0: any free port).
        mode: ``PULL`` (prefill first, then decode with prefill's ``kv_transfer_params``)
            or ``PUSH`` (decode registered first, then prefill writes into it).
        short_prompt_tokens: Prompts under this many estimated tokens skip P/D and go
            to a decode instance; 0 disables the decider's length rule.
        prefill_fallback: With no healthy prefill instance, serve P/D requests on a
            decode instance alone (True) or answer 503 (False).
        chars_per_token: Token estimate without a tokenizer.
        tokenizer: Path to a ``tokenizer.json`` (or a directory holding one) for exact
            prompt token counts; needs the ``tokenizers`` package.
        prefix_affinity: Route prompts sharing leading blocks to the same prefill.
        affinity_block_chars: Characters per affinity block (token-id prompts use
            ``affinity_block_chars / chars_per_token`` ids).
        affinity_max_blocks: Leading blocks hashed per prompt.
        affinity_capacity: Block keys remembered (LRU).
        affinity_slack_tokens: Extra outstanding prompt tokens an affine prefill
            instance may carry over the least loaded one and still be chosen.
        health_interval_s: Seconds between ``GET /health`` rounds; 0 disables checks
            (every instance then counts as healthy, always).
        health_timeout_s: Timeout of one health check.
        health_fall: Consecutive failed checks that take an instance out of rotation.
        health_rise: Consecutive passed checks that put it back.
        connect_timeout_s: TCP connect timeout toward instances.
        prefill_timeout_s: Whole prefill request (send to full response).
        decode_timeout_s: Longest wait for decode's first byte and between two of its
            chunks.
        retries: Re-sends of a request whose connection failed before any response
            (pull mode; to another healthy instance when there is one).
        push_gate_s: Push mode: longest wait for the decode request to be on the wire
            before the prefill request goes out.
        keepalive_timeout_s: Idle keep-alive of the proxy's own client connections;
            keep it above any client or load balancer idle timeout (llm-d's is 90 s).
        upstream_keepalive_s: How long idle connections to instances are reused; keep
            it below the engines' keep-alive (vLLM: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``,
            5 s by default) or a reused connection meets a reset.
        max_connections: Cap on connections to all instances together (0: none).
        shutdown_grace_s: On SIGINT/SIGTERM, how long in-flight requests may finish.
        max_body_bytes: Largest client request body accepted.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    mode: Direction = Direction.PULL
    short_prompt_tokens: int = 0
    prefill_fallback: bool = True
    chars_per_token: float = 4.0
    tokenizer: str | None = None
    prefix_affinity: bool = True
    affinity_block_chars: int = 256
    affinity_max_blocks: int = 64
    affinity_capacity: int = 65536
    affinity_slack_tokens: int = 4096
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_fall: int = 2
    health_rise: int = 1
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 300.0
    retries: int = 1
    push_gate_s: float = 0.5
    keepalive_timeout_s: float = 120.0
    upstream_keepalive_s: float = 4.0
    max_connections: int = 0
    shutdown_grace_s: float = 10.0
    max_body_bytes: int = 64 * 1024 * 1024

    def validate(self) -> None:
        """Check every rule.

        Raises:
            ConfigError: Naming the key, the value and the rule broken.
        """
        if not self.decode:
            raise ConfigError("decode", list(self.decode), "at least one decode instance")
        for key in ("prefill", "decode"):
            urls = [normalize_url(u) for u in getattr(self, key)]
            if len(set(urls)) != len(urls):
                raise ConfigError(key, list(getattr(self, key)), "URLs must be distinct")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", self.port, "must be in 0..65535")
        positive = (
            "chars_per_token",
            "health_timeout_s",
            "connect_timeout_s",
            "prefill_timeout_s",
            "decode_timeout_s",
            "keepalive_timeout_s",
            "upstream_keepalive_s",
            "affinity_block_chars",
            "affinity_max_blocks",
            "affinity_capacity",
            "health_fall",
            "health_rise",
            "max_body_bytes",
        )
        for key in positive:
            if not getattr(self, key) > 0:
                raise ConfigError(key, getattr(self, key), "must be > 0")
        non_negative = (
            "short_prompt_tokens",
            "affinity_slack_tokens",
            "health_interval_s",
            "retries",
            "push_gate_s",
            "max_connections",
            "shutdown_grace_s",
        )
        for key in non_negative:
            if not getattr(self, key) >= 0:
                raise ConfigError(key, getattr(self, key), "must be >= 0")


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/[v1]`` -> ``http://host:port``.

    Raises:
        ConfigError: Not an http(s) URL with a host.
    """
    raw = url.strip()
    text = raw if "://" in raw else f"http://{raw}"
    parts = urlsplit(text)
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("url", url, "expected http://HOST:PORT (or HOST:PORT)")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError("url", url, f"bad port: {exc}") from None
    return f"{parts.scheme}://{parts.netloc}{path}"


def load_tokenizer(path: str) -> Callable[[str], int]:
    """A ``text -> token count`` function from a ``tokenizer.json``.

    Raises:
        ConfigError: The file is missing or the ``tokenizers`` package is not installed.
    """
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ConfigError("tokenizer", path, "must be a tokenizer.json or a directory holding one")
    try:
        module: Any = importlib.import_module("tokenizers")
    except ImportError:
        raise ConfigError("tokenizer", path, "needs the `tokenizers` package") from None
    tok = module.Tokenizer.from_file(str(file))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count
