"""Build and write the quantization report (JSON is the source; Markdown/HTML render it)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from quantkit.evaluate.latency import load_average
from quantkit.irtools import proto_size
from quantkit.lowering.verify import Census
from quantkit.ops import FUSED_KERNELS, LAYER_OPS, PASSTHROUGH
from quantkit.recipe import RecipeModel
from quantkit.recipe.plan import inapplicable_overrides, unmatched_overrides
from quantkit.report.verdict import (
    UPSTREAM,
    error_growth,
    layer_predecessors,
    layers_between,
    upstream_layers,
    verdict_warnings,
)


def environment() -> dict[str, Any]:
    """Versions and machine facts, so every number can be traced to where it came from."""
    import numpy as np

    from quantkit._version import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "quantkit": __version__,
        "onnxruntime": ort.__version__,
        "onnx": onnx.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _static_rows(lowered: Any, census: Census, per_layer_sqnr: Mapping[str, float]) -> tuple[list[dict[str, Any]],
                                                                                             list[dict[str, Any]]]:
    """Rows of the static-INT8 layers (scales, zero points, kernel), and those ONNX Runtime did not fuse."""
    plan, lowering = lowered.static, lowered.lowering
    rows, unfused = [], []
    act_of: dict[str, list[str]] = {}
    for t in plan.tensors.values():
        for c in t.consumers:
            act_of.setdefault(c, []).append(t.name)
    kernels_of = {**dict.fromkeys(plan.dynamic_lstms, "DynamicQuantizeLSTM"),
                  **dict.fromkeys(plan.tables, "GatherBlockQuantized")}  # select rules 11 and 13: no QDQ group
    for name, lp in [*plan.layers.items(), *plan.dynamic_lstms.items(), *plan.tables.items()]:
        fusion = census.per_layer.get(name) if name in plan.layers else None
        w = lowering.weights.get(name)
        acts = [lowering.tensors[t] for t in act_of.get(name, []) if t in lowering.tensors]
        rows.append({
            "layer": name, "op": lp.op_type, "format": lp.format, "family": "static", "rule": lp.rule,
            "calibrator": lp.calibrator,
            "weights": None if w is None else {
                "dtype": w.dtype, "symmetric": w.symmetric, "axis": w.axis, "scale_min": w.scale_min,
                "scale_max": w.scale_max, "zero_point_range": list(w.zero_point_range),
                "weight_sqnr_db": _finite(w.weight_sqnr_db)},
            "inputs": [{"tensor": a.name, "dtype": a.dtype, "scale": a.scale, "zero_point": a.zero_point,
                        "calibrator": plan.tensors[a.name].calibrator if a.name in plan.tensors else None,
                        "note": a.note} for a in acts],
            "lowering_note": lowering.notes.get(name, ""),
            "output_sqnr_db": _finite(per_layer_sqnr[name]) if name in per_layer_sqnr else None,
            "fused": (True if name in kernels_of else None) if fusion is None else fusion.fused,
            "kernel": kernels_of.get(name) if fusion is None else fusion.kernel,
            "note": ("int8 data movement: ONNX Runtime drops the DQ/Q pair around it (same scale)"
                     if lp.op_type in PASSTHROUGH and name in plan.layers else "") if fusion is None else fusion.note,
        })
        if fusion is not None and not fusion.fused:
            unfused.append({
                "layer": name, "op": lp.op_type, "expected": list(FUSED_KERNELS.get(lp.op_type, ())),
                "note": fusion.note,
                "cost": "runs in float between a DequantizeLinear and a QuantizeLinear: the conversions are pure "
                        "overhead, so this layer is slower than in the FP32 model"})
    return rows, unfused


def _section_rows(rows: Sequence[Mapping[str, Any]], family: str, census: Census,
                  per_layer_sqnr: Mapping[str, float]) -> list[dict[str, Any]]:
    """A handler's rows with the census' kernel and, measured on the evaluation data, ``eval_output_sqnr_db``."""
    out = []
    for r in rows:
        fusion = census.per_layer.get(r["layer"])
        sq = per_layer_sqnr.get(r["layer"])
        out.append({**{k: (_finite(v) if isinstance(v, float) else v) for k, v in r.items()}, "family": family,
                    "kernel": None if fusion is None else fusion.kernel,
                    "fused": None if fusion is None else fusion.fused,
                    "eval_output_sqnr_db": None if sq is None else _finite(sq)})
    return out


PREFILL_NO_GAIN = 1.05
"""A quantized causal LM whose prefill is at most this much faster than FP32 gets a warning with the reason."""


def model_given_name(recipe: RecipeModel, read_from: str) -> str:
    """The model as the user named it: the recipe's ``model.source`` when the model was read from it, else
    the description of what was passed (``read_from``)."""
    src = recipe.model.source if recipe.model is not None else None
    return str(src) if src is not None and str(src) and str(src) in read_from else read_from


def latency_per(key: str, row: Mapping[str, Any]) -> str:
    """What one figure of an LLM latency row times: a whole prompt, or one generated token."""
    if key == "decode":
        if row.get("kv_cache") and row.get("new_tokens"):
            return f"per token (median of {row['new_tokens']} generated tokens)"
        return "per token (one-token call)"
    return f"per {row.get('tokens', '?')}-token prompt"


_W8A8_HINT = ("for prefill-heavy use try int8_dynamic (W8A8) on the largest layers (`quantkit sweep` with "
              "search.metric: latency finds the mix)")


GROUP_PADDING_NOTE = 0.02
"""Share of the weight-only codes' bytes that are padding (group sizes that do not divide K) above which the report
says so."""


def _figures(r: Mapping[str, Any]) -> tuple[int, int, int, int] | None:
    """A weight-only row's ``(K, N, group_size, bits)``, or None where one is missing (a per-channel layer)."""
    v = tuple(r.get(c) for c in ("K", "N", "group_size", "bits"))
    return v if all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v) else None  # type: ignore[return-value]


