"""Measured per-node latency from ONNX Runtime's profiler, attributed to the model's layers.

``profile_model`` runs a model in an ONNX Runtime CPU session with profiling on
(the trace goes to a temporary directory, never the working directory), runs it
``warmup`` times and then ``runs`` times, and reads ORT's trace back:

* one ``"cat": "Node"`` event named ``<node>_kernel_time`` per kernel execution,
  with the operator in ``args.op_name`` — ``<node>`` is the node name **in the
  optimized graph** ORT executes, not necessarily a name of the original model;
* one ``"cat": "Session"`` event ``model_run`` per ``session.run`` call, whose
  interval contains that run's node events (ORT does not tag warm-up runs: the
  first ``warmup`` ``model_run`` intervals and the node events inside them are
  dropped); ``session_initialization`` / ``model_loading_*`` events are not node time.

What is measured (all durations are ORT's own, in microseconds, with the
profiler's small per-kernel overhead included):

* :class:`NodeTime` ``median_us`` — the median over the measured runs of the
  node's total kernel time within one run; ``calls`` — its kernel executions per
  run (1 for a plain node; more inside a ``Loop`` / ``Scan`` body);
* :class:`Profile` ``run_median_ms`` — the median ``model_run`` duration (a whole
  ``session.run``: kernels plus the executor's and the binding's overhead);
  ``node_sum_ms`` — the sum of the node medians. On a quiet machine
  ``run_median_ms - node_sum_ms`` approximates what is spent outside kernels; on a
  loaded one each node's median drops that node's preempted runs while the run
  median keeps them, so ``node_sum_ms`` can be far below ``run_median_ms`` (seen:
  5 ms vs 15 ms on two busy cores). Compare node times with node times.

Attributing optimized nodes to original layers (:meth:`Profile.by_layer`)
--------------------------------------------------------------------------
ORT keeps the original node name for a fused kernel (a ``DQ → Conv → Q`` group
becomes ``QLinearConv`` named after the Conv) and derives names from it with
suffixes: ``<name>_token_<n>`` (its unique-name generator; e.g. the NHWC
``QLinearConv`` of level ``"all"``) and ``<name>/<FusionName>`` (e.g.
``<matmul>/MatMulAddFusion``, ``<matmul>/MatMulScaleFusion/``); see
:mod:`quantkit.lowering.verify`. quantkit's own lowerings name the helper nodes of
a layer ``L`` as ``L/<something>`` (``L/act_absmax``, ``L/MatMulIntegerToFloat``).
A node therefore belongs to layer ``L`` when its name is ``L``, or starts with
``L + "/"``, or is ``L`` followed by ``_token_<n>`` suffixes (also before a ``/``);
the longest matching layer name wins; everything else (ORT's ``Transpose`` /
``Reshape`` of layout transforms, leftover Q/DQ, unlisted layers) goes to
``"<other>"``.

:func:`roofline` places a measured kernel on the roofline of a machine whose peaks
:func:`machine_peaks` measures with numpy.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from quantkit.errors import DataError, ModelError, RecipeError
from quantkit.lowering.verify import _derived_bases

__all__ = ["OTHER", "LEVELS", "NodeTime", "Profile", "machine_peaks", "profile_model", "roofline"]

OTHER = "<other>"
"""Key of :meth:`Profile.by_layer` for node time not attributed to any layer."""

LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
"""Graph optimization levels accepted by :func:`profile_model`."""

_KERNEL_SUFFIX = "_kernel_time"


@dataclass
class NodeTime:
    """Time of one node of the optimized graph.

    ``median_us``: median over the measured runs of the node's total kernel time in
    one run (µs). ``calls``: kernel executions per run (median over the runs).
    """

    name: str
    op_type: str
    median_us: float
    calls: int


@dataclass
class Profile:
    """Per-node times of one model at one optimization level and thread count.

    ``nodes`` maps optimized-graph node names to their :class:`NodeTime`;
    ``run_median_ms`` is the median wall time of a whole ``session.run`` (ORT's
    ``model_run`` events); ``node_sum_ms`` the sum of the node medians; ``level``
    and ``threads`` are the session settings (``threads`` None: ORT's default).
    """

    nodes: dict[str, NodeTime]
    run_median_ms: float
    node_sum_ms: float
    level: str
    threads: int | None

    def layer_of(self, node_name: str, layers: Iterable[str]) -> str:
        """The layer of ``layers`` that optimized node ``node_name`` belongs to, else ``"<other>"``."""
        return _attribute(node_name, set(layers))

    def by_layer(self, layers: Iterable[str], aliases: Mapping[str, str] | None = None) -> dict[str, float]:
        """Milliseconds per original layer (median node times summed), plus ``"<other>"``.

        Every name of ``layers`` is a key (0.0 when no node is attributed to it) and so
        is ``"<other>"``; the values add up to :attr:`node_sum_ms`.

        ``aliases`` maps other names (e.g. a layer's output tensor, or the output of the
        activation fused into it) to a layer: ORT's NCHWc transformer (AVX-512 float convs at
        ``"all"``) names its ``Conv`` ``<output tensor>_nchwc``, so a node that matches no layer
        is tried again with ``_token_<n>`` / ``_nchwc`` suffixes removed against ``aliases``.
        """
        layer_set = set(layers)
        out: dict[str, float] = dict.fromkeys(sorted(layer_set), 0.0)
        out[OTHER] = 0.0
        for node in self.nodes.values():
            layer = _attribute(node.name, layer_set)
            if layer == OTHER and aliases:
                base = re.sub(r"(_token_\d+)+$", "", node.name)
                base = base[: -len("_nchwc")] if base.endswith("_nchwc") else base
                layer = aliases.get(base, OTHER)
            out[layer] += node.median_us / 1000.0
        return out

    def by_op_type(self) -> dict[str, float]:
        """Milliseconds per operator type of the optimized graph, largest first."""
        totals: dict[str, float] = {}
        for node in self.nodes.values():
            totals[node.op_type] = totals.get(node.op_type, 0.0) + node.median_us / 1000.0
        return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _candidates(name: str) -> set[str]:
    """``name`` and the original names ORT or quantkit may have derived it from."""
    found = {name}
    for base in _derived_bases(name):
        found.add(base)
        found.update(_derived_bases(base))  # "L_token_2/Fusion" -> "L_token_2" -> "L"
    return found


def _attribute(node_name: str, layers: set[str]) -> str:
    matches = [candidate for candidate in _candidates(node_name) if candidate in layers]
    if not matches:
        return OTHER
    return max(matches, key=lambda candidate: (len(candidate), candidate))


def _check_settings(level: str, threads: int | None, runs: int, warmup: int) -> ort.GraphOptimizationLevel:
    if level not in LEVELS:
        raise RecipeError(f"unknown optimization level {level!r}; allowed: {', '.join(LEVELS)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise RecipeError(f"threads must be None (ORT default) or an integer >= 1, got {threads!r}")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise RecipeError(f"runs must be an integer >= 1, got {runs!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise RecipeError(f"warmup must be an integer >= 0, got {warmup!r}")
    return LEVELS[level]


def _model_source(model: bytes | str | os.PathLike[str]) -> bytes | str:
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"model file {str(path)!r} does not exist")
    return str(path)


def _check_feed(session: ort.InferenceSession, feed: Mapping[str, np.ndarray]) -> None:
    expected = [value.name for value in session.get_inputs()]
    overridable = {value.name for value in session.get_overridable_initializers()}
    missing = [name for name in expected if name not in feed]
    unknown = [name for name in feed if name not in expected and name not in overridable]
    if missing or unknown:
        raise DataError(
            f"feed does not match the model inputs: missing {missing}, unknown {unknown}; "
            f"model inputs: {', '.join(expected)}"
        )


def _parse_trace(events: list[dict[str, Any]], warmup: int, runs: int) -> tuple[dict[str, NodeTime], float]:
    """Node times and median run time (ms) of the measured runs in ORT's trace ``events``."""
    run_spans = sorted(
        (int(event["ts"]), int(event["ts"]) + int(event["dur"]))
        for event in events
        if event.get("cat") == "Session" and event.get("name") == "model_run"
    )
    if len(run_spans) != warmup + runs:
        raise ModelError(
            f"ONNX Runtime's profile has {len(run_spans)} model_run events, expected {warmup + runs} "
            f"({warmup} warm-up + {runs} measured runs)"
        )
    measured = run_spans[warmup:]
    starts = [start for start, _ in measured]
    # per node: list (one entry per measured run) of [total µs, calls]
    per_run: dict[str, list[list[int]]] = {}
    op_types: dict[str, str] = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") != "Node" or not name.endswith(_KERNEL_SUFFIX):
            continue
        ts = int(event["ts"])
        index = _run_index(starts, measured, ts)
        if index is None:  # a warm-up run
            continue
        node = name[: -len(_KERNEL_SUFFIX)]
        op_types.setdefault(node, str(event.get("args", {}).get("op_name", "?")))
        slots = per_run.setdefault(node, [[0, 0] for _ in measured])
        slots[index][0] += int(event["dur"])
        slots[index][1] += 1
    nodes = {
        node: NodeTime(
            name=node,
            op_type=op_types[node],
            median_us=float(statistics.median(total for total, _ in slots)),
            calls=int(round(statistics.median(calls for _, calls in slots))),
        )
        for node, slots in per_run.items()
    }
    run_median_ms = statistics.median(end - start for start, end in measured) / 1000.0
    return nodes, run_median_ms


