"""Perplexity of a causal LM ONNX graph, run by ONNX Runtime.

For each sample (token ids ``x_0 .. x_{T-1}``, mask ``m``) the graph's ``logits``
``z_t`` (float32, ``[batch, seq, vocab]``) give the next-token negative log-likelihood

    nll_t = logsumexp(z_t) - z_t[x_{t+1}],      t = 0 .. T-2,

computed in float64.  A position counts when both ``m_t`` and ``m_{t+1}`` are 1 (padding is
ignored).  Over all counted positions of all samples

    nll = sum nll_t / N,     ppl = exp(nll).

This is what ``transformers`` reports as ``loss`` (labels = input ids, shifted inside the
model).  Windows are independent: the first token of a window is context only.  Logits are
consumed one batch at a time and converted to float64 in row chunks, so memory stays at one
batch's logits (``batch x seq x vocab x 4`` bytes, 100 MB for 512 x 49152).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from quantkit.errors import DataError, ModelError
from quantkit.frontends.kv_cache import match_cache_feed

__all__ = ["next_token_nll", "perplexity", "ppl_from_nll"]

_ROW_CHUNK = 64


def next_token_nll(
    logits: np.ndarray, input_ids: np.ndarray, mask: np.ndarray | None = None
) -> tuple[float, int]:
    """Sum of next-token NLL (float64) and number of counted positions for one batch.

    Args:
        logits: ``[batch, seq, vocab]``.
        input_ids: ``[batch, seq]``.
        mask: ``[batch, seq]`` attention mask (1 = real token), default all ones.
    """
    if logits.ndim != 3 or input_ids.shape != logits.shape[:2]:
        raise DataError(
            f"logits {list(logits.shape)} do not match input_ids {list(input_ids.shape)}; "
            "expected logits [batch, seq, vocab] for a causal LM"
        )
    b, t, _ = logits.shape
    m = np.ones((b, t), bool) if mask is None else np.asarray(mask) != 0
    valid = m[:, :-1] & m[:, 1:]
    total = 0.0
    for row in range(b):
        targets = input_ids[row, 1:]
        for start in range(0, t - 1, _ROW_CHUNK):
            stop = min(start + _ROW_CHUNK, t - 1)
            keep = valid[row, start:stop]
            if not keep.any():
                continue
            z = logits[row, start:stop].astype(np.float64)
            zmax = z.max(axis=-1, keepdims=True)
            lse = np.log(np.exp(z - zmax).sum(axis=-1)) + zmax[:, 0]
            picked = z[np.arange(stop - start), targets[start:stop]]
            total += float((lse - picked)[keep].sum())
    return total, int(valid.sum())


def _session(model: Any, threads: int | None) -> Any:
    from quantkit.evaluate.latency import make_session

    if isinstance(model, (bytes, str, os.PathLike)):
        source: bytes | str = model if isinstance(model, bytes) else os.fspath(model)
    else:
        import onnx_ir as ir

        if not isinstance(model, ir.Model):
            raise ModelError(
                f"perplexity needs ONNX bytes, a path or an onnx_ir.Model; got {type(model).__name__}"
            )
        source = ir.to_proto(model).SerializeToString()
    try:
        return make_session(source, threads=threads, arena=False)
    except Exception as e:
        raise ModelError(f"ONNX Runtime cannot load the model: {type(e).__name__}: {e}") from e


def perplexity(
    model: bytes | str | os.PathLike[str] | Any,
    dataset: Any,
    *,
    batch_size: int = 1,
    threads: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    per_batch: bool = False,
) -> dict[str, Any]:
    """Perplexity of ``model`` on ``dataset`` (see the module docstring for the math).

    Args:
        model: ONNX bytes, a path to an ONNX file, or an ``onnx_ir.Model``; its output
            ``logits`` (or its first output) must be ``[batch, seq, vocab]``.
        dataset: yields feed dicts with ``input_ids`` (and usually ``attention_mask``)
            via ``batches(batch_size)``, e.g. a ``TextDataset`` in ``"windows"`` mode.
            Only the inputs the model takes are fed.
        batch_size: samples per ONNX Runtime call.
        threads: intra-op threads (default: ONNX Runtime's choice).
        progress: called as ``progress(samples_done, samples_total)`` after each batch.
        per_batch: also return each batch's ``[nll_sum, tokens]``.

    Returns:
        ``{"ppl", "nll", "tokens", "windows"}``: perplexity, mean NLL (nats), number of predicted tokens,
        number of samples; with ``per_batch``, also ``"per_batch"``: ``[nll_sum, tokens]`` of each batch in order
        (for paired comparisons of models on the same windows, e.g. a bootstrap over windows).

    Raises:
        ModelError: the model does not load or has no logits output.
        DataError: a batch lacks ``input_ids`` or a model input, or the data is empty.
    """
    sess = _session(model, threads)
    outputs = [o.name for o in sess.get_outputs()]
    out_name = "logits" if "logits" in outputs else outputs[0]
    wanted = [i.name for i in sess.get_inputs()]
    total_samples = len(dataset)
    nll_sum, tokens, samples = 0.0, 0, 0
    batches: list[list[float]] = []
    for batch in dataset.batches(batch_size):
        if "input_ids" not in batch:
            raise DataError(f"perplexity: the data has no 'input_ids'; it provides {sorted(batch)}")
        missing = [n for n in wanted if n not in batch]
        if missing:
            raise DataError(
                f"perplexity: model input(s) {missing} are not in the data (it provides {sorted(batch)})"
            )
        ids = np.asarray(batch["input_ids"])
        # a decoder's empty past in the session's cache type (the data may be bound to a float32-cache model)
        (logits,) = sess.run([out_name], match_cache_feed(sess, {n: batch[n] for n in wanted}))
        s, n = next_token_nll(logits, ids, batch.get("attention_mask"))
        del logits
        nll_sum += s
        tokens += n
        samples += ids.shape[0]
        batches.append([float(s), int(n)])
        if progress is not None:
            progress(samples, total_samples)
    if tokens == 0:
        raise DataError("perplexity: the data has no predicted token (empty, or every sample shorter than 2)")
    nll = nll_sum / tokens
    out: dict[str, Any] = {"ppl": ppl_from_nll(nll), "nll": nll, "tokens": tokens, "windows": samples}
    if per_batch:
        out["per_batch"] = batches
    return out


def ppl_from_nll(nll: float) -> float:
    """``exp(nll)``; ``inf`` where that overflows a float (a model whose logits blew up: a mean NLL above ~709
    nats), so a broken quantized model is reported with an infinite perplexity instead of failing the run."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf
