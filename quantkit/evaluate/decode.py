"""Prefill and per-token decode latency of causal LM graphs under ONNX Runtime.

Two graph kinds are recognised from their inputs:

* **KV-cache decoders** (inputs ``past_key_values.<i>.key|value``, exported by
  :func:`quantkit.frontends.llm.export_causal_lm_with_cache`; :func:`decoder_with_cache` gives
  the cached one of a built-in).  A decode step is one new token attending to ``past_len``
  cached positions; prefill is ``seq_len`` tokens with an empty (length-0) past.
* **full-sequence graphs** (``input_ids``, ``attention_mask`` -> ``logits``; the built-ins).
  Prefill is one forward of ``1 x seq_len`` tokens; "decode" can only be a forward of one
  token with no context, labelled ``"one-token forward (no KV cache)"``: it measures the
  weight-streaming cost of a step (what INT4 speeds up) but not attention over a cache.

Feeds are synthetic (random token ids, zero caches): latency does not depend on values.
Timing goes through :func:`quantkit.evaluate.latency.compare_latency`, so several models given
together are measured interleaved and suffer the same machine noise.

:func:`measure_generation` times real decoding on a KV-cache graph: a prompt of ``prompt_len``
tokens, then ``new_tokens`` steps of one token each, every step's ``present.*`` fed back as the next
step's ``past_key_values.*`` (the cache grows from ``prompt_len`` to ``prompt_len + new_tokens - 1``).
Several models generate in lockstep (step ``t`` of each, then step ``t + 1``), so they share the noise;
:func:`llm_latency` reports its per-token median as the decode row of KV-cache graphs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quantkit.errors import ModelError
from quantkit.evaluate.latency import compare_latency, make_session
from quantkit.frontends.kv_cache import match_cache_feed, ort_dtype

__all__ = [
    "StepLatency",
    "decoder_with_cache",
    "has_kv_cache",
    "keeps_last",
    "llm_latency",
    "measure_decode",
    "measure_generation",
    "measure_prefill",
]

ModelSource = bytes | str | os.PathLike[str]
_PAST = "past_key_values."


@dataclass(frozen=True)
class StepLatency:
    """Latency of one prefill or decode step (milliseconds).

    Attributes:
        label: what was timed, e.g. ``"decode step with KV cache (past 128)"`` or
            ``"one-token forward (no KV cache)"``.
        kv_cache: whether the graph has a KV cache.
        tokens: tokens processed per step (1 for decode).
        tokens_per_s: ``tokens / median``.
    """

    label: str
    kv_cache: bool
    tokens: int
    median_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    runs: int
    tokens_per_s: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def decoder_with_cache(name: str = "smollm2-135m", *, refresh: bool = False) -> Path:
    """Path of the cached KV-cache decoder ``model.onnx`` of built-in ``name`` (exported on first use)."""
    from quantkit.frontends.llm import causal_lm_with_cache_path

    return causal_lm_with_cache_path(name, refresh=refresh)


def has_kv_cache(session: Any) -> bool:
    """True if the ORT session's graph takes ``past_key_values.*`` inputs."""
    return any(i.name.startswith(_PAST) for i in session.get_inputs())


def _dim(d: Any, what: str, name: str) -> int:
    if not isinstance(d, int):
        raise ModelError(
            f"input {name!r}: dim {what} is symbolic ({d!r}); a KV cache needs static heads/head_dim"
        )
    return d


def _feed(
    session: Any, *, new_tokens: int, past_len: int, batch: int = 1, seed: int = 0
) -> dict[str, np.ndarray]:
    """Synthetic feed: ``batch`` rows of ``new_tokens`` ids after ``past_len`` cached positions."""
    rng = np.random.default_rng(seed)
    logits = next((o for o in session.get_outputs() if o.name == "logits"), None)
    vocab = logits.shape[-1] if logits is not None and isinstance(logits.shape[-1], int) else 1000
    kv = has_kv_cache(session)
    past = past_len if kv else 0
    feed: dict[str, np.ndarray] = {}
    for inp in session.get_inputs():
        name = inp.name
        if name == "input_ids":
            feed[name] = rng.integers(3, max(4, min(vocab, 1000)), (batch, new_tokens), dtype=np.int64)
        elif name == "attention_mask":
            feed[name] = np.ones((batch, past + new_tokens), np.int64)
        elif name == "position_ids":
            feed[name] = np.tile(np.arange(past, past + new_tokens, dtype=np.int64), (batch, 1))
        elif name == "token_type_ids":
            feed[name] = np.zeros((batch, new_tokens), np.int64)
        elif name.startswith(_PAST):
            shape = inp.shape
            if len(shape) != 4:
                raise ModelError(
                    f"input {name!r} has shape {shape}; expected [batch, heads, past_seq, head_dim]"
                )
            heads, head_dim = _dim(shape[1], "1 (heads)", name), _dim(shape[3], "3 (head_dim)", name)
            feed[name] = np.zeros((batch, heads, past, head_dim), ort_dtype(inp.type))  # float32, or int8
        else:
            raise ModelError(
                f"cannot build a decode feed for input {name!r}; known inputs: input_ids, attention_mask, "
                f"position_ids, token_type_ids, {_PAST}*"
            )
    return feed


