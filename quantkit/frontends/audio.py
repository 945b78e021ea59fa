"""Hugging Face audio folders: exported to ONNX with the folder's own feature extractor.

A folder is an audio model when its ``config.json`` names a speech-recognition (CTC), audio-classification or
frame-classification architecture (:data:`AUDIO_HEADS`), or - a bare encoder (``Wav2Vec2Model``, ``HubertModel``,
``WavLMModel``, ``ASTModel``) - when it ships an audio feature extractor (``preprocessor_config.json`` with a
``sampling_rate``) and no tokenizer.  Encoder-decoder models (Whisper) are not exported from a folder.

The exported graph takes what the feature extractor makes - ``input_values`` (the normalised waveform) or
``input_features`` / filter banks - with a symbolic batch and, where the extractor's output length follows the
audio's, a symbolic ``time`` axis; it returns the head's ``logits`` or a bare encoder's ``last_hidden_state``.

:class:`FolderAudioProcessor` is that feature extractor (``transformers``' own NumPy code) as ``kind: audio``
datasets use it: a window of mono audio at the extractor's sampling rate in, one model input out.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import ModelError
from quantkit.frontends.vision import (
    EXPORT_OPSET,
    _archs,
    _quiet,
    export_wrapper,
    head_suffix,
    load_pretrained,
)

__all__ = ["AUDIO_HEADS", "FolderAudioProcessor", "audio_settings", "from_audio_folder", "is_audio_folder"]

log = logging.getLogger(__name__)

AUDIO_HEADS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ForCTC": ("AutoModelForCTC", ("logits",)),
    "ForAudioClassification": ("AutoModelForAudioClassification", ("logits",)),
    "ForAudioFrameClassification": ("AutoModelForAudioFrameClassification", ("logits",)),
}
"""Audio heads exported from a folder (``architectures`` suffix -> the transformers Auto class, the outputs)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
EXPORT_SECONDS = 1.0
"""The length of the example audio the graph is traced with (a ``time`` axis stays symbolic where the extractor's
output length follows the audio's)."""


def audio_head(config: Any) -> str | None:
    """The :data:`AUDIO_HEADS` suffix the folder's architecture ends with, else None."""
    return head_suffix(config, AUDIO_HEADS)


def audio_settings(folder: Path) -> dict[str, Any] | None:
    """``preprocessor_config.json`` when it describes an audio feature extractor (it has a ``sampling_rate``)."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and "sampling_rate" in d else None


def is_audio_folder(folder: Path, config: Any) -> bool:
    """Whether the folder holds an audio model quantkit exports (an :data:`AUDIO_HEADS` head, or a bare encoder:
    an audio feature extractor, no tokenizer, not an encoder-decoder nor a multi-modal model)."""
    if not isinstance(config, dict) or config.get("is_encoder_decoder"):
        return False
    if any(k in config for k in ("text_config", "vision_config", "audio_config")):
        return False
    if audio_head(config) is not None:
        return True
    if audio_settings(folder) is None or any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return False
    archs = _archs(config)
    return not archs or all(a.endswith("Model") for a in archs)


class FolderAudioProcessor:
    """The feature extractor a Hugging Face audio folder ships, as ``kind: audio`` datasets use it.

    ``sampling_rate`` (what the audio is resampled to), ``input_name`` (the model input it makes),
    ``settings()`` (for fingerprints and reports) and ``__call__(window)`` -> float32 (one sample, no batch dim).

    Raises:
        ModelError: no feature extractor can be loaded from the folder.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        try:
            from transformers import AutoFeatureExtractor

            with _quiet():
                self._fx = AutoFeatureExtractor.from_pretrained(str(self.folder), local_files_only=True)
        except Exception as e:
            raise ModelError(f"cannot load the feature extractor of {str(self.folder)!r} (preprocessor_config.json): "
                             f"{type(e).__name__}: {e}") from e
        self.sampling_rate = int(self._fx.sampling_rate)
        names = list(getattr(self._fx, "model_input_names", None) or ["input_values"])
        self.input_name = str(names[0])

    @property
    def name(self) -> str:
        """The extractor's class name (``Wav2Vec2FeatureExtractor``)."""
        return type(self._fx).__name__

    def settings(self) -> dict[str, Any]:
        """The extractor's own settings (JSON-safe) and its class."""
        raw = {k: v for k, v in self._fx.to_dict().items() if k not in ("mel_filters", "window")}
        safe = json.loads(json.dumps(raw, sort_keys=True, default=str))
        return {"processor": self.name, **safe}

    def __call__(self, window: np.ndarray) -> np.ndarray:
        """One window of mono float audio at :attr:`sampling_rate` -> the model input for it (no batch dim)."""
        with _quiet():
            out = self._fx(np.asarray(window, np.float32), sampling_rate=self.sampling_rate, return_tensors="np")
        return np.ascontiguousarray(np.asarray(out[self.input_name][0], dtype=np.float32))

    def __repr__(self) -> str:
        return f"FolderAudioProcessor({self.name}, {self.input_name} at {self.sampling_rate} Hz)"


