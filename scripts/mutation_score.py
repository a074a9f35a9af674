"""Summarise `mutmut results --all true` (stdin): killed / total per module, survivors."""

from __future__ import annotations

import collections
import sys

KILLED = {"killed", "timeout", "caught by type check", "segfault"}


def main() -> None:
    by_module: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    survivors: list[str] = []
    for line in sys.stdin:
        name, sep, status = line.strip().rpartition(": ")
        if not sep or "__mutmut_" not in name:
            continue
        module = name.split(".x")[0]
        by_module[module][status] += 1
        if status in ("survived", "no tests"):
            survivors.append(f"{name}: {status}")
    total_killed = total = 0
    for module, counts in sorted(by_module.items()):
        checked = sum(n for s, n in counts.items() if s not in ("not checked", "skipped"))
        killed = sum(n for s, n in counts.items() if s in KILLED)
        total_killed, total = total_killed + killed, total + checked
        score = 100 * killed / checked if checked else 0.0
        print(f"{module:<22} {killed:>5} / {checked:<5} killed  {score:5.1f}%  {dict(counts)}")
    if total:
        print(
            f"{'all':<22} {total_killed:>5} / {total:<5} killed  {100 * total_killed / total:5.1f}%"
        )
    print("\nsurvivors:")
    print("\n".join(survivors) or "none")


if __name__ == "__main__":
    main()
