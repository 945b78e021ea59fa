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
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise RecipeError(f"recipe {where} is not valid YAML: {exc}") from None
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
    d = model.quantization.default
    if d.activations.dtype == "uint8" and d.activations.symmetric:
        raise RecipeError(
            f"recipe {where}: quantization.default.activations: symmetric uint8 is not supported "
            "(ONNX Runtime's QDQ kernels need zero point 128 with a half-wasted grid); "
            "allowed: uint8 asymmetric, int8 symmetric or asymmetric"
        )
