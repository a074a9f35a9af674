"""The NIXL edge: the one module that calls NIXL's Python API and reads its failures.

* :func:`import_nixl` imports NIXL or raises the install hint;
* :func:`nixl_error` and :func:`map_nixl_errors` turn what NIXL (or an adapter built
  on it) raises into the most specific :mod:`kvxfer.errors` class, chained with
  ``raise ... from``; no other module classifies NIXL failures;
* :class:`NixlEndpoint` is what a kvxfer NIXL backend drives: one data-plane endpoint
  (the nixl-rbln adapter's agents implement it too);
* :class:`PluginAgent` is that endpoint on a ``nixl_agent`` with one backend plugin,
  made by :func:`start_plugin_agent` (``ucx`` uses NIXL's UCX plugin, nixl-rbln its
  ``"RBLN"`` plugin).

How failures map (:func:`nixl_error`), by what NIXL raised and what the call was doing
(:class:`NixlCall`):

=============================  =============================================
NIXL raises                    kvxfer raises
=============================  =============================================
``nixlRemoteDisconnectError``  :class:`~kvxfer.errors.PeerError`
``nixlNotFoundError``          :class:`~kvxfer.errors.PeerError` in a call that
                               names a peer (an unknown remote); else the call's class
``nixlCancelledError``         :class:`~kvxfer.errors.TransferError`
anything else                  the call's class: :class:`~kvxfer.errors.RegistrationError`
                               (memory), :class:`~kvxfer.errors.PeerError` (peers,
                               notifications), :class:`~kvxfer.errors.BackendError`
                               (start, post, poll, release): invalid parameters,
                               plugin faults, ``nixl._api``'s own ``KeyError`` or
                               ``RuntimeError``, an adapter's own exceptions
=============================  =============================================

A :class:`~kvxfer.errors.KvxferError` passes unchanged; an exception that is not an
``Exception`` (``KeyboardInterrupt``, ``SystemExit``) passes untouched. Everything
else is wrapped, never passed raw: a backend method raises kvxfer errors only.

The post and poll paths call :func:`nixl_error` from a plain ``try``/``except`` (free
when nothing fails) instead of entering :func:`map_nixl_errors`, whose ``with`` costs
two method calls per transfer or poll.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvxfer.backend import XferOp, XferStatus
from kvxfer.core.layout import MemKind
from kvxfer.errors import (
    BackendError,
    ConfigError,
    KvxferError,
    PeerError,
    RegistrationError,
    TransferError,
    missing_dependency,
)

__all__ = [
    "CUDA_IPC_GET_ZCOPY",
    "LIST_WRITES",
    "STALL_LIMIT",
    "NixlCall",
    "NixlEndpoint",
    "NixlErrorMap",
    "PluginAgent",
    "RunsEndpoint",
    "import_nixl",
    "list_writes",
    "map_nixl_errors",
    "nixl_error",
    "stall_limit",
    "start_plugin_agent",
    "ucx_defaults",
]


#: UCX's TCP keepalive for kvxfer's agents (see :func:`import_nixl`).
_UCX_TCP_KEEPALIVE = {"UCX_TCP_KEEPIDLE": "2s", "UCX_TCP_KEEPINTVL": "1s", "UCX_TCP_KEEPCNT": "3"}

#: UCX's TCP_USER_TIMEOUT for its sockets (see :func:`stall_limit`).
STALL_LIMIT = "UCX_TCP_USER_TIMEOUT"
# One agent's creation at a time changes the environment UCX reads.
_environ_lock = threading.Lock()

#: Where the NVIDIA driver lists this host's GPUs (one entry each).
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
#: UCX's switch for cuda_ipc GETs (see :func:`ucx_defaults`).
CUDA_IPC_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


#: NIXL's switch for list writes (docs/OPERATIONS.md, "UCX list writes"): set, the UCX
#: backend posts a WRITE's descriptors as one UCX put of a scatter-gather list.
LIST_WRITES = "NIXL_UCX_SGL_ENABLE"
# How NIXL reads a boolean setting (its configTraits<bool>; case does not matter).
_NIXL_TRUE = ("y", "yes", "on", "1", "true", "enable")
_NIXL_FALSE = ("n", "no", "off", "0", "false", "disable")


def list_writes(environ: Mapping[str, str]) -> bool:
    """Whether NIXL's UCX backend will post each WRITE as one list (``LIST_WRITES``).

    NIXL reads the variable when it creates a UCX backend, as a boolean; a value it
    cannot read makes that creation fail with a bare ``NIXL_ERR_BACKEND``, so kvxfer
    checks it first.

    Raises:
        ConfigError: the variable is set to something NIXL does not read as a boolean.
    """
    value = environ.get(LIST_WRITES)
    if value is None:
        return False
    word = value.lower()  # NIXL compares whole words, ignoring only case
    if word in _NIXL_TRUE:
        return True
    if word in _NIXL_FALSE:
        return False
    raise ConfigError(
        LIST_WRITES,
        value,
        f"NIXL reads it as one word, any case: {', '.join(_NIXL_TRUE)} (on) or "
        f"{', '.join(_NIXL_FALSE)} (off)",
    )


def ucx_defaults(gpus: Path | None = None) -> dict[str, str]:
    """The UCX settings kvxfer's NIXL agents start with unless the operator set them.

    * TCP keepalive (see :func:`import_nixl`).
    * On a host with NVIDIA GPUs, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``. UCX's cuda_ipc
      transport turns GETs off by default on GPUs without active NVLink (concurrent
      reads over PCIe can be slower than writes), and a NIXL READ of GPU memory
      between two processes of one host then goes through host memory over TCP and
      needs the producer's worker to progress. On an H200 (no NVLink peer) a raw NIXL
      READ of 459 MB moved 0.5 GB/s that way, against about 1,000 GB/s for the WRITE
      of the same descriptors over cuda_ipc (docs/PERFORMANCE.md, "GPU memory"). Set
      only where the driver lists a GPU: elsewhere UCX warns that the variable is
      unused.

    Args:
        gpus: the driver's GPU listing to look at (default :data:`NVIDIA_GPUS`).
    """
    out = dict(_UCX_TCP_KEEPALIVE)
    listing = gpus if gpus is not None else NVIDIA_GPUS
    try:
        present = listing.is_dir() and any(listing.iterdir())
    except OSError:
        present = False
    if present:
        out[CUDA_IPC_GET_ZCOPY] = "y"
    return out


@contextlib.contextmanager
def stall_limit(seconds: float | None) -> Iterator[None]:
    """While a NIXL agent is created in it, UCX over TCP ends a connection whose bytes
    stay unacknowledged for ``seconds`` (:attr:`BackendOptions.stall_limit_s
    <kvxfer.backend.BackendOptions.stall_limit_s>`): ``UCX_TCP_USER_TIMEOUT``, which UCX
    reads when it creates the agent's transport.

    Why the writer needs it: NIXL's UCX backend closes a removed peer's endpoint by
    flushing it, so a WRITE's bytes go on after NIXL said it failed; the writer
    therefore waits for the WRITE to end on its own. On a dead link that is when TCP
    gives up, 15 minutes by the kernel's default, and a link that came back resumes it
    only when the backed-off retransmission timer fires (over 90 s later, measured). A
    user timeout bounds both: the kernel ends the socket, and UCX the endpoint, once
    no byte was acknowledged for ``seconds``; the WRITE fails and none of its bytes
    can land any more. A peer that acknowledges, however slowly, keeps its
    connection. A value the operator set wins; ``None`` changes nothing. The variable
    is restored afterwards, so that the process's other agents keep their own.

    The producer announces ``seconds`` to its consumers (:attr:`wire.Ack.stall_limit_s
    <kvxfer.core.wire.Ack.stall_limit_s>`), who wait that long after it died. So an
    operator's own value must not exceed it: a longer one (or one that cannot be read
    as a time) would let a dead producer's bytes land after its consumers stopped
    waiting, and is refused with a :class:`~kvxfer.errors.ConfigError`.

    Raises:
        ConfigError: ``UCX_TCP_USER_TIMEOUT`` is set longer than ``seconds``, or not as
            a time in seconds (``30``, ``30s``, ``500ms``, ``us``, ``ns``)."""
    if seconds is None:
        yield
        return
    own = os.environ.get(STALL_LIMIT)
    if own is not None:
        parsed = _ucx_seconds(own)
        if parsed is None or parsed > seconds:
            raise ConfigError(
                STALL_LIMIT,
                own,
                f"a push producer's must be a time of at most its transfer_timeout_s "
                f"({seconds:g} s, in seconds or ms): its consumers keep a dead producer's "
                "blocks quarantined that long (R-SAFE-5), not for bytes its kernel sends "
                "later; lower it, unset it, or raise transfer_timeout_s",
            )
        yield
        return
    with _environ_lock:
        os.environ[STALL_LIMIT] = f"{max(1, round(seconds * 1000))}ms"
        try:
            yield
        finally:
            os.environ.pop(STALL_LIMIT, None)


_UCX_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _ucx_seconds(text: str) -> float | None:
    """Seconds in a UCX time value (``30``, ``30s``, ``500ms``); None for anything
    else (``inf``, ``auto``, units this reader does not take)."""
    value = text.strip().lower()
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    scale = _UCX_TIME_UNITS.get(value[len(number) :])
    try:
        seconds = float(number)
    except ValueError:
        return None
    if scale is None or not 0 < seconds < float("inf"):
        return None
    return seconds * scale


def import_nixl() -> Any:
    """Import NIXL's Python API: ``(nixl_agent, nixl_agent_config)``.

    Raises:
        MissingDependency: NIXL is not installed (with the ``pip install`` hint).
    """
    # NIXL logs at INFO to stdout (an agent's creation, each backend instantiated):
    # noise in an engine's output. Warnings and errors stay; a NIXL_LOG_LEVEL the
    # user set wins. Read by NIXL's Python logger and its C++ library at import.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # UCX over TCP (hosts without RDMA) notices a dead link only by TCP keepalive, which
    # the kernel's defaults start after 2 hours: a READ or WRITE in flight when a link
    # went down then never ended while it stayed down, and its blocks stayed quarantined
    # (R-SAFE-5). These make UCX fail the endpoint ~4-10 s after the link went quiet
    # (measured across two network namespaces); RDMA transports are unaffected. On a GPU
    # host, READs of GPU memory over cuda_ipc (ucx_defaults). A value the operator set
    # wins; UCX reads them when an agent creates its context.
    for key, value in ucx_defaults().items():
        os.environ.setdefault(key, value)
    module = _nixl_api_module()
    try:
        if module == "nixl._api":
            from nixl._api import nixl_agent, nixl_agent_config
        else:
            api = importlib.import_module(module)
            nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    except ImportError as exc:
        raise missing_dependency("nixl", "nixl", exc) from exc
    return nixl_agent, nixl_agent_config


#: The wheels the ``nixl`` meta package chooses from when no CUDA version picks one, in
#: its order.
_NIXL_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _nixl_api_module() -> str:
    """Where to import NIXL's API from: ``nixl._api``, or the wheel it would pick.

    The ``nixl`` meta package picks its wheel (``nixl_cu12``, ``nixl_cu13``, ...) by the
    CUDA version of the process. Where nothing CUDA is imported yet and torch on disk is
    a CPU build, or absent, it finds none by reading; it then imports torch to ask, gets
    no version either, and takes the first wheel installed. That torch import is ~3 s
    of CPU in every process that only moves bytes (a bench or test child, ``kvxfer
    doctor``, a non-torch engine). In exactly that case this takes the same first wheel
    without importing torch; in every other case the meta package decides.
    """
    if "nixl" in sys.modules or any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy")):
        return "nixl._api"
    if _torch_cuda_on_disk() is not False:
        return "nixl._api"
    for wheel in _NIXL_WHEELS:
        if importlib.util.find_spec(wheel) is not None:
            return f"{wheel}._api"
    return "nixl._api"  # none: the meta package's import raises the error to show


def _torch_cuda_on_disk() -> bool | None:
    """Whether the installed torch was built with CUDA (False also when there is no
    torch), read from its ``version.py`` without importing torch; None if unknown."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return False
    if not spec.origin:
        return None
    try:
        text = Path(spec.origin).with_name("version.py").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        # torch writes e.g. ``cuda: Optional[str] = None`` or ``cuda: Optional[str] = '12.8'``
        if line.startswith("cuda") and "=" in line:
            return line.split("=", 1)[1].strip() != "None"
    return None


