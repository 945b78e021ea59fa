"""Mixed-precision MILP solver: exactness against enumeration, budgets, ties, Pareto front, errors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from quantkit.errors import RecipeError
from quantkit.search.solver import Edge, Problem, Solution, pareto_front, pareto_mask, solve, spearman


def _random_problem(seed: int, n: int = 5, nf: int = 3, edges: bool = True) -> Problem:
    rng = np.random.default_rng(seed)
    units = [f"u{i}" for i in range(n)]
    names = [f"f{j}" for j in range(nf)]
    formats = {u: [str(f) for f in rng.permutation(names)[: int(rng.integers(1, nf + 1))]] for u in units}
    # some measured damages are slightly negative: they are clamped to 0
    damage = {(u, f): float(rng.uniform(-0.1, 1.0)) for u in units for f in formats[u]}
    costs = {
        m: {(u, f): float(rng.uniform(0.0, 10.0)) for u in units for f in formats[u]}
        for m in ("bytes", "lat")
    }
    es = []
    if edges:
        for i in range(n - 1):
            u, v = units[i], units[i + 1]
            pairs = {(a, b): float(rng.uniform(0.0, 3.0)) for a in formats[u] for b in formats[v] if a != b}
            es.append(Edge(u, v, "lat", pairs))
    return Problem(units, formats, damage, costs, base={"lat": 1.5}, edges=es)


def _enumerate(p: Problem) -> list[tuple[dict[str, str], dict[str, float]]]:
    out = []
    for combo in itertools.product(*[p.formats[u] for u in p.units]):
        a = dict(zip(p.units, combo, strict=True))
        vals = {"damage": sum(max(0.0, p.damage[(u, a[u])]) for u in p.units)}
        for m, table in p.costs.items():
            vals[m] = p.base.get(m, 0.0) + sum(table[(u, a[u])] for u in p.units)
        for e in p.edges:
            vals[e.metric] += e.cost.get((a[e.u], a[e.v]), 0.0)
        out.append((a, vals))
    return out


def _brute(p: Problem, minimize: str, budgets: dict[str, float]) -> float | None:
    feasible = [v[minimize] for _, v in _enumerate(p) if all(v[k] <= b for k, b in budgets.items())]
    return min(feasible) if feasible else None


def _check(p: Problem, s: Solution) -> None:
    """The solution's reported numbers are those of its assignment."""
    [(_, vals)] = [(a, v) for a, v in _enumerate(p) if a == s.assignment]
    assert s.damage == pytest.approx(vals["damage"], abs=1e-12)
    for m in p.costs:
        assert s.costs[m] == pytest.approx(vals[m], abs=1e-12)


# -- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_solve_matches_enumeration(seed: int) -> None:
    p = _random_problem(seed)
    allv = [v for _, v in _enumerate(p)]
    bq = float(np.quantile([v["bytes"] for v in allv], 0.3))
    lq = float(np.quantile([v["lat"] for v in allv], 0.5))
    dq = float(np.quantile([v["damage"] for v in allv], 0.4))
    cases = [
        ("damage", {}),
        ("damage", {"bytes": bq}),
        ("damage", {"bytes": bq, "lat": lq}),
        ("bytes", {"damage": dq}),
        ("lat", {"damage": dq, "bytes": bq}),
    ]
    for minimize, budgets in cases:
        s = solve(p, minimize=minimize, budgets=budgets)
        best = _brute(p, minimize, budgets)
        if best is None:
            assert s is None
            continue
        assert s is not None and s.status == "optimal"
        _check(p, s)
        got = s.damage if minimize == "damage" else s.costs[minimize]
        assert got == pytest.approx(best, rel=1e-7, abs=1e-9)
        for k, b in budgets.items():  # budgets hold exactly, not up to a solver tolerance
            assert (s.damage if k == "damage" else s.costs[k]) <= b


