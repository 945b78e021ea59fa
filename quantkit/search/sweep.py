"""Sweeps: sensitivity x cost -> integer program -> Pareto front -> emitted, MEASURED points.

``sweep(recipe)`` (what ``quantkit sweep --recipe X.yaml`` runs):

1. load + prepare the model, build the search space of the recipe's candidates (linear layers of
   a transformer: :class:`~quantkit.search.linear.LinearSpace`; static-INT8 conv nets:
   :class:`~quantkit.search.conv.ConvSpace`);
2. **sensitivity**: damage of every (unit, candidate) alone (:mod:`.sensitivity`, cached);
3. **cost**: bytes and profiled latency of every (unit, candidate) (:mod:`.cost`, cached);
4. **solve**: the predicted damage-vs-cost front (:func:`.solver.pareto_front`, ``scipy.optimize.milp``),
   ``search.points`` points spread along it, one point per ``search.budgets`` entry, and every
   candidate applied uniformly (``search.include_uniform``);
5. **emit and evaluate** each point: the ONNX model is written (atomically) and ONNX Runtime
   measures its quality on the evaluation data (perplexity for causal LMs, KL / top-1 against
   FP32 for classifiers, output SQNR / cosine otherwise), its file size and its latency
   (all points and FP32 timed interleaved, on the latency feed of ``report.latency``);
6. **report**: JSON, Markdown, SVG plots (quality vs latency, quality vs size), the per-layer
   assignment of every point, predicted next to measured, which measured points are on the
   measured Pareto front (the others are flagged dominated) and the Spearman rank correlation
   of predicted damage with the measured quality loss.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import DataError, QuantkitError, RecipeError
from quantkit.progress import grouped, tqdm

log = logging.getLogger("quantkit")

__all__ = ["SweepPoint", "SweepResult", "sweep"]

METRIC_KEY = {"size": "bytes", "latency": "latency_ms"}


@dataclass
class SweepPoint:
    id: str
    kind: str  # "fp32" | "uniform" | "front" | "budget"
    assignment: dict[str, str]
    predicted: dict[str, float]
    measured: dict[str, Any] = field(default_factory=dict)
    model_path: str | None = None
    on_measured_front: dict[str, bool] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class SweepResult:
    points: list[SweepPoint]
    predicted_front: list[dict[str, Any]]
    report: dict[str, Any]
    paths: dict[str, Path]


def _resolve_budget(
    expr: float | str, metric: str, uniform: Mapping[str, dict[str, float]], fp32: float
) -> float:
    """A budget expression as an absolute value of ``metric`` (see ``search.budgets``)."""
    if isinstance(expr, (int, float)):
        return float(expr) * fp32
    parts = expr.split(":")
    if parts[0] == "uniform" and len(parts) == 2:
        if parts[1] not in uniform:
            raise RecipeError(
                f"search.budgets {expr!r}: unknown candidate {parts[1]!r}; allowed: {sorted(uniform)}"
            )
        return uniform[parts[1]][metric]
    if parts[0] == "between" and len(parts) in (3, 4):
        a, b = parts[1], parts[2]
        for c in (a, b):
            if c not in uniform:
                raise RecipeError(
                    f"search.budgets {expr!r}: unknown candidate {c!r}; allowed: {sorted(uniform)}"
                )
        try:
            t = float(parts[3]) if len(parts) == 4 else 0.5
        except ValueError:
            raise RecipeError(f"search.budgets {expr!r}: t must be a number in [0, 1]") from None
        if not 0.0 <= t <= 1.0:
            raise RecipeError(f"search.budgets {expr!r}: t={t} is outside [0, 1]")
        return uniform[a][metric] + t * (uniform[b][metric] - uniform[a][metric])
    raise RecipeError(
        f"search.budgets {expr!r}: allowed: a number, 'uniform:<candidate>', 'between:<a>:<b>:<t>'"
    )


def _spread(front: list[Any], metric: str, k: int) -> list[Any]:
    """``k`` front solutions spread evenly in ``metric`` (both ends included)."""
    if k <= 0 or not front:
        return []
    if len(front) <= k:
        return list(front)
    xs = np.array([s.costs[metric] for s in front])
    targets = np.linspace(xs.min(), xs.max(), k)
    picked: list[int] = []
    for t in targets:
        order = np.argsort(np.abs(xs - t))
        i = next((int(j) for j in order if int(j) not in picked), None)
        if i is not None:
            picked.append(i)
    return [front[i] for i in sorted(picked)]


def _latency_feed(ds: Any, rec: Any) -> dict[str, np.ndarray]:
    lat = rec.report.latency
    for feed in ds.batches(lat.batch_size):
        out = {k: np.ascontiguousarray(v[: lat.batch_size]) for k, v in feed.items()}
        if lat.seq_len is not None:
            out = {
                k: (v[:, : lat.seq_len] if v.ndim == 2 and v.dtype == np.int64 else v) for k, v in out.items()
            }
        return out
    raise DataError("the dataset yielded no batch for the latency feed")


def _ray_session(address: str) -> Any:
    """``ray`` connected to ``address`` (``auto``, ``local`` for a new local cluster, or ``ray://host:port``)."""
    try:
        import ray
    except ImportError:
        raise QuantkitError("--ray needs Ray: pip install 'ray>=2' (or run the sweep without --ray)") from None
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, log_to_driver=False,
                 include_dashboard=False, ignore_reinit_error=True)  # fmt: skip
    return ray


