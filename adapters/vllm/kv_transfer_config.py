"""The vLLM adapter's configuration: vLLM's ``kv_transfer_config`` parsed and checked.

:func:`parse_kv_transfer_config` turns the dict an operator passes with
``--kv-transfer-config`` into a frozen :class:`TransferConfig`. Every rule breach is a
:class:`~kvxfer.errors.ConfigError` naming the key (dotted for nested keys, e.g.
``kv_connector_extra_config.stripe_width``), the value and the rule. Types are strict:
a bool is not an int, an int is not a bool, a string is not a number.

Keys kvxfer does not own are never rejected: ``kv_connector_extra_config`` is shared
with the upstream NIXL connector and the top level carries vLLM's own keys
(``kv_connector_module_path``, ``kv_port``, ...). They are kept, untouched, in
:attr:`TransferConfig.passthrough` and :attr:`TransferConfig.extra_passthrough`.
"""

from __future__ import annotations

import difflib
import enum
import json
import logging
import math
from collections.abc import Mapping
from typing import Any, Final, TypeVar

import msgspec

from kvxfer.core.descriptors import PlanOptions
from kvxfer.errors import ConfigError
from kvxfer.types import MAX_ENGINE_ID_LEN, Direction, Role, posts

__all__ = [
    "CONNECTORS",
    "BufferDevice",
    "PeerAddress",
    "TransferConfig",
    "parse_kv_transfer_config",
]

_log = logging.getLogger("kvxfer.adapters.vllm.kv_transfer_config")


class BufferDevice(enum.Enum):
    """Where registered KV memory lives: device-to-device or host bounce."""

    RBLN = "rbln"
    CPU = "cpu"


