"""A searched mix of weight-only formats, built block by block: the byte-budgeted 4/8-bit LLM.

A recipe with a ``search`` section whose candidates are all formats the layer-wise builder emits (``int4``,
``int8_weight``, ``fp32``) and whose decoder the layer-wise builder streams (:mod:`quantkit.llm_run`) is run in two steps:

1. **search** on the whole graph (:mod:`quantkit.search.sweep`): every searched linear's damage in every
   candidate (KL of the next-token distribution with that layer alone quantized, on ``search.sensitivity``'s
   calibration windows, one probe session), its exact bytes, and the integer program: the least total damage
   whose bytes fit ``search.target.size``.  The damage is measured with round-to-nearest codes (a cheap, rank-
   preserving proxy: measuring every layer under SignRound or GPTQ would cost a whole quantization per
   candidate); the build then rounds each layer with its candidate's algorithm (default: the recipe's);
2. **build** layer-wise with the chosen format of every layer written as an override (the recipe's own overrides
   first: pinned layers, e.g. the lm_head, are not searched), so the heavy rounding runs once, streamed, in
   bounded memory.

**The budget is the emitted file's.**  The whole graph stores a tied embedding / lm_head once; the layer-wise
build stores the input embedding apart when the lm_head is rounded from statistics (GPTQ, AWQ, SignRound: the
head then differs from the table a ``Gather`` reads) or the residual stream is rotated, which adds the embedding's bytes at its own format.  Those
bytes are taken off the budget before the solve (a searched lm_head carries them in its candidates' costs), so
``search.target: {size: 0.20}`` bounds the file that ships.  The report's ``search`` section holds the target,
the assignment, the predicted bytes and damage, and the emitted file's measured bytes beside them.

The sensitivity needs the whole FP32 graph in memory once (the search refuses, before any work, a model whose
estimate does not fit); the build itself streams.  The search runs in a child process (spawned: a model path or
name and recipe data pickle) so that everything it held is returned to the system before the build starts - the
run's peak is the larger of the two steps', not their sum; an in-memory model or dataset that does not pickle is
searched in this process and released before the build.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from quantkit.child import in_child, picklable
from quantkit.errors import RecipeError
from quantkit.recipe import RecipeModel, load_recipe
from quantkit.weight_only import STATS_ALGORITHMS

log = logging.getLogger("quantkit")

__all__ = ["searched_overrides", "run_layerwise_mix", "tensor_bytes"]



def _search_recipe(rec: RecipeModel) -> RecipeModel:
    """The recipe the whole-graph search runs: the same candidates with round-to-nearest codes, no rotation, no
    KV-cache format, whole graph."""
    d = rec.model_dump(mode="json", exclude_none=True)
    d["calibration"]["layerwise"] = False
    d["quantization"]["rotation"] = "none"
    d.setdefault("export", {})["kv_cache"] = "float32"
    for c in d["search"]["candidates"]:
        if isinstance(c, dict):
            c["algorithm"] = "rtn"
            c.pop("algorithm_options", None)
    return load_recipe(d)


def _embedding_apart_bytes(rec: RecipeModel, cfg: Any, head_algorithm: str, head_format: str) -> int:
    """Bytes the layer-wise build adds over the whole graph for an lm_head in ``head_format`` rounded by
    ``head_algorithm``: the input embedding stored apart (a tied model whose head is rounded from statistics)."""
    from quantkit.search.linear import weight_only_bytes

    if not getattr(cfg, "tie_word_embeddings", False):
        return 0
    rotated = rec.quantization.rotation != "none"  # a rotation unties the head from the table too
    if not rotated and (head_format not in ("int4", "int8_weight") or head_algorithm not in STATS_ALGORITHMS):
        return 0
    emb = _layer_plan(rec, cfg.spec.names.embed)
    bits = 4 if emb.format == "int4" else 8 if emb.format == "int8_weight" else 32
    if bits == 32:
        return 4 * cfg.vocab_size * cfg.hidden_size
    return weight_only_bytes(cfg.hidden_size, cfg.vocab_size, bits, emb.group_size or cfg.hidden_size,
                             emb.weight_symmetric)


def _layer_plan(rec: RecipeModel, name: str) -> Any:
    """The recipe's plan for layer ``name`` as the layer-wise builder resolves it (default and overrides)."""
    from quantkit.recipe.plan import PrecisionPlan

    return PrecisionPlan.from_recipe(rec).layer(name, "MatMul", name)


