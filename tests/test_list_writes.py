"""NIXL's UCX list writes (``NIXL_UCX_SGL_ENABLE``): kvxfer reads the switch exactly as
NIXL does, refuses by name a value NIXL's UCX backend would fail to start with, and
says what it does in ``kvxfer doctor`` and the bench's header. (That a push moves the
same bytes with it on: ``tests/test_agent_transfers.py``.)"""

from __future__ import annotations

import itertools
import os

import pytest

from kvxfer.backends import _nixl
from kvxfer.errors import ConfigError
from kvxfer.tools.bench import cli as bench_cli
from kvxfer.tools.bench import device
from kvxfer.tools.doctor import Status, list_writes_check

KEY = "NIXL_UCX_SGL_ENABLE"
ON = ["1", "y", "yes", "on", "TRUE", "Enable"]
OFF = ["0", "n", "NO", "off", "false", "Disable"]
BAD = ["", " 1", "1 ", "2", "maybe", "onn"]

_names = itertools.count()


@pytest.mark.parametrize("value", ON + OFF)
def test_the_words_nixl_reads(value: str) -> None:
    assert _nixl.list_writes({KEY: value}) is (value in ON)


def test_unset_is_off() -> None:
    assert _nixl.list_writes({}) is False


@pytest.mark.parametrize("value", BAD)
def test_a_value_nixl_cannot_read_is_refused_by_name(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        _nixl.list_writes({KEY: value})
    assert info.value.key == KEY and info.value.value == value
    assert f"{KEY}={value!r}" in str(info.value)
    assert "yes" in info.value.rule and "disable" in info.value.rule


@pytest.mark.parametrize("value", ["1", "Enable", "off", "", " 1", "maybe"])
def test_nixls_ucx_backend_starts_exactly_where_kvxfer_accepts_the_value(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NIXL reads the variable from the process environment when it creates a UCX
    # backend: a table of words that drifted from NIXL's would show here.
    monkeypatch.setenv(KEY, value)
    try:
        _nixl.list_writes(os.environ)
        accepted = True
    except ConfigError:
        accepted = False
    nixl_agent, nixl_agent_config = _nixl.import_nixl()
    agent = nixl_agent(f"list-writes-{next(_names)}", nixl_agent_config(backends=[]))
    try:
        agent.create_backend("UCX", {})
        started = True
    except Exception:  # NIXL raises its own nixlBackendError
        started = False
    finally:
        del agent
    assert started is accepted


def test_kvxfers_agent_start_refuses_the_value_before_nixl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY, "maybe")
    with pytest.raises(ConfigError, match=KEY):
        _nixl.start_plugin_agent(
            "list-writes-refused", "UCX", params={}, progress_thread=False, mem_names={}
        )


def test_doctor_line() -> None:
    assert list_writes_check({}) is None  # unset: NIXL's default, no line
    on = list_writes_check({KEY: "1"})
    assert on is not None and on.status is Status.INFO and "one UCX put of a list" in on.detail
    off = list_writes_check({KEY: "off"})
    assert off is not None and off.status is Status.INFO and "per descriptor" in off.detail
    bad = list_writes_check({KEY: "maybe"})
    assert bad is not None and bad.status is Status.FAIL and "'maybe'" in bad.detail


def test_bench_records_the_switch_and_refuses_a_bad_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The header's "nixl_ucx_sgl" is device.list_writes() (a real run's header:
    # tests/test_bench.py's smoke run).
    monkeypatch.setenv(KEY, "yes")
    assert device.list_writes() is True
    assert "NIXL_UCX_SGL_ENABLE" in device.list_writes_note(True)
    monkeypatch.delenv(KEY)
    assert device.list_writes() is False and device.list_writes_note(False) == ""
    monkeypatch.setenv(KEY, "perhaps")
    assert bench_cli.main(["--quick"]) == 2  # before any process starts
    assert f"{KEY}='perhaps'" in capsys.readouterr().err