def test_budget_at_an_exact_assignment_value_is_reachable() -> None:
    p = _random_problem(3)
    values = sorted({v["bytes"] for _, v in _enumerate(p)})
    b = values[len(values) // 2]
    s = solve(p, budgets={"bytes": b})
    assert s is not None and s.costs["bytes"] <= b
    assert s.damage == pytest.approx(_brute(p, "damage", {"bytes": b}), abs=1e-9)


def test_infeasible_budget_returns_none() -> None:
    p = _random_problem(1)
    cheapest = min(v["bytes"] for _, v in _enumerate(p))
    assert solve(p, budgets={"bytes": cheapest * 0.999}) is None
    assert solve(p, minimize="bytes", budgets={"damage": -1.0}) is None
    assert solve(p, budgets={"bytes": math.inf}) is not None  # +inf means no bound


def test_negative_damage_is_clamped() -> None:
    p = Problem(
        ["a"],
        {"a": ["x", "y"]},
        {("a", "x"): -0.5, ("a", "y"): 0.0},
        {"bytes": {("a", "x"): 2.0, ("a", "y"): 1.0}},
    )
    s = solve(p)
    # both damages are 0 after clamping, so the tie goes to the cheaper format
    assert s is not None and s.assignment == {"a": "y"} and s.damage == 0.0


def test_edges_are_counted() -> None:
    # two units; mixing formats costs a conversion on the latency metric
    p = Problem(
        ["a", "b"],
        {"a": ["int8", "fp16"], "b": ["int8", "fp16"]},
        {("a", "int8"): 0.1, ("a", "fp16"): 0.0, ("b", "int8"): 5.0, ("b", "fp16"): 0.0},
        {"lat": {("a", "int8"): 1.0, ("a", "fp16"): 3.0, ("b", "int8"): 1.0, ("b", "fp16"): 3.0}},
        base={"lat": 10.0},
        edges=[Edge("a", "b", "lat", {("int8", "fp16"): 2.5, ("fp16", "int8"): 2.5})],
    )
    s = solve(p, minimize="lat")
    assert s is not None and s.assignment == {"a": "int8", "b": "int8"} and s.costs["lat"] == 12.0
    # latencies: int8/int8 = 12, fp16/fp16 = 16, mixed = 10 + 1 + 3 + 2.5 = 16.5; under 14 only int8/int8 fits
    s = solve(p, budgets={"lat": 14.0})
    assert s is not None and s.assignment == {"a": "int8", "b": "int8"}
    s = solve(p, budgets={"lat": 16.0})
    assert s is not None and s.assignment == {"a": "fp16", "b": "fp16"} and s.costs["lat"] == 16.0


# -- ties ---------------------------------------------------------------------------------------
def test_reverse_mode_breaks_ties_by_damage() -> None:
    # four identical-size layers: any two in int4 give the same bytes; the least damaging pair wins
    units = ["l0", "l1", "l2", "l3"]
    fmts = {u: ["int8", "int4"] for u in units}
    sens = {"l0": 3.0, "l1": 1.0, "l2": 4.0, "l3": 2.0}
    damage = {(u, "int8"): 0.0 for u in units} | {(u, "int4"): sens[u] for u in units}
    nbytes = {(u, "int8"): 100.0 for u in units} | {(u, "int4"): 50.0 for u in units}
    p = Problem(units, fmts, damage, {"bytes": nbytes})
    s = solve(p, minimize="bytes", budgets={"damage": 3.5})
    assert s is not None
    assert s.costs["bytes"] == 300.0  # two layers in int4
    assert s.damage == 3.0  # l1 + l3, the least damaging of the tied pairs
    assert s.assignment == {"l0": "int8", "l1": "int4", "l2": "int8", "l3": "int4"}
    # with ties broken by another metric instead the objective is unchanged
    lat = {(u, f): 1.0 for u in units for f in fmts[u]}
    p2 = Problem(units, fmts, damage, {"bytes": nbytes, "lat": lat})
    s2 = solve(p2, minimize="bytes", budgets={"damage": 3.5}, tiebreak="lat")
    assert s2 is not None and s2.costs["bytes"] == 300.0


def test_damage_ties_prefer_cheaper() -> None:
    units = ["a", "b"]
    fmts = {u: ["fp32", "fp16"] for u in units}
    damage = {(u, f): 0.0 for u in units for f in fmts[u]}
    nbytes = {(u, "fp32"): 4.0 for u in units} | {(u, "fp16"): 2.0 for u in units}
    s = solve(Problem(units, fmts, damage, {"bytes": nbytes}))
    assert s is not None and s.assignment == {"a": "fp16", "b": "fp16"}


# -- Pareto front -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 5])
def test_pareto_front(seed: int) -> None:
    p = _random_problem(seed, n=6)
    front = pareto_front(p, metric="bytes", points=8)
    assert len(front) >= 2
    xs = [s.costs["bytes"] for s in front]
    ys = [s.damage for s in front]
    assert xs == sorted(xs)
    assert all(x1 < x2 and y1 > y2 for x1, x2, y1, y2 in zip(xs, xs[1:], ys, ys[1:], strict=False))
    assert all(pareto_mask(xs, ys))
    assert len({tuple(sorted(s.assignment.items())) for s in front}) == len(front)
    allv = [v for _, v in _enumerate(p)]
    cheapest = min(v["bytes"] for v in allv)
    least = min(v["damage"] for v in allv)
    assert xs[0] == pytest.approx(cheapest)
    assert ys[0] == pytest.approx(min(v["damage"] for v in allv if v["bytes"] <= cheapest + 1e-12))
    assert ys[-1] == pytest.approx(least)
    # every front point is optimal for its own budget
    for s in front:
        assert s.damage == pytest.approx(_brute(p, "damage", {"bytes": s.costs["bytes"]}), abs=1e-9)


def test_pareto_front_with_extra_budget_and_errors() -> None:
    p = _random_problem(2)
    lat = sorted(v["lat"] for _, v in _enumerate(p))[len(_enumerate(p)) // 2]
    front = pareto_front(p, metric="bytes", points=5, budgets={"lat": lat})
    assert front and all(s.costs["lat"] <= lat for s in front)
    assert pareto_front(p, metric="bytes", budgets={"lat": -1.0}) == []
    with pytest.raises(RecipeError, match="'damage'"):
        pareto_front(p, metric="damage")
    with pytest.raises(RecipeError, match="points must be an integer >= 2, got 1"):
        pareto_front(p, metric="bytes", points=1)


def test_pareto_mask() -> None:
    xs = [1.0, 2.0, 2.0, 3.0, 4.0, 1.0, float("nan")]
    ys = [5.0, 3.0, 3.0, 4.0, 1.0, 6.0, 0.0]
    assert pareto_mask(xs, ys) == [True, True, True, False, True, False, False]
    assert pareto_mask([], []) == []
    assert pareto_mask([1.0], [1.0]) == [True]
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 5, 40).astype(float), rng.integers(0, 5, 40).astype(float)
    slow = [
        not any(a[j] <= a[i] and b[j] <= b[i] and (a[j] < a[i] or b[j] < b[i]) for j in range(40))
        for i in range(40)
    ]
    assert pareto_mask(list(a), list(b)) == slow
    with pytest.raises(ValueError, match="differ in length"):
        pareto_mask([1.0], [])


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties get average ranks: [1, 2.5, 2.5, 4] vs [1, 3, 2, 4]
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1], [2]))


