"""Mixed-precision assignment as a 0/1 integer program, and its damage-vs-cost Pareto front.

The problem
-----------
Choose one format ``f`` from ``F(u)`` for every decision unit ``u`` (a layer, or a group
of layers that must share a format).  With binaries ``x[u,f]`` (1 when ``u`` gets ``f``)::

    sum_f x[u,f] = 1                                            for every unit u

    D(x)   = sum_{u,f} d[u,f] x[u,f]                            predicted damage
    C_m(x) = base_m + sum_{u,f} c_m[u,f] x[u,f]
                    + sum_{edges e of metric m} sum_{(p,q)} e[p,q] x[e.u,p] x[e.v,q]

Damage is additive over units (the usual first-order sensitivity model).  An edge adds a
*transition* cost that depends on the formats of two units at once, e.g. the Quantize /
Dequantize pair (bytes moved, latency) at a boundary whose two sides got different
formats.  For every pair of units ``(a, b)`` joined by an edge, the products
``x[a,p] x[b,q]`` are linearised with continuous ``y[p,q] >= 0`` and the marginal rows::

    sum_q y[p,q] = x[a,p]   for every p,        sum_p y[p,q] = x[b,q]   for every q

For binary ``x`` these force ``y[p,q] = x[a,p] x[b,q]`` exactly (whatever the cost signs),
and their LP relaxation is much tighter than the McCormick bound
``y >= x[a,p] + x[b,q] - 1`` (which lets a fractional ``x`` make every edge free and
makes HiGHS branch a lot).  Edge costs must still be ``>= 0`` (transition costs are).
Edges of a metric that is neither minimised, budgeted nor used to break ties get no
``y`` (their cost is still reported).

Before each solve, formats dominated within their unit are dropped: ``g`` dominates ``f``
when it is no worse in damage and in every metric that enters the MILP, and in the edge
cost against every format of every neighbour (see ``_Model.undominated``); an optimal
assignment always survives.

:func:`solve` minimises ``D`` (or one ``C_m``) subject to upper bounds on any of ``D`` and
the ``C_m``; ties in the objective are broken by a second, lexicographic solve (see
:func:`solve`).  The reported :class:`Solution` numbers are recomputed exactly from the
assignment, not read from the solver.  :func:`pareto_front` sweeps a budget on one metric
between its two extremes.  The MILP is solved by HiGHS through :func:`scipy.optimize.milp`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.stats import rankdata

from quantkit.errors import QuantkitError, RecipeError

DAMAGE = "damage"
#: ``tiebreak`` value meaning "the sum of all cost metrics, each divided by its range".
ALL_METRICS = "all_metrics"

# HiGHS stops at a relative gap of 1e-4 by default; the objective is scaled to O(1) per
# unit (see ``_Model.objective``), so this asks for the true optimum in practice.
_MIP_REL_GAP = 1e-9
# Slack on the optimum when it becomes a row of the tie-breaking solve (in the objective's
# scaled units, relative to max(1, optimum)); HiGHS's own absolute gap is 1e-6.
_TIE_TOL = 1e-9
# A budget counts as exceeded beyond this relative excess (float rounding of the sums).
_BUDGET_TOL = 1e-12
_MAX_TIGHTEN = 5


@dataclass(frozen=True)
class Edge:
    """Pairwise (transition) cost between units ``u`` and ``v``, added to metric ``metric``.

    ``cost[(fu, fv)]`` is the extra cost (``>= 0``) when ``u`` gets ``fu`` and ``v`` gets
    ``fv``; pairs that are missing cost 0.
    """

    u: str
    v: str
    metric: str
    cost: Mapping[tuple[str, str], float]


@dataclass
class Problem:
    """One mixed-precision decision problem.

    * ``units`` — the decision units (unique names);
    * ``formats[u]`` — the formats ``u`` may take (non-empty, unique);
    * ``damage[(u, f)]`` — predicted damage of giving ``u`` format ``f`` (additive over units);
    * ``costs[metric][(u, f)]`` — the cost of ``u`` in ``f`` for each cost metric
      (e.g. ``"bytes"``, ``"latency_ms"``); every ``(u, f)`` must be present;
    * ``base[metric]`` — a constant part of a metric (e.g. latency of ops that are not units);
    * ``edges`` — pairwise costs, see :class:`Edge`.
    """

    units: list[str]
    formats: dict[str, list[str]]
    damage: dict[tuple[str, str], float]
    costs: dict[str, dict[tuple[str, str], float]]
    base: dict[str, float] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)


@dataclass
class Solution:
    """An assignment and its predicted totals.

    ``damage`` is ``sum_u d[u, f(u)]`` (after clamping, see :func:`solve`); ``costs[m]`` is
    ``base_m + sum_u c_m[u, f(u)] + edge costs of m``.  ``status`` is ``"optimal"`` or
    ``"time_limit"`` (a feasible but possibly sub-optimal assignment).
    """

    assignment: dict[str, str]
    damage: float
    costs: dict[str, float]
    status: str


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence C-level writes to stdout (HiGHS prints MIP debug lines that scipy cannot switch off)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (pytest capture, notebooks)
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _check_finite(value: float, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise RecipeError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(v):
        raise RecipeError(f"{what} must be finite, got {v!r}")
    return v


class _Model:
    """A validated :class:`Problem` compiled to arrays over the ``x`` variables.

    ``x`` variables are numbered unit by unit: unit ``i`` owns ``offset[i] : offset[i+1]``,
    in the order of ``formats[unit]``.
    """

    def __init__(self, problem: Problem) -> None:
        self.units = list(problem.units)
        if not self.units:
            raise RecipeError("the problem has no units")
        seen: set[str] = set()
        for u in self.units:
            if u in seen:
                raise RecipeError(f"unit {u!r} is listed twice in units")
            seen.add(u)
        self.metrics = sorted(problem.costs)
        if DAMAGE in problem.costs:
            raise RecipeError(f"{DAMAGE!r} is reserved for the predicted damage and cannot be a cost metric")
        if ALL_METRICS in problem.costs:
            raise RecipeError(f"{ALL_METRICS!r} is reserved and cannot be a cost metric")

        self.fmts: list[list[str]] = []
        self.index: dict[tuple[str, str], int] = {}
        for u in self.units:
            fs = list(problem.formats.get(u, []))
            if not fs:
                raise RecipeError(f"unit {u!r} has no formats")
            if len(set(fs)) != len(fs):
                raise RecipeError(f"unit {u!r} lists a format twice: {fs}")
            for f in fs:
                self.index[(u, f)] = len(self.index)
            self.fmts.append(fs)
        self.offset = np.cumsum([0] + [len(fs) for fs in self.fmts])
        self.nx = int(self.offset[-1])
        self.unit_of = np.repeat(np.arange(len(self.units)), [len(fs) for fs in self.fmts])

        self.damage = np.empty(self.nx)
        for (u, f), j in self.index.items():
            if (u, f) not in problem.damage:
                raise RecipeError(f"damage has no entry for unit {u!r} in format {f!r}")
            d = _check_finite(problem.damage[(u, f)], f"damage of unit {u!r} in format {f!r}")
            # A measured damage can come out slightly negative: quantisation noise that
            # happens to help on a finite calibration/evaluation set.  That is noise, not a
            # real improvement; kept negative it would reward a format for "removing"
            # damage, make totals smaller than any real effect and bend damage budgets.
            # The model is "damage >= 0, additive", so clamp to 0.
            self.damage[j] = max(d, 0.0)

        self.cost: dict[str, np.ndarray] = {}
        for m in self.metrics:
            table = problem.costs[m]
            arr = np.empty(self.nx)
            for (u, f), j in self.index.items():
                if (u, f) not in table:
                    raise RecipeError(f"cost table {m!r} has no entry for unit {u!r} in format {f!r}")
                arr[j] = _check_finite(table[(u, f)], f"{m!r} cost of unit {u!r} in format {f!r}")
            self.cost[m] = arr

        self.base: dict[str, float] = {}
        for m, b in problem.base.items():
            if m not in problem.costs:
                raise RecipeError(f"base has unknown metric {m!r}; metrics: {self._metric_list()}")
            self.base[m] = _check_finite(b, f"base of metric {m!r}")

        # metric -> (x index of one side's format, x index of the other's, cost > 0); the
        # first index is the smaller (the unit listed first).
        self.pairs: dict[str, list[tuple[int, int, float]]] = {m: [] for m in self.metrics}
        self.edge_span: dict[str, float] = {m: 0.0 for m in self.metrics}
        unit_set = set(self.units)
        for k, e in enumerate(problem.edges):
            where = f"edge {k} ({e.u!r} -> {e.v!r}, metric {e.metric!r})"
            if e.metric not in problem.costs:
                raise RecipeError(f"{where} has unknown metric {e.metric!r}; metrics: {self._metric_list()}")
            for w in (e.u, e.v):
                if w not in unit_set:
                    raise RecipeError(f"{where} names unknown unit {w!r}")
            if e.u == e.v:
                raise RecipeError(f"{where} joins unit {e.u!r} to itself")
            for pair, c in e.cost.items():
                if not (isinstance(pair, tuple) and len(pair) == 2):
                    raise RecipeError(f"{where}: cost key {pair!r} is not a (format of u, format of v) pair")
                fu, fv = pair
                if (e.u, fu) not in self.index:
                    raise RecipeError(
                        f"{where}: {fu!r} is not a format of unit {e.u!r} ({self._fmts_of(e.u)})"
                    )
                if (e.v, fv) not in self.index:
                    raise RecipeError(
                        f"{where}: {fv!r} is not a format of unit {e.v!r} ({self._fmts_of(e.v)})"
                    )
                cv = _check_finite(c, f"{where} cost of {pair!r}")
                if cv < 0:
                    raise RecipeError(
                        f"{where} has negative cost {cv!r} for {pair!r}; edge costs must be >= 0"
                    )
                if cv > 0:
                    i, j = self.index[(e.u, fu)], self.index[(e.v, fv)]
                    self.pairs[e.metric].append((min(i, j), max(i, j), cv))
            self.edge_span[e.metric] += max([0.0, *(float(c) for c in e.cost.values())])

    # -- helpers -------------------------------------------------------------------------------
    def _metric_list(self) -> str:
        return ", ".join(repr(m) for m in self.metrics) or "(none)"

    def _fmts_of(self, u: str) -> str:
        return ", ".join(repr(f) for f in self.fmts[self.units.index(u)])

    def allowed(self) -> str:
        return ", ".join(repr(m) for m in [DAMAGE, *self.metrics])

    def check_target(self, name: str, what: str) -> None:
        if name != DAMAGE and name not in self.cost:
            raise RecipeError(f"unknown {what} {name!r}; allowed: {self.allowed()}")

    # -- pruning -----------------------------------------------------------------------------
    def undominated(self, criteria: Sequence[str]) -> np.ndarray:
        """Mask of the ``x`` variables not dominated within their unit on ``criteria``.

        Format ``f`` of unit ``u`` is dominated by ``g`` when ``g`` is no worse in every
        criterion (``"damage"`` or a metric) *and* in the edge cost against every format of
        every neighbour through an edge of a criterion metric, and strictly better in one
        (or equal in all and listed first).  Replacing ``f`` by ``g`` in any assignment then
        raises neither the objective, the tie-break nor any budgeted quantity, so dropping
        ``f`` keeps an optimal solution of every MILP built from these criteria.
        """
        cols: list[np.ndarray] = [self.damage if c == DAMAGE else self.cost[c] for c in criteria]
        # (metric, neighbour's x index) -> edge cost column over this unit's x variables
        extra: list[dict[tuple[str, int], np.ndarray]] = [{} for _ in self.units]
        for m in criteria:
            for i, j, c in self.pairs.get(m, []):
                for a, b in ((i, j), (j, i)):
                    k = int(self.unit_of[a])
                    col = extra[k].get((m, b))
                    if col is None:
                        col = extra[k][(m, b)] = np.zeros(int(self.offset[k + 1] - self.offset[k]))
                    col[a - self.offset[k]] += c
        base = np.stack(cols, axis=1)
        keep = np.ones(self.nx, dtype=bool)
        for k in range(len(self.units)):
            lo, hi = int(self.offset[k]), int(self.offset[k + 1])
            if hi - lo == 1:
                continue
            A = base[lo:hi]
            if extra[k]:
                A = np.concatenate([A, np.stack(list(extra[k].values()), axis=1)], axis=1)
            le = np.all(A[:, None, :] <= A[None, :, :], axis=2)  # le[g, f]: g no worse than f
            lt = np.any(A[:, None, :] < A[None, :, :], axis=2)
            first = np.arange(hi - lo)[:, None] < np.arange(hi - lo)[None, :]  # g listed before f
            dom = le & (lt | first)
            np.fill_diagonal(dom, False)
            keep[lo:hi] = ~dom.any(axis=0)
        return keep

    # -- linear expressions over z = (x kept, y) -------------------------------------------------
    def expression(self, name: str, lay: _Layout) -> tuple[np.ndarray, float]:
        """Coefficients over ``z`` and the constant of ``D`` or ``C_m`` (or the tie-break sum)."""
        coef = np.zeros(lay.n)
        if name == DAMAGE:
            coef[: lay.nx] = self.damage[lay.xs]
            return coef, 0.0
        if name == ALL_METRICS:
            const = 0.0
            for m in self.metrics:
                s = self.span(m)
                if s > 0:
                    vec, k = self.expression(m, lay)
                    coef += vec / s
                    const += k / s
            return coef, const
        coef[: lay.nx] = self.cost[name][lay.xs]
        for i, j, c in self.pairs[name]:
            y = lay.ys.get((i, j))
            if y is not None:
                coef[lay.nx + y] += c
        return coef, self.base.get(name, 0.0)

    def span(self, m: str) -> float:
        """An upper bound on the spread of metric ``m`` over assignments."""
        c = self.cost[m]
        per_unit = np.maximum.reduceat(c, self.offset[:-1]) - np.minimum.reduceat(c, self.offset[:-1])
        return float(per_unit.sum()) + self.edge_span[m]

    # -- exact evaluation ----------------------------------------------------------------------
    def evaluate(self, choice: np.ndarray, status: str) -> Solution:
        """The exact :class:`Solution` of ``choice`` (the chosen x index of every unit)."""
        chosen = np.zeros(self.nx, dtype=bool)
        chosen[choice] = True
        costs: dict[str, float] = {}
        for m in self.metrics:
            total = self.base.get(m, 0.0) + float(self.cost[m][choice].sum())
            total += sum(c for i, j, c in self.pairs[m] if chosen[i] and chosen[j])
            costs[m] = total
        assignment = {u: self.fmts[k][int(choice[k] - self.offset[k])] for k, u in enumerate(self.units)}
        return Solution(assignment, float(self.damage[choice].sum()), costs, status)

    # -- the MILP --------------------------------------------------------------------------------
    def solve(
        self, minimize: str, budgets: Mapping[str, float], tiebreak: str | None, time_limit: float
    ) -> Solution | None:
        deadline = time.monotonic() + time_limit
        bounded: dict[str, float] = {}
        for name, b in budgets.items():
            self.check_target(name, "budget metric")
            if b != math.inf:
                bounded[name] = _check_finite(b, f"budget on {name!r}")
        secondary = tiebreak
        if secondary is None or secondary == minimize:
            secondary = ALL_METRICS if minimize == DAMAGE else DAMAGE

        active = {minimize, secondary, *bounded}
        if ALL_METRICS in active:
            active |= set(self.metrics)
        criteria = [c for c in [DAMAGE, *self.metrics] if c in active]
        lay = _Layout(self, self.undominated(criteria), [m for m in self.metrics if m in active])

        # Budget rows, scaled to max |coefficient| = 1: name -> (coefficients, rhs, scale).
        budget_rows: dict[str, tuple[np.ndarray, float, float]] = {}
        for name, b in sorted(bounded.items()):
            coef, const = self.expression(name, lay)
            rhs = b - const
            scale = float(np.max(np.abs(coef)))
            if scale == 0.0:  # the quantity does not depend on the assignment
                if rhs < -_BUDGET_TOL * max(1.0, abs(b)):
                    return None
                continue
            budget_rows[name] = (coef / scale, rhs / scale, scale)
        integrality = np.concatenate([np.ones(lay.nx), np.zeros(lay.n - lay.nx)])

        def run(objective: np.ndarray, extra: list[LinearConstraint]) -> tuple[np.ndarray, int] | int:
            """Solve; the chosen x indices and HiGHS's status, or the status when there is no x.

            HiGHS accepts rows violated by up to its feasibility tolerance (and ``x`` off
            integrality by up to its integrality tolerance).  The assignment is evaluated
            exactly; a budget it exceeds is tightened by twice the excess and the MILP
            solved again, so returned assignments respect every budget exactly.
            """
            cut = dict.fromkeys(budget_rows, 0.0)
            for _ in range(_MAX_TIGHTEN):
                rows = [lay.structure, *extra]
                rows += [LinearConstraint(c, -np.inf, r - cut[k]) for k, (c, r, _) in budget_rows.items()]
                with _quiet_stdout():
                    res = milp(
                        objective,
                        integrality=integrality,
                        bounds=Bounds(0.0, 1.0),
                        constraints=rows,
                        options={
                            "time_limit": max(deadline - time.monotonic(), 1e-3),
                            "mip_rel_gap": _MIP_REL_GAP,
                        },
                    )
                if res.x is None:
                    return int(res.status)
                choice = lay.choice_of(res.x)
                sol = self.evaluate(choice, "")
                over = False
                for k, (_, _, scale) in budget_rows.items():
                    value = sol.damage if k == DAMAGE else sol.costs[k]
                    excess = value - bounded[k]
                    if excess > _BUDGET_TOL * max(1.0, abs(bounded[k])):
                        cut[k] += 2.0 * excess / scale + 1e-12
                        over = True
                if not over:
                    return choice, int(res.status)
            raise QuantkitError(
                f"the MILP solver kept returning assignments over budget after {_MAX_TIGHTEN} tightenings"
            )

        primary = lay.objective(self.expression(minimize, lay)[0])
        out = run(primary, [])
        if isinstance(out, int):
            if out == 2:
                return None
            if out == 1:
                raise QuantkitError(
                    f"the MILP solver found no feasible assignment within time_limit={time_limit} s "
                    "(the problem is not proven infeasible); raise time_limit"
                )
            raise QuantkitError(f"the MILP solver failed with status {out}")
        choice, code = out
        status = "optimal" if code == 0 else "time_limit"

        # Ties: bound the objective by its optimum (plus a tiny slack), minimise the secondary.
        second = lay.objective(self.expression(secondary, lay)[0])
        if status == "optimal" and deadline - time.monotonic() > 0 and np.any(second):
            best = float(primary @ lay.point(choice))
            tie_row = LinearConstraint(primary, -np.inf, best + _TIE_TOL * max(1.0, abs(best)))
            out2 = run(second, [tie_row])
            if not isinstance(out2, int):
                choice2, code2 = out2
                # keep the tie-break only if it did not lose on the objective beyond the slack
                if float(primary @ lay.point(choice2)) <= best + _TIE_TOL * max(1.0, abs(best)):
                    choice = choice2
                    if code2 != 0:
                        status = "time_limit"
        return self.evaluate(choice, status)


class _Layout:
    """The MILP variables ``z = (x kept, y)`` of one solve and its structural rows.

    ``xs`` are the model's ``x`` indices that survived pruning (in unit order).  For every
    pair of units joined by an edge of a metric in ``metrics`` there is one ``y[p, q]``
    per pair of kept formats ``p`` of the first unit and ``q`` of the second, tied to
    ``x`` by ``sum_q y[p,q] = x[p]`` and ``sum_p y[p,q] = x[q]`` (see :func:`solve`).
    """

    def __init__(self, model: _Model, keep: np.ndarray, metrics: Sequence[str]) -> None:
        self.model = model
        self.xs = np.flatnonzero(keep)
        self.nx = len(self.xs)
        new = np.full(model.nx, -1, dtype=np.int64)
        new[self.xs] = np.arange(self.nx)
        self.starts = np.searchsorted(self.xs, model.offset)  # unit k owns z[starts[k]:starts[k+1]]
        self.unit_of = model.unit_of[self.xs]

        joined = sorted(
            {(int(model.unit_of[i]), int(model.unit_of[j])) for m in metrics for i, j, _ in model.pairs[m]}
        )
        self.ys: dict[tuple[int, int], int] = {}
        r_idx: list[np.ndarray] = []
        c_idx: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        n_rows = len(model.units)
        # sum_f x[u,f] = 1
        r_idx.append(self.unit_of.astype(np.int64))
        c_idx.append(np.arange(self.nx))
        vals.append(np.ones(self.nx))
        for a, b in joined:
            P = self.xs[self.starts[a] : self.starts[a + 1]]
            Q = self.xs[self.starts[b] : self.starts[b + 1]]
            base = self.nx + len(self.ys)
            for p in P:
                for q in Q:
                    self.ys[(int(p), int(q))] = len(self.ys)
            grid = base + np.arange(len(P) * len(Q)).reshape(len(P), len(Q))
            # rows n_rows + [0, |P|): sum_q y[p,q] - x[p] = 0; then |Q| rows: sum_p y[p,q] - x[q] = 0
            r_idx += [n_rows + np.repeat(np.arange(len(P)), len(Q)), n_rows + np.arange(len(P))]
            c_idx += [grid.ravel(), new[P]]
            vals += [np.ones(grid.size), -np.ones(len(P))]
            n_rows += len(P)
            r_idx += [n_rows + np.tile(np.arange(len(Q)), len(P)), n_rows + np.arange(len(Q))]
            c_idx += [grid.ravel(), new[Q]]
            vals += [np.ones(grid.size), -np.ones(len(Q))]
            n_rows += len(Q)
        self.n = self.nx + len(self.ys)
        rhs = np.zeros(n_rows)
        rhs[: len(model.units)] = 1.0
        matrix = sparse.csr_array(
            (np.concatenate(vals), (np.concatenate(r_idx), np.concatenate(c_idx))), shape=(n_rows, self.n)
        )
        self.structure = LinearConstraint(matrix, rhs, rhs)

    def objective(self, coef: np.ndarray) -> np.ndarray:
        """``coef`` shifted by each unit's minimum over its ``x`` and scaled to max |.| = 1.

        Since exactly one ``x`` per unit is 1, subtracting a per-unit constant changes the
        objective by a constant only; it makes HiGHS's gap tolerances relative to the part
        of the objective the choice actually moves.
        """
        out = coef.copy()
        out[: self.nx] -= np.minimum.reduceat(coef[: self.nx], self.starts[:-1])[self.unit_of]
        scale = float(np.max(np.abs(out))) if out.size else 0.0
        return out / scale if scale > 0 else out

    def choice_of(self, z: np.ndarray) -> np.ndarray:
        """The model's ``x`` index chosen for every unit in the solver's ``z``."""
        s = self.starts
        return np.array([self.xs[s[k] + int(np.argmax(z[s[k] : s[k + 1]]))] for k in range(len(s) - 1)])

    def point(self, choice: np.ndarray) -> np.ndarray:
        """``z`` of an assignment given as the model's chosen ``x`` indices."""
        z = np.zeros(self.n)
        chosen = np.zeros(self.model.nx, dtype=bool)
        chosen[choice] = True
        z[np.searchsorted(self.xs, choice)] = 1.0
        for (p, q), k in self.ys.items():
            if chosen[p] and chosen[q]:
                z[self.nx + k] = 1.0
        return z