def _run_index(starts: list[int], spans: list[tuple[int, int]], ts: int) -> int | None:
    """Index of the measured run whose interval contains ``ts`` (None: outside all of them)."""
    lo, hi = 0, len(starts)
    while lo < hi:  # rightmost start <= ts
        mid = (lo + hi) // 2
        if starts[mid] <= ts:
            lo = mid + 1
        else:
            hi = mid
    index = lo - 1
    if index < 0 or ts > spans[index][1]:
        return None
    return index


def profile_model(
    model: bytes | str | os.PathLike[str],
    feed: Mapping[str, np.ndarray],
    *,
    runs: int = 30,
    warmup: int = 5,
    threads: int | None = None,
    level: str = "all",
) -> Profile:
    """Profile ``model`` (serialized bytes or a path) on ``feed`` with ORT's CPU provider.

    Runs ``warmup`` unmeasured then ``runs`` measured ``session.run`` calls with ORT's
    profiler on, at graph optimization ``level`` (one of :data:`LEVELS`) and
    ``threads`` intra-op threads (None: ORT's default). The trace file is written to
    and read from a temporary directory that is removed afterwards.

    Raises:
        RecipeError: unknown ``level`` or invalid ``threads`` / ``runs`` / ``warmup``.
        ModelError: the path does not exist, ORT cannot load the model, or the trace
            is not what this parser expects.
        DataError: ``feed`` does not match the model's inputs or ORT rejects it.
    """
    opt_level = _check_settings(level, threads, runs, warmup)
    source = _model_source(model)
    with tempfile.TemporaryDirectory(prefix="quantkit-profile-") as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = opt_level
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "ort_profile")
        if threads is not None:
            options.intra_op_num_threads = threads
        try:
            session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            raise ModelError(f"ONNX Runtime could not load the model at level {level!r}: {exc}") from exc
        try:
            _check_feed(session, feed)
            feed_dict = dict(feed)
            for _ in range(warmup + runs):
                try:
                    session.run(None, feed_dict)
                except Exception as exc:  # InvalidArgument, Fail, ... from ORT
                    raise DataError(f"ONNX Runtime rejected the feed: {exc}") from exc
        finally:
            trace_path = session.end_profiling()
        with open(trace_path, encoding="utf-8") as handle:
            events = json.load(handle)
    if not isinstance(events, list):
        raise ModelError(f"unexpected ONNX Runtime profile format: top level is {type(events).__name__}")
    nodes, run_median_ms = _parse_trace(events, warmup, runs)
    node_sum_ms = sum(node.median_us for node in nodes.values()) / 1000.0
    return Profile(
        nodes=nodes, run_median_ms=run_median_ms, node_sum_ms=node_sum_ms, level=level, threads=threads
    )


