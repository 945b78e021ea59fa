"""Per-layer sensitivity: the damage to the model's output when ONLY one unit takes one format.

``damage(u, f)`` is measured, not estimated: ONNX Runtime runs the model with unit ``u`` in
format ``f`` and everything else in FP32 on a few calibration samples, and the output is
compared with the FP32 output of the same samples:

* ``kl``: mean over output positions of ``KL(softmax(z_fp32) || softmax(z_f))`` (classifier /
  LM logits; for an LM the positions are the tokens);
* ``mse``: ``||y_f - y_fp32||^2 / ||y_fp32||^2`` (any output).

The solver treats damage as additive over units (first-order: small independent
perturbations of the output add up); the sweep reports how well that predicts the measured
metric of the emitted mixes (Spearman rank correlation).

Two engines, one table:

* **probe graph** (linear layers, :class:`~quantkit.search.linear.LinearSpace`): ONE session
  whose MatMul weights are graph inputs, and whose int8_dynamic layers are ``If`` nodes
  switching between the float MatMul and the real per-token int8 kernels by a boolean input
  per (unit, candidate).  Every measurement is then one ``run`` with different feeds - no
  session rebuild.  Weight-only / fp16 / bf16 candidates are fed their effective (dequantized)
  weights, which is what ``MatMulNBits`` computes at ``accuracy_level`` 0 (at level 4 it
  additionally rounds activations per block; the emitted points measure that).
* **emit and run** (any space with ``emit``): emit the one-unit model, open a session, run it.

``measure="scaled"`` (linear spaces, probe engine): per unit, only the weight-only candidate with the largest
rounding error is run; every other weight-only candidate of the unit gets that damage times the ratio of their
input-weighted rounding errors ``sum_k h_k sum_n (W_c - W)_kn^2`` (``h_k``: mean square of input channel ``k`` on
the same samples; the second-order term of the output error, ``E||(W_c - W)^T x||^2`` with the channels taken as
uncorrelated).  Damage is about quadratic in a small weight perturbation and the perturbation's direction
changes little between grids of one unit, so the ratio carries over.  Checked on SmolLM2-135M (121 units,
int4 g128 measured; int4 g32 and 8-bit scaled): median scaled / measured 1.00 (g32) and 1.07 (8-bit), rank
correlation of the savings over int4 g128 0.92 and 1.00 - one measurement per unit instead of three.

The table is cached on disk (JSON) keyed by model, data, candidates and settings, and written
as it grows, so an interrupted search resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from quantkit.checksum import dumps_checked, loads_checked
from quantkit.progress import tqdm

log = logging.getLogger("quantkit")

__all__ = ["DamageTable", "measure_sensitivity", "probe_model"]

DamageTable = dict[tuple[str, str], float]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float32, copy=False)
    m = np.max(z, axis=-1, keepdims=True)
    e = z - m
    return e - np.log(np.sum(np.exp(e), axis=-1, keepdims=True))


class _Reference:
    """FP32 outputs of the samples, kept in the form the metric needs."""

    def __init__(self, metric: str, outputs: list[np.ndarray], masks: list[np.ndarray | None]) -> None:
        self.metric = metric
        self.masks = masks
        if metric == "kl":
            self.logp = [_log_softmax(o) for o in outputs]
            self.p = [np.exp(lp) for lp in self.logp]
        else:
            self.y = [o.astype(np.float32) for o in outputs]

    def damage(self, outputs: list[np.ndarray]) -> float:
        if self.metric == "kl":
            total, count = 0.0, 0
            for p, lp, o, mask in zip(self.p, self.logp, outputs, self.masks, strict=True):
                kl = np.sum(p * (lp - _log_softmax(o)), axis=-1)  # per position
                if mask is not None and mask.shape == kl.shape:
                    total += float(np.sum(kl * mask))
                    count += int(np.sum(mask))
                else:
                    total += float(np.sum(kl))
                    count += kl.size
            return max(
                total / max(count, 1), 0.0
            )  # KL >= 0; float rounding can give -1e-9 for identical outputs
        num = sum(
            float(np.sum((o.astype(np.float64) - y) ** 2)) for o, y in zip(outputs, self.y, strict=True)
        )
        den = sum(float(np.sum(y.astype(np.float64) ** 2)) for y in self.y)
        return num / max(den, 1e-30)


# -- cache ------------------------------------------------------------------------------------------
class _TableCache:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.table: DamageTable = {}
        self.info: dict[str, Any] = {}  # how the table was made (measured / scaled counts)
        if path is not None and path.exists():
            try:
                raw = loads_checked(path.read_text())  # checksummed: an edited table is a miss
                self.table = {
                    (k.split("\t")[0], k.split("\t")[1]): float(v) for k, v in raw["damage"].items()
                }
                self.info = dict(raw.get("info") or {})
            except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
                self.table = {}
                log.warning("sensitivity cache %s unusable (%s); measuring again", path, exc)

    def save(self) -> None:
        if self.path is None:
            return
        from quantkit.report.build import atomic_write_text

        blob = dumps_checked({"damage": {f"{u}\t{c}": v for (u, c), v in sorted(self.table.items())},
                              "info": self.info})
        try:
            atomic_write_text(self.path, blob)
        except OSError as exc:
            log.warning("cannot write the sensitivity cache %s (%s); carrying on without it", self.path, exc)


def cache_path(parts: Mapping[str, Any]) -> Path:
    from quantkit.frontends.cache import cache_dir

    key = hashlib.sha256(json.dumps(dict(parts), sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_dir() / "search" / f"sensitivity-{key}.json"


# -- probe graph (linear layers) -------------------------------------------------------------------
def _gate_name(unit: str, cand: str) -> str:
    return f"quantkit_gate::{unit}::{cand}"


def _int8_branch(
    space: Any, unit: Any, cand: str, layer: str, x_name: str, out: str, prefix: str
) -> onnx.GraphProto:
    """The per-token int8 kernels of ``layer`` as an ``If`` branch reading ``x_name`` from outer scope."""
    import onnx_ir as ir

    from quantkit.lowering.dynamic import lower_int8_dynamic
    from quantkit.lowering.nbits import apply_input_scale

    lay = space.layers[layer]
    art = space.int8_artifact(unit, cand)
    w = np.zeros((lay.K, lay.N), np.float32)
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", [x_name, "W"], [out], name=layer)],
        "branch",
        [onnx.helper.make_tensor_value_info(x_name, onnx.TensorProto.FLOAT, None)],
        [onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "W")],
    )
    tiny = ir.from_proto(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)]))
    if art.s is not None:
        apply_input_scale(tiny, [layer], art.s)
    q, sc = art.codes[layer]
    lower_int8_dynamic(tiny, layer, q, sc, granularity=space.candidates[cand].granularity)
    bg = ir.to_proto(tiny).graph
    # rename everything defined inside the branch (sibling branches must not share names)
    ren = {t.name: prefix + t.name for t in bg.initializer}
    for n in bg.node:
        for o in n.output:
            if o and o != out:
                ren[o] = prefix + o
    for t in bg.initializer:
        t.name = ren[t.name]
    for n in bg.node:
        n.name = prefix + n.name
        n.input[:] = [ren.get(i, i) for i in n.input]
        n.output[:] = [ren.get(o, o) for o in n.output]
    return onnx.helper.make_graph(
        list(bg.node),
        prefix + "then",
        [],
        [onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)],
        list(bg.initializer),
    )


def probe_model(space: Any) -> tuple[onnx.ModelProto, dict[str, str], dict[tuple[str, str], str]]:
    """``(probe proto, layer -> weight input name, (unit, int8 candidate) -> gate input name)``.

    A tied lm_head (``MatMul(h, Transpose(E))``) keeps the graph's own form: its weight input is the table ``E
    [N, K]``, which the embedding ``Gather`` reads too, and both are fed the candidate's weight in the table's
    layout (the emitted model stores the table once, quantized, for both; the space builds a tied candidate's
    weight in that layout, so no transposed copy is made)."""
    from quantkit.irtools import weightless_proto

    int8_cands = [n for n, c in space.candidates.items() if c.format == "int8_dynamic"]
    layer_unit = {n: u for u in space.units for n in u.layers}
    weights = {n: space.layers[n].weight for n in space.layers}  # a tied lm_head's: the table E
    wanted = set(weights.values())
    # the probe feeds the searched weights: the graph serialized without them (no second copy of the model's
    # weights in memory, ~0.5 GB for a 135M-parameter decoder)
    proto, moved = weightless_proto(space.model, wanted)
    for name, v in moved:
        t = v.const_value
        proto.graph.input.append(onnx.helper.make_tensor_value_info(name, int(t.dtype), list(t.shape.numpy())))
    gates: dict[tuple[str, str], str] = {}
    if int8_cands:
        for u in space.units:
            for c in int8_cands:
                if not _ok(space, u, c):
                    continue
                gates[(u.name, c)] = _gate_name(u.name, c)
                proto.graph.input.append(
                    onnx.helper.make_tensor_value_info(gates[(u.name, c)], onnx.TensorProto.BOOL, [])
                )
        nodes = []
        for node in proto.graph.node:
            here = [c for c in int8_cands if node.name in layer_unit and (layer_unit[node.name].name, c) in gates]
            if not here or node.op_type != "MatMul":
                nodes.append(node)
                continue
            unit = layer_unit[node.name]
            x, w, y = node.input[0], node.input[1], node.output[0]
            # innermost: the float MatMul; each int8 candidate wraps it in an If
            inner_out = f"{node.name}/float_y"
            current = onnx.helper.make_graph(
                [onnx.helper.make_node("MatMul", [x, w], [inner_out], name=f"{node.name}/float")],
                f"{node.name}/else",
                [],
                [onnx.helper.make_tensor_value_info(inner_out, onnx.TensorProto.FLOAT, None)],
            )
            for i, c in enumerate(here):
                out_i = y if i == len(here) - 1 else f"{node.name}/if{i}_y"
                then = _int8_branch(
                    space, unit, c, node.name, x, f"{node.name}/int8_{i}_y", f"{node.name}/c{i}/"
                )
                if_node = onnx.helper.make_node(
                    "If",
                    [gates[(unit.name, c)]],
                    [out_i],
                    name=f"{node.name}/switch{i}",
                    then_branch=then,
                    else_branch=current,
                )
                if i == len(here) - 1:
                    nodes.append(if_node)
                else:
                    current = onnx.helper.make_graph(
                        [if_node],
                        f"{node.name}/else{i}",
                        [],
                        [onnx.helper.make_tensor_value_info(out_i, onnx.TensorProto.FLOAT, None)],
                    )
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        if not any(o.domain == "com.microsoft" for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return proto, weights, gates


def _ok(space: Any, unit: Any, cand: str) -> bool:
    """Whether ``unit`` can take ``cand`` (a space may restrict it, e.g. a tied lm_head: weight-only only)."""
    allowed = getattr(space, "allowed", None)
    return allowed is None or cand in allowed(unit)


def _samples(dataset: Any, count: int, seq_len: int | None) -> list[dict[str, np.ndarray]]:
    out = []
    for feed in dataset.batches(1):
        if seq_len is not None:
            feed = {
                k: (v[:, :seq_len] if v.ndim == 2 and v.dtype == np.int64 else v) for k, v in feed.items()
            }
        out.append(feed)
        if len(out) >= count:
            break
    return out


def measure_sensitivity(
    space: Any,
    dataset: Any,
    *,
    samples: int,
    seq_len: int | None,
    metric: str,
    cache_parts: Mapping[str, Any] | None = None,
    progress: bool = True,
    engine: str = "auto",
    measure: str = "all",
    info: dict[str, Any] | None = None,
) -> DamageTable:
    """``(unit, candidate) -> damage`` for every unit and non-fp32 candidate of ``space``.

    ``measure``: "all" runs every (unit, candidate); "scaled" runs one weight-only candidate per unit and scales
    the others (module doc; needs the probe engine, else every one is run).  ``info``, when given, receives
    ``measured`` / ``scaled`` counts and how the scaled ones were made."""
    if measure not in ("all", "scaled"):
        from quantkit.errors import RecipeError

        raise RecipeError(f"search.sensitivity.measure {measure!r}: allowed: 'all', 'scaled'")
    feeds = _samples(dataset, samples, seq_len)
    if not feeds:
        from quantkit.errors import DataError

        raise DataError("sensitivity: the calibration data yielded no sample")
    cache = _TableCache(cache_path(cache_parts) if cache_parts is not None else None)
    todo = [
        (u, c)
        for u in space.units
        for c, cand in space.candidates.items()
        if cand.format != "fp32" and _ok(space, u, c) and (u.name, c) not in cache.table
    ]
    for u in space.units:
        for c, cand in space.candidates.items():
            if cand.format == "fp32":
                cache.table[(u.name, c)] = 0.0
    if not todo:
        log.info("sensitivity: all %d measurements reused from %s", len(cache.table), cache.path)
        if info is not None:
            info.update(cache.info)
        return dict(cache.table)
    use_probe = engine == "probe" or (engine == "auto" and hasattr(space, "int8_artifact"))
    if measure == "scaled" and not use_probe:
        log.info("sensitivity: measure 'scaled' needs the probe engine (linear layers); every candidate is run")
        measure = "all"
    runner = _probe_runner(space, feeds, expose=measure == "scaled") if use_probe else _emit_runner(space, feeds)
    masks = [f.get("attention_mask") for f in feeds]
    ref = _Reference(
        metric, runner(None, None), [m.astype(np.float32) if m is not None else None for m in masks]
    )
    scaled: dict[tuple[str, str], tuple[str, float]] = {}  # (unit, cand) -> (the measured cand, error ratio)
    pending = {(u.name, c) for u, c in todo}
    if measure == "scaled":
        from quantkit.search.linear import WEIGHT_ONLY

        energy = runner.input_energy()  # type: ignore[attr-defined]
        wo = {c for c, cand in space.candidates.items() if cand.format in WEIGHT_ONLY}
        total = sum(1 for u, c in todo if c not in wo) + len({u.name for u, c in todo if c in wo})
    else:
        total = len(todo)
    done = 0
    with tqdm(total=total, desc="sensitivity", unit="layer x format", disable=not progress) as bar:
        for u in space.units:
            mine = [c for c in space.candidates if (u.name, c) in pending]
            if not mine:
                continue
            top_eff: dict[str, np.ndarray] | None = None
            unit_top: str | None = None  # the weight-only candidate measured for the unit's scaled ones
            if measure == "scaled":
                errs, top, top_eff = _weighted_errors(space, u, energy)
                if len(errs) >= 2 and top is not None:
                    unit_top = top
                    for c, e in errs.items():
                        if c != top:
                            scaled[(u.name, c)] = (top, e / errs[top] if errs[top] > 0 else 0.0)
                    # the measured candidate is run (once) even when only the scaled ones were missing
                    mine = [c for c in mine if (u.name, c) not in scaled]
                    if (u.name, top) not in cache.table and top not in mine:
                        mine.append(top)
            for c in mine:
                eff = top_eff if c == unit_top else None  # rounded once, for its error and its run
                cache.table[(u.name, c)] = ref.damage(runner(u, c, eff))
                bar.update(1)
                done += 1
                if done % 25 == 0:
                    cache.save()
    for (un, c), (top, ratio) in scaled.items():
        cache.table[(un, c)] = cache.table[(un, top)] * ratio
    cache.info = {"measure": measure, "measured": len(cache.table) - len(scaled), "scaled": len(scaled)}
    if scaled:
        cache.info["how"] = ("per unit, the weight-only candidate with the largest input-weighted rounding error "
                             "measured; the others scaled by their error ratio to it")
    if info is not None:
        info.update(cache.info)
    cache.save()
    return dict(cache.table)


_ERR_COLUMNS = 1 << 14  # columns of a weight difference squared at a time (a 49k-column lm_head: no full copy)
_KEEP_BYTES = 1 << 26
"""The measured candidate's rounded weights are kept from the error pass for its run up to this size; a larger
unit (a 49k x 576 lm_head: 113 MB) is rounded again for the run rather than held next to the next candidate's."""


