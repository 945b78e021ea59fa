"""Per (unit, format) cost: bytes in the emitted file and *measured* latency on the target provider.

Latency is measured in context, not from a formula: the model is emitted once per candidate
with every unit in that format (plus once all-FP32), each is profiled with ONNX Runtime's
profiler (:func:`quantkit.search.profile.profile_model`, the feed of ``report.latency``) and
every optimized kernel's median time is attributed to the layer it came from.  Then::

    latency(u, f)  = k_f * sum of the kernel medians of u's layers in the all-f model
    k_f            = (run median of the all-f model without the profiler) / (its run median with it)
    base           = run median of the all-FP32 model without the profiler - sum_u latency(u, fp32)

so a mix is predicted as ``base + sum_u latency(u, f_u)`` (+ boundary edges where a space
declares them).  ``base`` holds everything that is not a searched layer (attention, norms,
the executor's own overhead).  The sweep reports this prediction next to the measured
latency of each emitted point.

The roofline view comes with it: FLOPs (``2 M K N`` for a linear layer), bytes moved (weights as
stored + activations in and out), arithmetic intensity and compute- or memory-bound against
this machine's measured peaks.

Tables are cached on disk (JSON) by model, candidates, feed shape, threads, ONNX Runtime
version and CPU.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from quantkit.checksum import dumps_checked, loads_checked
from quantkit.progress import tqdm

log = logging.getLogger("quantkit")

__all__ = ["CostTable", "measure_costs"]


@dataclass
class CostTable:
    bytes: dict[tuple[str, str], float]
    latency_ms: dict[tuple[str, str], float]
    base: dict[str, float]  # metric -> constant part
    provider: str = "CPUExecutionProvider"
    notes: dict[str, Any] = field(default_factory=dict)
    roofline: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": {f"{u}\t{c}": v for (u, c), v in self.bytes.items()},
            "latency_ms": {f"{u}\t{c}": v for (u, c), v in self.latency_ms.items()},
            "base": self.base,
            "provider": self.provider,
            "notes": self.notes,
            "roofline": self.roofline,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CostTable:
        def split(m: Mapping[str, float]) -> dict[tuple[str, str], float]:
            return {(k.split("\t")[0], k.split("\t")[1]): float(v) for k, v in m.items()}

        return cls(
            split(d["bytes"]),
            split(d["latency_ms"]),
            dict(d["base"]),
            d.get("provider", ""),
            dict(d.get("notes", {})),
            list(d.get("roofline", [])),
        )


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_cache_path(parts: Mapping[str, Any]) -> Path:
    from quantkit.frontends.cache import cache_dir

    full = {**parts, "ort": ort.__version__, "cpu": _cpu(), "version": 3}
    key = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_dir() / "search" / f"cost-{key}.json"


def _save(path: Path, table: CostTable) -> None:
    from quantkit.report.build import atomic_write_text

    try:
        atomic_write_text(path, dumps_checked(table.to_json()))
    except OSError as exc:
        log.warning("cannot write the cost cache %s (%s); carrying on without it", path, exc)


def _plain_median_ms(blob: bytes, feed: Mapping[str, np.ndarray], *, runs: int, warmup: int,
                     threads: int | None) -> float:
    """Median wall time (ms) of ``session.run`` without the profiler, same settings as the profile."""
    import time

    from quantkit.evaluate.latency import make_session

    sess = make_session(blob, threads=threads)
    for _ in range(warmup):
        sess.run(None, dict(feed))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, dict(feed))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def output_aliases(model: Any, layers: list[str]) -> dict[str, str]:
    """Output tensor of each layer, and of the single-consumer activation / Add chain fused into it
    (ORT names some fused kernels after that tensor) -> layer."""
    wanted = set(layers)
    consumers: dict[str, list[Any]] = {}
    for node in model.graph:
        for i in node.inputs:
            if i is not None and i.name:
                consumers.setdefault(i.name, []).append(node)
    out: dict[str, str] = {}
    for node in model.graph:
        if (node.name or "") not in wanted or not node.outputs:
            continue
        v = node.outputs[0]
        for _ in range(3):
            if not v.name:
                break
            out.setdefault(v.name, node.name or "")
            nxt = consumers.get(v.name, [])
            if len(nxt) != 1 or nxt[0].op_type not in (
                "Relu",
                "Clip",
                "Sigmoid",
                "HardSigmoid",
                "Add",
                "Sum",
            ):
                break
            v = nxt[0].outputs[0]
    return out


def measure_costs(
    space: Any,
    feed: Mapping[str, np.ndarray],
    *,
    runs: int = 20,
    warmup: int = 3,
    threads: int | None = None,
    cache_parts: Mapping[str, Any] | None = None,
    progress: bool = True,
    rows: int | None = None,
    latency: bool = True,
) -> CostTable:
    """Bytes and profiled latency of every (unit, candidate) of ``space`` (see the module doc).

    ``rows``: activation rows per layer call (tokens x batch) for the roofline; inferred from
    the feed's first 2-D int64 input (text) when None.  ``latency=False``: bytes alone, from the weights' formats
    (no model is emitted or profiled; every latency is 0 - for a search with a size budget only)."""
    import onnx_ir as ir

    from quantkit.search.profile import machine_peaks, profile_model, roofline

    path = cost_cache_path(cache_parts) if cache_parts is not None else None
    if path is not None and path.exists():
        try:
            table = CostTable.from_json(loads_checked(path.read_text()))  # checksummed: an edit is a miss
            log.info("cost table reused from %s", path)
            return table
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            log.warning("cost cache %s unusable (%s); measuring again", path, exc)
    units = space.units
    layer_names = [n for u in units for n in u.layers]
    cands = ["fp32"] + [c for c in space.candidates if c != "fp32"]
    allowed = {u.name: (space.allowed(u) if hasattr(space, "allowed") else list(space.candidates)) for u in units}

    def own(u: Any, c: str) -> str:
        """The candidate unit ``u`` runs in a uniform-``c`` model (the nearest allowed one)."""
        from quantkit.search.linear import nearest_allowed

        return c if c == "fp32" else nearest_allowed(space.candidates, allowed[u.name], c)

    nbytes = {(u.name, c): float(space.unit_bytes(u, own(u, c))) for u in units for c in cands}
    if not latency:
        other = sorted({space.candidates[c].format for c in cands if c != "fp32"} - _BYTES_ONLY)
        if other:  # their graph adds activation scales / smoothing constants that only an emitted model shows
            raise ValueError(f"measure_costs(latency=False) counts weight formats only; {other} need latency=True")
        table = _bytes_only(space, nbytes)
        if path is not None:
            _save(path, table)
        return table
    file_size: dict[str, int] = {}
    lat: dict[tuple[str, str], float] = {}
    profiles: dict[str, Any] = {}
    storage16 = [
        c
        for c in cands
        if c != "fp32"
        and space.candidates[c].format in ("fp16", "bf16")
        and space.candidates[c].compute == "storage"
    ]
    for c in tqdm(cands, desc="profile formats", unit="model", disable=not progress):
        m = space.emit({u.name: own(u, c) for u in units})
        blob = ir.to_proto(m).SerializeToString()
        del m
        file_size[c] = len(blob)
        if c in storage16:
            # ORT folds a constant 16-bit weight's Cast back to FP32 at load (RUNTIME.md): the graph it runs
            # is the FP32 one, so the FP32 measurement is used (profiling it again would only add noise)
            for u in units:
                lat[(u.name, c)] = lat[(u.name, "fp32")]
            profiles[c] = {"same_as": "fp32"}
            continue
        prof = profile_model(blob, feed, runs=runs, warmup=warmup, threads=threads, level="all")
        per_layer = prof.by_layer(layer_names, aliases=output_aliases(space.model, layer_names))
        # the profiler's own overhead inflates every kernel: rescale this model's kernel times so that they
        # sum (with the rest) to its wall time measured WITHOUT profiling on the same feed
        plain_ms = _plain_median_ms(blob, feed, runs=max(5, runs // 2), warmup=warmup, threads=threads)
        scale = plain_ms / max(prof.run_median_ms, 1e-9)
        for u in units:
            lat[(u.name, c)] = scale * float(sum(per_layer.get(n, 0.0) for n in u.layers))
        profiles[c] = {
            "plain_run_median_ms": plain_ms,
            "profiler_scale": scale,
            "run_median_ms": prof.run_median_ms,
            "node_sum_ms": prof.node_sum_ms,
            "other_ms": per_layer.get("<other>", 0.0),
            "by_op_type": prof.by_op_type(),
        }
    fp32_layers = sum(lat[(u.name, "fp32")] for u in units)
    base_lat = profiles["fp32"]["plain_run_median_ms"] - fp32_layers
    base_bytes = float(file_size["fp32"]) - sum(
        nbytes[(u.name, "fp32")] for u in units
    )  # unsearched weights, graph
    # graph bytes a format adds or removes per layer besides its weights (helper nodes and constants of the
    # dynamic int8 pipeline; exporter metadata that leaves with a replaced node), from the uniform files
    n_layers = max(1, len(layer_names))
    overhead: dict[str, float] = {}
    for c in cands:
        weights_delta = sum(nbytes[(u.name, c)] - nbytes[(u.name, "fp32")] for u in units)
        overhead[c] = (file_size[c] - file_size["fp32"] - weights_delta) / n_layers
        for u in units:
            nbytes[(u.name, c)] += overhead[c] * len(u.layers)
    table = CostTable(
        nbytes,
        lat,
        {"bytes": base_bytes, "latency_ms": base_lat},
        notes={
            "profiles": profiles,
            "graph_bytes_per_layer": overhead,
            "file_bytes": file_size,
            "runs": runs,
            "threads": threads,
            "ort": ort.__version__,
            "cpu": _cpu(),
            "feed": {k: list(v.shape) for k, v in feed.items()},
        },
    )
    # roofline of every (unit, format) from the measured kernels
    if rows is None:
        rows = next((int(np.prod(v.shape)) for v in feed.values() if v.dtype == np.int64 and v.ndim == 2), 1)
    gflops, gbps = machine_peaks()
    table.notes["peaks"] = {"gflops": gflops, "gbps": gbps}
    for u in units:
        flops, act = space.unit_work(u, rows)
        for c in cands:
            t = lat[(u.name, c)]
            row = {
                "unit": u.name,
                "candidate": c,
                "flops": flops,
                "bytes": nbytes[(u.name, c)] + act,
                "time_ms": t,
            }
            if t > 0:
                row.update(roofline(flops, nbytes[(u.name, c)] + act, t, peak_gflops=gflops, peak_gbps=gbps))
            table.roofline.append(row)
    if path is not None:
        _save(path, table)
    return table


_BYTES_ONLY = {"fp32", "fp16", "bf16", "int4", "int8_weight"}
"""Formats whose bytes are their weights' alone (measure_costs(latency=False))."""