def roofline(
    flops: float, bytes_moved: float, time_ms: float, *, peak_gflops: float, peak_gbps: float
) -> dict[str, float | str]:
    """Where a kernel that did ``flops`` and moved ``bytes_moved`` in ``time_ms`` sits on the roofline.

    Returns ``intensity`` (flop/byte; ``inf`` when no bytes moved), ``achieved_gflops``,
    ``achieved_gbps``, ``ridge`` (``peak_gflops / peak_gbps``, flop/byte),
    ``attainable_gflops`` (``min(peak_gflops, intensity * peak_gbps)``), ``efficiency``
    (achieved / attainable) and ``bound``: ``"compute-bound"`` when the intensity is
    at or above the ridge point, else ``"memory-bound"``.

    Raises:
        RecipeError: a negative count, a non-positive time or peak.
    """
    for label, value in (("flops", flops), ("bytes_moved", bytes_moved)):
        if not math.isfinite(value) or value < 0:
            raise RecipeError(f"{label} must be a finite number >= 0, got {value!r}")
    for label, value in (("time_ms", time_ms), ("peak_gflops", peak_gflops), ("peak_gbps", peak_gbps)):
        if not math.isfinite(value) or value <= 0:
            raise RecipeError(f"{label} must be a finite number > 0, got {value!r}")
    seconds = time_ms / 1000.0
    intensity = flops / bytes_moved if bytes_moved > 0 else math.inf
    ridge = peak_gflops / peak_gbps
    attainable = min(peak_gflops, intensity * peak_gbps)
    achieved_gflops = flops / seconds / 1e9
    return {
        "intensity": intensity,
        "achieved_gflops": achieved_gflops,
        "achieved_gbps": bytes_moved / seconds / 1e9,
        "ridge": ridge,
        "attainable_gflops": attainable,
        "efficiency": achieved_gflops / attainable if attainable > 0 else 0.0,
        "bound": "compute-bound" if intensity >= ridge else "memory-bound",
    }


