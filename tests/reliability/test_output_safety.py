"""Nothing of the user's is ever deleted or overwritten by writing a run's outputs.

Every test hashes the whole working tree before and after (``tree_digest``) and asserts that every file
quantkit did not write is byte-identical afterwards; the exit code and the one-line message are asserted
too.  The property test at the end throws arbitrary manifests and pre-existing trees at
:func:`quantkit.report.output.write_outputs`.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.errors import RecipeError
from quantkit.recipe import load_recipe
from quantkit.report.output import MANIFEST, OutputError, write_outputs
from tests.conftest import tiny_cnn
from tests.reliability.conftest import OUTPUTS, _recipe, _run, tree_digest, unchanged_outside


def _forge(folder: Path, files: Any) -> None:
    """A manifest written by hand (or edited): quantkit must not trust it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"version": 2, "files": files, "mac": "0" * 64}))


# -- manifests are data, never trusted --------------------------------------------------------------
@pytest.mark.parametrize("entry", ["../victim", "VICTIM_ABS", ".", "", "sub/../../victim", "./", "/"])
def test_a_forged_manifest_removes_nothing_outside_or_inside(work: Path, capsys: Any, entry: str) -> None:
    victim = work / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    out = work / "o"
    name = str(victim) if entry == "VICTIM_ABS" else entry
    _forge(out, {name: {"size": 1, "sha256": "0" * 64}})
    before = tree_digest(work, skip=["cache", "o"])
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    # the folder holds only the (forged) manifest: no foreign files, so the run goes ahead, and the
    # manifest's entries are ignored
    assert rc == 0, text
    assert unchanged_outside(before, tree_digest(work, skip=["cache", "o"])) == []
    assert (victim / "thesis.tex").read_text() == "years of work"
    assert {p.name for p in out.iterdir()} == OUTPUTS


def test_a_forged_manifest_listing_the_folder_keeps_the_users_files(work: Path, capsys: Any, caplog: Any) -> None:
    out = work / "o"
    _forge(out, {".": {"size": 1, "sha256": "0" * 64}, "notes.txt": {"size": 7, "sha256": "0" * 64}})
    (out / "notes.txt").write_text("keep me")
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 2 and "quantkit did not write (notes.txt)" in text
    rc, text = _run(["calibrate", "-q", "--overwrite", "--recipe", str(_recipe(work)), "--output", str(out)], capsys,
                    caplog)
    assert rc == 0 and (out / "notes.txt").read_text() == "keep me"
    assert "not signed by quantkit on this machine" in text


def test_a_genuine_manifest_with_an_edited_file_keeps_the_edit(work: Path, capsys: Any) -> None:
    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    (out / "report.html").write_text("my annotated copy")  # the user edited one of quantkit's files
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work, formats=["json"])), "--output", str(out)],
                    capsys)
    assert rc == 2 and "report.html" in text  # now the user's: refused without --overwrite
    rc, _ = _run(["calibrate", "-q", "--overwrite", "--recipe", str(_recipe(work, formats=["json"])), "--output",
                  str(out)], capsys)
    assert rc == 0 and (out / "report.html").read_text() == "my annotated copy"  # not stale: kept
    assert not (out / "report.md").exists()  # quantkit's own stale report is removed


