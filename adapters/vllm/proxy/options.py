"""The options of ``kvxfer proxy``, declared once.

Each :class:`ProxyConfig` field carries an :class:`Opt` in its annotation: the CLI
help text, the help group and the rule its value must meet. The struct's fields and
defaults, the argparse parser (:func:`build_parser`), the config built from parsed
arguments (:func:`config_from_args`) and the checks (:meth:`ProxyConfig.validate`) are
all read from that one declaration, so an option is added or changed in one place.

Flags are derived from field names: ``health_interval_s`` is ``--health-interval``
(a trailing ``_s`` is dropped, ``_`` becomes ``-``); a boolean defaulting to True is
offered as ``--no-<name>`` (its help says what the flag does); a tuple of URLs takes
one or more values and repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec

from kvxfer.errors import ConfigError
from kvxfer.types import Direction

__all__ = [
    "Group",
    "Opt",
    "ProxyConfig",
    "Rule",
    "build_parser",
    "config_from_args",
    "load_tokenizer",
    "normalize_url",
    "options",
]


class Group(enum.Enum):
    """The ``--help`` section an option is listed in."""

    MAIN = ""
    ROUTING = "routing"
    HEALTH = "health checks"
    TIMEOUTS = "timeouts and connections"


class Rule(enum.Enum):
    """What a value must meet (the value is the rule as :class:`ConfigError` says it)."""

    ANY = ""
    POSITIVE = "must be > 0"
    NON_NEGATIVE = "must be >= 0"
    PORT = "must be in 0..65535"
    SOME = "needs at least one instance"


@dataclasses.dataclass(frozen=True)
class Opt:
    """How one :class:`ProxyConfig` field is offered and checked.

    Attributes:
        help: The ``--help`` text (for a ``--no-<name>`` flag: what the flag does).
        group: The ``--help`` section.
        rule: What the value must meet (:meth:`ProxyConfig.validate`).
        cli: False for a field only settable from Python (no flag).
    """

    help: str
    group: Group = Group.MAIN
    rule: Rule = Rule.ANY
    cli: bool = True


_G = Group
_R = Rule


class ProxyConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Everything ``kvxfer proxy`` can be told; each field is one CLI flag.

    ``mode``: pull sends prefill first, then decode with prefill's
    ``kv_transfer_params``; push registers decode first, then prefill writes into it.
    ``health_interval_s`` 0 disables checks (every instance then counts as healthy).
    ``upstream_keepalive_s`` must stay below the engines' keep-alive (vLLM's
    ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default) or a reused connection meets a
    reset; ``keepalive_timeout_s`` above any client or load balancer idle timeout
    (llm-d's is 90 s). The other fields are described by their :class:`Opt` help.
    """

    prefill: Annotated[
        tuple[str, ...], Opt("prefill instance(s), http://HOST:PORT; repeatable")
    ] = ()
    decode: Annotated[
        tuple[str, ...],
        Opt("decode instance(s), http://HOST:PORT; repeatable (at least one)", rule=_R.SOME),
    ] = ()
    host: Annotated[str, Opt("address to listen on")] = "127.0.0.1"
    port: Annotated[int, Opt("port to listen on", rule=_R.PORT)] = 8000
    mode: Annotated[
        Direction,
        Opt("pull: prefill, then decode pulls; push: decode registered first, prefill writes"),
    ] = Direction.PULL
    short_prompt_tokens: Annotated[
        int,
        Opt(
            "prompts under this many (estimated) tokens skip P/D; 0 disables",
            _G.ROUTING,
            _R.NON_NEGATIVE,
        ),
    ] = 0
    prefill_fallback: Annotated[
        bool,
        Opt("with no healthy prefill instance answer 503 instead of decode-only", _G.ROUTING),
    ] = True
    chars_per_token: Annotated[
        float, Opt("token estimate without a tokenizer", _G.ROUTING, _R.POSITIVE)
    ] = 4.0
    tokenizer: Annotated[
        str | None, Opt("tokenizer.json (or its directory) for exact counts", _G.ROUTING)
    ] = None
    prefix_affinity: Annotated[bool, Opt("route prefill by load alone", _G.ROUTING)] = True
    affinity_block_chars: Annotated[
        int, Opt("characters per prefix-affinity block", _G.ROUTING, _R.POSITIVE)
    ] = 256
    affinity_max_blocks: Annotated[
        int, Opt("leading blocks hashed per prompt", _G.ROUTING, _R.POSITIVE)
    ] = 64
    affinity_capacity: Annotated[
        int, Opt("prefix keys remembered (LRU)", _G.ROUTING, _R.POSITIVE)
    ] = 65536
    affinity_slack_tokens: Annotated[
        int,
        Opt(
            "extra outstanding tokens an affine prefill instance may carry and still win",
            _G.ROUTING,
            _R.NON_NEGATIVE,
        ),
    ] = 4096
    health_interval_s: Annotated[
        float,
        Opt("seconds between GET /health rounds; 0 disables", _G.HEALTH, _R.NON_NEGATIVE),
    ] = 2.0
    health_timeout_s: Annotated[float, Opt("seconds per check", _G.HEALTH, _R.POSITIVE)] = 5.0
    health_fall: Annotated[
        int, Opt("failed checks that take an instance out", _G.HEALTH, _R.POSITIVE)
    ] = 2
    health_rise: Annotated[int, Opt("passed checks that put it back", _G.HEALTH, _R.POSITIVE)] = 1
    connect_timeout_s: Annotated[
        float, Opt("TCP connect timeout toward instances (s)", _G.TIMEOUTS, _R.POSITIVE)
    ] = 5.0
    prefill_timeout_s: Annotated[
        float, Opt("whole prefill request (s)", _G.TIMEOUTS, _R.POSITIVE)
    ] = 300.0
    decode_timeout_s: Annotated[
        float,
        Opt("longest wait for decode's first byte or next chunk (s)", _G.TIMEOUTS, _R.POSITIVE),
    ] = 300.0
    retries: Annotated[
        int,
        Opt("re-sends after a connection failure (pull mode)", _G.TIMEOUTS, _R.NON_NEGATIVE),
    ] = 1
    push_gate_s: Annotated[
        float,
        Opt(
            "push: longest wait for decode's request before prefill's (s)",
            _G.TIMEOUTS,
            _R.NON_NEGATIVE,
        ),
    ] = 0.5
    keepalive_timeout_s: Annotated[
        float,
        Opt(
            "idle keep-alive of client connections (s); keep above any LB idle timeout",
            _G.TIMEOUTS,
            _R.POSITIVE,
        ),
    ] = 120.0
    upstream_keepalive_s: Annotated[
        float,
        Opt(
            "reuse idle connections to instances this long (s); keep below the engines' "
            "keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default)",
            _G.TIMEOUTS,
            _R.POSITIVE,
        ),
    ] = 4.0
    max_connections: Annotated[
        int, Opt("cap on connections to instances; 0 = none", _G.TIMEOUTS, _R.NON_NEGATIVE)
    ] = 0
    shutdown_grace_s: Annotated[
        float,
        Opt(
            "on SIGINT/SIGTERM, let in-flight requests finish this long (s)",
            _G.TIMEOUTS,
            _R.NON_NEGATIVE,
        ),
    ] = 10.0
    max_body_bytes: Annotated[
        int, Opt("largest client request body accepted", rule=_R.POSITIVE, cli=False)
    ] = 64 * 1024 * 1024

    def validate(self) -> None:
        """Check every field against its :class:`Opt` rule; URLs must be distinct.

        Raises:
            ConfigError: Naming the key, the value and the rule broken.
        """
        for field, opt, kind in options():
            value = getattr(self, field.name)
            if kind is tuple:
                urls = [normalize_url(u) for u in value]
                if len(set(urls)) != len(urls):
                    raise ConfigError(field.name, list(value), "URLs must be distinct")
            if not _meets(opt.rule, value):
                shown = list(value) if kind is tuple else value
                raise ConfigError(field.name, shown, opt.rule.value)