_KEEP = "logits_to_keep"


def keeps_last(session: Any) -> bool:
    """True if the graph can return the last positions' logits only (built decoders' ``logits_to_keep``)."""
    return any(i.name == _KEEP for i in session.get_overridable_initializers())


def _as_mapping(models: ModelSource | Mapping[str, ModelSource]) -> dict[str, ModelSource]:
    if isinstance(models, Mapping):
        if not models:
            raise ModelError("no model to measure")
        return dict(models)
    return {"model": models}


def _source(m: ModelSource) -> bytes | str:
    return m if isinstance(m, bytes) else os.fspath(m)


def _measure(
    models: ModelSource | Mapping[str, ModelSource],
    *,
    new_tokens: int,
    past_len: int,
    batch: int,
    threads: int | None,
    warmup: int,
    repeat: int,
    rounds: int,
    label_kv: str,
    label_full: str,
    last_logits: bool = False,
) -> dict[str, StepLatency]:
    sessions = {k: make_session(_source(m), threads=threads, arena=False) for k, m in _as_mapping(models).items()}
    # Sessions with the same inputs share a feed and are timed interleaved.
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for k, s in sessions.items():
        keep = last_logits and keeps_last(s)
        groups.setdefault((keep, *(i.name for i in s.get_inputs())), {})[k] = s
    out: dict[str, StepLatency] = {}
    for key, group in groups.items():
        first = next(iter(group.values()))
        kv = has_kv_cache(first)
        feed = _feed(first, new_tokens=new_tokens, past_len=past_len, batch=batch)
        if key[0]:
            feed[_KEEP] = np.ones(1, np.int64)
        lat = compare_latency(group, feed, warmup=warmup, repeat=repeat, threads=threads or 0, rounds=rounds)
        for k, v in lat.items():
            out[k] = StepLatency(
                label=(label_kv if kv else label_full) + (", last-position logits" if key[0] else ""),
                kv_cache=kv,
                tokens=new_tokens * batch,
                median_ms=v.median_ms,
                p90_ms=v.p90_ms,
                mean_ms=v.mean_ms,
                min_ms=v.min_ms,
                runs=v.runs,
                tokens_per_s=new_tokens * batch / (v.median_ms / 1e3),
            )
    return {k: out[k] for k in sessions}


def measure_decode(
    models: ModelSource | Mapping[str, ModelSource],
    *,
    past_len: int = 128,
    batch: int = 1,
    threads: int | None = None,
    warmup: int = 5,
    repeat: int = 60,
    rounds: int = 3,
) -> dict[str, StepLatency]:
    """Latency of one decode step (one new token per row, ``batch`` rows) per model.

    KV-cache graphs attend to ``past_len`` cached positions; full-sequence graphs run a
    one-token forward with no context (label ``"one-token forward (no KV cache)"``).

    Args:
        models: one model (ONNX bytes or path) or a mapping ``name -> model`` (timed interleaved).
        past_len: cached positions for KV-cache graphs.
        threads: intra-op threads (default ONNX Runtime's).

    Returns:
        ``{name: StepLatency}`` (the single model is called ``"model"``).
    """
    return _measure(
        models,
        new_tokens=1,
        past_len=past_len,
        batch=batch,
        threads=threads,
        warmup=warmup,
        repeat=repeat,
        rounds=rounds,
        label_kv=f"decode step with KV cache (past {past_len})",
        label_full="one-token forward (no KV cache)",
    )