def _model_ref(path: Path) -> bytes | str:
    """What a Ray task gets for an emitted model: its bytes when it is one file (any node can run it), else its
    path (external data: the output folder must be on storage every node sees)."""
    files = [f for f in path.parent.iterdir() if f.is_file()]
    return path.read_bytes() if files == [path] else str(path)


def _quality(
    path: str | bytes, float_bytes: bytes, ev: Any, rec: Any, is_lm: bool, metric: str = "kl"
) -> dict[str, Any]:
    """Measured quality of one emitted model (ONNX Runtime, evaluation data).

    Causal LMs: perplexity.  Others: the fidelity summary of the first output against FP32
    (top-1 / KL for classifiers, SQNR / cosine otherwise) plus ``damage``, the search's own
    sensitivity metric (mean KL per output position, or relative MSE) on the same data."""
    if is_lm:
        from quantkit.evaluate.perplexity import perplexity

        r = perplexity(path, ev)
        return {"ppl": float(r["ppl"]), "nll": float(r["nll"]), "tokens": int(r["tokens"])}
    from quantkit.evaluate.latency import make_session
    from quantkit.evaluate.metrics import FidelityAccumulator
    from quantkit.search.sensitivity import _log_softmax

    s_f, s_q = make_session(float_bytes), make_session(path)
    name = s_f.get_outputs()[0].name
    cls = {"classification": True, "embedding": False, "sqnr": False}.get(rec.evaluation.metric)
    acc = FidelityAccumulator(classification=cls)
    num = den = 0.0
    for feed in ev.batches(rec.evaluation.batch_size):
        (ref,) = s_f.run([name], feed)
        (got,) = s_q.run([name], feed)
        acc.update(name, ref, got)
        if metric == "kl":
            lp = _log_softmax(ref)
            kl = np.sum(np.exp(lp) * (lp - _log_softmax(got)), axis=-1)
            num += float(np.sum(kl))
            den += kl.size
        else:
            num += float(np.sum((got.astype(np.float64) - ref) ** 2))
            den += float(np.sum(ref.astype(np.float64) ** 2))
    out = {k: float(v) for k, v in acc.summary().get(name, {}).items() if isinstance(v, (int, float))}
    out["damage"] = max(num / max(den, 1e-30), 0.0)  # KL >= 0 (float rounding: -1e-9 for identical outputs)
    return out


def _damage_metric(rec: Any, first_output: str) -> str:
    """The sensitivity metric: the recipe's, or for ``auto`` KL on logits / classifiers and MSE otherwise."""
    m = rec.search.sensitivity.metric if rec.search is not None else "auto"
    if m != "auto":
        return str(m)
    return "kl" if first_output == "logits" or rec.evaluation.metric == "classification" else "mse"


def _loss_key(is_lm: bool, metric: str) -> tuple[str, str]:
    """(measured key used as the quality loss, its label) - lower is better."""
    if is_lm:
        return "ppl", "perplexity"
    return "damage", "mean KL vs FP32" if metric == "kl" else "relative MSE vs FP32"


