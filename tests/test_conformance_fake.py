"""The fake backend passes the conformance suite, with and without device-to-device."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from kvxfer import registry
from kvxfer.backend import XferOp, XferStatus
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.testing.conformance import (
    CHECKS,
    BackendConformance,
    BackendSpec,
    Harness,
    check_backend,
    check_chunk_and_window_modes,
    check_read_block_shapes,
    check_write_block_shapes,
)
from kvxfer.testing.fake_backend import FakeBackend


class TestFakeDeviceToDevice(BackendConformance):
    spec = BackendSpec(name="fake", in_process=True)


class TestFakeHostOnly(BackendConformance):
    spec = BackendSpec(name="fake", in_process=True, extra={"device_to_device": "false"})


def test_check_backend_runs_without_pytest_machinery() -> None:
    results = check_backend(BackendSpec(name="fake", in_process=True))
    assert set(results) == {c.__name__ for c in CHECKS}
    assert results["check_read_block_shapes"] == "passed"
    assert results["check_chunk_and_window_modes"] == "passed"
    host_only = BackendSpec(name="fake", in_process=True, extra={"device_to_device": "false"})
    results = check_backend(host_only, checks=[check_chunk_and_window_modes])
    assert results["check_chunk_and_window_modes"].startswith("skipped: ")


class _Lossy(FakeBackend):
    """A broken backend: reports DONE but corrupts the first byte it delivered."""

    def _move(self, xfer: Any, local: DescriptorTable, remote: DescriptorTable) -> XferStatus:
        state = super()._move(xfer, local, remote)
        table, ids = (
            (local, xfer.local_ids) if xfer.op is XferOp.READ else (remote, xfer.remote_ids)
        )
        byte = ctypes.c_uint8.from_address(int(table.addr[ids[0]]))
        byte.value ^= 0xFF
        return state


def test_a_backend_that_corrupts_a_byte_fails_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered for this test only: both registry tables are restored afterwards.
    monkeypatch.setitem(registry._manual, "lossy-fake", _Lossy)
    monkeypatch.setitem(registry._cache, "lossy-fake", _Lossy)
    h = Harness(BackendSpec(name="lossy-fake", in_process=True))
    try:
        with pytest.raises(AssertionError, match="1 byte"):
            check_read_block_shapes(h)
        with pytest.raises(AssertionError, match="1 byte"):
            check_write_block_shapes(h)
    finally:
        h.close()