def solve(
    problem: Problem,
    *,
    minimize: str = DAMAGE,
    budgets: Mapping[str, float] | None = None,
    time_limit: float = 10.0,
    tiebreak: str | None = None,
) -> Solution | None:
    """The assignment that minimises ``minimize`` subject to ``budgets``, or ``None`` if none exists.

    ``minimize`` is ``"damage"`` (``D``) or a cost metric ``m`` (``C_m``); ``budgets`` maps
    ``"damage"`` or a metric to an upper bound (``D <= B``, ``C_m <= B``; ``+inf`` means no
    bound).  Solved as the MILP in the module docstring::

        min  obj(x)   s.t.  sum_f x[u,f] = 1,   D(x) <= B_D,   C_m(x) <= B_m,   x binary

    Ties are broken lexicographically: a second solve minimises ``tiebreak`` subject to the
    same rows plus ``obj(x) <= obj* (1 + 1e-9)`` (in the solver's scaled units).  The default
    ``tiebreak`` is ``"damage"`` when minimising a metric (the least-damage of the cheapest
    assignments) and, when minimising damage, ``"all_metrics"``: ``sum_m C_m / span_m`` with
    ``span_m`` the largest possible spread of ``C_m``.  Budgets hold up to the solver's
    feasibility tolerance (about 1e-7 relative to the largest coefficient of the row).

    Negative damages are clamped to 0 (see :class:`Problem`).  Returns ``None`` when the
    budgets are infeasible (proven by the solver); raises :class:`~quantkit.errors.QuantkitError`
    when ``time_limit`` (seconds, for both solves together) runs out before any feasible
    assignment is found, and :class:`~quantkit.errors.RecipeError` for invalid input.
    """
    model = _Model(problem)
    return _solve_model(model, minimize=minimize, budgets=budgets, time_limit=time_limit, tiebreak=tiebreak)


