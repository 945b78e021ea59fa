"""Load and validate recipes (YAML file, mapping or object) into the frozen :class:`RecipeModel`."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from quantkit.errors import QuantkitError, RecipeError
from quantkit.recipe.schema import SCHEMA_VERSION, RecipeModel


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _format_errors(exc: ValidationError, where: str) -> str:
    from quantkit.recipe.reference import reference_link

    lines = [f"invalid recipe {where}:"]
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        key = _fmt_loc(loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _lookup_fields(loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), parent, n=1) if loc else []
            if close:
                msg += f" (did you mean {close[0]!r}?)"
            if parent:
                msg += f"; allowed keys here: {', '.join(parent)}"
        value = err.get("input")
        shown = "" if err["type"] == "missing" else f" (got {value!r})"
        if len(shown) > 120:
            shown = shown[:117] + "...)"
        lines.append(f"  - {key}: {msg}{shown}; see {reference_link(loc)}")
    return "\n".join(lines)


def _lookup_fields(loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed at ``loc`` of the schema (best effort, for error messages)."""
    model: Any = RecipeModel
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        nxt = None
        for c in candidates:
            inner = [c, *getattr(c, "__args__", ())]
            for i in inner:
                if isinstance(i, type) and hasattr(i, "model_fields"):
                    nxt = i
                    break
            if nxt:
                break
        if nxt is None:
            return []
        model = nxt
    return sorted(getattr(model, "model_fields", {}))


MAX_RECIPE_BYTES = 1 << 20
MAX_ALIASES = 64
MAX_DEPTH = 64


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with bounded aliases and nesting: a "billion laughs" document or one nested
    thousands deep is refused at once instead of exhausting memory, time or the stack."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A key given twice in one mapping is an error (PyYAML keeps the last one silently: a second
        ``format:`` would quietly win over the first)."""
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in getattr(node, "value", ()):
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                k = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if k in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} appears twice in one mapping (lines {seen[k]} and "
                        f"{line}); allowed: each key once", key_node.start_mark)
                seen[k] = line
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} aliases (*ref): refused (alias expansion bomb?)")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep: refused")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def safe_load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` with a size limit, bounded aliases and nesting; errors become :class:`RecipeError`."""
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {where} is {len(text)} characters; allowed: at most {MAX_RECIPE_BYTES}")
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {where} is not valid YAML: {exc}") from None
    except RecursionError:
        raise RecipeError(f"recipe {where} is nested too deeply; allowed: at most {MAX_DEPTH} levels") from None


def load_recipe(recipe: str | os.PathLike[str] | Mapping[str, Any] | RecipeModel) -> RecipeModel:
    """Return a validated, immutable recipe.

    ``recipe`` is a path to a YAML file, a mapping with the same structure, or an
    already-built :class:`RecipeModel`.  Relative paths inside a file recipe
    (model source, data paths) are resolved against the recipe file's folder when
    they exist there.
    """
    if isinstance(recipe, RecipeModel):
        return recipe
    where = "(mapping)"
    base: Path | None = None
    if isinstance(recipe, (str, os.PathLike)):
        path = Path(recipe)
        if not path.is_file():
            raise RecipeError(f"recipe file {str(path)!r} does not exist")
        where = str(path)
        base = path.resolve().parent
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(f"recipe {where} cannot be read as UTF-8 text: {exc}") from None
        data = safe_load_yaml(text, where)
    elif isinstance(recipe, Mapping):
        data = dict(recipe)
    else:
        raise RecipeError(
            f"a recipe must be a YAML path, a mapping or a RecipeModel; got {type(recipe).__name__}"
        )
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {where} must be a mapping at the top level, got {type(data).__name__}")
    if "version" not in data:
        raise RecipeError(f"recipe {where}: missing key 'version' (the current schema version is {SCHEMA_VERSION})")
    if data["version"] != SCHEMA_VERSION:
        raise RecipeError(
            f"recipe {where}: version {data['version']!r} is not supported; allowed: {SCHEMA_VERSION}"
        )
    if base is not None:
        data = _resolve_paths(data, base, where)
    try:
        model = RecipeModel.model_validate(data)
        if base is not None:
            model._origin = str(Path(where).resolve())
    except ValidationError as exc:
        raise RecipeError(_format_errors(exc, where)) from None
    except RecursionError:
        raise RecipeError(f"recipe {where} is nested too deeply; allowed: at most {MAX_DEPTH} levels") from None
    _check_registry_names(model, where)
    return model


