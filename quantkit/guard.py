"""Never slower than FP32: float islands chosen by measured latency, robustly.

An int8 kernel is not always faster than its float twin on a given CPU: ONNX Runtime's int8 convolution over
3 input channels (a CNN's stem) runs ~4x slower than the float NCHWc one on x86 (AVX512-VNNI: 311 vs 82 us on
MobileNetV3-Small), int8 depthwise convolutions are often slower than float ones, and a float convolution
absorbs its activation for free where the int8 chain pays a ``QLinearAdd`` + ``QLinearMul`` per HardSwish
(see ``docs/int8-lowering.md``).  For a static-INT8 plan with GEMM-like int8 layers (Conv, Gemm, MatMul) this
guard, on by default (``report.latency.guard``):

1. **profiles per region**, FP32 against int8, in :data:`PROFILE_ROUNDS` interleaved rounds (ONNX Runtime's
   profiler, per node: :mod:`quantkit.search.profile`).  A layer's *region* is the layer, the nodes after it
   that read only its output (its activation, a HardSwish's ``Add`` + ``Mul``, a pool) up to the next
   GEMM-like node, and the ``QuantizeLinear`` that feeds it from a float producer or a graph input
   (:func:`layer_regions`): what keeping the layer in float would remove.  A region is *slower in int8* only
   when its int8 time exceeds its float time in **every** round (:func:`slow_regions`);
2. builds at most three candidates - the slower regions where an int8 chain *starts* (their region holds the
   QuantizeLinear of their input: in float they also drop that Q, and the Q of their output replaces it, so
   they add no float island inside a chain; typically the stem), then all slower regions - each only when it
   removes at least :data:`AB_MARGIN` of the int8 model's kernel time (less could not pass the A/B below), the
   second only when it removes that much more than the first (it could replace a winning first candidate only
   by beating it by the margin; an A/B of a third model costs a third more rounds of timing); and a *float
   prefix* (:func:`float_prefix`): the first layers in graph order, up to the cut that removes the most profiled
   time (the sum of int8 minus float region times before it) among the cuts one tensor crosses
   (:func:`single_input_cuts`: block boundaries, one QuantizeLinear and no DequantizeLinear left on a skip), the
   last layer int8, tried whenever it removes :data:`AB_MARGIN` of the kernel time, even less than the
   candidates above - a model whose early, large activations cost more in int8 elementwise passes than its
   convolutions save (a squeeze-excite / HardSwish CNN: its float stem and first blocks, then one QuantizeLinear
   and an int8 tail; float islands inside an int8 chain lose there, each adding layout Transposes the profile
   does not charge them).
   Each candidate is the same plan with those layers kept in float (lowered only, reusing the calibrated ranges
   in memory; chain rules keep the float island's glue in float too), plus the int8 chains that this leaves
   *stranded* and that measured no faster in int8 than in float (:func:`stranded_layers`: a squeeze-excite
   branch between float convolutions); a candidate whose ONNX Runtime graph holds more stray Q/DQ than the
   all-int8 model's is dropped.  The rest are **timed against the all-int8
   model** in one A/B of :data:`AB_ROUNDS` interleaved rounds (:func:`ab_compare`); a candidate is faster only
   when it wins at least :data:`AB_MIN_WINS` of the rounds *and* its median time is at least :data:`AB_MARGIN`
   below the all-int8 one (when none passes but one won a majority of the rounds by the margin, the A/B runs
   :data:`AB_EXTRA_ROUNDS` more rounds and judges all of them: 15 of 20, the same sign-test level);
   the smaller winner ships unless the larger one beats it by the same rule (ties go
   to fewer float layers); it is re-run in full (census, kernel check, evaluation) and ships; a tie with the
   all-int8 model keeps the all-int8 model (the default);
3. when the model it would ship was still measured slower than FP32, times it against the FP32 model by the
   same rule and, when FP32 wins, ships every layer in float (:func:`_finish`: no int8 layout tried is faster on
   this CPU; not when the recipe states a size target, which only int8 meets);
4. records everything in the report (``latency_guard``: per-region times and ratios, the A/B rounds, the
   fallback's rounds, the decision and why).

Determinism: what ships is decided by measurements, so the rules are built to give the same answer on every
run in normal conditions (an unloaded or evenly loaded machine).  A region is a candidate only on a
unanimous per-round verdict, and the A/B takes a sign test plus a margin, so a layer whose int8 and float
times are within the noise is never flipped back and forth - ties go to the all-int8 model.  The decision is
also cached (``<cache>/guard/``), keyed by the sha256 of the all-int8 model, the CPU, the ONNX Runtime version,
the thread count and the feed shape: a rerun on the same machine that builds the same int8 model ships the
same float layers without measuring again (``--no-cache`` measures afresh).  Nothing is decided by model name
or by a constant tuned to one model: the verdict is this CPU's measured per-region comparison.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from quantkit.staging import StageArea

log = logging.getLogger("quantkit")

__all__ = [
    "AB_ALPHA", "AB_EXTRA_ROUNDS", "AB_MARGIN", "AB_MIN_WINS", "AB_ROUNDS", "GEMM_LIKE", "PROFILE_ROUNDS", "TOTAL",
    "ab_compare", "wins_needed",
    "apply_latency_guard", "float_prefix", "layer_regions", "layer_times", "single_input_cuts", "slow_int8_layers",
    "slow_regions", "stranded_layers",
]

GEMM_LIKE = ("Conv", "Gemm", "MatMul")

PROFILE_ROUNDS = 3
"""Interleaved profile rounds (FP32, int8, FP32, int8, ...): a region is slower in int8 only when it is in every
round (a one-sided sign test at 1/8 for a region whose two times are equal, before the A/B confirms it)."""
PROFILE_RUNS = 10
"""Measured runs per profile (after 3 warm-up runs); each round's node time is the median over them."""
AB_ROUNDS = 10
"""Interleaved rounds of the final A/B (all-int8 against the candidates; FP32 joins only when the run measured no
latency of its own, else a candidate's speedup over FP32 is the run's all-int8 speedup over its A/B ratio)."""
AB_MIN_WINS = 8
"""Rounds of :data:`AB_ROUNDS` the guarded model must win (sign test: 8 of 10 happens by chance with
probability 0.055 when the two models are equally fast)."""
AB_MARGIN = 0.02
"""... and its median time must be at least this fraction below the all-int8 model's."""
AB_ALPHA = 0.055
"""The sign test's level: a candidate must win ``k`` of ``n`` rounds with ``P(X >= k | n, 1/2) <= AB_ALPHA`` (8 of
10, 15 of 20); :func:`wins_needed`."""
AB_EXTRA_ROUNDS = AB_ROUNDS
"""When no candidate passed but one won a majority of the rounds by a median margin (an A/B blurred by a loaded
machine: seen on MobileNetV3-Small, the stem in float 0.87x the all-int8 time yet 7 of 10 wins, three rounds
hit by 10 ms stalls), the A/B runs this many more rounds and judges all of them at once (15 of 20)."""


