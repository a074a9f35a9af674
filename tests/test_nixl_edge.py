"""The NIXL edge (kvxfer.backends._nixl): how NIXL's failures become kvxfer errors, and
the import rules of the backends package.

The translation is checked with NIXL's own exception classes (the installed binding's),
then with failures provoked from a real NIXL agent, then through a backend's hot path.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.machinery
import importlib.util
import itertools
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import nixl._bindings as bindings
import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.backend import BackendOptions, Capabilities, PeerHandle, XferOp, XferStatus
from kvxfer.backends import _nixl
from kvxfer.backends._agent_backend import AgentBackend
from kvxfer.backends._nixl import NixlCall, map_nixl_errors, nixl_error, start_plugin_agent
from kvxfer.backends.host_bounce import NOT_AVAILABLE, HostBounceBackend
from kvxfer.backends.nixl_rbln import ADAPTER_ENV
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.layout import MemKind
from kvxfer.errors import (
    BackendError,
    KvxferError,
    MissingDependency,
    PeerError,
    RegistrationError,
    TransferError,
)
from kvxfer.testing.patterns import CacheShape, PatternCache

_names = itertools.count()

# Every exception class the installed NIXL binding declares, and what it maps to in a
# call that names a peer (a post) and in one that does not (a registration).
_EXPECTED: dict[str, tuple[type[KvxferError], type[KvxferError]]] = {
    "nixlRemoteDisconnectError": (PeerError, PeerError),
    "nixlNotFoundError": (PeerError, RegistrationError),
    "nixlCancelledError": (TransferError, TransferError),
    "nixlInvalidParamError": (BackendError, RegistrationError),
    "nixlBackendError": (BackendError, RegistrationError),
    "nixlMismatchError": (BackendError, RegistrationError),
    "nixlNotAllowedError": (BackendError, RegistrationError),
    "nixlNotSupportedError": (BackendError, RegistrationError),
    "nixlNotPostedError": (BackendError, RegistrationError),
    "nixlRepostActiveError": (BackendError, RegistrationError),
    "nixlNoTelemetryError": (BackendError, RegistrationError),
    "nixlUnknownError": (BackendError, RegistrationError),
}


def test_every_binding_exception_is_in_the_table() -> None:
    declared = {
        name
        for name in dir(bindings)
        if isinstance(getattr(bindings, name), type)
        and issubclass(getattr(bindings, name), BaseException)
    }
    assert declared == set(_EXPECTED), "NIXL's exception classes changed: review nixl_error"


@pytest.mark.parametrize("name", sorted(_EXPECTED))
def test_each_nixl_exception_maps_to_its_kvxfer_error(name: str) -> None:
    cls = getattr(bindings, name)
    on_post, on_register = _EXPECTED[name]
    for call, expected in ((NixlCall.POST, on_post), (NixlCall.REGISTER, on_register)):
        raised = cls("NIXL_ERR_SOMETHING")
        with pytest.raises(KvxferError) as info, map_nixl_errors(call, "doing it"):
            raise raised
        assert type(info.value) is expected, (name, call)
        assert info.value.__cause__ is raised
        assert "doing it" in str(info.value) and name in str(info.value)
        # The inline form of the hot paths is the same translation.
        assert type(nixl_error(raised, call, "doing it")) is expected


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (NixlCall.START, BackendError),
        (NixlCall.REGISTER, RegistrationError),
        (NixlCall.PEER, PeerError),
        (NixlCall.POST, BackendError),
        (NixlCall.POLL, BackendError),
        (NixlCall.RELEASE, BackendError),
        (NixlCall.NOTIFY, PeerError),
    ],
)
def test_other_exceptions_take_the_calls_class(call: NixlCall, expected: type[KvxferError]) -> None:
    # What nixl._api raises itself (KeyError for an unknown memory type, RuntimeError
    # without plugins) and an adapter's own exceptions: wrapped, never passed raw.
    for raised in (KeyError("FOO"), RuntimeError("no plugins"), OSError("adapter says no")):
        with pytest.raises(KvxferError) as info, map_nixl_errors(call, "x"):
            raise raised
        assert type(info.value) is expected and info.value.__cause__ is raised


def test_kvxfer_errors_pass_unchanged_and_interrupts_untouched() -> None:
    mine = RegistrationError("already registered")
    with pytest.raises(RegistrationError) as info, map_nixl_errors(NixlCall.PEER, "x"):
        raise mine
    assert info.value is mine and info.value.__cause__ is None
    assert nixl_error(mine, NixlCall.POST, "x") is mine
    with pytest.raises(KeyboardInterrupt), map_nixl_errors(NixlCall.POST, "x"):
        raise KeyboardInterrupt
    with map_nixl_errors(NixlCall.POST, "x"):
        pass  # nothing raised: nothing happens


# -- failures provoked from a real NIXL agent ------------------------------------------
def _agent() -> Any:
    return start_plugin_agent(
        f"edge-{os.getpid()}-{next(_names)}",
        "UCX",
        params={},
        progress_thread=False,
        mem_names={MemKind.DRAM: "DRAM", MemKind.VRAM: "DRAM"},
    )


def test_real_nixl_failures_map_by_meaning() -> None:
    agent = _agent()
    buf = np.zeros(4096, dtype=np.uint8)
    descs = np.array([[buf.ctypes.data, 1024, 0]], dtype=np.uint64)
    # Metadata that is not NIXL's: nixlMismatchError, a rejected peer.
    with pytest.raises(PeerError) as info, map_nixl_errors(NixlCall.PEER, "loading a peer"):
        agent.add_remote(b"not nixl metadata")
    assert type(info.value.__cause__).__name__ == "nixlMismatchError"
    # Descriptors of a remote NIXL never heard of: nixlNotFoundError, an unknown peer.
    with pytest.raises(PeerError) as info, map_nixl_errors(NixlCall.PEER, "preparing"):
        agent.prep_descs("nobody", MemKind.DRAM, descs)
    assert type(info.value.__cause__).__name__ == "nixlNotFoundError"
    # Deregistering twice: nixlNotFoundError again, but about memory this time.
    reg = agent.register(MemKind.DRAM, 0, [(buf.ctypes.data, buf.nbytes)])
    agent.deregister(reg)
    with pytest.raises(RegistrationError), map_nixl_errors(NixlCall.REGISTER, "deregistering"):
        agent.deregister(reg)
    # A plugin NIXL does not have: the clear BackendError, not NIXL's own.
    with pytest.raises(BackendError, match="no NOPE plugin"):
        start_plugin_agent("edge-nope", "NOPE", params={}, progress_thread=False, mem_names={})
    agent.close()


# -- through a backend's hot path ------------------------------------------------------
class _Failing:
    """A NixlEndpoint whose transfer calls raise what NIXL raises."""

    def __init__(self, on_post: BaseException, on_state: BaseException | None = None) -> None:
        self.on_post, self.on_state = on_post, on_state
        self.name = "failing"

    def metadata(self) -> bytes:
        return b"md"

    def register(self, mem: MemKind, device: int, spans: Any) -> object:
        return object()

    def deregister(self, registration: object) -> None:
        pass

    def prep_descs(self, agent: str | None, mem: MemKind, descs: npt.NDArray[np.uint64]) -> object:
        return object()

    def release_descs(self, prepared: object) -> None:
        pass

    def add_remote(self, metadata: bytes) -> str:
        return "peer"

    def remove_remote(self, agent: str) -> None:
        raise bindings.nixlNotFoundError("NIXL_ERR_NOT_FOUND")  # logged, never raised

    def post(self, op: XferOp, *args: object) -> object:
        if self.on_post is not None:
            raise self.on_post
        return object()

    def state(self, xfer: object) -> XferStatus:
        if self.on_state is not None:
            raise self.on_state
        return XferStatus.DONE

    def release_xfer(self, xfer: object) -> None:
        raise bindings.nixlRepostActiveError("NIXL_ERR_REPOST_ACTIVE")  # in flight

    def send_notification(self, agent: str, payload: bytes) -> None:
        raise bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    def notifications(self) -> list[tuple[str, bytes]]:
        raise bindings.nixlBackendError("NIXL_ERR_BACKEND")

    def close(self) -> None:
        pass


class _Backend(AgentBackend):
    name: ClassVar[str] = "edge-test"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            name=self.name, mem_kinds=frozenset({MemKind.DRAM}), device_to_device=False
        )


def _connected(endpoint: _Failing) -> tuple[_Backend, PeerHandle]:
    be = _Backend(BackendOptions(agent_name="edge"), endpoint, "test endpoint")
    table = DescriptorTable.build(be.register(PatternCache(CacheShape(num_blocks=4)).layout))
    be.prepare_local(table)
    return be, be.add_peer(b"md", table)


def test_a_disconnect_during_post_is_a_peer_error() -> None:
    be, peer = _connected(
        _Failing(bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"))
    )
    ids = np.arange(2, dtype=np.int64)
    with pytest.raises(PeerError, match="disconnected"):
        be.post(XferOp.READ, peer, ids, ids)
    with pytest.raises(PeerError):
        be.notify(peer, b"x")
    with pytest.raises(BackendError):
        be.drain_notifications()
    be.close()


def test_a_refused_post_is_a_backend_error_and_a_failed_poll_is_failed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint = _Failing(bindings.nixlInvalidParamError("NIXL_ERR_INVALID_PARAM"))
    be, peer = _connected(endpoint)
    ids = np.arange(2, dtype=np.int64)
    with pytest.raises(BackendError, match="read to peer: nixlInvalidParamError"):
        be.post(XferOp.READ, peer, ids, ids)
    endpoint.on_post = None  # type: ignore[assignment]
    endpoint.on_state = bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
    handle = be.post(XferOp.WRITE, peer, ids, ids)
    with caplog.at_level(logging.WARNING, logger="kvxfer.backends"):
        assert be.status(handle) is XferStatus.FAILED  # a poll answers, never raises
    assert any("nixlRemoteDisconnectError" in m for m in caplog.messages)
    be.release(handle)  # NIXL refusing the release is logged, not raised
    be.remove_peer(peer)  # so is a peer NIXL already forgot
    be.close()


class _InFlight(_Failing):
    """An endpoint whose transfers stay in flight until ``ended`` holds them, and that
    records the agents it disconnected."""

    def __init__(self) -> None:
        super().__init__(on_post=BaseException())
        self.posted: list[int] = []
        self.ended: set[int] = set()
        self.removed: list[str] = []

    def post(self, op: XferOp, *args: object) -> object:
        self.posted.append(len(self.posted))
        return self.posted[-1]

    def state(self, xfer: object) -> XferStatus:
        return XferStatus.DONE if xfer in self.ended else XferStatus.PENDING

    def release_xfer(self, xfer: object) -> None:
        pass

    def remove_remote(self, agent: str) -> None:
        self.removed.append(agent)


def test_a_removed_peer_keeps_its_connection_until_its_writes_in_flight_end() -> None:
    """R-SAFE-5 at the NIXL edge: NIXL reports a removed agent's transfers over, but its
    UCX backend flushes the endpoint, and a WRITE's bytes still land in the peer's
    blocks (measured across a cut link: 4.5-47 M elements, seconds after it came
    back). So a peer
    with a WRITE in flight stays connected, and the WRITE in flight, until it ends on
    its own; a READ (its bytes come in through our own connection) holds nothing."""
    endpoint = _InFlight()
    be = _Backend(BackendOptions(agent_name="edge"), endpoint, "test endpoint")
    table = DescriptorTable.build(be.register(PatternCache(CacheShape(num_blocks=4)).layout))
    be.prepare_local(table)
    ids = np.arange(2, dtype=np.int64)
    peer = be.add_peer(b"md", table)
    read = be.post(XferOp.READ, peer, ids, ids)
    be.remove_peer(peer)
    assert endpoint.removed == ["peer"]  # a READ: disconnected at once
    be.release(read)

    peer = be.add_peer(b"md", table)
    write = be.post(XferOp.WRITE, peer, ids, ids)
    be.remove_peer(peer)
    assert endpoint.removed == ["peer"]  # still connected: the WRITE goes on
    with pytest.raises(PeerError):
        be.post(XferOp.WRITE, peer, ids, ids)  # but nothing new goes to it
    assert be.status(write) is XferStatus.PENDING and not be.cancel(write)
    endpoint.ended.add(endpoint.posted[-1])
    assert be.cancel(write)  # ended on its own: released, and the connection goes
    assert endpoint.removed == ["peer", "peer"]

    # Added again while a WRITE to it is in flight: the connection serves it again,
    # and is not cut when that WRITE ends.
    peer = be.add_peer(b"md", table)
    write = be.post(XferOp.WRITE, peer, ids, ids)
    be.remove_peer(peer)
    peer = be.add_peer(b"md", table)
    endpoint.ended.add(endpoint.posted[-1])
    assert be.cancel(write)
    assert endpoint.removed == ["peer", "peer"]
    be.close()


# -- the transport host bounce picks ---------------------------------------------------
def test_without_nixl_host_bounce_raises_the_nixl_hint_not_the_rbln_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ADAPTER_ENV, "emulated")
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # from nixl._api import -> ImportError
    with caplog.at_level(logging.DEBUG), pytest.raises(MissingDependency, match="kvxfer\\[nixl\\]"):
        HostBounceBackend(BackendOptions(agent_name=f"edge-{os.getpid()}-{next(_names)}"))
    assert NOT_AVAILABLE not in caplog.messages


# -- which NIXL module is imported ----------------------------------------------------
def _spec_of(tmp_path: Path, cuda: str) -> Any:
    """find_spec for a torch whose version.py says ``cuda: Optional[str] = <cuda>``."""
    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(f"from typing import Optional\ncuda: Optional[str] = {cuda}\n")
    spec = importlib.machinery.ModuleSpec("torch", None, origin=str(pkg / "__init__.py"))
    return lambda name, *a: spec if name == "torch" else _real_find_spec(name, *a)


_real_find_spec = importlib.util.find_spec


@pytest.mark.parametrize(
    ("cuda", "expected"), [("None", False), ("'12.8'", True), ("'13.0'", True)]
)
def test_torchs_cuda_build_is_read_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str, expected: bool
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", _spec_of(tmp_path, cuda))
    assert _nixl._torch_cuda_on_disk() is expected


def test_the_meta_package_decides_unless_no_cuda_version_could_pick_a_wheel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "nixl" in sys.modules  # this module imported it: the meta package's choice stands
    assert _nixl._nixl_api_module() == "nixl._api"
    monkeypatch.delitem(sys.modules, "nixl")
    for cuda_stack in ("torch", "cuda.bindings", "cupy"):
        monkeypatch.delitem(sys.modules, cuda_stack, raising=False)
    first = next(w for w in _nixl._NIXL_WHEELS if _real_find_spec(w) is not None)
    monkeypatch.setattr(_nixl, "_torch_cuda_on_disk", lambda: False)  # CPU torch, or none
    assert _nixl._nixl_api_module() == f"{first}._api"
    for unknown_or_cuda in (None, True):
        monkeypatch.setattr(_nixl, "_torch_cuda_on_disk", lambda v=unknown_or_cuda: v)
        assert _nixl._nixl_api_module() == "nixl._api"
    monkeypatch.setattr(_nixl, "_torch_cuda_on_disk", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", object())  # a CUDA stack already imported
    assert _nixl._nixl_api_module() == "nixl._api"


@pytest.mark.proc
def test_a_process_that_only_moves_bytes_does_not_import_torch() -> None:
    """The ~3 s torch import the meta package would make on a CPU host is skipped, and
    the agent class is the one the meta package exports."""
    code = (
        "import sys; from kvxfer.backends._nixl import import_nixl; agent, _ = import_nixl(); "
        "torch = 'torch' in sys.modules; import nixl._api; "
        "print(agent is nixl._api.nixl_agent, torch)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    # A CUDA torch on disk (a GPU host) leaves the choice, and the torch import, to NIXL.
    torch_imported = _nixl._torch_cuda_on_disk() is not False
    assert out.stdout.split() == ["True", str(torch_imported)], out.stdout + out.stderr


# -- import rules ----------------------------------------------------------------------
_BACKENDS = Path(__file__).resolve().parent.parent / "backends"
_RBLN = {"kvxfer.backends.rbln_adapter", "kvxfer.backends.nixl_rbln"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy and TYPE_CHECKING ones too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_backends_import_no_testing_code_and_no_rbln_code_below_rbln() -> None:
    graph = {
        f"kvxfer.backends.{p.stem}": {
            m for m in _imports(p) if m.startswith("kvxfer.backends.") and m.count(".") == 2
        }
        for p in _BACKENDS.glob("*.py")
        if p.stem != "__init__"
    }
    for p in _BACKENDS.glob("*.py"):
        assert not [m for m in _imports(p) if m.startswith("kvxfer.testing")], p.name
    for generic in ("ucx", "host_bounce", "_bounce", "_agent_backend", "_nixl"):
        assert not graph[f"kvxfer.backends.{generic}"] & _RBLN, generic

    # No circle: a depth-first walk never comes back to a module on its own path.
    def walk(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        for nxt in graph.get(module, ()):
            walk(nxt, (*path, module))

    for module in graph:
        walk(module, ())


def test_the_metadata_blob_is_read_from_nixl_once_per_registration_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every handshake's Welcome carries the blob; NIXL's getLocalMD keeps the GIL, so it
    is read again only after memory was registered (new keys for peers to use)."""
    from kvxfer.backends._nixl import PluginAgent
    from kvxfer.backends.ucx import UcxBackend

    reads: list[bytes] = []
    real = PluginAgent.metadata

    def counted(self: PluginAgent) -> bytes:
        reads.append(real(self))
        return reads[-1]

    monkeypatch.setattr(PluginAgent, "metadata", counted)
    backend = UcxBackend(BackendOptions(agent_name=f"edge-md-{os.getpid()}-{next(_names)}"))
    try:
        first = backend.metadata()
        assert backend.metadata() == first and len(reads) == 1
        backend.register(PatternCache(CacheShape(num_blocks=4)).layout)
        after = backend.metadata()
        assert len(reads) == 2 and backend.metadata() == after and len(reads) == 2
        assert after != first  # the registered memory's keys are in it
        backend.register_guard(4)
        assert backend.metadata() != after and len(reads) == 3
    finally:
        backend.close()