def test_a_manifest_copied_from_another_machine_proves_nothing(work: Path, capsys: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    monkeypatch.setenv("QUANTKIT_CACHE", str(work / "other-cache"))  # another machine: another key
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 2 and "quantkit did not write" in text


# -- sweeps -----------------------------------------------------------------------------------------
def _sweep_recipe(work: Path) -> Path:
    rec = yaml.safe_load(_recipe(work).read_text())
    rec["name"] = "rel-sweep"
    rec["quantization"] = {"default": {"format": "int8"}}
    rec["report"] = {"latency": {"warmup": 1, "repeat": 2}, "kernel_check_samples": 2}
    rec["search"] = {"candidates": ["int8", "fp32"], "points": 2, "sensitivity": {"samples": 2}}
    path = work / "sweep.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path


@pytest.mark.slow
def test_sweep_overwrite_keeps_the_users_models_and_calibrate_refuses_them(work: Path, capsys: Any) -> None:
    ws = work / "ws"
    assert _run(["sweep", "-q", "--recipe", str(_sweep_recipe(work)), "--output", str(ws)], capsys)[0] == 0
    assert (ws / "models").is_dir() and (ws / "assignments").is_dir()
    mine = ws / "models" / "my-finetuned.onnx"
    mine.write_bytes(b"user model")
    (ws / "assignments" / "my-notes.csv").write_text("a,b\n")
    recipe = _sweep_recipe(work)
    before = tree_digest(work, skip=["cache"])
    rc, text = _run(["sweep", "-q", "--recipe", str(recipe), "--output", str(ws)], capsys)
    assert rc == 2 and "models/my-finetuned.onnx" in text
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(ws)], capsys)
    assert rc == 2 and "models/my-finetuned.onnx" in text
    assert tree_digest(work, skip=["cache"]) == before  # refused: nothing changed at all
    rc, text = _run(["sweep", "-q", "--overwrite", "--recipe", str(recipe), "--output", str(ws)], capsys)
    assert rc == 0, text
    after = tree_digest(work, skip=["cache"])
    assert after["ws/models/my-finetuned.onnx"] == before["ws/models/my-finetuned.onnx"]
    assert after["ws/assignments/my-notes.csv"] == before["ws/assignments/my-notes.csv"]
    assert unchanged_outside(before, after, allowed=["ws"]) == []


@pytest.mark.slow
def test_api_sweep_follows_the_output_rules(work: Path) -> None:
    import quantkit

    out = work / "api-ws"
    out.mkdir()
    (out / "results.xlsx").write_bytes(b"user data")
    recipe = _sweep_recipe(work)
    before = tree_digest(work, skip=["cache"])
    with pytest.raises(OutputError, match=r"quantkit did not write \(results.xlsx\)"):
        quantkit.sweep(recipe=recipe, output=out, progress=False)
    assert tree_digest(work, skip=["cache"]) == before
    with pytest.raises(RecipeError, match="overwrite must be True or False"):
        quantkit.sweep(recipe=recipe, output=out, progress=False, overwrite="yes")  # type: ignore[arg-type]
    res = quantkit.sweep(recipe=recipe, output=out, progress=False, overwrite=True)
    assert (out / "results.xlsx").read_bytes() == b"user data"
    assert all(Path(p.model_path or "").is_file() and out in Path(p.model_path or "").parents for p in res.points)
    assert all(Path(p).is_file() and out in Path(p).parents for p in res.paths.values())
    assert unchanged_outside(before, tree_digest(work, skip=["cache"]), allowed=["api-ws"]) == []


