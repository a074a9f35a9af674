"""``kvxfer bench``: model-shaped KV transfers, kvxfer beside raw NIXL and memcpy (R-CLI-3).

The package, one module per job:

* :mod:`.cli` - the command line (``main``), the ``--quick`` preset, the case selection
  and the run loop;
* :mod:`.cases` - the pure parts: model shapes, the case matrix, block lists, memory
  estimates, the bytes the descriptor algebra must move, the ratio math;
* :mod:`.runner` - the parent side: two bench processes and the script of each case;
* :mod:`.worker` - a bench process (producer or consumer): its command loop, the
  set-up of its cache and kvxfer agents, and the kvxfer transfers;
* :mod:`.side` - a bench process's state, and what both of its measurements use (block
  lists, plans, byte verification, the direct host-bounce copies);
* :mod:`.measure` - what a bench process measures beside kvxfer: raw NIXL, memcpy, the
  planning cost;
* :mod:`.raw_nixl` - the raw NIXL baseline: a bare ``nixl_agent`` on the same memory;
* :mod:`.data` - the provenance fill, the exact byte check and memcpy;
* :mod:`.tp_cases`, :mod:`.tp_runner`, :mod:`.tp_main`, :mod:`.tp_worker`,
  :mod:`.tp_push` - ``--tp``: pulls and pushes across tensor-parallel sizes (the pure
  parts; the parent; a prefill or decode rank's process, its state and set-up, its
  push commands);
* :mod:`.block_ratio` - ``--block-ratios``: pulls between block sizes (the option, the
  cases with their equal-size pulls, a case's address runs, the figures against them);
* :mod:`.netns` - two network namespaces joined by a veth pair (``--netns``);
* :mod:`.report` - cross-case figures, the bars, the table and the plot;
* :mod:`.tables` - the Markdown tables of docs/PERFORMANCE.md from ``--json`` runs
  (``kvxfer bench --tables run.jsonl``);
* :mod:`.plan_micro` - an in-process micro-bench of descriptor planning alone, no NIXL
  (``python -m kvxfer.tools.bench.plan_micro``).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvxfer bench`` (what ``kvxfer.cli`` dispatches to); see :func:`.cli.main`.

    Imported on call, so that the submodules never import the package's entry point.
    """
    from kvxfer.tools.bench.cli import main as run_bench

    return run_bench(argv)
