"""Load and validate recipes (YAML file, mapping or object) into the frozen :class:`RecipeModel`."""

from __future__ import annotations

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
    lines = [f"invalid recipe {where}:"]
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal["))))
        key = _fmt_loc(loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _lookup_fields(loc[:-1])
            if parent:
                msg += f"; allowed keys here: {', '.join(parent)}"
        value = err.get("input")
        shown = "" if err["type"] == "missing" else f" (got {value!r})"
        if len(shown) > 120:
            shown = shown[:117] + "...)"
        lines.append(f"  - {key}: {msg}{shown}")
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
        data = _resolve_paths(data, base)
    try:
        model = RecipeModel.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_format_errors(exc, where)) from None
    except RecursionError:
        raise RecipeError(f"recipe {where} is nested too deeply; allowed: at most {MAX_DEPTH} levels") from None
    _check_registry_names(model, where)
    return model


def _resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Make relative model/data paths relative to the recipe file when they exist there."""

    def fix(p: Any) -> Any:
        if isinstance(p, str) and not os.path.isabs(p) and (base / p).exists() and not Path(p).exists():
            return str(base / p)
        return p

    data = dict(data)
    if isinstance(data.get("model"), dict):
        data["model"] = {**data["model"], "source": fix(data["model"].get("source"))}
    for section in ("calibration", "evaluation"):
        sec = data.get(section)
        if isinstance(sec, dict) and isinstance(sec.get("data"), dict) and "path" in sec["data"]:
            data[section] = {**sec, "data": {**sec["data"], "path": fix(sec["data"]["path"])}}
    return data


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
            raise RecipeError(f"recipe {where}: {key}: unknown calibrator {name!r}; allowed: {', '.join(known)}")
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
                f"recipe {where}: {key}: unknown weight algorithm {name!r}; allowed: {', '.join(WEIGHT_ALGORITHMS.names())}"
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

    from quantkit.algorithms.woq import get_weight_algorithm

    d = model.quantization.default
    items = [("quantization.default", d.algorithm, dict(d.algorithm_options))] + [
        (f"quantization.overrides[{i}]", ov.algorithm or d.algorithm, dict(ov.algorithm_options))
        for i, ov in enumerate(model.quantization.overrides) if ov.algorithm_options is not None
    ]
    reserved = {"W", "w", "bits", "group_size", "symmetric", "stats", "hessian"}
    for key, name, options in items:
        fn = get_weight_algorithm(name)
        params = inspect.signature(fn).parameters
        allowed = sorted({p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY and p not in reserved}
                         | set(getattr(fn, "options", ())))  # options an algorithm takes through **kwargs
        unknown = sorted(k for k in options if k not in allowed)
        if unknown:
            raise RecipeError(f"recipe {where}: {key}.algorithm_options: unknown option(s) {unknown} for algorithm "
                              f"{name!r}; allowed: {allowed or 'none'}")
