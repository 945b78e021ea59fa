"""Probe: which QDQ patterns does ONNX Runtime's CPU provider fuse into integer kernels, are they exact, are they fast?

Standalone:  python eval/probes/qdq_op_coverage.py [--runs 100] [--only REGEX] [--dt u8,s8] [--no-qstatic]

For every pattern a tiny opset-20 graph is built three ways:

* ``fp32``: the plain float op(s) ``x -> OP -> y`` (the best float equivalent; ORT_ENABLE_ALL);
* QDQ, float I/O: ``x -> Q -> DQ -> OP -> Q -> DQ -> y``.  Run at ORT_ENABLE_ALL ("fused") and at
  ORT_DISABLE_ALL (the QDQ math).  The optimized graph is saved (``optimized_model_filepath``) and its op
  types counted;
* QDQ, integer I/O: ``xq -> DQ -> OP -> Q -> yq`` (the steady state inside an integer network, without the
  graph-boundary Q/DQ).  Timed at ORT_ENABLE_ALL ("fused ms") and at ORT_ENABLE_ALL with
  ``session.disable_quant_qdq=1`` ("island ms": DQ -> float op -> Q, every other optimization still on).

Columns: census of the optimized integer-I/O graph (Q/DQ = QuantizeLinear/DequantizeLinear, ms. = com.microsoft),
verdict, max |fused - QDQ math| in output steps (LSB) with the fraction of elements that differ,
max |fused - canonical| for re-written patterns (canonical = the plain op's QDQ graph at ORT_DISABLE_ALL with
the same input/output quantization), and median latencies (1 intra-op thread, io-binding, medians of --runs).

Timings are from whatever machine runs this; on a shared/loaded box they are indicative only.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import platform
import re
import shutil
import tempfile
import time
import zlib

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as onh

OPSET = 20
IR = 10
CNN = [1, 96, 28, 28]
GATE = [1, 96, 1, 1]
ENC = [1, 128, 768]
ATT = [1, 12, 128, 128]
NPDT = {"u8": np.uint8, "s8": np.int8}
ONNXDT = {"u8": TP.UINT8, "s8": TP.INT8}
TMP = tempfile.mkdtemp(prefix="qdqcov_")
atexit.register(shutil.rmtree, TMP, ignore_errors=True)


def qrange(dt):
    return (0, 255) if dt == "u8" else (-128, 127)


def zlo(dt):  # zero point that puts real 0 at the bottom of the range
    return qrange(dt)[0]


def qp_from_range(lo, hi, dt):
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = (hi - lo) / 255.0 or 1.0
    qmin, qmax = qrange(dt)
    zp = int(np.clip(np.rint(qmin - lo / scale), qmin, qmax))
    return (float(np.float32(scale)), zp)


def fixed(scale, zp_u8=None):
    """qparams spec independent of calibration; zp given for uint8, shifted by -128 for int8."""

    def f(dt):
        z = 0 if zp_u8 is None else zp_u8
        return (float(np.float32(scale)), z if dt == "u8" else z - 128)

    return f


def quant(x, qp, dt):
    s, z = qp
    qmin, qmax = qrange(dt)
    return np.clip(np.rint(x.astype(np.float32) / np.float32(s)) + z, qmin, qmax).astype(NPDT[dt])


def dequant(q, qp):
    return ((q.astype(np.float32) - np.float32(qp[1])) * np.float32(qp[0])).astype(np.float32)


# ----------------------------------------------------------------------------------------------- data
_DATA: dict = {}


def data(name, shape, kind="normal", scale=1.0):
    key = (name, tuple(shape), kind, scale)
    if key not in _DATA:
        rng = np.random.default_rng(zlib.crc32(repr(key).encode()))
        if kind == "normal":
            a = rng.standard_normal(shape).astype(np.float32) * scale
        elif kind == "gate":  # SE gate values in (0, 1)
            a = (1 / (1 + np.exp(-rng.standard_normal(shape) * 2))).astype(np.float32)
        elif kind == "bool":
            a = rng.random(shape) < 0.5
        else:
            raise ValueError(kind)
        _DATA[key] = a
    return _DATA[key]


# ----------------------------------------------------------------------------------------------- builder
class G:
    """Builds one pattern in one of three modes: 'fp32' (Q/DQ are identities), 'cal' (records tensors to
    calibrate), 'qdq' (emits QuantizeLinear/DequantizeLinear; io='f' float graph I/O, io='q' integer I/O)."""

    def __init__(self, mode, dt="u8", io="f", ranges=None, force=None):
        self.mode, self.dt, self.io = mode, dt, io
        self.ranges = ranges or {}
        self.force = force or {}
        self.qps, self.dqp, self.qout, self.cal, self.direct = {}, {}, {}, {}, {}
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.feeds, self.out_scales = {}, []
        self.n = 0

    # -- helpers
    def nm(self, p):
        self.n += 1
        return f"{p}_{self.n}"

    def const(self, arr):
        name = self.nm("c")
        self.inits.append(onh.from_array(np.asarray(arr), name))
        return name

    def resolve(self, key, spec):
        if key in self.force:
            qp = self.force[key]
        elif spec is None:
            qp = qp_from_range(*self.ranges[key], self.dt)
        elif isinstance(spec, str):
            qp = self.qps[spec]
        elif isinstance(spec, tuple):
            qp = spec
        elif spec.__code__.co_argcount == 2:  # spec(dt, resolved qparams so far)
            qp = spec(self.dt, self.qps)
        else:
            qp = spec(self.dt)
        self.qps[key] = qp
        return qp

    def _q(self, t, qp):
        s = self.const(np.array(qp[0], np.float32))
        z = self.const(np.array(qp[1], NPDT[self.dt]))
        o = self.nm("q")
        self.nodes.append(oh.make_node("QuantizeLinear", [t, s, z], [o]))
        return o

    def _dq(self, t, qp):
        s = self.const(np.array(qp[0], np.float32))
        z = self.const(np.array(qp[1], NPDT[self.dt]))
        o = self.nm("dq")
        self.nodes.append(oh.make_node("DequantizeLinear", [t, s, z], [o]))
        return o

    def op(self, op_type, inputs, n_out=1, domain="", **attrs):
        outs = [self.nm(op_type) for _ in range(n_out)]
        self.nodes.append(oh.make_node(op_type, inputs, outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    @property
    def q(self):
        return self.mode == "qdq"

    # -- pattern API
    def inp(self, key, arr, qp=None, dq=True):
        """Graph input. Returns the (dequantized) float tensor, or with dq=False the quantized tensor."""
        if arr.dtype == bool or self.mode != "qdq":
            et = TP.BOOL if arr.dtype == bool else TP.FLOAT
            self.inputs.append(oh.make_tensor_value_info(key, et, list(arr.shape)))
            self.feeds[key] = arr
            if arr.dtype != bool:
                self.direct[key] = (float(arr.min()), float(arr.max()))
            return key
        qp = self.resolve(key, qp)
        if self.io == "f":
            self.inputs.append(oh.make_tensor_value_info(key, TP.FLOAT, list(arr.shape)))
            self.feeds[key] = arr
            qo = self._q(key, qp)
        else:
            self.inputs.append(oh.make_tensor_value_info(key, ONNXDT[self.dt], list(arr.shape)))
            self.feeds[key] = quant(arr, qp, self.dt)
            qo = key
        self.qout[key], self.dqp[key] = qo, qp
        return self._dq(qo, qp) if dq else qo

    def qdq(self, t, key, qp=None, dq_qp=None):
        """Intermediate Q -> DQ (dq_qp: a DequantizeLinear with other params than the Q: 'relabel')."""
        if self.mode == "fp32":
            return t
        if self.mode == "cal":
            self.cal[key] = t
            return t
        qp = self.resolve(key, qp)
        qo = self._q(t, qp)
        dqp = qp if dq_qp is None else self.resolve(key + "@dq", dq_qp)
        self.qout[key], self.dqp[key] = qo, dqp
        return self._dq(qo, dqp)

    def redq(self, key, t):
        """A second, dedicated DequantizeLinear of an already quantized tensor (one DQ per consumer)."""
        return self._dq(self.qout[key], self.dqp[key]) if self.q else t

    def qconst(self, value):
        """Scalar constant; in QDQ mode an integer initializer + DQ with a scale that represents it exactly."""
        c = float(value)
        if not self.q:
            return self.const(np.array(c, np.float32))
        if self.dt == "u8":
            qp, qv = ((c / 255, 0), 255) if c > 0 else ((-c / 255, 255), 0)
        else:
            qp, qv = (abs(c) / 127, 0), (127 if c > 0 else -127)
        qp = (float(np.float32(qp[0])), qp[1])
        return self._dq(self.const(np.array(qv, NPDT[self.dt])), qp)

    def out(self, t, key, qp=None, dq_qp=None, quant=True):
        if self.mode == "fp32" or not quant:
            self.outputs.append(oh.make_tensor_value_info(t, TP.FLOAT, None))
            self.out_scales.append(None)
            return
        if self.mode == "cal":
            self.cal[key] = t
            return
        qp = self.resolve(key, qp)
        qo = self._q(t, qp)
        self.out_q(qo, key, dq_qp)

    def out_q(self, qo, key, dq_qp=None):
        """Mark an already-quantized tensor (qparams of `key` resolved) as the pattern output."""
        if self.mode == "cal":
            return
        dqp = self.qps[key] if dq_qp is None else self.resolve(key + "@dq", dq_qp)
        self.dqp[key] = dqp
        self.out_scales.append(dqp[0])
        if self.io == "f":
            o = self._dq(qo, dqp)
            self.outputs.append(oh.make_tensor_value_info(o, TP.FLOAT, None))
        else:
            self.outputs.append(oh.make_tensor_value_info(qo, ONNXDT[self.dt], None))

    def model(self):
        outs = list(self.outputs)
        if self.mode == "cal":
            seen = {o.name for o in outs}
            for t in self.cal.values():
                if t not in seen:
                    seen.add(t)
                    outs.append(oh.make_tensor_value_info(t, TP.FLOAT, None))
        g = oh.make_graph(self.nodes, "p", self.inputs, outs, self.inits)
        ops = [oh.make_opsetid("", OPSET)]
        if any(n.domain == "com.microsoft" for n in self.nodes):
            ops.append(oh.make_opsetid("com.microsoft", 1))
        return oh.make_model(g, opset_imports=ops, ir_version=IR)

    def dq_weight(self, w_float, scale):
        """Per-tensor int8 weight (zp 0) + DQ in QDQ mode, the float weight otherwise."""
        if not self.q:
            return self.const(w_float.astype(np.float32))
        wq = self.const(np.clip(np.rint(w_float / scale), -127, 127).astype(np.int8))
        s, z = self.const(np.array(scale, np.float32)), self.const(np.array(0, np.int8))
        o = self.nm("dqw")
        self.nodes.append(oh.make_node("DequantizeLinear", [wq, s, z], [o]))
        return o


# ----------------------------------------------------------------------------------------------- patterns
PATTERNS = []


def pattern(name, desc, dts=("u8", "s8"), fp32=None, canon=None, group=""):
    def deco(fn):
        PATTERNS.append(dict(name=name, desc=desc, fn=fn, dts=dts, fp32=fp32, canon=canon, group=group))
        return fn

    return deco


def unary(op, shape, kind="normal", scale=2.0, yqp=None, **attrs):
    def fn(g):
        x = g.inp("x", data("x", shape, kind, scale))
        g.out(g.op(op, [x], **attrs), "y", qp=yqp)

    return fn


def by_name(name):
    return next(p["fn"] for p in PATTERNS if p["name"] == name)


HS = dict(alpha=1 / 6, beta=0.5)  # MobileNetV3 hard-sigmoid
U = 1 / 256

# --- elementwise unary, CNN shape
for _n, _op, _a, _y in [
    ("Sigmoid", "Sigmoid", {}, None),
    ("Tanh", "Tanh", {}, None),
    ("LeakyRelu(0.1)", "LeakyRelu", dict(alpha=0.1), None),
    ("HardSigmoid", "HardSigmoid", HS, fixed(1 / 255)),
    ("HardSwish", "HardSwish", {}, None),
    ("Relu", "Relu", {}, None),
]:
    pattern(_n, f"DQ {_op} Q", group="unary")(unary(_op, CNN, yqp=_y, **_a))

pattern("Relu(out qp = in qp)", "DQ Relu Q, Q shares x's scale/zp (zp != qmin)", group="unary")(
    unary("Relu", CNN, yqp="x")
)


@pattern("Clip(0,6)", "DQ Clip Q, Q = [0,6]", group="unary")
def _clip(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    y = g.op("Clip", [x, g.const(np.array(0, np.float32)), g.const(np.array(6, np.float32))])
    g.out(y, "y", qp=fixed(6 / 255))


# --- HardSigmoid re-writes (canonical: HardSigmoid op QDQ with the same output qparams)
@pattern(
    "HardSigmoid: requant",
    "DQ(x) Q(6/256,zp128) DQ(1/256,0): no op at all",
    fp32=unary("HardSigmoid", CNN, **HS),
    canon=unary("HardSigmoid", CNN, **HS),
    group="hsig",
)
def _hsig_requant(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    if not g.q:
        x = g.op("HardSigmoid", [x], **HS)
    g.out(x, "y", qp=fixed(6 / 256, 128), dq_qp=fixed(U))


@pattern(
    "HardSigmoid: Add+relabel",
    "Add(x,3) Q(6/255,0) DQ(1/255,0) [Clip implied by Q]",
    fp32=unary("HardSigmoid", CNN, **HS),
    canon=unary("HardSigmoid", CNN, **HS),
    group="hsig",
)
def _hsig_add(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    if not g.q:
        g.out(g.op("HardSigmoid", [x], **HS), "y")
        return
    g.out(g.op("Add", [x, g.qconst(3.0)]), "y", qp=fixed(6 / 255), dq_qp=fixed(1 / 255))


@pattern(
    "HardSigmoid: Add+relabel, 1/256",
    "Add(x,3) Q(6/256,0) DQ(1/256,0) [no tie at x=0]",
    fp32=unary("HardSigmoid", CNN, **HS),
    canon=unary("HardSigmoid", CNN, **HS),
    group="hsig",
)
def _hsig_add256(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    if not g.q:
        g.out(g.op("HardSigmoid", [x], **HS), "y")
        return
    g.out(g.op("Add", [x, g.qconst(3.0)]), "y", qp=fixed(6 / 256), dq_qp=fixed(U))


@pattern(
    "HardSigmoid: Mul,Add,Clip (all QDQ)",
    "Mul(1/6) QDQ Add(.5) QDQ Clip(0,1) Q",
    fp32=unary("HardSigmoid", CNN, **HS),
    canon=unary("HardSigmoid", CNN, **HS),
    group="hsig",
)
def _hsig_dec_full(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    m = g.qdq(g.op("Mul", [x, g.qconst(1 / 6)]), "m")
    a = g.qdq(g.op("Add", [m, g.qconst(0.5)]), "a")
    g.out(
        g.op("Clip", [a, g.const(np.array(0, np.float32)), g.const(np.array(1, np.float32))]),
        "y",
        qp=fixed(1 / 255),
    )


@pattern(
    "HardSigmoid: Mul,Add,Clip (Clip->Q fold)",
    "Mul(1/6) QDQ Add(.5) Clip(0,1) Q(1/255,0)",
    fp32=unary("HardSigmoid", CNN, **HS),
    canon=unary("HardSigmoid", CNN, **HS),
    group="hsig",
)
def _hsig_dec_fold(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    m = g.qdq(g.op("Mul", [x, g.qconst(1 / 6)]), "m")
    a = g.op("Add", [m, g.qconst(0.5)])
    g.out(
        g.op("Clip", [a, g.const(np.array(0, np.float32)), g.const(np.array(1, np.float32))]),
        "y",
        qp=fixed(1 / 255),
    )


# --- LUT (256-entry Gather) for any unary op: exact by construction
def np_gelu(v):
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


NPF = {
    "Sigmoid": lambda v: 1 / (1 + np.exp(-v)),
    "HardSigmoid": lambda v: np.clip(v / 6 + 0.5, 0, 1),
    "HardSwish": lambda v: v * np.clip(v / 6 + 0.5, 0, 1),
    "SiLU": lambda v: v / (1 + np.exp(-v)),
    "Gelu": np_gelu,
    "Tanh": np.tanh,
}


def lut_pattern(fname, shape, float_build, yqp=None, scale=2.0):
    def fn(g):
        xq = g.inp("x", data("x", shape, scale=scale), dq=False)
        if not g.q:
            g.out(float_build(g, xq), "y")
            return
        qpx, qpy = g.qps["x"], g.resolve("y", yqp)
        qmin, qmax = qrange(g.dt)
        v = np.arange(256)
        v = (
            np.where(v > qmax, v - 256, v) if g.dt == "s8" else v
        )  # position p holds code p (int8: p-256 for p>127)
        tab = quant(
            NPF[fname](dequant(v.astype(np.int64), qpx).astype(np.float64)).astype(np.float32), qpy, g.dt
        )
        idx = g.op("Cast", [xq], to=TP.INT32)
        g.out_q(g.op("Gather", [g.const(tab), idx], axis=0), "y")

    return fn


def silu_float(g, x):
    return g.op("Mul", [x, g.op("Sigmoid", [x])])


def silu_ends(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    g.out(silu_float(g, x), "y")


for _f, _fb, _shape, _y in [
    ("HardSigmoid", lambda g, x: g.op("HardSigmoid", [x], **HS), CNN, fixed(1 / 255)),
    ("HardSwish", lambda g, x: g.op("HardSwish", [x]), CNN, None),
    ("Sigmoid", lambda g, x: g.op("Sigmoid", [x]), CNN, None),
    ("SiLU", silu_float, CNN, None),
    ("Tanh", lambda g, x: g.op("Tanh", [x]), CNN, None),
    ("Gelu", lambda g, x: g.op("Gelu", [x]), ENC, None),
]:

    def _fp(g, _fb=_fb, _shape=_shape):
        x = g.inp("x", data("x", _shape, scale=2.0 if _shape is CNN else 1.0))
        g.out(_fb(g, x), "y", qp=None)

    pattern(f"{_f}: LUT", "Cast(xq,int32) Gather(256-entry table)", fp32=_fp, canon=_fp, group="lut")(
        lut_pattern(_f, _shape, _fb, yqp=_y, scale=2.0 if _shape is CNN else 1.0)
    )


# --- HardSwish re-writes
def hswish_op(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    g.out(g.op("HardSwish", [x]), "y")


@pattern(
    "HardSwish: x*HardSigmoid(x)",
    "HardSigmoid QDQ(1/255) ; Mul(DQx, DQh) Q (shared DQx)",
    fp32=hswish_op,
    canon=hswish_op,
    group="hswish",
)
def _hsw_hsig(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    h = g.qdq(g.op("HardSigmoid", [x], **HS), "h", qp=fixed(1 / 255))
    g.out(g.op("Mul", [x, h]), "y")


def _hsw_requant(unique):
    def fn(g):
        x = g.inp("x", data("x", CNN, scale=2.0))
        if g.q:
            h = g.qdq(x, "h", qp=fixed(6 / 256, 128), dq_qp=fixed(U))
            x2 = g.redq("x", x) if unique else x
        else:
            h, x2 = g.op("HardSigmoid", [x], **HS), x
        g.out(g.op("Mul", [x2, h]), "y")

    return fn


pattern(
    "HardSwish: x*requant(x)",
    "DQx->Q(6/256,128)->DQ(1/256,0)=h ; Mul(DQx,h) Q (shared DQx)",
    fp32=hswish_op,
    canon=hswish_op,
    group="hswish",
)(_hsw_requant(False))
pattern(
    "HardSwish: x*requant(x), unique DQ",
    "as above, one DQ(x) per consumer",
    fp32=hswish_op,
    canon=hswish_op,
    group="hswish",
)(_hsw_requant(True))


def _hsw_add(den):
    def fn(g):
        x = g.inp("x", data("x", CNN, scale=2.0))
        if g.q:
            h = g.qdq(g.op("Add", [x, g.qconst(3.0)]), "h", qp=fixed(6 / den), dq_qp=fixed(1 / den))
        else:
            h = g.op("HardSigmoid", [x], **HS)
        g.out(g.op("Mul", [x, h]), "y")

    return fn


pattern(
    "HardSwish: x*relu6(x+3)/6",
    "Add(x,3) Q(6/255,0) DQ(1/255,0)=h ; Mul(DQx,h) Q",
    fp32=hswish_op,
    canon=hswish_op,
    group="hswish",
)(_hsw_add(255))
pattern(
    "HardSwish: x*relu6(x+3)/6, 1/256",
    "Add(x,3) Q(6/256,0) DQ(1/256,0)=h ; Mul(DQx,h) Q",
    fp32=hswish_op,
    canon=hswish_op,
    group="hswish",
)(_hsw_add(256))


# --- SiLU / Swish
def _silu2(unique):
    def fn(g):
        x = g.inp("x", data("x", CNN, scale=2.0))
        s = g.qdq(g.op("Sigmoid", [x]), "s")
        g.out(g.op("Mul", [g.redq("x", x) if unique else x, s]), "y")

    return fn


pattern(
    "SiLU: Sigmoid QDQ, Mul",
    "Sigmoid Q DQ ; Mul(DQx, DQs) Q (shared DQx)",
    fp32=silu_ends,
    canon=silu_ends,
    group="silu",
)(_silu2(False))
pattern(
    "SiLU: Sigmoid QDQ, Mul, unique DQ",
    "as above, one DQ(x) per consumer",
    fp32=silu_ends,
    canon=silu_ends,
    group="silu",
)(_silu2(True))


@pattern(
    "SiLU: ms.QuickGelu(alpha=1) island",
    "DQx -> com.microsoft QuickGelu(1.0) -> Q (single float op)",
    fp32=silu_ends,
    canon=silu_ends,
    group="silu",
)
def _silu_qg(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    g.out(g.op("QuickGelu", [x], domain="com.microsoft", alpha=1.0), "y")


pattern(
    "SiLU: QDQ at ends only",
    "DQx -> Sigmoid -> Mul -> Q (float interior)",
    fp32=silu_ends,
    canon=silu_ends,
    group="silu",
)(silu_ends)


# --- binary
@pattern("Mul same shape", "Mul(DQx, DQz) Q", group="binary")
def _mul(g):
    x, z = g.inp("x", data("x", CNN)), g.inp("z", data("z", CNN))
    g.out(g.op("Mul", [x, z]), "y")


@pattern("Mul bcast (SE scale)", "Mul(DQx[1,96,28,28], DQgate[1,96,1,1]) Q", group="binary")
def _mulb(g):
    x, z = g.inp("x", data("x", CNN, scale=2.0)), g.inp("gate", data("gate", GATE, "gate"))
    g.out(g.op("Mul", [x, z]), "y")


@pattern("SE: Sigmoid(s) * x", "Sigmoid(DQs[1,96,1,1]) QDQ ; Mul(DQx, gate) Q", group="binary")
def _se_sig(g):
    x, s = g.inp("x", data("x", CNN, scale=2.0)), g.inp("s", data("s", GATE, scale=2.0))
    gt = g.qdq(g.op("Sigmoid", [s]), "gate")
    g.out(g.op("Mul", [x, gt]), "y")


@pattern("SE: HardSigmoid(s) * x", "HardSigmoid(DQs) QDQ ; Mul(DQx, gate) Q", group="binary")
def _se_hsig(g):
    x, s = g.inp("x", data("x", CNN, scale=2.0)), g.inp("s", data("s", GATE, scale=2.0))
    gt = g.qdq(g.op("HardSigmoid", [s], **HS), "gate", qp=fixed(1 / 255))
    g.out(g.op("Mul", [x, gt]), "y")


@pattern("Add same shape (residual)", "Add(DQx, DQz) Q", group="binary")
def _add(g):
    x, z = g.inp("x", data("x", CNN)), g.inp("z", data("z", CNN))
    g.out(g.op("Add", [x, z]), "y")


@pattern("Add bcast [1,96,1,1]", "Add(DQx, DQb[1,96,1,1]) Q", group="binary")
def _addb(g):
    x, z = g.inp("x", data("x", CNN)), g.inp("b", data("b", GATE))
    g.out(g.op("Add", [x, z]), "y")


@pattern("Where", "Where(cond, DQx, DQz) Q", group="binary")
def _where(g):
    c = g.inp("cond", data("cond", CNN, "bool"))
    x, z = g.inp("x", data("x", CNN)), g.inp("z", data("z", CNN, scale=3.0))
    g.out(g.op("Where", [c, x, z]), "y")


def _matmul(qout):
    def fn(g):
        a = g.inp("a", data("a", [1, 12, 128, 64]))
        b = g.inp("b", data("b", [1, 12, 64, 128]))
        g.out(g.op("MatMul", [a, b]), "y", quant=qout)

    return fn


pattern("MatMul act x act", "MatMul(DQa[1,12,128,64], DQb[1,12,64,128]) Q", group="binary")(_matmul(True))
pattern("MatMul act x act, float out", "MatMul(DQa, DQb) -> float y (no Q)", group="binary")(_matmul(False))


# --- encoder ops
pattern("Softmax [1,12,128,128], out 1/256", "DQ Softmax(-1) Q(1/256, 0)", group="encoder")(
    unary("Softmax", ATT, scale=3.0, yqp=fixed(U), axis=-1)
)
pattern("Softmax [1,12,128,128], out calibrated", "DQ Softmax(-1) Q(calibrated)", group="encoder")(
    unary("Softmax", ATT, scale=3.0, axis=-1)
)
pattern("Softmax [1,128,768], out 1/256", "DQ Softmax(-1) Q(1/256, 0)", group="encoder")(
    unary("Softmax", ENC, scale=3.0, yqp=fixed(U), axis=-1)
)
pattern("Gelu (opset 20 op)", "DQ Gelu Q", group="encoder")(unary("Gelu", ENC, scale=1.0))


def gelu_erf(full):
    def fn(g):
        x = g.inp("x", data("x", ENC, scale=1.0))
        d = g.op("Div", [x, g.qconst(math.sqrt(2))])
        d = g.qdq(d, "d") if full else d
        e = g.op("Erf", [d])
        e = g.qdq(e, "e") if full else e
        a = g.op("Add", [e, g.qconst(1.0)])
        a = g.qdq(a, "a") if full else a
        m = g.op("Mul", [x, a])
        m = g.qdq(m, "m") if full else m
        g.out(g.op("Mul", [m, g.qconst(0.5)]), "y")

    return fn


pattern(
    "Gelu: Erf decomposition, all QDQ",
    "Div QDQ Erf QDQ Add QDQ Mul QDQ Mul Q",
    group="encoder",
    canon=unary("Gelu", ENC, scale=1.0),
)(gelu_erf(True))
pattern(
    "Gelu: Erf decomposition, QDQ at ends",
    "DQx Div Erf Add Mul Mul Q (float interior)",
    group="encoder",
    canon=unary("Gelu", ENC, scale=1.0),
)(gelu_erf(False))


@pattern("LayerNormalization", "DQ LayerNorm(gamma,beta float) Q", group="encoder")
def _ln(g):
    x = g.inp("x", data("x", ENC, scale=1.0))
    rng = np.random.default_rng(0)
    gm = g.const((1 + 0.1 * rng.standard_normal(768)).astype(np.float32))
    bt = g.const((0.1 * rng.standard_normal(768)).astype(np.float32))
    g.out(g.op("LayerNormalization", [x, gm, bt], axis=-1, epsilon=1e-5), "y")


# --- data movement / pooling (outputs share x's qparams unless said otherwise)
def mover(op, inputs_fn=None, yqp="x", shape=CNN, n_out=1, **attrs):
    def fn(g):
        x = g.inp("x", data("x", shape, scale=2.0))
        extra = inputs_fn(g) if inputs_fn else []
        ys = g.op(op, [x] + extra, n_out=n_out, **attrs)
        for i, y in enumerate([ys] if n_out == 1 else ys):
            g.out(y, f"y{i}", qp=yqp)

    return fn


@pattern("Concat axis 1, shared qparams", "Concat(DQx, DQz) Q, all same scale/zp", group="move")
def _cat_same(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    z = g.inp("z", data("z", CNN, scale=1.0), qp="x")
    g.out(g.op("Concat", [x, z], axis=1), "y", qp="x")


@pattern("Concat axis 1, own qparams", "Concat(DQx, DQz) Q, each calibrated", group="move")
def _cat_diff(g):
    x, z = g.inp("x", data("x", CNN, scale=2.0)), g.inp("z", data("z", CNN, scale=1.0))
    g.out(g.op("Concat", [x, z], axis=1), "y")


pattern("Split axis 1 (2 outputs)", "DQ Split Q,Q same qparams", group="move")(
    mover("Split", n_out=2, axis=1, num_outputs=2)
)
pattern("Resize nearest x2", "DQ Resize(nearest, asymmetric, floor) Q", group="move")(
    mover(
        "Resize",
        lambda g: ["", g.const(np.array([1, 1, 2, 2], np.float32))],
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )
)
pattern("Resize linear x2", "DQ Resize(linear, half_pixel) Q", group="move")(
    mover("Resize", lambda g: ["", g.const(np.array([1, 1, 2, 2], np.float32))], mode="linear")
)
pattern("MaxPool 3x3 s2", "DQ MaxPool Q", group="move")(
    mover("MaxPool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
)
pattern(
    "MaxPool 3x3 s2, out qp != in qp", "DQ MaxPool Q(calibrated: differs from x) -> not dropped", group="move"
)(mover("MaxPool", yqp=None, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))


pattern(
    "MaxPool 3x3 s2, out scale = in scale*(1+2^-20)",
    "DQ MaxPool Q(scale nudged 1 ulp-ish, same zp): not dropped, values unchanged",
    group="move",
)(
    mover(
        "MaxPool",
        yqp=lambda dt, q: (float(np.float32(q["x"][0] * (1 + 2**-20))), q["x"][1]),
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
    )
)


def avgpool_cip(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    g.out(
        g.op("AveragePool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=1),
        "y",
    )


pattern("AveragePool 3x3 s1 count_include_pad=1", "DQ AveragePool Q (calibrated)", group="move")(avgpool_cip)


@pattern(
    "AveragePool 3x3 as depthwise Conv",
    "Conv(DQx, DQw=127*(1/9)/127 [96,1,3,3] s8, group 96) Q",
    fp32=avgpool_cip,
    canon=avgpool_cip,
    group="move",
)
def _avg_conv(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    w = g.dq_weight(np.full((96, 1, 3, 3), 1 / 9, np.float64), (1 / 9) / 127)
    g.out(g.op("Conv", [x, w], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=96), "y")


pattern("AveragePool 3x3 s1", "DQ AveragePool Q (calibrated)", group="move")(
    mover(
        "AveragePool", yqp=None, kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], count_include_pad=0
    )
)
pattern("GlobalAveragePool", "DQ GlobalAveragePool Q (calibrated)", group="move")(
    mover("GlobalAveragePool", yqp=None)
)
pattern("ReduceMean HW keepdims", "DQ ReduceMean(axes=[2,3]) Q (calibrated)", group="move")(
    mover("ReduceMean", lambda g: [g.const(np.array([2, 3], np.int64))], yqp=None, keepdims=1)
)
pattern("Pad constant 0", "DQ Pad(1px, 0.0) Q", group="move")(
    mover(
        "Pad",
        lambda g: [g.const(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)), g.const(np.array(0, np.float32))],
        mode="constant",
    )
)
pattern("Transpose NCHW->NHWC", "DQ Transpose Q", group="move")(mover("Transpose", perm=[0, 2, 3, 1]))
pattern("Reshape", "DQ Reshape([1,96,784]) Q", group="move")(
    mover("Reshape", lambda g: [g.const(np.array([1, 96, 784], np.int64))])
)
pattern("Flatten", "DQ Flatten(axis 1) Q", group="move")(mover("Flatten", axis=1))
pattern("DepthToSpace b2", "DQ DepthToSpace(2, DCR) Q", group="move")(
    mover("DepthToSpace", blocksize=2, mode="DCR")
)


def shuffle(full):
    def fn(g):
        x = g.inp("x", data("x", CNN, scale=2.0))
        r = g.op("Reshape", [x, g.const(np.array([1, 2, 48, 28, 28], np.int64))])
        r = g.qdq(r, "r", qp="x") if full else r
        t = g.op("Transpose", [r], perm=[0, 2, 1, 3, 4])
        t = g.qdq(t, "t", qp="x") if full else t
        g.out(g.op("Reshape", [t, g.const(np.array(CNN, np.int64))]), "y", qp="x")

    return fn


pattern("Channel shuffle, QDQ every op", "Reshape QDQ Transpose QDQ Reshape Q", group="move")(shuffle(True))
pattern("Channel shuffle, QDQ at ends", "DQ Reshape Transpose Reshape Q", group="move")(shuffle(False))


@pattern("Transpose, no output Q", "DQ Transpose -> float y (QDQ propagation?)", group="move")
def _tr_noq(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    g.out(g.op("Transpose", [x], perm=[0, 2, 3, 1]), "y", quant=False)


@pattern("DQ -> {Transpose, Sigmoid}", "one DQ(x) feeding Transpose->Q and Sigmoid->Q", group="move")
def _multi(g):
    x = g.inp("x", data("x", CNN, scale=2.0))
    g.out(g.op("Transpose", [x], perm=[0, 2, 3, 1]), "y0", qp="x")
    g.out(g.op("Sigmoid", [x]), "y1")


# ----------------------------------------------------------------------------------------------- running
EXTRA_CFG: dict = {}  # session config entries applied to every session (e.g. session.qdqisint8allowed)


def session(model, level, disable_qdq=False, save=None):
    so = ort.SessionOptions()
    for k, v in EXTRA_CFG.items():
        so.add_session_config_entry(k, v)
    so.graph_optimization_level = level
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if disable_qdq:
        so.add_session_config_entry("session.disable_quant_qdq", "1")
    if save:
        so.optimized_model_filepath = save
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run(model, feeds, level, **kw):
    s = session(model, level, **kw)
    return s, s.run(None, feeds)


def bench(sess, feeds, outs, runs):
    io = sess.io_binding()
    keep = []
    for k, v in feeds.items():
        io.bind_cpu_input(k, np.ascontiguousarray(v))
    for o, a in zip(sess.get_outputs(), outs, strict=True):
        ov = ort.OrtValue.ortvalue_from_numpy(np.empty_like(a))
        keep.append(ov)
        io.bind_ortvalue_output(o.name, ov)
    for _ in range(5):
        sess.run_with_iobinding(io)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


ABBR = {"QuantizeLinear": "Q", "DequantizeLinear": "DQ"}


def census(path):
    m = onnx.load(path)
    ops = []
    for n in m.graph.node:
        nm = ABBR.get(n.op_type, n.op_type)
        if n.domain == "com.microsoft":
            nm = "ms." + nm
        elif n.domain not in ("", "ai.onnx"):
            nm = n.domain.split(".")[-1] + "." + nm
        ops.append(nm)
    return ops


def fmt_census(ops):
    out, prev, cnt = [], None, 0
    for o in ops + [None]:
        if o == prev:
            cnt += 1
            continue
        if prev is not None:
            out.append(prev if cnt == 1 else f"{prev}x{cnt}")
        prev, cnt = o, 1
    return " ".join(out)


INT_KERNELS = re.compile(r"^(ms\.)?(QLinear\w+|QGemm|MatMulInteger\w*|DynamicQuantize\w*|ConvInteger)$")


def verdict(ops):
    core = [o for o in ops if o not in ("Q", "DQ")]
    fused = sorted({o for o in core if INT_KERNELS.match(o)})
    other = sorted({o for o in core if not INT_KERNELS.match(o)})
    has_qdq = any(o in ("Q", "DQ") for o in ops)
    if fused and not other:
        return (
            "FUSED "
            + "+".join(o.replace("ms.", "") for o in fused)
            + (" (+requant DQ->Q)" if has_qdq else "")
        )
    if fused and not has_qdq:
        return "FUSED " + "+".join(o.replace("ms.", "") for o in fused) + " (+ int " + "+".join(other) + ")"
    if fused:
        return "PARTLY: " + "+".join(o.replace("ms.", "") for o in fused) + " ; float " + "+".join(other)
    if not core:
        return "op folded away (DQ->Q requant)" if has_qdq else "removed"
    if not has_qdq:
        return "INT passthrough: " + "+".join(other)
    return "not fused (float island)"


def diff(a_list, b_list, scales):
    worst, frac = 0.0, 0.0
    for a, b, s in zip(a_list, b_list, scales, strict=True):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        s = s or 1.0
        worst = max(worst, float(d.max()) / s)
        frac = max(frac, float((d > 0.5 * s).mean()))
    return worst, frac


def fmt_diff(d):
    if d is None:
        return "-"
    w, f = d
    if w < 1e-3:
        return "0"
    return f"{w:.3g} LSB ({100 * f:.2g}%)" if f > 0 else f"{w:.2g} LSB (float noise)"


def evaluate(P, dt, runs, fp32_cache):
    # calibration on the float graph
    gc = G("cal", dt)
    P["fn"](gc)
    s, outs = run(gc.model(), gc.feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    names = [o.name for o in s.get_outputs()]
    ranges = dict(gc.direct)
    for k, t in gc.cal.items():
        a = outs[names.index(t)]
        ranges[k] = (float(a.min()), float(a.max()))

    # QDQ, float I/O: exactness + census
    gf = G("qdq", dt, "f", ranges)
    P["fn"](gf)
    mf = gf.model()
    _, ref = run(mf, gf.feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    optf = os.path.join(TMP, "f.onnx")
    _, fused = run(mf, gf.feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, save=optf)
    census_f = census(optf)
    d_self = diff(fused, ref, gf.out_scales)
    d_canon = None
    if P["canon"] is not None:
        gk = G("qdq", dt, "f", ranges, force={k: v for k, v in gf.qps.items() if k in ("x", "y")})
        gk.force["y"] = gf.dqp.get("y", gf.qps.get("y"))
        P["canon"](gk)
        _, cref = run(gk.model(), gk.feeds, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        d_canon = diff(fused, cref, gf.out_scales)

    # QDQ, integer I/O: census + timings
    gq = G("qdq", dt, "q", ranges)
    P["fn"](gq)
    mq = gq.model()
    optq = os.path.join(TMP, "q.onnx")
    sq, oq = run(mq, gq.feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, save=optq)
    census_q = census(optq)
    t_fused = bench(sq, gq.feeds, oq, runs)
    si, oi = run(mq, gq.feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, disable_qdq=True)
    t_island = bench(si, gq.feeds, oi, runs)

    # FP32 baseline
    fpfn = P["fp32"] or P["fn"]
    if id(fpfn) not in fp32_cache:
        g32 = G("fp32")
        fpfn(g32)
        opt32 = os.path.join(TMP, "fp32.onnx")
        s32, o32 = run(g32.model(), g32.feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, save=opt32)
        c32 = census(opt32)
        note = "" if sorted(set(c32)) == sorted({n.op_type for n in g32.nodes}) else f" [{fmt_census(c32)}]"
        fp32_cache[id(fpfn)] = (bench(s32, g32.feeds, o32, runs), note)
    t_fp32, fp32_note = fp32_cache[id(fpfn)]

    core_f = [o for o in census_f if o not in ("Q", "DQ")]
    core_q = [o for o in census_q if o not in ("Q", "DQ")]
    return dict(
        name=P["name"],
        dt=dt,
        desc=P["desc"],
        census=fmt_census(census_q),
        census_f=fmt_census(census_f),
        census_note="" if sorted(core_f) == sorted(core_q) else " [float-I/O: " + fmt_census(census_f) + "]",
        verdict=verdict(census_q),
        d_self=d_self,
        d_canon=d_canon,
        fp32=t_fp32,
        fp32_note=fp32_note,
        island=t_island,
        fused=t_fused,
    )


def cpu_info():
    flags = set()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    want = ["avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16"]
    return model, {w: (w in flags) for w in want}


# ----------------------------------------------------------------------------------------------- quantize_static
def qstatic_models():
    """Small MobileNetV3 / EfficientNet style blocks, float, for ORT's own quantize_static."""
    rng = np.random.default_rng(1)

    def w(*s):
        return (rng.standard_normal(s) * math.sqrt(2.0 / np.prod(s[1:]))).astype(np.float32)

    def conv(nodes, inits, x, cin, cout, k=1, group=1, name=""):
        wn, bn = f"{name}_w", f"{name}_b"
        inits += [
            onh.from_array(w(cout, cin // group, k, k), wn),
            onh.from_array((0.1 * rng.standard_normal(cout)).astype(np.float32), bn),
        ]
        nodes.append(
            oh.make_node("Conv", [x, wn, bn], [name], kernel_shape=[k, k], pads=[k // 2] * 4, group=group)
        )
        return name

    def build(kind):
        nodes, inits = [], []
        c = conv(nodes, inits, "x", 96, 96, 1, name="pw1")
        if kind == "hswish":
            nodes.append(oh.make_node("HardSwish", [c], ["a1"]))
            c = conv(nodes, inits, "a1", 96, 96, 3, 96, name="dw")
            nodes.append(oh.make_node("HardSwish", [c], ["a2"]))
            a = "a2"
        else:
            nodes.append(oh.make_node("Sigmoid", [c], ["s1"]))
            nodes.append(oh.make_node("Mul", [c, "s1"], ["a1"]))
            c = conv(nodes, inits, "a1", 96, 96, 3, 96, name="dw")
            nodes.append(oh.make_node("Sigmoid", [c], ["s2"]))
            nodes.append(oh.make_node("Mul", [c, "s2"], ["a2"]))
            a = "a2"
        nodes.append(oh.make_node("GlobalAveragePool", [a], ["gap"]))
        r = conv(nodes, inits, "gap", 96, 24, 1, name="se1")
        nodes.append(oh.make_node("Relu", [r], ["ser"]))
        r = conv(nodes, inits, "ser", 24, 96, 1, name="se2")
        if kind == "hswish":
            nodes.append(oh.make_node("HardSigmoid", [r], ["gate"], **HS))
        else:
            nodes.append(oh.make_node("Sigmoid", [r], ["gate"]))
        nodes.append(oh.make_node("Mul", [a, "gate"], ["se"]))
        conv(nodes, inits, "se", 96, 96, 1, name="y")
        g = oh.make_graph(
            nodes,
            kind,
            [oh.make_tensor_value_info("x", TP.FLOAT, CNN)],
            [oh.make_tensor_value_info("y", TP.FLOAT, None)],
            inits,
        )
        return oh.make_model(g, opset_imports=[oh.make_opsetid("", OPSET)], ir_version=IR)

    return {
        "MobileNetV3 block (HardSwish, SE HardSigmoid)": build("hswish"),
        "EfficientNet block (SiLU as Sigmoid*x, SE Sigmoid)": build("silu"),
    }


def lut_rewrite(model):
    """Replace every per-tensor `DQ -> {HardSwish|HardSigmoid|Sigmoid|Tanh} -> Q` by Cast + 256-entry Gather."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    init = {i.name: onh.to_array(i) for i in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    cons = {}
    for n in g.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    fns = {"HardSwish": NPF["HardSwish"], "Sigmoid": NPF["Sigmoid"], "Tanh": NPF["Tanh"]}
    drop, new, count = set(), [], 0
    for n in g.node:
        f = fns.get(n.op_type)
        if n.op_type == "HardSigmoid":
            al = {a.name: a.f for a in n.attribute}
            a_, b_ = al.get("alpha", 0.2), al.get("beta", 0.5)

            def f(v, a_=a_, b_=b_):
                return np.clip(a_ * v + b_, 0, 1)

        if f is None:
            continue
        dq = prod.get(n.input[0])
        qs = cons.get(n.output[0], [])
        if not dq or dq.op_type != "DequantizeLinear" or len(qs) != 1 or qs[0].op_type != "QuantizeLinear":
            continue
        q = qs[0]
        try:
            sx, zx = float(init[dq.input[1]]), init[dq.input[2]]
            sy, zy = float(init[q.input[1]]), init[q.input[2]]
        except KeyError:
            continue
        if zx.size != 1 or zy.size != 1:
            continue
        dtx = "u8" if zx.dtype == np.uint8 else "s8"
        dty = "u8" if zy.dtype == np.uint8 else "s8"
        v = np.arange(256)
        v = np.where(v > 127, v - 256, v) if dtx == "s8" else v
        tab = quant(f(dequant(v, (sx, int(zx))).astype(np.float64)).astype(np.float32), (sy, int(zy)), dty)
        tname = n.output[0] + "_lut"
        g.initializer.append(onh.from_array(tab, tname))
        new.append(
            (
                n,
                [
                    oh.make_node("Cast", [dq.input[0]], [tname + "_idx"], to=TP.INT32),
                    oh.make_node("Gather", [tname, tname + "_idx"], [q.output[0]], axis=0),
                ],
            )
        )
        drop |= {id(n), id(q)}
        if len(cons[dq.output[0]]) == 1:
            drop.add(id(dq))
        count += 1
    repl = {id(n): ns for n, ns in new}
    nodes = []
    for n in g.node:
        if id(n) in repl:
            nodes += repl[id(n)]
        elif id(n) not in drop:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return m, count


def relabel_rewrite(model):
    """Rewrite ORT-quantizer float islands into QLinearAdd/QLinearMul-fusable patterns:
    DQ(x) -> HardSigmoid(1/6, .5) -> Q(s, qmin)   =>  Add(DQ(x), DQ(3)) -> Q(6*s, qmin)   (downstream DQ reads s)
    DQ(x) -> HardSwish -> Q(y)                    =>  Add(DQ(x), DQ(3)) -> Q(6/256, qmin) -> DQ(1/256, qmin) = h ;
                                                      Mul(DQ(x), h) -> Q(y)"""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    init = {i.name: onh.to_array(i) for i in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    cons = {}
    for n in g.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    new_inits, repl, count = [], {}, 0

    def c(name, arr):
        new_inits.append(onh.from_array(np.asarray(arr), name))
        return name

    for n in g.node:
        if n.op_type not in ("HardSwish", "HardSigmoid"):
            continue
        dq, qs = prod.get(n.input[0]), cons.get(n.output[0], [])
        if not dq or dq.op_type != "DequantizeLinear" or len(qs) != 1 or qs[0].op_type != "QuantizeLinear":
            continue
        q = qs[0]
        if dq.input[1] not in init or q.input[1] not in init or len(q.input) < 3:
            continue
        zq = init[q.input[2]]
        zx = init[dq.input[2]]
        dt = "u8" if zx.dtype == np.uint8 else "s8"
        qmin, qmax = qrange(dt)
        p = n.output[0] + "_rl"
        three = c(p + "_3", np.array(qmax, NPDT[dt]))
        nodes = [
            oh.make_node(
                "DequantizeLinear",
                [three, c(p + "_3s", np.array(3 / qmax, np.float32)), c(p + "_3z", np.array(0, NPDT[dt]))],
                [p + "_3f"],
            ),
            oh.make_node("Add", [n.input[0], p + "_3f"], [p + "_a"]),
        ]
        if n.op_type == "HardSigmoid":
            al = {a.name: a.f for a in n.attribute}
            sy = float(init[q.input[1]])
            if (
                abs(al.get("alpha", 0.2) - 1 / 6) > 1e-6
                or abs(al.get("beta", 0.5) - 0.5) > 1e-6
                or int(zq) != qmin
                or sy * (qmax - qmin) > 1 + 1e-6
            ):
                continue
            nodes[-1].output[0] = n.output[0]
            q.input[1] = c(p + "_qs", np.array(6 * sy, np.float32))  # Q(6*s) ; the existing DQ keeps s
        else:
            nodes += [
                oh.make_node(
                    "QuantizeLinear",
                    [
                        p + "_a",
                        c(p + "_hs", np.array(6 / 256, np.float32)),
                        c(p + "_hz", np.array(qmin, NPDT[dt])),
                    ],
                    [p + "_hq"],
                ),
                oh.make_node(
                    "DequantizeLinear",
                    [
                        p + "_hq",
                        c(p + "_ds", np.array(1 / 256, np.float32)),
                        c(p + "_dz", np.array(qmin, NPDT[dt])),
                    ],
                    [p + "_h"],
                ),
                oh.make_node("Mul", [n.input[0], p + "_h"], [n.output[0]]),
            ]
        repl[id(n)] = nodes
        count += 1
    nodes = []
    for n in g.node:
        nodes += repl.get(id(n), [n])
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)
    return m, count


def qstatic_section(runs):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(7)
            self.it = iter([{"x": rng.standard_normal(CNN).astype(np.float32)} for _ in range(8)])

        def get_next(self):
            return next(self.it, None)

    x = {"x": np.random.default_rng(9).standard_normal(CNN).astype(np.float32)}
    rows = []
    for title, fm in qstatic_models().items():
        fp = os.path.join(TMP, "qs_fp32.onnx")
        qp = os.path.join(TMP, "qs_qdq.onnx")
        onnx.save(fm, fp)
        quantize_static(
            fp,
            qp,
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
        qm = onnx.load(qp)
        # which float ops got Q/DQ around them?
        prod = {o: n for n in qm.graph.node for o in n.output}
        emitted = []
        for n in qm.graph.node:
            if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
                continue
            ins = [prod[i].op_type == "DequantizeLinear" for i in n.input if i in prod]
            emitted.append(f"{n.op_type}[{'DQ' if ins and all(ins) else 'f'}]")
        s32 = session(fm, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        o32 = s32.run(None, x)
        t32 = bench(s32, x, o32, runs)
        variants = [("quantize_static QDQ", qm)]
        rm, nrep = relabel_rewrite(qm)
        if nrep:
            variants.append((f"+ Add/relabel rewrite of {nrep} HardSwish/HardSigmoid island(s)", rm))
        lm, nrep = lut_rewrite(qm)
        if nrep:
            variants.append((f"+ LUT (Cast+Gather) rewrite of {nrep} unary island(s)", lm))
        oref = session(qm, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(
            None, x
        )  # QDQ math of the original
        for vname, vm in variants:
            optp = os.path.join(TMP, "qs_opt.onnx")
            sf = session(vm, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, save=optp)
            of = sf.run(None, x)
            tq = bench(sf, x, of, runs)
            sq = [n for n in qm.graph.node if n.op_type == "QuantizeLinear"]
            ys = float(onh.to_array(next(i for i in qm.graph.initializer if i.name == sq[-1].input[1])))
            d = float(np.abs(of[0] - oref[0]).max()) / ys
            e = float(np.abs(of[0] - o32[0]).max() / (np.abs(o32[0]).max()))
            rows.append(
                dict(
                    model=title,
                    variant=vname,
                    emitted=" ".join(emitted) if vname.startswith("quant") else "",
                    census=fmt_census(census(optp)),
                    d=d,
                    fp32=t32,
                    q=tq,
                    rel=e,
                )
            )
    return rows


# ----------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--only", default="", help="regex on pattern names")
    ap.add_argument("--dt", default="u8,s8")
    ap.add_argument("--no-qstatic", action="store_true")
    args = ap.parse_args()

    model, flags = cpu_info()
    print(
        f"# qdq_op_coverage  onnxruntime {ort.__version__}  onnx {onnx.__version__}  numpy {np.__version__}  "
        f"python {platform.python_version()}"
    )
    print(
        f"# CPU: {model or platform.processor()}  cores visible: {os.cpu_count()}  flags: "
        + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items())
    )
    print(
        f"# timings: 1 intra-op thread, io-binding, median of {args.runs} runs; shared/loaded machine -> indicative"
    )
    print()
    hdr = (
        "| pattern | act | emitted pattern | optimized graph (int I/O) | verdict | max\\|fused-QDQ\\| | "
        "max\\|fused-canonical\\| | fp32 ms | island ms | fused ms | fp32/fused |"
    )
    print(hdr)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cache, results = {}, {}
    t0 = time.time()
    dts = args.dt.split(",")
    for P in PATTERNS:
        if args.only and not re.search(args.only, P["name"]):
            continue
        for dt in P["dts"]:
            if dt not in dts:
                continue
            try:
                r = evaluate(P, dt, args.runs, cache)
            except Exception as e:  # noqa: BLE001 - a probe: report and continue
                msg = str(e).replace("\n", " ").replace("|", "/")[:150]
                print(f"| {P['name']} | {dt} | {P['desc']} | ERROR | {msg} | | | | | | |")
                continue
            sp = r["fp32"] / r["fused"]
            print(
                f"| {r['name']} | {dt} | {r['desc']} | {r['census']}{r['census_note']} | {r['verdict']} | "
                f"{fmt_diff(r['d_self'])} | {fmt_diff(r['d_canon'])} | {r['fp32']:.3f}{r['fp32_note']} | "
                f"{r['island']:.3f} | "
                f"{r['fused']:.3f} | {sp:.2f}x |",
                flush=True,
            )
            results[(P["name"], dt)] = r
    print(f"\n# patterns done in {time.time() - t0:.1f}s")

    redo = [
        P
        for P in PATTERNS
        if "s8" in dts
        and (P["name"], "s8") in results
        and not results[(P["name"], "s8")]["verdict"].startswith(("FUSED", "INT"))
        and results.get((P["name"], "u8"), {}).get("verdict", "").startswith(("FUSED", "INT", "PARTLY"))
    ]
    if redo:
        print(
            "\n## int8 activations again with session.qdqisint8allowed=1 (x86 default is 0: ORT rewrites int8 "
            "Q->DQ pairs to uint8, QDQS8ToU8Transformer), patterns that fused for u8 but not for s8\n"
        )
        print("| pattern | optimized graph (int I/O) | verdict | max\\|fused-QDQ\\| | fused ms |")
        print("|---|---|---|---|---|")
        EXTRA_CFG["session.qdqisint8allowed"] = "1"
        for P in redo:
            try:
                r = evaluate(P, "s8", args.runs, {})
            except Exception as e:  # noqa: BLE001
                print(f"| {P['name']} | ERROR | {str(e)[:120]} | | |")
                continue
            print(
                f"| {r['name']} | {r['census']}{r['census_note']} | {r['verdict']} | {fmt_diff(r['d_self'])} | "
                f"{r['fused']:.3f} |",
                flush=True,
            )
        EXTRA_CFG.clear()

    if not args.no_qstatic:
        print(
            "\n## onnxruntime.quantization.quantize_static (QDQ, per_channel, u8 act / s8 weights) on small blocks\n"
        )
        print(
            "| block | variant | ops in QDQ model ([DQ]=all inputs dequantized, [f]=float input) | "
            "optimized graph | max\\|fused - original QDQ math\\| (output LSB) | max err / max\\|fp32\\| | fp32 ms | QDQ fused ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        t1 = time.time()
        for r in qstatic_section(max(20, args.runs // 3)):
            print(
                f"| {r['model']} | {r['variant']} | {r['emitted']} | {r['census']} | {r['d']:.3g} | "
                f"{r['rel']:.3g} | {r['fp32']:.3f} | {r['q']:.3f} |",
                flush=True,
            )
        print(f"\n# quantize_static section done in {time.time() - t1:.1f}s")


if __name__ == "__main__":
    main()