def wins_needed(rounds: int) -> int:
    """The fewest wins of ``rounds`` that a one-sided sign test accepts at :data:`AB_ALPHA`."""
    from math import comb

    tail = 0.0
    for k in range(rounds, -1, -1):
        tail += comb(rounds, k) / 2.0**rounds
        if tail > AB_ALPHA:
            return k + 1
    return 0


def layer_regions(model: Any, layers: Iterable[str], int8_nodes: Iterable[str] = ()) -> dict[str, list[str]]:
    """``layer -> names of the nodes whose cost goes with it`` in ``model`` (the prepared float graph, whose node
    names the quantized model keeps): the layer itself, every node downstream whose activation inputs all come
    from the layer's region (its activation, HardSwish's ``HardSigmoid`` + ``Mul``, a pool, a reshape), up to the
    next GEMM-like node; and ``<tensor>_QuantizeLinear``, the quantization of its input when the int8 chain starts
    at the layer (the input is a graph input, or its producer is not one of ``int8_nodes`` nor a Relu/Clip
    after one)."""
    from quantkit.lowering.select import constant_array
    from quantkit.ops import ABSORBABLE

    wanted = set(layers)
    quantized = set(int8_nodes) | wanted
    regions: dict[str, list[str]] = {name: [name] for name in wanted}
    owner: dict[int, str] = {}
    for node in model.graph:
        name = node.name or ""
        if name in wanted:
            x = node.inputs[0] if node.inputs else None
            p = x.producer() if x is not None else None
            if p is not None and p.op_type in ABSORBABLE and p.inputs and p.inputs[0] is not None:
                p = p.inputs[0].producer() or p
            if x is not None and x.name and (p is None or (p.name or "") not in quantized):
                regions[name].append(f"{x.name}_QuantizeLinear")
            for v in node.outputs:
                owner[id(v)] = name
            continue
        if node.op_type in GEMM_LIKE:
            continue
        owners = {owner.get(id(v)) for v in node.inputs if v is not None and constant_array(v) is None}
        if len(owners) == 1 and None not in owners:
            o = owners.pop()
            assert o is not None
            regions[o].append(name)
            for v in node.outputs:
                owner[id(v)] = o
    return regions


def _region_ms(prof: Any, regions: Mapping[str, list[str]], aliases: Mapping[str, str] | None) -> dict[str, float]:
    names = sorted({n for r in regions.values() for n in r})
    by_node = prof.by_layer(names, aliases=aliases)
    return {layer: sum(by_node.get(n, 0.0) for n in nodes) for layer, nodes in regions.items()}


TOTAL = "<int8 model>"
"""Key of :func:`region_times` for the quantized model's whole kernel time (the sum of its node medians)."""


def region_times(float_bytes: bytes | str, quant_bytes: bytes | str, float_model: Any, layers: list[str],
                 feed: dict[str, Any], *, threads: int | None, rounds: int = PROFILE_ROUNDS,
                 runs: int = PROFILE_RUNS, int8_nodes: Iterable[str] = ()) -> dict[str, list[tuple[float, float]]]:
    """``layer -> [(fp32 ms, int8 ms) per round]``: each round profiles the float and the quantized model once
    (interleaved) and sums the median kernel times of each layer's region (:func:`layer_regions`); under
    :data:`TOTAL`, both models' whole kernel time.  Stops after a round that leaves no region slower in int8 in
    every round so far (:func:`slow_regions` could find none: the verdict is the same, a third of the time)."""
    from quantkit.search.cost import output_aliases
    from quantkit.search.profile import profile_model

    regions = layer_regions(float_model, layers, int8_nodes)
    aliases = output_aliases(float_model, sorted({n for r in regions.values() for n in r}))
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in [*layers, TOTAL]}
    for _ in range(rounds):
        pf = profile_model(float_bytes, feed, runs=runs, warmup=3, threads=threads)
        pq = profile_model(quant_bytes, feed, runs=runs, warmup=3, threads=threads)
        f, q = _region_ms(pf, regions, aliases), _region_ms(pq, regions, None)
        for name in layers:
            out[name].append((f[name], q[name]))
        out[TOTAL].append((pf.node_sum_ms, pq.node_sum_ms))
        if not any(all(q > f > 0.0 for f, q in out[name]) for name in layers):
            break  # no region slower in int8 in every round so far: later rounds cannot make one unanimous
    return out


