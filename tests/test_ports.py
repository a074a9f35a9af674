"""The suite's port picker (tests/ports.py): each pytest process in its own part of the
range below the kernel's ephemeral ports, never the same port twice."""

from __future__ import annotations

import socket

import pytest

from tests import ports


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    # What this process handed out so far stays out of these tests, and theirs out of it.
    monkeypatch.setattr(ports, "_HANDED_OUT", set())


def test_ports_stay_in_the_processes_part_and_are_never_handed_out_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ports.ENV, "26384-26483")
    assert ports.port_range() == (26384, 26483)
    picked = [ports.free_port() for _ in range(40)]
    assert all(26384 <= p <= 26483 for p in picked)
    assert len(set(picked)) == len(picked)
    base = ports.free_base_port(span=4)
    assert base >= 26384 and base + 3 <= 26483
    assert not set(range(base, base + 4)) & set(picked)


def test_a_held_port_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    low = 26500
    monkeypatch.setenv(ports.ENV, f"{low}-{low + 1}")
    with socket.socket() as held:
        held.bind(("127.0.0.1", low))
        held.listen()
        assert ports.free_port() == low + 1
    assert ports.free_port() == low  # free again, and not handed out yet
    with pytest.raises(RuntimeError, match=f"{low}-{low + 1}"):
        ports.free_port()  # both handed out now


def test_the_default_is_the_whole_range_below_the_ephemeral_ports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ports.ENV, raising=False)
    low, high = ports.port_range()
    assert low == 20000 and high < 32768


@pytest.mark.parametrize("spec", ["abc", "30000", "30000-20000", "100-200", "20000-65000"])
def test_a_bad_range_is_refused_by_name(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ports.ENV, spec)
    with pytest.raises(ValueError, match=ports.ENV):
        ports.port_range()
