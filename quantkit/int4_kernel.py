"""Which ``MatMulNBits`` ``accuracy_level`` a weight-only model ships with, chosen per CPU class.

``accuracy_level`` 4 quantizes each block of activations to int8 inside the kernel and multiplies in int8; level
0 unpacks the 4-bit weights and multiplies in float (exact against the dequantized weights).  Which one is faster
depends on the CPU's int8 instructions, so ``export.accuracy_level: auto`` (the default) decides per CPU class:

* the model is built at level 4 (:data:`BUILD_LEVEL`);
* when the target class (``target.isa``; ``auto`` is the running CPU's class) *is* the running CPU's class and
  latency is measured (``report.latency.enabled`` and no ``--no-latency``), a second graph that differs from the
  built one only in that attribute (level 0) is written beside it - it reads the same external weight file, no
  weight is copied - and both are timed interleaved (:func:`measure_levels`: the prefill of
  ``report.latency.seq_len`` tokens and the decode per token, with fewer repeats than the report's own latency).
  The level with the lower geometric mean of the two times ships (a tie keeps 4); when that is level 0 its graph
  replaces the built one, before the model is evaluated, so every figure of the report is of the shipped model;
* otherwise the class default of :data:`CLASS_DEFAULT_LEVEL` ships, and the report says that it was not measured
  and why.

A number in the recipe is obeyed as it is.  The report's ``int4_kernel`` section records the class, the level,
how and why it was chosen, and the times of both levels when they were measured.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quantkit.errors import ModelError, RecipeError
from quantkit.irtools import proto_size

log = logging.getLogger("quantkit")

__all__ = ["ACCURACY_LEVELS", "ALTERNATIVE_LEVEL", "BUILD_LEVEL", "CLASS_DEFAULT_LEVEL", "LEVEL_NAMES",
           "build_level", "choose_for_file", "choose_for_model", "measure_levels", "nbits_nodes",
           "set_accuracy_level", "set_model_accuracy_level", "write_level_sibling"]

ACCURACY_LEVELS: tuple[int, ...] = (0, 1, 2, 3, 4)
BUILD_LEVEL = 4
"""The level a model is built at under ``auto`` (the fast one on the CPUs measured, x86 with VNNI)."""
ALTERNATIVE_LEVEL = 0
"""The level timed against :data:`BUILD_LEVEL` (float compute; levels 1-3 run like 0 on the CPU provider)."""
LEVEL_NAMES = {0: "float, exact", 1: "float", 2: "fp16 compute", 3: "bf16 compute", 4: "int8 activations"}

CLASS_DEFAULT_LEVEL: dict[str, int] = {"x86-vnni": 4, "x86-avx2": 4, "arm64": 4, "portable": 0}
"""The level shipped when it is not measured (the target class is not this CPU's, or latency is off).

From the measured ONNX Runtime 1.32 facts the project designs against (CPU provider):

* ``x86-vnni``: 4.  Level 4 is the fast one: with K = N = 1536, block 128, it takes 0.014 ms at one token and
  0.79 ms at 128 tokens against 0.042 / 1.32 ms at level 0 - level 0 is even slower than FP32 (1.21 ms) at 128
  tokens.  Its int8 activations cost ~0.5-0.7% of max|Y| of error.
* ``x86-avx2``: 4.  The saturating ``vpmaddubsw`` pair sums of CPUs without VNNI cannot clip a pair of products of
  a 4-bit weight code (at most 15 in magnitude, however it is stored) and an 8-bit activation code:
  2 * 255 * 15 = 7650 < 32767 (as 7-bit weights stay exact there: 255 * 64 * 2 < 32767), so level 4 computes the
  same numbers as with VNNI; levels 1-3 run like 0.  How much faster it is without VNNI has not been measured,
  which is what ``auto`` does when the model is built on such a CPU.
* ``arm64``: 4.  NEON's ``sdot`` / ``udot`` accumulate int8 products in int32 (exact), the int8 path that
  level 4 takes; level 0 is the float path measured slower than FP32 at 128 tokens on x86.
* ``portable``: 0.  A portable model promises the same numbers on every class: level 0 is exact against
  dequantize-then-MatMul (<= 2e-6) wherever it runs, while level 4's int8 activations go through each class's
  own int8 kernel.  The price is speed (and at 8 bits, level 0 is ~20x slower than FP32 at one token).
"""

_CLASS_WHY = {
    "x86-vnni": "level 4 multiplies in int8 with VNNI dot products, measured ~3x faster than level 0 at one token "
                "and ~1.7x at 128 (where level 0 is slower than FP32)",
    "x86-avx2": "4-bit weight codes cannot saturate the int16 pair sums of CPUs without VNNI (2 * 255 * 15 < 32767), "
                "so level 4 computes what it computes with VNNI; its speed there is measured when the model is built "
                "on such a CPU (target.isa auto)",
    "arm64": "NEON dot products accumulate int8 products in int32: level 4 takes that int8 path",
    "portable": "level 0 computes in float, exact against the dequantized weights on every CPU class, while level 4's "
                "int8 activations go through each class's own int8 kernel",
}
_NBITS, _MS = "MatMulNBits", "com.microsoft"
MEASURE_RAM_FRACTION = 0.4
"""Both levels are timed only when two sessions of the quantized model take at most this share of the free RAM."""


def build_level(setting: int | str) -> int:
    """The level a model is built at: the recipe's number, or :data:`BUILD_LEVEL` for ``auto``."""
    if setting == "auto":
        return BUILD_LEVEL
    if isinstance(setting, bool) or setting not in ACCURACY_LEVELS:
        raise RecipeError(f"export.accuracy_level {setting!r}; allowed: 'auto', {', '.join(map(str, ACCURACY_LEVELS))}")
    return int(setting)


def _graph_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graph_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graph_nodes(g)


def nbits_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The ``com.microsoft.MatMulNBits`` nodes of ``proto`` (subgraphs included)."""
    return [n for n in _graph_nodes(proto.graph) if n.op_type == _NBITS and n.domain == _MS]


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def set_accuracy_level(proto: onnx.ModelProto, level: int) -> int:
    """Set ``accuracy_level`` of every ``MatMulNBits`` node of ``proto`` (in place); returns how many.  A mixture of
    experts' ``QMoE`` nodes (4-bit experts: the attribute has MatMulNBits' meaning there) get the same level, so the
    experts run as the rest of the model."""
    build_level(level)
    nodes = nbits_nodes(proto)
    for node in _graph_nodes(proto.graph):
        if node.op_type == "QMoE" and node.domain == _MS:
            attr = next((a for a in node.attribute if a.name == "accuracy_level"), None)
            if attr is None:
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", int(level)))
            else:
                attr.i = int(level)
    for node in nodes:
        attr = next((a for a in node.attribute if a.name == "accuracy_level"), None)
        if attr is None:
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", int(level)))
        else:
            attr.i = int(level)
    return len(nodes)


def set_model_accuracy_level(model: ir.Model, level: int) -> int:
    """:func:`set_accuracy_level` on an in-memory ``onnx_ir`` model."""
    build_level(level)
    count = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.op_type in (_NBITS, "QMoE") and node.domain == _MS:
            node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", int(level))
            count += node.op_type == _NBITS
    return count


def write_level_sibling(path: str | os.PathLike[str], level: int) -> Path:
    """Write beside ``path`` its graph with every ``MatMulNBits`` at ``level`` and nothing else changed.

    The graph is read without its external data and written back as it was read: its tensors keep their
    references (location, offset, length) to the same weight file, which is neither read nor copied.  The new
    file, ``<stem>.accuracy<level>.onnx``, lives in the same folder (so the folder's clean-up removes it).

    Raises:
        ModelError: the graph has no ``MatMulNBits`` node.
    """
    src = Path(path)
    proto = onnx.load(str(src), load_external_data=False)
    if not set_accuracy_level(proto, level):
        raise ModelError(f"{src}: no {_MS}.{_NBITS} node whose accuracy_level could be set")
    out = src.with_name(f"{src.stem}.accuracy{level}{src.suffix}")
    out.write_bytes(proto.SerializeToString())
    return out


def measure_levels(models: Mapping[str, Any], settings: Any, feed: Mapping[str, np.ndarray] | None = None
                   ) -> tuple[dict[str, dict[str, float]], str]:
    """Time the graphs of ``models`` (``{"4": model, "0": model}``, paths or bytes), interleaved.

    A causal LM (``feed`` None): the prefill of ``settings.seq_len`` tokens (default 128) and the decode per token
    (KV-cache graphs: 32 generated tokens after that prompt, in lockstep; others: a one-token forward).  Any other
    graph: one call on ``feed``.  ``settings`` is a recipe's ``report.latency``; a third of its repeats are used.

    Returns:
        ``({name: {"prefill_ms", "decode_ms"}} or {name: {"call_ms"}}, what was timed)`` (medians).
    """
    from quantkit.evaluate.decode import measure_decode, measure_generation, measure_prefill
    from quantkit.evaluate.latency import compare_latency, make_session

    threads = getattr(settings, "threads", None)
    warmup = min(2, int(getattr(settings, "warmup", 5)))
    repeat = max(6, int(getattr(settings, "repeat", 30)) // 3)
    if feed is not None:
        sessions = {k: make_session(m, threads=threads) for k, m in models.items()}
        lat = compare_latency(sessions, feed, warmup=warmup, repeat=repeat, threads=threads or 0, rounds=2)
        return {k: {"call_ms": v.median_ms} for k, v in lat.items()}, f"one call ({next(iter(lat.values())).shape})"
    seq = int(getattr(settings, "seq_len", None) or 128)
    batch = int(getattr(settings, "batch_size", 1) or 1)
    pre = measure_prefill(dict(models), seq_len=seq, batch=batch, threads=threads, warmup=warmup, repeat=repeat,
                          rounds=2)
    if next(iter(pre.values())).kv_cache:
        new = 32
        gen = measure_generation(dict(models), prompt_len=seq, new_tokens=new, threads=threads, rounds=1)
        dec = {k: float(v["median_ms"]) for k, v in gen.items()}
        what = (f"prefill of a {seq}-token prompt ({repeat} runs each); decode per token (median of "
                f"{next(iter(gen.values()))['new_tokens']} tokens after it, KV cache)")
    else:
        one = measure_decode(dict(models), past_len=seq, batch=batch, threads=threads, warmup=warmup,
                             repeat=2 * repeat, rounds=2)
        dec = {k: v.median_ms for k, v in one.items()}
        what = f"prefill of a {seq}-token prompt ({repeat} runs each); one-token forward ({2 * repeat} runs each)"
    return {k: {"prefill_ms": pre[k].median_ms, "decode_ms": dec[k]} for k in models}, what


def _score(row: Mapping[str, float]) -> float:
    """The geometric mean of a level's times (prefill and decode per token, or one call)."""
    vals = [float(v) for k, v in row.items() if k.endswith("_ms")]
    return math.exp(sum(math.log(max(v, 1e-9)) for v in vals) / len(vals))


def _plan(setting: int | str, target_class: str, isa: str, latency_on: bool, two_bytes: int
          ) -> tuple[int, str, str, str]:
    """(level, how, short reason, why) - how is ``recipe``, ``class default`` or ``measured`` (level then is the
    build level, to be decided by timing)."""
    from quantkit.memory import available_memory, gb
    from quantkit.scheme.target import detect_cpu

    if setting != "auto":
        lv = build_level(setting)
        return lv, "recipe", "set by the recipe", (f"export.accuracy_level {lv} in the recipe (auto: measured per "
                                                   "CPU class)")
    default = CLASS_DEFAULT_LEVEL.get(target_class, ALTERNATIVE_LEVEL)
    because = _CLASS_WHY.get(target_class, "an unknown class: level 0 computes in float everywhere")
    running = detect_cpu().cpu_class
    if target_class != running:
        short = f"the target class {target_class} is not this CPU's class {running}"
        why = (f"not measured: {short} (target.isa {isa}), so timing it here says nothing about the target; "
               f"the class default: {because}")
        return default, "class default", short, why
    if not latency_on:
        short = "latency measurement is off"
        why = (f"not measured: {short} (report.latency.enabled: false, or --no-latency); the class default: "
               f"{because}")
        return default, "class default", short, why
    avail = available_memory()
    if two_bytes > MEASURE_RAM_FRACTION * avail.bytes:
        short = f"two sessions of the quantized model ({gb(two_bytes)}) do not fit"
        why = (f"not measured: {short} in {MEASURE_RAM_FRACTION:.0%} of the available memory ({gb(avail.bytes)}); "
               f"the class default: {because}")
        return default, "class default", short, why
    return BUILD_LEVEL, "measured", "", ""


def _section(nodes: list[onnx.NodeProto], setting: int | str, target_class: str, isa: str) -> dict[str, Any]:
    from quantkit.scheme.target import detect_cpu

    built: dict[str, int] = {}
    for n in nodes:
        lv = str(_attr(n, "accuracy_level", 0))
        built[lv] = built.get(lv, 0) + 1
    return {"cpu_class": target_class, "target_isa": isa, "this_cpu_class": detect_cpu().cpu_class,
            "setting": setting, "accuracy_level": None, "how": None, "not_measured": None, "why": None,
            "measured": None, "timed": None, "load_average": None, "kernels": len(nodes),
            "bits": sorted({_attr(n, "bits", 4) for n in nodes}), "as_built": dict(sorted(built.items())),
            "time_s": 0.0}


def _decoder_layers(path: Path) -> int | None:
    """The number of blocks of a decoder quantkit built (its recorded ``source`` folder's config), else None."""
    m = onnx.load(str(path), load_external_data=False)
    source = {p.key: p.value for p in m.metadata_props}.get("source")
    if not source or not (Path(source) / "config.json").is_file():
        return None
    from quantkit.frontends.families import read_config

    try:
        return int(read_config(source).num_hidden_layers) or None
    except ModelError:
        return None


def _decide(sec: dict[str, Any], measure: Any, target_class: str, scope: str = "") -> int:
    """Time both levels with ``measure()`` and fill ``sec``; returns the level to ship."""
    from quantkit.evaluate.latency import load_average

    load = {"start": load_average()}
    rows, what = measure()
    what += scope
    load["end"] = load_average()
    scores = {k: _score(v) for k, v in rows.items()}
    alt = str(ALTERNATIVE_LEVEL)
    chosen = ALTERNATIVE_LEVEL if scores[alt] < scores[str(BUILD_LEVEL)] else BUILD_LEVEL
    other = BUILD_LEVEL if chosen == ALTERNATIVE_LEVEL else ALTERNATIVE_LEVEL
    sec.update(accuracy_level=chosen, how="measured", timed=what, load_average=load,
               measured={k: {**{a: float(b) for a, b in v.items()}, "geomean_ms": scores[k]} for k, v in rows.items()},
               why=(f"measured on this CPU (class {target_class}), both levels interleaved: {what}; level {chosen} "
                    f"has the lower geometric mean of its times ({scores[str(chosen)]:.3f} ms vs "
                    f"{scores[str(other)]:.3f} ms at level {other})"))
    log.info("MatMulNBits accuracy_level %d chosen for %s: geometric mean %.3f ms vs %.3f ms at level %d",
             chosen, target_class, scores[str(chosen)], scores[str(other)], other)
    return chosen


def choose_for_file(path: str | os.PathLike[str], setting: int | str, target_class: str, *, isa: str = "auto",
                    latency_on: bool, settings: Any = None, progress: bool = True,
                    blocks: int | None = None) -> dict[str, Any] | None:
    """Decide the level of the built model file ``path`` (built at :func:`build_level`) and leave the shipped
    graph at ``path``; returns the report's ``int4_kernel`` section, or None when it has no ``MatMulNBits``.

    Both graphs of a measurement share ``path``'s external weight file; the one not shipped is removed.
    ``blocks``: a decoder built by quantkit is timed on its first ``blocks`` blocks only (both levels cut alike by
    :func:`~quantkit.evaluate.streamed.truncate_decoder`, which load only those blocks' weights): the streamed run
    never holds the whole quantized model twice, whatever its size; None times the whole graph."""
    from quantkit.progress import stage

    t0 = time.perf_counter()
    q = Path(path)
    nodes = nbits_nodes(onnx.load(str(q), load_external_data=False))
    if not nodes:
        return None
    sec = _section(nodes, setting, target_class, isa)
    data = q.with_name(q.name + ".data")
    size = q.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    layers = _decoder_layers(q) if blocks else None
    cut = blocks if layers and blocks and blocks < layers else None
    if cut:  # two sessions of the cut graphs: about cut / layers of the block weights each
        size = int(size * cut / layers) if layers else size
    level, how, short, why = _plan(setting, target_class, isa, latency_on, 2 * size)
    sec.update(accuracy_level=level, how=how, not_measured=short or None, why=why)
    if how == "measured":
        sibling = write_level_sibling(q, ALTERNATIVE_LEVEL)
        timed = {str(BUILD_LEVEL): q, str(ALTERNATIVE_LEVEL): sibling}
        cuts: list[Path] = []
        try:
            if cut:
                from quantkit.evaluate.streamed import truncate_decoder

                for lv, p in list(timed.items()):
                    cuts.append(truncate_decoder(p, cut, q.with_name(f"{q.stem}.level-{lv}.first-{cut}-blocks.onnx")))
                    timed[lv] = cuts[-1]
            scope = f" on the first {cut} of {layers} blocks" if cut else ""
            with stage(f"time MatMulNBits accuracy_level {BUILD_LEVEL} vs {ALTERNATIVE_LEVEL} on this CPU{scope}",
                       enabled=progress):
                level = _decide(sec, lambda: measure_levels({k: str(v) for k, v in timed.items()}, settings),
                                target_class, scope=scope)
            if cut:
                sec["blocks"] = {"measured": cut, "of": layers}
            if level == ALTERNATIVE_LEVEL:
                os.replace(sibling, q)
        finally:
            sibling.unlink(missing_ok=True)
            for c in cuts:
                c.unlink(missing_ok=True)
    elif level != build_level(setting):
        os.replace(write_level_sibling(q, level), q)
    _shipped(sec, level, build_level(setting))
    sec["time_s"] = time.perf_counter() - t0
    return sec


def choose_for_model(model: ir.Model, proto: onnx.ModelProto, setting: int | str, target_class: str, *,
                     isa: str = "auto", latency_on: bool, settings: Any = None,
                     feed: Callable[[], Mapping[str, np.ndarray]] | None = None, progress: bool = True,
                     decided: Mapping[str, Any] | None = None) -> tuple[onnx.ModelProto, dict[str, Any] | None]:
    """:func:`choose_for_file` for a model held in memory (the whole-graph path): ``model`` and its ``proto``
    (built at :func:`build_level`) are set to the shipped level; returns the shipped proto and the section.
    ``feed``: for a model that is no causal LM, what gives the latency feed (one call on it is timed, and it is
    asked for only then); None for a causal LM.  ``decided``: the section of an earlier run of the same model (a
    latency guard's re-run with some other layers in float), whose level is kept, not timed again."""
    from quantkit.progress import stage

    t0 = time.perf_counter()
    nodes = nbits_nodes(proto)
    if not nodes:
        return proto, None
    sec = _section(nodes, setting, target_class, isa)
    if decided and decided.get("accuracy_level") is not None:
        sec.update({k: v for k, v in decided.items() if k in ("how", "not_measured", "why", "measured", "timed",
                                                               "load_average")},
                   accuracy_level=int(decided["accuracy_level"]), reused=True)
        level, how = sec["accuracy_level"], "reused"
    else:
        level, how, short, why = _plan(setting, target_class, isa, latency_on, 2 * proto_size(proto))
        sec.update(accuracy_level=level, how=how, not_measured=short or None, why=why)
    alt = proto
    if how == "measured" or level != build_level(setting):
        alt = onnx.ModelProto()
        alt.CopyFrom(proto)
        set_accuracy_level(alt, ALTERNATIVE_LEVEL if how == "measured" else level)
    if how == "measured":
        with stage(f"time MatMulNBits accuracy_level {BUILD_LEVEL} vs {ALTERNATIVE_LEVEL} on this CPU",
                   enabled=progress):
            level = _decide(sec, lambda: measure_levels(
                {str(BUILD_LEVEL): proto.SerializeToString(), str(ALTERNATIVE_LEVEL): alt.SerializeToString()},
                settings, None if feed is None else feed()), target_class)
    shipped = proto
    if level != build_level(setting):
        set_model_accuracy_level(model, level)
        shipped = alt
    _shipped(sec, level, build_level(setting))
    sec["time_s"] = time.perf_counter() - t0
    return shipped, sec


def _shipped(sec: dict[str, Any], level: int, built: int) -> None:
    """``sec["shipped"]``: kernels per level in the shipped graph (the graph as built - where a layer may have been
    kept at another level than the build level - or every kernel at ``level`` when it was rewritten)."""
    sec["shipped"] = dict(sec["as_built"]) if level == built else {str(level): sec["kernels"]}