def _weighted_errors(space: Any, unit: Any, energy: Mapping[str, np.ndarray]
                     ) -> tuple[dict[str, float], str | None, dict[str, np.ndarray] | None]:
    """``(candidate -> sum over the unit's layers of sum_k h_k sum_n (W_c - W)_kn^2, the candidate with the largest,
    its effective weights)`` over the unit's weight-only candidates (``h``: the unit input's per-channel sum of
    squares; effective weights ``[K, N]``: the largest's, kept for its run when small, :data:`_KEEP_BYTES`)."""
    from quantkit.search.linear import WEIGHT_ONLY

    h = energy.get(unit.input)
    out: dict[str, float] = {}
    top: str | None = None
    top_eff: dict[str, np.ndarray] | None = None
    if h is None:
        return out, top, top_eff
    for c, cand in space.candidates.items():
        if cand.format not in WEIGHT_ONLY or not _ok(space, unit, c):
            continue
        eff = space.effective_weights(unit, c)
        if eff is None:
            continue
        per_k = np.zeros_like(h)
        for n, w in eff.items():
            ref = space.weight(n)
            for j in range(0, ref.shape[1], _ERR_COLUMNS):
                # C order whatever the layouts (a tied layer's weights are views of [N, K] tables): the same sums
                d = np.subtract(np.asarray(w[:, j:j + _ERR_COLUMNS], np.float32), ref[:, j:j + _ERR_COLUMNS],
                                order="C")
                per_k += np.einsum("kn,kn->k", d, d, dtype=np.float64)
        out[c] = float(h @ per_k)
        if top is None or out[c] > out[top]:
            top = c
            top_eff = eff if sum(int(w.nbytes) for w in eff.values()) <= _KEEP_BYTES else None
        del eff
    return out, top, top_eff