# -- failures ---------------------------------------------------------------------------
class NixlCall(enum.Enum):
    """What a NIXL call was doing: picks the kvxfer error its failures become."""

    START = "start"  # creating an agent or its plugin backend; reading its metadata
    REGISTER = "register"  # (de)registering memory, preparing the local descriptors
    PEER = "peer"  # loading or removing a peer, preparing its descriptors
    POST = "post"  # making and posting a transfer
    POLL = "poll"  # a transfer's state, received notifications
    RELEASE = "release"  # releasing a transfer or a prepared list
    NOTIFY = "notify"  # sending a notification


_CALL_ERROR: dict[NixlCall, type[KvxferError]] = {
    NixlCall.START: BackendError,
    NixlCall.REGISTER: RegistrationError,
    NixlCall.PEER: PeerError,
    NixlCall.POST: BackendError,
    NixlCall.POLL: BackendError,
    NixlCall.RELEASE: BackendError,
    NixlCall.NOTIFY: PeerError,
}
#: Calls that name a remote agent: NIXL's "not found" there means an unknown peer.
_PEER_CALLS = frozenset({NixlCall.PEER, NixlCall.POST, NixlCall.NOTIFY})

# NIXL's binding exceptions (nixl_cu12._bindings, nixl_cu13._bindings, ...: one class
# per wheel) are told apart by name; every other one maps by the call alone.
_DISCONNECT = "nixlRemoteDisconnectError"
_NOT_FOUND = "nixlNotFoundError"
_CANCELLED = "nixlCancelledError"


