"""Whole-model verdicts a user can act on: where along the chain the error grows, and what to try.

Per-layer figures can all look fine while the whole model does not: each int8 layer adds a little error
(or, for the fused kernels, a one-step rounding difference from the QDQ math), and a deep or sensitive
network amplifies it.  Two measurements are already in every report, and this module reads them along
the graph:

* the output SQNR of every quantized layer against FP32 in the emitted model (``layers[*].output_sqnr_db``);
* the drift of every quantized tensor between this CPU's fused kernels and the QDQ math
  (``kernels.check.layers[*].drift_db``).

For a layer ``L`` with nearest quantized predecessors ``P`` (walking back through non-quantized nodes),
its *growth* is ``min_{p in P} SQNR(p) - SQNR(L)`` in dB: how much worse its output is than the worst of
its inputs.  A layer fed only by graph inputs (exact) is compared with :data:`IDEAL_INT8_DB`.  The layers
with the largest growth are where the error is made or amplified; keeping them in float is the first
thing to try, and the verdict prints the recipe snippet.

Where the report also measured the tensors a layer *reads* (before its input quantizer), the growth is split
in two: the layer's own (``SQNR(input) - SQNR(L)``: its weights and input quantizer) and the growth *between*
``P`` and ``L`` (``min SQNR(p) - SQNR(input)``), made by the float ops on the way.  A LayerNorm over a
tensor whose power is mostly a common offset, or frames of near-zero variance, turns a 24 dB input into 8 dB
without quantizing anything (wav2vec2's feature encoder into its projection): keeping ``L`` in float cannot
help there, keeping the layers *before* the ops in float does, and the verdict names those instead.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import onnx

__all__ = ["below_fidelity_floor", "error_growth", "layer_predecessors", "layers_between", "suggested_float_layers",
           "upstream_layers", "verdict_warnings"]

IDEAL_INT8_DB = 6.02 * 8
"""SQNR of an ideal 8-bit uniform quantizer on a full-scale uniform signal: the reference for a layer fed
only by exact graph inputs."""
FIDELITY_SQNR_DB = 20.0
"""Output SQNR against FP32 below which the verdict names the layers (an int8 model whose output keeps
1% of its power as error, SQNR 20 dB, has lost visible accuracy on most tasks)."""
FIDELITY_TOP1 = 0.9
"""Top-1 agreement with FP32 below which a classifier's verdict names the layers."""
DRIFT_SQNR_DB = 30.0
"""Fused-kernels-vs-QDQ-math SQNR at an output below which the drift is reported although every layer
alone agrees (one rounding step on ~1% of the codes of one layer gives ~40 dB)."""
DRIFT_TOP1 = 0.95
TOP = 3
GROWTH_MIN_DB = 1.0
"""Growth below this is not named: a layer that loses less than 1 dB of what it reads is not where the error is
made (and 16 evaluation samples do not resolve it much better)."""
UPSTREAM = 8
"""At most this many layers (nearest first) are named to keep in float before ops that amplify the error."""


