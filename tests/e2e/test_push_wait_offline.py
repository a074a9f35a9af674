"""Waiting costs little: a consumer's idle steps sleep until its load lands, a
producer's until its hold ends.

No engine: the worker side on real Agents over the fake backend (the helpers of
``test_adapter_offline``), the scheduler side with plain request objects, and
:meth:`Transfer.add_done_callback`, which the worker's idle wait is built on.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvxfer.adapters.vllm import timeline
from kvxfer.adapters.vllm import worker as worker_module
from kvxfer.adapters.vllm.scheduler import SchedulerSide
from kvxfer.adapters.vllm.worker import WorkerSide
from kvxfer.transfer import Transfer, TransferState, settle
from kvxfer.types import Direction, Role
from tests.e2e.test_adapter_offline import (
    FakeRequest,
    _new_acc,
    _pair,
    _results,
    _side,
)


def test_done_callbacks_run_once_after_the_state_and_at_once_when_settled() -> None:
    t = Transfer("r", ((1, 2),), progress=lambda: None, deadline=time.monotonic() + 5)
    seen: list[TransferState] = []
    t.add_done_callback(lambda x: seen.append(x.state))
    assert seen == []
    assert settle(t, TransferState.DONE)
    assert not settle(t, TransferState.FAILED)
    assert seen == [TransferState.DONE]  # once, and the state was already final
    t.add_done_callback(lambda x: seen.append(x.state))  # settled: called at once
    assert seen == [TransferState.DONE, TransferState.DONE]


def test_a_step_plan_says_whether_vllm_scheduled_nothing() -> None:
    s = _side(Role.CONSUMER, Direction.PUSH)
    assert s.build_step_plan({}).idle
    assert not s.build_step_plan({"cmpl-a-0-00000001": 1}).idle
    assert not s.build_step_plan().idle  # unknown: never treated as idle


def _finished_prompt(ps: SchedulerSide, request_id: str) -> dict[str, Any]:
    """A 70-token prompt in the producer's blocks 4-6 finished: its ticket's params."""
    req = FakeRequest(request_id, {"do_remote_decode": True}, 70, 70, "FINISHED_LENGTH_CAPPED")
    _, params = ps.request_finished(req, [[4, 5, 6]])
    assert params is not None
    return params


def _load(cs: SchedulerSide, request_id: str, params: dict[str, Any]) -> None:
    """The consumer's scheduler takes the ticket into its blocks 9-11."""
    req = FakeRequest(request_id, params, num_prompt_tokens=70)
    n, _ = cs.get_num_new_matched_tokens(req, 0)
    cs.update_state_after_alloc(req, [[9, 10, 11]], n, 0)


def _idle_waits_busy_does_not(
    w: WorkerSide, side: SchedulerSide, acc: dict[str, set[str]], wait_s: float
) -> None:
    """An idle step (started by the caller) waits out ``wait_s``; a busy one does not."""
    t0 = time.monotonic()
    _results(w, acc)
    idle = time.monotonic() - t0
    assert idle >= 0.8 * wait_s, f"an idle step returned after {idle:.3f}s"
    w.start_step(side.build_step_plan({"cmpl-other-0-00000009": 1}))  # a busy step
    t0 = time.monotonic()
    _results(w, acc)
    busy = time.monotonic() - t0
    assert busy < 0.5 * wait_s, f"a step with work waited {busy:.3f}s"


