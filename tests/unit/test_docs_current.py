"""The generated docs are current, the README stays a front page, and every link in the docs resolves.

* ``docs/recipe-reference.md`` and ``docs/recipe.schema.json`` are what :mod:`quantkit.recipe.reference` generates
  from the schema now (regenerate: ``python -m quantkit.recipe.reference --write``);
* ``docs/results.md`` and the README's headline table are what ``eval/render_results.py`` generates from
  ``eval/results/*.json`` (regenerate: ``python eval/render_results.py``);
* the README is at most 150 lines and starts with the two commands, the test command being the one CI runs.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from quantkit.errors import RecipeError
from quantkit.recipe import load_recipe
from quantkit.recipe import reference as ref

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
README = ROOT / "README.md"
README_MAX_LINES = 150


def _render_results() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "eval" / "render_results.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recipe_reference_and_schema_are_current() -> None:
    stale = ref.check(ROOT)
    assert not stale, (f"{', '.join(stale)} differ from the schema in quantkit/recipe/schema.py; "
                       f"regenerate them with: {ref.REGENERATE}")


def test_every_recipe_key_has_a_description() -> None:
    problems = ref.undocumented()
    assert not problems, ("give these keys a Field(description=...) in quantkit/recipe/schema.py (or fix "
                          "DESCRIPTIONS in quantkit/recipe/reference.py):\n" + "\n".join(problems))


def test_reference_lists_every_key_and_section() -> None:
    from quantkit.recipe.schema import RecipeModel

    text = ref.render_markdown()
    for section in ref.sections():
        assert f"## `{section.path}`" in text or not section.path
        for key in section.keys:
            assert f"| `{key.name}` |" in text
    assert set(RecipeModel.model_fields) == {k.name for k in ref.sections()[0].keys}


def test_json_schema_describes_every_key_and_accepts_the_shipped_recipes() -> None:
    schema = ref.json_schema()
    assert json.loads(ref.render_json()) == schema
    defs = schema["$defs"]

    def resolve(node: dict[str, Any]) -> list[dict[str, Any]]:
        if "$ref" in node:
            return [defs[node["$ref"].rsplit("/", 1)[1]]]
        return [n for alt in node.get("anyOf", []) for n in resolve(alt)] or [node]

    def walk(value: Any, node: dict[str, Any], where: str) -> None:
        for n in resolve(node):
            if isinstance(value, dict) and "properties" in n:
                for key, v in value.items():
                    assert key in n["properties"] or n.get("additionalProperties", True) is not False, \
                        f"{where}.{key} is not in the JSON Schema"
                    if key in n["properties"]:
                        assert n["properties"][key].get("description"), f"{where}.{key} has no description"
                        walk(v, n["properties"][key], f"{where}.{key}")
            elif isinstance(value, list) and "items" in n:
                for i, v in enumerate(value):
                    walk(v, n["items"], f"{where}[{i}]")

    recipes = sorted((ROOT / "recipes").glob("*.yaml"))
    assert recipes
    try:
        import jsonschema
    except ImportError:  # not a dependency: the structural walk above still runs
        jsonschema = None
    for path in recipes:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        walk(data, schema, path.name)
        if jsonschema is not None:
            jsonschema.validate(data, schema)


def test_validate_names_the_key_and_links_its_reference_section(tmp_path: Path) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text("version: 1\ncalibration: {layerwis: true}\nquantization: {overrides: [{layer: x, formt: int4}]}\n")
    with pytest.raises(RecipeError) as ei:
        load_recipe(bad)
    msg = str(ei.value)
    assert "calibration.layerwis: unknown key (did you mean 'layerwise'?)" in msg
    assert "see docs/recipe-reference.md#calibration" in msg
    assert "quantization.overrides[0].formt" in msg and "see docs/recipe-reference.md#quantizationoverrides" in msg
    anchors = _anchors(ROOT / ref.REFERENCE_DOC)
    for link in re.findall(r"docs/recipe-reference\.md#([\w-]+)", msg):
        assert link in anchors


def test_reference_link_follows_the_key_to_its_section() -> None:
    assert ref.reference_link(()) == "docs/recipe-reference.md#top-level"
    assert ref.reference_link(("evaluation", "extra", 0, "count")) == "docs/recipe-reference.md#calibrationdata"
    assert ref.reference_link(ref.key_parts("quantization.overrides[2].weights.dtype")).endswith(
        "#quantizationdefaultweights")
    assert ref.reference_link(("search", "candidates", 1, "name")).endswith("#searchcandidates")


def test_results_pages_are_current() -> None:
    stale = _render_results().stale()
    assert not stale, (f"{', '.join(stale)} differ from eval/results/*.json; regenerate them with: "
                       "python eval/render_results.py")


def test_results_pages_carry_the_provenance_of_every_file() -> None:
    rr = _render_results()
    files = rr.load_all()
    page = rr.render_page(files)
    for name, data in files.items():
        assert f"## {Path(name).stem}" in page
        prov = rr.provenance(name, data)
        assert set(prov) >= {"cpu_class", "onnxruntime", "date", "command"}
        assert all(v for v in prov.values())  # a value, or "not recorded"


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_is_a_short_front_page_starting_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    blocks = _code_blocks(text, "bash")
    main_job, tests = blocks[0].strip(), blocks[1].strip()
    assert "quantkit calibrate --recipe recipes/llama-int4.yaml" in main_job
    assert tests.endswith('python -m pytest -m "not veryslow" -n 2 --dist loadfile')
    assert text.index(blocks[1]) < text.index("## ")  # both before the first section
    # the test command installs what CI installs (.ci/run, "keep in sync")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_line = next(line for line in ci.splitlines() if line.startswith("pip install") and "torch" in line)
    ci_installs = [w for w in shlex.split(ci_line) if w != "-q"]
    readme_installs = shlex.split(tests.split(" && python -m pytest")[0].split(". .venv/bin/activate && ")[1])
    assert readme_installs == ci_installs
    # and runs pytest as CI does (CI adds only -q and no cache folder)
    ci_pytest = next(line for line in ci.splitlines() if line.startswith("python -m pytest"))
    readme_pytest = "python -m pytest" + tests.split(" && python -m pytest")[1]
    assert [w for w in shlex.split(ci_pytest) if w not in ("-q", "-p", "no:cacheprovider")] == shlex.split(readme_pytest)


def _slug(heading: str) -> str:
    return ref.slug(heading)


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    out = {_slug(m) for m in re.findall(r"^#{1,6} +(.+?)\s*$", text, flags=re.M)}
    return out | set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_link_resolves_inside_the_repository(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        assert dest.is_relative_to(ROOT), f"{doc.name}: {target} points outside the repository"
        assert "shared" not in dest.relative_to(ROOT).parts[:1], f"{doc.name}: {target} points into shared/"
        assert dest.exists(), f"{doc.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{doc.name}: {target}: no such heading in {dest.name}"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_recipes_in_the_docs_validate(doc: Path) -> None:
    for block in _code_blocks(doc.read_text(encoding="utf-8"), "yaml"):
        body = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("#"))
        data = yaml.safe_load(body)
        if isinstance(data, dict) and data.get("version") == 1 and len(data) > 1:
            load_recipe(data)
