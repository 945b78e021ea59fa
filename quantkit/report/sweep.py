"""Sweep report: JSON (everything), Markdown (tables), SVG plots, per-point layer assignments (CSV).

Every file is written to a temporary name in the output folder and renamed into place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantkit.report.build import atomic_write_text, warnings_lines
from quantkit.report.plots import Series, scatter_svg, write_svg

__all__ = ["render_mixed_markdown", "sweep_markdown", "write_sweep_report"]


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def _f(v: Any, nd: int = 3) -> str:
    if isinstance(v, (int, float)) and math.isfinite(v):
        return f"{v:.{nd}f}" if abs(v) < 1e4 else f"{v:.4g}"
    return "-"


def sweep_markdown(r: Mapping[str, Any]) -> str:
    key, label = r["quality_key"], r["quality_label"]
    fp = r["fp32"]
    lines = [
        f"# Sweep: {r['recipe']}",
        "",
        f"Model `{r['source']}` ({r['family']}, {len(r['units'])} units), provider {r['provider']}. "
        f"Cost axis of the front: **{r['metric']}**. Quality: **{label}** (lower is better), measured with ONNX "
        "Runtime on the evaluation data; latency measured on the emitted models, all points and FP32 interleaved.",
        "",
        f"FP32: latency {_f(fp.get('latency_ms'))} ms, size {_mb(fp.get('size_bytes', 0))} MB"
        + (f", {label} {_f(fp.get(key))}" if key in fp else ""),
        "",
        f"Spearman rank correlation, predicted damage vs measured {label}: "
        f"**{_f(r['spearman_predicted_damage_vs_measured'])}**; predicted vs measured latency: "
        f"{_f(r['spearman_predicted_vs_measured_latency'])}",
        "",
        f"> {r['note_16bit']}",
        "",
        "| point | kind | formats (layers) | predicted damage | measured "
        + label
        + " | pred. ms | measured ms | x FP32 | pred. MB | file MB | front (lat / size) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        m, pr = p["measured"], p["predicted"]
        counts = ", ".join(f"{k} {v}" for k, v in sorted(p["counts"].items()))
        fr = p["on_measured_front"]
        flag = "/".join("on" if fr.get(a) else "**dominated**" for a in ("latency", "size"))
        lines.append(
            f"| {p['id']} | {p['kind']} | {counts} | {_f(pr['damage'], 4)} | {_f(m.get(key), 4)} | "
            f"{_f(pr['latency_ms'])} | {_f(m.get('latency_ms'))} | {_f(m.get('speedup_vs_fp32'), 2)} | "
            f"{_mb(pr['bytes'])} | {_mb(m.get('size_bytes', 0))} | {flag} |"
        )
    lines += [
        "",
        "Plots: `quality_vs_latency.svg`, `quality_vs_size.svg`; per-layer assignments: "
        "`assignments/<point>.csv`; everything: `sweep.json`.",
        "",
        "## Timings (s)",
        "",
    ]
    lines += [f"- {k}: {_f(v, 1)}" for k, v in r["timings"].items()]
    lines += [
        "",
        "## Roofline of each unit (measured kernels)",
        "",
        "| unit | candidate | GFLOP | MB moved | ms | intensity (flop/B) | bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r.get("roofline", [])[:400]:
        lines.append(
            f"| {row['unit']} | {row['candidate']} | {_f(row['flops'] / 1e9, 4)} | {_f(row['bytes'] / 1e6, 2)} | "
            f"{_f(row['time_ms'], 4)} | {_f(row.get('intensity'), 1)} | {row.get('bound', '-')} |"
        )
    return "\n".join(lines) + "\n"


def _plots(r: Mapping[str, Any], out: Path) -> dict[str, Path]:
    key, label = r["quality_key"], r["quality_label"]
    pts = r["points"]
    paths = {}
    for axis, mkey, xlabel in (
        ("latency", "latency_ms", "measured latency (ms)"),
        ("size", "size_bytes", "file size (MB)"),
    ):
        scale = 1e-6 if mkey == "size_bytes" else 1.0
        series = []
        for kind, marker in (("uniform", "square"), ("front", "circle"), ("budget", "triangle")):
            sel = [p for p in pts if p["kind"].split("+")[0] == kind]
            if not sel:
                continue
            series.append(
                Series(
                    name=f"{kind} points",
                    xs=[p["measured"][mkey] * scale for p in sel],
                    ys=[float(p["measured"].get(key, float("nan"))) for p in sel],
                    labels=[
                        p["id"] + ("" if p["on_measured_front"].get(axis) else " (dominated)") for p in sel
                    ],
                    marker=marker,
                )
            )
        # the measured Pareto front across every evaluated point (not per kind)
        on = [p for p in pts if p["on_measured_front"].get(axis)]
        if on:
            series.append(
                Series(
                    name="measured Pareto front",
                    xs=[p["measured"][mkey] * scale for p in on],
                    ys=[float(p["measured"].get(key, float("nan"))) for p in on],
                    front=[True] * len(on),
                )
            )
        fp = r["fp32"]
        if key in fp:
            series.append(
                Series(
                    name="FP32", xs=[fp[mkey] * scale], ys=[float(fp[key])], labels=["FP32"], marker="square"
                )
            )
        svg = scatter_svg(series, x_label=xlabel, y_label=label, title=f"{r['recipe']}: {label} vs {axis}")
        paths[f"quality_vs_{axis}"] = write_svg(svg, out / f"quality_vs_{axis}.svg")
    # predicted front (damage vs the search metric), with the evaluated points' predictions
    metric = "latency_ms" if r["metric"] == "latency" else "bytes"
    scale = 1e-6 if metric == "bytes" else 1.0
    front = r["predicted_front"]
    series = [
        Series(
            name="predicted front",
            xs=[f[metric] * scale for f in front],
            ys=[f["damage"] for f in front],
            front=[True] * len(front),
            line=True,
        ),
        Series(
            name="evaluated points (predicted)",
            xs=[p["predicted"][metric] * scale for p in pts],
            ys=[p["predicted"]["damage"] for p in pts],
            labels=[p["id"] for p in pts],
            marker="triangle",
        ),
    ]
    xl = "predicted latency (ms)" if metric == "latency_ms" else "predicted size (MB)"
    paths["predicted_front"] = write_svg(
        scatter_svg(series, x_label=xl, y_label="predicted damage", title=f"{r['recipe']}: predicted front"),
        out / "predicted_front.svg",
    )
    return paths


def write_sweep_report(r: Mapping[str, Any], out: Path) -> dict[str, Path]:
    """Write ``sweep.json``, ``sweep.md``, the SVG plots and ``assignments/*.csv`` into ``out``."""
    paths = {
        "json": atomic_write_text(out / "sweep.json", json.dumps(r, indent=1, default=str)),
        "md": atomic_write_text(out / "sweep.md", sweep_markdown(r)),
    }
    paths.update(_plots(r, out))
    for i, (pid, rows) in enumerate(r["assignments"].items()):
        cols = ["layer", "unit", "candidate", "format", "K", "N", "smoothquant_alpha"]
        text = (
            ",".join(cols)
            + "\n"
            + "".join(",".join(str(row.get(c, "")) for c in cols) + "\n" for row in rows)
        )
        paths[f"assignment:{pid}"] = atomic_write_text(out / "assignments" / f"point-{i:02d}.csv", text)
    return paths


def render_mixed_markdown(rep: Mapping[str, Any]) -> str:
    """Markdown of one searched mixed-precision point (``quantkit calibrate`` with ``search.target``)."""
    env = rep["environment"]
    pr = rep["predicted"]
    lines = [
        f"# quantkit report: {rep['recipe']} (mixed precision, searched)",
        "",
        f"Model: `{rep['model']}`",
        "",
        f"Environment: quantkit {env['quantkit']}, onnxruntime {env['onnxruntime']}, {env['cpu']} "
        f"({env['cores']} cores), {env['date']}",
        "",
        f"Target: `{rep['target']}` (solver status {rep['status']}). Formats (layers): "
        + ", ".join(f"{k} {v}" for k, v in sorted(rep["formats"].items())),
        f"Predicted: damage {_f(pr['damage'], 5)}, {_mb(pr['bytes'])} MB, {_f(pr['latency_ms'])} ms",
        "",
    ]
    lines += warnings_lines(rep)
    s = rep["size"]
    lines += [
        "## Size",
        "",
        f"FP32 {_mb(s['fp32_bytes'])} MB -> {_mb(s['quantized_bytes'])} MB ({s['ratio']:.3f})",
        "",
    ]
    q = rep["quality"]
    if "perplexity_fp32" in q:
        lines += [
            "## Perplexity",
            "",
            f"FP32 {q['perplexity_fp32']['ppl']:.3f} -> {q['perplexity_quantized']['ppl']:.3f} "
            f"({100 * q['perplexity_increase']:+.2f}%)",
            "",
        ]
    for name, d in (q.get("fidelity") or {}).items():
        lines += [f"## Fidelity `{name}`", "", ", ".join(f"{k} {_f(v, 4)}" for k, v in d.items()), ""]
    lat = rep.get("latency") or {}
    if lat:
        lines += ["## Latency (same run, interleaved)", ""]
        if "speedup" in lat and "fp32" in lat:
            lines.append(
                f"FP32 {lat['fp32']['median_ms']:.2f} ms, quantized {lat['quantized']['median_ms']:.2f} ms "
                f"({lat['speedup']:.2f}x)"
            )
        for k, v in lat.items():
            if isinstance(v, dict) and "fp32_ms" in v:
                lines.append(
                    f"- {v.get('label', k)}: FP32 {v['fp32_ms']:.2f} ms, quantized {v['quantized_ms']:.2f} ms "
                    f"({v['speedup']:.2f}x)"
                )
        lines.append("")
    c = rep["census"]
    lines += [
        "## ONNX Runtime census",
        "",
        "Quantized kernels: "
        + (", ".join(f"{k} x{v}" for k, v in sorted(c["quantized_kernels"].items())) or "none"),
        "",
        "## Layers",
        "",
        "| layer | unit | candidate | format |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{r['layer']}` | {r['unit']} | {r['candidate']} | {r['format']} |" for r in rep["layers"]]
    lines += ["", "## Timings", "", " | ".join(f"{k}: {v:.2f}" for k, v in rep["timings"].items()), ""]
    return "\n".join(lines)