def slow_regions(times: Mapping[str, list[tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """The layers whose region took longer in int8 than in float in every round, with the median times."""
    slow = {}
    for name, rows in times.items():
        if name != TOTAL and rows and all(f > 0.0 and q > f for f, q in rows):
            slow[name] = (float(np.median([f for f, _ in rows])), float(np.median([q for _, q in rows])))
    return slow


def layer_times(float_bytes: bytes | str, quant_bytes: bytes | str, float_model: Any, layers: list[str],
                feed: dict[str, Any], *, threads: int | None, runs: int = 20) -> dict[str, tuple[float, float]]:
    """``layer -> (fp32 ms, int8 ms)``: the median time of each layer's region (:func:`layer_regions`) in the
    float and in the quantized model, one profile each."""
    times = region_times(float_bytes, quant_bytes, float_model, layers, feed, threads=threads, rounds=1, runs=runs)
    return {name: rows[0] for name, rows in times.items() if name != TOTAL}


def slow_int8_layers(float_bytes: bytes | str, quant_bytes: bytes | str, float_model: Any, layers: list[str],
                     feed: dict[str, Any], *, threads: int | None, runs: int = PROFILE_RUNS,
                     rounds: int = PROFILE_ROUNDS) -> dict[str, tuple[float, float]]:
    """The layers whose region is slower in int8 than in float in every one of ``rounds`` profiles
    (:func:`region_times`, :func:`slow_regions`), with their median ``(fp32 ms, int8 ms)``."""
    return slow_regions(region_times(float_bytes, quant_bytes, float_model, layers, feed, threads=threads,
                                     rounds=rounds, runs=runs))


def single_input_cuts(model: Any, layers: Iterable[str]) -> set[str]:
    """The layers of ``layers`` at which the graph (``model``, topologically sorted) can be cut with one tensor
    crossing: the layer's own input is the only activation computed before it and read at or after it (a block
    boundary of a CNN - not inside a residual or squeeze-excite block, not between a convolution and its
    activation).  A float prefix cut there needs one QuantizeLinear and no DequantizeLinear."""
    from quantkit.lowering.select import constant_array

    nodes = list(model.graph)
    pos = {id(n): i for i, n in enumerate(nodes)}
    crossing = [0] * (len(nodes) + 1)
    values: dict[int, Any] = {}
    for n in nodes:
        for v in n.inputs:
            if v is not None and constant_array(v) is None:
                values[id(v)] = v
    for v in values.values():
        p = v.producer()
        start = pos[id(p)] + 1 if p is not None and id(p) in pos else 0
        users = [pos[id(u)] for u, _ in v.uses() if id(u) in pos]
        if not users:
            continue
        crossing[start] += 1  # a difference array: + at the first position the value is live, - after its last use
        crossing[max(users) + 1] -= 1
    live = np.cumsum(crossing)
    wanted = set(layers)
    return {n.name or "" for i, n in enumerate(nodes) if (n.name or "") in wanted and live[i] == 1}


def float_prefix(layers: list[str], medians: Mapping[str, tuple[float, float]],
                 cuts: set[str] | None = None) -> tuple[list[str], float]:
    """The first layers of ``layers`` (graph order) to keep in float and the profiled time that removes: the cut
    ``k`` that maximises ``sum(int8 - fp32)`` over the regions before it (``medians``: ``layer -> (fp32 ms, int8
    ms)``), the last layer always int8 (every layer in float is the FP32 fallback's case) and, with ``cuts``
    (:func:`single_input_cuts`), the first int8 layer one of them; ``([], 0.0)`` when no cut removes time."""
    best = run = 0.0
    k = 0
    for i, name in enumerate(layers[:-1], 1):
        f, q = medians.get(name, (0.0, 0.0))
        run += q - f
        if run > best and (cuts is None or layers[i] in cuts):
            best, k = run, i
    return layers[:k], best


AB_ROUND_MS = 20.0
"""Each model's share of an A/B round lasts at least this long: a 1 ms model runs ~20 times per round, not 3 (the
median of 3 sub-millisecond runs is the scheduler's jitter: a squeeze-excite CNN's stem in float, 0.83x the all-int8
time, won only 14 of 20 such rounds)."""


def ab_compare(blobs: Mapping[str, bytes | str], feed: dict[str, Any], *, threads: int | None, rounds: int = AB_ROUNDS,
               per_round: int = 3, warmup: int = 3, max_per_round: int = 50,
               stop: Callable[[Mapping[str, list[float]]], bool] | None = None) -> dict[str, list[float]]:
    """``name -> [median ms of each round]``: every model run ``per_round`` times per round - more for a fast
    model, up to ``max_per_round``, so that the slowest of them fills :data:`AB_ROUND_MS` - the models interleaved
    in each round (so that machine noise hits them alike) and their order rotated between rounds; the sessions'
    threads stop spinning when a run returns (:func:`quantkit.evaluate.latency.make_session`), so a round's first
    runs are not slowed by the previous model's threads.  ``stop``: asked
    after each round with the rounds so far; True ends the comparison there (the verdict is already certain)."""
    from quantkit.evaluate.latency import make_session, settle

    # threads that stop spinning when a run ends (make_session's default): a session spinning on slowed the next
    # one's first runs for ~50 ms, which made every round's median of a few runs bimodal (24 or 15 ms for the same
    # model on 2 cores)
    sessions = {k: make_session(b, threads=threads) for k, b in blobs.items()}
    slowest = 0.0
    for s in sessions.values():
        last = 0.0
        for _ in range(warmup):
            t0 = time.perf_counter()
            s.run(None, dict(feed))
            last = (time.perf_counter() - t0) * 1e3
        slowest = max(slowest, last)  # the last warm-up run of each
    if slowest > 0.0:
        per_round = max(per_round, min(max_per_round, int(np.ceil(AB_ROUND_MS / slowest))))
    names = list(sessions)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            settle(sessions[k], feed)  # untimed: the caches refill after the other models ran
            ts = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                sessions[k].run(None, dict(feed))
                ts.append((time.perf_counter() - t0) * 1e3)
            out[k].append(float(np.median(ts)))
        if stop is not None and r + 1 < rounds and stop(out):
            break
    return out


def hopeless(ab: Mapping[str, list[float]], candidates: Iterable[str], rounds: int = AB_ROUNDS) -> bool:
    """Every candidate has lost at least half of ``rounds`` against ``int8`` already: none can pass the sign test
    (:data:`AB_MIN_WINS` of ``rounds``) nor win the majority that earns extra rounds (:func:`_inconclusive`), so the
    remaining rounds cannot change the verdict."""
    i8 = ab.get("int8") or []
    half = (rounds + 1) // 2
    return bool(i8) and all(sum(1 for a, b in zip(i8, ab[k], strict=False) if b >= a) >= half for k in candidates)


def ab_verdict(int8_ms: list[float], guarded_ms: list[float]) -> tuple[bool, int, float]:
    """``(guarded is faster, rounds it won, median of its per-round time ratios to all-int8)``: faster means at
    least :func:`wins_needed` wins of the rounds run (:data:`AB_MIN_WINS` of :data:`AB_ROUNDS`) and a median ratio
    at most ``1 - AB_MARGIN``."""
    ratios = [g / i for i, g in zip(int8_ms, guarded_ms, strict=True) if i > 0]
    wins = sum(1 for r in ratios if r < 1.0)
    need = wins_needed(len(ratios))
    med = float(np.median(ratios)) if ratios else 1.0
    return bool(ratios) and wins >= need and med <= 1.0 - AB_MARGIN, wins, med


def _cache_path(quant_digest: str, feed: Mapping[str, Any], threads: int | None) -> Any:
    import onnxruntime as ort

    from quantkit.frontends.cache import cache_dir
    from quantkit.search.cost import _cpu

    key = json.dumps({"model": quant_digest, "cpu": _cpu(), "cores": os.cpu_count(),
                      "ort": ort.__version__, "threads": threads,
                      "feed": {k: list(np.shape(v)) for k, v in sorted(feed.items())}, "version": 1},
                     sort_keys=True)
    return cache_dir() / "guard" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _load_decision(path: Any) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("float_layers"), list) else None


def _save_decision(path: Any, record: Mapping[str, Any]) -> None:
    from quantkit.frontends.cache import atomic_write_bytes

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(record, sort_keys=True, default=str).encode())
    except OSError as exc:
        log.warning("cannot write the latency guard's decision to %s (%s); carrying on", path, exc)


def _ms(rows: list[float]) -> float:
    return float(np.median(rows)) if rows else float("nan")


def apply_latency_guard(result: Any, rerun: Callable[[Any], Any], feed: dict[str, Any], *,
                        float_bytes: bytes | str, use_cache: bool = True,
                        lower: Callable[[Any], Any] | None = None, stage_area: StageArea | None = None) -> Any:
    """The guard of the module doc.  ``result``: a :class:`quantkit.run.QuantizeResult` of the recipe's plan;
    ``rerun(plan)`` executes another plan the same way (lowering, census, kernel check, evaluation, report);
    ``lower(plan)``, when given, only lowers it (the ``onnx_ir`` model): the A/B times that candidate and only
    a winner is re-run in full; ``feed``: the latency feed; ``float_bytes``: the float model, serialized or a
    path.  ``stage_area``: where the quantized models are staged for the sessions (:mod:`quantkit.staging`;
    None: serialized).  Returns the result to ship (``result`` itself, or the rerun with the slower layers in
    float), with ``latency_guard`` in its report."""
    rec = result.recipe
    if not rec.report.latency.guard or result.precision is None:
        return result
    layers = [n for n, lp in result.plan.layers.items() if lp.op_type in GEMM_LIKE and lp.format == "int8"]
    if not layers:
        return result
    import onnx_ir as ir

    threads = rec.report.latency.threads

    def source(model: Any, stem: str) -> tuple[bytes | str, str]:  # what a session opens, and its content hash
        if stage_area is None:
            blob = ir.to_proto(model).SerializeToString()
            return blob, hashlib.sha256(blob).hexdigest()
        staged = stage_area.stage(model, stem)
        return staged.path, stage_area.digest(staged)

    quant_bytes, quant_digest = source(result.model, "quantized-")
    path = _cache_path(quant_digest, feed, threads)
    cached = _load_decision(path) if use_cache else None
    record: dict[str, Any]
    if cached is not None and set(cached["float_layers"]) <= set(result.plan.layers):
        record = {**cached, "cached": str(path)}
        # the earlier run's own measurement is not this run's: the report has this run's under latency
        own = r"the shipped model's own latency measurement: [0-9.]+x FP32"
        record["decision"] = re.sub(rf"; {own}| \({own}\)", "", str(record.get("decision", ""))) + (
            " (decided by an earlier run on this machine)")
        record.pop("shipped_measured_speedup", None)
        float_layers = list(cached["float_layers"])
        log.info("latency guard: the decision for this int8 model on this machine is cached (%s): %s", path,
                 f"{len(float_layers)} layer(s) in float" if float_layers else "all layers int8")
        if not float_layers:
            result.report["latency_guard"] = record
            return result
        second = rerun(_float_plan(result, float_layers))
        second.report["latency_guard"] = record
        if (record.get("fallback") or {}).get("fp32_faster"):
            second.report.setdefault("warnings", []).append(f"latency guard (cached): {record['decision']}")
        return second

    t0 = time.perf_counter()
    int8_nodes = _int8_nodes(result.plan)
    times = region_times(float_bytes, quant_bytes, result.float_model, layers, feed, threads=threads,
                         int8_nodes=int8_nodes)
    slow = slow_regions(times)
    record = {
        "rule": (f"region slower in int8 than in float in all {PROFILE_RUNS}-run profiles of {PROFILE_ROUNDS} "
                 f"rounds; a candidate (the slower regions where an int8 chain starts, then all slower regions; and "
                 f"the float prefix that removes the most profiled time) is "
                 f"tried when it removes >= {AB_MARGIN:.0%} of the int8 kernel time (the second that much more than the "
                 f"first), and ships when it wins >= "
                 f"{AB_MIN_WINS} of {AB_ROUNDS} interleaved rounds against the all-int8 model by a median margin "
                 f">= {AB_MARGIN:.0%} ({wins_needed(AB_ROUNDS + AB_EXTRA_ROUNDS)} of {AB_ROUNDS + AB_EXTRA_ROUNDS} "
                 f"when the first {AB_ROUNDS} were a majority short of that; the A/B stops as soon as every "
                 f"candidate has lost half of the {AB_ROUNDS} rounds)"),
        "slower_int8_layers": {k: {"fp32_ms": v[0], "int8_ms": v[1],
                                   "rounds": [[round(f, 4), round(q, 4)] for f, q in times[k]]}
                               for k, v in sorted(slow.items())},
        "first_speedup": (result.report.get("latency") or {}).get("speedup"),
        "profile_rounds": len(times[TOTAL]),  # fewer than PROFILE_ROUNDS when a round left no region slower
    }
    total = float(np.median([q for _, q in times[TOTAL]]))
    record["int8_kernel_ms"] = total
    regions = layer_regions(result.float_model, sorted(slow), int8_nodes)
    entry = sorted(k for k in slow if any(n.endswith("_QuantizeLinear") for n in regions[k]))
    medians = {k: (float(np.median([f for f, _ in v])), float(np.median([q for _, q in v])))
               for k, v in times.items() if k != TOTAL}
    candidates: dict[str, list[str]] = {}
    stranded: dict[str, list[str]] = {}
    smaller = 0.0  # the excess of the smaller candidate kept: a larger one must add the margin to it
    for key, names in (("chain_entry", entry), ("all_slower", sorted(slow))):
        excess = sum(slow[k][1] - slow[k][0] for k in names)
        if not names or excess < AB_MARGIN * total:
            continue
        if candidates and excess - smaller < AB_MARGIN * total:
            # it could replace the smaller winner only by beating it by the margin (below): it is not timed
            record.setdefault("not_tried", {})[key] = (
                f"{len(names)} region(s) remove {excess:.3f} ms, {excess - smaller:.3f} ms more than the smaller "
                f"candidate: less than the A/B margin ({AB_MARGIN:.0%} of {total:.3f} ms)")
            continue
        smaller = excess
        extra = stranded_layers(result.float_model, _float_plan(result, names), medians)
        full = sorted({*names, *extra})
        if full not in candidates.values():
            candidates[key] = full
            stranded[key] = sorted(extra)
    # the float prefix: tried whenever it removes the margin, even less than the candidates above - their float
    # islands inside int8 chains add layout Transposes the profile does not charge them (a squeeze-excite CNN:
    # every island measured slower, the prefix faster); not when it is a set the rules above built already
    prefix, gain = float_prefix(layers, medians, single_input_cuts(result.float_model, layers))
    if prefix and gain >= AB_MARGIN * total and sorted(prefix) not in (entry, sorted(slow)):
        extra = stranded_layers(result.float_model, _float_plan(result, prefix), medians)
        full = sorted({*prefix, *extra})
        if full not in candidates.values():
            candidates["float_prefix"] = full
            stranded["float_prefix"] = sorted(extra)
    record["candidates"] = {k: {"float_layers": v, "stranded": stranded[k],
                                "excess_ms": (sum(slow[n][1] - slow[n][0] for n in v if n in slow)
                                              if k != "float_prefix" else
                                              sum(medians[n][1] - medians[n][0] for n in v if n in medians))}
                            for k, v in candidates.items()}
    if not candidates:
        excess = sum(q - f for f, q in slow.values())
        record.update(float_layers=[], decision=(
            "no layer's region measured slower in int8 than in float in every round: the model is kept as built"
            if not slow else
            f"kept all layers int8: the {len(slow)} region(s) slower in int8 add {excess:.3f} ms to the int8 model's "
            f"{total:.3f} ms of kernels, less than the A/B margin ({AB_MARGIN:.0%}) - nothing to try"))
        return _finish(result, result, quant_bytes, record["first_speedup"], record, float_bytes, feed, rerun,
                       t0, path if use_cache else None)
    log.info("latency guard: %d layer region(s) measured slower in int8 than in float in every round; trying in "
             "float: %s", len(slow), "; ".join(f"{k}: {', '.join(v[:6])}" for k, v in candidates.items()))
    built: dict[str, Any] = {}
    # FP32 joins the A/B only when the run measured no latency: otherwise a candidate's speedup over FP32 is the
    # run's measured all-int8 speedup scaled by its A/B ratio (FP32 in every round was ~40% of the A/B's time)
    first = record["first_speedup"]
    blobs: dict[str, bytes | str] = {"int8": quant_bytes} if first else {"fp32": float_bytes, "int8": quant_bytes}
    digests: dict[str, str] = {}
    base_stray = _stray_count(quant_bytes)
    for key, names in list(candidates.items()):
        plan = _float_plan(result, names)
        if lower is not None:
            blob, digests[key] = source(lower(plan), f"candidate-{key}-")
        else:
            built[key] = rerun(plan)
            blob, digests[key] = source(built[key].model, f"candidate-{key}-")
        n_stray = _stray_count(blob)
        if n_stray > base_stray:  # ORT's graph around the float layers would hold Q/DQ round trips: not shipped
            record["candidates"][key]["rejected"] = (f"{n_stray} stray Q/DQ in ONNX Runtime's graph (the all-int8 "
                                                     f"model has {base_stray})")
            del candidates[key]
            continue
        blobs[key] = blob
    if not candidates:
        record.update(float_layers=[], decision="kept all layers int8: every candidate left stray Q/DQ in ONNX "
                                                "Runtime's graph")
        return _finish(result, result, quant_bytes, record["first_speedup"], record, float_bytes, feed, rerun,
                       t0, path if use_cache else None)
    ab = ab_compare(blobs, feed, threads=threads, stop=lambda so_far: hopeless(so_far, list(candidates)))
    if len(ab["int8"]) < AB_ROUNDS:
        record["ab_stopped_early"] = (f"after {len(ab['int8'])} of {AB_ROUNDS} rounds: every candidate had lost "
                                      f"half of them")
    elif _inconclusive(ab, candidates):
        more = ab_compare(blobs, feed, threads=threads, rounds=AB_EXTRA_ROUNDS)
        ab = {k: v + more[k] for k, v in ab.items()}
    i8 = _ms(ab["int8"])
    f32 = _ms(ab["fp32"]) if "fp32" in ab else None
    i8_speedup = (f32 / i8 if i8 > 0 else None) if f32 is not None else float(first)
    record["ab"] = {"rounds_ms": {k: [round(x, 4) for x in v] for k, v in ab.items()}, "fp32_ms": f32,
                    "int8_ms": i8, "int8_speedup": i8_speedup,
                    "speedups_from": ("FP32 timed in the A/B" if f32 is not None else
                                      "the run's measured all-int8 speedup over FP32 divided by the A/B ratio")}
    best: tuple[float, str] | None = None
    for key in candidates:
        faster, wins, ratio = ab_verdict(ab["int8"], ab[key])
        gd = _ms(ab[key])
        speedup = ((f32 / gd if gd > 0 else None) if f32 is not None else
                   (i8_speedup / ratio if i8_speedup and ratio > 0 else None))
        record["ab"][key] = {"wins": wins, "median_ratio_to_int8": ratio, "ms": gd,
                             "speedup": speedup, "faster": faster}
        if not faster:
            continue
        if best is None:
            best = (ratio, key)
        else:  # a larger candidate replaces a smaller winner only when it beats it by the same rule
            beats, b_wins, b_ratio = ab_verdict(ab[best[1]], ab[key])
            record["ab"][key]["vs_" + best[1]] = {"wins": b_wins, "median_ratio": b_ratio, "faster": beats}
            if beats:
                best = (ratio, key)
    chosen = result
    if best is not None:
        key = best[1]
        names = candidates[key]
        chosen = built.get(key) or rerun(_float_plan(result, names))  # the full run (census, kernel check, ...)
        if source(chosen.model, "shipped-")[1] != digests[key]:
            log.warning("latency guard: the re-run built another model than the one timed (lowering is expected "
                        "to be deterministic); shipping the re-run, which is the one verified")
            record["rerun_differs_from_timed"] = True
        row = record["ab"][key]
        record["float_layers"] = names
        measured = ((getattr(chosen, "report", None) or {}).get("latency") or {}).get("speedup")
        every = set(layers) <= set(names)  # every int8 layer: the model ships as the float model
        detail = ([] if every else [f"estimated {_x(row['speedup'])} FP32 instead of {_x(i8_speedup)}: the first "
                                    "run's speedup over this A/B ratio"])
        if isinstance(measured, (int, float)):
            detail.append(f"the shipped model's own latency measurement: {measured:.2f}x FP32")
        record["decision"] = (
            (f"shipped in float (every layer: the {key} candidate holds all {len(layers)} int8 layers)" if every
             else f"shipped with {len(names)} layer(s) in float ({key})")
            + f": faster than all-int8 in {row['wins']} of {len(ab['int8'])} rounds, median "
            f"{row['median_ratio_to_int8']:.3f}x its time" + (f" ({'; '.join(detail)})" if detail else ""))
    else:
        record["float_layers"] = []
        record["decision"] = "kept all layers int8: " + "; ".join(
            f"{k} ({len(candidates[k])} layer(s) in float) won {record['ab'][k]['wins']} of {len(ab['int8'])} rounds, "
            f"median {record['ab'][k]['median_ratio_to_int8']:.3f}x the all-int8 time" for k in candidates
        ) + " - not faster by the rule"
    shipped = record["ab"][best[1]]["speedup"] if best is not None else i8_speedup
    return _finish(result, chosen, blobs[best[1]] if best is not None else quant_bytes, shipped, record,
                   float_bytes, feed, rerun, t0, path if use_cache else None)


def _finish(result: Any, chosen: Any, chosen_blob: bytes | str, speedup: float | None, record: dict[str, Any],
            float_bytes: bytes | str, feed: dict[str, Any], rerun: Callable[[Any], Any], t0: float,
            cache: Any) -> Any:
    """The guard's last step: when the model it would ship (``chosen``, serialized as ``chosen_blob``) was measured
    slower than FP32 (``speedup`` < 1: the run's own latency or the A/B's estimate), it is timed against the FP32
    model in an A/B of its own (:data:`AB_ROUNDS` rounds, the extra rounds when inconclusive); when FP32 wins by the
    same rule, every layer ships in float (:func:`_float_plan`: no Q/DQ left, the float model's weights) - no
    int8 layout tried was faster on this CPU - unless the recipe states a size target (``search.target.size``),
    which only int8 meets: then the slower model ships with the warning.  Records ``fallback`` and writes the
    decision (``cache``: its path, or None)."""
    rec = result.recipe
    measured = ((getattr(chosen, "report", None) or {}).get("latency") or {}).get("speedup")
    if isinstance(measured, (int, float)):
        record["shipped_measured_speedup"] = measured
    # the estimate (the A/B's ratio over the first run's speedup) or the shipped model's own measurement below
    # FP32: both are noisy on a model of a few ms, so FP32 and the shipped model are timed against each other
    suspects = [x for x in (speedup, measured) if isinstance(x, (int, float))]
    if suspects and min(suspects) < 1.0:
        target = (rec.search.target or {}) if rec.search is not None else {}
        if "size" in target:
            record["fallback"] = {"skipped": f"the recipe's size target ({target['size']}) needs int8 layers"}
        else:
            pair = {"shipped": chosen_blob, "fp32": float_bytes}
            ab = ab_compare(pair, feed, threads=rec.report.latency.threads)
            if _short_by_a_majority(ab["shipped"], ab["fp32"]):
                more = ab_compare(pair, feed, threads=rec.report.latency.threads, rounds=AB_EXTRA_ROUNDS)
                ab = {k: v + more[k] for k, v in ab.items()}
            faster, wins, ratio = ab_verdict(ab["shipped"], ab["fp32"])
            record["fallback"] = {"rounds_ms": {k: [round(x, 4) for x in v] for k, v in ab.items()},
                                  "fp32_wins": wins, "fp32_median_ratio": ratio, "fp32_faster": faster}
            if faster:
                # every quantized layer, whatever its format: a mixed plan's int8_dynamic / int4 / fp16 layers were
                # in the model FP32 beat too (keeping them would ship a model nobody timed, still slower)
                layers = _quantized_layers(result)
                names = sorted(layers)
                formats = sorted(set(layers.values()))
                chosen = rerun(_float_plan(result, names))
                record["float_layers"] = names
                record["decision"] = (
                    f"shipped in float (every layer, {len(names)}: {', '.join(formats)}): {record['decision']}, "
                    f"and that model was still "
                    f"slower than FP32 - FP32 was faster in {wins} of {len(ab['fp32'])} interleaved rounds, median "
                    f"{ratio:.3f}x its time; no int8 layout tried is faster on this CPU")
                speedup = 1.0 / ratio if ratio > 0 else None
                chosen.report.setdefault("warnings", []).append(
                    f"latency guard: {record['decision']}. The model is not quantized (size unchanged); to ship the "
                    f"int8 model anyway: report: {{latency: {{guard: false}}}}")
            else:  # the A/B of the two is the better figure than the estimate or one measurement
                speedup = ratio if ratio > 0 else speedup
    _attach(chosen, record, t0)
    if cache is not None:
        _save_decision(cache, record)
    if speedup is not None and speedup < 1.0 and not record.get("fallback", {}).get("fp32_faster"):
        chosen.report.setdefault("warnings", []).append(
            f"latency guard: {record['decision']}; still slower than FP32 on this CPU in its A/B "
            f"({speedup:.2f}x, see latency_guard)")
    log.info("latency guard: %s", record["decision"])
    return chosen


def _quantized_layers(result: Any) -> dict[str, str]:
    """``layer -> format`` of every layer the result's plan quantizes: the static-INT8 plan's layers and the
    layers the precision plan puts in a linear-only format (int4, int8_dynamic, fp16, ...) on an op it applies to."""
    from quantkit.lowering.select import layer_plan
    from quantkit.ops import LAYER_OPS

    out = {n: lp.format for n, lp in result.plan.layers.items() if lp.format != "fp32"}
    for node in result.float_model.graph:
        if node.name and node.name not in out and node.op_type in ("MatMul", "Gemm", "Conv"):
            fmt = layer_plan(result.precision, node).format
            if node.op_type in LAYER_OPS.get(fmt, ()):
                out[node.name] = fmt
    return out


def _x(speedup: float | None) -> str:
    return "?x" if speedup is None else f"{speedup:.2f}x"


def _short_by_a_majority(base_ms: list[float], other_ms: list[float]) -> bool:
    """``other`` did not pass the A/B against ``base`` but won more than half the rounds with a median ratio past
    the margin: the rounds are too few to tell (one more batch of rounds decides)."""
    faster, wins, ratio = ab_verdict(base_ms, other_ms)
    return not faster and 2 * wins > len(base_ms) and ratio <= 1.0 - AB_MARGIN


def _inconclusive(ab: Mapping[str, list[float]], candidates: Mapping[str, Any]) -> bool:
    """No candidate passed the A/B, but one is short of it by a majority (:func:`_short_by_a_majority`)."""
    if any(ab_verdict(ab["int8"], ab[k])[0] for k in candidates):
        return False
    return any(_short_by_a_majority(ab["int8"], ab[k]) for k in candidates)


def stranded_layers(float_model: Any, plan: Any, medians: Mapping[str, tuple[float, float]]) -> list[str]:
    """The GEMM-like layers still int8 under ``plan`` (a precision plan with some layers kept in float) whose
    int8 chain - the int8 nodes connected to them, directly or through a folded Relu/Clip - holds no layer that
    measured faster in int8 than in float (``medians``: layer -> (fp32 ms, int8 ms) of its region, in the
    all-int8 model): a chain that keeping its neighbours in float left stranded (a squeeze-excite branch
    between float convolutions) pays its QuantizeLinear and DequantizeLinear for nothing."""
    from quantkit.lowering.select import select
    from quantkit.ops import ABSORBABLE

    qplan = select(float_model, plan)
    int8 = _int8_nodes(qplan)
    parent: dict[str, str] = {n: n for n in int8}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in float_model.graph:
        name = node.name or ""
        if name not in int8:
            continue
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p.op_type in ABSORBABLE and p.inputs and p.inputs[0] is not None:
                p = p.inputs[0].producer() or p
            if p is not None and (p.name or "") in int8:
                parent[find(name)] = find(p.name or "")
    chains: dict[str, list[str]] = {}
    for name, lp in qplan.layers.items():
        if lp.op_type in GEMM_LIKE:
            chains.setdefault(find(name), []).append(name)
    out = []
    for members in chains.values():
        if all(m in medians and medians[m][1] >= medians[m][0] for m in members):
            out.extend(members)
    return sorted(out)


def _stray_count(blob: bytes | str) -> int:
    """Stray Q/DQ (:func:`quantkit.report.build.classify_leftovers`) in ONNX Runtime's optimized graph of a
    serialized model or a model file."""
    import onnx

    from quantkit.lowering.verify import census
    from quantkit.report.build import classify_leftovers

    model = blob if isinstance(blob, str) else onnx.load_from_string(blob)
    return sum(1 for _, kind in classify_leftovers(census(model)) if kind == "stray")


def _attach(result: Any, record: dict[str, Any], t0: float) -> None:
    """Put the guard's record (and its time, also under the report's timings) into ``result``'s report."""
    record["guard_s"] = round(time.perf_counter() - t0, 2)
    result.report["latency_guard"] = record
    result.report.setdefault("timings", {})["latency_guard_s"] = record["guard_s"]


def _int8_nodes(plan: Any) -> set[str]:
    """Every node the static-INT8 plan runs in int8 (layers, glue, rescales dropped, gates folded)."""
    return set(plan.layers) | set(plan.rescales) | set(plan.folded_gates) | set(plan.layer_biases)


def _float_plan(result: Any, layers: list[str], rule: str | None = None) -> Any:
    """The result's precision plan with ``layers`` kept in float (their rule: ``rule``, default :data:`RULE`)."""
    from quantkit.lowering.select import layer_plan

    wanted = set(layers)
    current = {k: lp for k, lp in result.plan.layers.items() if k in wanted}
    for node in result.float_model.graph:  # the layers of the other formats (not in the static-INT8 plan)
        if node.name in wanted and node.name not in current:
            current[node.name] = layer_plan(result.precision, node)
    return result.precision.choose({k: dataclasses.replace(lp, format="fp32", rule=rule or RULE)
                                    for k, lp in current.items()})


RULE = "latency guard"
"""The ``rule`` of a layer the guard put back in float (the report's plan table shows it)."""
