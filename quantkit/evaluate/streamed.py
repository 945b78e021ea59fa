"""The FP32 baseline of a decoder streamed block by block, in the memory of about one block.

A layer-wise run (:mod:`quantkit.llm_run`) never holds the FP32 model: its peak is one block's weights, whatever
the depth.  The FP32 figures its report compares the quantized model with (perplexity, latency) follow the same
principle when the FP32 weights are larger than that peak (``evaluation.fp32_baseline``,
:func:`quantkit.memory.choose_baseline`):

* **perplexity** (:func:`streamed_perplexity`): the evaluation windows' hidden states are kept (a file, read and
  written one window at a time); the embedding rows start them, then FP32 block 1 runs on every window, then
  block 2, ... - each block the ONNX graph the layer-wise builder runs for calibration
  (:func:`~quantkit.frontends.llm_builder.block_model`: the same fused ops as the built decoder) with the block's
  tensors read from the checkpoint - and finally the final norm, the lm_head (float32) and the next-token
  log-likelihood (:func:`~quantkit.evaluate.perplexity.next_token_nll`, as the whole decoder's perplexity
  computes it).  The result equals the whole FP32 decoder's perplexity (the same float32 operations; relative
  difference ~1e-7 on the tests' models).
* **latency** (:func:`truncated_latency`): the FP32 decoder and the quantized one, both truncated to their first
  ``k`` blocks (embedding + ``k`` blocks + final norm + lm_head), timed interleaved as the whole models would be
  (:func:`~quantkit.evaluate.decode.llm_latency`).  The FP32 one is built from the checkpoint
  (:func:`~quantkit.frontends.llm_builder.build_llm` with ``blocks=k``); the quantized one is cut from the
  emitted graph (:func:`truncate_decoder`: the final norm re-attached after block ``k - 1``, the rest pruned; it
  reads the emitted weight file, nothing is copied), so it is exactly the shipped model's first blocks, at the
  accuracy level it ships with.  ``k`` is the largest number of blocks whose two sessions fit the run's own
  estimated peak (at least 1); every ratio is labelled ``measured on k of L blocks``: the embedding and the
  lm_head weigh more in a truncated decoder than in the whole one, so the ratios are of that model.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.errors import DataError, ModelError
from quantkit.evaluate.perplexity import ppl_from_nll

log = logging.getLogger("quantkit")

__all__ = ["extra_datasets", "merge_extra", "streamed_perplexity", "truncate_decoder", "truncated_latency"]

# -------------------------------------------------------------------------------------------- perplexity


def _f32(t: Any) -> np.ndarray:
    """A checkpoint tensor (numpy, any float dtype: bf16 as ``ml_dtypes.bfloat16``) as float32."""
    return np.asarray(t, np.float32)


def _rows(table: Any, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of an embedding table as float32."""
    return np.asarray(table[ids], np.float32)


class _States:
    """Hidden states ``[1, S_j, H]`` of every window, in a file read and written one window at a time (plain file
    I/O, not a memory map: the pages are the page cache's, not this process's resident memory)."""

    def __init__(self, path: Path, lengths: list[int], hidden: int) -> None:
        self.path, self.hidden = path, hidden
        self.offsets = np.concatenate([[0], np.cumsum([4 * n * hidden for n in lengths])]).astype(np.int64)
        self.lengths = lengths
        with open(path, "wb") as fh:
            fh.truncate(int(self.offsets[-1]))

    def write(self, j: int, x: np.ndarray) -> None:
        a = np.ascontiguousarray(x, np.float32).reshape(-1)
        if a.size * 4 != self.offsets[j + 1] - self.offsets[j]:
            raise DataError(f"window {j}: hidden states of {a.size} values, expected {self.lengths[j] * self.hidden}")
        with open(self.path, "r+b") as fh:
            fh.seek(int(self.offsets[j]))
            fh.write(a.tobytes())

    def read(self, j: int) -> np.ndarray:
        with open(self.path, "rb") as fh:
            fh.seek(int(self.offsets[j]))
            a = np.fromfile(fh, np.float32, self.lengths[j] * self.hidden)
        return a.reshape(1, self.lengths[j], self.hidden)


def _windows(datasets: Mapping[str, Any]) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    for name, ds in datasets.items():
        for batch in ds.batches(1):
            if "input_ids" not in batch:
                raise DataError(f"perplexity: the data has no 'input_ids'; it provides {sorted(batch)}")
            ids = np.asarray(batch["input_ids"], np.int64)
            if ids.ndim != 2:
                raise DataError(f"perplexity: input_ids of shape {list(ids.shape)}; expected [batch, seq]")
            mask = batch.get("attention_mask")
            mask = np.ones_like(ids) if mask is None else np.asarray(mask, np.int64)
            for r in range(ids.shape[0]):
                yield name, ids[r : r + 1], mask[r : r + 1]


