"""The moving parts of :mod:`kvxfer.backends.host_bounce`: staging copies spread over a
few threads, and transfers whose staging copies overlap their slices' transfers.

A host-bounce transfer is three copies of the same bytes: engine → staging on the
sender, staging → staging by the transport, staging → engine on the receiver. Done one
after another they cost the sum of the three. Here they overlap instead: a request's
descriptors are cut into slices at region boundaries, and while the transport moves
slice *k* a copy thread already stages slice *k + 1* out (WRITE) or slice *k − 1* in
(READ). Copies run on their own threads because numpy and torch copies, like NIXL's
post, release the GIL.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from kvxfer.backend import Backend, PeerHandle, XferHandle, XferOp, XferStatus
from kvxfer.errors import BackendError, KvxferError

__all__ = ["Copier", "CopyDirection", "CopyTask", "Pipelined", "slice_ids"]

IntArray = npt.NDArray[np.int64]
ByteArray = npt.NDArray[np.uint8]


class CopyDirection(enum.Enum):
    """Which way a staging copy goes."""

    OUT = "d2h"  # engine blocks -> staging (sender, before peers read)
    IN = "h2d"  # staging -> engine blocks (receiver, after blocks landed)


#: One region's share of a staging copy: ``(region index, sorted unique block ids)``.
CopyTask = tuple[int, IntArray]


class Copier:
    """Runs staging copies on a small pool of threads.

    Args:
        copy_one: copies one region's blocks one way (the backend's copy routine).
        threads: copies of different regions that may run at once.
    """

    def __init__(self, copy_one: Callable[[CopyDirection, CopyTask], None], threads: int) -> None:
        self._copy_one = copy_one
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvxfer-stage")
            return self._pool

    def submit(self, direction: CopyDirection, tasks: Sequence[CopyTask]) -> Future[None]:
        """Copy ``tasks`` one after another on one pool thread."""
        return self._executor().submit(self._serial, direction, tasks)

    def run(self, direction: CopyDirection, tasks: Sequence[CopyTask]) -> None:
        """Copy ``tasks`` now, spread over the pool's threads by bytes; re-raises."""
        if self.threads <= 1 or len(tasks) <= 1:
            self._serial(direction, tasks)
            return
        parts = _spread(tasks, self.threads)
        futures = [self.submit(direction, part) for part in parts[1:]]
        try:
            self._serial(direction, parts[0])  # the caller's thread takes a share too
        finally:
            for f in futures:
                f.result()

    def _serial(self, direction: CopyDirection, tasks: Sequence[CopyTask]) -> None:
        for task in tasks:
            try:
                self._copy_one(direction, task)
            except KvxferError:
                raise
            except Exception as exc:  # the engine's copy op (torch, CUDA, ...) failed
                raise BackendError(
                    f"staging copy {direction.value} of region {task[0]} failed: {exc}"
                ) from exc

    def close(self) -> None:
        """Wait for queued copies and stop the threads."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _spread(tasks: Sequence[CopyTask], n: int) -> list[list[CopyTask]]:
    """Split tasks into ``n`` parts of about equal block counts (regions stay whole)."""
    sizes = np.array([len(blocks) for _, blocks in tasks], dtype=np.int64)
    bounds = np.cumsum(sizes) * n // max(int(sizes.sum()), 1)
    parts: list[list[CopyTask]] = [[] for _ in range(n)]
    for task, part in zip(tasks, np.minimum(bounds, n - 1).tolist()):
        parts[part].append(task)
    return [p for p in parts if p] or [[]]


def slice_ids(local_ids: IntArray, num_blocks: int, slices: int) -> list[tuple[int, int]]:
    """Cut a plan's descriptor ids into about ``slices`` ``[lo, hi)`` ranges at region
    boundaries (ids are ``region * num_blocks + block``, ordered region by region)."""
    n = len(local_ids)
    if n == 0:
        return []
    region = local_ids // num_blocks
    starts = np.flatnonzero(np.diff(region)) + 1  # where a new region begins
    if slices <= 1 or not len(starts):
        return [(0, n)]
    # Cut at the region starts nearest to even shares of the descriptors.
    want = np.arange(1, slices, dtype=np.int64) * n // slices
    pos = np.clip(np.searchsorted(starts, want), 0, len(starts) - 1)
    cuts = np.unique(starts[pos]).tolist()
    edges = [0, *cuts, n]
    return [(a, z) for a, z in itertools.pairwise(edges) if z > a]


class Pipelined:
    """One engine-to-engine transfer of a staging backend, posted slice by slice.

    READ: each slice is staged in as soon as the transport reports it landed. WRITE:
    every slice's stage-out is queued first, and each slice is posted as soon as its
    copy finished. The notification goes with :meth:`Backend.notify` once every slice
    moved (so it never overtakes bytes of an earlier slice).
    """

    def __init__(
        self,
        op: XferOp,
        peer: PeerHandle,
        notification: bytes,
        tasks: list[list[CopyTask]],
    ) -> None:
        self.op = op
        self.peer = peer
        self.notification = notification
        self.tasks = tasks  # per slice: what its staging copy moves
        self.handles: list[XferHandle] = []
        self.moved: list[bool] = []
        self.staged: list[Future[None] | None] = [None] * len(tasks)
        self.notified = not notification
        self.error: str | None = None
        self.lock = threading.Lock()

    def post(
        self,
        transport: Backend,
        copier: Copier,
        posts: Sequence[Callable[[], XferHandle]],
    ) -> None:
        """Post every slice: ``posts[k]()`` posts slice *k* on ``transport`` (by table
        ids or by address runs) and returns its handle."""
        if self.op is XferOp.WRITE:
            # Stage-outs queue up on the copy threads and run ahead of the posts.
            self.staged = [copier.submit(CopyDirection.OUT, t) for t in self.tasks]
        try:
            for k, post_slice in enumerate(posts):
                staged = self.staged[k]
                if staged is not None:
                    staged.result()  # a failed copy raises here: nothing unstaged moves
                self.handles.append(post_slice())
                self.moved.append(False)
                if self.op is XferOp.READ:
                    # Transports that copy inside post (UCX over CMA) are done already:
                    # start this slice's stage-in while the next one moves.
                    self._check(transport, copier, k)
        except BaseException:
            self.release(transport)
            raise

    def _check(self, transport: Backend, copier: Copier, k: int) -> None:
        state = transport.status(self.handles[k])
        if state is XferStatus.FAILED:
            self.error = "the transport reported an error"
        elif state is XferStatus.DONE:
            self.moved[k] = True
            if self.op is XferOp.READ:
                self.staged[k] = copier.submit(CopyDirection.IN, self.tasks[k])

    def status(self, transport: Backend, copier: Copier) -> XferStatus:
        """Advance the slices (progress, stage-ins, the notification) and report."""
        with self.lock:
            if self.error is None:
                for k, moved in enumerate(self.moved):
                    if not moved:
                        self._check(transport, copier, k)
                        if self.error is not None:
                            break
            if self.error is None and all(self.moved) and not self.notified:
                try:
                    transport.notify(self.peer, self.notification)
                    self.notified = True
                except KvxferError as exc:
                    self.error = f"could not send the completion notice: {exc}"
            if self.error is None:
                for f in self.staged:
                    if f is not None and f.done() and f.exception() is not None:
                        self.error = f"staging copy failed: {f.exception()}"
            if self.error is not None:
                return XferStatus.FAILED
            pending = not all(self.moved) or not self.notified
            if any(f is not None and not f.done() for f in self.staged):
                pending = True
            return XferStatus.PENDING if pending else XferStatus.DONE

    def quiet(self, transport: Backend) -> bool:
        """Whether no byte of the job can move any more: no slice's transfer is in
        flight and no staging copy runs (a READ's stage-in writes the engine's blocks,
        so it counts as much as the transport's bytes)."""
        with self.lock:
            if any(transport.status(h) is XferStatus.PENDING for h in self.handles):
                return False
            return all(f is None or f.done() for f in self.staged)

    def release(self, transport: Backend) -> None:
        """Release every slice's transport handle; the job reports FAILED from now on
        unless it already finished."""
        with self.lock:
            for h in self.handles:
                transport.release(h)
            self.handles, self.moved = [], []
            if self.error is None:
                self.error = "released"
