"""Two connected backend endpoints and one verified transfer at a time.

A :class:`Harness` pairs a local :class:`~kvxfer.testing._endpoint.Endpoint` (in the
test process) with a peer endpoint, which lives in the same process for backends whose
fabric is in-process (``fake``) and otherwise in a spawned child process
(:class:`~kvxfer.testing._endpoint.SpawnedEndpoint`). :meth:`Harness.post_ids` fills
both sides with fresh patterns, posts one transfer, follows it to completion while
watching for its notification, and reports what the receiver must and does hold.
"""

from __future__ import annotations

import itertools
import os
import time

import msgspec
import numpy as np
import numpy.typing as npt

from kvxfer.backend import Capabilities, XferOp, XferStatus
from kvxfer.core.block_lists import ChainLists
from kvxfer.core.descriptors import DescriptorTable, PlanOptions
from kvxfer.testing._endpoint import (
    BackendSpec,
    Endpoint,
    EndpointLike,
    Groups,
    SpawnedEndpoint,
)
from kvxfer.testing.patterns import CacheShape, expected_after

__all__ = ["BackendSpec", "CacheShape", "Harness", "Moved"]

IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]

_names = itertools.count()


class Moved(msgspec.Struct, kw_only=True):
    """The outcome of one transfer driven by :meth:`Harness.post_ids`."""

    status: XferStatus
    expected: ByteArray  # the receiver's memory if every byte landed
    received: ByteArray | None  # the receiver's memory after completion (+ stage-in)
    notifications: list[tuple[str, bytes]]
    at_notification: ByteArray | None  # receiver memory when the notification was seen
    slowest_status_s: float


