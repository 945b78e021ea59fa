"""Scatter / line plots of sweeps (quality vs latency / size, the predicted front), drawn with matplotlib.

:func:`scatter_svg` renders one or more :class:`Series` and returns a standalone SVG document (text kept
as ``<text>`` so it stays searchable and can be inlined in HTML; no timestamp, so the same data gives
the same file).  Points on a Pareto front (``Series.front``) are drawn filled and joined by a step line;
the others hollow.  Points with a NaN or infinite coordinate (or ``<= 0`` on a log axis) are skipped.

Damage axes are logarithmic (``log_y=True``): measured damages span several decades and points near 0
would otherwise collapse onto the axis.  A damage of exactly 0 (FP32, or a point that changed nothing)
is drawn on a symmetric-log axis whose linear part ends at the smallest positive value.  Per-point labels
are offset in turn above-right / below-right / above-left / below-left of their points to limit overlap,
and dropped beyond ``max_labels`` points (the legend and the report's tables carry the names).
Every series is an SVG group with ``id="series-<i>"`` (``<i>`` its position).

:func:`write_svg` writes atomically (temporary file + rename).
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKERS = {"circle": "o", "square": "s", "triangle": "^"}
# Colour-blind-friendly palette (Okabe-Ito, then Tableau), cycled.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#8C564B", "#7F7F7F",
           "#BCBD22")
_OFFSETS = ((5, 5, "left"), (5, -11, "left"), (-5, 5, "right"), (-5, -11, "right"))


@dataclass
class Series:
    """One named set of points.

    ``labels`` (text next to each point) and ``front`` (which points are on a Pareto
    front) have one entry per point when given.  ``line`` joins the points in x order.
    """

    name: str
    xs: list[float]
    ys: list[float]
    labels: list[str] | None = None
    front: list[bool] | None = None
    marker: str = "circle"
    line: bool = False

    def __post_init__(self) -> None:
        n = len(self.xs)
        if len(self.ys) != n:
            raise ValueError(f"series {self.name!r}: {n} xs but {len(self.ys)} ys")
        if self.labels is not None and len(self.labels) != n:
            raise ValueError(f"series {self.name!r}: {n} points but {len(self.labels)} labels")
        if self.front is not None and len(self.front) != n:
            raise ValueError(f"series {self.name!r}: {n} points but {len(self.front)} front flags")
        if self.marker not in MARKERS:
            raise ValueError(f"series {self.name!r}: unknown marker {self.marker!r}; allowed: {sorted(MARKERS)}")


def _usable(x: float, y: float, log_x: bool, log_y: bool) -> bool:
    return (math.isfinite(x) and math.isfinite(y) and not (log_x and x <= 0)
            and not (log_y and y < 0))


def scatter_svg(series: Sequence[Series], *, x_label: str, y_label: str, title: str, log_x: bool = False,
                log_y: bool = False, max_labels: int = 24) -> str:
    """The SVG document of ``series`` (see the module doc)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    clean = _printable
    fig = Figure(figsize=(8.0, 5.0), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    n_labels = 0
    positive: list[float] = []
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        labels: list[str | None] = list(s.labels) if s.labels is not None else [None] * len(s.xs)
        pts = [(x, y, labels[j], (s.front or [False] * len(s.xs))[j])
               for j, (x, y) in enumerate(zip(s.xs, s.ys, strict=True)) if _usable(x, y, log_x, log_y)]
        positive += [y for _, y, _, _ in pts if y > 0]
        filled = [p for p in pts if p[3] or s.front is None]
        hollow = [p for p in pts if not (p[3] or s.front is None)]
        artists: list[Any] = []
        for group, face in ((filled, color), (hollow, "white")):
            if group:
                artists.append(ax.scatter([p[0] for p in group], [p[1] for p in group], marker=MARKERS[s.marker],
                                          s=36, facecolors=face, edgecolors=color, linewidths=1.4, zorder=3,
                                          label=clean(s.name) if not artists else None))
        on = sorted((p for p in pts if p[3]), key=lambda p: p[0])
        if len(on) > 1:
            artists += ax.step([p[0] for p in on], [p[1] for p in on], where="post", color=color, linewidth=1.2,
                               alpha=0.8)
        if s.line and len(pts) > 1:
            srt = sorted(pts, key=lambda p: p[0])
            artists += ax.plot([p[0] for p in srt], [p[1] for p in srt], color=color, linewidth=1.0, alpha=0.7)
        for x, y, lab, _ in pts:
            if lab and n_labels < max_labels:
                dx, dy, ha = _OFFSETS[n_labels % len(_OFFSETS)]
                artists.append(ax.annotate(clean(lab), (x, y), xytext=(dx, dy), textcoords="offset points",
                                           fontsize=7, ha=ha, color=color))
                n_labels += 1
        if not artists:  # keep the series in the legend even when it has no drawable point
            artists.append(ax.scatter([], [], marker=MARKERS[s.marker], edgecolors=color, facecolors=color,
                                      label=clean(s.name)))
        for a in artists:
            a.set_gid(f"series-{i}")
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("symlog", linthresh=min(positive) if positive else 1e-6)
    ax.set_xlabel(clean(x_label))
    ax.set_ylabel(clean(y_label) + (" (log scale)" if log_y else ""))
    ax.set_title(clean(title))
    ax.grid(True, which="major", alpha=0.3)
    if series:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.1, right=0.72, top=0.9, bottom=0.12)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "quantkit"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def _printable(s: str) -> str:
    """Text without control characters (XML 1.0 forbids them) and without matplotlib's math mode."""
    return "".join(ch for ch in str(s) if ch >= " " or ch in "\t\n").replace("$", r"\$")


def write_svg(svg: str, path: str | os.PathLike[str]) -> Path:
    """Write ``svg`` to ``path`` atomically (temporary file in the same folder, then rename)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(svg)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out