@dataclass
class SearchContext:
    """Everything the search measured, ready to solve (see :func:`prepare_search`)."""

    rec: Any
    loaded: Any
    float_model: ir.Model
    serialized: bytes | None  # the float model serialized, made on first use (float_bytes)
    cal: Any
    ev: Any
    is_lm: bool
    space: Any
    damage: dict[tuple[str, str], float]
    costs: Any
    problem: Any
    feed: dict[str, np.ndarray]
    units: list[str]
    cnames: list[str]
    uniform_all: dict[str, dict[str, float]]
    fp32_pred: dict[str, float]
    timings: dict[str, float]
    t_start: float
    damage_metric: str = "kl"
    allowed: dict[str, list[str]] = field(default_factory=dict)  # unit -> candidates it can take
    memory: dict[str, Any] = field(default_factory=dict)  # the report's memory section: the estimate, what is free
    sensitivity_info: dict[str, Any] = field(default_factory=dict)  # measured / scaled counts (measure_sensitivity)

    @property
    def float_bytes(self) -> bytes:
        """The float model serialized (made once, when a point is evaluated: a size-budgeted mix never needs it,
        and a 135M-parameter decoder's copy is ~0.5 GB)."""
        if self.serialized is None:
            self.serialized = ir.to_proto(self.float_model).SerializeToString()
        return self.serialized

    def uniform(self, cand: str) -> dict[str, str]:
        """``cand`` on every unit that can take it, the nearest allowed candidate elsewhere."""
        from quantkit.search.linear import nearest_allowed

        return {u: nearest_allowed(self.space.candidates, self.allowed.get(u, self.cnames), cand) for u in self.units}

    def predicted(self, assign: Mapping[str, str]) -> dict[str, float]:
        """Predicted damage and costs of an assignment (additive model + edges)."""
        pr = self.problem
        out = {"damage": float(sum(pr.damage[(u, assign[u])] for u in self.units))}
        for m, tab in pr.costs.items():
            out[m] = pr.base.get(m, 0.0) + float(sum(tab[(u, assign[u])] for u in self.units))
        for e in pr.edges:
            out[e.metric] += float(e.cost.get((assign[e.u], assign[e.v]), 0.0))
        return out

    def solve_target(self, target: Mapping[Any, float | str]) -> Any:
        """The assignment meeting ``search.target`` (``{size|latency: budget}``: least damage within the
        budget; ``{damage: budget}``: cheapest in ``search.metric`` within the damage budget)."""
        from quantkit.search.solver import solve

        srch = self.rec.search
        ((key, expr),) = target.items()
        if key == "damage":
            b = _resolve_budget(expr, "damage", self.uniform_all, 1.0)
            sol = solve(
                self.problem,
                minimize=METRIC_KEY[srch.metric],
                budgets={"damage": b},
                time_limit=srch.time_limit_s,
            )
        else:
            m = METRIC_KEY[key]
            b = _resolve_budget(expr, m, self.uniform_all, self.fp32_pred[m])
            sol = solve(self.problem, minimize="damage", budgets={m: b}, time_limit=srch.time_limit_s)
        if sol is None:
            raise RecipeError(
                f"search.target {dict(target)}: no assignment of the candidates meets it "
                f"(budget {b:.6g}); allowed: a looser budget or more candidates"
            )
        return sol