_PEAKS: tuple[float, float] | None = None
_MATMUL_N = 1024
_COPY_BYTES = 64 * 2**20  # x2 arrays: well past any L3, and page-faulting them in stays fast


def _best_seconds(fn: Any, repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine_peaks(cache: bool = True) -> tuple[float, float]:
    """Measured ``(GFLOP/s, GB/s)`` of this CPU through numpy (about a second).

    GFLOP/s: best of a few float32 ``1024 × 1024`` matmuls (``2·n³`` flops each, on
    numpy's BLAS threads). GB/s: best of a few ``np.copyto`` of a 64 MiB array,
    counting read plus write bytes. With ``cache`` the first result is kept for the
    process and returned again; ``cache=False`` measures again (and refreshes it).
    """
    global _PEAKS
    if cache and _PEAKS is not None:
        return _PEAKS
    rng = np.random.default_rng(0)
    a = rng.standard_normal((_MATMUL_N, _MATMUL_N), dtype=np.float32)
    b = rng.standard_normal((_MATMUL_N, _MATMUL_N), dtype=np.float32)
    c = np.empty_like(a)
    np.matmul(a, b, out=c)  # warm BLAS threads and pages
    matmul_s = _best_seconds(lambda: np.matmul(a, b, out=c), repeat=5)
    gflops = 2.0 * _MATMUL_N**3 / matmul_s / 1e9

    src = np.ones(_COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination pages in
    copy_s = _best_seconds(lambda: np.copyto(dst, src), repeat=5)
    gbps = 2.0 * src.nbytes / copy_s / 1e9
    _PEAKS = (gflops, gbps)
    return _PEAKS
