"""Dependency-free SVG scatter / line plots (e.g. a damage-vs-size Pareto front).

:func:`scatter_svg` renders one or more :class:`Series` on linear (or logarithmic x)
axes with "nice" ticks (steps of 1, 2 or 5 times a power of ten), a legend, one colour
and marker per series and optional per-point labels.  Points on a Pareto front
(``Series.front``) are drawn filled and joined by a step line; the others hollow.
Points with a NaN or infinite coordinate (or ``x <= 0`` on a log axis) are skipped.
The output is a standalone SVG document (valid XML, no XML declaration so it can be
inlined in HTML); :func:`write_svg` writes it atomically.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

MARKERS = ("circle", "square", "triangle")
# Colour-blind-friendly palette (Okabe-Ito, then Tableau), cycled.
PALETTE = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#000000",
    "#8C564B",
    "#7F7F7F",
    "#BCBD22",
)

_WIDTH, _HEIGHT = 760, 480
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 190, 44, 60  # plot-area margins; the legend sits on the right
_R = 4.0  # marker radius
# Characters XML 1.0 does not allow at all (escape() does not remove them).
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


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
            raise ValueError(
                f"series {self.name!r}: unknown marker {self.marker!r}; markers: {', '.join(MARKERS)}"
            )


def _text(s: str) -> str:
    return escape(_INVALID_XML.sub("", str(s)))


def _attr(s: str) -> str:
    return quoteattr(_INVALID_XML.sub("", str(s)))


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def nice_step(span: float, target: int = 6) -> float:
    """The 1-2-5 step (times a power of ten) that cuts ``span`` into about ``target`` parts."""
    if not (span > 0 and math.isfinite(span)):
        return 1.0
    raw = span / max(target, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        if raw <= m * mag * (1 + 1e-9):
            return m * mag
    return 10.0 * mag  # pragma: no cover - the loop always returns


def nice_ticks(lo: float, hi: float, target: int = 6) -> tuple[float, float, list[float]]:
    """Axis limits widened to whole 1-2-5 steps, and the ticks between them."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:  # a single value: pad around it
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, target)
    start = math.floor(lo / step + 1e-9) * step
    stop = math.ceil(hi / step - 1e-9) * step
    n = int(round((stop - start) / step))
    ticks = [start + k * step for k in range(n + 1)]
    ticks = [0.0 if abs(t) < step * 1e-9 else t for t in ticks]
    return start, stop, ticks