def _resolve_one(p: Any, base: Path, key: str, where: str) -> Any:
    """The one rule for every path in a recipe file: a relative path is looked up beside the recipe first,
    then in the working directory; when both hold it and they are different files, that is an error."""
    if not isinstance(p, str) or not p or os.path.isabs(p) or p.startswith("~"):
        return p
    beside, here = base / p, Path(p)
    if beside.exists():
        if here.exists() and not _same(beside, here):
            raise RecipeError(
                f"recipe {where}: {key}: {p!r} is ambiguous: it exists beside the recipe ({beside}) and in the "
                f"working directory ({here.absolute()}); write the path you mean (absolute, or relative to the "
                "recipe's folder after removing the other)"
            )
        return str(beside)
    return p


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


def _resolve_paths(data: dict[str, Any], base: Path, where: str = "") -> dict[str, Any]:
    """Resolve relative paths in the recipe (model source, data paths, text sources) by :func:`_resolve_one`."""

    def fix_data(d: Any, key: str) -> Any:
        if not isinstance(d, dict):
            return d
        d = dict(d)
        for k in ("path", "source"):
            v = d.get(k)
            if isinstance(v, list):
                d[k] = [_resolve_one(x, base, f"{key}.{k}[{i}]", where) for i, x in enumerate(v)]
            elif k in d:
                d[k] = _resolve_one(v, base, f"{key}.{k}", where)
        return d

    data = dict(data)
    if isinstance(data.get("model"), dict) and "source" in data["model"]:
        data["model"] = {**data["model"], "source": _resolve_one(data["model"]["source"], base, "model.source", where)}
    for section in ("calibration", "evaluation"):
        sec = data.get(section)
        if not isinstance(sec, dict):
            continue
        sec = dict(sec)
        if "data" in sec:
            sec["data"] = fix_data(sec["data"], f"{section}.data")
        if isinstance(sec.get("extra"), list):
            sec["extra"] = [fix_data(d, f"{section}.extra[{i}]") for i, d in enumerate(sec["extra"])]
        data[section] = sec
    return data


def recipe_inputs(rec: RecipeModel) -> list[Path]:
    """Files and folders a run of ``rec`` reads: the recipe file, the model (an ONNX file's external data
    too) and the data paths.  The output folder may never hold one of them."""
    found: list[Path] = []

    def add(v: Any) -> None:
        if isinstance(v, (str, os.PathLike)) and os.fspath(v) and os.path.lexists(os.fspath(v)):
            found.append(Path(os.fspath(v)))

    add(rec._origin)
    if rec.model is not None:
        src = Path(str(rec.model.source))
        add(str(rec.model.source))
        if src.is_file() and src.suffix == ".onnx":
            found.extend(_external_data_files(src))
    sections = [rec.calibration.data, rec.evaluation.data, *rec.evaluation.extra]
    for d in sections:
        if d is None:
            continue
        extra = d.model_extra or {}
        for k in ("path", "source"):
            v = extra.get(k)
            for x in v if isinstance(v, list) else [v]:
                add(x)
    return found


def _external_data_files(model: Path) -> list[Path]:
    """The external-data files an ONNX file names (read without loading the weights)."""
    try:
        import onnx

        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable model is reported by the loader, not here
        return []
    out: set[Path] = set()
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location" and e.value:
                out.add(model.parent / e.value)
    return sorted(out)


def _see(key: str) -> str:
    """The section of the recipe reference that documents ``key`` (``"quantization.overrides[0].calibrator"``)."""
    from quantkit.recipe.reference import key_parts, reference_link

    return reference_link(key_parts(key))