def measure_prefill(
    models: ModelSource | Mapping[str, ModelSource],
    *,
    seq_len: int = 128,
    batch: int = 1,
    threads: int | None = None,
    warmup: int = 3,
    repeat: int = 30,
    rounds: int = 3,
    last_logits: bool = True,
) -> dict[str, StepLatency]:
    """Latency of a prefill of ``batch x seq_len`` tokens (KV graphs: with an empty past).

    ``last_logits``: graphs that can (built decoders' ``logits_to_keep``) return the last position's logits
    only, as a generation loop asks for its prompt (the label then says so); the others return all of them."""
    return _measure(
        models,
        new_tokens=seq_len,
        past_len=0,
        batch=batch,
        threads=threads,
        warmup=warmup,
        repeat=repeat,
        rounds=rounds,
        label_kv=f"prefill 1x{seq_len} (KV cache, empty past)",
        label_full=f"prefill 1x{seq_len} (full sequence)",
        last_logits=last_logits,
    )


def _past_names(session: Any) -> tuple[list[str], list[str]]:
    past = [i.name for i in session.get_inputs() if i.name.startswith(_PAST)]
    outs = {o.name for o in session.get_outputs()}
    present = [n.replace(_PAST, "present.", 1) for n in past]
    missing = [n for n in present if n not in outs]
    if missing:
        raise ModelError(f"KV-cache graph has past inputs but no outputs {missing[:3]}; expected present.<i>.key|value")
    return past, present


_GQA = b"GroupQueryAttention"


def _uses_gqa(source: bytes | str) -> bool:
    """Whether the graph's attention is ``GroupQueryAttention`` (its KV cache can live in one shared buffer).

    Looks for the op type's name in the serialized model instead of parsing it: a single-file model with its
    weights inside would otherwise be parsed a second time, in memory, next to its session."""
    if isinstance(source, bytes):
        return _GQA in source
    tail = b""
    with open(source, "rb") as f:
        while chunk := f.read(8 << 20):
            if _GQA in tail + chunk[: len(_GQA)] or _GQA in chunk:
                return True
            tail = chunk[-len(_GQA) :]
    return False


class _ConcatRunner:
    """Feeds the cache as arrays and keeps ``present.*`` (any KV-cache graph; the cache is copied every step)."""

    def __init__(self, session: Any, feed0: dict[str, np.ndarray]) -> None:
        self.s = session
        self.past, self.present = _past_names(session)
        wanted = {i.name for i in session.get_inputs()}
        # the feed may be another model's: its empty past in this session's cache type (float32 / int8)
        self.feed0 = match_cache_feed(session, {n: v for n, v in feed0.items() if n in wanted})
        self.keep = keeps_last(session)

    def prompt(self) -> np.ndarray:
        feed = dict(self.feed0)
        if self.keep:  # the prompt's last logits only, as a generation loop asks
            feed[_KEEP] = np.ones(1, np.int64)
        outs = self.s.run(["logits", *self.present], feed)
        self.mask = self.feed0["attention_mask"]
        self.state = dict(zip(self.past, outs[1:], strict=True))
        return outs[0]

    def step(self, ids: np.ndarray) -> np.ndarray:
        mask = np.concatenate([self.mask, np.ones_like(ids)], axis=1)
        outs = self.s.run(["logits", *self.present], {"input_ids": ids, "attention_mask": mask, **self.state})
        self.mask, self.state = mask, dict(zip(self.past, outs[1:], strict=True))
        return outs[0]


class _SharedRunner:
    """GroupQueryAttention graphs: the cache in one buffer per layer, past = present (``io_binding``)."""

    def __init__(self, session: Any, feed0: dict[str, np.ndarray], max_length: int) -> None:
        from quantkit.frontends.llm_builder import LLMSession

        _past_names(session)
        self.llm = LLMSession("", session=session, max_length=max_length)
        self.ids = feed0["input_ids"]

    def prompt(self) -> np.ndarray:
        self.llm.reset(self.ids.shape[0])
        return self.llm(self.ids, logits_to_keep=1)

    def step(self, ids: np.ndarray) -> np.ndarray:
        return self.llm(ids)