def from_audio_folder(folder: Path, config: dict[str, Any], *, opset: int) -> tuple[ir.Model, FolderAudioProcessor]:
    """Export the audio model in ``folder`` (see the module docstring); return it with its feature extractor.

    Raises:
        ModelError: the extractor or the model cannot be loaded, or the export fails.
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ModelError(f"a Hugging Face audio folder needs torch and transformers (pip install 'quantkit[llm]', "
                         f"after torch==2.13.0): {e}") from e

    from quantkit.frontends.torch_module import from_torch

    head = audio_head(config)
    if audio_settings(folder) is None:
        raise ModelError(
            f"{str(folder)!r} holds an audio model ({', '.join(_archs(config)) or config.get('model_type')}) without "
            "its feature extractor settings (preprocessor_config.json): quantkit feeds the model audio prepared as "
            "it was trained; save its feature extractor beside the weights (AutoFeatureExtractor.from_pretrained("
            "<the original>).save_pretrained(folder)), or export it to ONNX yourself and give quantkit the .onnx file "
            "with .npz data")
    processor = FolderAudioProcessor(folder)
    auto = getattr(transformers, AUDIO_HEADS[head][0]) if head is not None else transformers.AutoModel
    hf_model = load_pretrained(auto, folder, f"an audio model ({head[3:] if head else 'encoder'})")
    rng = np.random.default_rng(0)
    rate = processor.sampling_rate

    def features(seconds: float) -> np.ndarray:
        return np.stack([processor(0.1 * rng.standard_normal(int(rate * seconds)).astype(np.float32))
                         for _ in range(2)])

    example, longer = features(EXPORT_SECONDS), features(1.5 * EXPORT_SECONDS)
    if example.ndim != longer.ndim:
        raise ModelError(f"the feature extractor of {str(folder)!r} makes inputs of varying rank")
    varying = [i for i, (a, b) in enumerate(zip(example.shape, longer.shape, strict=True)) if i > 0 and a != b]
    if len(varying) > 1:
        raise ModelError(f"the feature extractor of {str(folder)!r} makes inputs whose axes {varying} all follow the "
                         "audio's length; export the model yourself and give quantkit the .onnx file")
    outputs = AUDIO_HEADS[head][1] if head is not None else ("last_hidden_state",)
    name = processor.input_name
    log.info("exporting %s (%s) with %s %s", type(hf_model).__name__, ", ".join(outputs), name,
             [None, *("time" if i + 1 in varying else d for i, d in enumerate(example.shape[1:]))])
    model = from_torch(export_wrapper(hf_model, name, outputs), (torch.from_numpy(example),), input_names=[name],
                       output_names=list(outputs), dynamic_batch=True,
                       dynamic_dims={name: {varying[0]: "time"}} if varying else None,
                       opset=max(opset, EXPORT_OPSET))  # GELU as one op (vision.EXPORT_OPSET)
    return model, processor
