"""The conformance suite every kvxfer backend must pass (R-BE-5).

Two ways to run it. From pytest, subclass :class:`BackendConformance` in a test module
(fsspec's abstract tests do the same)::

    from kvxfer.testing.conformance import BackendConformance, BackendSpec

    class TestUcx(BackendConformance):
        spec = BackendSpec(name="ucx")

Without pytest, call :func:`check_backend`, which runs every ``check_*`` function of
this module (they are public too, trio's ``check_*`` style) and returns what passed and
what did not apply.

A :class:`~kvxfer.testing._harness.Harness` connects a local endpoint (this process) to a
peer endpoint: in a ``spawn``-ed child process, over the real transport, unless the
spec says the backend's fabric is in-process. Both sides register a small sharded KV
cache filled with provenance patterns, so every received byte is compared with the exact
source byte. The peer processes are reused by all checks of one harness; teardown
checks that each exited with status 0.
"""

from __future__ import annotations

import time
import unittest
from collections.abc import Callable, Sequence
from typing import ClassVar

import msgspec
import numpy as np

from kvxfer.backend import XferHandle, XferOp, XferStatus
from kvxfer.core.block_lists import ChainLists
from kvxfer.core.descriptors import DescriptorTable, PlanOptions, build_plan
from kvxfer.core.layout import KVLayout
from kvxfer.errors import BackendError, KvxferError, PeerError
from kvxfer.testing._harness import BackendSpec, CacheShape, Harness, Moved

__all__ = [
    "CHECKS",
    "BackendConformance",
    "BackendSpec",
    "CacheShape",
    "Harness",
    "check_backend",
    "check_chunk_and_window_modes",
    "check_close",
    "check_descriptor_shapes",
    "check_invalid_ids",
    "check_notifications",
    "check_peer_exit",
    "check_read_block_shapes",
    "check_registration",
    "check_release_idempotent",
    "check_removed_peer",
    "check_status_nonblocking",
    "check_write_block_shapes",
]

#: A status poll slower than this is treated as blocking.
STATUS_LIMIT_S = 0.25

#: (local blocks per group, remote blocks per group, num_tokens) request shapes with a
#: block size of 16: whole blocks, contiguous runs, scattered ids, partial last blocks,
#: a single block, and a sliding-window group listing only its last blocks.
_SHAPES: tuple[tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...], int], ...] = (
    (((0, 1, 2, 3),), ((4, 5, 6, 7),), 64),
    (((8, 9, 10, 11, 12),), ((2, 3, 4, 5, 6),), 80),
    (((19, 3, 11, 7),), ((1, 22, 5, 14),), 64),
    (((5, 6, 7),), ((20, 21, 22),), 37),
    (((13,),), ((0,),), 1),
    (((23, 0, 12, 1, 17, 2),), ((6, 18, 9, 0, 3, 23),), 95),
)


