"""Export a local Hugging Face model folder (optionally a sentence-transformers one) to ONNX.

Encoders (``BertModel`` ...) become a graph with inputs ``input_ids``,
``attention_mask`` (and ``token_type_ids`` when the model takes them), symbolic
``batch`` and ``seq`` dims, and output ``last_hidden_state``.  When the folder is a
sentence-transformers model (``modules.json`` with a ``Pooling`` module) the graph also
outputs ``sentence_embedding``, computed exactly as sentence-transformers does:

* mean:  ``e = sum_t m_t h_t / max(sum_t m_t, 1e-9)``  (``m`` = attention mask)
* mean_sqrt_len: ``e = sum_t m_t h_t / sqrt(max(sum_t m_t, 1e-9))``
* cls:   ``e = h_0``
* max:   ``e = max_t (h_t if m_t else -1e9)``

several enabled modes are concatenated in the order cls, max, mean, mean_sqrt_len; a
``Normalize`` module then applies ``e / max(||e||_2, 1e-12)``.

Causal LMs (``*ForCausalLM``) export ``logits`` for the whole sequence from
``input_ids`` and ``attention_mask`` (no KV cache).

Attention is exported with the ``eager`` implementation: with ``sdpa`` the graph gains
IsNaN/Where guards and extra Slice/Reshape nodes around every attention block.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx_ir as ir

from quantkit.errors import ModelError
from quantkit.frontends.checkpoint import check_config_values, checkpoint_tensors
from quantkit.frontends.families import parse_config
from quantkit.frontends.torch_module import DEFAULT_OPSET, from_torch

if TYPE_CHECKING:
    import torch

__all__ = ["HEADS", "HF_TASKS", "MAX_POSITIONS_KEY", "check_hf_folder", "detect_task", "from_hf_folder", "load_hf_tokenizer",
           "sentence_transformers_config"]

HF_TASKS = ("auto", "encoder", "causal-lm", "vision", "audio")
_POOLING_ORDER = ("cls", "max", "mean", "mean_sqrt_len")
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_EXAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Quantization maps floating point weights to small integers with a scale.",
)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {str(path)!r}: {e}") from e


def _check_folder(path: str | os.PathLike[str]) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelError(f"Hugging Face model folder {str(folder)!r} does not exist or is not a folder")
    if not (folder / "config.json").is_file():
        raise ModelError(f"{str(folder)!r} is not a Hugging Face model folder: it has no config.json")
    return folder


def detect_task(path: str | os.PathLike[str]) -> str:
    """``"causal-lm"`` if config.json's ``architectures`` name a ``*ForCausalLM`` / ``*LMHeadModel``, ``"vision"``
    for an image model (:func:`quantkit.frontends.vision.is_vision_folder`), ``"audio"`` for a speech / audio
    model (:func:`quantkit.frontends.audio.is_audio_folder`), else ``"encoder"``."""
    folder = _check_folder(path)
    where = folder / "config.json"
    config = _read_json(where)
    if not isinstance(config, dict):
        raise ModelError(f"{str(where)!r}: config.json must hold a JSON object, got {type(config).__name__}")
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    # GPT-2-style checkpoints name their causal LM class ``*LMHeadModel`` (GPT2LMHeadModel, GPTJ...)
    if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal-lm"
    from quantkit.frontends.audio import is_audio_folder
    from quantkit.frontends.vision import is_vision_folder

    if is_vision_folder(folder, config):
        return "vision"
    return "audio" if is_audio_folder(folder, config) else "encoder"


HEADS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ForSequenceClassification": ("AutoModelForSequenceClassification", ("logits",)),
    "ForTokenClassification": ("AutoModelForTokenClassification", ("logits",)),
    "ForQuestionAnswering": ("AutoModelForQuestionAnswering", ("start_logits", "end_logits")),
    "ForMaskedLM": ("AutoModelForMaskedLM", ("logits",)),
}
"""Text-encoder heads exported with the model (``config.json``'s ``architectures`` suffix -> the transformers
Auto class, the outputs): the exported graph returns what the trained head computes, not the hidden states."""


def encoder_head(config: Any) -> str | None:
    """The :data:`HEADS` suffix of the folder's architecture, None for a bare encoder (``BertModel``)."""
    archs = config.get("architectures") or [] if isinstance(config, dict) else []
    for a in archs if isinstance(archs, list) else [archs]:
        for suffix in HEADS:
            if str(a).endswith(suffix):
                return suffix
    return None