def _session(proto_bytes: bytes) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.enable_cpu_mem_arena = False
    return ort.InferenceSession(proto_bytes, so, providers=["CPUExecutionProvider"])


def _probe_runner(
    space: Any, feeds: list[dict[str, np.ndarray]], expose: bool = False
) -> Callable[..., list[np.ndarray]]:
    """``run(unit, cand)``: the probe's output on every feed; with ``expose``, ``run.input_energy()`` gives each
    unit input's per-channel sum of squares over the feeds (FP32 weights)."""
    proto, weights, gates = probe_model(space)
    inputs = sorted({u.input for u in space.units}) if expose else []
    have = {o.name for o in proto.graph.output}
    for name in inputs:
        if name not in have:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    sess = _session(proto.SerializeToString())
    del proto
    out_name = sess.get_outputs()[0].name
    wanted = {i.name for i in sess.get_inputs()}
    tables = {n: space.layers[n].weight for n in space.layers if getattr(space.layers[n], "tied", None)}
    base: dict[str, np.ndarray] = {weights[n]: space.weight(n) for n in space.layers if n not in tables}
    # the table as the model holds it (not a transposed copy of the lm_head's [K, N] weight: 113 MB on SmolLM2)
    base.update({t: _table(space, n, t) for n, t in tables.items()})
    base.update({g: np.array(False) for g in gates.values()})

    def run(unit: Any, cand: str | None, eff: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        feed = dict(base)
        if unit is not None and cand is not None:
            if eff is None:
                eff = space.effective_weights(unit, cand)
            if eff is None:
                feed[gates[(unit.name, cand)]] = np.array(True)
            else:
                for n, w in eff.items():
                    # a tied layer's [K, N] weight is the transpose of a [N, K] table: no copy when it is one
                    feed[weights[n]] = np.ascontiguousarray(w.T if n in tables else w, np.float32)
        return [
            sess.run([out_name], {**{k: v for k, v in f.items() if k in wanted}, **feed})[0] for f in feeds
        ]

    def input_energy() -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for f in feeds:
            got = sess.run(inputs, {**{k: v for k, v in f.items() if k in wanted}, **base})
            for name, x in zip(inputs, got, strict=True):
                x2 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
                out[name] = out.get(name, 0.0) + np.einsum("ij,ij->j", x2, x2)
        return out

    run.input_energy = input_energy  # type: ignore[attr-defined]
    return run


def _table(space: Any, layer: str, name: str) -> np.ndarray:
    """The embedding table ``name`` a tied lm_head ``layer`` reads, float32 ``[N, K]``: the model's own array when it
    is one (no copy), else the transpose of the layer's weight."""
    from quantkit.lowering.select import constant_array

    v = space.model.graph.initializers.get(name)
    arr = constant_array(v) if v is not None else None
    if arr is not None:
        arr = np.asarray(arr)
        if arr.dtype == np.float32 and arr.flags.c_contiguous and arr.shape == space.weight(layer).shape[::-1]:
            return arr
    return np.ascontiguousarray(space.weight(layer).T, np.float32)


def _emit_runner(
    space: Any, feeds: list[dict[str, np.ndarray]]
) -> Callable[..., list[np.ndarray]]:
    import onnx_ir as ir

    def run(unit: Any, cand: str | None, eff: Any = None) -> list[np.ndarray]:
        assignment = {} if unit is None or cand is None else {unit.name: cand}
        m = space.emit(assignment)  # the reference too: pinned layers as in every emitted point
        sess = _session(ir.to_proto(m).SerializeToString())
        name = sess.get_outputs()[0].name
        wanted = {i.name for i in sess.get_inputs()}
        return [sess.run([name], {k: v for k, v in f.items() if k in wanted})[0] for f in feeds]

    return run
