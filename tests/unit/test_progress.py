"""Progress stays readable without a terminal: full lines (stage, done/total, rate, ETA) at least every
``LINE_INTERVAL_S`` instead of carriage-return bars, when stderr is a file, a pipe or a CI log."""

from __future__ import annotations

import ast
import io
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import quantkit.progress as progress
from quantkit.cli import main

ROOT = Path(__file__).resolve().parents[2]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """stderr replaced by a non-TTY stream, and the ``quantkit`` logger writing to it."""
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.delenv("QUANTKIT_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.2)
    log = logging.getLogger("quantkit")
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("quantkit: %(message)s"))
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield out
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def test_without_a_terminal_a_bar_logs_full_lines(lines: io.StringIO) -> None:
    for _ in progress.tqdm(range(6), desc="calibrate", unit="batch"):
        time.sleep(0.1)
    text = lines.getvalue()
    assert "\r" not in text
    rows = [r for r in text.splitlines() if r.startswith("quantkit: calibrate: ")]
    assert rows[0].startswith("quantkit: calibrate: 0/6 batch (0%)")
    assert rows[-1].startswith("quantkit: calibrate: 6/6 batch (100%)")
    assert any("batch/s" in r and "ETA" in r for r in rows[1:-1])  # rate and time left while it runs
    assert len(rows) < 6 + 2  # rate-limited, not one line per step


def test_a_heartbeat_repeats_the_line_while_a_step_runs(lines: io.StringIO) -> None:
    with progress.tqdm(total=3, desc="quantize blocks", unit="block") as bar:
        time.sleep(1.0)  # one long step: no update at all
        bar.update(1)
    rows = [r for r in lines.getvalue().splitlines() if "quantize blocks" in r]
    assert len(rows) >= 4  # start, >= 2 heartbeats, end
    assert rows[-1].startswith("quantkit: quantize blocks: 1/3 block (33%)")


def test_refresh_driven_bars_are_rate_limited_and_leave_false_logs_no_end(lines: io.StringIO) -> None:
    with progress.tqdm(total=100, desc="perplexity", unit="window", leave=False) as bar:
        for i in range(100):
            bar.n = i + 1
            bar.refresh()
    rows = lines.getvalue().splitlines()
    assert len(rows) == 1 and "perplexity: 0/100" in rows[0]


def test_disabled_bars_are_silent(lines: io.StringIO) -> None:
    for _ in progress.tqdm(range(3), desc="x", disable=True):
        pass
    assert lines.getvalue() == ""


def test_a_terminal_gets_tqdm_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUANTKIT_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", _Tty())
    bar = progress.tqdm(total=2, desc="x")
    try:
        assert not isinstance(bar, progress._LineBar)
    finally:
        bar.close()
    monkeypatch.setenv("QUANTKIT_PROGRESS", "lines")
    bar = progress.tqdm(total=2, desc="x")
    try:
        assert isinstance(bar, progress._LineBar)
    finally:
        bar.close()


def test_a_cli_run_with_output_to_a_file_prints_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A small ``quantkit calibrate`` with stderr captured (not a TTY, as under CI, nohup or tee)."""
    from tests.unit.test_api_cli import _write_recipe

    monkeypatch.delenv("QUANTKIT_PROGRESS", raising=False)
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.05)
    rec = _write_recipe(tmp_path)  # a tiny CNN; the whole-graph path (what this test watches is the progress)
    rec.write_text(rec.read_text().replace("batch_size: 4}", "batch_size: 4, layerwise: false}"))
    assert main(["calibrate", "--recipe", str(rec), "--output", str(tmp_path / "out"), "--no-latency",
                 "--no-cache"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "\x1b[" not in err  # no cursor movement either
    calib = [r for r in err.splitlines() if r.startswith("quantkit: calibrate: ")]
    assert calib and re.search(r"calibrate: \d+/\d+ batch", calib[-1])


def test_no_module_uses_tqdm_directly() -> None:
    """Every progress bar goes through quantkit.progress.tqdm (so it is readable without a terminal)."""
    offenders = []
    for path in sorted((ROOT / "quantkit").rglob("*.py")):
        if path.name == "progress.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(m == "tqdm" or m.startswith("tqdm.") for m in mods):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"import quantkit.progress.tqdm instead of tqdm: {offenders}"

