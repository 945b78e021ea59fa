"""Load an ONNX file (with or without external data) into an ``onnx_ir.Model``."""

from __future__ import annotations

import os
from pathlib import Path

import onnx_ir as ir
import onnx_ir.external_data

from quantkit.errors import ModelError

__all__ = ["load_onnx"]


def load_onnx(path: str | os.PathLike[str], *, load_external: bool = True) -> ir.Model:
    """Load the ONNX model at ``path``.

    External data (``.onnx.data`` files next to the model) is supported.  Every external
    file referenced by an initializer is checked to exist, so that a missing one fails
    here, naming the file.  With ``load_external`` (default) the external tensors are
    read into memory, so the model is self-contained: ``ir.to_proto(model)`` can be
    serialised and handed to ONNX Runtime as bytes, and the files may be deleted.  Pass
    ``load_external=False`` for models too large to hold twice (> 2 GB), which must then
    be saved with external data before ORT can read them.

    Raises:
        ModelError: the path does not exist, is a folder, is not an ONNX model or
            references external data that is missing.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"ONNX model file {str(p)!r} does not exist")
    if p.is_dir():
        raise ModelError(f"expected an ONNX model file, got the folder {str(p)!r}")
    try:
        model = ir.load(p)
    except Exception as e:  # protobuf raises DecodeError, onnx raises its own types
        raise ModelError(f"{str(p)!r} is not a readable ONNX model: {type(e).__name__}: {e}") from e
    if len(model.graph.outputs) == 0:
        raise ModelError(f"{str(p)!r} is not a usable ONNX model: its graph has no outputs")
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and not Path(tensor.path).is_file():
            raise ModelError(
                f"ONNX model {str(p)!r}: initializer {value.name!r} refers to external data file "
                f"{str(tensor.path)!r}, which does not exist"
            )
    if load_external:
        model = onnx_ir.external_data.load_to_model(model)
    return model
