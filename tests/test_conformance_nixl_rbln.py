"""nixl_rbln: the conformance suite on the EMULATED adapter, plus adapter selection rules.

Every transfer here runs on the emulation of nixl-rbln (host memory standing in for NPU
memory, moved by real NIXL over UCX); nothing in this file touches an NPU.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import types
from collections.abc import Sequence
from importlib.metadata import entry_points

import numpy as np
import numpy.typing as npt
import pytest

from kvxfer.backend import BackendOptions
from kvxfer.backends.host_bounce import NOT_AVAILABLE, default_transport
from kvxfer.backends.nixl_rbln import ADAPTER_ENV, ADAPTER_GROUP, NixlRblnBackend, load_adapter
from kvxfer.backends.rbln_adapter import NixlAgentAdapter, RblnAdapter, RblnAgent
from kvxfer.backends.ucx import UcxBackend
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.layout import KVLayout, KVPart, MemKind, Region, SplitAxis
from kvxfer.errors import BackendError, MissingDependency
from kvxfer.testing.conformance import BackendConformance, BackendSpec
from kvxfer.testing.rbln_emulation import EmulatedRblnAdapter

_names = itertools.count()


class TestNixlRblnEmulated(BackendConformance):
    spec = BackendSpec(name="nixl_rbln", extra={"rbln_adapter": "emulated"}, mem=MemKind.VRAM)


def _options(**kw: object) -> BackendOptions:
    return BackendOptions(agent_name=f"rbln-{os.getpid()}-{next(_names)}", **kw)  # type: ignore[arg-type]


@pytest.fixture
def no_nixl_rbln(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADAPTER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "nixl_rbln", None)  # import nixl_rbln -> ImportError


def test_without_nixl_rbln_device_to_device_is_refused(no_nixl_rbln: None) -> None:
    with pytest.raises(MissingDependency) as err:
        NixlRblnBackend(_options())
    message = str(err.value)
    assert "nixl-rbln is required" in message and 'kv_buffer_device "rbln"' in message
    assert isinstance(err.value, BackendError) and isinstance(err.value, ImportError)


def test_host_transport_falls_back_to_ucx_with_the_exact_line(
    no_nixl_rbln: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvxfer.backends.host_bounce"):
        be = default_transport(_options())
    try:
        assert isinstance(be, UcxBackend)
        warned = [r for r in caplog.records if r.getMessage() == NOT_AVAILABLE]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert NOT_AVAILABLE == "RBLN NIXL: nixl-rbln not available"
    finally:
        be.close()


def test_environment_selects_the_emulation(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ADAPTER_ENV, "emulated")
    with caplog.at_level(logging.INFO):
        be = NixlRblnBackend(_options())
    try:
        assert be.adapter.emulated and "emulation" in be.adapter.description
        assert be.capabilities.device_to_device is True
        emulation_lines = [r.getMessage() for r in caplog.records if "emulation" in r.name]
        assert emulation_lines and all(m.startswith("RBLN emulation:") for m in emulation_lines)
    finally:
        be.close()
    host = default_transport(_options())  # with an adapter, host bounce rides it too
    try:
        assert isinstance(host, NixlRblnBackend)
    finally:
        host.close()


def test_rails_and_stripe_width_reach_the_adapter() -> None:
    adapter = EmulatedRblnAdapter()
    be = NixlRblnBackend(_options(rails=("mlx5_0:1", "mlx5_3:1"), stripe_width=0), adapter=adapter)
    try:
        assert adapter.last_rails == ("mlx5_0:1", "mlx5_3:1")
        assert adapter.last_stripe_width == 0
    finally:
        be.close()
    real = NixlAgentAdapter("RBLN")
    assert real.plugin_params(("mlx5_0:1", "mlx5_3:1"), 0) == {
        "rails": "mlx5_0:1,mlx5_3:1",
        "stripe_width": "0",
    }
    assert real.plugin_params((), None) == {}
    assert not real.emulated


def test_adapter_selection_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    # "emulated" is a name in the adapters' entry-point group, not known to nixl_rbln.
    named = {ep.name: ep.value for ep in entry_points(group=ADAPTER_GROUP)}
    assert named.get("emulated") == "kvxfer.testing.rbln_emulation:EmulatedRblnAdapter"
    assert isinstance(load_adapter("emulated"), EmulatedRblnAdapter)
    assert isinstance(
        load_adapter("kvxfer.testing.rbln_emulation:EmulatedRblnAdapter"), EmulatedRblnAdapter
    )
    assert isinstance(EmulatedRblnAdapter(), RblnAdapter)
    with pytest.raises(BackendError, match=r"unknown RBLN adapter 'gpu'.*emulated"):
        load_adapter("gpu")
    with pytest.raises(BackendError, match="not found"):
        load_adapter("kvxfer.testing.rbln_emulation:Nope")
    with pytest.raises(BackendError, match="does not implement"):
        load_adapter("builtins:object")
    # An installed nixl_rbln that ships its own adapter is used as is.
    module = types.ModuleType("nixl_rbln")
    module.kvxfer_adapter = EmulatedRblnAdapter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nixl_rbln", module)
    assert isinstance(load_adapter(None), EmulatedRblnAdapter)


def test_installed_module_without_rbln_plugin_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ADAPTER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "nixl_rbln", types.ModuleType("nixl_rbln"))
    with pytest.raises(BackendError, match="no RBLN plugin"):
        NixlRblnBackend(_options())


class _Recording(EmulatedRblnAdapter):
    """The emulated adapter, recording what the backend registers and prepares."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[tuple[MemKind, int, list[tuple[int, int]]]] = []
        self.prepared: list[tuple[str | None, MemKind, int]] = []

    def create_agent(
        self, name: str, *, rails: tuple[str, ...], stripe_width: int | None, progress_thread: bool
    ) -> RblnAgent:
        inner = super().create_agent(
            name, rails=rails, stripe_width=stripe_width, progress_thread=progress_thread
        )
        outer = self
        register, prep = inner.register, inner.prep_descs

        def recording_register(
            mem: MemKind, device: int, spans: Sequence[tuple[int, int]]
        ) -> object:
            outer.registered.append((mem, device, list(spans)))
            return register(mem, device, spans)

        def recording_prep(
            agent: str | None, mem: MemKind, descs: npt.NDArray[np.uint64]
        ) -> object:
            outer.prepared.append((agent, mem, len(descs)))
            return prep(agent, mem, descs)

        inner.register = recording_register  # type: ignore[method-assign]
        inner.prep_descs = recording_prep  # type: ignore[method-assign]
        return inner