def _groups(h: Harness, blocks: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """One block list per group; a sliding group gets the last two blocks only."""
    first = list(blocks[0])
    out = [first]
    for _ in h.local.exposed.groups[1:]:
        out.append(first[-2:])
    return out


def _assert_landed(moved: Moved, what: str) -> None:
    assert moved.status is XferStatus.DONE, f"{what}: transfer ended {moved.status.value}"
    assert moved.received is not None, f"{what}: nothing received"
    bad = np.argwhere(moved.received != moved.expected)
    assert not len(bad), (
        f"{what}: {len(bad)} byte(s) differ from the source; first at "
        f"(region, block, byte)={tuple(int(x) for x in bad[0])}"
    )


def _move_blocks(
    h: Harness,
    op: XferOp,
    local: tuple[tuple[int, ...], ...],
    remote: tuple[tuple[int, ...], ...],
    num_tokens: int,
    notification: bytes = b"",
) -> Moved:
    lg, rg = _groups(h, local), _groups(h, remote)
    plan = build_plan(h.local.table, h.remote_table, lg, rg, num_tokens)
    return h.post_ids(
        op,
        plan.local_ids,
        plan.remote_ids,
        local_groups=lg,
        remote_groups=rg,
        notification=notification,
    )


def _skip(reason: str) -> unittest.SkipTest:
    # unittest's SkipTest is understood by pytest and needs no pytest import here.
    return unittest.SkipTest(reason)


# -- checks ---------------------------------------------------------------------------
def check_registration(h: Harness) -> None:
    """``register`` returns a layout of the same shape covering the registered memory."""
    engine, exposed = h.local.cache.layout, h.local.exposed
    assert exposed.num_regions == engine.num_regions
    assert exposed.num_blocks == engine.num_blocks
    diff = exposed.first_difference(engine)
    staging = h.caps.stages_through_host
    assert diff is None or (staging and diff[0].endswith(".mem")), f"shape differs: {diff}"
    if not staging:
        assert exposed == engine, "a direct backend must expose the engine's own memory"
    else:
        for r in exposed.regions:
            assert r.stride == r.block_len, "staging buffers are contiguous per region"
    table = DescriptorTable.build(exposed)
    assert len(table) == engine.num_regions * engine.num_blocks
    try:
        h.local.backend.register(engine)
    except KvxferError:
        pass
    else:
        raise AssertionError("registering a second layout on one backend must raise")


def check_read_block_shapes(h: Harness) -> None:
    """READ moves exactly the planned bytes for many block-list shapes."""
    h.use_options(PlanOptions())
    for local, remote, tokens in _SHAPES:
        moved = _move_blocks(h, XferOp.READ, local, remote, tokens)
        _assert_landed(moved, f"READ {local}<-{remote} ({tokens} tokens)")


def check_write_block_shapes(h: Harness) -> None:
    """WRITE moves exactly the planned bytes for many block-list shapes."""
    h.use_options(PlanOptions())
    for local, remote, tokens in _SHAPES:
        moved = _move_blocks(h, XferOp.WRITE, local, remote, tokens)
        _assert_landed(moved, f"WRITE {local}->{remote} ({tokens} tokens)")


def check_descriptor_shapes(h: Harness) -> None:
    """Arbitrary descriptor pairs: one, a contiguous run, scattered, reversed order."""
    if h.caps.stages_through_host:
        raise _skip("staging backends move whole blocks of every region only")
    h.use_options(PlanOptions())
    n_local, n_remote = len(h.local.table), len(h.remote_table)
    rng = np.random.default_rng(7)
    cases = [
        (np.array([n_local - 1]), np.array([0])),
        (np.arange(10, 30), np.arange(40, 60)),
        (rng.permutation(n_local)[:50], rng.permutation(n_remote)[:50]),
        (np.arange(n_local)[::-1][:64].copy(), np.arange(64)),
    ]
    for op in (XferOp.READ, XferOp.WRITE):
        for lids, rids in cases:
            moved = h.post_ids(op, lids.astype(np.int64), rids.astype(np.int64))
            _assert_landed(moved, f"{op.value} of {len(lids)} descriptor pair(s)")


def _interleaved(layout: KVLayout) -> tuple[KVLayout, list[int]] | None:
    """The regions of ``layout`` that share one buffer block by block (the test cache's
    even layers), in the first group alone, and their indices in ``layout``; None
    without two such regions (a staging backend's contiguous buffers)."""
    keep = [i for i, r in enumerate(layout.regions) if r.group == 0 and r.stride > r.block_len]
    if len(keep) < 2:
        return None
    regions = tuple(layout.regions[i] for i in keep)
    return msgspec.structs.replace(layout, regions=regions, groups=layout.groups[:1]), keep


def check_chain_lists(h: Harness) -> None:
    """Chain lists (:mod:`kvxfer.core.block_lists`): a direct backend prepares them and
    moves exactly the bytes of the rows it is given, READ and WRITE; a staging backend
    answers False. The test cache's interleaved regions (a layer's K and V shards side
    by side in each block) chain into one row per block."""
    h.use_options(PlanOptions())
    ours, peers = _interleaved(h.local.table.layout), _interleaved(h.remote_table.layout)
    if ours is None or peers is None:
        # Staging buffers are contiguous per region: ask with lists of the engine's
        # own cache, which a staging backend must refuse (it copies per block id).
        engine = _interleaved(h.local.cache.layout)
        assert h.caps.stages_through_host and engine is not None, (
            "a direct backend exposes the engine's cache, whose regions interleave"
        )
        table = DescriptorTable.build(engine[0])
        lists = ChainLists.build(table, table)
        assert lists is not None
        assert not h.local.backend.prepare_lists(h.peer, lists), (
            "a staging backend must not take chain lists"
        )
        return
    (mine, keep), (theirs, _) = ours, peers
    local, remote = DescriptorTable.build(mine), DescriptorTable.build(theirs)
    lists = ChainLists.build(local, remote)
    assert lists is not None and lists.chains < len(keep), "interleaved regions must chain"
    assert h.local.backend.prepare_lists(h.peer, lists), "a direct backend posts chain lists"
    nb_local, nb_remote = local.num_blocks, remote.num_blocks
    rows_of = np.asarray(keep, dtype=np.int64)
    for blocks_l, blocks_r, tokens in _SHAPES:
        lg, rg = [list(blocks_l[0])], [list(blocks_r[0])]
        plan = build_plan(local, remote, lg, rg, tokens)
        cp = lists.plan((np.array(lg[0]),), (np.array(rg[0]),), tokens)
        assert cp.nbytes == plan.nbytes and cp.num_descriptors == plan.num_descriptors
        # The same descriptors as ids of the prepared tables (whole-cache regions).
        lids = rows_of[plan.local_ids // nb_local] * nb_local + plan.local_ids % nb_local
        rids = rows_of[plan.remote_ids // nb_remote] * nb_remote + plan.remote_ids % nb_remote
        for op in (XferOp.READ, XferOp.WRITE):
            moved = h.post_ids(
                op, lids, rids, local_groups=lg, remote_groups=rg,
                rows=(lists, cp.local_ids, cp.remote_ids),
            )  # fmt: skip
            _assert_landed(moved, f"chain rows {op.value} {lg}<->{rg} ({tokens} tokens)")


def check_chunk_and_window_modes(h: Harness) -> None:
    """Device-to-device: chunk and window tables move exactly their sub-block bytes."""
    if not h.caps.device_to_device:
        raise _skip("chunk_mode / swa_window_mode need a device-to-device backend")
    modes = (
        PlanOptions(chunk_mode=True, chunk_tokens=2),
        PlanOptions(swa_window_mode=True),
        PlanOptions(chunk_mode=True, chunk_tokens=2, swa_window_mode=True),
    )
    try:
        for options in modes:
            h.use_options(options)
            for local, remote, tokens in _SHAPES:
                lg, rg = _groups(h, local), _groups(h, remote)
                plan = build_plan(h.local.table, h.remote_table, lg, rg, tokens)
                layout = h.local.exposed
                whole = sum(len(g) * layout.block_bytes(i) for i, g in enumerate(lg))
                assert plan.nbytes <= whole, "a sub-block plan moves more than whole blocks"
                for op in (XferOp.READ, XferOp.WRITE):
                    moved = h.post_ids(
                        op, plan.local_ids, plan.remote_ids, local_groups=lg, remote_groups=rg
                    )
                    _assert_landed(moved, f"{options} {op.value} {local} ({tokens} tokens)")
    finally:
        h.use_options(PlanOptions())


def check_notifications(h: Harness) -> None:
    """A transfer's notification arrives once, exactly, and only after the bytes landed."""
    h.use_options(PlanOptions())
    me = h.local.backend.agent_name
    # PeerHandle is a str; engines key their bookkeeping on it.
    assert isinstance(h.peer, str), f"add_peer returned a {type(h.peer).__name__}, not a str"
    for op in (XferOp.WRITE, XferOp.READ):
        payload = f"done:{op.value}:\x00\xff".encode() + bytes(range(256))
        moved = _move_blocks(h, op, ((3, 4, 9),), ((7, 8, 1),), 45, notification=payload)
        _assert_landed(moved, f"{op.value} with a notification")
        assert moved.notifications == [(me, payload)], (
            f"{op.value}: expected exactly one notification from {me!r}, "
            f"got {[(s, p[:16]) for s, p in moved.notifications]}"
        )
        staged_read = op is XferOp.READ and h.caps.stages_through_host
        if not staged_read:
            # Staging backends copy in after completion; their bytes are checked above.
            assert moved.at_notification is not None
            assert np.array_equal(moved.at_notification, moved.expected), (
                f"{op.value}: the notification arrived before every byte landed"
            )
    h.local.notify(h.peer, b"out-of-band \x01")
    deadline = time.monotonic() + 10
    got: list[tuple[str, bytes]] = []
    while not got and time.monotonic() < deadline:
        got = h.remote.collect().notifications
        time.sleep(0.001)
    assert got == [(me, b"out-of-band \x01")], f"notify(): got {got}"


def check_status_nonblocking(h: Harness) -> None:
    """``status`` returns at once, from posting to completion."""
    h.use_options(PlanOptions())
    moved = _move_blocks(
        h, XferOp.READ, ((0, 1, 2, 3, 4, 5, 6, 7),), ((8, 9, 10, 11, 12, 13, 14, 15),), 128
    )
    _assert_landed(moved, "READ")
    assert moved.slowest_status_s < STATUS_LIMIT_S, (
        f"status() blocked {moved.slowest_status_s:.3f}s"
    )
    backend = h.local.backend
    t0 = time.perf_counter()
    state = backend.status(XferHandle(987654321))
    assert time.perf_counter() - t0 < STATUS_LIMIT_S
    assert state is XferStatus.FAILED, "an unknown handle is not PENDING or DONE"


def check_release_idempotent(h: Harness) -> None:
    """Releasing a handle twice, or one never posted, is harmless."""
    h.use_options(PlanOptions())
    backend = h.local.backend
    handle = backend.post(XferOp.READ, h.peer, np.arange(4), np.arange(4))
    deadline = time.monotonic() + 20
    while backend.status(handle) is XferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
    backend.release(handle)
    backend.release(handle)
    backend.release(XferHandle(123456789))
    assert isinstance(backend.status(handle), XferStatus)
    _assert_landed(_move_blocks(h, XferOp.READ, ((1,),), ((2,),), 16), "READ after releases")


def check_removed_peer(h: Harness) -> None:
    """Posting to or notifying a removed peer raises a kvxfer error; re-adding works."""
    h.use_options(PlanOptions())
    backend = h.local.backend
    peer = h.peer
    h.local.disconnect(peer)
    try:
        for op in (XferOp.READ, XferOp.WRITE):
            try:
                backend.post(op, peer, np.arange(2), np.arange(2), b"x")
            except (PeerError, BackendError):
                pass
            else:
                raise AssertionError(f"{op.value} to a removed peer did not raise")
        try:
            backend.notify(peer, b"x")
        except (PeerError, BackendError):
            pass
        else:
            raise AssertionError("notify() of a removed peer did not raise")
        backend.remove_peer(peer)  # removing twice is harmless
    finally:
        h.reconnect()
    _assert_landed(_move_blocks(h, XferOp.READ, ((5, 6),), ((7, 8),), 32), "READ after re-adding")


def check_invalid_ids(h: Harness) -> None:
    """Out-of-range or unpaired descriptor ids raise BackendError; the backend survives."""
    h.use_options(PlanOptions())
    backend, peer = h.local.backend, h.peer
    n_local, n_remote = len(h.local.table), len(h.remote_table)
    bad = {
        "local id past the table": (np.array([0, n_local]), np.array([0, 1])),
        "remote id past the table": (np.array([0, 1]), np.array([0, n_remote + 5])),
        "negative local id": (np.array([-1]), np.array([0])),
        "unpaired ids": (np.arange(3), np.arange(2)),
    }
    for what, (lids, rids) in bad.items():
        for op in (XferOp.READ, XferOp.WRITE):
            try:
                handle = backend.post(op, peer, lids.astype(np.int64), rids.astype(np.int64))
            except BackendError:
                continue
            backend.release(handle)
            raise AssertionError(f"{op.value} with {what} did not raise BackendError")
    _assert_landed(_move_blocks(h, XferOp.READ, ((9,),), ((10,),), 16), "READ after bad posts")


def check_close(h: Harness) -> None:
    """``close`` is idempotent, and nothing can be posted or notified afterwards."""
    ep = h.new_local()
    peer = ep.connect(h.remote_info)
    backend = ep.backend
    handle = backend.post(XferOp.READ, peer, np.arange(4), np.arange(4))
    deadline = time.monotonic() + 20
    while backend.status(handle) is XferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert backend.status(handle) is XferStatus.DONE
    ep.close()
    ep.close()
    try:
        backend.post(XferOp.READ, peer, np.arange(4), np.arange(4))
    except KvxferError:
        pass
    else:
        raise AssertionError("post after close did not raise")
    try:
        backend.notify(peer, b"x")
    except KvxferError:
        pass
    else:
        raise AssertionError("notify after close did not raise")
    assert isinstance(backend.status(handle), XferStatus)
    assert backend.drain_notifications() == []
    backend.release(handle)


def check_peer_exit(h: Harness) -> None:
    """A peer process that transferred and exits without ``close`` exits with status 0;
    transfers to it afterwards never report DONE, and nothing here crashes."""
    remote = h.new_remote()
    info = remote.info()
    peer = h.local.connect(info)
    # The peer initiates a READ too and leaves it unreleased: all of its handles are
    # live when it exits, so only its atexit teardown stands between it and a crash.
    assert remote.read_from(h.local.info(), 4) is XferStatus.DONE
    backend = h.local.backend
    ok = backend.post(XferOp.READ, peer, np.arange(4), np.arange(4))
    deadline = time.monotonic() + 20
    while backend.status(ok) is XferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert backend.status(ok) is XferStatus.DONE
    backend.release(ok)
    code = remote.abandon()
    assert code in (None, 0), f"a peer exiting without close() ended with status {code}"
    try:
        try:
            handle = backend.post(XferOp.READ, peer, np.arange(4), np.arange(4), b"late")
        except (PeerError, BackendError):
            return
        deadline = time.monotonic() + 5
        state = backend.status(handle)
        while state is XferStatus.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
            state = backend.status(handle)
        backend.release(handle)
        # Either FAILED, or still PENDING (the agent's deadline turns it into a
        # failure); never DONE from memory that no longer exists.
        assert state is not XferStatus.DONE, "a transfer from a dead peer reported DONE"
    finally:
        h.local.disconnect(peer)
        _assert_landed(_move_blocks(h, XferOp.READ, ((3,),), ((4,),), 16), "READ from a live peer")


#: Every check, in the order :func:`check_backend` and the test class run them.
CHECKS: tuple[Callable[[Harness], None], ...] = (
    check_registration,
    check_read_block_shapes,
    check_write_block_shapes,
    check_descriptor_shapes,
    check_chunk_and_window_modes,
    check_chain_lists,
    check_notifications,
    check_status_nonblocking,
    check_release_idempotent,
    check_removed_peer,
    check_invalid_ids,
    check_close,
    check_peer_exit,
)


def check_backend(
    spec: BackendSpec,
    *,
    shape: CacheShape | None = None,
    checks: Sequence[Callable[[Harness], None]] = CHECKS,
) -> dict[str, str]:
    """Run the conformance checks against a backend without pytest.

    Peers of out-of-process backends start with the ``spawn`` method, so a script calling
    this needs the ``if __name__ == "__main__":`` guard.

    Args:
        spec: The backend under test.
        shape: The test cache shape (default: :class:`CacheShape` for ``spec.mem``).
        checks: Which checks to run.

    Returns:
        ``{check name: "passed" | "skipped: <reason>"}``.

    Raises:
        AssertionError: a check failed, or a peer process exited with a non-zero status.
    """
    results: dict[str, str] = {}
    h = Harness(spec, shape)
    try:
        for check in checks:
            try:
                check(h)
            except unittest.SkipTest as skip:
                results[check.__name__] = f"skipped: {skip}"
            else:
                results[check.__name__] = "passed"
    finally:
        codes = h.close()
    assert all(c == 0 for c in codes), f"peer process exit codes {codes}"
    return results


class BackendConformance:
    """pytest base class: subclass it and set :attr:`spec` (see the module docstring).

    One :class:`Harness` (and its peer process) serves every test of the class;
    ``teardown_class`` fails when a peer process did not exit with status 0.
    """

    spec: ClassVar[BackendSpec]
    shape: ClassVar[CacheShape | None] = None
    harness: ClassVar[Harness]

    @classmethod
    def make_harness(cls) -> Harness:
        """The connected pair under test; override to build it differently."""
        return Harness(cls.spec, cls.shape)

    @classmethod
    def setup_class(cls) -> None:
        cls.harness = cls.make_harness()

    @classmethod
    def teardown_class(cls) -> None:
        codes = cls.harness.close()
        assert all(c == 0 for c in codes), f"peer process exit codes {codes}"

    def test_registration(self) -> None:
        check_registration(self.harness)

    def test_read_block_shapes(self) -> None:
        check_read_block_shapes(self.harness)

    def test_write_block_shapes(self) -> None:
        check_write_block_shapes(self.harness)

    def test_descriptor_shapes(self) -> None:
        check_descriptor_shapes(self.harness)

    def test_chunk_and_window_modes(self) -> None:
        check_chunk_and_window_modes(self.harness)

    def test_chain_lists(self) -> None:
        check_chain_lists(self.harness)

    def test_notifications(self) -> None:
        check_notifications(self.harness)

    def test_status_nonblocking(self) -> None:
        check_status_nonblocking(self.harness)

    def test_release_idempotent(self) -> None:
        check_release_idempotent(self.harness)

    def test_removed_peer(self) -> None:
        check_removed_peer(self.harness)

    def test_invalid_ids(self) -> None:
        check_invalid_ids(self.harness)

    def test_close(self) -> None:
        check_close(self.harness)

    def test_peer_exit(self) -> None:
        check_peer_exit(self.harness)