def _walk(proto: onnx.ModelProto, layers: set[str]) -> dict[str, tuple[list[str], list[str]]]:
    """``layer -> (the nearest layers of `layers` upstream of it, the op types of the nodes walked through)``."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    inits = {t.name for t in proto.graph.initializer}
    out: dict[str, tuple[list[str], list[str]]] = {}
    for node in proto.graph.node:
        if node.name not in layers:
            continue
        preds: list[str] = []
        via: list[str] = []
        stack = [i for i in node.input if i and i not in inits]
        seen: set[str] = set()
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            p = producer.get(t)
            if p is None:
                continue
            if p.name in layers:
                if p.name not in preds:
                    preds.append(p.name)
                continue
            if p.op_type not in via and p.op_type != "Constant":
                via.append(p.op_type)
            stack.extend(i for i in p.input if i and i not in inits)
        out[node.name] = (preds, via[::-1])  # in graph order
    return out


def layer_predecessors(proto: onnx.ModelProto, layers: set[str]) -> dict[str, list[str]]:
    """``layer -> the nearest layers of `layers` upstream of it`` (through nodes that are not layers)."""
    return {k: v[0] for k, v in _walk(proto, layers).items()}


def layers_between(proto: onnx.ModelProto, layers: set[str]) -> dict[str, list[str]]:
    """``layer -> the op types between it and its nearest upstream layers`` (graph order reversed)."""
    return {k: v[1] for k, v in _walk(proto, layers).items()}


def upstream_layers(proto: onnx.ModelProto, layers: set[str], layer: str, limit: int = UPSTREAM
                    ) -> tuple[list[str], int]:
    """The layers of ``layers`` upstream of ``layer`` (all of them, not only the nearest), nearest first: at most
    ``limit``, and how many more there are."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    node = next((n for n in proto.graph.node if n.name == layer), None)
    if node is None:
        return [], 0
    found: list[str] = []
    frontier = [i for i in node.input if i]
    seen: set[str] = set(frontier)
    while frontier:  # breadth first: by distance in nodes
        nxt: list[str] = []
        for t in frontier:
            p = producer.get(t)
            if p is None:
                continue
            if p.name in layers and p.name != layer and p.name not in found:
                found.append(p.name)
            for i in p.input:
                if i and i not in seen:
                    seen.add(i)
                    nxt.append(i)
        frontier = nxt
    return found[:limit], max(0, len(found) - limit)


def error_growth(values: Mapping[str, float], preds: Mapping[str, list[str]],
                 inputs: Mapping[str, float] | None = None, via: Mapping[str, list[str]] | None = None
                 ) -> list[dict[str, Any]]:
    """Rows sorted by growth (largest first), for the layers of ``values`` (SQNR in dB per layer) whose value is
    finite (module doc): ``{kind: "layer", layer, in_db, out_db, growth_db}``, and where ``inputs`` (``layer ->
    SQNR of the tensors it reads``) has the layer and it has predecessors, also ``{kind: "between", layer, after,
    via, in_db, out_db, growth_db}``: the growth made by the nodes (op types ``via``) between its predecessors
    ``after`` and its input."""
    inputs = inputs or {}
    rows: list[dict[str, Any]] = []
    for layer, v in values.items():
        if v is None or not math.isfinite(float(v)):
            continue
        after = [p for p in preds.get(layer, []) if p in values and values[p] is not None
                 and math.isfinite(float(values[p]))]
        ref = min(float(values[p]) for p in after) if after else IDEAL_INT8_DB
        own = inputs.get(layer)
        if own is not None and not math.isnan(float(own)):
            if after and math.isfinite(float(own)):
                rows.append({"kind": "between", "layer": layer, "after": after,
                             "via": list((via or {}).get(layer, [])), "in_db": ref, "out_db": float(own),
                             "growth_db": ref - float(own)})
            ref = min(float(own), IDEAL_INT8_DB)
        rows.append({"kind": "layer", "layer": layer, "in_db": ref, "out_db": float(v), "growth_db": ref - float(v)})
    rows.sort(key=lambda r: -float(r["growth_db"]))
    return rows


def _snippet(layers: list[str]) -> str:
    items = ", ".join(f"{{layer: {name}, format: fp32}}" for name in layers)
    return f"quantization: {{overrides: [{items}]}}"