def measure_generation(
    models: ModelSource | Mapping[str, ModelSource],
    *,
    prompt_len: int = 128,
    new_tokens: int = 64,
    threads: int | None = None,
    rounds: int = 3,
    warmup_tokens: int = 4,
    seed: int = 0,
    shared_cache: bool = True,
) -> dict[str, dict[str, Any]]:
    """Per-token decode latency with the KV cache: ``new_tokens`` one-token steps after a ``prompt_len`` prompt.

    Each round, every model prefills the same random prompt (empty past), then all models take one decode step
    each in turn (lockstep, so they see the same machine noise), the step's greedy token being the next input.
    A first, untimed round of ``warmup_tokens`` steps warms the sessions.  How the cache is kept is what a
    generation runtime does: for ``GroupQueryAttention`` graphs (built decoders, onnxruntime-genai's) with
    ``shared_cache``, one buffer of ``prompt_len + new_tokens`` positions per layer bound as both past and
    present (:class:`quantkit.frontends.llm_builder.LLMSession`); for other KV graphs, each step's
    ``present.*`` is fed back as ``past_key_values.*``.  Prompts ask for the last position's logits only when
    the graph can (``logits_to_keep``).

    Returns:
        ``{name: {"median_ms", "mean_ms", "p90_ms", "min_ms", "steps", "new_tokens", "prompt_ms", "tokens_per_s",
        "shared_cache"}}``: per decode step over all rounds (``prompt_ms``: median prefill of the prompt in the
        same loop; ``new_tokens`` is smaller than asked when the model's context ends first).

    Raises:
        ModelError: a model has no KV cache (``past_key_values.*`` inputs and ``present.*`` outputs).
    """
    import time

    sources = {k: _source(m) for k, m in _as_mapping(models).items()}
    sessions = {k: make_session(src, threads=threads) for k, src in sources.items()}
    for k, s in sessions.items():
        if not has_kv_cache(s):
            raise ModelError(f"measure_generation: model {k!r} has no KV cache (past_key_values.* inputs)")
    first = next(iter(sessions.values()))
    feed0 = _feed(first, new_tokens=prompt_len, past_len=0, seed=seed)
    vocab_hi = int(feed0["input_ids"].max()) + 1
    runners: dict[str, _ConcatRunner | _SharedRunner] = {
        k: _SharedRunner(s, feed0, prompt_len + new_tokens) if shared_cache and _uses_gqa(sources[k])
        else _ConcatRunner(s, feed0) for k, s in sessions.items()}  # fmt: skip
    steps: dict[str, list[float]] = {k: [] for k in sessions}
    prompts: dict[str, list[float]] = {k: [] for k in sessions}
    for rnd in range(rounds + 1):
        timed = rnd > 0
        n_steps = new_tokens if timed else min(warmup_tokens, new_tokens)
        logits: dict[str, np.ndarray] = {}
        for k, r in runners.items():
            t0 = time.perf_counter()
            logits[k] = r.prompt()
            if timed:
                prompts[k].append((time.perf_counter() - t0) * 1e3)
        for t in range(n_steps):
            row: dict[str, float] = {}
            try:
                for k, r in runners.items():
                    tok = int(np.argmax(logits[k][0, -1])) % vocab_hi
                    ids = np.full((logits[k].shape[0], 1), tok, np.int64)
                    t0 = time.perf_counter()
                    logits[k] = r.step(ids)
                    row[k] = (time.perf_counter() - t0) * 1e3
            except Exception:  # the model's context (rotary cache) ends before prompt_len + new_tokens
                if t == 0:
                    raise
                new_tokens = t
                break
            if timed:
                for k, ms in row.items():
                    steps[k].append(ms)
    out: dict[str, dict[str, Any]] = {}
    for k in sessions:
        a = np.asarray(steps[k])
        med = float(np.median(a))
        out[k] = {"median_ms": med, "mean_ms": float(a.mean()), "p90_ms": float(np.percentile(a, 90)),
                  "min_ms": float(a.min()), "steps": int(a.size), "new_tokens": new_tokens, "prompt_ms": float(np.median(prompts[k])),
                  "tokens_per_s": 1e3 / med, "shared_cache": isinstance(runners[k], _SharedRunner)}  # fmt: skip
    return out