def searched_overrides(rec: RecipeModel, rows: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """The recipe's overrides followed by one per searched layer (its module path, its candidate's format, group
    size and algorithm - the recipe's own where the candidate leaves them unset)."""
    cands = {c.name: c for c in rec.search.candidate_list()} if rec.search is not None else {}
    out = [o.model_dump(mode="json", exclude_none=True) for o in rec.quantization.overrides]
    for row in rows:
        c = cands.get(row["candidate"])
        if c is None:  # fp32: the search may keep a layer in float when the budget allows it
            out.append({"layer": names.get(row["layer"], row["layer"]), "format": "fp32"})
            continue
        o: dict[str, Any] = {"layer": names.get(row["layer"], row["layer"]), "format": c.format}
        if c.group_size is not None:
            o["group_size"] = c.group_size
        if c.per_channel:
            o["per_channel"] = True
        if c.algorithm is not None:
            o["algorithm"] = c.algorithm
            o["algorithm_options"] = dict(c.algorithm_options or {})
        out.append(o)
    return out


def tensor_bytes(path: Any) -> int:
    """Bytes of a saved model's initializers (external data by its recorded lengths: nothing is read)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext["length"]) if "length" in ext else len(t.raw_data)
    return total


def run_layerwise_mix(model: Any, calibration_data: Any, rec: RecipeModel, *, evaluation_data: Any,
                      evaluate: bool, measure_latency: bool | None, progress: bool, use_cache: bool,
                      t_start: float) -> Any:
    """The module doc: search on the whole graph, then build layer-wise with the chosen formats."""
    from quantkit.llm_run import run_layerwise

    srch = rec.search
    if srch is None:
        raise RecipeError("a searched layer-wise mix needs a recipe with a 'search' section")
    if srch.target is None or set(srch.target) != {"size"}:
        raise RecipeError(f"search.target {dict(srch.target or {})}: a weight-only mix built layer-wise takes a "
                          "size budget; allowed: search.target: {size: <fraction of FP32 | 'uniform:<candidate>' | "
                          "'between:<a>:<b>:<t>'>}")
    args = (model, calibration_data, rec, evaluation_data, progress, use_cache)
    t = time.perf_counter()
    child = picklable(args)
    if child:
        # a checkpoint that is converted on first use (the built-in's GGUF: a process of ~1.2 GB) is converted
        # here, before the search's process starts, so the two never run side by side
        from quantkit.llm_run import resolve_llm_folder

        resolve_llm_folder(_source(model, rec))
    overrides, search = in_child(_search, args, name="quantkit-search") if child else _search(*args)
    search["process"] = ("a child process (its memory returned before the build)" if child else
                         "this process (an in-memory model or dataset that does not pickle)")
    search["search_wall_s"] = time.perf_counter() - t
    budget = search["budget_bytes"]
    d = rec.model_dump(mode="json", exclude_none=True)
    d.pop("search")
    d["quantization"]["overrides"] = overrides
    built = load_recipe(d)
    gc.collect()
    result = run_layerwise(model, calibration_data, built, evaluation_data=evaluation_data, evaluate=evaluate,
                           measure_latency=measure_latency, progress=progress, t_start=t_start)
    size = result.report.get("size") or {}
    if size.get("quantized_bytes"):
        search["emitted_bytes"] = size["quantized_bytes"]
        search["emitted_over_budget"] = size["quantized_bytes"] / budget
    path = getattr(result, "path", None)
    if path is not None:
        # the tensors alone: the weights file pads each tensor to a page for memory mapping (a tiny model's file is
        # mostly padding; SmolLM2's ~1 MB of 100)
        search["emitted_tensor_bytes"] = tensor_bytes(path)
    result.report["search"] = search
    result.report.setdefault("timings", {})["search_s"] = search["search_s"]
    return result


def _source(model: Any, rec: RecipeModel) -> Any:
    """The model the run quantizes: the one passed, else the recipe's ``model.source``."""
    return model if model is not None else (rec.model.source if rec.model is not None else None)


def _search(model: Any, calibration_data: Any, rec: RecipeModel, evaluation_data: Any, progress: bool,
            use_cache: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Step 1 of the module doc: ``(overrides of the build, the report's search record)``."""
    from quantkit.frontends.llm_builder import read_decoder_config
    from quantkit.llm_run import resolve_llm_folder
    from quantkit.lowering.select import module_path
    from quantkit.search.solver import solve
    from quantkit.search.sweep import METRIC_KEY, _resolve_budget, prepare_search

    srch = rec.search
    if srch is None or srch.target is None:
        raise RecipeError("a searched layer-wise mix needs a recipe with a 'search' section and a search.target")
    cfg = read_decoder_config(resolve_llm_folder(_source(model, rec)))
    t = time.perf_counter()
    # a size budget: the costs are the formats' bytes (no uniform model emitted and profiled: ~35 s and two more
    # copies of the weights in memory for a 135M-parameter decoder)
    ctx = prepare_search(model, calibration_data, _search_recipe(rec), evaluation_data=evaluation_data,
                         progress=progress, use_cache=use_cache, latency_costs=False)
    expr = srch.target["size"]
    # a fraction is of the FP32 model (every weight float32, the tied table once): the search's own FP32 point
    # keeps the recipe's pinned layers (an lm_head override) in their format
    fp32_bytes = float(sum(v.const_value.nbytes for v in ctx.float_model.graph.initializers.values()
                           if v.const_value is not None))
    budget = (float(expr) * fp32_bytes if isinstance(expr, (int, float)) else
              _resolve_budget(expr, METRIC_KEY["size"], ctx.uniform_all, ctx.fp32_pred["bytes"]))
    problem = ctx.problem
    # the bytes the layer-wise build adds over the whole graph (an embedding stored apart)
    head_units = [u for u in ctx.space.units if any(ctx.space.layers[n].tied for n in u.layers)]
    fixed = 0
    if head_units:
        cands = {c.name: c for c in srch.candidate_list()}
        bytes_ = problem.costs["bytes"]
        for u in head_units:
            for (un, cn) in list(bytes_):
                if un == u.name and cn in cands:
                    algo = cands[cn].algorithm or rec.quantization.default.algorithm
                    bytes_[(un, cn)] += _embedding_apart_bytes(rec, cfg, algo, cands[cn].format)
    else:
        head = _layer_plan(rec, "lm_head")
        fixed = _embedding_apart_bytes(rec, cfg, head.algorithm, head.format)
    sol = solve(problem, minimize="damage", budgets={"bytes": budget - fixed}, time_limit=srch.time_limit_s)
    if sol is None:
        bytes_ = problem.costs["bytes"]
        least = problem.base.get("bytes", 0.0) + fixed + sum(
            min(bytes_[(u, f)] for f in problem.formats[u]) for u in problem.units)
        raise RecipeError(f"search.target {dict(srch.target)}: no assignment of the candidates fits {budget:.6g} "
                          f"bytes ({budget / fp32_bytes:.3f} of FP32); the smallest these candidates reach is "
                          f"{least:.6g} bytes ({least / fp32_bytes:.3f} of FP32: every searched layer in its "
                          f"smallest candidate, plus the weights no candidate covers"
                          + (f", {fixed} bytes of them the embedding the layer-wise build stores apart" if fixed
                             else "") + "); allowed: a size target of at least that, or smaller candidates")
    predicted = ctx.predicted(sol.assignment)
    names = {n.name: module_path(n) or n.name for n in ctx.float_model.graph if n.name}
    rows = ctx.space.assignment_table(sol.assignment)
    overrides = searched_overrides(rec, rows, names)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["candidate"]] = counts.get(r["candidate"], 0) + 1
    search = {
        "target": dict(srch.target), "route": "searched on the whole graph (round-to-nearest damage), built "
        "layer-wise with each layer's candidate", "status": sol.status,
        "budget_bytes": budget, "embedding_apart_bytes": fixed, "predicted": predicted,
        "predicted_bytes_emitted": predicted["bytes"] + fixed, "fp32_bytes": fp32_bytes,
        "uniform_predicted": ctx.uniform_all, "assignment": rows, "counts": counts,
        "pinned": list(ctx.space.pinned),
        "sensitivity": ctx.sensitivity_info,
        "search_timings": {k: round(v, 2) for k, v in ctx.timings.items()},
    }
    log.info("search: %s within %.1f MB (%s)", ", ".join(f"{v} x {k}" for k, v in sorted(counts.items())),
             budget / 1e6, srch.target)
    search["search_s"] = time.perf_counter() - t
    return overrides, search
