"""The package's floors: no import cycle between quantkit's folders / top-level modules, and the search
never imports the API (it is handed the pipeline's pieces instead)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "quantkit"


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "quantkit":
        return None
    return "quantkit" if len(parts) == 1 else parts[1]


def _graph() -> dict[str, set[str]]:
    """Every import statement (module level and inside functions) between quantkit's units."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        mod = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        src = _unit(mod)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                dst = _unit(name)
                if src and dst and dst != src:
                    edges[src].add(dst)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_quantkit_folders() -> None:
    assert _cycles(_graph()) == []


def test_the_search_does_not_import_the_api() -> None:
    g = _graph()
    assert "api" not in g["search"] and "cli" not in g["search"]


# Floors, bottom to top: a unit may import only from its own floor or below (and no cycle within a floor).
FLOORS: list[set[str]] = [
    {"errors", "registry", "_version", "ops", "progress", "checksum", "tempdirs", "staging", "irtools", "threads"},
    {"scheme", "frontends", "child"},  # child: heavy work in a spawned process (the build, the mix search)
    {"calibrate", "algorithms", "data", "evaluate", "memory", "int4_kernel"},
    {"recipe"},
    {"lowering"},
    {"prep", "weight_only", "layerwise"},
    {"report"},
    {"pipeline"},
    {"formats"},  # format handlers + the lowering walk over a precision plan
    {"run", "llm_run"},  # execute, check, evaluate, report one plan
    {"search"},  # proposes plans; runs them through formats / run
    {"api", "guard", "fidelity_guard", "llm_mix"},  # guard: float islands by measured latency; fidelity_guard: by
    # measured output fidelity; llm_mix: a searched mix, streamed
    {"cli", "__main__", "quantkit"},
]


def test_every_folder_imports_only_downward() -> None:
    floor = {u: i for i, units in enumerate(FLOORS) for u in units}
    g = _graph()
    unknown = sorted((set(g) | {d for ds in g.values() for d in ds}) - set(floor))
    assert not unknown, f"place these units on a floor: {unknown}"
    upward = sorted(f"{s} (floor {floor[s]}) -> {d} (floor {floor[d]})" for s, ds in g.items() for d in ds
                    if floor[d] > floor[s])
    assert not upward, upward
