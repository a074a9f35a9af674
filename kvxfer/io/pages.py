"""What the kernel backs memory with: transparent huge pages or 4 KiB ones (Linux).

Between two processes on one host UCX copies with ``process_vm_readv``/``writev``,
which pin the other process's pages as they go; on huge pages that runs 2-2.5x as
fast as on 4 KiB ones (docs/PERFORMANCE.md, push against pull). Memory gets huge
pages only where its allocator asks for them (NumPy does for large arrays; torch's CPU
allocator only with ``THP_MEM_ALLOC_ENABLE=1``) and the kernel's mode allows. These
read what was granted, from ``/proc`` (:mod:`kvxfer.tools.cma` reports it beside its
rates; an embedder can check its own registered memory).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

__all__ = ["huge_page_share", "thp_mode"]

_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), ''
    where it does not say."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _mappings(pid: int | str) -> list[tuple[int, int, int]]:
    """``(start, end, huge bytes)`` of each mapping in ``/proc/<pid>/smaps``, by start
    (raises OSError or ValueError where it cannot be read)."""
    out: list[tuple[int, int, int]] = []
    lo = hi = -1
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if head.endswith(":"):
                if head == "AnonHugePages:" and lo >= 0:
                    out.append((lo, hi, int(line.split()[1]) * 1024))
                    lo = -1
            elif "-" in head:  # a mapping's first line: "start-end perms offset ..."
                start, _, end = head.partition("-")
                lo, hi = int(start, 16), int(end, 16)
    out.sort()
    return out


def huge_page_share(ranges: Iterable[tuple[int, int]], pid: int | str = "self") -> float:
    """Share of the bytes in ``ranges`` (``[start, end)`` addresses in process ``pid``)
    that the kernel backs with transparent huge pages, or -1.0 where ``/proc`` does not
    say (not Linux, no such process, none of the bytes mapped, device memory).

    ``smaps`` counts huge pages per mapping, so a range is credited with its mapping's
    share (``AnonHugePages`` over the mapping's size) for the bytes it holds of it.
    """
    spans = [(int(a), int(b)) for a, b in ranges if int(b) > int(a)]
    if not spans:
        return -1.0
    try:
        maps = _mappings(pid)
    except (OSError, ValueError):
        return -1.0
    starts = [m[0] for m in maps]
    covered = huge = 0.0
    for a, b in spans:
        k = max(bisect.bisect_right(starts, a) - 1, 0)
        while k < len(maps) and maps[k][0] < b:
            lo, hi, big = maps[k]
            held = min(b, hi) - max(a, lo)
            if held > 0:
                covered += held
                huge += held * min(1.0, big / (hi - lo))
            k += 1
    return huge / covered if covered else -1.0
