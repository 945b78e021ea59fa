"""Report of a weight-only (INT4 / INT8 weights) quantization: per-layer weight error and
algorithm, perplexity before/after, size, latency, and the fused-kernel census."""

from __future__ import annotations

import math
from typing import Any

import onnx

from quantkit.lowering.verify import Census
from quantkit.recipe import RecipeModel
from quantkit.report.build import (
    _finite,
    _fmt,
    classify_leftovers,
    data_lines,
    environment,
    summary_lines,
    warnings_lines,
)


def _model_bytes(proto: onnx.ModelProto) -> int:
    return proto.ByteSize()


def build_woq_report(
    *,
    recipe: RecipeModel,
    source: str,
    float_proto: onnx.ModelProto,
    quant_proto: onnx.ModelProto,
    outcome: Any,
    census: Census,
    quality: dict[str, Any],
    latency: dict[str, Any],
    timings: dict[str, float],
    calibration_samples: int,
    evaluation_samples: int,
) -> dict[str, Any]:
    f_size, q_size = _model_bytes(float_proto), _model_bytes(quant_proto)
    rows = []
    for r in outcome.rows:
        fusion = census.per_layer.get(r["layer"])
        rows.append(
            {
                **{k: (_finite(v) if isinstance(v, float) else v) for k, v in r.items()},
                "kernel": None if fusion is None else fusion.kernel,
                "fused": None if fusion is None else fusion.fused,
            }
        )
    warnings = []
    unfused = [str(r["layer"]) for r in rows if r["fused"] is False]
    if unfused:
        warnings.append(
            f"{len(unfused)} quantized layers do not run as MatMulNBits: {', '.join(unfused[:5])}"
        )
    stray = [d for d, kind in classify_leftovers(census) if kind == "stray"]
    if stray:
        warnings.append(f"{len(stray)} stray Q/DQ nodes remain in ONNX Runtime's optimized graph")
    pf, pq = quality.get("perplexity_fp32"), quality.get("perplexity_quantized")
    if pf and pq:
        quality["perplexity_increase"] = pq["ppl"] / pf["ppl"] - 1.0
    if latency.get("prefill", {}).get("speedup", 1.0) < 1.0:
        warnings.append(
            f"prefill is slower than FP32 ({latency['prefill']['speedup']:.2f}x): at many tokens per call the "
            "matrix products are compute-bound and ONNX Runtime's 4-bit kernel unpacks weights on the fly, so "
            "INT4 pays off in decoding (one token per call, memory-bound), not in long prefills. For prefill-heavy "
            "use, try int8_dynamic (W8A8) on the largest layers (`quantkit sweep` with search.metric: latency "
            "finds the mix), keep export.accuracy_level at 4, and judge the decode figure for generation"
        )
    return {
        "kind": "weight_only",
        "recipe": recipe.name,
        "model": source,
        "environment": environment(),
        "settings": recipe.model_dump(mode="json"),
        "samples": {"calibration": calibration_samples, "evaluation": evaluation_samples},
        "size": {"fp32_bytes": f_size, "quantized_bytes": q_size, "ratio": q_size / max(f_size, 1)},
        "quality": quality,
        "latency": latency,
        "timings": timings,
        "census": {
            "op_counts": dict(census.op_counts),
            "quantized_kernels": dict(census.quantized_kernels),
            "float_matmul_left": census.op_counts.get("MatMul", 0)
            + census.op_counts.get("com.microsoft.FusedMatMul", 0),
            "leftover_quantize_linear": census.leftover_q,
            "leftover_dequantize_linear": census.leftover_dq,
        },
        "layers": rows,
        "notes": dict(outcome.notes),
        "warnings": warnings,
    }


def render_woq_markdown(rep: dict[str, Any]) -> str:
    env = rep["environment"]
    lines = [
        f"# quantkit report: {rep['recipe']} (weight-only)",
        "",
        f"Model: `{rep['model']}`",
        "",
        *summary_lines(rep),
        f"Environment: quantkit {env['quantkit']}, onnxruntime {env['onnxruntime']}, {env['cpu']} "
        f"({env['cores']} cores), {env['date']}",
        f"Samples: {rep['samples']['calibration']} calibration windows, {rep['samples']['evaluation']} evaluation windows",
        *data_lines(rep),
        "",
    ]
    lines += warnings_lines(rep)
    s = rep["size"]
    lines += [
        "## Size",
        "",
        "| FP32 | quantized | ratio |",
        "|---|---|---|",
        f"| {s['fp32_bytes'] / 2**20:.1f} MiB | {s['quantized_bytes'] / 2**20:.1f} MiB | {s['ratio']:.3f} |",
        "",
    ]
    q = rep["quality"]
    if "perplexity_fp32" in q:
        pf, pq = q["perplexity_fp32"], q["perplexity_quantized"]
        lines += [
            "## Perplexity (held-out windows)",
            "",
            "| model | perplexity | tokens |",
            "|---|---|---|",
            f"| FP32 | {pf['ppl']:.3f} | {pf['tokens']} |",
            f"| quantized | {pq['ppl']:.3f} | {pq['tokens']} |",
            "",
            f"Increase: {100 * q['perplexity_increase']:.2f}%",
            "",
        ]
    lat = rep.get("latency") or {}
    if lat:
        lines += [
            "## Latency (same run, interleaved)",
            "",
            "| measurement | FP32 ms | quantized ms | speedup |",
            "|---|---|---|---|",
        ]
        for k, v in lat.items():
            if isinstance(v, dict) and "fp32_ms" in v:
                lines.append(
                    f"| {v.get('label', k)} | {v['fp32_ms']:.2f} | {v['quantized_ms']:.2f} | {v['speedup']:.2f}x |"
                )
        lines.append("")
    c = rep["census"]
    lines += [
        "## ONNX Runtime census (optimized graph)",
        "",
        "Quantized kernels: "
        + (", ".join(f"{k} x{v}" for k, v in sorted(c["quantized_kernels"].items())) or "none")
        + f". MatMuls left in float: {c['float_matmul_left']} (attention products, activation x activation: "
        "no constant weight, kept float by design).",
        "",
    ]
    lines += [
        "## Layers",
        "",
        "Columns: `weight rel. error` = ||W - W_q|| / ||W||; `output SQNR dB` = the layer's output error on "
        "calibration inputs, 10 log10(E||xW||^2 / E||x(W - W_q)||^2) (no calibration statistics: -); `stage` = "
        "the sequential calibration pass the layer was quantized in (later stages see earlier layers already "
        "quantized).",
        "",
        "| layer | format | algorithm | bits | group | sym | weight rel. error | output SQNR dB "
        "| kernel | stage |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rep["layers"]:
        sq = r.get("output_sqnr_db")
        lines.append(
            f"| `{r['layer']}` | {r['format']} | {r['algorithm']}{' +awq-scale' if r.get('awq_scaled') else ''}"
            f"{' (tied)' if r.get('tied') else ''} | {r['bits']} | {r['group_size']} | {'y' if r['symmetric'] else 'n'} | "
            f"{r['weight_rel_error']:.4f} | {_fmt(sq, 1) if isinstance(sq, float) and math.isfinite(sq) else _fmt(sq)} | "
            f"{r['kernel'] or '-'} | {r['stage']} |"
        )
    lines += ["", "## Timings", "", " | ".join(f"{k}: {v:.2f}" for k, v in rep["timings"].items()), ""]
    return "\n".join(lines)
