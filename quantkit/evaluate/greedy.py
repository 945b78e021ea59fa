"""Greedy-token agreement of a quantized causal LM with its FP32 model (``evaluation.greedy_agreement``).

Perplexity averages over every token; a user of greedy decoding sees something else: whether the quantized model
writes the same text.  Both models decode greedily (the most likely token each step, ``tokens`` steps, end-of-text
tokens included: both run the same number of steps) after the same prompts, and the tokens are compared:

* prompts: ``prompts`` windows of ``prompt_tokens`` tokens cut from the evaluation windows (:func:`prompts_from`):
  every window is split into consecutive, non-overlapping pieces of ``prompt_tokens`` and ``prompts`` of them are
  taken at evenly spaced indices of that list - the same prompts every run, spread over every window;
* ``prefix_agreement``: the tokens the quantized model generates before its first token that differs from
  FP32's, summed over the prompts, over ``prompts x tokens`` (1.0: every continuation identical; a divergence at
  the first token of every prompt: 0.0);
* ``position_agreement``: the share of the ``prompts x tokens`` positions whose two tokens are equal (after a
  divergence the two continuations usually part, so this is at least ``prefix_agreement`` and says how often they
  meet again);
* ``teacher_forced_agreement``: the quantized model fed the prompt and FP32's continuation (no divergence can
  compound): the share of the positions where its most likely next token is FP32's;
* ``identical_prompts``: the prompts whose ``tokens`` generated tokens are all equal;
* ``self_consistency``: each model fed its own greedy continuation in one call (the prompt's path, not the
  decode steps'): the share of the positions where its most likely token is the one it generated.  1.0 for a
  model whose result does not depend on how the tokens are batched (FP32: to float rounding); at
  ``accuracy_level`` 4 the int8 rounding of the activations turns the float rounding differences between a prompt
  and a decode step (or between batch sizes) into other codes, and the logits part by about the level-4 error
  itself: measured on SmolLM2-135M, 4% of max |logit| between a 33-token prompt and 32 tokens + one decode step,
  0.95 self-consistency.  It is the noise floor of the agreement figures: the same quantized model, run two ways.

Both models decode in batches with the KV cache (:class:`quantkit.frontends.llm_builder.LLMSession`), the prompt
in one call, then one token per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BATCH", "FullSequence", "agreement", "greedy_agreement", "greedy_decode", "prompts_from", "teacher_forced"]

BATCH = 16
"""Prompts decoded together (a memory bound: the KV cache and the activations of ``BATCH x prompt_tokens``)."""


def prompts_from(windows: Iterable[np.ndarray], count: int, length: int) -> np.ndarray:
    """``[n, length]`` int64 prompts (``n = min(count, pieces)``) cut from token-id ``windows`` (each 1-D, or
    ``[1, S]``) as the module doc says; ``[0, length]`` when no window holds ``length`` tokens."""
    rows = [np.asarray(w, np.int64).reshape(-1) for w in windows]
    pieces = [(i, s) for i, r in enumerate(rows) for s in range(0, r.size - length + 1, length)]
    if not pieces:
        return np.zeros((0, length), np.int64)
    n = min(count, len(pieces))
    pick = [pieces[(k * len(pieces)) // n] for k in range(n)]
    return np.stack([rows[i][s : s + length] for i, s in pick])


LOGITS_BYTES = 32 * 2**20
"""Teacher forcing keeps the logits of every forced position: its runs take as many prompts as keep them under
this (SmolLM2's 49152-token vocabulary, 32 positions: 5 prompts per run, not 16 - the FP32 decoder's teacher-forced
pass had peaked ~220 MB above its greedy pass)."""


def _vocab(sess: Any) -> int:
    """The logits' last dimension when the graph states it (0 when symbolic)."""
    for o in sess.session.get_outputs():
        if o.name == "logits" and o.shape and isinstance(o.shape[-1], int):
            return int(o.shape[-1])
    return 0