def prepare_search(
    model: Any = None,
    calibration_data: Any = None,
    recipe: Any = None,
    *,
    evaluation_data: Any = None,
    example_inputs: Any = None,
    progress: bool = True,
    use_cache: bool = True,
    latency_costs: bool = True,
) -> SearchContext:
    """Load, prepare, build the space, measure sensitivity and costs, set up the integer program.

    ``model`` as for :func:`quantkit.quantize` (a ``torch.nn.Module`` needs ``example_inputs``).
    ``latency_costs=False``: bytes alone, no model emitted or profiled (a search with a size budget only)."""
    from quantkit.data import model_inputs
    from quantkit.irtools import model_digest
    from quantkit.pipeline import eval_dataset as _eval_dataset
    from quantkit.recipe import load_recipe
    from quantkit.run import load_inputs
    from quantkit.search.cost import measure_costs
    from quantkit.search.sensitivity import measure_sensitivity
    from quantkit.search.solver import Problem

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    rec = load_recipe(recipe if recipe is not None else {"version": 1})
    if rec.search is None:
        raise RecipeError("a mixed-precision search needs a recipe with a 'search' section (candidates, ...)")
    srch = rec.search
    if model is None and rec.model is None:
        raise QuantkitError("sweep() needs a model: pass one, or name it in the recipe's model.source")

    t = time.perf_counter()
    if calibration_data is None and rec.calibration.data is None:
        raise QuantkitError("sweep() needs calibration data: pass calibration_data or set calibration.data")
    memory = _check_search_memory(model if model is not None else getattr(rec.model, "source", None), rec)
    loaded, float_model, cal = load_inputs(model, calibration_data, rec, example_inputs=example_inputs,
                                           progress=progress, timings=timings)
    inputs = model_inputs(float_model)
    ev = _eval_dataset(rec, loaded, evaluation_data, inputs)
    # a tokenizer served by a worker process (quantkit.frontends.tokenizer_worker) ends here: the text is tokenized
    release = getattr(getattr(loaded, "tokenizer", None), "release", None)
    if callable(release):
        release()
    if ev is None:
        raise DataError(
            "the search measures latency and quality: set evaluation.data or pass evaluation_data"
        )
    damage_metric = _damage_metric(rec, float_model.graph.outputs[0].name or "")
    is_lm = (
        rec.evaluation.perplexity
        and any(o.name == "logits" for o in float_model.graph.outputs)
        and any(i.name == "input_ids" for i in float_model.graph.inputs)
    )
    digest = model_digest(float_model)  # tensor by tensor: no serialized copy of the weights
    timings["load_s"] = time.perf_counter() - t

    t = time.perf_counter()
    formats = {c.format for c in srch.candidate_list()}
    if "int8" in formats:
        from quantkit.search.conv import ConvSpace

        space: Any = ConvSpace.build(float_model, rec, cal, progress=progress, use_cache=use_cache)
    else:
        from quantkit.search.linear import LinearSpace

        space = LinearSpace.build(float_model, rec, cal, progress=progress, use_cache=use_cache)
    timings["space_s"] = time.perf_counter() - t
    cand_spec = [c.model_dump() for c in srch.candidate_list()]
    common = {
        "model": digest,
        "data": cal.fingerprint(),
        "candidates": cand_spec,
        "tie": srch.tie,
        "layers": srch.layers,
        "units": [u.name for u in space.units],
        "pinned": [o.model_dump() for o in rec.quantization.overrides],
        "acc": rec.export.accuracy_level,
    }
    log.info(
        "search space: %d units (%d layers), %d candidates, %d pinned layers",
        len(space.units),
        sum(len(u.layers) for u in space.units),
        len(space.candidates),
        len(space.pinned),
    )

    t = time.perf_counter()
    sens = srch.sensitivity
    sens_info: dict[str, Any] = {}
    with grouped("sensitivity"):  # one line per repeated step (lowering, statistics), not one per probe
        damage = measure_sensitivity(
            space,
            cal,
            samples=sens.samples,
            seq_len=sens.seq_len,
            metric=damage_metric,
            cache_parts={**common, "sens": sens.model_dump()} if use_cache else None,
            progress=progress,
            measure=sens.measure,
            info=sens_info,
        )
    timings["sensitivity_s"] = time.perf_counter() - t

    t = time.perf_counter()
    feed = _latency_feed(ev, rec)
    lat = rec.report.latency
    with grouped("cost"):
        costs = measure_costs(
            space,
            feed,
            runs=lat.repeat,
            warmup=lat.warmup,
            threads=lat.threads,
            cache_parts={
                **common,
                "feed": {k: list(v.shape) for k, v in feed.items()},
                "threads": lat.threads,
                "runs": lat.repeat,
                **({} if latency_costs else {"latency": False}),
            }
            if use_cache
            else None,
            progress=progress,
            latency=latency_costs,
        )
    timings["cost_s"] = time.perf_counter() - t

    t = time.perf_counter()
    cnames = list(space.candidates)
    units = [u.name for u in space.units]
    allowed = {u.name: [c for c in cnames if not hasattr(space, "allowed") or c in space.allowed(u)]
               for u in space.units}
    problem = Problem(
        units=units,
        formats=allowed,
        damage={(u, c): damage[(u, c)] for u in units for c in allowed[u]},
        costs={
            "bytes": {(u, c): costs.bytes[(u, c)] for u in units for c in allowed[u]},
            "latency_ms": {(u, c): costs.latency_ms[(u, c)] for u in units for c in allowed[u]},
        },
        base=dict(costs.base),
        edges=list(getattr(space, "edges", lambda _c: [])(costs)),
    )
    ctx = SearchContext(
        rec,
        loaded,
        float_model,
        None,
        cal,
        ev,
        bool(is_lm),
        space,
        damage,
        costs,
        problem,
        feed,
        units,
        cnames,
        {},
        {},
        timings,
        t_start,
        damage_metric,
    )
    ctx.sensitivity_info = sens_info
    if "fp32" in cnames:
        ctx.fp32_pred = ctx.predicted({u: "fp32" for u in units})
    else:
        ctx.fp32_pred = {
            "damage": 0.0,
            "bytes": costs.base["bytes"] + sum(costs.bytes[(u, "fp32")] for u in units),
            "latency_ms": costs.base["latency_ms"] + sum(costs.latency_ms[(u, "fp32")] for u in units),
        }
    ctx.allowed = allowed
    ctx.memory = memory
    ctx.uniform_all = {**{c: ctx.predicted(ctx.uniform(c)) for c in cnames}, "fp32": ctx.fp32_pred}
    return ctx