def _meets(rule: Rule, value: Any) -> bool:
    if rule is Rule.POSITIVE:
        return bool(value > 0)
    if rule is Rule.NON_NEGATIVE:
        return bool(value >= 0)
    if rule is Rule.PORT:
        return bool(0 <= value <= 65535)
    if rule is Rule.SOME:
        return bool(value)
    return True


def options() -> Iterator[tuple[msgspec.structs.FieldInfo, Opt, type]]:
    """Every :class:`ProxyConfig` field with its :class:`Opt` and its plain type
    (``tuple`` for URL lists, ``str`` for an optional string)."""
    for field in msgspec.structs.fields(ProxyConfig):
        base, opt = typing.get_args(field.type)
        origin = typing.get_origin(base)
        if origin is tuple:
            kind: type = tuple
        elif isinstance(base, type):
            kind = base
        else:  # str | None
            kind = str
        yield field, opt, kind


def _flag(name: str) -> str:
    return "--" + name.removesuffix("_s").replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvxfer proxy`` argument parser, one flag per :class:`ProxyConfig` field."""
    p = argparse.ArgumentParser(
        prog="kvxfer proxy",
        description="A prefill/decode proxy in front of vLLM instances (OpenAI API).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups: dict[Group, Any] = {Group.MAIN: p}
    for field, opt, kind in options():
        if not opt.cli:
            continue
        if opt.group not in groups:
            groups[opt.group] = p.add_argument_group(opt.group.value)
        add = groups[opt.group].add_argument
        flag, dest = _flag(field.name), field.name
        if kind is tuple:
            add(
                flag,
                dest=dest,
                nargs="+",
                action="extend",
                default=[],
                metavar="URL",
                help=opt.help,
            )
        elif kind is bool:
            add("--no-" + flag[2:], dest=dest, action="store_false", help=opt.help)
        elif issubclass(kind, enum.Enum):
            choices = [m.value for m in kind]
            add(flag, dest=dest, choices=choices, default=field.default.value, help=opt.help)
        elif field.default is None:
            add(flag, dest=dest, help=opt.help)
        else:
            metavar = flag[2:].replace("-", "_").upper()
            add(flag, dest=dest, type=kind, default=field.default, metavar=metavar, help=opt.help)
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    return p


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The :class:`ProxyConfig` behind parsed CLI arguments (validated).

    Raises:
        ConfigError: A value breaks a rule.
    """
    values: dict[str, Any] = {}
    for field, opt, kind in options():
        if not opt.cli:
            continue
        value = getattr(args, field.name)
        if kind is tuple:
            value = tuple(normalize_url(u) for u in value)
        elif issubclass(kind, enum.Enum):
            value = kind(value)
        values[field.name] = value
    config = ProxyConfig(**values)
    config.validate()
    return config


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