def _solve_model(
    model: _Model,
    *,
    minimize: str,
    budgets: Mapping[str, float] | None,
    time_limit: float,
    tiebreak: str | None,
) -> Solution | None:
    model.check_target(minimize, "objective")
    if tiebreak is not None and tiebreak != ALL_METRICS:
        model.check_target(tiebreak, "tiebreak")
    t = _check_finite(time_limit, "time_limit")
    if t <= 0:
        raise RecipeError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    return model.solve(minimize, dict(budgets or {}), tiebreak, t)


def pareto_front(
    problem: Problem,
    *,
    metric: str,
    points: int = 12,
    time_limit: float = 10.0,
    budgets: Mapping[str, float] | None = None,
) -> list[Solution]:
    """The damage-vs-``metric`` frontier, sorted by ``metric`` ascending.

    Solves ``points`` problems: the two extremes — ``min C_m`` (ties: least damage) and
    ``min D`` (ties: cheapest in ``m``) — and ``points - 2`` budgets
    ``B_k = lo + (hi - lo) k / (points - 1)``, ``k = 1 .. points-2``, spread evenly between
    their costs ``lo`` and ``hi``, each ``min D s.t. C_m <= B_k`` (ties: cheapest in ``m``).
    ``budgets`` adds fixed upper bounds on other metrics (or damage) to every solve.
    Identical assignments, and assignments with the same ``(C_m, D)`` as one already
    kept, are dropped, then every point dominated by another (see :func:`pareto_mask`).
    ``time_limit`` applies to each solve.  Empty when ``budgets`` are infeasible.
    """
    model = _Model(problem)
    if metric == DAMAGE or metric not in model.cost:
        raise RecipeError(f"unknown front metric {metric!r}; metrics: {model._metric_list()}")
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise RecipeError(f"points must be an integer >= 2, got {points!r}")
    extra = dict(budgets or {})
    if metric in extra:
        raise RecipeError(f"budgets must not bound the front metric {metric!r}; the front sweeps it")

    def run(minimize: str, tiebreak: str, bound: float | None = None) -> Solution | None:
        b = dict(extra)
        if bound is not None:
            b[metric] = bound
        return _solve_model(model, minimize=minimize, budgets=b, time_limit=time_limit, tiebreak=tiebreak)

    cheap = run(metric, DAMAGE)
    if cheap is None:
        return []
    best = run(DAMAGE, metric)
    found = [cheap] + ([best] if best is not None else [])
    if best is not None:
        lo, hi = cheap.costs[metric], best.costs[metric]
        for k in range(1, points - 1):
            s = run(DAMAGE, metric, lo + (hi - lo) * k / (points - 1))
            if s is not None:
                found.append(s)

    unique: list[Solution] = []
    seen: set[tuple[tuple[str, str], ...]] = set()
    values: set[tuple[float, float]] = set()
    for s in found:
        key = tuple(sorted(s.assignment.items()))
        val = (s.costs[metric], s.damage)
        if key in seen or val in values:
            continue
        seen.add(key)
        values.add(val)
        unique.append(s)
    mask = pareto_mask([s.costs[metric] for s in unique], [s.damage for s in unique])
    front = [s for s, keep in zip(unique, mask, strict=True) if keep]
    front.sort(key=lambda s: (s.costs[metric], s.damage))
    return front