def _check_registry_names(model: RecipeModel, where: str) -> None:
    from quantkit.calibrate import CALIBRATORS

    names: list[tuple[str, str]] = [("calibration.calibrator", model.calibration.calibrator)]
    if model.quantization.default.calibrator:
        names.append(("quantization.default.calibrator", model.quantization.default.calibrator))
    for i, ov in enumerate(model.quantization.overrides):
        if ov.calibrator:
            names.append((f"quantization.overrides[{i}].calibrator", ov.calibrator))
    known = CALIBRATORS.names()
    for key, name in names:
        if name not in known:
            raise RecipeError(f"recipe {where}: {key}: unknown calibrator {name!r}; allowed: {', '.join(known)}; "
                              f"see {_see(key)}")
    from quantkit.algorithms.woq import WEIGHT_ALGORITHMS, get_weight_algorithm

    algos = [("quantization.default.algorithm", model.quantization.default.algorithm)] + [
        (f"quantization.overrides[{i}].algorithm", ov.algorithm)
        for i, ov in enumerate(model.quantization.overrides) if ov.algorithm
    ]
    for key, name in algos:
        try:
            get_weight_algorithm(name)
        except QuantkitError:
            raise RecipeError(
                f"recipe {where}: {key}: unknown weight algorithm {name!r}; allowed: {', '.join(WEIGHT_ALGORITHMS.names())}; "
                f"see {_see(key)}"
            ) from None
    schemes = [("quantization.default.activations", model.quantization.default.activations)] + [
        (f"quantization.overrides[{i}].activations", ov.activations)
        for i, ov in enumerate(model.quantization.overrides) if ov.activations is not None
    ]
    for key, act in schemes:
        if act.dtype == "uint8" and act.symmetric:
            raise RecipeError(
                f"recipe {where}: {key}: symmetric uint8 is not supported "
                "(ONNX Runtime's QDQ kernels need zero point 128 with a half-wasted grid); "
                "allowed: uint8 asymmetric, int8 symmetric or asymmetric"
            )
    _check_calibrator_options(model, where)
    _check_algorithm_options(model, where)


def _check_calibrator_options(model: RecipeModel, where: str) -> None:
    """``calibration.calibrator_options`` are the keyword options of the recipe's calibrator: construct one
    now, so a typo or a bad value fails when the recipe loads, not after the calibration pass."""
    import inspect

    from quantkit.calibrate import get_calibrator

    name, options = model.calibration.calibrator, dict(model.calibration.calibrator_options)
    cls = get_calibrator(name)
    params = inspect.signature(cls.__init__).parameters
    allowed = sorted(p for p in params if p not in ("self", "dtype", "symmetric", "axis")
                     and params[p].kind is inspect.Parameter.KEYWORD_ONLY)
    unknown = sorted(k for k in options if k not in allowed)
    if unknown:
        raise RecipeError(f"recipe {where}: calibration.calibrator_options: unknown option(s) {unknown} for calibrator "
                          f"{name!r}; allowed: {allowed or 'none'}")
    try:
        cls(**options)
    except RecipeError as exc:
        raise RecipeError(f"recipe {where}: calibration.calibrator_options ({name}): {exc}") from None
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"recipe {where}: calibration.calibrator_options ({name}): {exc}; allowed: {allowed}") from None


