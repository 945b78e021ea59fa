"""Sweep report: JSON (everything), Markdown (tables), SVG plots, per-point layer assignments (CSV).

Every file is written to a temporary name in the output folder and renamed into place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantkit.report.build import atomic_write_text
from quantkit.report.plots import Series, scatter_svg, write_svg

__all__ = ["sweep_markdown", "write_sweep_report"]


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
        ("size", "size_bytes", "file size (MiB)"),
    ):
        scale = 2**-20 if mkey == "size_bytes" else 1.0
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
        svg = scatter_svg(series, x_label=xlabel, y_label=label, title=f"{r['recipe']}: {label} vs {axis}",
                          log_y=key == "damage")
        paths[f"quality_vs_{axis}"] = write_svg(svg, out / f"quality_vs_{axis}.svg")
    # predicted front (damage vs the search metric), with the evaluated points' predictions
    metric = "latency_ms" if r["metric"] == "latency" else "bytes"
    scale = 2**-20 if metric == "bytes" else 1.0
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
    xl = "predicted latency (ms)" if metric == "latency_ms" else "predicted size (MiB)"
    paths["predicted_front"] = write_svg(
        scatter_svg(series, x_label=xl, y_label="predicted damage", title=f"{r['recipe']}: predicted front",
                    log_y=True),
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