def _until_woken(w: WorkerSide, acc: dict[str, set[str]], kind: str, request_id: str) -> float:
    """Seconds of idle steps until ``request_id`` is in ``acc[kind]`` (at most 5)."""
    t0 = time.monotonic()
    deadline = t0 + 5
    while request_id not in acc[kind] and time.monotonic() < deadline:
        _results(w, acc)
    return time.monotonic() - t0


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_an_idle_consumer_step_sleeps_until_its_load_lands(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Registered for a push the producer has not written, or pulling a ticket the
    producer has not held yet (vLLM's scheduler hands it out a step before the worker
    holds): an idle step waits (up to IDLE_WAIT_S) instead of returning at once, a step
    with work never waits, and the landing wakes a waiting idle step early. (Before,
    a pull consumer's idle steps returned at once: vLLM's loop and a TP group's workers
    spun while a pull waited, on the CPU its producer needed.)"""
    wait_s = 1.0
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", wait_s)
    p, c, ps, cs = _pair(mode)
    try:
        _load(cs, "cmpl-w-0-00000002", _finished_prompt(ps, "cmpl-w-0-00000001"))
        c.start_step(cs.build_step_plan({}))  # registers or pulls; vLLM scheduled nothing
        acc = _new_acc()
        _idle_waits_busy_does_not(c, cs, acc, wait_s)
        assert not acc["recving"]

        # The producer holds (and writes) while the consumer's idle step waits.
        writer = threading.Timer(0.05, lambda: p.start_step(ps.build_step_plan()))
        c.start_step(cs.build_step_plan({}))
        writer.start()
        landed = _until_woken(c, acc, "recving", "cmpl-w-0-00000002")
        writer.join()
        assert "cmpl-w-0-00000002" in acc["recving"] and not acc["failed"]
        # woken by the landing (~0.05 s), not at the end of the idle wait
        assert landed < 0.5 * wait_s, f"landed after {landed:.3f}s"
    finally:
        c.close()
        p.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_an_idle_producer_step_sleeps_until_its_hold_ends(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """vLLM steps a producer for as long as it holds a finished request's blocks for
    its consumer (its scheduler counts such requests as work). A producer whose
    consumer has not come yet (or never comes: one that refused the ticket cannot
    always say so) spun a core until the lease expired (1.5 CPU-seconds in 3 s on the
    test bed). Now an idle step waits (up to IDLE_WAIT_S) instead, a step with work
    never waits, and the hold's end wakes a waiting idle step early."""
    wait_s = 1.0
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", wait_s)
    p, c, ps, cs = _pair(mode)
    try:
        params = _finished_prompt(ps, "cmpl-h-0-00000001")
        p.start_step(ps.build_step_plan({}))  # holds; vLLM scheduled nothing
        acc = _new_acc()
        _idle_waits_busy_does_not(p, ps, acc, wait_s)
        assert not acc["sending"]

        # The consumer comes (reads, or registers and is written) while the idle step waits.
        def consume() -> None:
            _load(cs, "cmpl-h-0-00000002", params)
            c.start_step(cs.build_step_plan({}))

        consumer = threading.Timer(0.05, consume)
        p.start_step(ps.build_step_plan({}))
        consumer.start()
        freed = _until_woken(p, acc, "sending", "cmpl-h-0-00000001")
        consumer.join()
        assert "cmpl-h-0-00000001" in acc["sending"]
        # woken by the hold's end (~0.05 s and a transfer), not at the end of the wait
        assert freed < 0.5 * wait_s, f"freed after {freed:.3f}s"
    finally:
        c.close()
        p.close()


def test_the_timeline_is_written_only_when_its_variable_names_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = logging.getLogger("kvxfer.timeline")
    before = (log.level, log.propagate, list(log.handlers))
    path = tmp_path / "p.tl"
    try:
        monkeypatch.delenv(timeline.ENV, raising=False)
        assert not timeline.enable_from_env()
        timeline.mark("p_new", "cmpl-ttft-0-1")  # off: nothing anywhere
        monkeypatch.setenv(timeline.ENV, str(path))
        assert timeline.enable_from_env() and timeline.enabled()
        timeline.mark("p_new", "cmpl-ttft-0-1", t=12.5, bytes=7)
        for h in log.handlers:
            h.flush()
        assert path.read_text().splitlines() == ["TL p_new cmpl-ttft-0-1 12.500000 bytes=7"]
    finally:
        for h in log.handlers:
            if h not in before[2]:
                log.removeHandler(h)
                h.close()
        log.setLevel(before[0])
        log.propagate = before[1]
