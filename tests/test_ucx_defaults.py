"""The UCX settings kvxfer's NIXL agents start with (``backends/_nixl.ucx_defaults``):
TCP keepalive everywhere, cuda_ipc GETs where the NVIDIA driver lists a GPU, and the
operator's own value over either."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvxfer.backends import _nixl

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def test_cuda_ipc_gets_are_on_where_the_driver_lists_a_gpu(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus"
    assert GET_ZCOPY not in _nixl.ucx_defaults(gpus)  # no driver
    gpus.mkdir()
    assert GET_ZCOPY not in _nixl.ucx_defaults(gpus)  # a driver, no GPU
    (gpus / "0000:00:06.0").mkdir()
    defaults = _nixl.ucx_defaults(gpus)
    assert defaults[GET_ZCOPY] == "y"
    assert defaults["UCX_TCP_KEEPIDLE"] == "2s"  # the keepalive stays in either case


def test_import_nixl_applies_the_gpu_default_unless_the_operator_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "0000:00:06.0").mkdir()
    monkeypatch.setattr(_nixl, "NVIDIA_GPUS", tmp_path)
    # A copy of the environment: what import_nixl sets must not reach later tests' children.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != GET_ZCOPY})
    _nixl.import_nixl()
    assert os.environ[GET_ZCOPY] == "y"
    os.environ[GET_ZCOPY] = "auto"
    _nixl.import_nixl()
    assert os.environ[GET_ZCOPY] == "auto"


def test_no_gpu_no_cuda_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Elsewhere UCX would warn that the variable is unused: kvxfer leaves it unset."""
    monkeypatch.setattr(_nixl, "NVIDIA_GPUS", tmp_path / "absent")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != GET_ZCOPY})
    _nixl.import_nixl()
    assert GET_ZCOPY not in os.environ
