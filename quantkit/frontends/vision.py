"""Hugging Face vision folders: exported to ONNX with the folder's own image preprocessing.

A folder is a vision model when its ``config.json`` names an image-classification or semantic-segmentation
architecture (:data:`VISION_HEADS`), or - a bare backbone (``ViTModel``, ``ResNetModel``, ``Dinov2Model``) -
when it ships an image processor (``preprocessor_config.json`` with image settings) and no tokenizer.

The exported graph takes ``pixel_values`` ``[batch, channels, height, width]`` (the batch symbolic, the image
size the processor makes) and returns what the trained head computes (``logits``), or a backbone's
``last_hidden_state`` (and ``pooler_output`` where the model has one).

:class:`FolderImageProcessor` is the folder's preprocessing (resize, crop, rescale, normalise exactly as
``transformers``' image processor for that model does, on its PIL backend: no torchvision needed); image data
for such a model (``kind: images`` / ``sample_photos``) uses it unless the recipe names another ``preprocess``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import ModelError

__all__ = ["VISION_HEADS", "FolderImageProcessor", "from_vision_folder", "is_vision_folder", "vision_head"]

log = logging.getLogger(__name__)

VISION_HEADS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ForImageClassification": ("AutoModelForImageClassification", ("logits",)),
    "ForImageClassificationWithTeacher": ("AutoModelForImageClassification", ("logits",)),
    "ForSemanticSegmentation": ("AutoModelForSemanticSegmentation", ("logits",)),
}
"""Vision heads exported from a folder (``architectures`` suffix -> the transformers Auto class, the outputs)."""

BACKBONE_OUTPUTS = ("last_hidden_state", "pooler_output")
EXPORT_OPSET = 20
"""The least opset vision and audio folders are exported at: GELU is then one ``Gelu`` op. At opset 18 torch writes
it as ``x * 0.5 * (1 + erf(x / sqrt 2))``; after an int8 convolution (SegFormer's Mix-FFN) ONNX Runtime's QDQ
propagation gives each of its two readers of ``x`` its own DequantizeLinear, the pattern no longer fuses, and a
stray Q/DQ pair is left (measured on SegFormer-B0: 8 stray)."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "spiece.model",
                    "sentencepiece.bpe.model", "vocab.json")
# two probe images of different aspect ratios: a processor whose output size depends on the image is refused
_PROBE_SIZES = ((320, 240), (240, 320))


def _archs(config: Any) -> list[str]:
    archs = config.get("architectures") if isinstance(config, dict) else None
    return [str(a) for a in archs] if isinstance(archs, list) else []


def head_suffix(config: Any, heads: Mapping[str, Any]) -> str | None:
    """The suffix of ``heads`` (longest first) that the folder's architecture ends with, else None."""
    for a in _archs(config):
        for suffix in sorted(heads, key=len, reverse=True):
            if a.endswith(suffix):
                return suffix
    return None


def vision_head(config: Any) -> str | None:
    """The :data:`VISION_HEADS` suffix the folder's architecture ends with, else None."""
    return head_suffix(config, VISION_HEADS)


def _image_settings(folder: Path) -> dict[str, Any] | None:
    """``preprocessor_config.json`` when it describes image preprocessing (not an audio feature extractor)."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or "sampling_rate" in d:
        return None
    kind = str(d.get("image_processor_type") or d.get("feature_extractor_type") or "")
    return d if ("Image" in kind or "image_mean" in d) else None


def is_vision_folder(folder: Path, config: Any) -> bool:
    """Whether the folder holds a vision model quantkit exports (a :data:`VISION_HEADS` head, or a bare
    backbone: an image processor, no tokenizer, no text / audio / encoder-decoder parts)."""
    if not isinstance(config, dict) or config.get("is_encoder_decoder"):
        return False
    if any(k in config for k in ("text_config", "audio_config", "vision_config")):
        return False  # a multi-modal model (CLIP, LLaVA, ...): not an image model alone
    if vision_head(config) is not None:
        return True
    if _image_settings(folder) is None or any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return False
    archs = _archs(config)
    return not archs or all(a.endswith("Model") for a in archs)


def _quiet() -> contextlib.AbstractContextManager[Any]:
    """transformers' backend notes ("requires torchvision ... falling back to ...Pil") and loading bars."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    try:
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        stack.callback(hf_logging.set_verbosity, level)
    except ImportError:  # pragma: no cover - transformers always has it
        pass
    return stack