# -- validation ---------------------------------------------------------------------------------
def _tiny() -> Problem:
    return Problem(
        ["a", "b"],
        {"a": ["x", "y"], "b": ["x"]},
        {("a", "x"): 0.0, ("a", "y"): 1.0, ("b", "x"): 0.0},
        {"bytes": {("a", "x"): 2.0, ("a", "y"): 1.0, ("b", "x"): 1.0}},
    )


def test_typed_errors() -> None:
    p = _tiny()
    with pytest.raises(RecipeError, match=r"unknown objective 'latency'; allowed: 'damage', 'bytes'"):
        solve(p, minimize="latency")
    with pytest.raises(RecipeError, match=r"unknown budget metric 'byts'; allowed: 'damage', 'bytes'"):
        solve(p, budgets={"byts": 1.0})
    with pytest.raises(RecipeError, match="budget on 'bytes' must be finite, got nan"):
        solve(p, budgets={"bytes": float("nan")})
    with pytest.raises(RecipeError, match="time_limit must be > 0"):
        solve(p, time_limit=0)

    p = _tiny()
    p.formats["b"] = []
    with pytest.raises(RecipeError, match="unit 'b' has no formats"):
        solve(p)
    p = _tiny()
    del p.damage[("a", "y")]
    with pytest.raises(RecipeError, match="damage has no entry for unit 'a' in format 'y'"):
        solve(p)
    p = _tiny()
    del p.costs["bytes"][("b", "x")]
    with pytest.raises(RecipeError, match="cost table 'bytes' has no entry for unit 'b' in format 'x'"):
        solve(p)
    p = _tiny()
    p.edges.append(Edge("a", "b", "bytes", {("y", "x"): -1.0}))
    with pytest.raises(RecipeError, match=r"negative cost -1\.0 for \('y', 'x'\)"):
        solve(p)
    p = _tiny()
    p.edges.append(Edge("a", "b", "lat", {("y", "x"): 1.0}))
    with pytest.raises(RecipeError, match="unknown metric 'lat'; metrics: 'bytes'"):
        solve(p)
    p = _tiny()
    p.edges.append(Edge("a", "b", "bytes", {("z", "x"): 1.0}))
    with pytest.raises(RecipeError, match="'z' is not a format of unit 'a'"):
        solve(p)
    p = _tiny()
    p.damage[("a", "x")] = float("inf")
    with pytest.raises(RecipeError, match="damage of unit 'a' in format 'x' must be finite"):
        solve(p)
    p = _tiny()
    p.base["lat"] = 1.0
    with pytest.raises(RecipeError, match="base has unknown metric 'lat'"):
        solve(p)


def test_scales_to_hundreds_of_units() -> None:
    rng = np.random.default_rng(0)
    fm = ["fp16", "int8", "int4"]
    bits = {"fp16": 16, "int8": 8, "int4": 4}
    units = [f"L{i}" for i in range(200)]
    params = {u: int(rng.integers(1000, 100000)) for u in units}
    sens = {u: float(rng.lognormal(0.0, 2.0)) for u in units}
    damage = {(u, f): sens[u] * 2.0 ** (-2 * bits[f]) for u in units for f in fm}
    nbytes = {(u, f): params[u] * bits[f] / 8 for u in units for f in fm}
    p = Problem(units, {u: list(fm) for u in units}, damage, {"bytes": nbytes})
    budget = sum(params.values()) * 0.75  # an average of 6 bits
    s = solve(p, budgets={"bytes": budget})
    assert s is not None and s.costs["bytes"] <= budget
    assert {"int8", "int4"} <= set(s.assignment.values())
