"""Helpers of the reliability tests: a tiny model + data (``work``), recipes, the CLI runner, and a tree's
content digest to prove nothing of the user's changed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml

from quantkit.cli import main
from tests.conftest import image_batches, tiny_cnn


def tree_digest(root: Path, *, skip: Iterable[str] = ()) -> dict[str, str]:
    """``relative path -> sha256`` (files), ``-> "dir"`` (folders), ``-> "link:TARGET"`` (symlinks) of
    everything under ``root``, without following links.  Paths in ``skip`` (relative, POSIX) and everything
    under them are left out: the places the run is allowed to write."""
    skipped = {s.strip("/") for s in skip}
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel in skipped or any(rel.startswith(s + "/") for s in skipped):
                continue
            if p.is_symlink():
                out[rel] = f"link:{os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def unchanged_outside(before: dict[str, str], after: dict[str, str], allowed: Iterable[str] = ()) -> list[str]:
    """Paths of ``before`` that are gone or different in ``after`` (ignoring ``allowed`` prefixes)."""
    ok = [a.strip("/") for a in allowed]
    bad = []
    for k, v in before.items():
        if any(k == a or k.startswith(a + "/") for a in ok):
            continue
        if after.get(k) != v:
            bad.append(k)
    return bad


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny model, calibration / evaluation data and a private cache in ``tmp_path``."""
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    onnx.save(tiny_cnn(), tmp_path / "model.onnx")
    _npz(tmp_path / "cal.npz", np.concatenate([b["input"] for b in image_batches(4)]))
    _npz(tmp_path / "ev.npz", np.concatenate([b["input"] for b in image_batches(2, seed=7)]))
    return tmp_path


def _npz(path: Path, x: np.ndarray) -> Path:
    np.savez(path, input=x.astype(np.float32))
    return path


def _recipe(work: Path, *, cal: str = "cal.npz", formats: list[str] | None = None, **extra: Any) -> Path:
    rec: dict[str, Any] = {
        "version": 1, "name": "rel",
        "model": {"source": str(work / "model.onnx")},
        "calibration": {"data": {"kind": "npz", "path": str(work / cal)}, "batch_size": 4},
        "evaluation": {"data": {"kind": "npz", "path": str(work / "ev.npz")}},
        "report": {"formats": formats or ["json", "md", "html"], "latency": {"enabled": False},
                   "kernel_check_samples": 2},
    }
    rec.update(extra)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")} if folder.exists() else set()


OUTPUTS = {"model.onnx", "report.json", "report.md", "report.html", "quantkit-manifest.json"}


def _run(args: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture | None = None
         ) -> tuple[int, str]:
    rc = main(args)
    out = capsys.readouterr()
    text = out.out + out.err + (caplog.text if caplog is not None else "")
    return rc, text