def _bytes_only(space: Any, nbytes: dict[tuple[str, str], float]) -> CostTable:
    """The cost table of a size-only search: each (unit, candidate)'s weight bytes; the constant part every other
    initializer and the graph itself, serialized without its weights (the few bytes a format's nodes add are left
    out: the emitted file is measured after the build)."""
    from quantkit.irtools import weightless_proto

    searched = {u.name: nbytes[(u.name, "fp32")] for u in space.units}
    graph = len(weightless_proto(space.model)[0].SerializeToString())
    total = graph + sum(float(v.const_value.nbytes) for v in space.model.graph.initializers.values()
                        if v.const_value is not None)
    pinned_f32, pinned_fmt = space.pinned_bytes() if hasattr(space, "pinned_bytes") else (0, 0)
    lat = dict.fromkeys(nbytes, 0.0)
    base = total - sum(searched.values()) - pinned_f32 + pinned_fmt  # pinned layers in their recipe format
    return CostTable(nbytes, lat, {"bytes": base, "latency_ms": 0.0},
                     notes={"latency": "not measured: a search with a size budget only (bytes from the formats)",
                            "cpu": _cpu(), "ort": ort.__version__})


_QDQ_RATE: list[float] = []


def qdq_ns_per_element(elements: int = 1 << 20, repeat: int = 20) -> float:
    """Measured ns per element of a uint8 ``QuantizeLinear`` + ``DequantizeLinear`` pair in ONNX Runtime
    (what a boundary between an int8 and a float layer costs); measured once per process."""
    if _QDQ_RATE:
        return _QDQ_RATE[0]
    import time

    import onnx

    h = onnx.helper
    g = h.make_graph(
        [
            h.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            h.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "qdq",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [elements])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [elements])],
        [
            onnx.numpy_helper.from_array(np.array(0.05, np.float32), "s"),
            onnx.numpy_helper.from_array(np.array(128, np.uint8), "z"),
        ],
    )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the pair (no folding)
    sess = ort.InferenceSession(
        h.make_model(g, opset_imports=[h.make_opsetid("", 13)]).SerializeToString(),
        so,
        providers=["CPUExecutionProvider"],
    )
    x = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
    for _ in range(3):
        sess.run(None, {"x": x})
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, {"x": x})
        ts.append(time.perf_counter() - t0)
    _QDQ_RATE.append(float(np.median(ts)) * 1e9 / elements)
    return _QDQ_RATE[0]