def text_model_problem(folder: Path, config: Any) -> str | None:
    """Why the folder is not a text model quantkit can export from a folder (a vision, audio, or encoder-decoder
    model, or a head it cannot feed), with what to do instead; None when it is one."""
    if not isinstance(config, dict):
        return None
    archs = [str(a) for a in (config.get("architectures") or [])] if isinstance(config.get("architectures"),
                                                                                   list) else []
    what = None
    if config.get("is_encoder_decoder"):
        what = "an encoder-decoder (seq2seq) model"
    elif any(a.endswith(("ForImageClassification", "ForObjectDetection", "ForSemanticSegmentation",
                         "ForDepthEstimation", "ForImageSegmentation", "ForMaskedImageModeling")) for a in archs):
        what = "a vision model"
    elif any(a.endswith(("ForCTC", "ForAudioClassification", "ForAudioFrameClassification", "ForXVector",
                         "ForSpeechSeq2Seq")) for a in archs):
        what = "an audio model"
    elif any(a.endswith("ForMultipleChoice") for a in archs):
        what = "a multiple-choice head (inputs [batch, choices, tokens])"
    elif "vision_config" in config or "audio_config" in config:
        what = "a multi-modal model"
    elif not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                                     "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                                                     "vocab.json")):
        what = ("a model without a tokenizer (a vision or audio model?)" if (folder / "preprocessor_config.json")
                .is_file() else "a folder without tokenizer files")
    if what is None:
        return None
    if what == "a multi-modal model":
        try:
            text = parse_config(config, str(folder / "config.json"))
        except ModelError:
            pass
        else:  # its text decoder is a family of the streaming builder
            return (f"{str(folder)!r} holds a multi-modal model ({', '.join(archs) or config.get('model_type')}); "
                    f"quantkit builds its text decoder ({text.model_type}, token ids in, logits out; the vision "
                    "tower is not part of it) layer-wise only: set calibration.layerwise: true (the default for "
                    "decoders), not the whole-graph path")  # fmt: skip
    return (f"{str(folder)!r} holds {what} ({', '.join(archs) or config.get('model_type', 'unknown type')}); from a "
            "Hugging Face folder quantkit exports text encoders (with their classification / token / question-"
            "answering / masked-LM head), decoder LLMs, vision models (image classification, semantic "
            "segmentation, bare backbones with their preprocessor_config.json) and audio encoders (CTC, audio "
            "classification, bare encoders with their feature extractor). For this model, export it to ONNX yourself (torch.onnx."
            "export, optimum-cli export onnx) and give quantkit the .onnx file with .npz data, or pass the "
            "torch.nn.Module to quantkit.quantize(module, calibration_data, recipe, example_inputs=...)")


def max_positions(config: Any, tokenizer: Any = None) -> int | None:
    """The longest token sequence a text encoder takes: the tokenizer's ``model_max_length`` when it is a real
    limit (RoBERTa: 512 of 514 position rows), else ``config.json``'s ``max_position_embeddings``; None: no limit
    (relative positions: DeBERTa, T5-style)."""
    if not isinstance(config, dict):
        return None
    limit = getattr(tokenizer, "model_max_length", None)
    cfg = config.get("max_position_embeddings")
    if config.get("position_embedding_type") not in ("absolute", None):
        cfg = None  # relative positions: no table to run past
    if isinstance(limit, int) and 0 < limit < 1_000_000:
        return min(limit, cfg) if isinstance(cfg, int) and cfg > 0 else limit
    return cfg if isinstance(cfg, int) and cfg > 0 else None


