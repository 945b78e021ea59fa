"""Fidelity metrics between a reference (FP32) output and a quantized output.

All metrics stream: :class:`FidelityAccumulator` is updated batch by batch and keeps
O(1) state per output, so evaluating on many samples does not grow memory.

* SQNR (dB) = 10 log10( sum ref^2 / sum (ref - q)^2 ), accumulated over all samples.
* cosine similarity per sample (flattened per sample), averaged.
* classification outputs (last dim = classes): top-1 agreement (argmax equal),
  top-5 agreement (FP32's top-1 class within the quantized top-5), and the mean
  KL(softmax(ref) || softmax(q)) in nats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def sqnr_db(ref: np.ndarray, approx: np.ndarray) -> float:
    """10·log10(‖ref‖² / ‖ref − approx‖²); +inf when equal."""
    ref64 = ref.astype(np.float64)
    num = float(np.sum(ref64**2))
    den = float(np.sum((ref64 - approx.astype(np.float64)) ** 2))
    if den == 0.0:
        return float("inf")
    return float(10.0 * np.log10(max(num, 1e-300) / den))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


@dataclass
class _OutputStats:
    signal: float = 0.0
    noise: float = 0.0
    cos_sum: float = 0.0
    n: int = 0
    top1: int = 0
    top5: int = 0
    kl_sum: float = 0.0
    rows: int = 0
    max_abs_err: float = 0.0


@dataclass
class FidelityAccumulator:
    """Streams reference/quantized output pairs and summarises them.

    ``classification`` says whether to compute top-k agreement and KL on the last axis
    (logits).  With ``None`` it is decided per output: a float output of rank 2 counts as logits when its last
    dimension is >= 10, or >= 2 when the output is named like logits (``logits``, ``start_logits``: a task
    head's, a binary classifier's).
    """

    classification: bool | None = None
    stats: dict[str, _OutputStats] = field(default_factory=dict)

    def update(self, name: str, ref: np.ndarray, approx: np.ndarray) -> None:
        s = self.stats.setdefault(name, _OutputStats())
        r = ref.astype(np.float64)
        a = approx.astype(np.float64)
        s.signal += float(np.sum(r**2))
        s.noise += float(np.sum((r - a) ** 2))
        s.max_abs_err = max(s.max_abs_err, float(np.max(np.abs(r - a))) if r.size else 0.0)
        rb = r.reshape(r.shape[0], -1) if r.ndim > 0 else r.reshape(1, 1)
        ab = a.reshape(rb.shape)
        nr = np.linalg.norm(rb, axis=1)
        na = np.linalg.norm(ab, axis=1)
        cos = np.sum(rb * ab, axis=1) / np.maximum(nr * na, 1e-300)
        s.cos_sum += float(np.sum(cos))
        s.n += rb.shape[0]
        is_cls = self.classification
        if is_cls is None:
            is_cls = r.ndim == 2 and (r.shape[-1] >= 10 or (r.shape[-1] >= 2 and name.lower().endswith("logits")))
        if is_cls:
            r2 = r.reshape(-1, r.shape[-1])
            a2 = a.reshape(-1, a.shape[-1])
            ref_top = np.argmax(r2, axis=-1)
            s.top1 += int(np.sum(np.argmax(a2, axis=-1) == ref_top))
            top5 = np.argsort(-a2, axis=-1)[:, :5]
            s.top5 += int(np.sum(np.any(top5 == ref_top[:, None], axis=-1)))
            lp, lq = _log_softmax(r2), _log_softmax(a2)
            s.kl_sum += float(np.sum(np.exp(lp) * (lp - lq)))
            s.rows += r2.shape[0]

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name, s in self.stats.items():
            d: dict[str, float] = {
                "sqnr_db": float("inf") if s.noise == 0 else float(10 * np.log10(max(s.signal, 1e-300) / s.noise)),
                "mean_cosine": s.cos_sum / max(s.n, 1),
                "max_abs_error": s.max_abs_err,
                "samples": float(s.n),
            }
            if s.rows:
                d["top1_agreement"] = s.top1 / s.rows
                d["top5_agreement"] = s.top5 / s.rows
                d["mean_kl"] = s.kl_sum / s.rows
            out[name] = d
        return out
