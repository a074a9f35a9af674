"""How many of kvxfer's files one pull passes through, from ``Agent.pull`` to the
backend's post, measured on a real pull (fake backend, real side channels) with a
profile hook: every Python call the pulling thread enters until ``post_engine`` is
called (the peer is known already: a first contact's handshake is not on this path).

Issue 28 asks for a pull a newcomer can follow in at most five files without coming
back to one. Today's path is longer (docs/DESIGN.md lists it); this test keeps it from
growing unseen and prints the path, so whoever shortens it lowers the ceilings here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from tests.faultkit import Engine, Side, pull_pair, settle

ROOT = Path(__file__).resolve().parent.parent
#: kvxfer files one pull enters today, and how often it comes back to one it left.
MAX_FILES = 13
MAX_RETURNS = 20


@pytest.fixture
def pair() -> Iterator[tuple[Side, Engine, Side]]:
    yield from pull_pair()


def _pull_path(producer: Side, engine: Engine, consumer: Side) -> list[str]:
    """The library files entered, in order (a file entered twice in a row once)."""
    warm = consumer.agent.pull(engine.hold("warm", [1, 2]), [5, 6])  # first contact
    settle(warm, 10, engine)
    ticket = engine.hold("traced", [3, 4])
    seq: list[str] = []
    posted = threading.Event()
    real_post = consumer.backend.post_engine

    def post(*args: Any, **kwargs: Any) -> Any:
        posted.set()
        return real_post(*args, **kwargs)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or posted.is_set():
            return
        path = Path(frame.f_code.co_filename)
        if not path.is_relative_to(ROOT):
            return
        rel = path.relative_to(ROOT).as_posix()
        library = rel.startswith(("kvxfer/", "backends/")) and "/testing/" not in rel
        if library and (not seq or seq[-1] != rel):
            seq.append(rel)

    consumer.backend.post_engine = post  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        t = consumer.agent.pull(ticket, [7, 8])
    finally:
        sys.setprofile(None)
    assert posted.is_set(), "the pull did not post on its own thread"
    settle(t, 10, engine)
    return seq


def test_one_pull_passes_through_no_more_files_than_today(
    pair: tuple[Side, Engine, Side],
) -> None:
    seq = _pull_path(*pair)
    files = list(dict.fromkeys(seq))
    returns = len(seq) - len(files)
    print(f"\none pull: {len(files)} files, {returns} returns\n  " + " > ".join(seq))
    assert seq[0] == "kvxfer/agent.py"
    assert "kvxfer/core/descriptors.py" in files  # it planned on the way
    assert len(files) <= MAX_FILES, files
    assert returns <= MAX_RETURNS, seq