def _check_algorithm_options(model: RecipeModel, where: str) -> None:
    """Weight-algorithm options are the algorithm function's keyword parameters, plus the names it lists in
    its ``options`` attribute when it takes them through ``**kwargs`` (checked by name)."""
    import inspect

    from quantkit.algorithms.woq import RESERVED_OPTIONS, get_weight_algorithm

    d = model.quantization.default
    items = [("quantization.default", d.algorithm, dict(d.algorithm_options))] + [
        (f"quantization.overrides[{i}]", ov.algorithm or d.algorithm, dict(ov.algorithm_options))
        for i, ov in enumerate(model.quantization.overrides) if ov.algorithm_options is not None
    ]
    if model.search is not None:
        items += [(f"search.candidates[{i}]", cand.algorithm or d.algorithm, dict(cand.algorithm_options))
                  for i, cand in enumerate(model.search.candidate_list()) if cand.algorithm_options is not None]
    reserved = RESERVED_OPTIONS
    for key, name, options in items:
        fn = get_weight_algorithm(name)
        params = inspect.signature(fn).parameters
        allowed = sorted({p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY and p not in reserved}
                         | (set(getattr(fn, "options", ())) - reserved))  # options an algorithm takes via **kwargs
        unknown = sorted(k for k in options if k not in allowed)
        if unknown:
            raise RecipeError(f"recipe {where}: {key}.algorithm_options: unknown option(s) {unknown} for algorithm "
                              f"{name!r}; allowed: {allowed or 'none'}")
        _check_option_ranges(key, name, options, where)


#: Weight-algorithm options that count iterations, grid points or rows, and their allowed range: a typo
#: (``iters: 1000000000``) is refused when the recipe loads instead of running for days.
ALGORITHM_COUNT_RANGES: dict[str, tuple[int, int]] = {
    "iters": (0, 100_000),  # signround
    "n_grid": (1, 10_000),  # awq
    "max_rows": (1, 1 << 16),  # awq
    "clip_rows": (1, 1 << 16),  # awq
    "block_size": (1, 1 << 16),  # gptq
}


#: The type (and for numbers the range; ``open`` bounds exclude their value) or choices of each weight-algorithm
#: option a recipe may set: checked when the recipe loads, so that ``percdamp: -1`` or ``act_order: "no"`` is
#: refused before calibration instead of failing (or silently meaning True) after it.
ALGORITHM_OPTION_VALUES: dict[str, dict[str, Any]] = {
    **{k: {"type": "bool"} for k in ("narrow", "clip", "act_order", "learn_clip", "relaxed", "gptq", "signround")},
    "percdamp": {"type": "float", "lo": 0.0, "hi": 1.0},
    "lr": {"type": "float", "lo": 0.0, "lo_open": True, "hi": 1e3, "none": True},
    "min_clip": {"type": "float", "lo": 0.0, "lo_open": True, "hi": 1.0},
    "max_shrink": {"type": "float", "lo": 0.0, "hi": 1.0, "hi_open": True},
    "clip_lr_scale": {"type": "float", "lo": 0.0, "lo_open": True, "hi": 1e3},
    "init": {"type": "choice", "choices": ("gptq", "rtn")},
    "precision": {"type": "choice", "choices": ("auto", "float32", "float64")},
}


def _check_option_ranges(key: str, name: str, options: dict[str, Any], where: str) -> None:
    for opt, value in options.items():
        at = f"recipe {where}: {key}.algorithm_options.{opt} is {value!r} (algorithm {name!r})"
        bounds = ALGORITHM_COUNT_RANGES.get(opt)
        if bounds is not None:
            lo, hi = bounds
            if isinstance(value, bool) or not isinstance(value, int):
                raise RecipeError(f"{at}; allowed: an integer from {lo} to {hi}")
            if not lo <= value <= hi:
                raise RecipeError(f"{at}; allowed: {lo} to {hi}")
            continue
        spec = ALGORITHM_OPTION_VALUES.get(opt)
        if spec is None:
            continue
        if spec["type"] == "bool":
            if not isinstance(value, bool):
                raise RecipeError(f"{at}; allowed: true or false")
        elif spec["type"] == "choice":
            if value not in spec["choices"]:
                raise RecipeError(f"{at}; allowed: {', '.join(spec['choices'])}")
        elif not (value is None and spec.get("none")):
            lo, hi = spec["lo"], spec["hi"]
            ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
                  and (value > lo if spec.get("lo_open") else value >= lo)
                  and (value < hi if spec.get("hi_open") else value <= hi))
            if not ok:
                rng = f"{'(' if spec.get('lo_open') else '['}{lo}, {hi}{')' if spec.get('hi_open') else ']'}"
                raise RecipeError(f"{at}; allowed: a number in {rng}" + (" or null" if spec.get("none") else ""))
