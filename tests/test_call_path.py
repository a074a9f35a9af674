"""How many of kvxfer's files one pull (``Agent.pull``) and one push write (a push
producer's ``Agent.hold``) pass through to the backend's post, measured on real
transfers (fake backend, real side channels; the peer is known already: a first
contact's handshake is not on this path). Two measures:

- **the main line**: the files of the frames on the pulling thread's stack at the
  moment the backend is asked to post, outermost first, and the backend's. This is the
  path a newcomer follows by reading one call into the next (docs/DESIGN.md lists it):
  at most five files for a pull and seven for a push write, none entered twice
  (issue 28).
- **everything entered**: every Python call into a library file until the post (a
  profile hook), side trips included: the block-id checks, the planner, the transfer
  record, the peer cache, the guard. The ceilings below keep it from growing unseen;
  whoever shortens it lowers them. ``-s`` prints both.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from kvxfer.transfer import Transfer
from kvxfer.types import Direction, Role
from tests.faultkit import (
    BLOCK,
    PRODUCER_SEED,
    Engine,
    Side,
    pull_pair,
    push_registered,
    settle,
    stub,
)

ROOT = Path(__file__).resolve().parent.parent
#: The main line: at most this many files (issue 28), none entered twice.
MAX_MAIN_LINE = 5
MAX_PUSH_MAIN_LINE = 7
#: Everything one pull enters today, and how often it comes back to a file it left.
MAX_FILES = 11
MAX_RETURNS = 10
MAX_PUSH_FILES = 16
# 15 since pushes between block sizes: a write asks its pairing for the consumer's block
# size (kvxfer/_agent/push_ratio.py) before it posts.
MAX_PUSH_RETURNS = 15


@pytest.fixture
def pair() -> Iterator[tuple[Side, Engine, Side]]:
    yield from pull_pair()


def _library(path: Path) -> str | None:
    """``path`` relative to the repository when it is a library file (not a test's)."""
    if not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT).as_posix()
    return rel if rel.startswith(("kvxfer/", "backends/")) and "/testing/" not in rel else None


def _traced(poster: Side, call: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """The library files ``call`` enters until ``poster``'s backend is asked to post, in
    order (a file entered twice in a row once), and the main line: the files on the
    stack at that moment."""
    seq: list[str] = []
    main: list[str] = []
    posted = threading.Event()
    real_post = poster.backend.post_engine

    def post(*args: Any, **kwargs: Any) -> Any:
        posted.set()
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            rel = _library(Path(frame.f_code.co_filename))
            if rel is not None and (not main or main[0] != rel):
                main.insert(0, rel)
            frame = frame.f_back
        main.append(_library(Path(type(poster.backend).post_engine.__code__.co_filename)) or "")
        return real_post(*args, **kwargs)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or posted.is_set():
            return
        rel = _library(Path(frame.f_code.co_filename))
        if rel is not None and (not seq or seq[-1] != rel):
            seq.append(rel)

    poster.backend.post_engine = post  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        poster.backend.post_engine = real_post  # type: ignore[method-assign]
    assert posted.is_set(), "the call did not post on its own thread"
    return seq, main


def _pull_path(producer: Side, engine: Engine, consumer: Side) -> tuple[list[str], list[str]]:
    warm = consumer.agent.pull(engine.hold("warm", [1, 2]), [5, 6])  # first contact
    settle(warm, 10, engine)
    ticket = engine.hold("traced", [3, 4])
    pulls: list[Transfer] = []
    seq, main = _traced(consumer, lambda: pulls.append(consumer.agent.pull(ticket, [7, 8])))
    settle(pulls[0], 10, engine)
    return seq, main


def test_one_pull_follows_a_main_line_of_five_files_and_enters_no_more_than_today(
    pair: tuple[Side, Engine, Side],
) -> None:
    seq, main = _pull_path(*pair)
    files = list(dict.fromkeys(seq))
    returns = len(seq) - len(files)
    print(f"\nmain line: {len(main)} files\n  " + " > ".join(main))
    print(f"everything entered: {len(files)} files, {returns} returns\n  " + " > ".join(seq))
    assert main[0] == "kvxfer/agent.py" and main[-1] == "kvxfer/backend.py", main
    assert len(main) == len(set(main)), f"the main line comes back to a file: {main}"
    assert len(main) <= MAX_MAIN_LINE, main
    assert "kvxfer/core/descriptors.py" in files  # it planned on the way
    assert len(files) <= MAX_FILES, files
    assert returns <= MAX_RETURNS, seq


def test_one_push_write_follows_a_main_line_of_seven_files() -> None:
    """A push producer's hold writes to a consumer that registered already, on the
    engine's own thread: Agent.hold to the posted descriptors."""
    producer = Side(Role.PRODUCER, Direction.PUSH, seed=PRODUCER_SEED, lease_s=60.0)
    consumer = Side(Role.CONSUMER, Direction.PUSH, transfer_timeout_s=30.0)
    engine = Engine(producer)
    try:
        # The first write to a consumer handshakes first: not on this path.
        warm = consumer.agent.expect_push(stub(producer, "warm"), [5, 6], num_tokens=2 * BLOCK)
        push_registered(producer, "warm")
        engine.hold("warm", [1, 2])
        settle(warm, 10)
        traced = consumer.agent.expect_push(stub(producer, "traced"), [7, 8], num_tokens=2 * BLOCK)
        push_registered(producer, "traced")
        # The warm write ran on the writer thread; under load it may still be finishing
        # there, and a busy writer takes the next write too (to keep a request's order).
        deadline = time.monotonic() + 10
        while not producer.agent._push.writer_idle:
            assert time.monotonic() < deadline, "the writer stayed busy"
            time.sleep(0.001)
        seq, main = _traced(producer, lambda: engine.hold("traced", [3, 4]))
        settle(traced, 10)
    finally:
        consumer.close()
        producer.close()
    files = list(dict.fromkeys(seq))
    print(f"\npush main line: {len(main)} files\n  " + " > ".join(main))
    print(f"push, everything entered: {len(files)} files, {len(seq) - len(files)} returns")
    print("  " + " > ".join(seq))
    assert main[0] == "kvxfer/agent.py" and main[-1] == "kvxfer/backend.py", main
    assert len(main) == len(set(main)), f"the main line comes back to a file: {main}"
    assert len(main) <= MAX_PUSH_MAIN_LINE, main
    assert len(files) <= MAX_PUSH_FILES, files
    assert len(seq) - len(files) <= MAX_PUSH_RETURNS, seq