class FullSequence:
    """A causal LM without a KV cache (the whole-graph path's graph: ``input_ids`` [, ``attention_mask``,
    ``position_ids``] -> ``logits``) behind :class:`~quantkit.frontends.llm_builder.LLMSession`'s interface: each
    call runs the whole sequence so far (quadratic in its length, exact)."""

    def __init__(self, model: str | Path | bytes, *, threads: int | None = None) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.enable_cpu_mem_arena = False
        so.log_severity_level = 3
        if threads:
            so.intra_op_num_threads = threads
        self.session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), so,
                                            providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.ids = np.zeros((0, 0), np.int64)

    def reset(self, batch: int) -> None:
        self.ids = np.zeros((batch, 0), np.int64)

    def __call__(self, ids: np.ndarray, logits_to_keep: int = 1) -> np.ndarray:
        self.ids = np.concatenate([self.ids, np.asarray(ids, np.int64)], axis=1)
        b, n = self.ids.shape
        feed = {"input_ids": self.ids}
        if "attention_mask" in self.inputs:
            feed["attention_mask"] = np.ones((b, n), np.int64)
        if "position_ids" in self.inputs:
            feed["position_ids"] = np.broadcast_to(np.arange(n, dtype=np.int64), (b, n)).copy()
        logits = self.session.run(["logits"], feed)[0]
        return logits[:, -logits_to_keep:]


def _session(model: str | Path | bytes, threads: int | None, max_length: int | None = None) -> Any:
    """An :class:`~quantkit.frontends.llm_builder.LLMSession` for a KV-cache decoder, a :class:`FullSequence` for a
    causal LM without a cache (given as bytes, or a graph with no ``past_key_values.*`` input)."""
    from quantkit.frontends.llm_builder import LLMSession

    if isinstance(model, bytes):
        full = FullSequence(model, threads=threads)
        if not any(n.startswith("past_key_values.") for n in full.inputs):
            return full
        return LLMSession("<bytes>", session=full.session, max_length=max_length)  # its options: no arena
    import onnx

    graph_inputs = onnx.load(str(model), load_external_data=False).graph.input
    if not any(i.name.startswith("past_key_values.") for i in graph_inputs):
        return FullSequence(model, threads=threads)
    return LLMSession(model, threads=threads, max_length=max_length, arena=False)  # not timed: no arena kept


def greedy_decode(model: str | Path | bytes, prompts: np.ndarray, tokens: int, *, batch: int = BATCH,
                  threads: int | None = None) -> np.ndarray:
    """``[P, tokens]``: the greedy continuation of each prompt (``[P, L]``) by the decoder ``model`` (its KV cache,
    or the whole sequence again each step for a graph without one: :class:`FullSequence`)."""
    P, L = prompts.shape
    sess = _session(model, threads, max_length=L + tokens)
    out = np.zeros((P, tokens), np.int64)
    for b in range(0, P, batch):
        ids = prompts[b : b + batch]
        sess.reset(ids.shape[0])
        logits = sess(ids, logits_to_keep=1)
        for t in range(tokens):
            nxt = np.argmax(logits[:, -1], axis=-1).astype(np.int64)
            out[b : b + ids.shape[0], t] = nxt
            if t + 1 < tokens:
                logits = sess(nxt[:, None])
    return out


