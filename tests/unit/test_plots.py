"""Dependency-free SVG plots: valid XML, content, edge cases, atomic write."""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from quantkit.report.plots import Series, nice_ticks, scatter_svg, write_svg

NS = "{http://www.w3.org/2000/svg}"


def _points(root: ET.Element) -> list[ET.Element]:
    return [e for e in root.iter() if e.get("class") == "point"]


def test_scatter_parses_and_has_series() -> None:
    a = Series(
        "front <a&b>",
        [1e6, 2e6, 3e6, 4e6],
        [0.3, 0.1, 0.2, 0.01],
        labels=["int4", "mix", "x", "int8"],
        front=[True, True, False, True],
    )
    b = Series("baseline", [2.5e6], [0.05], marker="square")
    c = Series("sweep", [1.0, 2.0, 3.0], [1.0, 0.5, 0.2], marker="triangle", line=True)
    svg = scatter_svg([a, b, c], x_label="bytes", y_label="damage", title="size vs damage")
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg"
    text = " ".join(t.text or "" for t in root.iter(f"{NS}text"))
    assert "front <a&b>" in text and "baseline" in text and "sweep" in text
    assert "size vs damage" in text and "int4" in text
    assert len(_points(root)) == 8
    groups = [g for g in root.iter(f"{NS}g") if g.get("class") == "series"]
    assert [g.get("data-name") for g in groups] == ["front <a&b>", "baseline", "sweep"]
    assert len(_points(groups[0])) == 4
    # front points filled, the off-front point hollow; one step line for the front
    fills = [p.get("fill") for p in _points(groups[0])]
    assert fills.count("white") == 1
    assert len([e for e in groups[0].iter() if e.get("class") == "front"]) == 1
    assert len([e for e in groups[2].iter() if e.get("class") == "line"]) == 1
    # distinct colours per series
    assert len({_points(g)[0].get("stroke") for g in groups}) == 3


def test_nan_inf_single_and_empty() -> None:
    s = Series("bad", [1.0, math.nan, 3.0, math.inf], [1.0, 2.0, -math.inf, 4.0])
    root = ET.fromstring(scatter_svg([s], x_label="x", y_label="y", title="t"))
    assert len(_points(root)) == 1
    root = ET.fromstring(scatter_svg([Series("one", [5.0], [5.0])], x_label="x", y_label="y", title="t"))
    assert len(_points(root)) == 1
    root = ET.fromstring(scatter_svg([Series("empty", [], [])], x_label="x", y_label="y", title="t"))
    assert len(_points(root)) == 0
    root = ET.fromstring(scatter_svg([], x_label="x", y_label="y", title="t"))
    assert len(_points(root)) == 0
    # log x skips x <= 0
    s = Series("log", [0.0, 10.0, 1000.0, -1.0], [1.0, 2.0, 3.0, 4.0])
    root = ET.fromstring(scatter_svg([s], x_label="x", y_label="y", title="t\x01", log_x=True))
    assert len(_points(root)) == 2


def test_nice_ticks() -> None:
    lo, hi, ticks = nice_ticks(0.13, 0.87)
    assert lo <= 0.13 and hi >= 0.87
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1
    (step,) = steps
    mant = step / 10 ** math.floor(math.log10(step))
    assert round(mant, 9) in (1.0, 2.0, 5.0)
    assert nice_ticks(3.0, 3.0)[0] < 3.0 < nice_ticks(3.0, 3.0)[1]


def test_series_validation() -> None:
    with pytest.raises(ValueError, match="2 xs but 1 ys"):
        Series("s", [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="unknown marker 'star'"):
        Series("s", [1.0], [1.0], marker="star")


def test_write_svg_atomic(tmp_path: Path) -> None:
    svg = scatter_svg([Series("a", [1.0, 2.0], [2.0, 1.0])], x_label="x", y_label="y", title="t")
    out = write_svg(svg, tmp_path / "sub" / "plot.svg")
    assert out == tmp_path / "sub" / "plot.svg"
    assert out.read_text(encoding="utf-8") == svg
    write_svg(svg.replace("t<", "u<"), out)  # overwrite in place
    assert os.listdir(out.parent) == ["plot.svg"]
    ET.fromstring(out.read_text(encoding="utf-8"))
