"""``LSTM`` -> ONNX Runtime's ``com.microsoft.DynamicQuantizeLSTM`` (select rule 11).

ONNX Runtime has no QDQ form of a recurrent layer; its CPU provider has one int8 LSTM kernel, with int8 weights
and the input / hidden state quantized at run time inside the kernel (uint8, one scale per step).  Its weights,
per direction: ``W`` ``[num_directions, input_size, 4 * hidden_size]`` and ``R`` ``[num_directions, hidden_size,
4 * hidden_size]`` - the ONNX ``LSTM`` weights transposed - with scales and zero points per ``[num_directions,
4 * hidden_size]`` (one per gate row; symmetric here, zero points 0, codes in ``[-127, 127]``; in ``[-64, 64]`` for a
CPU class whose uint8 x int8 kernels saturate int16 pair sums - ``x86-avx2``, ``portable`` - where any two codes then
sum to at most 128, so ``255 * 128`` fits: the kernel stays exact there).  The bias, sequence
lengths, initial states and peepholes are the float LSTM's own inputs; every attribute but ``layout`` (which the
kernel does not have: select keeps ``layout=1`` LSTMs float) carries over.  The node keeps the LSTM's name.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

__all__ = ["lower_dynamic_lstms", "quantize_rows"]


def quantize_rows(w: np.ndarray, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes of ``w`` ``[D, G, K]`` with one scale per ``[D, G]`` row (``max |w| / qmax``; 1 for an
    all-zero row): ``(codes [D, G, K] int8, scales [D, G] float32)``."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(w / scale[..., None]), -qmax, qmax).astype(np.int8)
    return codes, scale


def lower_dynamic_lstms(graph: ir.Graph, names: set[str] | frozenset[str],
                        const: Callable[[str, np.ndarray], ir.Value], *, pair_safe: bool = False) -> list[str]:
    """Rewrite the LSTMs named ``names`` (in place); returns the rewritten names.  ``const(base, array)``
    registers an initializer under a fresh name; ``pair_safe``: codes in ``[-64, 64]`` (module doc)."""
    from quantkit.lowering.nbits import _drop_if_unused, _replace_node

    done = []
    for node in list(graph):
        if node.op_type != "LSTM" or (node.name or "") not in names:
            continue
        base = node.name or "lstm"
        w_old, r_old = node.inputs[1], node.inputs[2]
        assert w_old is not None and r_old is not None  # noqa: S101 - select rule 11 checked both
        qmax = 64 if pair_safe else 127
        wq, ws = quantize_rows(np.asarray(w_old.const_value.numpy()), qmax)  # type: ignore[union-attr]
        rq, rs = quantize_rows(np.asarray(r_old.const_value.numpy()), qmax)  # type: ignore[union-attr]
        rest = [node.inputs[i] if len(node.inputs) > i else None for i in range(3, 8)]
        ins = [node.inputs[0], const(f"{base}_W_quantized", np.ascontiguousarray(wq.transpose(0, 2, 1))),
               const(f"{base}_R_quantized", np.ascontiguousarray(rq.transpose(0, 2, 1))), *rest,
               const(f"{base}_W_scale", ws), const(f"{base}_W_zero_point", np.zeros(ws.shape, np.int8)),
               const(f"{base}_R_scale", rs), const(f"{base}_R_zero_point", np.zeros(rs.shape, np.int8))]
        attrs = {k: a for k, a in node.attributes.items() if k != "layout"}
        new = ir.Node("com.microsoft", "DynamicQuantizeLSTM", ins, attributes=list(attrs.values()), name=base,
                      num_outputs=len(node.outputs))
        node.name = None
        _replace_node(graph, node, new)
        for v in (w_old, r_old):
            _drop_if_unused(graph, v)
        done.append(base)
    return done