def _final_norm(cfg: Any, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None) -> np.ndarray:
    """The decoder's final norm (RMSNorm; LayerNorm for GPT-2) of ``x`` ``[S, H]`` in float32."""
    eps = np.float32(cfg.rms_norm_eps)
    if cfg.spec.norm == "layer":
        x = x - np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    y = (x / np.sqrt(var + eps)) * gamma
    return (y + beta if beta is not None else y).astype(np.float32)


def streamed_perplexity(folder: str | os.PathLike[str], datasets: Mapping[str, Any], *,
                        work_dir: str | os.PathLike[str], progress: bool = True, threads: int | None = None,
                        ) -> dict[str, dict[str, float | int]]:
    """The FP32 perplexity of the Hugging Face decoder ``folder`` on each of ``datasets`` (name -> dataset of
    ``input_ids`` / ``attention_mask`` windows), block by block (module docstring): memory of about one block.

    Returns ``{name: {"ppl", "nll", "tokens", "windows"}}`` as :func:`quantkit.evaluate.perplexity.perplexity`
    returns them.  ``work_dir``: where the hidden states are kept (two files of ``windows x seq x hidden`` float32;
    removed at the end).

    Raises:
        DataError: a dataset yields no ``input_ids``, or no predicted token.
        ModelError: the checkpoint cannot be read (see :func:`~quantkit.frontends.llm_builder.check_decoder_folder`).
    """
    from quantkit.evaluate.latency import make_session
    from quantkit.evaluate.perplexity import next_token_nll
    from quantkit.frontends.llm_builder import (
        HEAD_BIAS,
        _Checkpoint,
        block_model,
        block_tensor_names,
        embedded_stream,
        norm_gamma,
        norm_params,
        read_decoder_config,
        stream_extras,
    )
    from quantkit.progress import tqdm

    folder = Path(folder)
    cfg = read_decoder_config(folder)
    ckpt = _Checkpoint(folder, cfg)
    names = cfg.spec.names
    wins = list(_windows(datasets))
    if not wins:
        raise DataError("perplexity: the evaluation data is empty")
    lengths = [int(ids.shape[1]) for _, ids, _ in wins]
    if max(lengths) > cfg.context_length:
        raise DataError(f"the evaluation data: sequences of {max(lengths)} tokens do not fit the model's context of "
                        f"{cfg.context_length} positions")  # fmt: skip
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    H = cfg.hidden_size
    cur, nxt = _States(work / "hidden_a.f32", lengths, H), _States(work / "hidden_b.f32", lengths, H)
    bar = tqdm(total=cfg.num_hidden_layers + 2, desc="perplexity fp32 (streamed block by block)", unit="step",
               disable=not progress)  # fmt: skip
    try:
        # the residual stream entering block 0: the embedding rows (Gemma's scale, GPT-2's positions), as the decoder
        ((_, table),) = list(ckpt.read([f"{names.embed}.weight"]))
        extras = stream_extras(cfg, ckpt)
        for j, (_, ids, _) in enumerate(wins):
            cur.write(j, embedded_stream(cfg, _rows(table, ids[0]), extras))
        del table, extras
        bar.update(1)
        longest = max(lengths)
        for i in range(cfg.num_hidden_layers):
            w = dict(ckpt.read(block_tensor_names(cfg, i, ckpt.__contains__)))
            blob = block_model(cfg, i, w, {}, (), longest).SerializeToString()
            del w
            sess = make_session(blob, threads=threads, arena=False)
            del blob
            empty = np.zeros((1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
            for j, (_, _, mask) in enumerate(wins):
                feed = {"hidden": cur.read(j), "attention_mask": mask,
                        f"past_key_values.{i}.key": empty, f"past_key_values.{i}.value": empty}  # fmt: skip
                nxt.write(j, sess.run(["hidden_out"], feed)[0])
            del sess
            cur, nxt = nxt, cur
            bar.update(1)
        # the final norm, the lm_head (float32) and the next-token log-likelihood, window by window
        norm = dict(ckpt.read(norm_params(cfg, names.final_norm)))
        gamma = _f32(norm_gamma(cfg, norm[f"{names.final_norm}.weight"]))
        beta = _f32(norm[f"{names.final_norm}.bias"]) if f"{names.final_norm}.bias" in norm else None
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in ckpt
        ((_, head),) = list(ckpt.read([f"{names.embed}.weight" if tied else "lm_head.weight"]))
        wt = np.ascontiguousarray(_f32(head).T)  # [H, V], as the decoder's MatMul reads it
        del head
        head_bias = _f32(dict(ckpt.read([HEAD_BIAS]))[HEAD_BIAS]) if HEAD_BIAS in ckpt else None
        sums: dict[str, list[float]] = {name: [0.0, 0, 0] for name in datasets}
        for j, (name, ids, mask) in enumerate(wins):
            y = _final_norm(cfg, cur.read(j)[0], gamma, beta)
            logits = (y @ wt)[None]
            if head_bias is not None:  # Phi-2
                logits = logits + head_bias
            if cfg.logits_scaling is not None:  # Granite
                logits = (logits / np.float32(cfg.logits_scaling)).astype(np.float32)
            if cfg.logit_scale is not None:  # Cohere
                logits = (logits * np.float32(cfg.logit_scale)).astype(np.float32)
            if cfg.final_softcap is not None:
                cap = np.float32(cfg.final_softcap)
                logits = (np.tanh(logits / cap) * cap).astype(np.float32)
            s, n = next_token_nll(logits, ids, mask)
            del logits
            sums[name][0] += s
            sums[name][1] += n
            sums[name][2] += 1
        bar.update(1)
    finally:
        bar.close()
        for st in (cur, nxt):
            st.path.unlink(missing_ok=True)
    out: dict[str, dict[str, float | int]] = {}
    for name, (total, tokens, count) in sums.items():
        if tokens == 0:
            raise DataError(f"perplexity ({name}): the data has no predicted token (every window shorter than 2)")
        nll = total / tokens
        out[name] = {"ppl": ppl_from_nll(nll), "nll": nll, "tokens": int(tokens), "windows": int(count)}
    return out


# ----------------------------------------------------------------------------------------------- latency

_SKIP_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")


def _reads(node: Any) -> set[str]:
    """Every tensor name ``node`` reads, its subgraphs' (an ``If``'s branches) included."""
    out = {i for i in node.input if i}
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for n in sub.node:
                out |= _reads(n)
    return out


def truncate_decoder(path: str | os.PathLike[str], blocks: int, out_path: str | os.PathLike[str]) -> Path:
    """A decoder built by :func:`~quantkit.frontends.llm_builder.build_llm` (FP32 or quantized), cut after its first
    ``blocks`` blocks: the final norm re-attached to the residual stream entering block ``blocks`` (the two inputs
    of that block's input norm, which fuses the residual add), everything after pruned, the KV-cache inputs and
    outputs of the later blocks dropped.  ``out_path`` must be in ``path``'s folder: the graph reads the same
    external weight file (nothing is copied); the weights it no longer needs are not loaded.

    Raises:
        ModelError: the graph is not such a decoder (no final norm or block input norm of the expected form), or
            ``blocks`` is not between 1 and its number of blocks - 1.
    """
    import onnx

    from quantkit.frontends.llm_builder import block_prefix, read_decoder_config

    path, out = Path(path), Path(out_path)
    if out.parent.resolve() != path.parent.resolve():
        raise ModelError(f"{out}: a truncated decoder is written beside {path} (it reads the same weight file)")
    m = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in m.metadata_props}
    source = props.get("source")
    if source is None or not (Path(source) / "config.json").is_file():
        raise ModelError(f"{path}: no 'source' Hugging Face folder recorded: not a decoder quantkit built")
    cfg = read_decoder_config(source)
    if not 1 <= blocks < cfg.num_hidden_layers:
        raise ModelError(f"blocks {blocks}: allowed 1 to {cfg.num_hidden_layers - 1} (the decoder has "
                         f"{cfg.num_hidden_layers})")  # fmt: skip
    g = m.graph
    by_name = {n.name: n for n in g.node}
    final = by_name.get(cfg.spec.names.final_norm)
    attn_norm = cfg.spec.names.attn_norm  # None: the block adds its input without a norm (OLMo-2)
    cut = by_name.get(f"{block_prefix(cfg, blocks)}.{attn_norm}" if attn_norm else f"{block_prefix(cfg, blocks)}/input_add")
    if (final is None or cut is None or final.op_type not in _SKIP_NORMS
            or cut.op_type not in (_SKIP_NORMS if attn_norm else ("Add",))):  # fmt: skip
        raise ModelError(f"{path}: no final norm / input norm of block {blocks} fusing the residual add: not a "
                         "decoder of quantkit's builder")  # fmt: skip
    final.input[0], final.input[1] = cut.input[0], cut.input[1]
    drop_io = {f"{kind}.{i}.{kv}" for i in range(blocks, cfg.num_hidden_layers) for kv in ("key", "value")
               for kind in ("past_key_values", "present")}  # fmt: skip
    outputs = [o for o in g.output if o.name not in drop_io]
    # prune: the nodes the kept outputs need, walking back from them
    producer = {o: n for n in g.node for o in n.output if o}
    need = {o.name for o in outputs}
    keep: set[int] = set()
    stack = list(need)
    while stack:
        t = stack.pop()
        n = producer.get(t)
        if n is None or id(n) in keep:
            continue
        keep.add(id(n))
        stack.extend(_reads(n))
    nodes = [n for n in g.node if id(n) in keep]
    used = set().union(*(_reads(n) for n in nodes)) | need
    inits = [t for t in g.initializer if t.name in used]
    inputs = [i for i in g.input if i.name in used]
    del g.node[:]
    g.node.extend(nodes)
    del g.output[:]
    g.output.extend(outputs)
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.input[:]
    g.input.extend(inputs)
    g.ClearField("value_info")
    out.write_bytes(m.SerializeToString())
    return out


def truncated_latency(folder: str | os.PathLike[str], quantized: str | os.PathLike[str], blocks: int,
                      settings: Any, *, work_dir: str | os.PathLike[str], progress: bool = True,
                      ) -> dict[str, dict[str, Any]]:
    """Prefill and decode latency, FP32 against quantized, on both decoders truncated to their first ``blocks``
    blocks (module docstring); :func:`~quantkit.evaluate.decode.llm_latency`'s rows, each labelled ``measured on k
    of L blocks`` (``scope``) with ``blocks`` ``{"measured": k, "of": L}``.  ``work_dir``: where the truncated FP32
    decoder is built (removed at the end); the quantized one is written beside ``quantized`` and removed."""
    from quantkit.evaluate.decode import llm_latency
    from quantkit.frontends.llm_builder import build_llm, read_decoder_config
    from quantkit.progress import stage

    folder = Path(folder)
    L = read_decoder_config(folder).num_hidden_layers
    k = max(1, min(int(blocks), L))
    q = Path(quantized)
    work = Path(work_dir)
    q_cut = q.with_name(f"{q.stem}.first-{k}-blocks.onnx")
    try:
        with stage(f"build the FP32 decoder truncated to {k} of {L} blocks", enabled=progress):
            fp32 = build_llm(folder, work / "fp32" / "model.onnx", genai_config=False, blocks=k if k < L else None)
        q_model = truncate_decoder(q, k, q_cut) if k < L else q
        with stage(f"measure latency on {k} of {L} blocks (FP32 vs quantized, interleaved)", enabled=progress):
            rows = llm_latency(str(fp32), str(q_model), settings)
    finally:
        q_cut.unlink(missing_ok=True)
        shutil.rmtree(work / "fp32", ignore_errors=True)
    scope = f"measured on {k} of {L} blocks"
    for row in rows.values():
        row["label"] = (f"{row['label']} - {scope} (embedding + {k} block{'s' if k != 1 else ''} + final norm + "
                        "lm_head, FP32 and quantized)")
        row["scope"] = scope
        row["blocks"] = {"measured": k, "of": L}
    return rows


def merge_extra(extra: dict[str, dict[str, Any]], fp32: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``evaluation.extra`` rows of the quantized model (:func:`quantkit.pipeline.extra_perplexities`) with the
    streamed FP32 perplexity of each text (by label) and the increase."""
    for label, row in extra.items():
        f = fp32.get(label)
        if f is not None:
            row["fp32"] = dict(f)
            if "quantized" in row:
                row["increase"] = row["quantized"]["ppl"] / f["ppl"] - 1.0
    return extra


def extra_datasets(rec: Any, tokenizer: Any, inputs: list[Any]) -> dict[str, Any]:
    """The ``evaluation.extra`` texts as datasets, by the label :func:`quantkit.pipeline.extra_perplexities` gives
    them."""
    from quantkit.data import make_dataset

    out = {}
    for spec in rec.evaluation.extra:
        d = spec.model_dump()
        out[str(d.get("source") or d.get("path") or d.get("kind"))] = make_dataset(d, inputs=inputs,
                                                                                   tokenizer=tokenizer,
                                                                                   split="evaluation")  # fmt: skip
    return out