class PeerAddress(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A peer instance to connect to at start-up (``connect_ahead``): its rank 0's
    side-channel address (rank *p* at ``port + p``), its TP size and, optionally, the
    engine id it must have.

    With ``refresh_s`` over 0, ``host`` names a set of instances (a headless Service):
    each address it resolves to is one instance, connected by that address, and the
    name is resolved again every ``refresh_s`` seconds (:mod:`kvxfer.adapters.vllm.ahead`).
    """

    host: str
    port: int
    tp_size: int = 1
    engine_id: str | None = None
    refresh_s: float = 0.0


#: Connector class names accepted in ``kv_connector`` and the direction each implies.
#: ``RblnNixlConnector`` stays as an alias of the pull connector for existing deployments.
CONNECTORS: Final[Mapping[str, Direction]] = {
    "RblnNixlPullConnector": Direction.PULL,
    "RblnNixlConnector": Direction.PULL,
    "RblnNixlPushConnector": Direction.PUSH,
}

_EXTRA = "kv_connector_extra_config"
#: The longest ``connect_ahead[i].refresh_s``: a name resolved less often than hourly
#: would miss the instances a day of scaling brings.
_MAX_REFRESH_S = 3600.0
# Top-level keys this module reads; everything else at the top level is vLLM's.
_OWN_TOP: Final = frozenset({"kv_connector", "kv_role", "kv_buffer_device", "engine_id", _EXTRA})
_OWN_EXTRA: Final = (
    "swa_window_mode",
    "chunk_mode",
    "chunk_tokens",
    "push_stream",
    "stripe_width",
    "link_down_exit_s",
    "enforce_handshake_compat",
    "head_regions",
    "connect_ahead",
)
_D2D_ONLY = (
    "device-to-device only: host bounce (kv_buffer_device 'cpu') registers one full "
    "buffer per layer, so descriptors cannot be cut"
)


class TransferConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The connector configuration, validated.

    Attributes:
        connector: The ``kv_connector`` name as given.
        direction: Pull or push, implied by the connector name.
        role: ``kv_role``.
        buffer_device: ``kv_buffer_device``: RBLN (device-to-device) or CPU (host bounce).
        engine_id: This instance's engine id, or None to let the engine pick one.
        swa_window_mode: Send only the window granules of sliding-window groups.
        chunk_mode: Cut blocks into chunks; of the last block only chunks with tokens go.
        chunk_tokens: Lower bound of the chunk size in tokens; None means one prefill step.
        push_stream: Push each block as prefill closes it (push, device-to-device only).
        stripe_width: None uses the backend default of one rail per transfer; 0 opens
            connections on every rail both instances share.
        link_down_exit_s: Exit after losing every local link for this long; 0 never exits.
        enforce_handshake_compat: Check the compatibility hash in the handshake.
        head_regions: Describe a head-major cache one region per (layer, KV head);
            None: only when this instance's tensor_parallel_size is over 1. No longer
            needed by pairs across TP sizes (they are cut per head at the handshake,
            kvxfer.core.heads.pairing_heads); still accepted: it only sets how many
            descriptors requests post (true on a TP1 instance multiplies those of
            equal-TP pairs by the KV heads, and logs a warning saying so).
        connect_ahead: Peer instances this one posts to (a pull's consumer: its
            producers; a push's producer: its consumers), connected at start-up in the
            background so that the first request finds the handshakes done: a list of
            ``{"host", "port", "tp_size", "engine_id", "refresh_s"}`` objects (port:
            rank 0's side-channel port, the one tickets name; tp_size default 1;
            refresh_s over 0: host names several instances, each address it
            resolves to connected, the name resolved again that often).
        passthrough: Top-level keys kvxfer does not own (vLLM's), untouched.
        extra_passthrough: ``kv_connector_extra_config`` keys kvxfer does not own
            (the upstream NIXL connector's), untouched.
    """

    connector: str = "RblnNixlPullConnector"
    direction: Direction = Direction.PULL
    role: Role
    buffer_device: BufferDevice = BufferDevice.RBLN
    engine_id: str | None = None
    swa_window_mode: bool = False
    chunk_mode: bool = False
    chunk_tokens: int | None = None
    push_stream: bool = False
    stripe_width: int | None = None
    link_down_exit_s: float = 0.0
    enforce_handshake_compat: bool = True
    head_regions: bool | None = None
    connect_ahead: tuple[PeerAddress, ...] = ()
    passthrough: dict[str, Any] = msgspec.field(default_factory=dict)
    extra_passthrough: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # The rules live here, not in the parser, so a directly built config obeys them too.
        if CONNECTORS.get(self.connector) is not self.direction:
            raise ConfigError(
                "kv_connector", self.connector, f"does not name a {self.direction} connector"
            )
        if not isinstance(self.role, Role):
            raise ConfigError("kv_role", self.role, _one_of(Role, "must be a Role:"))
        if not isinstance(self.buffer_device, BufferDevice):
            raise ConfigError(
                "kv_buffer_device",
                self.buffer_device,
                _one_of(BufferDevice, "must be a BufferDevice:"),
            )
        engine_id = self.engine_id
        if engine_id is not None and (
            not isinstance(engine_id, str) or not 0 < len(engine_id) <= MAX_ENGINE_ID_LEN
        ):
            raise ConfigError(
                "engine_id",
                engine_id,
                f"must be null or a non-empty string of at most {MAX_ENGINE_ID_LEN} characters",
            )
        for key in ("swa_window_mode", "chunk_mode", "push_stream", "enforce_handshake_compat"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{_EXTRA}.{key}", getattr(self, key), "must be a bool")
        if self.head_regions is not None and not isinstance(self.head_regions, bool):
            raise ConfigError(f"{_EXTRA}.head_regions", self.head_regions, "must be a bool or null")
        self._check_counts()
        self._check_combinations()
        msgspec.structs.force_setattr(self, "connect_ahead", self._peer_addresses())
        if _is_int(self.link_down_exit_s):  # JSON `5` means 5.0 s; keep the field a float
            msgspec.structs.force_setattr(self, "link_down_exit_s", float(self.link_down_exit_s))

    def _check_counts(self) -> None:
        tokens = self.chunk_tokens
        if tokens is not None:
            if not _is_int(tokens) or tokens <= 0:
                raise ConfigError(f"{_EXTRA}.chunk_tokens", tokens, "must be an int > 0 or null")
            if not self.chunk_mode:
                # Silently ignoring it would let an operator believe chunking is on.
                raise ConfigError(
                    f"{_EXTRA}.chunk_tokens", tokens, "only applies with chunk_mode true"
                )
        width = self.stripe_width
        if width is not None and (not _is_int(width) or width != 0):
            raise ConfigError(
                f"{_EXTRA}.stripe_width",
                width,
                "must be unset (the backend's default: one rail per transfer) or 0 "
                "(every rail both instances share); other widths are not supported",
            )
        exit_s = self.link_down_exit_s
        if not _is_number(exit_s) or not math.isfinite(exit_s) or exit_s < 0:
            raise ConfigError(f"{_EXTRA}.link_down_exit_s", exit_s, "must be a finite number >= 0")

    def _check_combinations(self) -> None:
        if self.link_down_exit_s > 0 and self.role is not Role.PRODUCER:
            raise ConfigError(
                f"{_EXTRA}.link_down_exit_s",
                self.link_down_exit_s,
                f"only valid with kv_role {Role.PRODUCER.value!r} (kv_role is "
                f"{self.role.value!r}): decode instances are replaced from outside while "
                "keeping their in-flight requests, so they must not exit on their own",
            )
        if self.buffer_device is BufferDevice.CPU:
            for key in ("chunk_mode", "swa_window_mode", "push_stream"):
                if getattr(self, key):
                    raise ConfigError(f"{_EXTRA}.{key}", True, _D2D_ONLY)
        if self.push_stream and self.direction is not Direction.PUSH:
            raise ConfigError(
                f"{_EXTRA}.push_stream",
                True,
                "push direction only: use kv_connector 'RblnNixlPushConnector'",
            )

    def _peer_addresses(self) -> tuple[PeerAddress, ...]:
        key, value = f"{_EXTRA}.connect_ahead", self.connect_ahead
        if not isinstance(value, list | tuple):
            raise ConfigError(key, value, "must be a list of {host, port, tp_size} objects")
        if value and not posts(self.role, self.direction):
            raise ConfigError(
                key,
                list(value),
                f"a {self.direction.value} {self.role.value} never posts: the instances "
                "that do connect to it",
            )
        out: list[PeerAddress] = []
        item: Any
        for i, item in enumerate(value):
            where = f"{key}[{i}]"
            if isinstance(item, PeerAddress):  # built directly: checked as its fields
                item = msgspec.structs.asdict(item)
            if not isinstance(item, Mapping):
                raise ConfigError(where, item, "must be a {host, port, tp_size} object")
            for field, ok, rule in (
                ("host", lambda v: isinstance(v, str) and v != "", "must be a non-empty string"),
                ("port", lambda v: _is_int(v) and 0 < v < 65536, "must be an int in [1, 65535]"),
                ("tp_size", lambda v: _is_int(v) and v > 0, "must be an int > 0"),
                (
                    "engine_id",
                    lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= MAX_ENGINE_ID_LEN),
                    f"must be null or a non-empty string of at most {MAX_ENGINE_ID_LEN} characters",
                ),
                (
                    "refresh_s",
                    lambda v: _is_number(v) and (v == 0 or 1 <= v <= _MAX_REFRESH_S),
                    f"must be 0 (connect to the host as named) or seconds in [1, "
                    f"{_MAX_REFRESH_S:.0f}] between resolutions of the name",
                ),
            ):
                if field in item and not ok(item[field]):
                    raise ConfigError(f"{where}.{field}", item[field], rule)
            unknown = sorted(set(item) - set(PeerAddress.__struct_fields__))
            if unknown:
                raise ConfigError(
                    f"{where}.{unknown[0]}",
                    item[unknown[0]],
                    "unknown key; use host, port, tp_size, engine_id, refresh_s",
                )
            if item.get("refresh_s") and item.get("engine_id") is not None:
                raise ConfigError(
                    f"{where}.engine_id",
                    item["engine_id"],
                    "must be null with refresh_s: the name stands for several instances, "
                    "each with an engine id of its own",
                )
            for field in ("host", "port"):
                if field not in item:
                    raise ConfigError(f"{where}.{field}", None, "is required")
            # JSON `10` means 10.0 s: keep the field a float.
            out.append(PeerAddress(**{**item, "refresh_s": float(item.get("refresh_s", 0.0))}))
        return tuple(out)

    @property
    def device_to_device(self) -> bool:
        """True when KV moves between device memories (``kv_buffer_device: rbln``)."""
        return self.buffer_device is BufferDevice.RBLN

    @property
    def all_rails(self) -> bool:
        """True when ``stripe_width: 0`` asks for every rail both instances share."""
        return self.stripe_width == 0

    def plan_options(self, prefill_step_tokens: int | None) -> PlanOptions:
        """Return the descriptor plan options, checked against the prefill step.

        Args:
            prefill_step_tokens: Tokens one prefill step can close (vLLM's
                ``max_num_batched_tokens``). Required when ``chunk_mode`` is on.

        Raises:
            ConfigError: ``chunk_tokens`` is below one prefill step (a step must close
                at most one chunk), or the step size is missing or not a positive int.
        """
        step_key = "max_num_batched_tokens"
        if prefill_step_tokens is None:
            if self.chunk_mode:
                raise ConfigError(step_key, None, "chunk_mode needs the prefill step size")
        elif not _is_int(prefill_step_tokens) or prefill_step_tokens <= 0:
            raise ConfigError(step_key, prefill_step_tokens, "must be an int > 0")
        if (
            self.chunk_tokens is not None
            and prefill_step_tokens is not None
            and self.chunk_tokens < prefill_step_tokens
        ):
            raise ConfigError(
                f"{_EXTRA}.chunk_tokens",
                self.chunk_tokens,
                f"must be at least one prefill step (max_num_batched_tokens="
                f"{prefill_step_tokens}): a step must close at most one chunk",
            )
        return PlanOptions(
            chunk_mode=self.chunk_mode,
            chunk_tokens=self.chunk_tokens,
            prefill_step_tokens=prefill_step_tokens,
            swa_window_mode=self.swa_window_mode,
        )


def parse_kv_transfer_config(config: Mapping[str, Any] | str | bytes) -> TransferConfig:
    """Validate a ``kv_transfer_config`` and return the typed configuration.

    Args:
        config: The mapping (vLLM's ``kv_transfer_config`` as a dict) or its JSON text,
            as passed to ``--kv-transfer-config``.

    Returns:
        The frozen configuration; unknown keys are kept in the passthrough mappings.

    Raises:
        ConfigError: A key is missing, has the wrong type, or breaks a rule. The error
            names the key, the value and the rule.
    """
    if isinstance(config, str | bytes):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise ConfigError("kv_transfer_config", config, f"is not valid JSON: {exc}") from exc
    if not isinstance(config, Mapping):
        raise ConfigError("kv_transfer_config", config, "must be a mapping (JSON object)")

    connector = config.get("kv_connector")
    if not isinstance(connector, str) or connector not in CONNECTORS:
        accepted = ", ".join(CONNECTORS)
        raise ConfigError("kv_connector", connector, f"must be one of: {accepted}")
    direction = CONNECTORS[connector]

    role_value = config.get("kv_role")
    if role_value is None:
        raise ConfigError("kv_role", None, _one_of(Role, "is required"))
    role = _enum(Role, "kv_role", role_value)

    buffer_device = _buffer_device(config.get("kv_buffer_device"))

    engine_id = config.get("engine_id")
    extra = config.get(_EXTRA)
    if extra is None:
        extra = {}
    elif not isinstance(extra, Mapping):
        raise ConfigError(_EXTRA, extra, "must be a mapping (JSON object)")
    extra_passthrough = {k: v for k, v in extra.items() if k not in _OWN_EXTRA}
    _warn_near_misses(extra_passthrough)

    # Absent keys keep the defaults; present ones go in as given and are checked there.
    options = {key: extra[key] for key in _OWN_EXTRA if key in extra}
    return TransferConfig(
        connector=connector,
        direction=direction,
        role=role,
        buffer_device=buffer_device,
        engine_id=engine_id,
        passthrough={k: v for k, v in config.items() if k not in _OWN_TOP},
        extra_passthrough=extra_passthrough,
        **options,
    )


def _buffer_device(value: Any) -> BufferDevice:
    if value is None:
        return BufferDevice.RBLN
    if value == "cuda":
        # vLLM's own KVTransferConfig defaults to "cuda"; say so instead of a bare "no".
        raise ConfigError(
            "kv_buffer_device",
            value,
            "'cuda' is vLLM's default, not an RBLN buffer: set kv_buffer_device "
            "explicitly to 'rbln' (device-to-device) or 'cpu' (host bounce)",
        )
    return _enum(BufferDevice, "kv_buffer_device", value)


def _warn_near_misses(unknown: Mapping[str, Any]) -> None:
    # Unknown keys may be upstream's, so they pass; a near miss of ours is likely a typo.
    for key in unknown:
        if isinstance(key, str):
            close = difflib.get_close_matches(key, _OWN_EXTRA, n=1, cutoff=0.85)
            if close:
                _log.warning(
                    "%s.%s is not a kvxfer key and is passed through; did you mean %r?",
                    _EXTRA,
                    key,
                    close[0],
                )


_E = TypeVar("_E", bound=enum.Enum)


def _enum(cls: type[_E], key: str, value: Any) -> _E:
    if isinstance(value, str):
        for member in cls:
            if member.value == value:
                return member
    raise ConfigError(key, value, _one_of(cls, "must be"))


def _one_of(cls: type[enum.Enum], prefix: str) -> str:
    return f"{prefix} one of: " + ", ".join(repr(m.value) for m in cls)


def _is_int(value: Any) -> bool:
    # bool subclasses int, but `true` for a count is a mistake, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)
