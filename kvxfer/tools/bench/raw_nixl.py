"""Raw NIXL for ``kvxfer bench``: the same memory and descriptors, no kvxfer in the loop.

One :class:`RawNixl` per bench process: a plain ``nixl_agent`` with the UCX plugin that
registers the very buffers the kvxfer agent registered, prepares descriptor lists from
the same :class:`~kvxfer.core.descriptors.DescriptorTable` arrays and posts
``make_prepped_xfer`` with the same index arrays :func:`~kvxfer.core.descriptors.build_plan`
produced. A background thread keeps its UCX worker progressing (connection set-up and
notifications need the passive side to progress, as kvxfer's progress thread does);
every NIXL call goes through one lock because NIXL agents without a listener thread
are not thread-safe.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxfer.backends.ucx import import_nixl, merged_intervals
from kvxfer.core.descriptors import DescriptorTable
from kvxfer.core.layout import KVLayout, MemKind

__all__ = ["RawNixl"]


def _extents(layout: KVLayout) -> list[tuple[int, int]]:
    starts = np.array([r.base for r in layout.regions], dtype=np.uint64)
    ends = np.array([r.end for r in layout.regions], dtype=np.uint64)
    return merged_intervals(starts, ends)


def _rows(table: DescriptorTable) -> npt.NDArray[np.uint64]:
    rows = np.stack([table.addr, table.length, table.device.astype(np.uint64)], axis=1)
    return np.ascontiguousarray(rows, dtype=np.uint64)


class RawNixl:
    """A bare NIXL agent (UCX; host or device memory) with a polling thread."""

    def __init__(self, name: str, poll_interval_s: float = 0.001) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        conf = nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]
        )
        self.name = name
        self.mem = "DRAM"  # NIXL's name of the memory last registered (see register)
        self._nixl: Any = nixl_agent(name, conf)
        self._lock = threading.Lock()
        self._notifs: list[bytes] = []
        self._peers: set[str] = set()
        self._closed = False
        self._interval = poll_interval_s
        # Cleared while the main thread busy-polls itself: the poller then sleeps without
        # asking for the GIL, so it cannot slow the measured loop down.
        self._idle = threading.Event()
        self._idle.set()
        # Cleared while kvxfer's transfer of a rep runs (see pause()).
        self._enabled = threading.Event()
        self._enabled.set()
        self.polls = 0  # background drains so far (a test reads it across a pause)
        self._thread = threading.Thread(target=self._poll, name="raw-nixl-poll", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop the background polls while kvxfer's side of a rep runs: they serve only
        raw NIXL's transfers, and would be load on kvxfer's (two more wakeups a
        millisecond on a small host) that raw NIXL's transfers do not carry, since
        kvxfer's progress threads idle through those.

        Once it returns no background poll runs until resume(): a poll already past
        its wait finishes under the lock taken here, and the poller checks the flag
        again under that lock before it drains."""
        self._enabled.clear()
        with self._lock:
            pass

    def resume(self) -> None:
        """Poll in the background again (raw NIXL's side of a rep)."""
        self._enabled.set()

    def _poll(self) -> None:
        while not self._closed:
            self._idle.wait()
            self._enabled.wait()
            with self._lock:
                if self._closed:
                    return
                if not self._enabled.is_set():
                    continue  # paused between its wait and the lock
                self._drain_locked()
                self.polls += 1
            time.sleep(self._interval)

    def _drain_locked(self) -> None:
        for msgs in self._nixl.get_new_notifs().values():
            self._notifs.extend(msgs)
        del self._notifs[:-256]  # nobody waits for old ones

    # -- memory and peers -----------------------------------------------------------
    def register(self, layout: KVLayout) -> Any:
        """Register the layout's memory (VRAM when it is device memory, else DRAM);
        returns the handle for deregister. The descriptor lists prepared and built
        after it name the same kind: the bench registers the memory a case moves
        last (the cache, or host bounce's staging after it)."""
        device = {r.device_id for r in layout.regions if r.mem is MemKind.VRAM}
        self.mem = "VRAM" if device else "DRAM"
        dev = min(device) if device else 0
        descs = [(s, e - s, dev, "") for s, e in _extents(layout)]
        with self._lock:
            return self._nixl.register_memory(descs, self.mem, ["UCX"])

    def deregister(self, handle: Any) -> None:
        with self._lock:
            self._nixl.deregister_memory(handle)

    def metadata(self) -> bytes:
        with self._lock:
            blob: bytes = self._nixl.get_agent_metadata()
            return blob

    def add_peer(self, metadata: bytes) -> str:
        """Add (or refresh, after new registrations) a peer; returns its name."""
        with self._lock:
            raw = self._nixl.add_remote_agent(metadata)
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._peers.add(name)
            return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if name in self._peers:
                self._peers.discard(name)
                self._nixl.remove_remote_agent(name)

    def prep(self, peer: str | None, table: DescriptorTable) -> Any:
        """A prepared descriptor list of ``table`` (local when ``peer`` is None)."""
        with self._lock:
            return self._nixl.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", _rows(table), self.mem)

    def release(self, dlist: Any) -> None:
        with self._lock:
            dlist.release()

    # -- transfers ------------------------------------------------------------------
    def xfer(
        self,
        op: str,
        local: Any,
        local_ids: npt.NDArray[np.int32],
        remote: Any,
        remote_ids: npt.NDArray[np.int32],
        notif: bytes,
        timeout_s: float,
    ) -> tuple[float, float]:
        """Post one transfer (``notif`` rides with it) and busy-poll it to completion.

        Returns:
            ``(seconds from make_prepped_xfer to DONE, seconds of make_prepped_xfer)``.
        """
        make = functools.partial(
            self._nixl.make_prepped_xfer, op, local, local_ids, remote, remote_ids, notif
        )
        return self._post_one(op, make, timeout_s)

    def _post_one(self, op: str, make: Callable[[], Any], timeout_s: float) -> tuple[float, float]:
        """Make one transfer, post it and busy-poll it to completion; returns ``(seconds
        from the make to DONE, seconds of the make)``."""
        deadline = time.monotonic() + timeout_s
        self._idle.clear()
        try:
            with self._lock:
                t0 = time.perf_counter()
                handle = make()
                t1 = time.perf_counter()
                state = self._nixl.transfer(handle)
                while state == "PROC" and time.monotonic() < deadline:
                    state = self._nixl.check_xfer_state(handle)
                t2 = time.perf_counter()
                handle.release()
        finally:
            self._idle.set()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL {op} ended in state {state}")
        return t2 - t0, t1 - t0

    def xfer_many(
        self,
        op: str,
        posts: Sequence[tuple[Any, npt.NDArray[np.int32], Any, npt.NDArray[np.int32]]],
        notif: bytes,
        timeout_s: float,
    ) -> float:
        """Post one transfer per ``(local, local_ids, remote, remote_ids)`` (one per
        peer: a pull across TP sizes reads several producer ranks in one request), all
        before polling any, then busy-poll them all to completion.

        Returns:
            seconds from the first ``make_prepped_xfer`` to the last DONE.
        """
        makers = [
            functools.partial(self._nixl.make_prepped_xfer, op, local, lids, remote, rids, notif)
            for local, lids, remote, rids in posts
        ]
        return self._post_all(op, makers, timeout_s)

    def _post_all(self, op: str, makers: Sequence[Callable[[], Any]], timeout_s: float) -> float:
        """Make and post one transfer per maker, all before polling any, then wait for
        them all; returns seconds from the first make to the last DONE."""
        deadline = time.monotonic() + timeout_s
        self._idle.clear()
        handles: list[Any] = []
        try:
            with self._lock:
                t0 = time.perf_counter()
                states = []
                for make in makers:
                    handles.append(make())
                    states.append(self._nixl.transfer(handles[-1]))
                states = self._wait_all(handles, states, deadline)
                t1 = time.perf_counter()
                for h in handles:
                    h.release()
        finally:
            self._idle.set()
        if any(s != "DONE" for s in states):
            raise RuntimeError(f"raw NIXL {op}s ended in states {states}")
        return t1 - t0

    def _wait_all(self, handles: list[Any], states: list[str], deadline: float) -> list[str]:
        """Busy-poll every posted handle until none is in progress or the deadline."""
        while "PROC" in states and time.monotonic() < deadline:
            states = [
                self._nixl.check_xfer_state(h) if s == "PROC" else s
                for h, s in zip(handles, states, strict=True)
            ]
        return states

    def _runs_xfer(self, op: str, runs: Any, peer: str, notif: bytes) -> Any:
        """One transfer of per-request ``(addr, length, device)`` lists built from
        pre-merged runs, initialized (not posted)."""
        local = np.stack([runs.local_addr, runs.length, runs.local_device.astype(np.uint64)], 1)
        remote = np.stack([runs.remote_addr, runs.length, runs.remote_device.astype(np.uint64)], 1)
        ld = self._nixl.get_xfer_descs(np.ascontiguousarray(local, np.uint64), self.mem)
        rd = self._nixl.get_xfer_descs(np.ascontiguousarray(remote, np.uint64), self.mem)
        return self._nixl.initialize_xfer(op, ld, rd, peer, notif)

    def xfer_runs_many(
        self, op: str, posts: Sequence[tuple[Any, str]], notif: bytes, timeout_s: float
    ) -> float:
        """Post pre-merged runs (``RankPlan.runs``), one ``initialize_xfer`` per
        ``(runs, peer)``, all before polling any, and wait for them all.

        Returns:
            seconds from building the first lists to the last DONE.
        """
        makers = [functools.partial(self._runs_xfer, op, runs, peer, notif) for runs, peer in posts]
        return self._post_all(op, makers, timeout_s)

    def time_request(
        self,
        op: str,
        local: Any,
        local_ids: npt.NDArray[np.int32],
        remote: Any,
        remote_ids: npt.NDArray[np.int32],
    ) -> float:
        """Seconds ``make_prepped_xfer`` takes to build a request, which is released
        unposted (NIXL's share of planning)."""
        with self._lock:
            t0 = time.perf_counter()
            handle = self._nixl.make_prepped_xfer(op, local, local_ids, remote, remote_ids, b"")
            t1 = time.perf_counter()
            handle.release()
        return t1 - t0

    def xfer_runs(
        self, op: str, runs: Any, peer: str, notif: bytes, timeout_s: float
    ) -> tuple[float, float]:
        """Post pre-merged runs (``Plan.runs``) with ``initialize_xfer`` and wait.

        The alternative to prepared lists + indices: descriptor lists built per request.

        Returns:
            ``(seconds from building the lists to DONE, seconds to build and initialize)``.
        """
        return self._post_one(
            op, functools.partial(self._runs_xfer, op, runs, peer, notif), timeout_s
        )

    def wait_notif(self, tag: bytes, timeout_s: float, poll_s: float = 0.0002) -> float:
        """Poll for a notification carrying ``tag``; returns when it was seen."""
        deadline = time.monotonic() + timeout_s
        self._idle.clear()
        try:
            while True:
                with self._lock:
                    self._drain_locked()
                    if tag in self._notifs:
                        seen = time.perf_counter()
                        self._notifs = [m for m in self._notifs if m != tag]
                        return seen
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw NIXL notification {tag!r} did not arrive")
                # A short sleep, not a spin: on a small box a spinning receiver steals
                # the core the writer copies with.
                time.sleep(poll_s)
        finally:
            self._idle.set()

    def forget_notifs(self) -> None:
        with self._lock:
            self._drain_locked()
            self._notifs.clear()

    def close(self) -> None:
        """Stop polling and drop the agent (peers first)."""
        self._idle.set()
        self._enabled.set()
        with self._lock:
            self._closed = True
            for name in list(self._peers):
                with contextlib.suppress(Exception):  # a peer already gone: nothing to undo
                    self._nixl.remove_remote_agent(name)
            self._peers.clear()
        self._thread.join(timeout=2)
        self._nixl = None