def _nixl_kind(exc: BaseException) -> str | None:
    """Name of the NIXL binding exception ``exc`` is, or None."""
    for cls in type(exc).__mro__:
        if cls.__module__.startswith("nixl"):
            return cls.__name__
    return None


def nixl_error(exc: BaseException, call: NixlCall, what: str) -> KvxferError:
    """The kvxfer error a failed NIXL call stands for (see the module docstring).

    Args:
        exc: What the call raised.
        call: What it was doing.
        what: The action, for the message ("NIXL plugin UCX: READ to peer p").

    Returns:
        ``exc`` itself when it is a kvxfer error already, else a new error whose
        message names the action and NIXL's own error; raise it ``from exc``.
    """
    if isinstance(exc, KvxferError):
        return exc
    kind = _nixl_kind(exc)
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if kind == _DISCONNECT:
        return PeerError(f"{what}: the peer disconnected ({detail})")
    if kind == _NOT_FOUND and call in _PEER_CALLS:
        return PeerError(f"{what}: NIXL does not know the peer ({detail})")
    if kind == _CANCELLED:
        return TransferError(f"{what}: the transfer was cancelled ({detail})")
    return _CALL_ERROR[call](f"{what}: {detail}")


class NixlErrorMap:
    """What :func:`map_nixl_errors` returns: the context manager itself."""

    __slots__ = ("call", "what")

    def __init__(self, call: NixlCall, what: str) -> None:
        self.call = call
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or isinstance(exc, KvxferError) or not isinstance(exc, Exception):
            return
        raise nixl_error(exc, self.call, self.what) from exc