def _where(rows: list[dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        if r.get("kind") == "between":
            ops = "/".join(r.get("via") or []) or "the nodes"
            parts.append(f"the {ops} between {', '.join(r['after'])} and {r['layer']} ({r['in_db']:.1f} -> "
                         f"{r['out_db']:.1f} dB, in float: they amplify the error of the layers before them, so "
                         f"keeping {r['layer']} in float would not help)")
        else:
            parts.append(f"{r['layer']} ({r['in_db']:.1f} -> {r['out_db']:.1f} dB)")
    return ", ".join(parts)


def _keep_float(rows: list[dict[str, Any]]) -> list[str]:
    """The layers the verdict suggests keeping in float: a layer where it grows, the layers before the float ops
    where it grows between layers (``upstream``, set by the report from the graph; else the nearest ones)."""
    out: list[str] = []
    for r in rows:
        names = (r.get("upstream") or r.get("after") or []) if r.get("kind") == "between" else [r["layer"]]
        out += [n for n in names if n not in out]
    return out


def below_fidelity_floor(fidelity: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """The outputs whose fidelity against FP32 is below the verdict's floor (:data:`FIDELITY_SQNR_DB`, or a top-1
    agreement below :data:`FIDELITY_TOP1`), as ``(name, figures)``."""
    return [(name, d) for name, d in fidelity.items()
            if float(d.get("sqnr_db", math.inf)) < FIDELITY_SQNR_DB or d.get("top1_agreement", 1.0) < FIDELITY_TOP1]


def _top(sqnr_growth: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in sqnr_growth if r["growth_db"] >= GROWTH_MIN_DB][:TOP]


def suggested_float_layers(fidelity: Mapping[str, Mapping[str, Any]], sqnr_growth: list[dict[str, Any]]) -> list[str]:
    """The layers the accuracy verdict tells the user to keep in float (its recipe snippet), or ``[]`` when the
    outputs are above the floor or no layer grows the error by :data:`GROWTH_MIN_DB` or more."""
    top = _top(sqnr_growth)
    return _keep_float(top) if below_fidelity_floor(fidelity) and top else []


def verdict_warnings(fidelity: Mapping[str, Mapping[str, float]], sqnr_growth: list[dict[str, Any]],
                     kernels: Mapping[str, Any], drift_growth: list[dict[str, Any]],
                     layers: Collection[str] | None = None) -> list[str]:
    """The whole-model verdicts (module doc): empty when the outputs are close to FP32 and the fused
    kernels stay close to the QDQ math.  ``layers``: the quantized layers a recipe override can name; where the
    drift grows at the output of an op that is not one (a float GELU before an int8 MatMul), the snippet names
    only the layers among the rows (none: no snippet)."""
    out = []
    worst = below_fidelity_floor(fidelity)
    top = _top(sqnr_growth)
    if worst and top:
        what = "; ".join(f"'{n}' SQNR {float(d.get('sqnr_db', math.nan)):.1f} dB"
                         + (f", top-1 {d['top1_agreement']:.2f}" if "top1_agreement" in d else "") for n, d in worst)
        keep = _keep_float(top)
        more = sum(int(r.get("upstream_more", 0)) for r in top if r.get("kind") == "between")
        out.append(f"accuracy: the quantized model is far from FP32 ({what}); the error grows most at "
                   f"{_where(top)} (SQNR vs FP32, from the worst input to the output). Try keeping "
                   + ("these layers" if keep != [r["layer"] for r in top] else "them")
                   + f" in float: {_snippet(keep)}"
                   + (f" ({more} more layers upstream feed the same ops)" if more else ""))
    chk = kernels.get("check") or {}
    if chk and chk.get("agree", False):
        drifting = [(n, d) for n, d in (chk.get("outputs") or {}).items()
                    if float(d.get("sqnr_db", math.inf)) < DRIFT_SQNR_DB or d.get("top1_agreement", 1.0) < DRIFT_TOP1]
        dtop = [r for r in drift_growth if r["growth_db"] >= GROWTH_MIN_DB][:TOP]
        if drifting and dtop:
            what = "; ".join(f"'{n}' SQNR {float(d.get('sqnr_db', math.nan)):.1f} dB"
                             + (f", top-1 {d['top1_agreement']:.2f}" if "top1_agreement" in d else "")
                             for n, d in drifting)
            named = [r["layer"] for r in dtop if layers is None or r["layer"] in layers]
            advice = (f"and if it falls short keep those layers in float: {_snippet(named)}" if named else
                      "and if it falls short keep the int8 layers that read those ops' outputs in float")
            out.append(f"kernels: every layer alone matches the QDQ math (at most one rounding step), but the "
                       f"one-step differences compound to {what} between this CPU's fused kernels and the QDQ "
                       f"math at the output: this model amplifies small perturbations. The drift grows most at "
                       f"{_where(dtop)}. Judge the model by its fused-kernel accuracy (the report's fidelity), "
                       f"{advice}")
    return out
