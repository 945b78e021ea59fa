"""Frontends: turn any supported model source into one ``onnx_ir.Model``.

:func:`load_model` dispatches on what it is given:

==============================  ==========  ==========================================
source                          kind        how
==============================  ==========  ==========================================
path to a file                  ``onnx``    :func:`load_onnx` (external data supported)
folder containing config.json   ``hf``      :func:`from_hf_folder` (tokenizer returned)
folder containing model.onnx    ``onnx``    :func:`load_onnx`
built-in name                   ``builtin`` :func:`load_builtin` (exported once, cached)
``onnx.ModelProto``             ``onnx``    ``ir.from_proto``
``onnx_ir.Model``               ``onnx``    used as is
``torch.nn.Module``             ``torch``   :func:`from_torch` (``example_inputs=`` required)
==============================  ==========  ==========================================
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from quantkit.errors import ModelError
from quantkit.frontends.builtin import (
    BUILTINS,
    BuiltinModel,
    builtin_info,
    builtin_names,
    builtin_tokenizer,
    load_builtin,
)
from quantkit.frontends.cache import cache_dir
from quantkit.frontends.hf_folder import from_hf_folder, load_hf_tokenizer
from quantkit.frontends.onnx_file import load_onnx
from quantkit.frontends.torch_module import DEFAULT_OPSET, from_torch

__all__ = [
    "BUILTINS",
    "DEFAULT_OPSET",
    "BuiltinModel",
    "LoadedModel",
    "builtin_info",
    "builtin_names",
    "builtin_tokenizer",
    "cache_dir",
    "from_hf_folder",
    "from_torch",
    "load_builtin",
    "load_hf_tokenizer",
    "load_model",
    "load_onnx",
]

_ALLOWED = (
    "an ONNX file path, a Hugging Face folder (with config.json), a built-in model name, "
    "an onnx.ModelProto, an onnx_ir.Model or a torch.nn.Module (with example_inputs=)"
)


@dataclass(frozen=True)
class LoadedModel:
    """A model as every later stage sees it.

    Attributes:
        model: the ONNX graph.
        source: human-readable description of where it came from.
        tokenizer: the tokenizer for text models (HF folders, text built-ins), else None.
        kind: ``"onnx"``, ``"torch"``, ``"hf"`` or ``"builtin"``.
    """

    model: ir.Model
    source: str
    tokenizer: object | None
    kind: str


def _reject_kwargs(kind: str, kw: dict[str, Any], allowed: tuple[str, ...] = ()) -> None:
    extra = sorted(set(kw) - set(allowed))
    if extra:
        raise ModelError(
            f"load_model: option(s) {extra} do not apply to a {kind} source; "
            f"allowed here: {list(allowed) or 'none'}"
        )


def _is_torch_module(obj: object) -> bool:
    # Avoid importing torch (an optional dependency) unless it is already loaded.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def load_model(source: object, **kw: Any) -> LoadedModel:
    """Load ``source`` (see the module docstring for what is accepted) as a :class:`LoadedModel`.

    Keyword options are forwarded: ``example_inputs``, ``input_names``, ``output_names``,
    ``dynamic_batch``, ``dynamic_dims``, ``opset`` for torch modules; ``task``, ``seq_len``,
    ``opset`` for HF folders; ``refresh`` for built-ins.

    Raises:
        ModelError: unsupported type, missing path, or an option that does not apply.
        UnknownNameError: a string that is neither an existing path nor a built-in name
            is reported as an unknown built-in, listing the known names.
    """
    if isinstance(source, ir.Model):
        _reject_kwargs("onnx_ir.Model", kw)
        return LoadedModel(source, "onnx_ir.Model object", None, "onnx")
    onnx_mod = sys.modules.get("onnx")
    if onnx_mod is not None and isinstance(source, onnx_mod.ModelProto):
        _reject_kwargs("onnx.ModelProto", kw)
        try:
            model = ir.from_proto(source)
        except Exception as e:
            raise ModelError(f"the onnx.ModelProto cannot be converted: {type(e).__name__}: {e}") from e
        return LoadedModel(model, "onnx.ModelProto object", None, "onnx")
    if _is_torch_module(source):
        if "example_inputs" not in kw:
            raise ModelError(
                f"load_model got a torch.nn.Module ({type(source).__name__}); pass example_inputs= "
                "(a tensor, a tuple of tensors or a dict name -> tensor) to export it"
            )
        allowed = ("example_inputs", "input_names", "output_names", "dynamic_batch", "dynamic_dims", "opset")
        _reject_kwargs("torch.nn.Module", kw, allowed)
        example = kw.pop("example_inputs")
        model = from_torch(source, example, **kw)  # type: ignore[arg-type]
        return LoadedModel(model, f"torch module {type(source).__name__}", None, "torch")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if path.is_file():
            _reject_kwargs("ONNX file", kw)
            return LoadedModel(load_onnx(path), f"ONNX file {str(path)}", None, "onnx")
        if path.is_dir():
            if (path / "config.json").is_file():
                _reject_kwargs("Hugging Face folder", kw, ("task", "seq_len", "opset"))
                model, tokenizer = from_hf_folder(path, **kw)
                return LoadedModel(model, f"Hugging Face folder {str(path)}", tokenizer, "hf")
            if (path / "model.onnx").is_file():
                _reject_kwargs("ONNX folder", kw)
                return LoadedModel(
                    load_onnx(path / "model.onnx"), f"ONNX file {str(path / 'model.onnx')}", None, "onnx"
                )
            raise ModelError(
                f"folder {str(path)!r} contains neither config.json (Hugging Face) nor model.onnx; "
                f"expected {_ALLOWED}"
            )
        name = str(source)
        if name in BUILTINS:
            _reject_kwargs("built-in model", kw, ("refresh",))
            model = load_builtin(name, **kw)
            return LoadedModel(model, f"built-in model {name}", builtin_tokenizer(name), "builtin")
        looks_like_path = os.sep in name or name.endswith(".onnx") or isinstance(source, os.PathLike)
        if looks_like_path:
            raise ModelError(f"model path {name!r} does not exist")
        raise ModelError(
            f"{name!r} is neither an existing file/folder nor a built-in model name; "
            f"built-in models: {', '.join(builtin_names())}"
        )
    raise ModelError(
        f"load_model cannot load an object of type {type(source).__module__}.{type(source).__name__}; expected {_ALLOWED}"
    )
