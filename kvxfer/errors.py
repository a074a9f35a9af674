"""The kvxfer error tree.

Every error kvxfer raises derives from :class:`KvxferError`. Subclasses mix in the
builtin a caller would naturally catch (``ValueError`` for bad input, ``TimeoutError``
for deadlines, ``ConnectionError`` for peers, ``LookupError`` for unknown names), so
code that already handles builtins keeps working::

    KvxferError
    ├── ConfigError (ValueError)            a config key has a bad value
    ├── LayoutError (ValueError)            a KV layout is malformed
    │   └── LayoutMismatch                  two layouts differ (names the first field)
    ├── PlanError (ValueError)              block lists / requests that cannot be planned
    ├── WireError (ValueError)              a side-channel message could not be decoded
    │   └── ProtocolVersionError            the peer speaks another protocol version
    ├── CompatError                         compatibility hashes differ
    ├── HandshakeError (ConnectionError)    the side-channel handshake failed
    │   ├── HandshakeRejected               the peer answered with a rejection
    │   └── HandshakeTimeout (TimeoutError) no answer within the deadline
    ├── AuthError                           side-channel authentication failed
    ├── PeerError (ConnectionError)         a peer is unknown, gone or restarted
    ├── TransferError                       a transfer did not land
    │   └── TransferTimeout (TimeoutError)  a transfer exceeded its deadline
    ├── LeaseError (LookupError)            no lease for that request
    ├── RegistrationError                   memory (de)registration failed
    ├── BackendError                        a backend failed or cannot be loaded
    │   ├── BackendNotFound (LookupError)   no backend of that name
    │   ├── DuplicateBackend                two packages claim one backend name
    │   └── MissingDependency (ImportError) an optional dependency is not installed
    └── RailError                           no usable data-plane NIC / link lost
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AuthError",
    "BackendError",
    "BackendNotFound",
    "CompatError",
    "ConfigError",
    "DuplicateBackend",
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeTimeout",
    "KvxferError",
    "LayoutError",
    "LayoutMismatch",
    "LeaseError",
    "MissingDependency",
    "PeerError",
    "PlanError",
    "ProtocolVersionError",
    "RailError",
    "RegistrationError",
    "TransferError",
    "TransferTimeout",
    "WireError",
    "missing_dependency",
]


class KvxferError(Exception):
    """Root of every error raised by kvxfer."""


class ConfigError(KvxferError, ValueError):
    """A configuration key has a value that breaks a rule.

    The message always names the key, the offending value and the rule.
    """

    def __init__(self, key: str, value: Any, rule: str) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        super().__init__(f"{key}={value!r}: {rule}")


class LayoutError(KvxferError, ValueError):
    """A KV layout is malformed (bad region, shard or group description)."""


class LayoutMismatch(LayoutError):
    """Two layouts differ; ``field`` names the first differing field."""

    def __init__(self, field: str, local: Any, remote: Any) -> None:
        self.field = field
        self.local = local
        self.remote = remote
        super().__init__(f"KV layout mismatch at {field}: local={local!r} remote={remote!r}")


class PlanError(KvxferError, ValueError):
    """A request's block lists cannot be turned into a transfer plan."""


class WireError(KvxferError, ValueError):
    """A side-channel message is malformed, oversized or of an unknown type."""


class ProtocolVersionError(WireError):
    """The peer speaks a kvxfer protocol version this build does not."""


class CompatError(KvxferError):
    """The compatibility hashes of two instances differ."""


class HandshakeError(KvxferError, ConnectionError):
    """The side-channel handshake with a peer failed."""


class HandshakeRejected(HandshakeError):
    """The peer answered the handshake with a rejection."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"handshake rejected ({code}): {reason}")


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The peer did not answer the handshake before the deadline."""


class AuthError(KvxferError):
    """Side-channel authentication failed or is misconfigured."""


class PeerError(KvxferError, ConnectionError):
    """A peer is unknown, unreachable, gone or has restarted."""


class TransferError(KvxferError):
    """A transfer failed; ``invalid_blocks`` are the local blocks that did not land."""

    def __init__(self, message: str, invalid_blocks: tuple[int, ...] = ()) -> None:
        self.invalid_blocks = invalid_blocks
        super().__init__(message)


class TransferTimeout(TransferError, TimeoutError):
    """A transfer did not complete before its deadline."""


class LeaseError(KvxferError, LookupError):
    """No lease is held for that request."""


class RegistrationError(KvxferError):
    """Registering or deregistering memory failed."""


class BackendError(KvxferError):
    """A backend failed, or could not be loaded."""


class BackendNotFound(BackendError, LookupError):
    """No backend is registered under that name."""


class DuplicateBackend(BackendError):
    """Two distributions register a backend under the same name."""


class MissingDependency(BackendError, ImportError):
    """An optional dependency is missing; the message carries the install hint."""


class RailError(KvxferError):
    """No usable data-plane NIC, or every local link is down."""


def missing_dependency(
    module: str, extra: str, exc: BaseException | None = None
) -> MissingDependency:
    """Build the error raised when an optional dependency cannot be imported."""
    detail = f" ({exc})" if exc is not None else ""
    return MissingDependency(
        f"{module} is required for this feature but could not be imported{detail}; "
        f"install it with: pip install 'kvxfer[{extra}]'"
    )