def _guarded_pair(role: str) -> tuple[AgentBackend, AgentBackend, list[PatternCache]]:
    """Two UCX backends in this process, the one that posts (named after ``role``) and
    the owner of the word it moves, with a 4-block cache for each (registered by the
    caller; kept alive by it for as long as the backends live)."""
    from kvxfer.backends.ucx import UcxBackend

    poster = UcxBackend(BackendOptions(agent_name=f"edge-{role}-{os.getpid()}-{next(_names)}"))
    owner = UcxBackend(BackendOptions(agent_name=f"edge-owner-{os.getpid()}-{next(_names)}"))
    return poster, owner, [PatternCache(CacheShape(num_blocks=4)) for _ in range(2)]


def _ended(poster: AgentBackend, owner: AgentBackend, handle: Any) -> XferStatus:
    """The state ``handle`` ends in (30 s at most), progressing the owner's worker
    meanwhile (UCX wires an endpoint up only as both workers progress)."""
    deadline = time.monotonic() + 30
    while (state := poster.status(handle)) is XferStatus.PENDING:
        assert time.monotonic() < deadline, "still pending after 30 s"
        owner.drain_notifications()
        time.sleep(0.001)
    return state


def test_a_guard_read_of_many_copies_reads_the_peers_word() -> None:
    """The agent's first warm-up posts its guard read as many descriptors, all of one
    remote word into one landing word (``copies``): real NIXL over UCX, between two
    agents in this process, completes it with the peer's word; fewer than one copy
    is refused before anything is posted."""
    reader, owner, caches = _guarded_pair("reader")
    try:
        layout = owner.register(caches[0].layout)
        words = owner.register_guard(4)
        words[2] = 0x5EED_0000_0000_0042
        reader.register(caches[1].layout)
        reader.register_guard(4)
        peer = reader.add_peer(owner.metadata(), DescriptorTable.build(layout))
        guard = owner.guard_table()
        assert guard is not None
        reader.add_peer_guard(peer, guard)
        with pytest.raises(BackendError, match=r"copies=0: must be at least 1"):
            reader.post_guard_read(peer, 2, copies=0)
        for copies in (4096, 1):
            handle = reader.post_guard_read(peer, 2, copies=copies)
            assert _ended(reader, owner, handle) is XferStatus.DONE, f"{copies} copies"
            assert reader.guard_word(handle) == 0x5EED_0000_0000_0042
            reader.release(handle)
    finally:
        reader.close()
        owner.close()


