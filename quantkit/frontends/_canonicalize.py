"""Small canonicalisation passes run on freshly exported graphs.

The PyTorch exporters spell a few standard operators in roundabout ways that the
runtime's quantized kernels do not recognise.  These passes restore the canonical
op so that later stages (calibration, QDQ lowering, ORT fusion) see a classic graph.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes
import onnx_ir.passes.common

__all__ = ["ReduceMeanToGlobalAveragePoolPass"]


def _reduce_axes(node: ir.Node) -> list[int] | None:
    """The ``axes`` of a ReduceMean node, from its attribute (opset < 18) or constant input."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return list(attr.as_ints())
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    tensor = ir.convenience.get_const_tensor(node.inputs[1])
    if tensor is None:
        return None
    return [int(a) for a in tensor.numpy().reshape(-1)]


class ReduceMeanToGlobalAveragePoolPass(onnx_ir.passes.InPlacePass):
    """Rewrite ``ReduceMean(x, axes=[2, 3], keepdims=1)`` on a rank-4 ``x`` as ``GlobalAveragePool(x)``.

    Both compute ``y[n, c, 0, 0] = 1/(H*W) * sum_{h,w} x[n, c, h, w]`` for an NCHW tensor,
    so the rewrite is exact up to float summation order.  The dynamo exporter lowers
    ``adaptive_avg_pool2d(x, 1)`` / ``x.mean((2, 3), keepdim=True)`` to ReduceMean, which
    ONNX Runtime cannot fuse into ``QLinearGlobalAveragePool``; GlobalAveragePool it can.
    Nodes whose input rank is unknown or whose axes are not exactly the two spatial
    axes are left alone.
    """

    def call(self, model: ir.Model) -> onnx_ir.passes.PassResult:
        modified = False
        for node in list(model.graph):
            if node.op_type != "ReduceMean" or node.domain not in ("", "ai.onnx"):
                continue
            x = node.inputs[0]
            if x is None or x.shape is None or len(x.shape) != 4:
                continue
            keepdims = node.attributes.get("keepdims")
            if keepdims is not None and keepdims.as_int() != 1:
                continue
            axes = _reduce_axes(node)
            if axes is None or sorted(a % 4 for a in axes) != [2, 3]:
                continue
            new = ir.Node("", "GlobalAveragePool", inputs=[x], name=node.name)
            # Copies name, type and shape of the old output onto the new one.
            ir.convenience.replace_nodes_and_values(
                model.graph, node, [node], [new], [node.outputs[0]], [new.outputs[0]]
            )
            modified = True
        if modified:
            # Drop the now unused ``axes`` initializers.
            onnx_ir.passes.common.RemoveUnusedNodesPass()(model)
        return onnx_ir.passes.PassResult(model, modified)