class FolderImageProcessor:
    """The image preprocessing a Hugging Face folder ships, as quantkit's image datasets use it.

    Same interface as :class:`quantkit.data.images.Preprocess`: ``output_shape`` (one sample, no batch dim),
    ``layout`` (``"NCHW"``), ``settings()`` (for fingerprints and reports) and ``__call__(image)`` -> float32.

    Raises:
        ModelError: no image processor can be loaded from the folder, or its output size depends on the image
            (quantkit batches images of one size).
    """

    layout = "NCHW"

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        try:
            from transformers import AutoImageProcessor

            with _quiet():
                try:
                    self._proc = AutoImageProcessor.from_pretrained(str(self.folder), local_files_only=True,
                                                                    backend="pil")
                except TypeError:  # transformers before the ``backend`` argument
                    self._proc = AutoImageProcessor.from_pretrained(str(self.folder), local_files_only=True,
                                                                    use_fast=False)
        except Exception as e:
            raise ModelError(f"cannot load the image processor of {str(self.folder)!r} (preprocessor_config.json): "
                             f"{type(e).__name__}: {e}") from e
        from PIL import Image

        shapes = {self(Image.new("RGB", size, (128, 96, 64))).shape for size in _PROBE_SIZES}
        if len(shapes) != 1:
            raise ModelError(
                f"the image processor of {str(self.folder)!r} ({type(self._proc).__name__}) makes inputs whose size "
                f"depends on the image ({sorted(shapes)}); quantkit batches images of one size: export the model "
                "yourself at a fixed size and give quantkit the .onnx file with .npz data")
        shape = shapes.pop()
        if len(shape) != 3:
            raise ModelError(f"the image processor of {str(self.folder)!r} makes arrays of shape {list(shape)}; "
                             "expected [channels, height, width]")
        self.output_shape: tuple[int, int, int] = (int(shape[0]), int(shape[1]), int(shape[2]))

    @property
    def name(self) -> str:
        """The processor's class name (``ViTImageProcessorPil``)."""
        return type(self._proc).__name__

    def settings(self) -> dict[str, Any]:
        """The processor's own settings (JSON-safe), its class and output shape."""
        raw = self._proc.to_dict()
        safe = json.loads(json.dumps(raw, sort_keys=True, default=str))
        return {"processor": self.name, "output_shape": list(self.output_shape), **safe}

    def __call__(self, image: Any) -> np.ndarray:
        """One PIL image -> float32 ``[C, H, W]``, as the model's processor makes it."""
        out = self._proc(images=image.convert("RGB"), return_tensors="np")["pixel_values"]
        return np.ascontiguousarray(np.asarray(out[0], dtype=np.float32))

    def __repr__(self) -> str:
        return f"FolderImageProcessor({self.name}, output {list(self.output_shape)})"


def export_wrapper(model: Any, input_name: str, outputs: tuple[str, ...]) -> Any:
    """A module whose ``forward(x)`` calls the Hugging Face ``model`` with ``x`` as ``input_name`` and returns the
    named outputs (one tensor, or a tuple)."""
    import torch

    class FolderExport(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> Any:
            out = self.model(**{input_name: x})
            got = tuple(getattr(out, n) for n in outputs)
            return got[0] if len(got) == 1 else got

    return FolderExport()


def load_pretrained(auto: Any, folder: Path, what: str) -> Any:
    """``auto.from_pretrained`` of the folder in float32 with eager attention (where the class has attention),
    in eval mode.

    Raises:
        ModelError: naming ``what`` and the folder, when it cannot be loaded.
    """
    import torch

    try:
        with _quiet():
            try:
                hf_model = auto.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32,
                                                attn_implementation="eager")
            except (ValueError, TypeError) as e:
                if "attn_implementation" not in str(e) and "eager" not in str(e):
                    raise
                hf_model = auto.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    except Exception as e:
        raise ModelError(f"cannot load {what} from {str(folder)!r}: {type(e).__name__}: {e}") from e
    return hf_model.eval()


def from_vision_folder(folder: Path, config: dict[str, Any], *, opset: int) -> tuple[ir.Model, FolderImageProcessor]:
    """Export the vision model in ``folder`` (see the module docstring); return it with its image processor.

    Raises:
        ModelError: the processor or the model cannot be loaded, or the export fails.
    """
    try:
        import torch
        import transformers
        from PIL import Image
    except ImportError as e:
        raise ModelError(f"a Hugging Face vision folder needs torch, transformers and Pillow (pip install "
                         f"'quantkit[vision]', after torch==2.13.0): {e}") from e

    from quantkit.frontends.torch_module import from_torch

    head = vision_head(config)
    if _image_settings(folder) is None:
        raise ModelError(
            f"{str(folder)!r} holds a vision model ({', '.join(_archs(config)) or config.get('model_type')}) "
            "without image preprocessing settings (preprocessor_config.json): quantkit feeds the model images "
            "prepared as it was trained; save its image processor beside the weights (AutoImageProcessor."
            "from_pretrained(<the original>).save_pretrained(folder)), or export it to ONNX yourself and give "
            "quantkit the .onnx file with .npz data")
    processor = FolderImageProcessor(folder)
    auto = getattr(transformers, VISION_HEADS[head][0]) if head is not None else transformers.AutoModel
    hf_model = load_pretrained(auto, folder, f"a vision model ({head[3:] if head else 'backbone'})")
    rng = np.random.default_rng(0)
    example = torch.from_numpy(np.stack([
        processor(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for w, h in _PROBE_SIZES]))
    if head is not None:
        outputs = VISION_HEADS[head][1]
    else:
        with torch.no_grad():
            probe = hf_model(pixel_values=example)
        outputs = tuple(n for n in BACKBONE_OUTPUTS if getattr(probe, n, None) is not None)
        if not outputs:
            raise ModelError(f"{str(folder)!r}: the backbone ({type(hf_model).__name__}) returns none of "
                             f"{list(BACKBONE_OUTPUTS)}; export it yourself and give quantkit the .onnx file")
    log.info("exporting %s (%s) with pixel_values %s", type(hf_model).__name__, ", ".join(outputs),
             [None, *processor.output_shape])
    model = from_torch(export_wrapper(hf_model, "pixel_values", outputs), (example,), input_names=["pixel_values"],
                       output_names=list(outputs), dynamic_batch=True, opset=max(opset, EXPORT_OPSET))
    return model, processor
