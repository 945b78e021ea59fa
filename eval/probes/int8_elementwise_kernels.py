"""Micro-benchmarks of the elementwise kernels an int8 squeeze-excite / HardSwish / SiLU block runs in ONNX
Runtime's CPU provider, against their float counterparts: one op per model, uint8 activations, the shapes of a
small CNN's large tensors (NHWC, as ONNX Runtime's int8 layout pass runs them), interleaved rounds (15 x 20 runs),
median microseconds per op.

    python eval/probes/int8_elementwise_kernels.py 2      # intra-op threads (default 2)

Results and what they explain: eval/results/se_blocks_latency_x86-vnni.md.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

U8, F32 = TensorProto.UINT8, TensorProto.FLOAT
MS = "com.microsoft"


def _scalar(name: str, value: float, dtype: int = F32) -> Any:
    return helper.make_tensor(name, dtype, [], [value])


QPARAMS = [_scalar("s", 0.05), _scalar("z", 128, U8), _scalar("s2", 0.004), _scalar("z2", 0, U8),
           _scalar("so", 0.05), _scalar("zo", 128, U8)]


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any]) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _vi(name: str, dtype: int, shape: list[int]) -> Any:
    return helper.make_tensor_value_info(name, dtype, shape)


def _qbinary(op: str, a: list[int], b: list[int] | None, out: list[int], scale_b: str = "s") -> bytes:
    zb = "z" if scale_b == "s" else "z2"
    ins = ["a", "s", "z", "b" if b is not None else "c", scale_b, zb, "so", "zo"]
    node = helper.make_node(op, ins, ["y"], domain=MS)
    inputs = [_vi("a", U8, a)] + ([_vi("b", U8, b)] if b is not None else [])
    const = [] if b is not None else [helper.make_tensor("c", U8, [1], [200])]
    return _model([node], inputs, [_vi("y", U8, out)], QPARAMS + const)


def cases() -> dict[str, tuple[bytes, dict[str, tuple[list[int], str]]]]:
    """name -> (model bytes, input name -> (shape, 'u8' | 'f32'))."""
    out: dict[str, tuple[bytes, dict[str, tuple[list[int], str]]]] = {}
    for label, (H, C) in {"112x112x64": (112, 64), "56x56x96": (56, 96), "28x28x160": (28, 160)}.items():
        nhwc, nchw = [1, H, H, C], [1, C, H, H]
        u8 = {"a": (nhwc, "u8")}
        out[f"QLinearAdd same {label}"] = (_qbinary("QLinearAdd", nhwc, nhwc, nhwc), {**u8, "b": (nhwc, "u8")})
        out[f"QLinearAdd scalar-const {label}"] = (_qbinary("QLinearAdd", nhwc, None, nhwc), u8)
        out[f"QLinearMul same {label}"] = (_qbinary("QLinearMul", nhwc, nhwc, nhwc, "s2"), {**u8, "b": (nhwc, "u8")})
        out[f"QLinearMul SE bcast NHWC [1,1,1,C] {label}"] = (
            _qbinary("QLinearMul", nhwc, [1, 1, 1, C], nhwc, "s2"), {**u8, "b": ([1, 1, 1, C], "u8")})
        out[f"QLinearMul SE bcast NCHW [1,C,1,1] {label}"] = (
            _qbinary("QLinearMul", nchw, [1, C, 1, 1], nchw, "s2"), {"a": (nchw, "u8"), "b": ([1, C, 1, 1], "u8")})
        sig = helper.make_node("QLinearSigmoid", ["a", "s", "z", "s2", "z2"], ["y"], domain=MS)
        out[f"QLinearSigmoid {label}"] = (_model([sig], [_vi("a", U8, nhwc)], [_vi("y", U8, nhwc)], QPARAMS), u8)
        for act, node in (("HardSwish", helper.make_node("HardSwish", ["x"], ["h"])),
                          ("QuickGelu", helper.make_node("QuickGelu", ["x"], ["h"], domain=MS, alpha=1.0))):
            nodes = [helper.make_node("DequantizeLinear", ["a", "s", "z"], ["x"]), node,
                     helper.make_node("QuantizeLinear", ["h", "so", "zo"], ["y"])]
            out[f"DQ->{act}->Q {label}"] = (_model(nodes, [_vi("a", U8, nhwc)], [_vi("y", U8, nhwc)], QPARAMS), u8)
        dq = helper.make_node("DequantizeLinear", ["a", "s", "z"], ["y"])
        out[f"DequantizeLinear {label}"] = (_model([dq], [_vi("a", U8, nhwc)], [_vi("y", F32, nhwc)], QPARAMS), u8)
        q = helper.make_node("QuantizeLinear", ["a", "s", "z"], ["y"])
        out[f"QuantizeLinear {label}"] = (_model([q], [_vi("a", F32, nhwc)], [_vi("y", U8, nhwc)], QPARAMS),
                                          {"a": (nhwc, "f32")})
        hs = helper.make_node("HardSwish", ["a"], ["y"])
        out[f"f32 HardSwish {label}"] = (_model([hs], [_vi("a", F32, nchw)], [_vi("y", F32, nchw)], []),
                                         {"a": (nchw, "f32")})
        mul = helper.make_node("Mul", ["a", "b"], ["y"])
        out[f"f32 Mul SE bcast NCHW {label}"] = (
            _model([mul], [_vi("a", F32, nchw), _vi("b", F32, [1, C, 1, 1])], [_vi("y", F32, nchw)], []),
            {"a": (nchw, "f32"), "b": ([1, C, 1, 1], "f32")})
        tr = helper.make_node("Transpose", ["a"], ["y"], perm=[0, 2, 3, 1])
        out[f"u8 Transpose NCHW->NHWC {label}"] = (_model([tr], [_vi("a", U8, nchw)], [_vi("y", U8, nhwc)], []),
                                                   {"a": (nchw, "u8")})
    return out


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rng = np.random.default_rng(0)
    sessions, feeds = {}, {}
    for name, (blob, shapes) in cases().items():
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.force_spinning_stop", "1")
        sessions[name] = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
        feeds[name] = {n: (rng.standard_normal(s).astype(np.float32) if kind == "f32"
                           else rng.integers(0, 256, s).astype(np.uint8)) for n, (s, kind) in shapes.items()}
        for _ in range(5):
            sessions[name].run(None, feeds[name])
    rounds: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(15):  # interleaved: every op once per round
        for name, sess in sessions.items():
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                sess.run(None, feeds[name])
                times.append(time.perf_counter() - t0)
            rounds[name].append(float(np.median(times)))
    print(f"threads={threads}")
    for name, ts in rounds.items():
        print(f"  {name:52s} {np.median(ts) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