def teacher_forced(model: str | Path | bytes, prompts: np.ndarray, reference: np.ndarray, *, batch: int = BATCH,
                   threads: int | None = None) -> np.ndarray:
    """``[P, T]``: ``model``'s most likely next token at each position of ``reference`` (``[P, T]``), fed the prompt
    and the reference tokens before it."""
    P, T = reference.shape
    seq = np.concatenate([prompts, reference[:, :-1]], axis=1)
    sess = _session(model, threads)
    vocab = _vocab(sess)
    if vocab:  # the logits of T positions per prompt: at most LOGITS_BYTES of them per run
        batch = max(1, min(batch, LOGITS_BYTES // (4 * T * vocab)))
    out = np.zeros((P, T), np.int64)
    for b in range(0, P, batch):
        ids = seq[b : b + batch]
        sess.reset(ids.shape[0])
        logits = sess(ids, logits_to_keep=T)[:, -T:]
        out[b : b + ids.shape[0]] = np.argmax(logits, axis=-1)
    return out


def agreement(reference: np.ndarray, got: np.ndarray, forced: np.ndarray | None = None) -> dict[str, Any]:
    """The figures of the module doc from FP32's tokens ``reference`` and the quantized model's ``got`` (both
    ``[P, T]``), and ``forced`` (the quantized model's next tokens fed ``reference``), when given."""
    ref, q = np.asarray(reference), np.asarray(got)
    if ref.shape != q.shape or ref.ndim != 2:
        raise ValueError(f"agreement: token arrays of shapes {ref.shape} and {q.shape}; allowed: two equal [P, T]")
    P, T = ref.shape
    same = ref == q
    first = np.where(same.all(axis=1), T, np.argmin(same, axis=1))  # tokens before the first divergence
    out: dict[str, Any] = {
        "prompts": int(P), "tokens": int(T),
        "prefix_agreement": float(first.sum() / max(P * T, 1)),
        "position_agreement": float(same.mean()) if same.size else 1.0,
        "identical_prompts": int((first == T).sum()),
        "mean_tokens_before_divergence": float(first.mean()) if P else float(T),
    }  # fmt: skip
    if forced is not None:
        out["teacher_forced_agreement"] = float((np.asarray(forced) == ref).mean()) if ref.size else 1.0
    return out


def greedy_agreement(fp32: str | Path | bytes | None, quantized: str | Path | bytes, windows: Iterable[np.ndarray],
                     spec: Any, *, why_no_fp32: str = "", context: int | None = None,
                     threads: int | None = None) -> dict[str, Any]:
    """``quality.greedy_agreement``: ``spec`` (``evaluation.greedy_agreement``: ``prompts``, ``prompt_tokens``,
    ``tokens``, ``batch``) run on ``fp32`` and ``quantized`` with prompts from ``windows``.  ``{"measured": False,
    "why"}`` when there is no FP32 model (``why_no_fp32`` says why), no window long enough, or the prompt and the
    continuation do not fit the ``context``."""
    cfg: Mapping[str, Any] = spec if isinstance(spec, Mapping) else spec.model_dump()
    n, L, T = int(cfg["prompts"]), int(cfg["prompt_tokens"]), int(cfg["tokens"])
    batch = int(cfg.get("batch") or BATCH)
    head = {"prompt_tokens": L, "tokens": T, "batch": batch}
    if fp32 is None:
        return {"measured": False, **head, "why": why_no_fp32 or "no FP32 model to compare with"}
    if context is not None and L + T > context:
        return {"measured": False, **head, "why": f"prompt_tokens + tokens = {L + T} exceed the model's context of "
                                                  f"{context} positions"}  # fmt: skip
    prompts = prompts_from(windows, n, L)
    if prompts.shape[0] == 0:
        return {"measured": False, **head, "why": f"no evaluation window holds {L} tokens (prompt_tokens)"}
    t0 = time.perf_counter()
    ref = greedy_decode(fp32, prompts, T, batch=batch, threads=threads)
    got = greedy_decode(quantized, prompts, T, batch=batch, threads=threads)
    forced = teacher_forced(quantized, prompts, ref, batch=batch, threads=threads)
    res = agreement(ref, got, forced)
    res["self_consistency"] = {
        k: float((teacher_forced(m, prompts, toks, batch=batch, threads=threads) == toks).mean())
        for k, m, toks in (("fp32", fp32, ref), ("quantized", quantized, got))}  # fmt: skip
    return {"measured": True, **head, **res, "seconds": round(time.perf_counter() - t0, 3)}