# -- inputs, names and paths ------------------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_output_folder_holding_the_input_model_is_refused(work: Path, capsys: Any, overwrite: bool) -> None:
    args = ["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(work)]
    before = tree_digest(work, skip=["cache"])
    rc, text = _run(args + (["--overwrite"] if overwrite else []), capsys)
    assert rc == 2 and "holds an input of this run" in text
    assert tree_digest(work, skip=["cache"]) == before
    assert not (work / "cache" / "stats").exists()  # refused before any work


def test_output_folder_holding_the_recipe_or_data_is_refused(work: Path, capsys: Any) -> None:
    sub = work / "proj"
    sub.mkdir()
    os.replace(work / "ev.npz", sub / "ev.npz")
    rec = yaml.safe_load(_recipe(work).read_text())
    rec["evaluation"]["data"]["path"] = str(sub / "ev.npz")
    (sub / "r.yaml").write_text(yaml.safe_dump(rec))
    before = tree_digest(work, skip=["cache"])
    rc, text = _run(["calibrate", "-q", "--overwrite", "--recipe", str(sub / "r.yaml"), "--output", str(sub)], capsys)
    assert rc == 2 and "holds an input of this run" in text
    assert tree_digest(work, skip=["cache"]) == before


def test_an_ambiguous_relative_path_names_both_files(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proj, cwd = work / "proj", work / "cwd"
    proj.mkdir()
    cwd.mkdir()
    onnx.save(tiny_cnn(seed=1), proj / "model.onnx")
    onnx.save(tiny_cnn(seed=2), cwd / "model.onnx")
    (proj / "r.yaml").write_text(yaml.safe_dump({"version": 1, "model": {"source": "model.onnx"}}))
    monkeypatch.chdir(cwd)
    with pytest.raises(RecipeError, match="ambiguous") as exc:
        load_recipe(proj / "r.yaml")
    assert str(proj / "model.onnx") in str(exc.value) and str(cwd / "model.onnx") in str(exc.value)
    os.remove(cwd / "model.onnx")  # only beside the recipe: that one
    assert load_recipe(proj / "r.yaml").model.source == str(proj / "model.onnx")  # type: ignore[union-attr]
    (proj / "r.yaml").write_text(yaml.safe_dump({"version": 1, "model": {"source": "other.onnx"}}))
    onnx.save(tiny_cnn(seed=2), cwd / "other.onnx")  # only in the working directory: that one
    assert load_recipe(proj / "r.yaml").model.source == "other.onnx"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", ".hidden", "..", "a\\b"])
def test_a_recipe_name_is_a_plain_name(work: Path, capsys: Any, name: str) -> None:
    rec = yaml.safe_load(_recipe(work).read_text())
    rec["name"] = name
    (work / "r.yaml").write_text(yaml.safe_dump(rec))
    before = tree_digest(work.parent, skip=[f"{work.name}/cache"])
    rc, text = _run(["calibrate", "-q", "--recipe", str(work / "r.yaml")], capsys)
    assert rc == 2 and "name" in text and "letters, digits" in text
    assert tree_digest(work.parent, skip=[f"{work.name}/cache"]) == before


def test_a_dangling_symlink_output_is_refused_before_the_work(work: Path, capsys: Any) -> None:
    link = work / "o"
    link.symlink_to(work / "nowhere")
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(link)], capsys)
    assert rc == 2 and "symbolic link" in text and "does not exist" in text
    assert not (work / "cache" / "stats").exists() and not (work / "nowhere").exists()


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(work: Path, capsys: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import quantkit.run as run_mod

    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_mod, "save_model", full)
    out, recipe = work / "o", _recipe(work)
    before = tree_digest(work, skip=["cache"])
    rc, text = _run(["calibrate", "-q", "--recipe", str(recipe), "--output", str(out)], capsys)
    assert rc == 2 and "no space left on the device" in text and "nothing was written" in text
    assert tree_digest(work, skip=["cache"]) == before  # no half-written folder, no staging left


def test_a_file_or_link_in_the_way_is_refused_before_anything_moves(work: Path, capsys: Any) -> None:
    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    os.remove(out / "report.md")
    (out / "report.md").mkdir()  # a folder where quantkit writes a file
    (out / "report.md" / "draft.txt").write_text("mine")
    before = tree_digest(work, skip=["cache"])
    rc, text = _run(["calibrate", "-q", "--overwrite", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 2 and "is a folder where quantkit writes the file report.md" in text
    assert tree_digest(work, skip=["cache"]) == before


# -- stale staging folders --------------------------------------------------------------------------
def test_staging_folders_of_dead_runs_are_removed_and_live_ones_kept(work: Path, capsys: Any) -> None:
    from quantkit.tempdirs import owned_tempdir

    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from quantkit.tempdirs import owned_tempdir; "
            "print(owned_tempdir(sys.argv[2], '.quantkit-stage-'))")
    dead = Path(subprocess.run([sys.executable, "-c", code, str(Path.cwd()), str(out)], check=True,
                               capture_output=True, text=True).stdout.strip())
    (dead / "model.onnx").write_bytes(b"half")
    live = owned_tempdir(out, ".quantkit-stage-")  # this process: alive
    foreign = out.parent / ".quantkit-stage-users-own"  # no marker: not provably quantkit's
    foreign.mkdir()
    (foreign / "x").write_text("mine")
    rc, text = _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)
    assert rc == 0, text
    assert not dead.exists() and live.is_dir() and (foreign / "x").read_text() == "mine"


# -- the property: a run removes nothing it did not write -------------------------------------------
_names = st.sampled_from(["a", "b", "model.onnx", "report.json", "models", "sub", "..", ".", "", "/", "x/../y",
                          "models/p.onnx", "sub/a", "VICTIM", "/etc", "quantkit-manifest.json"])
_tree = st.dictionaries(st.sampled_from(["a", "b", "model.onnx", "report.json", "models/p.onnx", "models/mine",
                                         "sub/a", "sub/deep/c", "notes"]), st.binary(max_size=8), max_size=6)