def test_shards_register_per_device_and_expand_per_descriptor() -> None:
    # Two NPU shards on device ids 0 and 1, K and V interleaved in one buffer per shard.
    nb, bl = 4, 64
    buffers = [np.zeros((nb, 2, bl), dtype=np.uint8) for _ in range(2)]
    regions = tuple(
        Region(
            base=int(buf[:, part].ctypes.data),
            num_blocks=nb,
            stride=2 * bl,
            block_len=bl,
            mem=MemKind.VRAM,
            device_id=shard,
            shard=shard,
            part=(KVPart.K, KVPart.V)[part],
        )
        for shard, buf in enumerate(buffers)
        for part in range(2)
    )
    layout = KVLayout(block_size=8, regions=regions, num_shards=2, split_axis=SplitAxis.TOKEN)
    adapter = _Recording()
    be = NixlRblnBackend(_options(), adapter=adapter)
    try:
        be.register(layout)
        be.prepare_local(DescriptorTable.build(layout))
        assert sorted((m, d) for m, d, _ in adapter.registered) == [
            (MemKind.VRAM, 0),
            (MemKind.VRAM, 1),
        ]
        for _, device, spans in adapter.registered:
            assert spans == [(int(buffers[device].ctypes.data), buffers[device].nbytes)]
        # One descriptor per (shard region, block): 4 regions x 4 blocks.
        assert adapter.prepared == [(None, MemKind.VRAM, 16)]
    finally:
        be.close()
