"""Graph preparation: float-model clean-up before calibration and quantization.

Each transform is an ``onnx_ir`` pass or an onnxscript rewrite rule set, one per
module; :func:`prepare` runs them in order.
"""

from quantkit.prep.fold_batchnorm import (
    FoldBatchNormIntoConv,
    FoldBatchNormIntoGemm,
    FoldBatchNormIntoMatMul,
    FoldBatchNormIntoMatMulAdd,
    fold_batchnorm_rules,
)
from quantkit.prep.name_nodes import NameNodesPass
from quantkit.prep.pipeline import PrepResult, prepare

__all__ = [
    "FoldBatchNormIntoConv",
    "FoldBatchNormIntoGemm",
    "FoldBatchNormIntoMatMul",
    "FoldBatchNormIntoMatMulAdd",
    "NameNodesPass",
    "PrepResult",
    "fold_batchnorm_rules",
    "prepare",
]