def _fill_with(files: dict[str, bytes]) -> Any:
    def fill(stage: Path) -> None:
        for rel, data in files.items():
            (stage / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage / rel).write_bytes(data)
    return fill


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pre=_tree, manifest=st.one_of(
    st.none(), st.text(max_size=20),
    st.dictionaries(_names, st.one_of(st.none(), st.integers(), st.text(max_size=4),
                                      st.fixed_dictionaries({"size": st.integers(0, 8),
                                                             "sha256": st.sampled_from(["0" * 64, "x"])})),
                    max_size=6),
    st.lists(_names, max_size=6)),
    outputs=st.dictionaries(st.sampled_from(["model.onnx", "report.json", "models/p.onnx", "assignments/q.csv"]),
                            st.binary(max_size=4), min_size=1, max_size=4),
    overwrite=st.booleans(), sign=st.booleans())
def test_property_nothing_foreign_is_removed(tmp_path_factory: pytest.TempPathFactory, pre: dict[str, bytes],
                                             manifest: Any, outputs: dict[str, bytes], overwrite: bool,
                                             sign: bool) -> None:
    root = tmp_path_factory.mktemp("prop")
    saved = os.environ.get("QUANTKIT_CACHE")
    os.environ["QUANTKIT_CACHE"] = str(root / "cache")
    try:
        _check_property(root, pre, manifest, outputs, overwrite, sign)
    finally:
        if saved is None:
            os.environ.pop("QUANTKIT_CACHE", None)
        else:
            os.environ["QUANTKIT_CACHE"] = saved


def _check_property(root: Path, pre: dict[str, bytes], manifest: Any, outputs: dict[str, bytes], overwrite: bool,
                    sign: bool) -> None:
    victim = root / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"p")
    out = root / "out"
    out.mkdir()
    for rel, data in pre.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        if not (out / rel).is_dir():
            (out / rel).write_bytes(data)
    if manifest is not None:
        text = json.dumps(manifest).replace("VICTIM", str(victim))
        body: Any = {"version": 2, "files": json.loads(text)} if isinstance(manifest, dict) else json.loads(text)
        if sign and isinstance(body, dict) and isinstance(body.get("files"), dict):
            from quantkit.report.output import _mac  # a correctly signed but arbitrary manifest too

            body["mac"] = _mac({"files": body["files"]})
        (out / MANIFEST).write_text(json.dumps(body))
    before = tree_digest(root, skip=["cache", f"out/{MANIFEST}"])
    try:
        write_outputs(out, _fill_with(outputs), overwrite=overwrite)
        wrote = set(outputs)
    except OutputError:
        wrote = set()
    after = tree_digest(root, skip=["cache", f"out/{MANIFEST}"])
    for rel, digest in before.items():
        if digest == "dir" or rel.startswith("out/.quantkit-stage-"):
            continue
        if rel.startswith("out/") and rel[4:] in wrote:
            continue  # replaced by a new output of the same name: only with overwrite or if provably ours
        assert after.get(rel) == digest, rel
    assert (victim / "precious").read_bytes() == b"p"
    if wrote:
        assert all((out / r).read_bytes() == d for r, d in outputs.items())


def test_unsigned_manifest_of_an_interrupted_save_stays_usable(work: Path, capsys: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupt between two moves leaves a manifest that proves both the old and the new files."""
    import quantkit.report.output as output_mod

    out = work / "o"
    assert _run(["calibrate", "-q", "--recipe", str(_recipe(work)), "--output", str(out)], capsys)[0] == 0
    real, calls = output_mod._move, {"n": 0}

    def flaky(a: Any, b: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(output_mod, "_move", flaky)
    rec2 = _recipe(work, formats=["json", "md"])
    (work / "cal.npz").write_bytes((work / "cal.npz").read_bytes())  # same data
    assert _run(["calibrate", "-q", "--recipe", str(rec2), "--output", str(out)], capsys)[0] == 130
    monkeypatch.setattr(output_mod, "_move", real)
    rc, text = _run(["calibrate", "-q", "--recipe", str(rec2), "--output", str(out)], capsys)
    assert rc == 0, text  # no --overwrite needed: every file there is provably quantkit's
    assert {p.name for p in out.iterdir()} == {"model.onnx", "report.json", "report.md", MANIFEST}