def _log_ticks(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """Log-axis limits at powers of ten and ticks at 1 (and 2, 5 for short ranges) per decade."""
    a = math.floor(math.log10(lo) + 1e-12)
    b = math.ceil(math.log10(hi) - 1e-12)
    if b == a:
        b = a + 1
    mults = (1.0, 2.0, 5.0) if b - a <= 3 else (1.0,)
    ticks = [m * 10.0**e for e in range(a, b + 1) for m in mults if m * 10.0**e <= 10.0**b * (1 + 1e-9)]
    return 10.0**a, 10.0**b, ticks


def _fmt_tick(v: float, step: float) -> str:
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e6 and step >= 1e-6:
        decimals = max(0, -math.floor(math.log10(step) + 1e-9))
        return f"{v:.{decimals}f}"
    return f"{v:.3g}"


def _marker(kind: str, x: float, y: float, color: str, filled: bool, extra: str = "") -> str:
    fill = color if filled else "white"
    style = f'fill="{fill}" stroke="{color}" stroke-width="1.5"{extra}'
    if kind == "square":
        s = _R * 0.9
        return f'<rect x="{_num(x - s)}" y="{_num(y - s)}" width="{_num(2 * s)}" height="{_num(2 * s)}" {style}/>'
    if kind == "triangle":
        r = _R * 1.2
        pts = f"{_num(x)},{_num(y - r)} {_num(x - r * 0.87)},{_num(y + r * 0.5)} {_num(x + r * 0.87)},{_num(y + r * 0.5)}"
        return f'<polygon points="{pts}" {style}/>'
    return f'<circle cx="{_num(x)}" cy="{_num(y)}" r="{_num(_R)}" {style}/>'


def scatter_svg(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    title: str,
    log_x: bool = False,
) -> str:
    """An SVG document plotting ``series``; every point marker has ``class="point"``.

    Axis limits are the data range widened to whole tick steps (1-2-5 steps on a linear
    axis, decades on a log x axis); an empty plot gets the unit square.  Front points of a
    series are joined by a "post" step line (horizontal, then vertical), the shape of the
    attainable region of a lower-is-better front.
    """

    def usable(x: float, y: float) -> bool:
        return math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x)

    pts = [(float(x), float(y)) for s in series for x, y in zip(s.xs, s.ys, strict=True) if usable(x, y)]
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    if log_x:
        x0, x1, xticks = _log_ticks(min(xs), max(xs)) if xs else (1.0, 10.0, [1.0, 10.0])
        xstep = 0.0
    else:
        x0, x1, xticks = nice_ticks(min(xs), max(xs)) if xs else (0.0, 1.0, [0.0, 0.5, 1.0])
        xstep = xticks[1] - xticks[0] if len(xticks) > 1 else 1.0
    y0, y1, yticks = nice_ticks(min(ys), max(ys)) if ys else (0.0, 1.0, [0.0, 0.5, 1.0])
    ystep = yticks[1] - yticks[0] if len(yticks) > 1 else 1.0

    pw = _WIDTH - _LEFT - _RIGHT
    ph = _HEIGHT - _TOP - _BOTTOM

    def px(x: float) -> float:
        if log_x:
            return _LEFT + pw * (math.log10(x) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))
        return _LEFT + pw * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return _TOP + ph * (1.0 - (y - y0) / (y1 - y0))

    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" font-family="sans-serif" font-size="12">',
        f"<title>{_text(title)}</title>",
        f'<rect x="0" y="0" width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
        f'<text x="{_LEFT + pw / 2:.1f}" y="24" text-anchor="middle" font-size="15" '
        f'font-weight="bold">{_text(title)}</text>',
    ]
    # grid, ticks and tick labels
    out.append('<g class="axes" stroke="#dddddd" stroke-width="1">')
    for t in xticks:
        x = px(t)
        out.append(f'<line x1="{_num(x)}" y1="{_TOP}" x2="{_num(x)}" y2="{_TOP + ph}"/>')
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{_LEFT}" y1="{_num(y)}" x2="{_LEFT + pw}" y2="{_num(y)}"/>')
    out.append("</g>")
    out.append(f'<rect x="{_LEFT}" y="{_TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333333"/>')
    out.append('<g class="tick-labels" fill="#333333">')
    for t in xticks:
        label = f"{t:g}" if log_x else _fmt_tick(t, xstep)
        out.append(f'<text x="{_num(px(t))}" y="{_TOP + ph + 16}" text-anchor="middle">{_text(label)}</text>')
    for t in yticks:
        out.append(
            f'<text x="{_LEFT - 6}" y="{_num(py(t) + 4)}" text-anchor="end">{_text(_fmt_tick(t, ystep))}</text>'
        )
    out.append("</g>")
    out.append(
        f'<text x="{_LEFT + pw / 2:.1f}" y="{_HEIGHT - 16}" text-anchor="middle">{_text(x_label)}</text>'
    )
    cy = _TOP + ph / 2
    out.append(
        f'<text x="18" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 18 {cy:.1f})">{_text(y_label)}</text>'
    )

    # series
    for k, s in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        out.append(f'<g class="series" data-name={_attr(s.name)}>')
        keep = [i for i in range(len(s.xs)) if usable(float(s.xs[i]), float(s.ys[i]))]
        if s.line and len(keep) > 1:
            order = sorted(keep, key=lambda i: float(s.xs[i]))
            path = " ".join(f"{_num(px(float(s.xs[i])))},{_num(py(float(s.ys[i])))}" for i in order)
            out.append(
                f'<polyline class="line" points="{path}" fill="none" stroke="{color}" stroke-width="1.2"/>'
            )
        on_front = [i for i in keep if s.front is not None and s.front[i]]
        if len(on_front) > 1:
            order = sorted(on_front, key=lambda i: (float(s.xs[i]), float(s.ys[i])))
            d = f"M{_num(px(float(s.xs[order[0]])))},{_num(py(float(s.ys[order[0]])))}"
            for i in order[1:]:
                d += f" H{_num(px(float(s.xs[i])))} V{_num(py(float(s.ys[i])))}"
            out.append(f'<path class="front" d="{d}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for i in keep:
            x, y = px(float(s.xs[i])), py(float(s.ys[i]))
            filled = s.front is None or bool(s.front[i])
            out.append(_marker(s.marker, x, y, color, filled, ' class="point"'))
            if s.labels is not None and s.labels[i]:
                out.append(
                    f'<text class="label" x="{_num(x + 6)}" y="{_num(y - 6)}" font-size="10" '
                    f'fill="{color}">{_text(s.labels[i])}</text>'
                )
        out.append("</g>")

    # legend
    lx = _LEFT + pw + 16
    out.append('<g class="legend">')
    for k, s in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        y = _TOP + 10 + 20 * k
        out.append(_marker(s.marker, lx + 5, y, color, True))
        out.append(f'<text x="{lx + 16}" y="{y + 4}">{_text(s.name)}</text>')
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(svg: str, path: str | os.PathLike[str]) -> Path:
    """Write ``svg`` to ``path`` atomically and return the path.

    The text goes to a temporary file in the same directory (created if missing), is
    flushed to disk, and replaces ``path`` with :func:`os.replace`, so a reader never
    sees a half-written file; the temporary file is removed if anything fails.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(svg)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a report is meant to be read
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target
