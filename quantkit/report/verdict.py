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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import onnx

__all__ = ["error_growth", "layer_predecessors", "verdict_warnings"]

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


def layer_predecessors(proto: onnx.ModelProto, layers: set[str]) -> dict[str, list[str]]:
    """``layer -> the nearest layers of `layers` upstream of it`` (through nodes that are not layers)."""
    producer = {o: n for n in proto.graph.node for o in n.output}
    inits = {t.name for t in proto.graph.initializer}
    out: dict[str, list[str]] = {}
    for node in proto.graph.node:
        if node.name not in layers:
            continue
        preds: list[str] = []
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
            stack.extend(i for i in p.input if i and i not in inits)
        out[node.name] = preds
    return out


def error_growth(values: Mapping[str, float], preds: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    """Rows ``{layer, in_db, out_db, growth_db}`` sorted by growth (largest first), for the layers of
    ``values`` (SQNR in dB per layer) whose value is finite (module doc)."""
    rows: list[dict[str, Any]] = []
    for layer, v in values.items():
        if v is None or not math.isfinite(float(v)):
            continue
        ins = [float(values[p]) for p in preds.get(layer, []) if p in values and values[p] is not None]
        ins = [x for x in ins if math.isfinite(x)]
        ref = min(ins) if ins else IDEAL_INT8_DB
        rows.append({"layer": layer, "in_db": ref, "out_db": float(v), "growth_db": ref - float(v)})
    rows.sort(key=lambda r: -float(r["growth_db"]))
    return rows


def _snippet(layers: list[str]) -> str:
    items = ", ".join(f"{{layer: {name}, format: fp32}}" for name in layers)
    return f"quantization: {{overrides: [{items}]}}"


def _where(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['layer']} ({r['in_db']:.1f} -> {r['out_db']:.1f} dB)" for r in rows)


def verdict_warnings(fidelity: Mapping[str, Mapping[str, float]], sqnr_growth: list[dict[str, Any]],
                     kernels: Mapping[str, Any], drift_growth: list[dict[str, Any]]) -> list[str]:
    """The whole-model verdicts (module doc): empty when the outputs are close to FP32 and the fused
    kernels stay close to the QDQ math."""
    out = []
    worst = [(name, d) for name, d in fidelity.items()
             if float(d.get("sqnr_db", math.inf)) < FIDELITY_SQNR_DB or d.get("top1_agreement", 1.0) < FIDELITY_TOP1]
    top = [r for r in sqnr_growth if r["growth_db"] > 0][:TOP]
    if worst and top:
        what = "; ".join(f"'{n}' SQNR {float(d.get('sqnr_db', math.nan)):.1f} dB"
                         + (f", top-1 {d['top1_agreement']:.2f}" if "top1_agreement" in d else "") for n, d in worst)
        out.append(f"accuracy: the quantized model is far from FP32 ({what}); the error grows most at "
                   f"{_where(top)} (layer output SQNR vs FP32, from its worst input to its output). Try keeping "
                   f"them in float: {_snippet([r['layer'] for r in top])}")
    chk = kernels.get("check") or {}
    if chk and chk.get("agree", False):
        drifting = [(n, d) for n, d in (chk.get("outputs") or {}).items()
                    if float(d.get("sqnr_db", math.inf)) < DRIFT_SQNR_DB or d.get("top1_agreement", 1.0) < DRIFT_TOP1]
        dtop = [r for r in drift_growth if r["growth_db"] > 0][:TOP]
        if drifting and dtop:
            what = "; ".join(f"'{n}' SQNR {float(d.get('sqnr_db', math.nan)):.1f} dB"
                             + (f", top-1 {d['top1_agreement']:.2f}" if "top1_agreement" in d else "")
                             for n, d in drifting)
            out.append(f"kernels: every layer alone matches the QDQ math (at most one rounding step), but the "
                       f"one-step differences compound to {what} between this CPU's fused kernels and the QDQ "
                       f"math at the output: this model amplifies small perturbations. The drift grows most at "
                       f"{_where(dtop)}. Judge the model by its fused-kernel accuracy (the report's fidelity), "
                       f"and if it falls short keep those layers in float: {_snippet([r['layer'] for r in dtop])}")
    return out