def sentence_transformers_config(path: str | os.PathLike[str]) -> tuple[tuple[str, ...], bool] | None:
    """Pooling modes and whether to L2-normalise, or None if not a sentence-transformers folder.

    Raises:
        ModelError: modules.json lists a module we cannot export (e.g. ``Dense``) or the
            pooling config enables an unsupported mode.
    """
    folder = Path(path)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        if (folder / "1_Pooling" / "config.json").is_file():
            return ("mean",), False
        return None
    modules = _read_json(modules_file)
    pooling_dir: Path | None = None
    normalize = False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind == _ST_TRANSFORMER:
            continue
        if kind == _ST_POOLING:
            pooling_dir = folder / str(m.get("path", ""))
        elif kind == _ST_NORMALIZE:
            normalize = True
        else:
            raise ModelError(
                f"{str(modules_file)!r}: sentence-transformers module {kind!r} is not supported; "
                f"supported: {_ST_TRANSFORMER}, {_ST_POOLING}, {_ST_NORMALIZE}"
            )
    if pooling_dir is None:
        return None
    cfg = _read_json(pooling_dir / "config.json")
    flags = {
        "cls": "pooling_mode_cls_token",
        "max": "pooling_mode_max_tokens",
        "mean": "pooling_mode_mean_tokens",
        "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    }
    for key in ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"):
        if cfg.get(key):
            raise ModelError(
                f"{str(pooling_dir)!r}: pooling mode {key!r} is not supported; supported: {list(flags.values())}"
            )
    modes = tuple(m for m in _POOLING_ORDER if cfg.get(flags[m]))
    if not modes:
        raise ModelError(
            f"{str(pooling_dir)!r}: no pooling mode is enabled; expected one of {list(flags.values())}"
        )
    return modes, normalize


def check_hf_folder(path: str | os.PathLike[str]) -> None:
    """Refuse, before any tokenization or allocation, a folder whose ``config.json`` holds nonsensical sizes
    (``num_attention_heads: 0``, a ``max_position_embeddings`` of 300 million, ...) or whose safetensors files
    are malformed, point outside the folder (index ``weight_map``) or hold non-float weights
    (:mod:`quantkit.frontends.checkpoint`)."""
    folder = _check_folder(path)
    cfg = _read_json(folder / "config.json")
    check_config_values(cfg, str(folder / "config.json"))
    from quantkit.frontends.families import moe_message

    moe = moe_message(cfg, str(folder / "config.json")) if isinstance(cfg, dict) else None
    if moe is not None:
        raise ModelError(moe)
    checkpoint_tensors(folder)


def load_hf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The folder's tokenizer via ``AutoTokenizer`` (local files only); in a process that isolates tokenizers
    (:func:`quantkit.frontends.tokenizer_worker.isolate`), the same tokenizer served by a worker process."""
    folder = _check_folder(path)
    from quantkit.frontends.tokenizer_worker import WorkerTokenizer, isolated

    if isolated():
        return WorkerTokenizer(str(folder))
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise ModelError(f"cannot load a tokenizer from {str(folder)!r}: {type(e).__name__}: {e}") from e


def _encoder_wrapper(model: torch.nn.Module, pooling: tuple[tuple[str, ...], bool] | None,
                     head: tuple[str, ...] = ()) -> torch.nn.Module:
    import torch

    class EncoderExport(torch.nn.Module):
        """``forward(input_ids, attention_mask[, token_type_ids])`` -> the head's outputs (``head``: their names,
        :data:`HEADS`), else the hidden state [+ the pooled embedding]."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor | None = None,
        ) -> Any:
            extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
            if head:
                got = tuple(getattr(out, n) for n in head)
                return got[0] if len(got) == 1 else got
            h = out.last_hidden_state
            if pooling is None:
                return h
            modes, normalize = pooling
            mask = attention_mask.unsqueeze(-1).to(h.dtype)
            parts = []
            for mode in modes:
                if mode == "cls":
                    parts.append(h[:, 0])
                elif mode == "max":
                    parts.append(torch.where(mask > 0, h, torch.full_like(h, -1e9)).max(dim=1).values)
                else:
                    total = (h * mask).sum(dim=1)
                    count = mask.sum(dim=1).clamp(min=1e-9)
                    parts.append(total / (count if mode == "mean" else count.sqrt()))
            e = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
            if normalize:
                e = torch.nn.functional.normalize(e, p=2.0, dim=-1)
            return h, e

    return EncoderExport()


