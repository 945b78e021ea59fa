"""Sweep plots (matplotlib SVG): valid XML, content, log damage axis, edge cases, atomic write."""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from quantkit.report.plots import Series, scatter_svg, write_svg

NS = "{http://www.w3.org/2000/svg}"


def _text(root: ET.Element) -> str:
    return " ".join("".join(t.itertext()) for t in root.iter(f"{NS}text"))


def _series_groups(root: ET.Element) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in root.iter(f"{NS}g"):
        gid = g.get("id") or ""
        if gid.startswith("series-"):
            out[gid] = out.get(gid, 0) + 1
    return out


def test_scatter_parses_and_has_every_series_and_label() -> None:
    a = Series("front <a&b>", [1e6, 2e6, 3e6, 4e6], [0.3, 0.1, 0.2, 0.01], labels=["int4", "mix", "x", "int8"],
               front=[True, True, False, True])
    b = Series("baseline", [2.5e6], [0.05], marker="square")
    c = Series("sweep", [1.0, 2.0, 3.0], [1.0, 0.5, 0.2], marker="triangle", line=True)
    svg = scatter_svg([a, b, c], x_label="bytes", y_label="damage", title="size vs damage")
    root = ET.fromstring(svg)
    assert root.tag == f"{NS}svg"
    text = _text(root)
    for s in ("front <a&b>", "baseline", "sweep", "size vs damage", "int4", "int8", "bytes"):
        assert s in text, s
    assert set(_series_groups(root)) == {"series-0", "series-1", "series-2"}
    assert svg == scatter_svg([a, b, c], x_label="bytes", y_label="damage", title="size vs damage")  # reproducible


def test_log_damage_axis_keeps_zero_and_tiny_values_apart() -> None:
    s = Series("points", [1.0, 2.0, 3.0, 4.0], [0.0, 1e-5, 1e-3, 0.2], labels=["fp32", "a", "b", "c"])
    lin = scatter_svg([s], x_label="MB", y_label="damage", title="t")
    log = scatter_svg([s], x_label="MB", y_label="damage", title="t", log_y=True)
    assert "(log scale)" in _text(ET.fromstring(log)) and "(log scale)" not in _text(ET.fromstring(lin))
    # decade ticks on the log axis (10^-5 .. 10^-1) besides 0: tiny damages are not flattened onto the axis
    ticks = ["".join("".join(t.itertext()).split()) for t in ET.fromstring(log).iter(f"{NS}text")]
    assert {"10−5", "10−3", "10−1", "0"} <= set(ticks), ticks


def test_nan_inf_single_and_empty_do_not_fail() -> None:
    for series in ([Series("bad", [1.0, math.nan, 3.0, math.inf], [1.0, 2.0, -math.inf, 4.0])],
                   [Series("one", [5.0], [5.0])], [Series("empty", [], [])], [],
                   [Series("log", [0.0, 10.0, 1000.0, -1.0], [1.0, 2.0, 3.0, 4.0])]):
        root = ET.fromstring(scatter_svg(series, x_label="x", y_label="y", title="t\x01 $x$", log_x=True))
        assert root.tag == f"{NS}svg"


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