def pareto_mask(xs: Sequence[float], ys: Sequence[float]) -> list[bool]:
    """``True`` where no other point is ``<=`` in both coordinates and ``<`` in one.

    Lower is better in both.  Equal points do not dominate each other.  A point with a
    NaN coordinate is never on the front and dominates nothing.  O(n log n).
    """
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length: {len(xs)} != {len(ys)}")
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    mask = [False] * len(x)
    ok = np.flatnonzero(~(np.isnan(x) | np.isnan(y)))
    order = ok[np.lexsort((y[ok], x[ok]))]  # by x, then y
    best_y = math.inf  # least y among points with strictly smaller x
    first = True
    k = 0
    while k < len(order):
        g = k
        while g < len(order) and x[order[g]] == x[order[k]]:
            g += 1
        group_min = y[order[k]]  # sorted by y within equal x
        if first or group_min < best_y:
            for idx in order[k:g]:
                mask[int(idx)] = bool(y[idx] == group_min)
        best_y = min(best_y, group_min)
        first = False
        k = g
    return mask


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks of ``a`` and ``b``.

    Ties get the average of the ranks they span.  NaN when fewer than two pairs or when
    either side is constant (the correlation is undefined).
    """
    if len(a) != len(b):
        raise ValueError(f"a and b differ in length: {len(a)} != {len(b)}")
    if len(a) < 2:
        return math.nan
    ra = rankdata(np.asarray(a, dtype=np.float64))
    rb = rankdata(np.asarray(b, dtype=np.float64))
    da = ra - ra.mean()
    db = rb - rb.mean()
    den = math.sqrt(float(np.sum(da * da)) * float(np.sum(db * db)))
    if den == 0.0:
        return math.nan
    return float(np.sum(da * db) / den)