def test_a_sink_write_lands_in_the_peers_sink_word_only() -> None:
    """A push producer's warm-up writes its own sink word into the peer's, as many
    descriptors (``copies``): real NIXL over UCX, between two agents in this process,
    lands the writer's word in the sink the owner announced, and leaves the owner's
    guard slots and landing words as they were. A peer that announced no sink, or
    fewer than one copy, is refused before anything is posted."""
    from kvxfer.core.wire import GuardTable

    writer, owner, caches = _guarded_pair("writer")
    try:
        layout = owner.register(caches[0].layout)
        words = owner.register_guard(4)
        words[:] = 0x5EED_0000_0000_0042
        writer.register(caches[1].layout)
        writer.register_guard(4)
        guard, mine = owner.guard_table(), writer.guard_table()
        assert guard is not None and guard.sink is not None
        assert mine is not None and mine.sink is not None
        # The sink lies past the table and the landing words, in the same registration.
        assert guard.sink >= guard.base + guard.slots * guard.slot_bytes
        peer = writer.add_peer(owner.metadata(), DescriptorTable.build(layout))
        writer.add_peer_guard(peer, GuardTable(base=guard.base, slots=guard.slots))
        with pytest.raises(PeerError, match=r"announced no sink word"):
            writer.post_sink_write(peer)
        writer.add_peer_guard(peer, guard)
        with pytest.raises(BackendError, match=r"copies=0: must be at least 1"):
            writer.post_sink_write(peer, copies=0)
        for copies, value in ((4096, 0xC0FFEE), (1, 0xBEEF)):
            ctypes.c_uint64.from_address(mine.sink).value = value
            handle = writer.post_sink_write(peer, copies=copies)
            assert _ended(writer, owner, handle) is XferStatus.DONE, f"{copies} copies"
            writer.release(handle)
            assert ctypes.c_uint64.from_address(guard.sink).value == value
            assert (words == 0x5EED_0000_0000_0042).all()
    finally:
        writer.close()
        owner.close()
