"""The import graph of kvxfer has no cycle: no module imports itself back through any
chain of imports, counting imports inside functions and under ``TYPE_CHECKING``, across
the symlinked ``kvxfer.backends`` and ``kvxfer.adapters`` packages.

The layering itself is import-linter's (``[tool.importlinter]`` in pyproject.toml, run
by scripts/run_tests.sh); its acyclic contract compares sibling packages only, so a
circle through a package's ``__init__`` would pass it. This test looks at modules.
"""

from __future__ import annotations

import grimp
import pytest


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("kvxfer", cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_every_kind_of_import(graph: grimp.ImportGraph) -> None:
    # Without these the test below would pass on a graph that misses imports.
    assert "kvxfer.backends.ucx" in graph.modules  # through the symlink
    assert "kvxfer.adapters.vllm.worker" in graph.modules
    # under TYPE_CHECKING only
    assert graph.direct_import_exists(importer="kvxfer.transfer", imported="kvxfer.backend")
    # inside a function only
    assert graph.direct_import_exists(importer="kvxfer.tools.bench.worker", imported="kvxfer.agent")


def test_the_cycle_finder_finds_a_cycle() -> None:
    g = grimp.ImportGraph()
    for name in ("p.a", "p.b", "p.c", "p.d"):
        g.add_module(name)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    g.add_import(importer="p.c", imported="p.a")
    g.add_import(importer="p.d", imported="p.a")
    assert _cycles(g) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycle_in_kvxfer(graph: grimp.ImportGraph) -> None:
    cycles = _cycles(graph)
    described = [
        " -> ".join(
            f"{m} (imports {sorted(set(graph.find_modules_directly_imported_by(m)) & set(c))})"
            for m in c
        )
        for c in cycles
    ]
    assert cycles == [], "import cycles:\n" + "\n".join(described)


def test_nixl_is_imported_by_the_one_edge_only() -> None:
    """kvxfer.backends._nixl is the one module that imports NIXL (its errors mapped
    there); tools and backends reach NIXL through it (issue 28)."""
    external = grimp.build_graph("kvxfer", include_external_packages=True, cache_dir=None)
    importers = external.find_modules_that_directly_import("nixl")
    assert importers == {"kvxfer.backends._nixl"}, sorted(importers)