def map_nixl_errors(call: NixlCall, what: str) -> NixlErrorMap:
    """Context manager: a failure inside becomes :func:`nixl_error`'s kvxfer error.

    ``with map_nixl_errors(NixlCall.PEER, "loading a peer"): agent.add_remote(md)``

    Args:
        call: What the calls inside do.
        what: The action, for the message.
    """
    return NixlErrorMap(call, what)


# -- the endpoint -----------------------------------------------------------------------
@runtime_checkable
class NixlEndpoint(Protocol):
    """One data-plane endpoint of a NIXL-style agent (one per kvxfer backend).

    Everything crossing this boundary is a kvxfer type, a number, bytes or a numpy
    array; the endpoint's own handles stay opaque. Methods may raise anything: the
    backend maps failures with :func:`nixl_error` at its edge.
    """

    @property
    def name(self) -> str:
        """The agent's name, as peers see it in notifications."""

    def metadata(self) -> bytes:
        """Connection blob a peer passes to :meth:`add_remote`."""

    def register(self, mem: MemKind, device: int, spans: Sequence[tuple[int, int]]) -> object:
        """Register ``(start, length)`` byte ranges of one device; returns a handle."""

    def deregister(self, registration: object) -> None:
        """Undo one :meth:`register`."""

    def prep_descs(self, agent: str | None, mem: MemKind, descs: npt.NDArray[np.uint64]) -> object:
        """Prepare an ``N×3`` ``(addr, length, device)`` list; ``agent`` None is local."""

    def release_descs(self, prepared: object) -> None:
        """Release a prepared list."""

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""

    def remove_remote(self, agent: str) -> None:
        """Forget a peer and disconnect from it."""

    def post(
        self,
        op: XferOp,
        local: object,
        local_ids: npt.NDArray[np.int64],
        remote: object,
        remote_ids: npt.NDArray[np.int64],
        notification: bytes,
    ) -> object:
        """Create and start one transfer of paired prepared descriptors; returns a handle."""

    def state(self, xfer: object) -> XferStatus:
        """Non-blocking state of a transfer (drives progress)."""

    def release_xfer(self, xfer: object) -> None:
        """Release a transfer handle."""

    def send_notification(self, agent: str, payload: bytes) -> None:
        """Send a message to a peer outside any transfer."""

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications received since the last call, as ``(agent name, payload)``."""

    def close(self) -> None:
        """Release the agent itself (everything else was released before)."""


@runtime_checkable
class RunsEndpoint(Protocol):
    """An endpoint that also posts per-request descriptor lists (optional: an adapter
    without it posts prepared lists only)."""

    def post_runs(
        self,
        op: XferOp,
        local_mem: MemKind,
        local: npt.NDArray[np.uint64],
        agent: str,
        remote_mem: MemKind,
        remote: npt.NDArray[np.uint64],
        notification: bytes,
    ) -> object:
        """Create and start one transfer of ``N×3`` ``(addr, length, device)`` lists
        paired by row, built for this request; returns a handle."""


_OPS = {XferOp.READ: "READ", XferOp.WRITE: "WRITE"}


def _text(name: Any) -> str:
    # NIXL's binding hands agent names back as bytes; kvxfer keys peers by str.
    return name.decode() if isinstance(name, bytes) else str(name)


class PluginAgent:
    """:class:`NixlEndpoint` over a ``nixl._api.nixl_agent`` with one backend plugin.

    A thin shape adapter (kvxfer types in, NIXL's calls out); its NIXL failures reach
    the caller raw, for the backend's edge to map.

    Args:
        agent: The ``nixl_agent``, its plugin backend created.
        plugin: The plugin every call is pinned to (``"UCX"``, ``"RBLN"``).
        mem_names: NIXL memory type of each :class:`~kvxfer.core.layout.MemKind`.
    """

    def __init__(self, agent: Any, plugin: str, mem_names: Mapping[MemKind, str]) -> None:
        self._agent = agent
        self._plugin = plugin
        self._plugins = [plugin]
        self._mem = dict(mem_names)

    @property
    def name(self) -> str:
        return str(self._agent.name)

    def metadata(self) -> bytes:
        blob: bytes = self._agent.get_agent_metadata()
        return blob

    def register(self, mem: MemKind, device: int, spans: Sequence[tuple[int, int]]) -> object:
        descs = [(start, length, device, "") for start, length in spans]
        return self._agent.register_memory(descs, self._mem[mem], self._plugins)

    def deregister(self, registration: object) -> None:
        self._agent.deregister_memory(registration, self._plugins)

    def prep_descs(self, agent: str | None, mem: MemKind, descs: npt.NDArray[np.uint64]) -> object:
        return self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT" if agent is None else agent,
            np.ascontiguousarray(descs, dtype=np.uint64),
            self._mem[mem],
            self._plugins,
        )

    def release_descs(self, prepared: object) -> None:
        prepared.release()  # type: ignore[attr-defined]

    def add_remote(self, metadata: bytes) -> str:
        name = _text(self._agent.add_remote_agent(metadata))
        # Connect now, at the handshake, rather than inside the first transfer: the
        # first request then pays no endpoint set-up (issue 27).
        self._agent.make_connection(name, self._plugins)
        return name

    def remove_remote(self, agent: str) -> None:
        self._agent.remove_remote_agent(agent)

    def post(
        self,
        op: XferOp,
        local: object,
        local_ids: npt.NDArray[np.int64],
        remote: object,
        remote_ids: npt.NDArray[np.int64],
        notification: bytes,
    ) -> object:
        xfer = self._agent.make_prepped_xfer(
            _OPS[op],
            local,
            np.ascontiguousarray(local_ids, dtype=np.int32),
            remote,
            np.ascontiguousarray(remote_ids, dtype=np.int32),
            notification,
            self._plugins,
        )
        if self._agent.transfer(xfer) == "ERR":
            xfer.release()
            raise BackendError(f"NIXL {self._plugin} failed to post a {op.value}")
        return xfer

    def post_runs(
        self,
        op: XferOp,
        local_mem: MemKind,
        local: npt.NDArray[np.uint64],
        agent: str,
        remote_mem: MemKind,
        remote: npt.NDArray[np.uint64],
        notification: bytes,
    ) -> object:
        """Create and start one transfer of per-request ``N×3`` ``(addr, length,
        device)`` lists paired by row (:class:`RunsEndpoint`)."""
        local_list = self._agent.get_xfer_descs(
            np.ascontiguousarray(local, dtype=np.uint64), self._mem[local_mem]
        )
        remote_list = self._agent.get_xfer_descs(
            np.ascontiguousarray(remote, dtype=np.uint64), self._mem[remote_mem]
        )
        xfer = self._agent.initialize_xfer(
            _OPS[op], local_list, remote_list, agent, notification, self._plugins
        )
        if self._agent.transfer(xfer) == "ERR":
            xfer.release()
            raise BackendError(f"NIXL {self._plugin} failed to post a {op.value}")
        return xfer

    def state(self, xfer: object) -> XferStatus:
        state = self._agent.check_xfer_state(xfer)
        if state == "DONE":
            return XferStatus.DONE
        if state == "PROC":
            return XferStatus.PENDING
        return XferStatus.FAILED

    def release_xfer(self, xfer: object) -> None:
        xfer.release()  # type: ignore[attr-defined]

    def send_notification(self, agent: str, payload: bytes) -> None:
        self._agent.send_notif(agent, payload)

    def notifications(self) -> list[tuple[str, bytes]]:
        notifs: dict[Any, list[bytes]] = self._agent.get_new_notifs()
        return [(_text(name), msg) for name, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        self._agent = None


def start_plugin_agent(
    name: str,
    plugin: str,
    *,
    params: Mapping[str, str],
    progress_thread: bool,
    mem_names: Mapping[MemKind, str],
) -> PluginAgent:
    """Start a NIXL agent named ``name`` with one ``plugin`` backend.

    NIXL's listener thread stays off: metadata travels in kvxfer's handshake.

    Args:
        name: The agent's name (peers address it by this name).
        plugin: The NIXL backend plugin.
        params: The plugin's init parameters.
        progress_thread: NIXL's own progress thread (it spins a core while idle).
        mem_names: NIXL memory type of each :class:`~kvxfer.core.layout.MemKind`.

    Raises:
        MissingDependency: NIXL is not installed.
        ConfigError: ``NIXL_UCX_SGL_ENABLE`` set to a value NIXL cannot read (UCX).
        BackendError: NIXL could not start the agent, or has no such plugin here.
    """
    nixl_agent, nixl_agent_config = import_nixl()
    if plugin == "UCX":
        list_writes(os.environ)  # a value NIXL cannot read fails here, by name
    conf = nixl_agent_config(
        enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[]
    )
    with map_nixl_errors(NixlCall.START, f"could not start a NIXL agent with {plugin}"):
        agent = nixl_agent(name, conf)
        if plugin not in agent.plugin_list:
            raise BackendError(f"NIXL has no {plugin} plugin here (plugins: {agent.plugin_list})")
        agent.create_backend(plugin, dict(params))
    return PluginAgent(agent, plugin, mem_names)