def sweep(
    model: Any = None,
    calibration_data: Any = None,
    recipe: Any = None,
    *,
    evaluation_data: Any = None,
    example_inputs: Any = None,
    output: str | os.PathLike[str] = "sweep-out",
    overwrite: bool = False,
    progress: bool = True,
    use_cache: bool = True,
    save_models: bool = True,
    ray_address: str | None = None,
) -> SweepResult:
    """Run the recipe's mixed-precision search and evaluate the chosen points (module doc).

    ``output`` follows the rules of every output folder (:mod:`quantkit.report.output`): checked before any
    work, a folder holding files quantkit did not write is refused unless ``overwrite``, the run's inputs are
    never written over, and the report, plots and models appear as one set (staged, then moved).

    ``ray_address``: evaluate the points' quality (perplexity / fidelity against FP32) as Ray tasks on that
    cluster (``"local"`` starts one on this machine); emitting and latency stay in this process."""
    from quantkit.recipe import load_recipe
    from quantkit.recipe.load import recipe_inputs
    from quantkit.report.output import check_output_dir, write_outputs

    for key, val in (("overwrite", overwrite), ("progress", progress), ("use_cache", use_cache),
                     ("save_models", save_models)):
        if not isinstance(val, bool):
            raise RecipeError(f"sweep(): {key} must be True or False, got {val!r}")
    rec = load_recipe(recipe) if recipe is not None else None
    inputs = recipe_inputs(rec) if rec is not None else []
    if isinstance(model, (str, os.PathLike)):
        inputs.append(Path(model))
    out = check_output_dir(output, overwrite=overwrite, inputs=inputs)  # before any work
    holder: dict[str, Any] = {}

    def fill(stage: Path) -> None:
        holder["stage"] = stage
        holder["res"] = _sweep_into(
            model, calibration_data, rec if rec is not None else recipe, evaluation_data=evaluation_data,
            example_inputs=example_inputs, out_dir=stage, progress=progress, use_cache=use_cache,
            save_models=save_models, ray_address=ray_address)

    write_outputs(out, fill, overwrite=overwrite, inputs=inputs)
    res: SweepResult = holder["res"]
    stage = holder["stage"]
    res.paths = {k: out / Path(v).relative_to(stage) for k, v in res.paths.items()}
    for pt in res.points:
        if pt.model_path:
            pt.model_path = str(out / Path(pt.model_path).relative_to(stage))
    return res