def _causal_wrapper(model: torch.nn.Module) -> torch.nn.Module:
    import torch

    class CausalLMExport(torch.nn.Module):
        """``forward(input_ids, attention_mask)`` -> full-sequence logits, no KV cache."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    return CausalLMExport()


def from_hf_folder(
    path: str | os.PathLike[str],
    *,
    task: str = "auto",
    seq_len: int = 128,
    opset: int = DEFAULT_OPSET,
) -> tuple[ir.Model, Any]:
    """Export the model in a local Hugging Face folder; return ``(model, tokenizer)`` - for a vision model
    ``(model, image processor)`` (:mod:`quantkit.frontends.vision`), for an audio model ``(model, feature
    extractor)`` (:mod:`quantkit.frontends.audio`).

    Args:
        path: folder containing ``config.json``, weights and tokenizer (or image processor) files.
        task: ``"auto"`` (from config.json's architectures), ``"encoder"``, ``"causal-lm"``, ``"vision"`` or
            ``"audio"``.
        seq_len: sequence length of the tracing example (the exported ``seq`` dim is dynamic).
        opset: default-domain opset.

    Raises:
        ModelError: not a model folder, unknown task, unsupported sentence-transformers
            module, or the export fails.
    """
    folder = _check_folder(path)
    if task not in HF_TASKS:
        raise ModelError(f"unknown Hugging Face task {task!r}; allowed: {', '.join(HF_TASKS)}")
    if seq_len < 2:
        raise ModelError(f"seq_len must be >= 2 so that the sequence dim stays dynamic, got {seq_len}")
    if task == "auto":
        task = detect_task(folder)
    check_hf_folder(folder)
    config = _read_json(folder / "config.json")
    if task in ("vision", "audio"):
        from quantkit.frontends import audio, vision

        media = {"vision": (vision.is_vision_folder, vision.from_vision_folder, "an image-classification or semantic-"
                            "segmentation head, or a backbone with an image processor and no tokenizer"),
                 "audio": (audio.is_audio_folder, audio.from_audio_folder, "a CTC, audio- or frame-classification "
                           "head, or an encoder with an audio feature extractor and no tokenizer")}
        is_media, export, what = media[task]
        if not is_media(folder, config):
            raise ModelError(f"task {task!r}: {str(folder)!r} holds no {task} model quantkit exports ({what}); "
                             f"allowed tasks here: {', '.join(t for t in HF_TASKS if t != task)}")
        return export(folder, config, opset=opset)
    head = None
    if task != "causal-lm":
        problem = text_model_problem(folder, config)
        if problem is not None:
            raise ModelError(problem)
        pooling = sentence_transformers_config(folder)
        head = encoder_head(config) if pooling is None else None

    import torch
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    tokenizer = load_hf_tokenizer(folder)
    auto = (AutoModelForCausalLM if task == "causal-lm" else
            getattr(transformers, HEADS[head][0]) if head is not None else AutoModel)
    limit = max_positions(config, tokenizer) if task != "causal-lm" else None
    if limit is not None and seq_len > limit:
        seq_len = max(2, limit)  # the tracing example; longer data is refused before calibration
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # weight-loading progress bar
            hf_model = auto.from_pretrained(
                str(folder), local_files_only=True, dtype=torch.float32, attn_implementation="eager"
            )
    except Exception as e:
        raise ModelError(f"cannot load a {task} model from {str(folder)!r}: {type(e).__name__}: {e}") from e
    hf_model.eval()

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    enc = tokenizer(
        list(_EXAMPLE_TEXTS), padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt"
    )
    seq_dims = {"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}}
    if task == "causal-lm":
        wrapper = _causal_wrapper(hf_model)
        names = ["input_ids", "attention_mask"]
        outputs = ["logits"]
    else:
        accepted = set(_forward_names(hf_model))
        names = ["input_ids", "attention_mask"]
        if "token_type_ids" in accepted and "token_type_ids" in tokenizer.model_input_names:
            names.append("token_type_ids")
            seq_dims["token_type_ids"] = {1: "seq"}
            if "token_type_ids" not in enc:
                enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
        if head is not None:
            wrapper = _encoder_wrapper(hf_model, None, HEADS[head][1])
            outputs = list(HEADS[head][1])
        else:
            wrapper = _encoder_wrapper(hf_model, pooling)
            outputs = ["last_hidden_state"] + (["sentence_embedding"] if pooling is not None else [])
    example = [enc[n].to(torch.int64) for n in names]
    model = from_torch(
        wrapper,
        example,
        input_names=names,
        output_names=outputs,
        dynamic_batch=True,
        dynamic_dims=seq_dims,
        opset=opset,
    )
    if task == "causal-lm":  # layers named after their modules (lm_head, model.decoder.layers.0.fc1): the names
        from quantkit.frontends.llm import CausalLMNamesPass  # recipe overrides use, as on the LLaMA path

        CausalLMNamesPass()(model)
    elif limit is not None:  # read by quantkit.pipeline.check_context: longer token data is refused at once
        model.metadata_props[MAX_POSITIONS_KEY] = str(limit)
    return model, tokenizer


MAX_POSITIONS_KEY = "quantkit.max_positions"
"""Model metadata: the longest token sequence an exported text encoder takes (:func:`max_positions`)."""


def _forward_names(model: torch.nn.Module) -> list[str]:
    import inspect

    return list(inspect.signature(model.forward).parameters)
