"""host_bounce: the conformance suite against a peer in another process, plus its own rules."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvxfer.backend import BackendOptions, PeerHandle, XferHandle, XferOp, XferStatus
from kvxfer.backends._bounce import Copier, CopyTask, Pipelined, slice_ids
from kvxfer.backends.host_bounce import (
    NOT_AVAILABLE,
    CopyDirection,
    CopyOp,
    HostBounceBackend,
    host_block_view,
    torch_copy_op,
)
from kvxfer.backends.nixl_rbln import ADAPTER_ENV
from kvxfer.backends.ucx import UcxBackend
from kvxfer.core.descriptors import DescriptorTable, build_plan
from kvxfer.core.layout import KVLayout, MemKind, split_kv
from kvxfer.errors import BackendError, ConfigError, PlanError, RegistrationError
from kvxfer.testing.conformance import BackendConformance, BackendSpec
from kvxfer.testing.fake_backend import FakeBackend, Faults
from kvxfer.testing.patterns import CacheShape, PatternCache

_names = itertools.count()


class TestHostBounce(BackendConformance):
    spec = BackendSpec(name="host_bounce")


def _options() -> BackendOptions:
    return BackendOptions(agent_name=f"hb-{os.getpid()}-{next(_names)}")


def _over_fake(copy_op: CopyOp | None = None) -> HostBounceBackend:
    options = _options()
    return HostBounceBackend(options, transport=FakeBackend(options), copy_op=copy_op)


@pytest.fixture
def no_nixl_rbln(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADAPTER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "nixl_rbln", None)  # import nixl_rbln -> ImportError


def test_capabilities_and_staging_layout() -> None:
    cache = PatternCache(CacheShape(num_blocks=6))
    be = _over_fake()
    try:
        caps = be.capabilities
        assert (caps.device_to_device, caps.stages_through_host) == (False, True)
        exposed = be.register(cache.layout)
        assert exposed.first_difference(cache.layout) is None
        regions = exposed.regions
        for engine, staging in zip(cache.layout.regions, regions):
            assert (staging.num_blocks, staging.block_len) == (engine.num_blocks, engine.block_len)
            assert staging.stride == staging.block_len and staging.mem is MemKind.DRAM
        # One allocation, regions back to back: one registered range.
        for a, b in itertools.pairwise(regions):
            assert b.base == a.end
        with pytest.raises(RegistrationError):
            be.register(cache.layout)
    finally:
        be.close()
        be.close()


def test_stage_rejects_bad_block_lists() -> None:
    cache = PatternCache(CacheShape(num_blocks=6))
    be = _over_fake()
    try:
        with pytest.raises(RegistrationError):
            be.stage_out([np.array([0]), np.array([0])])
        be.register(cache.layout)
        with pytest.raises(PlanError, match="group"):
            be.stage_out([np.array([0])])  # the layout has two groups
        with pytest.raises(PlanError, match="out of range"):
            be.stage_in([np.array([6]), np.array([0])])
        with pytest.raises(PlanError, match="out of range"):
            be.stage_out([np.array([-1]), np.array([0])])
    finally:
        be.close()
    with pytest.raises(RegistrationError):
        be.stage_out([np.array([0]), np.array([0])])


def test_device_memory_needs_a_copy_op() -> None:
    cache = PatternCache(CacheShape(num_blocks=4, mem=MemKind.VRAM))
    be = _over_fake()
    try:
        with pytest.raises(RegistrationError, match="copy op"):
            be.register(cache.layout)
    finally:
        be.close()


def test_a_failing_copy_op_is_a_backend_error() -> None:
    def broken(direction: Any, region: int, blocks: Any, staging: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    cache = PatternCache(CacheShape(num_blocks=4, mem=MemKind.VRAM))
    be = _over_fake(copy_op=broken)
    try:
        be.register(cache.layout)
        ids = [np.array([0, 1], dtype=np.int64) for _ in cache.layout.groups]
        for stage in (be.stage_out, be.stage_in):
            with pytest.raises(BackendError, match=r"staging copy .* failed: CUDA") as info:
                stage(ids)
            assert isinstance(info.value.__cause__, RuntimeError)
    finally:
        be.close()


def test_stage_copies_only_listed_blocks_of_strided_regions() -> None:
    cache = PatternCache(CacheShape(num_blocks=6))
    cache.fill(3)
    be = _over_fake()
    try:
        exposed = be.register(cache.layout)
        be.stage_out([np.array([4, 1]), np.array([1])])
        views = [host_block_view(r) for r in exposed.regions]
        for i, r in enumerate(cache.layout.regions):
            listed = [4, 1] if r.group == 0 else [1]
            assert np.array_equal(views[i][listed], cache.views[i][listed])
            others = [b for b in range(6) if b not in listed]
            assert not views[i][others].any()
            views[i][:] = 0xAB
        be.stage_in([np.array([2]), np.array([])])
        for i, r in enumerate(cache.layout.regions):
            expect = cache.pattern(3, i, range(6))
            if r.group == 0:
                expect[2] = 0xAB
            assert np.array_equal(cache.views[i], expect)
    finally:
        be.close()


def test_overlapping_copies_in_leave_the_later_ones_bytes() -> None:
    """Two copies in of the same blocks overlap (receptions settling on two threads):
    one that read the staging rows before new bytes landed and writes the engine's
    rows late (an engine copy descheduled between its read and its write) must not
    overwrite what the later copy wrote: copies in of a region go one at a time."""
    cache = PatternCache(CacheShape(num_blocks=4))
    read, later = threading.Event(), threading.Event()

    def op(direction: CopyDirection, region: int, blocks: Any, staging: Any) -> None:
        if direction is CopyDirection.OUT:
            staging[blocks] = cache.views[region][blocks]
            return
        rows = staging[blocks].copy()  # read now...
        if not read.is_set():
            read.set()
            later.wait(1.0)  # ...and written after the later copy (1 s at most)
        cache.views[region][blocks] = rows

    options = BackendOptions(
        agent_name=f"hb-{os.getpid()}-{next(_names)}", extra={"copy_threads": "1"}
    )
    be = HostBounceBackend(options, transport=FakeBackend(options), copy_op=op)
    try:
        exposed = be.register(cache.layout)
        staging = [host_block_view(r) for r in exposed.regions]
        for v in staging:
            v[:] = 0x11
        ids = [np.arange(4, dtype=np.int64) for _ in cache.layout.groups]
        first = threading.Thread(target=be.stage_in, args=(ids,))
        first.start()
        assert read.wait(5)
        for v in staging:  # new bytes land
            v[:] = 0x22
        be.stage_in(ids)
        later.set()
        first.join(5)
        for i, view in enumerate(cache.views):
            assert (view == 0x22).all(), f"region {i} holds the earlier copy's bytes"
    finally:
        be.close()


def test_torch_tensors_bounce_through_staging() -> None:
    import torch

    def endpoint(seed: int) -> tuple[HostBounceBackend, list[Any], DescriptorTable]:
        gen = torch.Generator().manual_seed(seed)
        # vLLM-style (num_blocks, 2, block_size, heads, head_dim) bf16 caches: K and V
        # of one block sit side by side, so each region is strided.
        caches = [torch.randn(10, 2, 4, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(2)]
        if seed == 0:
            for c in caches:
                c.zero_()
        views = [v for c in caches for v in split_kv(c, kv_dim=1)]
        layout = KVLayout.from_kv_caches(caches, block_size=4, kv_dim=1)
        be = _over_fake(torch_copy_op(views))
        table = DescriptorTable.build(be.register(layout))
        be.prepare_local(table)
        return be, views, table

    producer, pviews, ptable = endpoint(1)
    consumer, cviews, ctable = endpoint(0)
    try:
        remote, local = [7, 2, 3], [0, 5, 6]
        producer.stage_out([np.array(remote)])
        peer = consumer.add_peer(producer.metadata(), ptable)
        plan = build_plan(ctable, ptable, local, remote, 11)
        h = consumer.post(XferOp.READ, peer, plan.local_ids, plan.remote_ids)
        assert consumer.status(h) is XferStatus.DONE
        consumer.stage_in([np.array(local)])
        for cv, pv in zip(cviews, pviews):
            c, p = cv.view(torch.int16), pv.view(torch.int16)
            assert torch.equal(c[local], p[remote])
            rest = [b for b in range(10) if b not in local]
            assert not c[rest].any()
    finally:
        consumer.close()
        producer.close()


def test_default_transport_falls_back_to_ucx_with_the_log_line(
    no_nixl_rbln: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvxfer.backends"):
        be = HostBounceBackend(_options())
    try:
        assert isinstance(be.transport, UcxBackend)
        lines = [r.getMessage() for r in caplog.records if "rbln" in r.getMessage().lower()]
        assert lines == [NOT_AVAILABLE]
        assert NOT_AVAILABLE == "RBLN NIXL: nixl-rbln not available"
    finally:
        be.close()


def test_transport_ucx_is_pinned_quietly(
    no_nixl_rbln: None, caplog: pytest.LogCaptureFixture
) -> None:
    options = BackendOptions(agent_name=_options().agent_name, extra={"transport": "ucx"})
    with caplog.at_level(logging.DEBUG):
        be = HostBounceBackend(options)
    try:
        assert isinstance(be.transport, UcxBackend)
        assert NOT_AVAILABLE not in caplog.messages
    finally:
        be.close()
    with pytest.raises(BackendError, match="transport"):
        HostBounceBackend(BackendOptions(agent_name="x", extra={"transport": "rdma"}))


@pytest.fixture
def emulated_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(ADAPTER_ENV, "emulated")
    yield


def test_with_an_rbln_adapter_host_bounce_rides_it(emulated_env: None) -> None:
    be = HostBounceBackend(_options())
    try:
        from kvxfer.backends.nixl_rbln import NixlRblnBackend

        assert isinstance(be.transport, NixlRblnBackend)
        assert be.transport.adapter.emulated
        assert be.capabilities.device_to_device is False  # host bounce all the same
    finally:
        be.close()


# -- engine-to-engine transfers: staging copies overlapped with the transfer ------------


def _bounce_pair(
    slices: int, faults: Any = None
) -> tuple[HostBounceBackend, HostBounceBackend, PatternCache, PatternCache, Any, Any]:
    """A producer and a consumer over the in-process fake fabric (which moves bytes
    only when polled, as an RDMA transport completes asynchronously)."""
    shape = CacheShape(num_blocks=12, window=0)
    pcache, ccache = PatternCache(shape), PatternCache(shape)
    pcache.fill(5)
    ends = []
    for _ in range(2):
        options = BackendOptions(
            agent_name=_options().agent_name,
            extra={"pipeline_slices": str(slices), "copy_threads": "2"},
        )
        ends.append(HostBounceBackend(options, transport=FakeBackend(options)))
    producer, consumer = ends
    ptable = DescriptorTable.build(producer.register(pcache.layout))
    ctable = DescriptorTable.build(consumer.register(ccache.layout))
    producer.prepare_local(ptable)
    consumer.prepare_local(ctable)
    if faults is not None:
        consumer.transport.faults = faults  # type: ignore[attr-defined]
    return producer, consumer, pcache, ccache, ptable, ctable


def _settle(be: HostBounceBackend, handle: Any, timeout_s: float = 10.0) -> XferStatus:
    # By time, not by a count of polls: a first READ over UCX also wires the endpoint
    # up, which outlasted 10,000 quick polls once in a CI run.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = be.status(handle)
        if state is not XferStatus.PENDING:
            return state
        time.sleep(0.0005)
    raise AssertionError(f"transfer never settled in {timeout_s:g}s")


@pytest.mark.parametrize("slices", [1, 3, 8, 64])
def test_post_engine_read_lands_in_the_engine_blocks(slices: int) -> None:
    producer, consumer, pcache, ccache, ptable, ctable = _bounce_pair(slices)
    try:
        remote, local = [9, 2, 3, 7], [0, 5, 6, 11]
        producer.stage_out([np.array(remote)])
        peer = consumer.add_peer(producer.metadata(), ptable)
        plan = build_plan(ctable, ptable, local, remote, 4 * 16)
        h = consumer.post_engine(XferOp.READ, peer, plan.local_ids, plan.remote_ids, b"done")
        assert _settle(consumer, h) is XferStatus.DONE
        for i, view in enumerate(ccache.views):
            assert np.array_equal(view[local], pcache.pattern(5, i, remote))
            rest = [b for b in range(12) if b not in local]
            assert not view[rest].any()  # nothing else of the engine was touched
        # The notice went once, after every slice moved.
        assert producer.drain_notifications() == [(consumer.agent_name, b"done")]
        consumer.release(h)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize("slices", [1, 5])
def test_post_engine_write_stages_its_own_blocks(slices: int) -> None:
    producer, consumer, pcache, ccache, ptable, ctable = _bounce_pair(slices)
    try:
        local, remote = [1, 2, 8], [4, 5, 10]
        peer = producer.add_peer(consumer.metadata(), ctable)
        plan = build_plan(ptable, ctable, local, remote, 3 * 16)
        # No stage_out: the write stages the producer's blocks itself.
        h = producer.post_engine(XferOp.WRITE, peer, plan.local_ids, plan.remote_ids, b"pushed")
        assert _settle(producer, h) is XferStatus.DONE
        assert consumer.drain_notifications() == [(producer.agent_name, b"pushed")]
        consumer.stage_in([np.array(remote)])
        for i, view in enumerate(ccache.views):
            assert np.array_equal(view[remote], pcache.pattern(5, i, local))
        producer.release(h)
    finally:
        consumer.close()
        producer.close()


def test_post_engine_failure_sends_no_notice_and_reports_failed() -> None:
    producer, consumer, _, _, ptable, ctable = _bounce_pair(4, Faults(fail_midway=0.5))
    try:
        producer.stage_out([np.array([0, 1, 2])])
        peer = consumer.add_peer(producer.metadata(), ptable)
        plan = build_plan(ctable, ptable, [3, 4, 5], [0, 1, 2], 48)
        h = consumer.post_engine(XferOp.READ, peer, plan.local_ids, plan.remote_ids, b"done")
        assert _settle(consumer, h) is XferStatus.FAILED
        assert producer.drain_notifications() == []  # the producer keeps its blocks
        consumer.release(h)
    finally:
        consumer.close()
        producer.close()


def test_post_engine_refuses_ids_outside_the_whole_block_section() -> None:
    producer, consumer, _, _, ptable, _ = _bounce_pair(2)
    try:
        peer = consumer.add_peer(producer.metadata(), ptable)
        with pytest.raises(PlanError, match="whole-block"):
            consumer.post_engine(XferOp.READ, peer, np.array([10**6]), np.array([0]))
        with pytest.raises(PlanError, match="remote"):
            consumer.post_engine(XferOp.READ, peer, np.array([0, 1]), np.array([0]))
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(("key", "value"), [("copy_threads", "0"), ("pipeline_slices", "x")])
def test_bad_pipeline_options_name_the_key(key: str, value: str) -> None:
    options = BackendOptions(agent_name=_options().agent_name, extra={key: value})
    transport = FakeBackend(options)
    with pytest.raises(ConfigError, match=f"backend_extra.{key}") as err:
        HostBounceBackend(options, transport=transport)
    assert value in str(err.value)
    assert transport.closed  # handed over, so closed with the failed backend


def test_slices_cut_at_region_boundaries_and_cover_every_id() -> None:
    nb = 10
    ids = np.array([r * nb + b for r in range(7) for b in (1, 4, 5)], dtype=np.int64)
    for want in (1, 2, 3, 7, 50):
        cuts = slice_ids(ids, nb, want)
        assert cuts[0][0] == 0 and cuts[-1][1] == len(ids)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
        for lo, hi in cuts:
            assert ids[lo] % nb == 1 and ids[hi - 1] % nb == 5  # whole regions only
        assert len(cuts) == min(want, 7)
    assert slice_ids(ids[:0], nb, 4) == []


def test_a_write_whose_first_stage_out_fails_posts_nothing() -> None:
    def copy_one(direction: CopyDirection, task: CopyTask) -> None:
        raise RuntimeError("device copy failed")

    class Transport:
        def post(self, *args: Any) -> XferHandle:
            raise AssertionError("posted a slice that was not staged out")

    copier = Copier(copy_one, 2)
    tasks = [[(0, np.arange(2, dtype=np.int64)), (1, np.arange(2, dtype=np.int64))]] * 3
    job = Pipelined(XferOp.WRITE, PeerHandle(1), b"", tasks)
    try:
        with pytest.raises(BackendError, match="staging copy d2h of region 0 failed"):
            job.post(Transport(), copier, [(np.array([0]), np.array([0]))] * 3)  # type: ignore[arg-type]
    finally:
        copier.close()