def _stored_k(r: Mapping[str, Any], k: int, g: int) -> int:
    """K as one column's codes are stored: rounded up to whole groups by a MatMulNBits (``[N, K / g, g / 2]``);
    a GatherBlockQuantized table stores its rows unpadded (only its scales are per group)."""
    return k if r.get("kernel") == "GatherBlockQuantized" else -(-k // g) * g


def _group_bytes(r: Mapping[str, Any], k: int, n: int, g: int, bits: int) -> float:
    """Bytes of one weight-only layer's codes, float16 scales and (asymmetric) packed zero points at group size g."""
    return n * _stored_k(r, k, g) * bits / 8 + n * -(-k // g) * (2 + (0 if r.get("symmetric", True) else bits / 8))


def group_padding_warnings(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Weight-only layers whose group size does not divide K: each column's last group is stored whole (a MatMulNBits
    pads it with zero codes), so part of the codes' bytes - read on every token - hold nothing.  Above
    :data:`GROUP_PADDING_NOTE` of the codes, a warning naming the layers' K and the largest power-of-two group size
    below the chosen one that divides every K, with what it would change in bytes."""
    rows_f = [(r, f) for r in rows if (f := _figures(r)) is not None]
    padded = total = 0.0
    ks: dict[int, int] = {}
    for r, (k, n, g, bits) in rows_f:
        stored = _stored_k(r, k, g)
        padded += n * (stored - k) * bits / 8
        total += n * stored * bits / 8
        if stored != k:
            ks[k] = ks.get(k, 0) + 1
    if not ks or total <= 0 or padded / total < GROUP_PADDING_NOTE:
        return []
    groups = sorted({f[2] for _, f in rows_f})
    fit = next((c for c in (groups[-1] >> i for i in range(1, 8))
                if c >= 16 and all(f[0] % c == 0 for _, f in rows_f)), None)
    which = ", ".join(f"K = {k} ({c} layer{'s' if c > 1 else ''})" for k, c in sorted(ks.items()))
    if fit:
        delta = sum(_group_bytes(r, k, n, fit, bits) - _group_bytes(r, k, n, g, bits) for r, (k, n, g, bits) in rows_f)
        hint = (f"; group_size: {fit} divides every K: a finer grid without padding, "
                f"{abs(delta) / 2**20:.1f} MiB {'smaller' if delta <= 0 else 'larger'} (codes, scales, zero points); "
                "but a MatMulNBits also pays per group at one token per call, so more, smaller groups can decode "
                "slower than fewer padded ones: time both (report.latency) before choosing")
    else:
        hint = "; no power-of-two group size from 16 up divides every K"
    return [f"the group size ({'/'.join(str(x) for x in groups)}) does not divide the input width of "
            f"{sum(ks.values())} weight-only layer(s) - {which}: each column's last group is padded with zero codes, "
            f"{100 * padded / total:.1f}% of the weight codes' bytes ({padded / 2**20:.1f} MiB), which a MatMulNBits "
            f"reads on every token{hint}"]


def llm_latency_warnings(latency: Mapping[str, Any], int4_kernel: Mapping[str, Any] | None) -> list[str]:
    """A causal LM whose prefill is no faster than FP32 (at most :data:`PREFILL_NO_GAIN`): why, and what to try.

    ``int4_kernel`` is the report's section of that name (the MatMulNBits accuracy_level shipped and how it was
    chosen, :mod:`quantkit.int4_kernel`), None when the model has no MatMulNBits."""
    p = latency.get("prefill")
    if not isinstance(p, Mapping) or not isinstance(p.get("speedup"), (int, float)) or p["speedup"] > PREFILL_NO_GAIN:
        return []
    what = f"{p['speedup']:.2f}x FP32 {latency_per('prefill', p)}"
    long = latency.get("prefill_long")
    if isinstance(long, Mapping) and isinstance(long.get("speedup"), (int, float)):
        what += f", {long['speedup']:.2f}x {latency_per('prefill_long', long)}"
    dec = latency.get("decode")
    gain = (f"; decode runs at {dec['speedup']:.2f}x FP32 {latency_per('decode', dec)}"
            if isinstance(dec, Mapping) and isinstance(dec.get("speedup"), (int, float)) else "")
    k = int4_kernel or {}
    level, how, cls = k.get("accuracy_level"), k.get("how"), k.get("cpu_class")
    bound = ("at many tokens per call the matrix products are compute-bound and the weight-only kernel unpacks its "
             "weights on the fly, so it pays off in decoding (one token per call, memory-bound), not in long prefills")
    if not k:
        why = ("at many tokens per call the matrix products are compute-bound, so the quantized model gains in "
               f"decoding (one token per call, memory-bound), not in long prefills; {_W8A8_HINT}")
    elif how == "measured":
        why = (f"MatMulNBits accuracy_level {level}, the faster of levels 4 and 0 on this CPU (class {cls}, see "
               f"int4_kernel), ships; {bound}. Neither level makes this prefill faster: {_W8A8_HINT}")
    elif how == "class default":
        why = (f"MatMulNBits accuracy_level {level} is the default of class {cls}, not measured here "
               f"({k.get('not_measured')}); {bound}; {_W8A8_HINT}")
    else:
        why = (f"MatMulNBits accuracy_level {level} is set by the recipe; export.accuracy_level: auto times level 4 "
               f"against level 0 on this CPU and ships the faster; {bound}; {_W8A8_HINT}")
    return [f"prefill is no faster than FP32 ({what}){gain}: {why}"]


def _level_text(level: Any) -> str:
    from quantkit.int4_kernel import LEVEL_NAMES

    return f"accuracy_level {level} ({LEVEL_NAMES.get(level, '?')})"


def int4_kernel_line(sec: Mapping[str, Any] | None) -> str:
    """One line on the MatMulNBits accuracy_level shipped: the class, the level, the measured alternative or why
    it was not measured (empty when the model has no MatMulNBits)."""
    if not sec:
        return ""
    name = "INT4 kernel" if list(sec.get("bits") or []) == [4] else "MatMulNBits kernel"
    level, cls = sec.get("accuracy_level"), sec.get("cpu_class")
    if sec.get("how") == "measured":
        rows = sec.get("measured") or {}
        mine, other_key = rows.get(str(level)) or {}, next((k for k in rows if k != str(level)), None)
        other = rows.get(other_key) or {} if other_key is not None else {}
        parts = []
        if "prefill_ms" in mine:
            parts.append(f"prefill {mine['prefill_ms']:.1f} ms vs {other.get('prefill_ms', float('nan')):.1f} ms "
                         f"at level {other_key}")
        if "decode_ms" in mine:
            parts.append(f"decode {mine['decode_ms']:.2f} vs {other.get('decode_ms', float('nan')):.2f} ms/token")
        if "call_ms" in mine:
            parts.append(f"{mine['call_ms']:.3f} ms vs {other.get('call_ms', float('nan')):.3f} ms per call at "
                         f"level {other_key}")
        line = f"{name}: {_level_text(level)} chosen for {cls}: {', '.join(parts)} (measured)"
    elif sec.get("how") == "class default":
        line = f"{name}: {_level_text(level)} for {cls}, the class default (not measured: {sec.get('not_measured')})"
    else:
        line = f"{name}: {_level_text(level)}, set by the recipe (export.accuracy_level; not measured)"
    shipped = sec.get("shipped") or {}
    if len(shipped) > 1:  # some layers built at another level (e.g. kept exact by a per-layer check)
        line += "; kernels per level as shipped: " + ", ".join(f"{k} x{v}" for k, v in sorted(shipped.items()))
    return line


def class_grid_line(sec: Mapping[str, Any] | None) -> str:
    """One line on the recipe's ``quantization.by_cpu_class`` entry that applied (empty when none did)."""
    if not sec:
        return ""
    parts = []
    if sec.get("group_size") is not None:
        parts.append(f"group_size {sec['group_size']}")
    w = sec.get("weights") or {}
    if w:
        parts.append("symmetric weights" if w.get("symmetric") else "asymmetric weights (a zero point per group)")
    how = "this CPU's class" if sec.get("target_isa") == "auto" else f"target.isa: {sec.get('target_isa')}"
    return (f"Weight grid: quantization.by_cpu_class[{sec.get('cpu_class')}] applied ({how}): "
            f"{', '.join(parts) or 'nothing changed'} in place of the default's")


def w4a8_line(sec: Mapping[str, Any], int4: Mapping[str, Any] | None = None) -> str:
    """One line on the W4A8 check (:mod:`quantkit.lowering.w4a8`): the layers kept at accuracy_level 0 and why."""
    if not sec.get("checked"):
        return f"W4A8 check: not run ({sec.get('why') or 'nothing to check'})"
    thr, kept = sec.get("threshold"), list(sec.get("kept_level0") or [])
    own = list(sec.get("kept_level0_own") or [])
    dist = (f"ratio median {_fmt(sec.get('median_ratio'), 3)}, max {_fmt(sec.get('max_ratio'), 2)} "
            f"(`{sec.get('worst_layer')}`)")
    if kept:
        names = ", ".join(own[:4]) + (" ..." if len(own) > 4 else "")
        why = (f"level-4 error > {thr:g}x the weight-only error: {names}"
               + (f"; {len(kept) - len(own)} more read the same input" if len(kept) > len(own) else ""))
        line = f"W4A8 check: {len(kept)} of {sec['checked']} 4-bit linears kept at accuracy_level 0 ({why}); {dist}"
    else:
        line = (f"W4A8 check: 0 of {sec['checked']} 4-bit linears kept at accuracy_level 0 (level-4 error at most "
                f"{thr:g}x the weight-only error everywhere: {dist})")
    if sec.get("why"):
        line += f"; {sec['why']}"
    eq = sec.get("equalize") or {}
    if eq:
        line += (f"; input equalization (signround `equalize`): {eq.get('groups_scaled', 0)} of "
                 f"{eq.get('groups_searched', 0)} layer groups scaled")
        if eq.get("not_applied"):
            line += f", {len(eq['not_applied'])} linears not (their scale would need a Mul, e.g. `{eq['not_applied'][0]}`)"
    shipped = (int4 or {}).get("shipped") or {}
    if kept and list(shipped) == ["0"]:
        line += "; moot: every kernel ships at level 0 (INT4 kernel)"
    return line


def greedy_line(g: Mapping[str, Any]) -> str:
    """One line on greedy-token agreement with FP32 (:mod:`quantkit.evaluate.greedy`)."""
    if not g.get("measured"):
        return f"greedy tokens vs FP32: not measured ({g.get('why')})"
    tf = g.get("teacher_forced_agreement")
    return (f"greedy tokens vs FP32 ({g['prompts']} prompts of {g['prompt_tokens']} tokens, {g['tokens']} generated "
            f"each): {100 * g['prefix_agreement']:.1f}% generated before the first divergence, "
            f"{100 * g['position_agreement']:.1f}% of positions agree"
            + (f", {100 * tf:.1f}% when fed FP32's tokens" if isinstance(tf, float) else "")
            + f"; {g['identical_prompts']} of {g['prompts']} prompts identical"
            + (f"; self-consistency (noise floor) FP32 {100 * sc['fp32']:.1f}%, quantized {100 * sc['quantized']:.1f}%"
               if isinstance(sc := g.get("self_consistency"), Mapping) else ""))


def int4_kernel_lines(rep: Mapping[str, Any]) -> list[str]:
    """The 'INT4 kernel' Markdown section: the level shipped, why, and both levels' times when measured."""
    sec = rep.get("int4_kernel")
    if not sec:
        return []
    lines = ["## INT4 kernel: MatMulNBits accuracy_level", "", int4_kernel_line(sec) + ".", "",
             f"Why: {sec.get('why')}.", ""]
    rows = sec.get("measured") or {}
    if rows:
        keys = [k for k in ("prefill_ms", "decode_ms", "call_ms") if any(k in r for r in rows.values())]
        heads = {"prefill_ms": "prefill ms", "decode_ms": "decode ms / token", "call_ms": "ms per call"}
        lines += ["| accuracy_level | " + " | ".join(heads[k] for k in keys) + " | geometric mean ms | shipped |",
                  "|---" * (len(keys) + 3) + "|"]
        lines += [f"| {lv} | " + " | ".join(_fmt(r.get(k), 3) for k in keys)
                  + f" | {_fmt(r.get('geomean_ms'), 3)} | {'yes' if str(sec.get('accuracy_level')) == lv else ''} |"
                  for lv, r in rows.items()]
        load = sec.get("load_average") or {}
        lines += ["", f"Timed: {sec.get('timed')}; {_load_text(load)}.", ""]
    return lines


def map_layer_kernels(proto: onnx.ModelProto, rows: Sequence[dict[str, Any]],
                      ops: Sequence[str] = ("MatMulNBits", "GatherBlockQuantized")) -> dict[str, Any]:
    """Fill ``kernel`` / ``kernel_node`` of each row from the emitted graph: the node named like the layer, or
    one node computing several layers of one module side by side (q/k/v read the same input: one
    ``MatMulNBits`` whose ``N`` is the sum of theirs).  Returns ``{"shared": [...], "unmatched": [...]}``: the
    nodes shared by several layers, and the kernel nodes of no layer row (an embedding reading a tied table)."""
    nodes = [n for n in proto.graph.node if n.op_type in ops]
    layers = {str(r["layer"]) for r in rows}
    for r in rows:
        node = next((n for n in nodes if n.name == r["layer"]), None)
        if node is not None:
            r["kernel"], r["kernel_node"] = node.op_type, node.name
    shared, unmatched = [], []
    for node in nodes:
        if node.name in layers:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        parent = node.name.rsplit(".", 1)[0]
        members = [r for r in rows if r.get("kernel") is None and str(r["layer"]).rsplit(".", 1)[0] == parent
                   and r.get("K") == attrs.get("K")]
        if len(members) > 1 and sum(int(r.get("N") or 0) for r in members) == attrs.get("N"):
            for r in members:
                r["kernel"], r["kernel_node"] = node.op_type, node.name
            shared.append({"kernel": node.op_type, "node": node.name, "layers": [r["layer"] for r in members]})
        else:
            unmatched.append({"kernel": node.op_type, "node": node.name})
    return {"shared": shared, "unmatched": unmatched}


def _kernel_story(rep: Mapping[str, Any]) -> dict[str, Any]:
    """How the quantized layers became the kernels the census counts: shared kernels, layers without one."""
    rows = rep.get("layers") or []
    kinds = dict((rep.get("census") or {}).get("quantized_kernels") or {})
    why: list[str] = []
    sharing = rep.get("kernel_sharing") or {}
    pattern: dict[tuple[str, tuple[str, ...]], int] = {}
    for g in sharing.get("shared") or []:
        key = (str(g["kernel"]), tuple(str(n).rsplit(".", 1)[-1] for n in g["layers"]))
        pattern[key] = pattern.get(key, 0) + 1
    for (kernel, names), count in pattern.items():
        why.append(f"{' + '.join(names)} read the same input and run as one {kernel} "
                   + (f"in each of {count} blocks " if count > 1 else "")
                   + f"({count * len(names)} layers -> {count} kernel{'s' if count > 1 else ''})")
    for u in sharing.get("unmatched") or []:
        why.append(f"`{u['node']}` ({u['kernel']}) has no layer of its own"
                   + (": it reads the quantized table of the tied lm_head / embedding, stored once"
                      if u["kernel"] == "GatherBlockQuantized" else ""))
    tied = [r["layer"] for r in rows if r.get("tied")]
    if tied:
        why.append(f"{', '.join(f'`{t}`' for t in tied)}: tied to the embedding, whose GatherBlockQuantized reads "
                   "the same quantized table (one more kernel, no layer of its own)")
    moves = [r for r in rows if r.get("family") == "static" and not r.get("kernel") and r.get("op") in PASSTHROUGH]
    if moves:
        why.append(f"{len(moves)} int8 data-movement layer{'s' if len(moves) > 1 else ''} ("
                   + ", ".join(f"`{r['layer']}` {r['op']}" for r in moves[:4]) + (" ..." if len(moves) > 4 else "")
                   + f") {'run' if len(moves) > 1 else 'runs'} without a kernel of its own: ONNX Runtime drops the "
                   "DQ/Q pair around it")
    unfused = [r for r in rows if r.get("fused") is False]
    if unfused:
        why.append(f"{len(unfused)} layer{'s' if len(unfused) > 1 else ''} not fused by ONNX Runtime (see Unfused "
                   "layers): they run in float between a DequantizeLinear and a QuantizeLinear")
    half = [r for r in rows if r.get("family") == "float"]
    if half:
        why.append(f"{len(half)} fp16 / bf16 layer{'s' if len(half) > 1 else ''}: 16-bit storage, computed in "
                   "float (no quantized kernel)")
    return {"layers": len(rows), "kernels": sum(int(v) for v in kinds.values()), "by_kernel": kinds, "why": why}


def _n(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _algorithm(r: Mapping[str, Any]) -> str:
    """The weight algorithm a row ran (a row may carry the note of a fallback: ``awq -> gptq (...)``)."""
    a = str(r.get("algorithm"))
    return a.split("->", 1)[1].split()[0] if "->" in a else a


def method_of(rep: Mapping[str, Any]) -> dict[str, Any]:
    """What quantized each family of layers and which statistics the run collected for it (from the rows, not
    from the recipe's defaults: a weight-only run has no activation calibrator)."""
    from quantkit.weight_only import STATS_ALGORITHMS

    rows = rep.get("layers") or []
    st = rep.get("settings") or {}
    cal = rep.get("calibration") or {}
    timings = rep.get("timings") or {}
    out: dict[str, Any] = {}
    static = [r for r in rows if r.get("family") == "static"]
    if static:
        tensors: dict[str, str] = {}
        for r in static:
            for a in r.get("inputs") or []:
                tensors[str(a["tensor"])] = str(a.get("calibrator") or r.get("calibrator"))
        cals: dict[str, int] = {}
        for c in tensors.values():
            cals[c] = cals.get(c, 0) + 1
        stats = [f"min/max + histogram of {_n(len(tensors), 'activation tensor')}"]
        if (st.get("quantization") or {}).get("bias_correction"):
            stats.append("per-channel input means (bias correction)")
        n = int(cal.get("reused", 0)) + int(cal.get("collected", 0))
        stats[-1] += (f" ({cal.get('reused', 0)} of these {n} statistics reused from the cache {cal['cache']}, "
                      f"{cal.get('collected', 0)} collected)" if cal.get("cache") else
                      f" ({cal.get('collected', 0)} statistics collected; not cached: "
                      f"{cal.get('uncached') or 'cache disabled'})")
        if "pair_hessians_s" in timings:
            stats.append("input second moments in kernel order (pair-safe rounding; never cached: K x K floats per "
                         "layer)")
        out["static"] = {"layers": len(static), "activation_calibrators": cals, "statistics": stats}
        choice = cal.get("calibrator_choice")
        if isinstance(choice, dict) and choice.get("chosen"):
            out["static"]["calibrator_choice"] = choice
    woq = rep.get("weight_only") or []
    if woq:
        algos: dict[str, int] = {}
        for r in woq:
            algos[_algorithm(r)] = algos.get(_algorithm(r), 0) + 1
        if not any(a in STATS_ALGORITHMS for a in algos):
            stats = ["none: RTN rounds each weight on its own"]
        elif cal.get("mode") == "layerwise":
            stats = [f"each layer's input second moments (sum of x^T x) and a row sample, block by block on "
                     f"{cal.get('tokens', 0)} calibration tokens (each block sees the earlier blocks quantized"
                     + (f"; {cal['resumed_blocks']} finished blocks resumed from an interrupted run"
                        if cal.get("resumed_blocks") else "") + ")"]
        else:
            n_stages = len({r.get("stage") for r in woq if r.get("stage") is not None})
            stats = ["each layer's input second moments (sum of x^T x) and a row sample over the calibration data"
                     + (f", in {n_stages} sequential stages" if n_stages > 1 else "")]
        out["weight_only"] = {"layers": len(woq), "algorithms": algos, "statistics": stats,
                              "activation_calibrators": {}}
    dyn = [r for r in rep.get("linear_formats") or [] if r.get("format") == "int8_dynamic"]
    if dyn:
        smooth = [r for r in dyn if r.get("smoothquant_alpha") is not None]
        out["dynamic"] = {"layers": len(dyn), "activation_calibrators": {},
                          "statistics": [f"per-channel max |x| of the inputs of {_n(len(smooth), 'layer')} "
                                         "(SmoothQuant)"]
                          if smooth else ["none: activation scales are computed per token at run time"]}
    half = [r for r in rep.get("linear_formats") or [] if r.get("family") == "float"]
    if half:
        out["float"] = {"layers": len(half), "activation_calibrators": {}, "statistics": ["none"]}
    return out


def method_lines(rep: Mapping[str, Any]) -> list[str]:
    """One line per family: what quantized it and the statistics actually collected."""
    names = {"static": "static INT8 (W8A8, Q/DQ)", "weight_only": "weight-only (MatMulNBits)",
             "dynamic": "int8_dynamic (W8A8, per-token scales)", "float": "fp16 / bf16 storage"}
    out = []
    for fam, m in (rep.get("method") or method_of(rep)).items():
        what = f"Method, {names.get(fam, fam)} on {_n(m['layers'], 'layer')}: "
        if fam == "static":
            choice = m.get("calibrator_choice") or {}
            what += "activation calibrator " + ", ".join(
                f"{k} ({_n(v, 'tensor')})" if k != "auto" or not choice else f"auto -> {choice['chosen']} "
                f"({_n(v, 'tensor')}; output SQNR on {choice['samples']} calibration samples: "
                + ", ".join(f"{c} {db:.2f} dB" for c, db in choice["output_sqnr_db"].items()) + ")"
                for k, v in m["activation_calibrators"].items())
        elif fam == "weight_only":
            what += ("algorithm " + ", ".join(f"{k} x{v}" for k, v in sorted(m["algorithms"].items(), key=lambda kv: -kv[1]))
                     + "; no activation calibrator (activations stay float)")
        else:
            what += "no activation calibrator"
        out.append(what + "; statistics collected: " + "; ".join(m["statistics"]) + ".")
    return out


def measurement(rep: Mapping[str, Any], load: Mapping[str, Any] | None) -> dict[str, Any]:
    """The machine the figures were measured on: CPU, its class, cores, threads, and the load average."""
    from quantkit.scheme.target import detect_cpu

    cpu = detect_cpu()
    threads = (((rep.get("settings") or {}).get("report") or {}).get("latency") or {}).get("threads")
    return {"cpu": cpu.model_name, "cpu_class": cpu.cpu_class, "cores": os.cpu_count(), "threads": threads,
            "load_average": dict(load) if load else {"report": load_average()}}


def _quality_summary(rep: Mapping[str, Any]) -> dict[str, Any]:
    q = rep.get("quality") or {}
    if "perplexity_quantized" in q:
        pf = (q.get("perplexity_fp32") or {}).get("ppl")
        pq = q["perplexity_quantized"]["ppl"]
        return {"metric": "perplexity", "fp32": pf, "quantized": pq,
                "change": None if not pf else pq / pf - 1.0}
    fid = rep.get("fidelity") or {}
    if fid:
        keys = ("accuracy_fp32", "accuracy", "top1_agreement", "mean_kl", "mean_cosine", "sqnr_db")
        return {"metric": "fidelity", "outputs": {n: {k: d[k] for k in keys if k in d} for n, d in fid.items()}}
    return {"metric": None, "why": "not evaluated (no evaluation data, or evaluate=False)"}


def _latency_summary(rep: Mapping[str, Any], note: str) -> dict[str, Any]:
    lat = rep.get("latency") or {}
    if "speedup" in lat and "fp32" in lat:
        batch = (((rep.get("settings") or {}).get("report") or {}).get("latency") or {}).get("batch_size")
        return {"kind": "one call", "batch": batch, "input": lat["fp32"].get("shape"),
                "fp32_ms": lat["fp32"]["median_ms"], "quantized_ms": lat["quantized"]["median_ms"],
                "speedup": lat["speedup"]}
    rows = {k: v for k, v in lat.items() if isinstance(v, Mapping) and "fp32_ms" in v}
    if rows:
        return {"kind": "causal LM", **{k: {"per": latency_per(k, v), "fp32_ms": v["fp32_ms"],
                                            "quantized_ms": v["quantized_ms"], "speedup": v["speedup"],
                                            **({"scope": v["scope"]} if v.get("scope") else {})}
                                        for k, v in rows.items()}}  # scope: "measured on k of L blocks"
    return {"kind": None, "why": note or "not measured (report.latency.enabled: false, or --no-latency)"}


def summary_of(rep: Mapping[str, Any], latency_note: str = "") -> dict[str, Any]:
    """The summary every report has, whatever the family: the same keys for a CNN, an encoder and an LLM."""
    sz = rep.get("size") or {}
    t = (rep.get("timings") or {}).get("total_s")
    return {
        "quantized": _kernel_story(rep),
        "quality": _quality_summary(rep),
        "size": {"fp32_bytes": sz.get("fp32_bytes"), "quantized_bytes": sz.get("quantized_bytes"),
                 "ratio": sz.get("ratio")},
        "latency": _latency_summary(rep, latency_note),
        "measured_on": rep.get("measurement") or measurement(rep, None),
        "warnings": len(rep.get("warnings") or []),
        "time_s": t if isinstance(t, (int, float)) else None,
    }


def complete_report(rep: dict[str, Any], *, load: Mapping[str, Any] | None = None, latency_note: str = ""
                    ) -> dict[str, Any]:
    """Add what every report carries, whichever path built it: the machine and its load at measurement time,
    the latency warnings of a causal LM, the method actually run, and the summary (in place; returned)."""
    rep["measurement"] = measurement(rep, load)
    rep.setdefault("int4_kernel", None)
    rep["warnings"] = list(rep.get("warnings") or []) + llm_latency_warnings(
        rep.get("latency") or {}, rep.get("int4_kernel")) + group_padding_warnings(rep.get("weight_only") or [])
    rep["method"] = method_of(rep)
    rep["summary"] = summary_of(rep, latency_note)
    return rep


def build_report(
    *,
    recipe: RecipeModel,
    source: str,
    float_proto: onnx.ModelProto,
    quant_proto: onnx.ModelProto,
    lowered: Any,
    census: Census,
    quality: dict[str, Any],
    per_layer_sqnr: Mapping[str, float],
    latency: dict[str, Any],
    timings: dict[str, float],
    calibration_samples: int,
    evaluation_samples: int,
    kernels: dict[str, Any] | None = None,
    zero_range: Sequence[str] = (),
    search: dict[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
    model_given: str | None = None,
    load: Mapping[str, Any] | None = None,
    int4_kernel: Mapping[str, Any] | None = None,
    layer_input_sqnr: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The one report of a quantized model, whatever its mix of formats (JSON-serialisable).

    ``lowered`` is the :class:`~quantkit.formats.base.Lowered` of the executed plan: one section per format
    handler (static INT8 rows with scales and kernels, weight-only rows with algorithm and output SQNR,
    dynamic / 16-bit rows); ``quality`` holds ``fidelity`` (per output) and / or perplexities; ``search`` the
    solver's target, status and prediction when a search chose the plan.  ``source`` says where the model was
    read from, ``model_given`` how the user named it (default: the recipe's ``model.source``); ``load`` the load
    average around the latency runs (:func:`load_average`, ``{"start": [...], "end": [...]}``);
    ``layer_input_sqnr`` the SQNR of the tensors each layer reads (:mod:`quantkit.report.verdict`).
    """
    static_rows, unfused = _static_rows(lowered, census, per_layer_sqnr)
    woq = _section_rows(lowered.sections.get("weight_only", []), "weight_only", census, per_layer_sqnr)
    linear = (_section_rows(lowered.sections.get("dynamic", []), "dynamic", census, per_layer_sqnr)
              + _section_rows(lowered.sections.get("float16", []), "float", census, per_layer_sqnr))
    formats = lowered.formats()
    families = sorted({r["family"] for r in static_rows + woq + linear})
    pf, pq = quality.get("perplexity_fp32"), quality.get("perplexity_quantized")
    if pf and pq:
        quality["perplexity_increase"] = pq["ppl"] / pf["ppl"] - 1.0
    leftovers = classify_leftovers(census)
    warnings = _warnings(static_rows, unfused, woq, leftovers, latency, kernels or {}, zero_range,
                         "evaluation" if evaluation_samples else "calibration")
    nodes = _graph_nodes(float_proto)
    warnings += unmatched_overrides(recipe, nodes)
    warnings += inapplicable_overrides(recipe, nodes, LAYER_OPS)
    if not formats:
        reasons: dict[str, int] = {}
        for why in lowered.static.skipped.values():
            reasons[why] = reasons.get(why, 0) + 1
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        # the "quantized" model is the float model: a speed ratio below 1 is one model timed against itself
        warnings = [w for w in warnings if not w.startswith("the quantized model is slower than FP32")]
        warnings.insert(0, "no layer was quantized: the output is the float model" + (
            " (most common reasons: " + "; ".join(f"{why} ({n} nodes)" for why, n in top) + ")" if top else ""))
    growth = _growth(float_proto, per_layer_sqnr, kernels or {}, layer_input_sqnr or {})
    warnings += verdict_warnings(quality.get("fidelity", {}), growth["sqnr"], kernels or {}, growth["drift"],
                                 set(formats))
    counts: dict[str, int] = {}
    for f in formats.values():
        counts[f] = counts.get(f, 0) + 1
    f_size, q_size = proto_size(float_proto), proto_size(quant_proto)
    rep = {
        "kind": "mixed" if search is not None or len(families) > 1 else (families[0] if families else "float"),
        "recipe": recipe.name,
        "model": model_given or model_given_name(recipe, source),
        "model_read_from": source,
        "environment": environment(),
        "settings": recipe.model_dump(mode="json"),
        "samples": {"calibration": calibration_samples, "evaluation": evaluation_samples},
        "calibration": dict(calibration or {}),
        "formats": counts,
        "size": {"fp32_bytes": f_size, "quantized_bytes": q_size, "ratio": q_size / max(f_size, 1)},
        "latency": latency,
        "fidelity": quality.get("fidelity", {}),
        "quality": quality,
        "timings": timings,
        "census": {
            "op_counts": dict(census.op_counts),
            "quantized_kernels": dict(census.quantized_kernels),
            "float_matmul_left": census.op_counts.get("MatMul", 0) + census.op_counts.get("com.microsoft.FusedMatMul", 0),
            "leftover_quantize_linear": census.leftover_q,
            "leftover_dequantize_linear": census.leftover_dq,
            "leftover_qdq_nodes": list(census.leftover_qdq_nodes),
            "leftover_by_kind": {k: sum(1 for _, kind in leftovers if kind == k)
                                 for k in ("boundary", "chain_exit", "feeds_fused_kernel", "float_island",
                                           "stray")},
            "float_islands": float_islands(census),
        },
        "layers": static_rows + woq + linear,
        "weight_only": woq,
        "linear_formats": linear,
        "unfused": unfused,
        "float_layers": [{"layer": k, "reason": v} for k, v in lowered.static.skipped.items() if k not in formats],
        "notes": dict(lowered.notes),
        "search": _json_safe(search) if search is not None else None,
        "kernels": _json_safe(kernels or {}),
        "error_growth": _json_safe({k: v[:8] for k, v in growth.items()}),
        "warnings": warnings,
        "int4_kernel": dict(int4_kernel) if int4_kernel else None,
    }
    return complete_report(rep, load=load)


def _growth(float_proto: onnx.ModelProto, per_layer_sqnr: Mapping[str, float], kernels: Mapping[str, Any],
            input_sqnr: Mapping[str, float]) -> dict[str, list[dict[str, Any]]]:
    """Where the error grows along the chain (:mod:`quantkit.report.verdict`): against FP32 (split into the
    layers' own growth and the float ops' between them, where ``input_sqnr`` measured what the layers read),
    and between the fused kernels and the QDQ math.  Each is walked over its own set of layers: a tensor
    measured by one and not the other is not a predecessor without a figure."""
    drift: dict[str, float] = {}
    for r in (kernels.get("check") or {}).get("layers") or []:
        d = r.get("drift_db")
        if isinstance(d, (int, float)):
            drift[str(r["layer"])] = min(float(d), drift.get(str(r["layer"]), float("inf")))
    layers = set(per_layer_sqnr)
    sqnr = error_growth(per_layer_sqnr, layer_predecessors(float_proto, layers), input_sqnr,
                        layers_between(float_proto, layers) if input_sqnr else None)
    for r in sqnr[:2 * UPSTREAM]:
        if r.get("kind") == "between" and r["growth_db"] > 0:
            r["upstream"], r["upstream_more"] = upstream_layers(float_proto, layers, r["layer"])
    return {"sqnr": sqnr, "drift": error_growth(drift, layer_predecessors(float_proto, set(drift)))}


def _graph_nodes(proto: onnx.ModelProto) -> list[tuple[str, str, str | None]]:
    """``(name, op type, PyTorch module path)`` of every node of ``proto``'s main graph."""
    from types import SimpleNamespace

    from quantkit.ops import module_path

    return [(n.name, n.op_type, module_path(SimpleNamespace(metadata_props={e.key: e.value for e in n.metadata_props})))
            for n in proto.graph.node]


def _warnings(static_rows: list[dict[str, Any]], unfused: list[dict[str, Any]], woq: list[dict[str, Any]],
              leftovers: list[tuple[str, str]], latency: Mapping[str, Any], kernels: Mapping[str, Any],
              zero_range: Sequence[str], data: str = "evaluation") -> list[str]:
    out = []
    if unfused:
        out.append(f"{len(unfused)} of {len(static_rows)} quantized layers were NOT fused by ONNX Runtime "
                   "(see 'unfused'); expect them to run slower than FP32")
    bad = [str(r["layer"]) for r in woq if r["fused"] is False]
    if bad:
        out.append(f"{len(bad)} weight-only layers do not run as MatMulNBits: {', '.join(bad[:5])}")
    stray = [d for d, kind in leftovers if kind == "stray"]
    if stray:
        out.append(f"{len(stray)} stray QuantizeLinear/DequantizeLinear nodes remain inside ONNX Runtime's optimized "
                   "graph (each is a float<->int8 conversion that costs time): " + "; ".join(stray[:5]))
    if latency and latency.get("speedup", 1.0) < 1.0:
        out.append(f"the quantized model is slower than FP32 (speedup {latency['speedup']:.2f}x)")
    out += kernel_warnings(kernels, data)
    if zero_range:
        out.append(f"{len(zero_range)} activation tensor(s) had zero range over the calibration data (constant or all "
                   f"zero: their scale is a placeholder and any other value will saturate): {', '.join(zero_range[:8])}"
                   + (" ..." if len(zero_range) > 8 else "") + ". Calibrate on representative data")
    return out


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return _finite(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def check_data(rep: Mapping[str, Any]) -> str:
    """Which samples the kernel check, the portability emulation and the latency ran on: ``evaluation``, or
    ``calibration`` when the run had no evaluation data."""
    return "evaluation" if ((rep.get("samples") or {}).get("evaluation") or 0) > 0 else "calibration"


def data_lines(rep: Mapping[str, Any]) -> list[str]:
    """The calibration / evaluation data and the scheme, as the recipe set them (from the settings)."""
    st = rep.get("settings") or {}

    def spec(d: Any) -> str:
        return ", ".join(f"{k}={v}" for k, v in d.items()) if isinstance(d, dict) else "given through the API"

    cal, ev = st.get("calibration") or {}, st.get("evaluation") or {}
    q = (st.get("quantization") or {}).get("default") or {}
    ev_text = (spec(ev.get("data")) if isinstance(ev.get("data"), dict) or check_data(rep) == "evaluation" else
               "none (no evaluation section: no accuracy figures; the kernel check and the latency ran on calibration "
               "samples)")
    out = [f"Calibration data: {spec(cal.get('data'))}. Evaluation data: {ev_text}."]
    out += method_lines(rep)
    if q:
        fmt = q.get("format")
        detail = (f"algorithm {q.get('algorithm')}, group size {q.get('group_size')}" if fmt in ("int4", "int8_weight")
                  else f"weights {spec(q.get('weights'))}; activations {spec(q.get('activations'))}")
        out.append(f"Default scheme: {fmt}, {detail}; {len((st.get('quantization') or {}).get('overrides') or [])} "
                   "override(s).")
    return out


def _load_text(load: Mapping[str, Any]) -> str:
    """``load average 4.82 / 4.50 / 3.81 (1 / 5 / 15 min) when the latency runs started, 4.90 (1 min) when they
    ended``."""
    when = {"start": "when the latency runs started", "end": "when they ended",
            "report": "when the report was built (no latency run)"}
    parts = [f"{' / '.join(f'{x:.2f}' for x in v)} (1 / 5 / 15 min) {when.get(k, k)}" if i == 0 else
             f"{v[0]:.2f} (1 min) {when.get(k, k)}" for i, (k, v) in enumerate((k, v) for k, v in load.items() if v)]
    return ("load average " + ", ".join(parts)) if parts else "load average not available"


def summary_lines(rep: Mapping[str, Any]) -> list[str]:
    """A one-screen summary, the same fields for every family: what was quantized into which kernels, quality vs
    FP32, size, latency, the machine and its load, time, warnings."""
    s = rep.get("summary") or summary_of(rep)
    out = ["## Summary", ""]
    k = s["quantized"]
    kinds = ", ".join(f"{a} x{b}" for a, b in sorted(k["by_kernel"].items())) or "no quantized kernels"
    out.append(f"- quantized: {k['layers']} layers -> {k['kernels']} kernels ({kinds})"
               + (": " + "; ".join(k["why"]) if k["why"] else ""))
    fm = rep.get("formats") or {}
    if len(fm) > 1:
        out.append("- formats: " + ", ".join(f"{a} {b}" for a, b in sorted(fm.items())))
    q = s["quality"]
    if q["metric"] == "perplexity":
        out.append(f"- quality vs FP32: perplexity {q['fp32']:.3f} -> {q['quantized']:.3f} ({100 * q['change']:+.1f}%)"
                   if q.get("fp32") else f"- quality vs FP32: perplexity {q['quantized']:.3f} (FP32 not evaluated)")
    elif q["metric"] == "fidelity":
        for name, d in q["outputs"].items():
            out.append(f"- quality vs FP32: fidelity `{name}`: " + ", ".join(f"{a} {_fmt(b, 4)}" for a, b in d.items()))
    else:
        out.append(f"- quality vs FP32: {q['why']}")
    fb = rep.get("fp32_baseline") or {}
    if fb.get("summary"):  # a layer-wise run: how the FP32 figures were measured (quantkit.evaluate.streamed)
        out.append(f"- FP32 baseline: {fb['summary']}")
    sz = s["size"]
    if sz.get("fp32_bytes") is not None:
        out.append(f"- size: {sz['fp32_bytes'] / 2**20:.2f} MiB -> {sz['quantized_bytes'] / 2**20:.2f} MiB "
                   f"({sz['ratio']:.3f})")
    lat = s["latency"]
    if lat["kind"] == "one call":
        out.append(f"- latency, batch {lat.get('batch') or '?'} ({lat.get('input')}): {lat['fp32_ms']:.3f} ms -> "
                   f"{lat['quantized_ms']:.3f} ms per call (**{lat['speedup']:.2f}x**, same run)")
    elif lat["kind"] == "causal LM":
        names = {"prefill": "prefill", "prefill_long": "long prefill", "decode": "decode"}
        out.append("- latency: " + "; ".join(
            f"{names.get(key, key)} {v['fp32_ms']:.2f} -> {v['quantized_ms']:.2f} ms {v['per']}"
            + (f", {v['scope']}" if v.get("scope") else "") + f" (**{v['speedup']:.2f}x**)"
            for key, v in lat.items() if isinstance(v, Mapping)) + ", same run")
    else:
        out.append(f"- latency: {lat['why']}")
    if rep.get("int4_kernel"):
        out.append("- " + int4_kernel_line(rep["int4_kernel"]))
    if rep.get("by_cpu_class"):
        out.append("- " + class_grid_line(rep["by_cpu_class"]))
    if rep.get("w4a8_check"):
        out.append("- " + w4a8_line(rep["w4a8_check"], rep.get("int4_kernel")))
    if "greedy_agreement" in (rep.get("quality") or {}):
        out.append("- " + greedy_line(rep["quality"]["greedy_agreement"]))
    kern = rep.get("kernels") or {}
    if kern:
        port = (kern.get("portability") or {}).get("classes") or {}
        chk = kern.get("check") or {}
        out.append(f"- CPU: built for `{(kern.get('target') or {}).get('cpu_class')}`; exact on "
                   f"{', '.join(c for c, v in port.items() if v.get('exact')) or 'none'}"
                   + (f"; this CPU's kernels {'agree with' if chk.get('agree') else '**DISAGREE** with'} the QDQ math"
                      if chk else ""))
    m = s["measured_on"]
    out.append(f"- measured on: {m['cpu']} (class `{m['cpu_class']}`, {m['cores']} cores, threads "
               f"{m.get('threads') or 'ONNX Runtime default'}); {_load_text(m.get('load_average') or {})}")
    t = {a: b for a, b in (rep.get("timings") or {}).items() if isinstance(b, (int, float)) and a.endswith("_s")}
    if "total_s" in t:
        parts = ", ".join(f"{a[:-2].replace('_', ' ')} {b:.1f} s" for a, b in t.items() if a != "total_s" and b >= 0.05)
        out.append(f"- time: {t['total_s']:.1f} s ({parts})")
    out.append(f"- warnings: {s['warnings']}" + (" (see Warnings)" if s["warnings"] else ""))
    return [*out, ""]


def kernel_warnings(kernels: Mapping[str, Any], data: str = "evaluation") -> list[str]:
    """Warnings from the kernel check and the portability table (see :mod:`quantkit.lowering.kernel_check`);
    ``data``: which samples they ran on (``evaluation`` | ``calibration``, :func:`check_data`)."""
    out = []
    cpu = (kernels.get("cpu") or {}).get("cpu_class", "?")
    chk = kernels.get("check")
    if chk and not chk.get("agree", True):
        first = chk.get("first_parted") or {}
        where = (f"they first part at layer {first.get('layer')!r} (tensor {first.get('tensor')!r}, SQNR "
                 f"{float(first.get('sqnr_db', 0)):.1f} dB)") if first else "at the outputs"
        outs = ", ".join(f"{k}: SQNR {float(v.get('sqnr_db', 0)):.1f} dB"
                         + (f", top-1 {v['top1_agreement']:.3f}" if "top1_agreement" in v else "")
                         for k, v in (chk.get("outputs") or {}).items())
        out.append(
            f"ONNX Runtime's fused int8 kernels on this CPU ({cpu}) DISAGREE with the model's QDQ math: {where}; "
            f"outputs vs the QDQ reference: {outs}. Rebuild with target: {{isa: auto}} on this machine, or "
            "{isa: portable} for a model that is exact on every CPU"
        )
    if kernels.get("check_skipped"):
        out.append(f"fused kernels not checked against the QDQ math: {kernels['check_skipped']}; the fidelity "
                   "figures against FP32 include that randomness")
    port = (kernels.get("portability") or {}).get("classes") or {}
    broken = [c for c, v in port.items() if not v.get("exact", True)]
    if broken:
        emu = (chk or {}).get("emulated_x86_avx2") or {}
        worst = max(emu.items(), key=lambda kv: kv[1]) if emu else None
        seen = (f" (emulated on the {data} data: up to {100 * worst[1]:.1f}% of the int32 accumulators of "
                f"{worst[0]!r} wrong there)") if worst and worst[1] > 0 else ""
        out.append(
            "not exact on CPU class(es) " + ", ".join(broken) + ": " + "; ".join(port[c]["why"] for c in broken)
            + seen + ". x86 CPUs without VNNI add u8*s8 product pairs in saturating int16; build with "
            "target: {isa: portable} to ship one model that is exact everywhere"
        )
    return out


def kernel_lines(rep: Mapping[str, Any]) -> list[str]:
    """The 'CPU kernels' Markdown section: target, running CPU, kernel check, portability table."""
    k = rep.get("kernels") or {}
    if not k:
        return []
    tgt, cpu = k.get("target") or {}, k.get("cpu") or {}
    lines = ["## CPU kernels: target, check, portability", "",
             f"Target: isa `{tgt.get('isa')}` -> class `{tgt.get('cpu_class')}`. Running CPU: "
             f"{cpu.get('model_name')} ({cpu.get('machine')}, flags {', '.join(cpu.get('flags') or []) or '-'}), "
             f"class `{cpu.get('cpu_class')}`.", ""]
    chk = k.get("check")
    if k.get("check_skipped"):
        lines += [f"Fused kernels vs QDQ reference: not checked: {k['check_skipped']}.", ""]
    if chk:
        verdict = "agree" if chk.get("agree") else "**DISAGREE**"
        lines.append(f"Fused kernels (ORT_ENABLE_ALL) vs QDQ reference (ORT_DISABLE_ALL) on {chk.get('samples')} "
                     f"{check_data(rep)} samples: {verdict}.")
        for name, v in (chk.get("outputs") or {}).items():
            lines.append(f"- `{name}`: SQNR {_fmt(v.get('sqnr_db'), 1)} dB"
                         + (f", top-1 agreement {v['top1_agreement']:.3f}" if "top1_agreement" in v else ""))
        if chk.get("first_parted"):
            f = chk["first_parted"]
            what = ("of its float outputs off by more than 1e-4 of the largest" if f.get("float_output")
                    else "of its codes more than one step off")
            lines.append(f"- first layer where they part: `{f['layer']}` (alone, on the reference's input codes: "
                         f"{100 * f['off']:.2f}% {what}, SQNR {_fmt(f['sqnr_db'], 1)} dB)")
        lyr = chk.get("layers") or []
        if lyr:
            worst = min(lyr, key=lambda r: r["drift_db"] if isinstance(r["drift_db"], float) else 1e9)
            lines.append(f"- every layer alone: at most {100 * max(r['off'] for r in lyr):.3f}% of codes more than "
                         f"one step off; in the whole model one-step rounding differences compound to "
                         f"{_fmt(worst['drift_db'], 1)} dB at `{worst['layer']}`")
        emu = chk.get("emulated_x86_avx2") or {}
        if emu:
            bad = sorted(((v, k) for k, v in emu.items() if v > 0), reverse=True)
            lines.append(f"- emulated x86-avx2 kernels on the first sample: {len(bad)} of {len(emu)} at-risk layers "
                         "saturate" + (f", worst `{bad[0][1]}` ({100 * bad[0][0]:.2f}% of accumulators)" if bad else ""))
        lines.append("")
    port = (k.get("portability") or {}).get("classes") or {}
    if port:
        lines += ["| CPU class | exact for every input | why |", "|---|---|---|"]
        lines += [f"| {c} | {'yes' if v['exact'] else '**no**'} | {v['why'].replace('|', chr(92) + '|')} |"
                  for c, v in port.items()]
        lines.append("")
    return lines


def classify_leftovers(census: Census) -> list[tuple[str, str]]:
    """Each leftover Q/DQ of the census with its kind:

    * ``boundary``: quantizes a graph input or dequantizes a graph output (expected);
    * ``chain_exit``: a ``DequantizeLinear`` of a quantized kernel's output read by float ops that do not
      quantize again - where an int8 chain meets a layer in another format (expected, needed); or of codes a
      ``QuantizeLinear`` made for a chain (one output of an int8 ``Split`` read only by float ops);
    * ``feeds_fused_kernel``: a ``QuantizeLinear`` whose every consumer is a quantized kernel or
      int8 data movement (ORT's QDQ propagation moves a Q above Transpose/Reshape) - the one
      quantization of an activation that a float op produced (expected, needed);
    * ``float_island``: a ``DequantizeLinear`` into an op that runs in float on purpose - one with no int8
      kernel in ONNX Runtime (``LayerNormalization``, ``Gelu``, an unfolded ``BatchNormalization``), one whose
      int8 kernel quantkit does not use, or a layer the plan keeps in float - whose result is quantized again
      (:func:`quantkit.ops.float_island_reason`; the reasons per op are :func:`float_islands`);
    * ``stray``: anything else - a float<->int8 round trip that buys nothing (e.g. a DQ into an ``Add`` left
      in float whose sum is quantized again: ``QLinearAdd`` could have run it).
    """
    from quantkit.lowering.verify import QUANTIZED_KERNELS

    ok = QUANTIZED_KERNELS | PASSTHROUGH
    unfused = {name for name, f in census.per_layer.items() if not f.fused}
    out = []
    for item in census.leftovers:
        if item.at_graph_input or item.at_graph_output:
            kind = "boundary"
        elif (item.op_type.endswith("DequantizeLinear") and (item.producer.split(".")[-1] in QUANTIZED_KERNELS
                                                             or item.q_feeds_kernel) and not item.feeds_requantize):
            kind = "chain_exit"
        elif (
            item.op_type.endswith("QuantizeLinear")
            and not item.op_type.endswith("DequantizeLinear")
            and (item.consumers and all(_consumer_op(c) in ok for c in item.consumers))
        ):
            kind = "feeds_fused_kernel"
        elif item.op_type.endswith("DequantizeLinear") and _island_ops(item.consumers, unfused):
            kind = "float_island"
        else:
            kind = "stray"
        out.append((item.describe(), kind))
    return out


def _consumer_op(consumer: str) -> str:
    """The bare op type of a census consumer entry (``"com.microsoft.QLinearConv 'name'"`` -> ``QLinearConv``)."""
    return consumer.split(" ", 1)[0].split(".")[-1]


def _island_ops(consumers: Sequence[str], unfused: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The consumers' op types that run in float on purpose (:func:`quantkit.ops.float_island_reason`); a float
    GEMM-like kernel derived from a layer the plan meant to run in int8 (``unfused``: the census' unfused layers)
    is not on purpose."""
    from quantkit.lowering.verify import _derived_bases
    from quantkit.ops import GEMM_LIKE_FLOAT_KERNELS, float_island_reason

    out = []
    for c in consumers:
        if c.startswith("graph output"):
            continue
        op = _consumer_op(c)
        if float_island_reason(op) is None:
            continue
        name = c.split(" ", 1)[1].strip("'") if " " in c else ""
        if op in GEMM_LIKE_FLOAT_KERNELS and unfused & {name, *_derived_bases(name)}:
            continue
        out.append(op)
    return out


def float_islands(census: Census) -> dict[str, dict[str, Any]]:
    """``op -> {"count", "reason"}``: the float ops entered by the ``float_island`` DequantizeLinear nodes of
    :func:`classify_leftovers` (each island counted once per DQ that enters it), with why each runs in float."""
    from quantkit.ops import float_island_reason

    unfused = {name for name, f in census.per_layer.items() if not f.fused}
    out: dict[str, dict[str, Any]] = {}
    for item, (_, kind) in zip(census.leftovers, classify_leftovers(census), strict=True):
        if kind != "float_island":
            continue
        for op in dict.fromkeys(_island_ops(item.consumers, unfused)):
            row = out.setdefault(op, {"count": 0, "reason": float_island_reason(op)})
            row["count"] += 1
    return dict(sorted(out.items()))


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, float):
        return f"{x:.{nd}f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"
    return str(x)


def warnings_lines(rep: Mapping[str, Any]) -> list[str]:
    """The report's warnings as a Markdown section (empty when there are none)."""
    if not rep.get("warnings"):
        return []
    return ["## Warnings", ""] + [f"- {w}" for w in rep["warnings"]] + [""]


def render_markdown(rep: dict[str, Any]) -> str:
    """A human-readable Markdown rendering of the report: one section per part that is present."""
    kind = {"mixed": " (mixed precision)", "weight_only": " (weight-only)"}.get(rep.get("kind", ""), "")
    read = rep.get("model_read_from")
    lines = [f"# quantkit report: {rep['recipe']}{kind}", "",
             f"Model: `{rep['model']}`" + (f" (read from {read})" if read and read != rep["model"] else ""), ""]
    lines += summary_lines(rep)
    env = rep["environment"]
    lines.append(f"Environment: quantkit {env['quantkit']}, onnxruntime {env['onnxruntime']}, onnx {env['onnx']}, "
                 f"{env['cpu']} ({env['cores']} cores), {env['date']}")
    lines.append(f"Samples: {rep['samples']['calibration']} calibration, {rep['samples']['evaluation']} evaluation")
    lines += data_lines(rep)
    lines.append("")
    for part in (warnings_lines, kernel_lines, int4_kernel_lines, _search_lines, _size_lines, _latency_lines,
                 _quality_lines, _census_lines, _static_layer_lines, _weight_only_lines, _linear_lines, _float_lines):
        lines += part(rep)
    lines += ["## Timings", "", " | ".join(f"{k}: {v:.2f}" for k, v in rep["timings"].items()), ""]
    return "\n".join(lines)


def _search_lines(rep: Mapping[str, Any]) -> list[str]:
    s = rep.get("search")
    if not s:
        return []
    pr = s.get("predicted") or {}
    return ["## Search", "",
            f"Target `{s.get('target')}` (solver status {s.get('status')}); formats (layers): "
            + ", ".join(f"{k} {v}" for k, v in sorted((rep.get("formats") or {}).items())) + ".",
            f"Predicted: damage {_fmt(pr.get('damage'), 5)}, {_fmt((pr.get('bytes') or 0) / 2**20, 2)} MiB, "
            f"{_fmt(pr.get('latency_ms'))} ms. Pinned by the recipe: "
            + (", ".join(f"`{p}`" for p in s.get("pinned") or []) or "none") + ".", ""]


def _size_lines(rep: Mapping[str, Any]) -> list[str]:
    s = rep["size"]
    return ["## Size", "", "| FP32 | quantized | ratio |", "|---|---|---|",
            f"| {s['fp32_bytes'] / 2**20:.2f} MiB | {s['quantized_bytes'] / 2**20:.2f} MiB | {s['ratio']:.3f} |", ""]


def _latency_lines(rep: Mapping[str, Any]) -> list[str]:
    lat = rep.get("latency") or {}
    if not lat:
        return []
    lines = ["## Latency (same run, interleaved)", ""]
    if "fp32" in lat and "median_ms" in lat["fp32"]:
        f, q = lat["fp32"], lat["quantized"]
        lines += [f"Input: {f['shape']}; {f['runs']} runs after {f['warmup']} warm-up, "
                  f"threads: {f['threads'] or 'ORT default'}", "",
                  "| model | median ms | p90 ms |", "|---|---|---|",
                  f"| FP32 | {f['median_ms']:.3f} | {f['p90_ms']:.3f} |",
                  f"| quantized | {q['median_ms']:.3f} | {q['p90_ms']:.3f} |", "",
                  f"Speedup (median): **{lat['speedup']:.2f}x**", ""]
    rows = [(k, v) for k, v in lat.items() if isinstance(v, dict) and "fp32_ms" in v]
    if rows:
        lines += ["| measurement | timed | FP32 ms | quantized ms | speedup |", "|---|---|---|---|---|"]
        lines += [f"| {v.get('label', k)} | {latency_per(k, v)} | {v['fp32_ms']:.2f} | {v['quantized_ms']:.2f} | "
                  f"{v['speedup']:.2f}x |" for k, v in rows]
        lines.append("")
    return lines


def _quality_lines(rep: Mapping[str, Any]) -> list[str]:
    lines = []
    fid = rep.get("fidelity") or {}
    if fid:
        lines += ["## Fidelity vs FP32", ""]
        keys = sorted({k for d in fid.values() for k in d})
        lines += ["| output | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(_fmt(d.get(k), 4) for k in keys) + " |" for name, d in fid.items()]
        lines.append("")
        guard = rep.get("fidelity_guard") or {}
        if guard.get("decision"):
            lines += [f"Fidelity guard: {guard['decision']}.", ""]
    q = rep.get("quality") or {}
    if "perplexity_fp32" in q:
        pf, pq = q["perplexity_fp32"], q["perplexity_quantized"]
        lines += ["## Perplexity (held-out windows)", "", "| model | perplexity | tokens |", "|---|---|---|",
                  f"| FP32 | {pf['ppl']:.3f} | {pf['tokens']} |", f"| quantized | {pq['ppl']:.3f} | {pq['tokens']} |",
                  "", f"Increase: {100 * q['perplexity_increase']:.2f}%", ""]
    extra = q.get("perplexity_extra") or {}
    if extra:
        lines += ["Other held-out texts (`evaluation.extra`: domains the main evaluation does not cover):", "",
                  "| text | FP32 | quantized | increase | tokens |", "|---|---|---|---|---|"]
        for label, row in extra.items():
            f, qq = row.get("fp32"), row.get("quantized") or {}
            lines.append(f"| {label} | {f['ppl']:.3f} | {qq.get('ppl', float('nan')):.3f} | "
                         f"{100 * row['increase']:.2f}% | {qq.get('tokens', '-')} |" if f else
                         f"| {label} | - | {qq.get('ppl', float('nan')):.3f} | - | {qq.get('tokens', '-')} |")
        lines.append("")
    return lines


def _census_lines(rep: Mapping[str, Any]) -> list[str]:
    c = rep["census"]
    lines = ["## ONNX Runtime census (optimized graph)", "",
             "Quantized kernels: " + (", ".join(f"{k} x{v}" for k, v in sorted(c["quantized_kernels"].items()))
                                      or "none")
             + f". MatMuls left in float: {c.get('float_matmul_left', 0)}.", "",
             f"Leftover QuantizeLinear: {c['leftover_quantize_linear']}, DequantizeLinear: "
             f"{c['leftover_dequantize_linear']} (by kind: "
             + ", ".join(f"{k} {v}" for k, v in c["leftover_by_kind"].items()) + ")", ""]
    if c.get("float_islands"):
        lines += ["Float islands (a DequantizeLinear into a float op whose result is quantized again, on purpose): "
                  + "; ".join(f"{op} x{v['count']} ({v['reason']})" for op, v in c["float_islands"].items()), ""]
    if c["leftover_qdq_nodes"]:
        lines += ["Leftover Q/DQ nodes: " + ", ".join(f"`{n}`" for n in c["leftover_qdq_nodes"][:30]), ""]
    if rep.get("unfused"):
        lines += ["## Unfused layers", "", "| layer | op | expected kernel | note | cost |", "|---|---|---|---|---|"]
        lines += [f"| `{u['layer']}` | {u['op']} | {', '.join(u['expected'])} | {u['note']} | {u['cost']} |"
                  for u in rep["unfused"]]
        lines.append("")
    return lines


def _static_layer_lines(rep: Mapping[str, Any]) -> list[str]:
    rows = [r for r in rep["layers"] if r.get("family") == "static"]
    if not rows:
        return []
    lines = ["## Static INT8 layers", "",
             "| layer | op | format | rule | weight scale (min..max) | weight SQNR dB | input scale / zp "
             "| output SQNR dB | kernel | fused |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["weights"]
        ws = "-" if w is None else f"{w['scale_min']:.2e}..{w['scale_max']:.2e} ({w['dtype']}{', sym' if w['symmetric'] else ''})"
        wq = "-" if w is None else _fmt(w["weight_sqnr_db"], 1)
        ins = "; ".join(f"{a['scale']:.3e}/{a['zero_point']} {a['dtype']} ({a['calibrator']})" for a in r["inputs"]) or "-"
        note = f" {r['lowering_note']}" if r.get("lowering_note") else ""
        lines.append(f"| `{r['layer']}` | {r['op']} | {r['format']} | {r['rule']} | {ws} | {wq} | {ins} | "
                     f"{_fmt(r['output_sqnr_db'], 1)} | {r['kernel'] or '-'}{note} | {_fmt(r['fused'])} |")
    return [*lines, ""]


def _weight_only_lines(rep: Mapping[str, Any]) -> list[str]:
    rows = rep.get("weight_only") or []
    if not rows:
        return []

    def sqnr(v: Any) -> str:
        return _fmt(v, 1) if isinstance(v, float) and math.isfinite(v) else _fmt(v)

    def kernel(r: Mapping[str, Any]) -> str:
        k, node = r.get("kernel"), r.get("kernel_node")
        return "-" if not k else f"{k} (shared: `{node}`)" if node and node != r["layer"] else str(k)

    # (header, explanation, cell, filled by a row); a column no row fills is left out
    optional = [
        ("output SQNR dB", "the layer's output error on calibration inputs, 10 log10(E||xW||^2 / E||x(W - W_q)||^2) "
         "(no calibration statistics: -)", lambda r: sqnr(r.get("output_sqnr_db")), "output_sqnr_db"),
        ("eval SQNR dB", "the layer's output in the emitted model vs FP32 on evaluation samples (errors of earlier "
         "layers included)", lambda r: _fmt(r.get("eval_output_sqnr_db"), 1), "eval_output_sqnr_db"),
        ("kernel", "the ONNX Runtime kernel that computes it (shared: one kernel computes several layers side by "
         "side)", kernel, "kernel"),
        ("stage", "the sequential calibration pass the layer was quantized in (later stages see earlier layers "
         "already quantized)", lambda r: _fmt(r.get("stage")), "stage"),
        ("block", "the decoder block it was calibrated with, block by block (later blocks see earlier ones already "
         "quantized; -1: the embedding, after the last block: the lm_head)", lambda r: _fmt(r.get("block")), "block"),
        ("acc. level", "the MatMulNBits accuracy_level it is built at (4: int8 activations, 0: float)",
         lambda r: _fmt(r.get("accuracy_level")), "accuracy_level"),
        ("W4A8 ratio", "||Y4 - Y|| / ||Y0 - Y|| on calibration inputs: the layer's output error at accuracy_level 4 "
         "relative to its weight-only error (Y the float product; above export.w4a8_max_error_ratio: level 0)",
         lambda r: _fmt(r.get("w4a8_error_ratio"), 3) + (" (kept 0)" if r.get("w4a8_level0") else ""),
         "w4a8_error_ratio"),
    ]
    cols = [c for c in optional if any(r.get(c[3]) is not None for r in rows)]
    lines = ["## Weight-only layers (MatMulNBits)", "",
             "Columns: `weight rel. error` = ||W - W_q|| / ||W||"
             + "".join(f"; `{h}` = {e}" for h, e, _, _ in cols) + ".", "",
             "| " + " | ".join(["layer", "format", "algorithm", "bits", "group", "sym", "K x N", "weight rel. error",
                                *(h for h, _, _, _ in cols)]) + " |", "|---" * (8 + len(cols)) + "|"]
    for r in rows:
        cells = [f"`{r['layer']}`", r["format"],
                 f"{r['algorithm']}{' +awq-scale' if r.get('awq_scaled') else ''}{' (tied)' if r.get('tied') else ''}",
                 r["bits"], r["group_size"], "y" if r["symmetric"] else "n", f"{r['K']} x {r['N']}",
                 _fmt(r["weight_rel_error"], 4), *(cell(r) for _, _, cell, _ in cols)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return [*lines, ""]


def _linear_lines(rep: Mapping[str, Any]) -> list[str]:
    rows = rep.get("linear_formats") or []
    if not rows:
        return []
    lines = ["## int8_dynamic / fp16 / bf16 layers", "",
             "int8_dynamic: W8A8 with per-token activation scales computed at run time (SmoothQuant alpha per group "
             "of layers sharing an input); fp16 / bf16: 16-bit weight storage (ONNX Runtime's CPU provider computes "
             "in FP32).", "", "| layer | format | detail | eval output SQNR dB | kernel |", "|---|---|---|---|---|"]
    for r in rows:
        detail = (f"{r.get('granularity')}, SmoothQuant alpha {_fmt(r.get('smoothquant_alpha'))}"
                  if r["format"] == "int8_dynamic" else f"compute {r.get('compute', 'storage')}")
        lines.append(f"| `{r['layer']}` | {r['format']} | {detail} | {_fmt(r.get('eval_output_sqnr_db'), 1)} | "
                     f"{r.get('kernel') or '-'} |")
    return [*lines, ""]


def _float_lines(rep: Mapping[str, Any]) -> list[str]:
    if not rep.get("float_layers"):
        return []
    groups: dict[str, list[str]] = {}
    for f in rep["float_layers"]:
        groups.setdefault(f["reason"], []).append(f["layer"])
    lines = ["## Layers kept in float, by reason", "",
             "Most are by design: activation x activation products (attention) have no constant weight to "
             "quantize, and ops outside an int8 chain would only add conversions.", "",
             "| reason | layers | examples |", "|---|---|---|"]
    lines += [f"| {reason} | {len(names)} | " + ", ".join(f"`{n}`" for n in names[:4])
              + (" ..." if len(names) > 4 else "") + " |"
              for reason, names in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    return [*lines, ""]


def render_html(rep: dict[str, Any]) -> str:
    """A minimal standalone HTML page wrapping the Markdown tables (no external assets)."""
    import html
    import re

    def inline(text: str) -> str:
        """Markdown inline marks -> HTML (escaped first, so report text can never inject markup)."""
        t = html.escape(text)
        t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
        return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)

    md = render_markdown(rep)
    body = []
    in_table = False
    in_list = False
    for line in md.splitlines():
        if in_list and not line.startswith("- "):
            body.append("</ul>")
            in_list = False
        if line.startswith("|"):
            cells = [inline(c.strip().replace("\\|", "|")) for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if set("".join(cells)) <= set("-"):
                continue
            if not in_table:
                body.append("<table>")
                in_table = True
                body.append("<tr>" + "".join(f"<th>{c}</th>" for c in cells) + "</tr>")
            else:
                body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
            continue
        if in_table:
            body.append("</table>")
            in_table = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{inline(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("- "):
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{inline(line[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    if in_table:
        body.append("</table>")
    if in_list:
        body.append("</ul>")
    style = "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}"
    return f"<!doctype html><html><head><meta charset='utf-8'><title>quantkit report</title><style>{style}</style></head><body>{''.join(body)}</body></html>"


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_report(rep: dict[str, Any], directory: Path, formats: Sequence[str]) -> dict[str, Path]:
    """Write the report in each requested format; returns format -> path."""
    out: dict[str, Path] = {}
    if "json" in formats:
        out["report.json"] = atomic_write_text(
            directory / "report.json", json.dumps(rep, indent=2, default=str)
        )
    if "md" in formats:
        out["report.md"] = atomic_write_text(directory / "report.md", render_markdown(rep))
    if "html" in formats:
        out["report.html"] = atomic_write_text(directory / "report.html", render_html(rep))
    return out
