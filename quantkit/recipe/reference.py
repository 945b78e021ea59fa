"""The recipe reference (Markdown) and the recipe JSON Schema, generated from :mod:`quantkit.recipe.schema`.

    python -m quantkit.recipe.reference --write    # docs/recipe-reference.md and docs/recipe.schema.json
    python -m quantkit.recipe.reference --check    # exit 1 when the committed files differ from the code

Every key's type, default, allowed values and bounds come from the pydantic models.  Its description comes
from its ``Field(description=...)``; for a field without one, from :data:`DESCRIPTIONS` (keyed by the key's
path in the reference); for an override or search-candidate key without either, from the
``quantization.default`` key of the same name.  Registered names (calibrators, weight algorithms and their
options), op types and dataset keys are read from their registries.  ``tests/unit/test_docs_current.py``
fails when the committed files are not what this module generates, and when a key has no description.

``quantkit validate`` (:mod:`quantkit.recipe.load`) ends each error with :func:`reference_link`, the section
of the reference that documents the key.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from quantkit.recipe.schema import SCHEMA_VERSION, DataSection, LayerScheme, RecipeModel

__all__ = [
    "REFERENCE_DOC",
    "REGENERATE",
    "SCHEMA_FILE",
    "check",
    "json_schema",
    "reference_link",
    "render_json",
    "render_markdown",
    "sections",
    "undocumented",
    "write",
]

REFERENCE_DOC = "docs/recipe-reference.md"
SCHEMA_FILE = "docs/recipe.schema.json"
REGENERATE = "python -m quantkit.recipe.reference --write"

#: Descriptions of keys whose pydantic field has no ``description`` yet, keyed by the key's path in the
#: reference (a list's items are ``[]``).  A key that gains a ``Field(description=...)`` must leave this table
#: (the test says which), so each key has one description.
DESCRIPTIONS: dict[str, str] = {
    # top level
    "version": "The recipe schema version. Required; the current version is the only one accepted.",
    "model": "Where the model comes from. May be omitted when the Python API is handed the model.",
    "calibration": "The calibration data and how its statistics are collected.",
    "quantization": "The format and scheme of every layer: a default, overrides, and which op types are "
    "quantized.",
    "evaluation": "The held-out data and the metric the report compares FP32 and the quantized model on.",
    "export": "How the quantized model is written.",
    "report": "Which report files are written and how latency is measured.",
    "search": "Per-layer mixed-precision search (`quantkit sweep`, or the one `target` point with "
    "`quantkit calibrate`). Absent: no search.",
    "target": "The CPU the model is built for.",
    # model
    "model.source": "A built-in name, a path to an `.onnx` file, or a Hugging Face folder. A relative path is "
    "looked up beside the recipe file first, then in the working directory.",
    # calibration
    "calibration.data": "The calibration dataset. May be omitted when the Python API is handed the data.",
    "calibration.data.kind": "The kind of dataset; the keys each kind takes are listed below.",
    "calibration.batch_size": "Samples per calibration batch.",
    "calibration.calibrator": "How a tensor's range is chosen from its statistics. `auto` (the default): the "
    "ranges of each candidate calibrator (`calibrator_options.candidates`, default `[mse, minmax]`), the model "
    "lowered once per candidate and run with this CPU's fused kernels on `calibrator_options.samples` (16) "
    "calibration samples; the candidate with the highest output SQNR against FP32 is kept for every `auto` "
    "tensor and named in the report. `mse`: the range with the least expected quantize-dequantize error of the "
    "tensor itself; `entropy`: KL divergence (TensorRT's method); `percentile`; `minmax`. Third-party "
    "calibrators register under the entry-point group `quantkit.calibrators`.",
    "calibration.calibrator_options": "Keyword options of the chosen calibrator (checked by name and value "
    "when the recipe loads).",
    # quantization
    "quantization.default": "The scheme of every quantizable layer that no override matches.",
    "quantization.default.format": "The layer's format: `int8` static W8A8 QDQ; `int8_dynamic` W8A8 with "
    "activation scales computed at run time; `int4` / `int8_weight` weight-only (MatMulNBits); `fp16` / `bf16` "
    "16-bit weights; `fp32` kept in float. Formats other than `int8` apply to MatMul / Gemm layers.",
    "quantization.default.weights": "The int8 weight scheme of static / dynamic INT8 layers; for weight-only "
    "formats only `symmetric` is read.",
    "quantization.default.weights.dtype": "Integer type of the weight codes.",
    "quantization.default.weights.symmetric": "Zero point 0 (symmetric grid) or a fitted zero point.",
    "quantization.default.weights.granularity": "One scale per output channel or one per tensor.",
    "quantization.default.activations": "The activation scheme of static INT8 layers.",
    "quantization.default.activations.dtype": "Integer type of the activation codes (with "
    "`export.activation_storage: uint8`, int8 grids are stored as uint8 with the zero point shifted by 128).",
    "quantization.default.activations.symmetric": "Zero point at the middle of the grid (symmetric) or fitted "
    "to the range. Symmetric uint8 is refused.",
    "quantization.default.calibrator": "The calibrator for this layer's tensors; null: "
    "`calibration.calibrator`.",
    "quantization.default.algorithm_options": "Keyword options of the weight algorithm (checked by name and "
    "value when the recipe loads; see the table of algorithms below).",
    "quantization.op_types": "Which op types are quantized: `auto` (every op type quantkit lowers) or a list.",
    "quantization.overrides": "Per-layer exceptions to `default`, each selected by exactly one of `layer`, "
    "`pattern`, `op_type`. A layer takes the first override with its exact `layer` name, else the first "
    "matching `pattern`, else the first matching `op_type`; keys an override leaves out come from `default`.",
    "quantization.overrides[].layer": "Selects the layer with exactly this node name.",
    "quantization.overrides[].pattern": "Selects layers whose node name or PyTorch module path (recorded by "
    "the exporter) this regular expression matches (searched, with a 0.25 s limit per name).",
    "quantization.overrides[].op_type": "Selects layers of this op type (`Conv`, `MatMul`, `Gemm`, `Add` ...).",
    # evaluation
    "evaluation.data": "The evaluation dataset (held out from calibration). May be omitted with the Python "
    "API, or to skip the quality comparison.",
    "evaluation.metric": "What the report compares: `classification` (top-1 / top-5 agreement and KL on the "
    "last axis), `embedding` or `sqnr` (SQNR and cosine only), `auto` (classification for a rank-2 output "
    "with at least 10 columns).",
    "evaluation.batch_size": "Samples per evaluation batch.",
    # export
    "export.external_data": "Weights in a separate `model.onnx.data` file: `auto` when the model exceeds "
    "1.8 GB, `always`, or `never`.",
    # report
    "report.formats": "Report files to write beside the model (`report.json` is the source; Markdown and HTML "
    "render it).",
    "report.latency": "How FP32 and quantized latency are measured (interleaved, in the same run).",
    "report.latency.enabled": "Measure latency at all (`--no-latency` on the command line turns it off).",
    "report.latency.batch_size": "Batch size of the timed input.",
    "report.latency.seq_len": "Text models: tokens of the timed input (null: as the model or data says).",
    "report.latency.warmup": "Untimed runs before timing.",
    "report.latency.repeat": "Timed runs per model; the report gives the median and p90.",
    "report.latency.threads": "ONNX Runtime intra-op threads (null: ONNX Runtime's default, all cores).",
    # search
    "search.candidates": "The formats a layer may get: shorthand format names, or mappings with a `name` and "
    "options.",
    "search.candidates[].name": "How reports and budgets (`uniform:<name>`) refer to this candidate.",
    "search.candidates[].format": "The candidate's format (as `quantization.default.format`).",
    "search.candidates[].algorithm_options": "Keyword options of the candidate's weight algorithm.",
    "search.sensitivity": "How each (layer, format)'s damage is measured.",
    # target
    "target.device": "The device the model runs on (only the CPU is modelled).",
}

#: Keys of a dataset spec (``calibration.data``, ``evaluation.data``, ``evaluation.extra[]``), besides ``kind``:
#: their type and what they do.  Which kind takes which key, and the integer ranges, are read from
#: :mod:`quantkit.data.factory`.
DATA_KEYS: dict[str, tuple[str, str]] = {
    "path": ("string or list of strings", "A file or folder (`images`: a folder of photos; `audio`: a `.wav` file "
             "or a folder of them; `npz`: an `.npz` file, "
             "a folder of them, or a list of files; arrays keyed by model input name, first axis = samples)."),
    "count": ("integer", "How many samples (`sample_photos`: crops; `text`: sentences or windows)."),
    "preprocess": ("string or mapping", "Image preprocessing: `model` (the image processor of a Hugging Face "
                   "vision folder, the default for such a model; else the default is `efficientnet`), a preset name "
                   "(`efficientnet`, `imagenet`) or a mapping of resize / crop / mean / std / layout fields, "
                   "optionally starting from a `preset`."),
    "seed": ("integer", "Seed of the sample order and crops."),
    "seconds": ("number", "`audio`: window length in seconds (default 1); each window of each `.wav` file is one "
                "sample."),
    "hop": ("number", "`audio`: seconds from one window's start to the next (default: `seconds`, back to back)."),
    "sampling_rate": ("integer", "`audio`: the rate raw windows are resampled to when the model brings no feature "
                      "extractor (default 16000); a Hugging Face audio folder's extractor sets its own."),
    "input": ("string", "The model input that takes the images or the audio (needed when the model has several)."),
    "limit": ("integer", "`images`: use at most this many files; `audio`: at most this many windows."),
    "source": ("string or list of strings", "`text`: `pydoc` (Python's own documentation), `austen:<book>` "
               "(a Jane Austen novel, e.g. `austen:emma`), a `.txt` path, or a list of strings; `a+b` "
               "mixes sources (windows taken from each in turn)."),
    "mode": ("string", "`text`: `sentences` (paragraphs and lines, padded) or `windows` (the token stream cut "
             "into `seq_len` windows)."),
    "seq_len": ("integer", "`text`: tokens per sample."),
    "offset": ("integer", "`text`, `windows` mode: windows of the split to skip."),
}


# -- the walk over the models -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """One key of a recipe section as the reference shows it."""

    path: str
    name: str
    type: str
    default: str
    allowed: str
    description: str


@dataclass(frozen=True)
class Section:
    """A mapping of the recipe (one pydantic model), documented at the first path it occurs at."""

    path: str
    model: type[BaseModel]
    keys: tuple[Key, ...]
    intro: str

    @property
    def heading(self) -> str:
        return self.path or "top level"

    @property
    def anchor(self) -> str:
        return slug(self.heading)


def slug(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _union_members(ann: Any) -> list[Any]:
    if get_origin(ann) in (Union, types.UnionType):
        return [m for a in get_args(ann) for m in _union_members(a)]
    return [ann]


def _models_in(ann: Any) -> list[tuple[type[BaseModel], bool]]:
    """The pydantic models a field holds, each with whether it sits in a list."""
    out: list[tuple[type[BaseModel], bool]] = []
    for m in _union_members(ann):
        if isinstance(m, type) and issubclass(m, BaseModel):
            out.append((m, False))
        elif get_origin(m) is list:
            out += [(inner, True) for inner, _ in _models_in(get_args(m)[0])]
    return out


def _clean(doc: str | None) -> str:
    """A docstring's first paragraph as one Markdown line."""
    if not doc:
        return ""
    first = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(first.split())
    text = re.sub(r":(?:func|mod|class|data|meth|attr):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


class _Walk:
    def __init__(self) -> None:
        self.where: dict[type[BaseModel], str] = {}
        self.sections: list[Section] = []
        self.descriptions: dict[str, str] = {}

    def run(self) -> list[Section]:
        self.where[RecipeModel] = ""
        self._visit("", RecipeModel)
        return self.sections

    def _visit(self, path: str, model: type[BaseModel]) -> None:
        """Document ``model`` at ``path``, then each model first met in its fields (depth first)."""
        keys, children = [], []
        for name, field in model.model_fields.items():
            kpath = f"{path}.{name}" if path else name
            for inner, in_list in _models_in(field.annotation):
                if inner not in self.where:
                    self.where[inner] = kpath + ("[]" if in_list else "")
                    children.append(inner)
            keys.append(self._key(model, kpath, name, field))
        self.sections.append(Section(path, model, tuple(keys), _clean(model.__doc__)))
        for inner in children:
            self._visit(self.where[inner], inner)

    def _link(self, model: type[BaseModel]) -> str:
        where = self.where[model]
        return f"mapping ([{where}](#{slug(where)}))"

    def _type(self, ann: Any) -> str:
        if ann is type(None):
            return "null"
        if ann is Any:
            return "any"
        origin = get_origin(ann)
        if origin is Literal:
            values = get_args(ann)
            if all(isinstance(v, str) for v in values):
                return "string"
            if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                return "integer"
            return "value"
        if origin in (Union, types.UnionType):
            names: list[str] = []
            for m in get_args(ann):
                t = self._type(m)
                if t not in names:
                    names.append(t)
            return " or ".join(names)
        if origin is list:
            return "list of " + self._type(get_args(ann)[0])
        if origin is dict or ann is dict:
            return "mapping"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return self._link(ann)
        return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(ann, str(ann))

    def _key(self, model: type[BaseModel], path: str, name: str, field: FieldInfo) -> Key:
        description = field.description or DESCRIPTIONS.get(path, "")
        if not description and model is not LayerScheme and name in LayerScheme.model_fields:
            same = self.descriptions.get(f"{self.where[LayerScheme]}.{name}", "")
            if same:
                description = f"As `{self.where[LayerScheme]}.{name}`: {same}"
        if not description:
            nested = _models_in(field.annotation)
            description = _clean(nested[0][0].__doc__) if nested else ""
        description = " ".join(description.split())
        self.descriptions[path] = description
        return Key(path, name, self._type(field.annotation), _default(field), _allowed(path, name, field),
                   description)


def _yaml(value: Any) -> str:
    """``value`` as a recipe writes it (quoted where YAML would read it otherwise)."""
    if isinstance(value, BaseModel):
        return "(the defaults below)"
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "defaults of each key"
    return f"`{_yaml(value)}`"


def _literals(ann: Any) -> list[Any]:
    out: list[Any] = []
    for m in _union_members(ann):
        if get_origin(m) is Literal:
            out += list(get_args(m))
        elif get_origin(m) is list:
            out += _literals(get_args(m)[0])
    return out


def _bounds(field: FieldInfo) -> list[str]:
    c: dict[str, Any] = {}
    for meta in field.metadata:
        for attr in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            if getattr(meta, attr, None) is not None:
                c[attr] = getattr(meta, attr)
    out = []
    if "ge" in c and "le" in c:
        out.append(f"{c['ge']:,} to {c['le']:,}".replace(",", " "))
    else:
        if "ge" in c:
            out.append(f"at least {c['ge']}")
        if "gt" in c:
            out.append(f"greater than {c['gt']}")
        if "le" in c:
            out.append(f"at most {c['le']:,}".replace(",", " "))
        if "lt" in c:
            out.append(f"less than {c['lt']}")
    if "min_length" in c:
        out.append(f"at least {c['min_length']} {'item' if get_origin(field.annotation) is list else 'character'}"
                   f"{'s' if c['min_length'] != 1 else ''}")
    if "max_length" in c:
        out.append(f"at most {c['max_length']} items")
    if "pattern" in c:
        out.append(f"matching `{c['pattern']}`")
    return out


def _registered(kind: str) -> list[str]:
    """The built-in calibrators or weight algorithms (plug-ins installed here are left out: the reference is
    the same on every machine)."""
    if kind == "calibrator":
        from quantkit.calibrate import CALIBRATORS

        return sorted(n for n, obj in CALIBRATORS._items.items()
                      if getattr(obj, "__module__", "").startswith(("calibrators.", "quantkit.")))
    from quantkit.algorithms.woq import WEIGHT_ALGORITHMS, get_weight_algorithm

    get_weight_algorithm("rtn")  # imports the built-ins
    return sorted(n for n, obj in WEIGHT_ALGORITHMS._items.items()
                  if getattr(obj, "__module__", "").startswith("quantkit."))


def _allowed(path: str, name: str, field: FieldInfo) -> str:
    parts: list[str] = []
    literals = _literals(field.annotation)
    for key_ann in (get_args(m)[0] for m in _union_members(field.annotation) if get_origin(m) is dict):
        if get_origin(key_ann) is Literal:
            parts.append("keys " + ", ".join(f"`{_yaml(v)}`" for v in get_args(key_ann)))
    if literals:
        if bool in _union_members(field.annotation):
            literals = [True, False, *literals]
        parts.append(", ".join(f"`{_yaml(v)}`" for v in literals))
    if name in ("calibrator", "algorithm") and not literals:
        parts.append(", ".join(f"`{n}`" for n in _registered(name)))
    if path == "quantization.op_types":
        from quantkit.ops import QUANTIZABLE_OPS

        parts.append("or a list of " + ", ".join(f"`{o}`" for o in sorted(QUANTIZABLE_OPS)))
    if name == "group_size":
        parts.append("a power of two")
    parts += _bounds(field)
    nullable = type(None) in _union_members(field.annotation)
    if nullable and not field.is_required():
        parts.append("`null`")
    return "; ".join(parts)


def sections() -> list[Section]:
    """Every mapping of a recipe, in the order the reference documents them."""
    return _Walk().run()


def undocumented() -> list[str]:
    """Paths of keys without a description (the test requires none), and :data:`DESCRIPTIONS` entries that
    name no key or repeat a description the field now carries."""
    out = [f"{k.path}: no description" for s in sections() for k in s.keys if not k.description]
    fields = {k.path: s.model.model_fields[k.name] for s in sections() for k in s.keys}
    for path in DESCRIPTIONS:
        if path not in fields:
            out.append(f"DESCRIPTIONS[{path!r}]: no such key")
        elif fields[path].description:
            out.append(f"DESCRIPTIONS[{path!r}]: the field has a description now; remove this entry")
    return out


def reference_link(loc: Sequence[Any]) -> str:
    """``docs/recipe-reference.md#<section>`` for the key at ``loc`` (a pydantic error location or a dotted
    key split into parts): the section of the deepest mapping on the way that the reference documents."""
    where = {s.model: s.anchor for s in sections()}
    model: type[BaseModel] = RecipeModel
    anchor = where[RecipeModel]
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        nested = _models_in(field.annotation) if field is not None else []
        if not nested:
            break
        model = nested[0][0]
        anchor = where.get(model, anchor)
    return f"{REFERENCE_DOC}#{anchor}"


def key_parts(key: str) -> list[str | int]:
    """``"quantization.overrides[0].calibrator"`` -> ``["quantization", "overrides", 0, "calibrator"]``."""
    return [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", key)]


# -- Markdown -----------------------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def _data_tables() -> list[str]:
    from quantkit.data.factory import DATASET_KINDS, SPEC_FLOAT_RANGES, SPEC_INT_RANGES

    lines = ["Keys by `kind` (an unknown or missing key is an error when the data is built):", "",
             "| kind | required | optional |", "|---|---|---|"]
    for kind, (req, opt) in DATASET_KINDS.items():
        lines.append(f"| `{kind}` | {', '.join(f'`{k}`' for k in req) or ' '} | "
                     f"{', '.join(f'`{k}`' for k in opt) or ' '} |")
    lines += ["", "| key | type | allowed | description |", "|---|---|---|---|"]
    for key in sorted({k for req, opt in DATASET_KINDS.values() for k in (*req, *opt)}):
        typ, desc = DATA_KEYS.get(key, ("", ""))
        lo_hi = SPEC_INT_RANGES.get(key)
        allowed = ""
        if lo_hi:
            lo, hi = lo_hi
            allowed = f"at least {lo}" if hi >= 2**62 else f"{lo:,} to {hi:,}".replace(",", " ")
        if key in SPEC_FLOAT_RANGES:
            allowed = "{:g} to {:g}".format(*SPEC_FLOAT_RANGES[key])
        lines.append(f"| `{key}` | {typ} | {_cell(allowed)} | {_cell(desc)} |")
    return lines


def _registry_tables() -> list[str]:
    from quantkit.algorithms.woq import RESERVED_OPTIONS, get_weight_algorithm
    from quantkit.calibrate import get_calibrator
    from quantkit.recipe.load import ALGORITHM_COUNT_RANGES

    lines = ["## Registered names", "",
             "Built-in calibrators (`calibration.calibrator`, an override's `calibrator`) and their "
             "`calibration.calibrator_options`, read from their constructors:", "",
             "| calibrator | options | description |", "|---|---|---|"]
    for name in _registered("calibrator"):
        cls = get_calibrator(name)
        params = inspect.signature(cls.__init__).parameters
        opts = [f"`{p}`" + (f" (`{_yaml(v.default)}`)" if v.default is not inspect.Parameter.empty else "")
                for p, v in params.items()
                if p not in ("self", "dtype", "symmetric", "axis") and v.kind is inspect.Parameter.KEYWORD_ONLY]
        lines.append(f"| `{name}` | {', '.join(opts) or 'none'} | {_cell(_clean(cls.__doc__))} |")
    lines += ["", "Built-in weight algorithms (`algorithm`) and their `algorithm_options`, read from their "
              "signatures (counts are bounded: "
              + ", ".join(f"`{k}` {lo} to {hi}" for k, (lo, hi) in ALGORITHM_COUNT_RANGES.items()) + "):", "",
              "| algorithm | options | description |", "|---|---|---|"]
    reserved = RESERVED_OPTIONS
    for name in _registered("algorithm"):
        fn = get_weight_algorithm(name)
        params = inspect.signature(fn).parameters
        opts = [f"`{p}`" + (f" (`{_yaml(v.default)}`)" if v.default is not inspect.Parameter.empty else "")
                for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY and p not in reserved]
        opts += [f"`{p}`" for p in sorted(getattr(fn, "options", ())) if p not in params and p not in reserved]
        lines.append(f"| `{name}` | {', '.join(opts) or 'none'} | {_cell(_clean(fn.__doc__))} |")
    return lines


def render_markdown() -> str:
    """The recipe reference page, ``docs/recipe-reference.md``."""
    secs = sections()
    schema_rel = Path(SCHEMA_FILE).name
    out = [
        "# Recipe reference",
        "",
        f"<!-- Generated from quantkit/recipe/schema.py by `{REGENERATE}`. Do not edit by hand. -->",
        "",
        f"Every key a recipe (schema `version: {SCHEMA_VERSION}`) may hold, with its type, default, allowed values "
        "and meaning. Keys left out take their default; an unknown key, a wrong type or a value out of range is an "
        "error naming the key, the value and what is allowed, and `quantkit validate RECIPE` prints a recipe with "
        "every default filled in. How to write recipes: [recipes.md](recipes.md).",
        "",
        f"**Editors.** [`{schema_rel}`]({schema_rel}) is this schema as JSON Schema. With a YAML language "
        "server (VS Code's YAML extension, Neovim's `yamlls`, JetBrains IDEs) a recipe gets completion, hover "
        "help and validation from its first line:",
        "",
        "```yaml",
        f"# yaml-language-server: $schema=../docs/{schema_rel}",
        "version: 1",
        "```",
        "",
        f"(the path is relative to the recipe file; `recipes/*.yaml` use `../docs/{schema_rel}`).",
        "",
        "Sections: " + " · ".join(f"[{s.heading}](#{s.anchor})" for s in secs) + " · "
        "[registered names](#registered-names)",
        "",
    ]
    for s in secs:
        out += [f"## {s.heading}" if not s.path else f"## `{s.path}`", ""]
        if s.intro:
            out += [s.intro, ""]
        out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for k in s.keys:
            out.append(f"| `{k.name}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.allowed)} | "
                       f"{_cell(k.description)} |")
        out.append("")
        if s.model is DataSection:
            out += [*_data_tables(), ""]
    out += [*_registry_tables(), ""]
    return "\n".join(out)


# -- JSON Schema --------------------------------------------------------------------------------------------------


def json_schema() -> dict[str, Any]:
    """The recipe's JSON Schema (``docs/recipe.schema.json``): pydantic's, with every key's description from
    the reference and the dataset keys spelled out per ``kind``."""
    from quantkit.data.factory import DATASET_KINDS, SPEC_FLOAT_RANGES, SPEC_INT_RANGES

    schema = RecipeModel.model_json_schema(mode="validation")
    defs = schema.get("$defs", {})
    for s in sections():
        node = schema if s.model is RecipeModel else defs[s.model.__name__]
        if s.intro and "description" not in node:
            node["description"] = s.intro
        for k in s.keys:
            node["properties"][k.name].setdefault("description", k.description)
    data = defs[DataSection.__name__]
    for key in sorted({k for req, opt in DATASET_KINDS.values() for k in (*req, *opt)}):
        typ, desc = DATA_KEYS.get(key, ("", ""))
        prop: dict[str, Any] = {"description": desc}
        if typ == "number":
            prop["type"] = "number"
            if key in SPEC_FLOAT_RANGES:
                prop["minimum"], prop["maximum"] = SPEC_FLOAT_RANGES[key]
        elif typ == "integer":
            prop["type"] = "integer"
            if key in SPEC_INT_RANGES:
                prop["minimum"], hi = SPEC_INT_RANGES[key]
                if hi < 2**62:
                    prop["maximum"] = hi
        elif typ == "string":
            prop["type"] = "string"
        elif typ == "string or list of strings":
            prop["anyOf"] = [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]
        elif key == "preprocess":
            prop["anyOf"] = [{"type": "string"}, {"type": "object"}]
        data["properties"][key] = prop
    data["allOf"] = [
        {"if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
         "then": {"required": list(req), "propertyNames": {"enum": ["kind", *req, *opt]}}}
        for kind, (req, opt) in DATASET_KINDS.items()
    ]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"quantkit recipe (schema version {SCHEMA_VERSION})",
        **{k: v for k, v in schema.items() if k != "title"},
        "description": f"A quantkit recipe. Generated from quantkit/recipe/schema.py by `{REGENERATE}`; "
        f"reference: {REFERENCE_DOC}.",
    }


def render_json() -> str:
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


# -- files --------------------------------------------------------------------------------------------------------


def _outputs() -> dict[str, str]:
    return {REFERENCE_DOC: render_markdown(), SCHEMA_FILE: render_json()}


def repo_root() -> Path:
    """The checkout this module lives in (``docs/`` beside ``quantkit/``); an installed copy has none."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{root} is not a quantkit checkout (no pyproject.toml): pass --root")
    return root


def write(root: Path | None = None) -> list[Path]:
    """Write the reference and the schema under ``root`` (default: this checkout); return the paths."""
    root = root or repo_root()
    written = []
    for rel, text in _outputs().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def check(root: Path | None = None) -> list[str]:
    """The generated files under ``root`` that are missing or differ from what the code generates now."""
    root = root or repo_root()
    stale = []
    for rel, text in _outputs().items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(rel)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quantkit.recipe.reference", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help=f"write {REFERENCE_DOC} and {SCHEMA_FILE}")
    p.add_argument("--check", action="store_true", help="exit 1 when the committed files are out of date")
    p.add_argument("--root", type=Path, default=None, help="the checkout (default: the one this module is in)")
    args = p.parse_args(argv)
    if (args.write or args.check) and args.root is None:
        try:
            args.root = repo_root()
        except FileNotFoundError as exc:
            p.error(str(exc))
    if args.write:
        for path in write(args.root):
            print(f"wrote {path}")
        return 0
    if args.check:
        stale = check(args.root)
        for rel in stale:
            print(f"{rel} is out of date: run {REGENERATE}", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