def llm_latency(
    fp32: ModelSource,
    quantized: ModelSource,
    settings: Any = None,
    *,
    vocab_input: Any = None,
) -> dict[str, dict[str, Any]]:
    """Prefill and decode latency of an FP32 and a quantized causal LM, timed interleaved.

    Args:
        fp32, quantized: ONNX bytes or paths of the two graphs (same inputs).
        settings: an object with ``batch_size``, ``seq_len`` (prefill length, default 128),
            ``warmup``, ``repeat``, ``threads`` (a recipe's ``report.latency``), or None.
        vocab_input: accepted for the API's convenience and unused (token ids are drawn
            below the graph's static vocabulary size).

    Returns:
        ``{"prefill": row, "decode": row}`` with ``row = {"label", "tokens", "fp32_ms",
        "quantized_ms", "fp32_p90_ms", "quantized_p90_ms", "speedup"}``
        (``speedup = fp32_ms / quantized_ms``, medians).  For KV-cache graphs the decode row is
        :func:`measure_generation` (64 tokens after a ``seq_len`` prompt, the cache kept as a generation runtime keeps it, per-token
        median) and adds ``kv_cache: True``, ``prompt_len``, ``new_tokens``, ``steps``, ``fp32_mean_ms``,
        ``quantized_mean_ms``; full-sequence graphs keep the one-token forward (``kv_cache: False``).
    """
    del vocab_input
    batch = int(getattr(settings, "batch_size", 1) or 1)
    seq_len = int(getattr(settings, "seq_len", None) or 128)
    warmup = int(getattr(settings, "warmup", 5))
    repeat = int(getattr(settings, "repeat", 30))
    threads = getattr(settings, "threads", None)
    models = {"fp32": fp32, "quantized": quantized}
    rows: dict[str, dict[str, Any]] = {}
    prefill = measure_prefill(models, seq_len=seq_len, batch=batch, threads=threads, warmup=warmup, repeat=repeat)
    if prefill["fp32"].kv_cache:
        new_tokens = 64
        gen = measure_generation(models, prompt_len=seq_len, new_tokens=new_tokens, threads=threads,
                                 rounds=max(1, min(3, repeat // 10)))
        gf, gq = gen["fp32"], gen["quantized"]
        new_tokens = int(gf["new_tokens"])
        rows["decode"] = {
            "label": f"decode with KV cache: {new_tokens} tokens after a {seq_len}-token prompt "
                     + ("(cache in one shared buffer)" if gq["shared_cache"] else "(present -> past)"),
            "tokens": 1, "fp32_ms": gf["median_ms"], "quantized_ms": gq["median_ms"],
            "fp32_p90_ms": gf["p90_ms"], "quantized_p90_ms": gq["p90_ms"], "speedup": gf["median_ms"] / gq["median_ms"],
            "kv_cache": True, "prompt_len": seq_len, "new_tokens": new_tokens, "steps": gf["steps"],
            "fp32_mean_ms": gf["mean_ms"], "quantized_mean_ms": gq["mean_ms"],
        }  # fmt: skip
        steps: tuple[tuple[str, dict[str, StepLatency]], ...] = (("prefill", prefill),)
        long = getattr(settings, "long_prefill", None)
        if long and long > seq_len and long <= _context_length(fp32):  # a long prompt: fewer, slower runs
            steps += (("prefill_long", measure_prefill(models, seq_len=int(long), batch=batch, threads=threads,
                                                       warmup=1, repeat=max(3, repeat // 4))),)  # fmt: skip
    else:
        steps = (
            ("prefill", prefill),
            ("decode", measure_decode(models, past_len=seq_len, batch=batch, threads=threads, warmup=warmup,
                                      repeat=2 * repeat)),
        )  # fmt: skip
    for key, res in steps:
        f, q = res["fp32"], res["quantized"]
        rows[key] = {
            "label": f.label,
            "tokens": f.tokens,
            "fp32_ms": f.median_ms,
            "quantized_ms": q.median_ms,
            "fp32_p90_ms": f.p90_ms,
            "quantized_p90_ms": q.p90_ms,
            "speedup": f.median_ms / q.median_ms,
            "kv_cache": f.kv_cache,
        }
    return {k: rows[k] for k in ("prefill", "prefill_long", "decode") if k in rows}


def _context_length(model: ModelSource) -> int:
    """The longest sequence a built decoder's rotary cache covers (``cos_cache`` rows), else a large number."""
    import onnx

    src = _source(model)
    proto = onnx.load_model_from_string(src) if isinstance(src, bytes) else onnx.load(str(src), load_external_data=False)
    for init in proto.graph.initializer:
        if init.name == "cos_cache" and init.dims:
            return int(init.dims[0])
    return 1 << 30