class Harness:
    """A local endpoint connected to a peer endpoint (see the module docstring).

    Args:
        spec: The backend under test.
        shape: The test cache's shape (default :class:`CacheShape` with ``spec.mem``).
    """

    def __init__(self, spec: BackendSpec, shape: CacheShape | None = None) -> None:
        self.spec = spec
        self.shape = shape if shape is not None else CacheShape(mem=spec.mem)
        self._spawned: list[SpawnedEndpoint] = []
        self._locals: list[Endpoint] = []
        self.exit_codes: list[int | None] = []
        self.remote = self.new_remote()  # starts first: a child takes seconds to boot
        try:
            self.local = self.new_local()
            self.remote_info = self.remote.info()
            self.peer = self.local.connect(self.remote_info)
        except BaseException:
            self.close()
            raise
        self.options = PlanOptions()
        self._seeds = itertools.count(1)

    # -- endpoints --------------------------------------------------------------------
    def _name(self, role: str) -> str:
        return f"{self.spec.name}-{role}-{os.getpid()}-{next(_names)}"

    def new_local(self) -> Endpoint:
        """A fresh endpoint in this process (closed with the harness)."""
        ep = Endpoint(self.spec, self._name("local"), self.shape)
        self._locals.append(ep)
        return ep

    def new_remote(self) -> EndpointLike:
        """A fresh peer endpoint (a child process unless ``spec.in_process``)."""
        if self.spec.in_process:
            ep = Endpoint(self.spec, self._name("peer"), self.shape)
            self._locals.append(ep)
            return ep
        spawned = SpawnedEndpoint(self.spec, self._name("peer"), self.shape)
        spawned.while_waiting = self._progress_locals
        self._spawned.append(spawned)
        return spawned

    def _progress_locals(self) -> None:
        for ep in self._locals:
            if not ep.closed:
                ep.pump()

    @property
    def caps(self) -> Capabilities:
        """Capabilities of the backend under test."""
        return self.local.backend.capabilities

    @property
    def remote_table(self) -> DescriptorTable:
        """The peer's descriptor table as the local endpoint prepared it."""
        return self.local.peer_tables[self.peer]

    def use_options(self, options: PlanOptions) -> None:
        """Rebuild both tables for ``options`` and reconnect."""
        if options == self.options:
            return
        self.local.configure(options)
        self.remote.configure(options)
        self.options = options
        self.reconnect()

    def reconnect(self) -> None:
        """Connect the local endpoint to the peer again (after a removal)."""
        self.peer = self.local.connect(self.remote_info)

    # -- transfers --------------------------------------------------------------------
    def post_ids(
        self,
        op: XferOp,
        local_ids: IntArray,
        remote_ids: IntArray,
        *,
        local_groups: Groups | None = None,
        remote_groups: Groups | None = None,
        notification: bytes = b"",
        timeout: float = 30.0,
        rows: tuple[ChainLists, IntArray, IntArray] | None = None,
    ) -> Moved:
        """Fill both sides with fresh patterns, post one transfer, wait and report.

        ``local_groups`` / ``remote_groups`` are the blocks per group the ids cover;
        backends staging through host memory get them staged out on the sender and in
        on the receiver, as the agent does. ``rows``: post these rows of chain lists
        (:meth:`Backend.post_lists <kvxfer.backend.Backend.post_lists>`) instead; the
        ids, on the prepared tables, say which bytes they must move.
        """
        ls, rs = next(self._seeds), next(self._seeds)
        self.local.fill(ls)
        self.remote.fill(rs)
        backend = self.local.backend
        stages = self.caps.stages_through_host
        if stages and (local_groups is None or remote_groups is None):
            raise AssertionError("a staging backend needs the block lists of the transfer")
        send, recv = (self.remote, self.local) if op is XferOp.READ else (self.local, self.remote)
        send_groups, recv_groups = (
            (remote_groups, local_groups) if op is XferOp.READ else (local_groups, remote_groups)
        )
        if stages and send_groups is not None:
            send.stage_out(send_groups)
        self.remote.collect()  # forget anything earlier
        if op is XferOp.WRITE:
            self.remote.arm(recv_groups if stages else None)
        lids = np.asarray(local_ids, dtype=np.int64)
        rids = np.asarray(remote_ids, dtype=np.int64)
        if rows is None:
            handle = backend.post(op, self.peer, lids, rids, notification)
        else:
            handle = backend.post_lists(op, self.peer, *rows, notification)
        notes: list[tuple[str, bytes]] = []
        at_note: ByteArray | None = None
        slowest = 0.0
        deadline = time.monotonic() + timeout
        state = XferStatus.PENDING
        try:
            while True:
                # Look for the notification before every poll, the first included: one
                # that shows up before the transfer moved its bytes is caught here.
                got = self.remote.collect()
                if got.notifications:
                    if op is XferOp.READ and at_note is None:
                        at_note = self.local.snapshot()
                    elif got.snapshot is not None:
                        at_note = got.snapshot
                    notes.extend(got.notifications)
                waiting_note = bool(notification) and not notes
                if state is XferStatus.FAILED or (state is XferStatus.DONE and not waiting_note):
                    break
                if time.monotonic() > deadline:
                    break
                t0 = time.perf_counter()
                state = backend.status(handle)
                slowest = max(slowest, time.perf_counter() - t0)
                if state is XferStatus.PENDING:
                    time.sleep(0.0002)
        finally:
            backend.release(handle)
        if notification and state is XferStatus.DONE:
            # Give a duplicate a moment to show up, so "exactly once" is checked.
            end = time.monotonic() + 0.05
            while time.monotonic() < end:
                notes.extend(self.remote.collect().notifications)
                time.sleep(0.002)
        received: ByteArray | None = None
        if state is XferStatus.DONE:
            if op is XferOp.READ and stages and recv_groups is not None:
                recv.stage_in(recv_groups)
            if op is XferOp.WRITE and stages and not notification and recv_groups is not None:
                recv.stage_in(recv_groups)
            received = (
                recv.snapshot() if not (op is XferOp.WRITE and stages and notification) else at_note
            )
        local_pair = (self.local.table, lids)
        remote_pair = (self.remote_table, rids)
        if op is XferOp.READ:
            expected = expected_after(self.local.cache, ls, rs, local_pair, remote_pair)
        else:
            expected = expected_after(self.local.cache, rs, ls, remote_pair, local_pair)
        return Moved(
            status=state,
            expected=expected,
            received=received,
            notifications=notes,
            at_notification=at_note,
            slowest_status_s=slowest,
        )

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> list[int | None]:
        """Close every endpoint; returns the exit codes of the child processes."""
        for ep in self._locals:
            ep.close()
        self._locals.clear()
        for sp in self._spawned:
            self.exit_codes.append(sp.close())
        self._spawned.clear()
        return self.exit_codes