def _sweep_into(
    model: Any,
    calibration_data: Any,
    recipe: Any,
    *,
    evaluation_data: Any,
    example_inputs: Any,
    out_dir: Path,
    progress: bool,
    use_cache: bool,
    save_models: bool,
    ray_address: str | None,
) -> SweepResult:
    """The sweep itself, writing into ``out_dir`` (a staging folder of :func:`sweep`)."""
    from quantkit.memory import PeakMeter
    from quantkit.pipeline import save_model

    meter = PeakMeter().start()  # the measured peak, recorded beside the estimate
    from quantkit.search.solver import pareto_front, pareto_mask, solve, spearman

    ctx = prepare_search(
        model,
        calibration_data,
        recipe,
        evaluation_data=evaluation_data,
        example_inputs=example_inputs,
        progress=progress,
        use_cache=use_cache,
    )
    rec, srch, space, problem, units, cnames = (
        ctx.rec,
        ctx.rec.search,
        ctx.space,
        ctx.problem,
        ctx.units,
        ctx.cnames,
    )
    timings, t_start, loaded, float_model, float_bytes = (
        ctx.timings,
        ctx.t_start,
        ctx.loaded,
        ctx.float_model,
        ctx.float_bytes,
    )
    ev, is_lm, feed, damage, costs = ctx.ev, ctx.is_lm, ctx.feed, ctx.damage, ctx.costs
    uniform_all, fp32_pred, predicted = ctx.uniform_all, ctx.fp32_pred, ctx.predicted
    lat = rec.report.latency
    cand_spec = [c.model_dump() for c in srch.candidate_list()]
    t = time.perf_counter()
    metric = METRIC_KEY[srch.metric]
    front = pareto_front(problem, metric=metric, points=srch.frontier_points, time_limit=srch.time_limit_s)

    points: list[SweepPoint] = []
    seen: set[tuple[str, ...]] = set()

    def add(pid: str, kind: str, assign: dict[str, str]) -> None:
        key = tuple(assign[u] for u in units)
        if key in seen:
            for p in points:
                if tuple(p.assignment[u] for u in units) == key:
                    p.kind += f"+{kind}"
                    p.id += f" = {pid}"
            return
        seen.add(key)
        counts: dict[str, int] = {}
        for u in space.units:
            counts[assign[u.name]] = counts.get(assign[u.name], 0) + len(u.layers)
        points.append(
            SweepPoint(
                pid, kind, dict(assign), predicted(assign) if kind != "fp32" else fp32_pred, counts=counts
            )
        )

    if srch.include_uniform:
        for c in cnames:
            add(f"uniform:{c}", "uniform", ctx.uniform(c))
    for i, s in enumerate(_spread(front, metric, srch.points)):
        add(f"front-{i + 1}", "front", s.assignment)
    for expr in srch.budgets:
        b = _resolve_budget(expr, metric, uniform_all, fp32_pred[metric])
        sol = solve(problem, minimize="damage", budgets={metric: b}, time_limit=srch.time_limit_s)
        if sol is None:
            log.warning("search.budgets %r (%s <= %.4g) is infeasible with these candidates", expr, metric, b)
            continue
        add(f"budget:{expr}", "budget", sol.assignment)
    if srch.target is not None:  # the point `quantkit calibrate` would emit
        ((tk, tv),) = srch.target.items()
        add(f"target:{tk}<={tv}", "budget", ctx.solve_target(srch.target).assignment)
    timings["solve_s"] = time.perf_counter() - t

    # -- emit and measure ------------------------------------------------------------------------------
    t = time.perf_counter()
    models_dir = out_dir / "models"
    paths: dict[str, Path] = {}
    fp32_path = None
    tmp_dir = tempfile.TemporaryDirectory(prefix="quantkit-sweep-")
    try:
        store = models_dir if save_models else Path(tmp_dir.name)
        fp32_path = Path(tmp_dir.name) / "fp32.onnx"
        save_model(float_model, fp32_path, "auto")
        fp32_quality = _quality(str(fp32_path), float_bytes, ev, rec, is_lm) if is_lm else {"damage": 0.0}
        ray = _ray_session(ray_address) if ray_address else None
        pending: dict[str, Any] = {}
        if ray is not None:
            remote_quality = ray.remote(_quality)
            float_ref, ev_ref = ray.put(float_bytes), ray.put(ev)
        with grouped("emit points"):  # one line per repeated step (lowering, statistics), not one per point
            for i, p in enumerate(
                tqdm(points, desc="emit + evaluate points", unit="point", disable=not progress)
            ):
                m = space.emit(p.assignment)
                path = store / f"point-{i:02d}" / "model.onnx"
                save_model(m, path, rec.export.external_data)
                del m
                p.model_path = str(path) if save_models else None
                paths[p.id] = path
                p.measured["size_bytes"] = sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file())
                if ray is not None:  # a task per point; results gathered below
                    pending[p.id] = remote_quality.remote(_model_ref(path), float_ref, ev_ref, rec, is_lm,
                                                          ctx.damage_metric)  # fmt: skip
                else:
                    p.measured.update(_quality(str(path), float_bytes, ev, rec, is_lm, ctx.damage_metric))
        if pending and ray is not None:
            done = dict(zip(pending, ray.get(list(pending.values())), strict=True))
            for p in points:
                p.measured.update(done[p.id])
            timings["ray_tasks"] = float(len(done))
        # latency: all points and FP32, interleaved on one feed
        from quantkit.evaluate.latency import compare_latency, make_session

        lat_paths = {"fp32": fp32_path, **{p.id: paths[p.id] for p in points}}
        # every session held at once when they fit in the memory left, else in groups, each with FP32 beside it
        groups = latency_groups({k: _files_size(v) for k, v in lat_paths.items()})
        if len(groups) > 1:
            log.info("latency: %d models timed in %d groups (all at once would not fit in the memory left), FP32 "
                     "in each group", len(lat_paths), len(groups))  # fmt: skip
            timings["latency_groups"] = float(len(groups))
        res: dict[str, Any] = {}
        fp32_of: dict[str, float] = {}
        for group in groups:
            sessions = {k: make_session(str(lat_paths[k]), threads=lat.threads) for k in group}
            # 3 interleaved rounds of repeat/3 runs each: switching sessions every few runs measured FP32
            # EfficientNet at 10-13 ms instead of 4-5 ms (the previous session's intra-op threads keep spinning
            # and take the 2 cores from the next one)
            got = compare_latency(sessions, feed, warmup=lat.warmup, repeat=lat.repeat, threads=lat.threads or 0)
            del sessions
            res.setdefault("fp32", got["fp32"])
            for k, v in got.items():
                if k != "fp32":
                    res[k], fp32_of[k] = v, got["fp32"].median_ms
        fp32_ms = res["fp32"].median_ms
        for p in points:
            p.measured["latency_ms"] = res[p.id].median_ms
            p.measured["latency_p90_ms"] = res[p.id].p90_ms
            p.measured["speedup_vs_fp32"] = fp32_of[p.id] / max(res[p.id].median_ms, 1e-9)
        fp32_size = fp32_path.stat().st_size + sum(
            f.stat().st_size for f in fp32_path.parent.iterdir() if f.name.startswith("fp32.onnx.")
        )
    finally:
        tmp_dir.cleanup()
    timings["evaluate_s"] = time.perf_counter() - t

    # -- measured front, rank correlation -------------------------------------------------------------
    loss_key, loss_label = _loss_key(is_lm, ctx.damage_metric)
    losses = [float(p.measured.get(loss_key, float("nan"))) for p in points]
    for axis, key in (("latency", "latency_ms"), ("size", "size_bytes")):
        mask = pareto_mask([float(p.measured[key]) for p in points], losses)
        for p, on in zip(points, mask, strict=True):
            p.on_measured_front[axis] = bool(on)
    rho = spearman([p.predicted["damage"] for p in points], losses) if len(points) >= 3 else float("nan")
    rho_lat = (
        spearman([p.predicted["latency_ms"] for p in points], [p.measured["latency_ms"] for p in points])
        if len(points) >= 3
        else float("nan")
    )
    timings["total_s"] = time.perf_counter() - t_start
    report = {
        "recipe": rec.name,
        "source": str(loaded.source),
        "family": type(space).__name__,
        "provider": "CPUExecutionProvider",
        "note_16bit": "fp16/bf16 on ONNX Runtime's CPU provider are storage formats: weights are stored in 16 bits "
        "and widened to fp32 at load time (no fp16/bf16 GEMM on this provider); their latency is FP32's",
        "metric": srch.metric,
        "quality_key": loss_key,
        "quality_label": loss_label,
        "fp32": {"latency_ms": fp32_ms, "size_bytes": fp32_size, **fp32_quality},
        "units": [{"name": u.name, "layers": list(u.layers)} for u in space.units],
        "pinned": list(space.pinned),
        "candidates": cand_spec,
        "spearman_predicted_damage_vs_measured": rho,
        "spearman_predicted_vs_measured_latency": rho_lat,
        # model paths relative to the output folder: the folder may be staged and moved (CLI), or copied
        "points": [{**asdict(p), "model_path": str(Path(p.model_path).relative_to(out_dir)) if p.model_path else None}
                   for p in points],
        "predicted_front": [{"damage": s.damage, **s.costs, "status": s.status} for s in front],
        "uniform_predicted": uniform_all,
        "costs": {"base": costs.base, "notes": costs.notes},
        "roofline": costs.roofline,
        "sensitivity": [{"unit": u, "candidate": c, "damage": v} for (u, c), v in sorted(damage.items())],
        "sensitivity_info": ctx.sensitivity_info,
        "assignments": {p.id: space.assignment_table(p.assignment) for p in points},
        "timings": timings,
        "memory": {**ctx.memory, "measured_peak_bytes": int(meter.stop())},
    }
    from quantkit.report.sweep import write_sweep_report

    out_paths = write_sweep_report(report, out_dir)
    front_rows = [{"damage": s.damage, **s.costs, "status": s.status} for s in front]
    return SweepResult(points, front_rows, report, out_paths)


