"""Probe: how close can *any* evaluation of a deep static-INT8 model come to its own QDQ math?

Standalone:  python eval/probes/qdq_exact_reference.py [--recipe recipes/efficientnet-int8.yaml] [--isa auto]

Quantizes the recipe's model with quantkit, then evaluates the emitted QDQ model three ways on the
recipe's evaluation samples and compares their top-1 predictions pairwise:

* ``fused``: ONNX Runtime with all optimizations (the integer kernels of this CPU: what users run);
* ``ort_float``: ONNX Runtime with ``ORT_DISABLE_ALL`` (DequantizeLinear -> float32 op -> QuantizeLinear;
  the reference quantkit's reports use);
* ``exact``: the same graph in ``onnx.reference`` with every DequantizeLinear output cast to float64, so
  each Conv / Gemm / Add sums in double and each QuantizeLinear rounds a value that is exact to ~1e-16:
  the QDQ math without float32 accumulation error.

Why: a chain of ~60 requantizations is chaotic - a value that lies within float32 rounding error of a
rounding tie flips one code, and that one-step difference spreads through the following layers (each
layer *alone* agrees to one step; the whole model drifts to ~25 dB).  The probe shows whether the fused
kernels are further from the math than ONNX Runtime's own float reference is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def exact_reference_model(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with every DequantizeLinear output cast to float64 (for ``onnx.reference``)."""
    x = onnx.ModelProto()
    x.CopyFrom(proto)
    for o in x.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = max(o.version, 21)  # onnx.reference implements DequantizeLinear from opset 19
    nodes = []
    for n in x.graph.node:
        nodes.append(n)
        if n.op_type == "DequantizeLinear":
            t = n.output[0]
            n.output[0] = t + "__f32"
            nodes.append(helper.make_node("Cast", [t + "__f32"], [t], to=TensorProto.DOUBLE))
    del x.graph.node[:]
    x.graph.node.extend(nodes)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/efficientnet-int8.yaml")
    ap.add_argument("--isa", default="auto", help="target.isa to build for (auto | x86-vnni | x86-avx2 | portable)")
    args = ap.parse_args()

    from bench_int8 import _datasets
    from onnx.reference import ReferenceEvaluator

    from quantkit.api import quantize
    from quantkit.evaluate.latency import make_session
    from quantkit.recipe import load_recipe
    from quantkit.scheme.target import detect_cpu

    rec, _, _, ev = _datasets(args.recipe, None, None)
    d = rec.model_dump(mode="json")
    d["target"]["isa"] = args.isa
    res = quantize(None, None, load_recipe(d), progress=False, measure_latency=False, evaluate=False)
    proto = ir.to_proto(res.model)
    data = proto.SerializeToString()
    fused, ort_float = make_session(data, level="all"), make_session(data, level="disabled")
    exact = ReferenceEvaluator(exact_reference_model(proto))
    got: dict[str, list[np.ndarray]] = {"fused": [], "ort_float": [], "exact": []}
    t = time.perf_counter()
    for feed in ev.batches(1):
        got["fused"].append(fused.run(None, feed)[0])
        got["ort_float"].append(ort_float.run(None, feed)[0])
        got["exact"].append(np.asarray(exact.run(None, feed)[0], np.float64))
    out = {k: np.concatenate(v) for k, v in got.items()}
    print(f"cpu={detect_cpu().as_dict()} isa={args.isa} samples={len(out['fused'])} ({time.perf_counter() - t:.0f} s)")
    names = list(out)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            agree = float(np.mean(out[a].argmax(-1) == out[b].argmax(-1)))
            diff = float(np.abs(out[a] - out[b]).max())
            print(f"top-1 agreement {a:>9s} vs {b:<9s} {agree:.3f}   max |logit diff| {diff:.3f}")


if __name__ == "__main__":
    main()
