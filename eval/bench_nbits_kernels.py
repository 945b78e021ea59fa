"""One decode step's GEMV kernels on this CPU: ``MatMulNBits`` (4 / 8 bits, groups of 32 / 128, accuracy_level
4 / 0) and the int8 / float alternatives, at M = 1 on SmolLM2-135M's shapes (the 576 x 49152 lm_head, the
576 <-> 1536 MLP, 576 x 576 attention).  Each kernel alone in its own session, random weights, median of 200 runs
after 20 warm-up runs (microseconds).

A kernel timed alone keeps its weights in the CPU caches across runs; in a decoder every layer's weights come
from memory once per token, so these figures say what the kernels cost per call, not what bytes cost per token
(``eval/bench_int4.py``'s ``decode_kv ms`` measures that).  What they show: at level 0 an 8-bit MatMulNBits runs
~40x slower than at level 4 (``quantkit.layerwise`` never packs an 8-bit layer at level 0 for the W4A8 check).

    python eval/bench_nbits_kernels.py --out eval/results/nbits_kernels_x86-vnni.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(576, 49152), (576, 1536), (1536, 576), (576, 576)]


def _session(model: Any) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _model(nodes: list[Any], inits: list[Any], K: int, N: int) -> Any:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


def nbits(rng: np.random.Generator, K: int, N: int, bits: int, block: int, level: int) -> Any:
    nblk = -(-K // block)
    codes = rng.integers(0, 256, size=(N, nblk, block * bits // 8), dtype=np.uint8)
    scales = rng.random(N * nblk, dtype=np.float32) * 0.01
    node = helper.make_node("MatMulNBits", ["x", "B", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=bits,
                            block_size=block, accuracy_level=level)
    return _model([node], [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "s")], K, N)


def int8_matmul(rng: np.random.Generator, K: int, N: int) -> Any:
    """DynamicQuantizeLinear + MatMulIntegerToFloat, per-column int8 weights (what quantkit's int8_dynamic emits)."""
    w = rng.integers(-127, 128, size=(K, N), dtype=np.int8)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulIntegerToFloat", ["xq", "B", "xs", "bs", "xz"], ["y"], domain="com.microsoft")]
    return _model(nodes, [numpy_helper.from_array(w, "B"),
                          numpy_helper.from_array(rng.random(N, dtype=np.float32) * 0.01, "bs")], K, N)


def fp32(rng: np.random.Generator, K: int, N: int) -> Any:
    w = rng.standard_normal((K, N), dtype=np.float32)
    return _model([helper.make_node("MatMul", ["x", "W"], ["y"])], [numpy_helper.from_array(w, "W")], K, N)


def time_us(model: Any, K: int, reps: int) -> float:
    s = _session(model)
    x = {"x": np.random.default_rng(1).standard_normal((1, K), dtype=np.float32)}
    for _ in range(20):
        s.run(None, x)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        s.run(None, x)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results: dict[str, dict[str, float]] = {}
    for K, N in SHAPES:
        row: dict[str, float] = {"fp32 MatMul": time_us(fp32(rng, K, N), K, args.reps),
                                 "int8 MatMulIntegerToFloat": time_us(int8_matmul(rng, K, N), K, args.reps)}
        for bits in (4, 8):
            for block in (32, 128):
                for level in (4, 0):
                    row[f"{bits}-bit g{block} level {level}"] = time_us(nbits(rng, K, N, bits, block, level), K,
                                                                       args.reps)
        results[f"{K} x {N}"] = {k: round(v, 1) for k, v in row.items()}
        print(f"K x N = {K} x {N}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[f"{K} x {N}"].items()),
              flush=True)
    if args.out:
        from provenance import run_record

        from quantkit.report.build import environment

        out = {"environment": {**environment(), **run_record()}, "unit": "microseconds per call, M = 1, median",
               "kernels_us": results}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