def _files_size(path: Path) -> int:
    """Bytes of an emitted model: the ``.onnx`` file and its external-data files beside it."""
    return sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file() and f.name.startswith(path.name))


def latency_groups(sizes: Mapping[str, int], budget: int | None = None) -> list[list[str]]:
    """Split the models timed for latency (name -> bytes; ``"fp32"`` first) into groups whose ONNX Runtime sessions
    fit together in ``budget`` bytes (default: what is free now, :func:`quantkit.memory.available_memory` less
    what the process holds); every group holds ``"fp32"``, so each point is timed beside FP32.  One group when all
    fit (the usual case: every session interleaved in one run)."""
    from quantkit.memory import EVAL_SESSION_COPIES, available_memory, process_tree_rss

    if budget is None:
        budget = available_memory().bytes - process_tree_rss()
    need = {k: int(EVAL_SESSION_COPIES * v) for k, v in sizes.items()}
    others = [k for k in sizes if k != "fp32"]
    if sum(need.values()) <= budget or not others:
        return [["fp32", *others]]
    groups: list[list[str]] = []
    cur, used = ["fp32"], need["fp32"]
    for k in others:
        if len(cur) > 1 and used + need[k] > budget:
            groups.append(cur)
            cur, used = ["fp32"], need["fp32"]
        cur.append(k)
        used += need[k]
    groups.append(cur)
    return groups


def _check_search_memory(source: Any, rec: Any) -> dict[str, Any]:
    """Refuse, before any work, a search whose whole-graph peak is estimated above the memory available (a
    search measures the whole graph: it never streams).  Returns the report's memory section."""
    from quantkit.llm_run import LARGE_MODEL_BYTES, decoder_folder, memory_section, whole_graph_memory
    from quantkit.memory import announce, available_memory, check_fits

    folder = decoder_folder(source)
    got = whole_graph_memory(source, rec, folder)
    if got is None:
        return memory_section(None, None)
    est, is_lm = got
    avail = available_memory()
    if not (is_lm or est.weights_bytes >= LARGE_MODEL_BYTES):  # small: recorded, not guarded (see llm_run)
        return memory_section(est, avail)
    announce(est, avail)
    instead = ("a recipe without a search section, with formats int4 / int8_weight / fp32, streams this checkpoint "
               "block by block (calibration.layerwise: auto, the default)" if folder is not None else
               "this model is quantized whole; run the search where more memory is available")  # fmt: skip
    check_fits(est, avail, what="the search (it measures the whole graph)", instead=instead)
    return memory_section(est, avail)
