"""The kernel's copy between two processes, written against read (Linux CMA).

Between two processes on one host, UCX moves NIXL's READs with ``process_vm_readv`` and
its WRITEs with ``process_vm_writev``: a pull's consumer copies out of the producer, a
push's producer copies into the consumer. How fast the kernel writes into another
process against how fast it reads out of one is therefore the most a push can reach
against a pull there, whatever posts it. :func:`measure` takes that ratio in one run,
paired per rep, against a child process holding the far buffer.

The page size matters, and mostly the far side's: the kernel pins the other process's
pages as it copies, and pins a huge page's worth of them at once. On a 2-vCPU AMD VM
(kernel 6.18) it read transparent huge pages at 16 GB/s and wrote them at 12 (0.77),
but on 4 KiB pages read 6 and wrote 7 (1.1); with only the far buffer on huge pages
it read and wrote about as fast as with both (:func:`by_side`). So on one host a pull
runs at the page kind of the producer's registered memory and a push at the
consumer's (the engine's blocks where a backend registers them, host bounce's staging
buffers otherwise). NumPy asks for huge pages for large arrays (kvxfer's test caches,
the bench, the demo, host bounce's staging); torch's CPU allocator does not unless
``THP_MEM_ALLOC_ENABLE=1``; the kernel grants them where
``/sys/kernel/mm/transparent_hugepage/enabled`` allows.

``python -m kvxfer.tools.cma`` prints the four combinations of page kinds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvxfer.io.pages import huge_page_share, thp_mode

__all__ = [
    "PAGE_NAMES",
    "CmaRates",
    "by_page_size",
    "by_side",
    "describe",
    "measure",
    "numpy_pages",
    "sample_bytes",
    "thp_mode",
    "tls_note",
    "ucx_uses_cma",
]

#: The child: map and touch a buffer, print its address, hold it until stdin closes.
_CHILD = """
import ctypes, mmap, sys
m = mmap.mmap(-1, int(sys.argv[1]), flags=mmap.MAP_PRIVATE)
m.madvise(mmap.MADV_HUGEPAGE if sys.argv[2] == "1" else mmap.MADV_NOHUGEPAGE)
m.write(b"Z" * len(m))
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
sys.stdin.read()
"""
#: The page kinds :func:`by_page_size` measures, as reports name them.
PAGE_NAMES = {"huge": "huge pages", "small": "4 KiB pages"}

#: iovecs per call: the kernel's IOV_MAX.
_IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@dataclass(frozen=True)
class CmaRates:
    """One :func:`measure` run: GB/s (decimal, medians of the reps) each way."""

    read_gbps: float
    write_gbps: float
    #: ``process_vm_writev`` over ``process_vm_readv``, paired per rep, median.
    write_over_read: float
    nbytes: int
    segment: int
    #: This process's buffer asked the kernel for transparent huge pages (else
    #: refused them).
    huge_pages: bool
    #: The kernel's THP mode (``always``, ``madvise``, ``never``; '' if unknown).
    thp: str
    #: The child's (far) buffer asked for transparent huge pages: the pages a READ
    #: copies out of and a WRITE copies into, which the kernel pins as it goes.
    far_huge_pages: bool
    #: Share of this buffer the kernel backed with huge pages (``AnonHugePages``;
    #: -1.0 where ``/proc`` does not say): what was granted, not asked.
    huge_share: float = -1.0
    #: The same for the child's buffer.
    far_huge_share: float = -1.0


def measure(
    nbytes: int = 128 << 20,
    segment: int = 1 << 20,
    reps: int = 5,
    huge_pages: bool = True,
    timeout_s: float = 30.0,
    far_huge_pages: bool | None = None,
) -> CmaRates | str:
    """Copy ``nbytes`` into and out of a child process in ``segment``-byte iovecs.

    ``huge_pages``: this process's buffer asks for transparent huge pages
    (``MADV_HUGEPAGE``), as NumPy does for large arrays; ``False`` refuses them
    (``MADV_NOHUGEPAGE``). ``far_huge_pages``: the same for the child's buffer (default:
    as ``huge_pages``).

    Returns the rates, or why they could not be taken (not Linux, no
    ``process_vm_readv``, the kernel refused: ptrace rules, seccomp). Each rep reads,
    then writes, the same bytes; the ratio is taken per rep so a load change between
    reps moves both sides of it.
    """
    if nbytes <= 0 or segment <= 0 or nbytes % segment or reps < 1:
        raise ValueError(
            f"nbytes={nbytes}, segment={segment}, reps={reps}: nbytes must be a positive "
            "multiple of segment and reps >= 1"
        )
    if not sys.platform.startswith("linux"):
        return f"process_vm_readv is Linux-only (platform {sys.platform})"
    far_huge = huge_pages if far_huge_pages is None else far_huge_pages
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    calls = []
    for name in ("process_vm_readv", "process_vm_writev"):
        fn = getattr(libc, name, None)
        if fn is None:
            return f"this libc has no {name}"
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        calls.append(fn)
    # Private: an anonymous shared map is shmem, whose huge pages follow other rules.
    mine = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    mine.madvise(mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_NOHUGEPAGE)
    mine.write(b"\0" * nbytes)
    here = ctypes.c_char.from_buffer(mine)
    base = ctypes.addressof(here)
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(nbytes), "1" if far_huge else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        if not line:
            return f"the child process exited ({child.wait(timeout_s)}) before its buffer was up"
        far = int(line)
        batches = _iovecs(base, far, nbytes, segment)  # built once, off the clock
        times: list[list[float]] = [[], []]
        for _ in range(reps):
            for k, fn in enumerate(calls):
                t0 = time.perf_counter()
                err = _copy(fn, child.pid, batches)
                if err:
                    return err
                times[k].append(time.perf_counter() - t0)
            # A read that reported success must have brought the child's bytes.
            if ctypes.string_at(base, 1) + ctypes.string_at(base + nbytes - 1, 1) != b"ZZ":
                return "process_vm_readv reported success but the bytes did not arrive"
        shares = (
            huge_page_share([(base, base + nbytes)]),
            huge_page_share([(far, far + nbytes)], child.pid),
        )
    finally:
        del here  # the map's only export: it can close now
        mine.close()
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    read_s, write_s = times
    return CmaRates(
        read_gbps=nbytes / statistics.median(read_s) / 1e9,
        write_gbps=nbytes / statistics.median(write_s) / 1e9,
        write_over_read=statistics.median(r / w for r, w in zip(read_s, write_s)),
        nbytes=nbytes,
        segment=segment,
        huge_pages=huge_pages,
        thp=thp_mode(),
        far_huge_pages=far_huge,
        huge_share=shares[0],
        far_huge_share=shares[1],
    )


def numpy_pages() -> str:
    """``huge`` or ``small``: the pages the kernel gives this process's large NumPy arrays.

    NumPy asks for transparent huge pages for large arrays unless
    ``NUMPY_MADVISE_HUGEPAGE=0``; the kernel grants them in its ``madvise`` mode, always
    in ``always`` and never in ``never``.
    """
    thp = thp_mode()
    if thp in ("always", "never"):
        return "huge" if thp == "always" else "small"
    return "small" if os.environ.get("NUMPY_MADVISE_HUGEPAGE") == "0" else "huge"


#: ``UCX_TLS`` names that include CMA: itself, the shared-memory aliases and ``all``.
_CMA_NAMES = frozenset({"cma", "sm", "shm", "all"})


def ucx_uses_cma(tls: str | None) -> bool:
    """Whether UCX may copy between two processes on one host with CMA under
    ``UCX_TLS=tls`` (``None`` or empty: unset, UCX picks and CMA wins on one host).

    A list names the transports to use; a leading ``^`` names those to leave out
    (UCX's syntax). With CMA left out (``UCX_TLS=tcp,self``, as across hosts) the
    kernel's write over read says nothing about a push against a pull.
    """
    if not tls or not tls.strip():
        return True
    text = tls.strip()
    negated = text.startswith("^")
    names = {n.strip().lower() for n in text.lstrip("^").split(",") if n.strip()}
    named = bool(names & _CMA_NAMES)
    return not (names & (_CMA_NAMES - {"all"})) if negated else named


def tls_note(tls: str | None) -> str:
    """What a report says of ``UCX_TLS`` beside the network: ``""`` when unset, else
    ``" (UCX_TLS=...)"``, ending ``": no CMA"`` where it leaves the kernel's copy out."""
    if not tls:
        return ""
    return f" (UCX_TLS={tls}{'' if ucx_uses_cma(tls) else ': no CMA'})"


#: The bounds of :func:`sample_bytes`.
SAMPLE_MIN_BYTES, SAMPLE_MAX_BYTES = 16 << 20, 128 << 20


def sample_bytes(moved: int) -> int:
    """How many bytes to measure the kernel's copy with, beside a transfer of ``moved``
    bytes: as many, in whole MiB, but at least 16 MiB (a few huge pages, and reps long
    against the timer) and at most 128 MiB (the measurement, whose copies and page
    faults are mostly kernel time, stays a second or two however large the transfer)."""
    mib = 1 << 20
    return min(SAMPLE_MAX_BYTES, max(SAMPLE_MIN_BYTES, -(-moved // mib) * mib))


def by_page_size(nbytes: int = 128 << 20) -> dict[str, Any]:
    """:func:`measure` on huge pages and on 4 KiB pages, as plain JSON.

    ``{"thp": mode, "numpy_pages": kind, "huge": {...}, "small": {...}}``, each page
    kind either the fields of :class:`CmaRates` or ``{"error": why}``.
    """
    out: dict[str, Any] = {"thp": thp_mode(), "numpy_pages": numpy_pages()}
    for key, huge in (("huge", True), ("small", False)):
        rates = measure(nbytes=nbytes, huge_pages=huge)
        out[key] = {"error": rates} if isinstance(rates, str) else dataclasses.asdict(rates)
    return out


def by_side(nbytes: int = 128 << 20) -> list[dict[str, Any]]:
    """:func:`measure` for each pairing of page kinds, this process's (``here``, the
    reader or writer) and the child's (``far``, whose pages the kernel pins), as plain
    JSON rows: ``{"here": kind, "far": kind, **rates}`` or ``{..., "error": why}``."""
    rows: list[dict[str, Any]] = []
    for here in (True, False):
        for far in (True, False):
            rates = measure(nbytes=nbytes, huge_pages=here, far_huge_pages=far)
            row: dict[str, Any] = {"here": _kind(here), "far": _kind(far)}
            row.update({"error": rates} if isinstance(rates, str) else dataclasses.asdict(rates))
            rows.append(row)
    return rows


def side_table(rows: list[dict[str, Any]]) -> str:
    """:func:`by_side`'s rows as a text table, with what the kernel granted."""
    out = [
        f"{'this side':<12} {'far side':<12} {'read GB/s':>9} {'write GB/s':>10} "
        f"{'write/read':>10}  huge-page share here / far"
    ]
    for r in rows:
        head = f"{PAGE_NAMES[r['here']]:<12} {PAGE_NAMES[r['far']]:<12}"
        if "error" in r:
            out.append(f"{head} not measured: {r['error']}")
            continue
        out.append(
            f"{head} {r['read_gbps']:>9.1f} {r['write_gbps']:>10.1f} "
            f"{r['write_over_read']:>10.2f}  {_share(r['huge_share'])} / "
            f"{_share(r['far_huge_share'])}"
        )
    return "\n".join(out)


def _kind(huge: bool) -> str:
    return "huge" if huge else "small"


def _share(share: float) -> str:
    return "?" if share < 0 else f"{share:.2f}"


def describe(rates: dict[str, Any]) -> str:
    """One line for a report: the kernel's write over read on each page kind."""
    parts = []
    for key, name in PAGE_NAMES.items():
        r = rates.get(key) or {}
        if "write_over_read" in r:
            parts.append(
                f"{r['write_over_read']:.2f} on {name} "
                f"({r['write_gbps']:.1f} / {r['read_gbps']:.1f} GB/s)"
            )
        else:
            parts.append(f"{name} not measured: {r.get('error', 'no figures')}")
    return ", ".join(parts)


_Batch = tuple[ctypes.Array[_Iovec], ctypes.Array[_Iovec], int]


def _iovecs(here: int, far: int, nbytes: int, seg: int) -> list[_Batch]:
    """The buffer as (local, remote, bytes) iovec arrays of at most IOV_MAX segments."""
    count, done, batches = nbytes // seg, 0, []
    while done < count:
        k = min(_IOV_MAX, count - done)
        local = (_Iovec * k)(*[_Iovec(here + (done + i) * seg, seg) for i in range(k)])
        remote = (_Iovec * k)(*[_Iovec(far + (done + i) * seg, seg) for i in range(k)])
        batches.append((local, remote, k * seg))
        done += k
    return batches


def _copy(fn: Callable[..., int], pid: int, batches: list[_Batch]) -> str:
    """One pass over the buffer; '' or why it failed."""
    for local, remote, size in batches:
        moved = fn(pid, local, len(local), remote, len(remote), 0)
        if moved != size:
            name = getattr(fn, "__name__", "copy")
            return f"{name} moved {moved} of {size} bytes (errno {ctypes.get_errno()})"
    return ""


if __name__ == "__main__":  # pragma: no cover - a quick look from a shell
    print(
        f"process_vm_readv (read) and process_vm_writev (write) of 128 MiB against a "
        f"child process, THP mode {thp_mode() or '?'}:"
    )
    print(side_table(by_side()))
    print(
        "A pull's consumer reads the producer's pages and a push's producer writes the "
        "consumer's: the far side's page kind is the one that counts."
    )
