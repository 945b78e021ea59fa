"""A builder for the tiny image graphs of the lowering tests: random float32 weights from one seed, float32
constants, single-output nodes named ``<output>_node``; ``model()`` wraps them as an opset-17 model with an
``input[N, 3, 16, 16]`` image input."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class TinyGraph:
    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []

    def w(self, name: str, *shape: int, s: float = 0.3) -> str:
        """A random weight ``N(0, s)`` of ``shape``."""
        self.inits.append(numpy_helper.from_array((self.rng.standard_normal(shape) * s).astype(np.float32), name))
        return name

    def c(self, name: str, value: Any, dtype: Any = np.float32) -> str:
        """A constant (float32 unless told)."""
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def node(self, op: str, ins: list[str], out: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, ins, [out], name=f"{out}_node", **attrs))
        return out

    def multi(self, op: str, ins: list[str], outs: list[str], name: str, **attrs: Any) -> list[str]:
        """A node of several outputs (``Split``)."""
        self.nodes.append(helper.make_node(op, ins, outs, name=name, **attrs))
        return outs

    def model(self, name: str, output: str, out_shape: list[Any]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name,
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, out_shape)], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m
