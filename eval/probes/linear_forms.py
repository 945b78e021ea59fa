"""Probe: which ONNX form of a static-INT8 linear layer (float out + bias) does ORT's CPU EP fuse, and how fast is it?

Standalone:  python eval/probes/linear_forms.py [--runs 300] [--quick]

Each candidate is built with onnx.helper (opset 17 default domain, plus com.microsoft only where the
name says "contrib"), optimised with ORT_ENABLE_ALL (optimized graph dumped to a temp dir for the op
histogram), timed with 2 intra-op threads (candidates interleaved in rounds, median reported), and
checked against a NumPy float64 reference of the intended integer math:

    y = (s_x * s_w) * (xq - zp_x) @ (Wq - zp_w) + b          xq = clip(round(x / s_x) + zp_x, 0, 255)

Scenarios: one linear layer (K, N) in {(384,384), (384,1536), (1536,384)} at M = 128 and M = 1;
three linears (Q, K, V) sharing one input; and an FFN chain  L1 -> erf-GELU -> L2 -> +residual -> LayerNorm.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ort.set_default_logger_severity(3)  # silence "initializer appears in graph inputs" / NCHWc serialisation warnings

OPSET = 17
F32 = TensorProto.FLOAT


# ----------------------------------------------------------------------------------------------
# quantisation helpers (numpy)
# ----------------------------------------------------------------------------------------------
def act_qparams(x: np.ndarray) -> tuple[np.float32, np.uint8]:
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s = np.float32((hi - lo) / 255.0)
    zp = np.uint8(np.clip(np.round(-lo / s), 0, 255))
    return s, zp


def quant_act(x: np.ndarray, s: np.float32, zp: np.uint8) -> np.ndarray:
    # ONNX QuantizeLinear: saturate(round_half_even(x / s) + zp); division in float32
    return np.clip(np.rint(x.astype(np.float32) / s) + int(zp), 0, 255).astype(np.uint8)


class QLinear:
    """One linear layer: float W [K,N], b [N]; symmetric per-output-channel int8 weights."""

    def __init__(self, rng: np.random.Generator, K: int, N: int):
        self.K, self.N = K, N
        self.W = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
        self.b = (rng.standard_normal(N) * 0.1).astype(np.float32)
        self.s_w = (np.abs(self.W).max(axis=0) / 127.0).astype(np.float32)  # [N]
        self.Wq = np.clip(np.rint(self.W / self.s_w), -127, 127).astype(np.int8)
        self.zp_w = np.zeros(self.N, np.int8)
        self.s_x: np.float32 | None = None
        self.zp_x: np.uint8 | None = None

    def calibrate(self, x: np.ndarray) -> None:
        self.s_x, self.zp_x = act_qparams(x)

    # the intended integer math, float64
    def ref(self, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        xq = quant_act(x, self.s_x, self.zp_x).astype(np.int64) - int(self.zp_x)
        acc = xq @ (self.Wq.astype(np.int64) - self.zp_w.astype(np.int64))
        b = self.b if bias is None else bias
        return (acc.astype(np.float64) * (np.float64(self.s_x) * self.s_w.astype(np.float64)) + b).astype(np.float64)

    def ref_fp32(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float64) @ self.W.astype(np.float64) + self.b

    # int32 bias for the QGemm form, and the float bias it actually represents
    def bias_i32(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        sb = (np.float32(self.s_x) * self.s_w).astype(np.float32)
        bq = np.rint(self.b / sb).astype(np.int32)
        return bq, sb, (bq.astype(np.float64) * sb.astype(np.float64))


# ----------------------------------------------------------------------------------------------
# graph builder
# ----------------------------------------------------------------------------------------------
class G:
    def __init__(self) -> None:
        self.nodes: list = []
        self.inits: list = []
        self.extra_inputs: list = []  # overridable initializers (listed as graph inputs)
        self.n = 0
        self.contrib = False

    def name(self, p: str) -> str:
        self.n += 1
        return f"{p}_{self.n}"

    def const(self, arr: np.ndarray, p: str = "c", overridable: bool = False) -> str:
        nm = self.name(p)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), nm))
        if overridable:
            a = np.asarray(arr)
            self.extra_inputs.append(
                helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)))
        return nm

    def node(self, op: str, ins: list[str], n_out: int = 1, domain: str = "", **attrs) -> str | list[str]:
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, ins, outs, name=self.name("n_" + op), domain=domain, **attrs))
        if domain == "com.microsoft":
            self.contrib = True
        return outs[0] if n_out == 1 else outs

    def model(self, inputs: list, outputs: list) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "probe", inputs + self.extra_inputs, outputs, self.inits)
        opsets = [helper.make_opsetid("", OPSET)]
        if self.contrib:
            opsets.append(helper.make_opsetid("com.microsoft", 1))
        m = helper.make_model(graph, opset_imports=opsets)
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m


class Shared:
    """Per-input cache so that a tensor feeding several linears is quantised once (static forms)."""

    def __init__(self) -> None:
        self.q: dict = {}


def q_input(g: G, sh: Shared, x: str, L: QLinear) -> tuple[str, str, str]:
    key = (x, float(L.s_x), int(L.zp_x))
    if key not in sh.q:
        s = g.const(np.float32(L.s_x), "s_x")
        zp = g.const(np.uint8(L.zp_x), "zp_x")
        sh.q[key] = (g.node("QuantizeLinear", [x, s, zp]), s, zp)
    return sh.q[key]


def linear(form: str, g: G, sh: Shared, x: str, L: QLinear, M: int) -> str:
    """Emit one linear layer in `form`; returns the float output name ([1, M, N])."""
    K, N = L.K, L.N
    if form == "fp32":
        return g.node("Add", [g.node("MatMul", [x, g.const(L.W, "W")]), g.const(L.b, "b")])

    if form == "dyn":  # quantize_dynamic's node pattern, built by hand (per-channel int8 W, uint8 acts)
        key = ("dyn", x)
        if key not in sh.q:
            sh.q[key] = g.node("DynamicQuantizeLinear", [x], n_out=3)
        xq, sx, zpx = sh.q[key]
        mmi = g.node("MatMulInteger", [xq, g.const(L.Wq, "Wq"), zpx, g.const(L.zp_w, "zp_w")])
        sc = g.node("Mul", [sx, g.const(L.s_w, "s_w")])
        y = g.node("Mul", [g.node("Cast", [mmi], to=F32), sc])
        return g.node("Add", [y, g.const(L.b, "b")])

    if form == "qdq":
        xq, s, zp = q_input(g, sh, x, L)
        xd = g.node("DequantizeLinear", [xq, s, zp])
        wd = g.node("DequantizeLinear", [g.const(L.Wq, "Wq"), g.const(L.s_w, "s_w"), g.const(L.zp_w, "zp_w")], axis=1)
        return g.node("Add", [g.node("MatMul", [xd, wd]), g.const(L.b, "b")])

    if form == "qdq_gemm":  # Reshape to 2-D -> Q -> DQ -> Gemm(., DQ(W), DQ(int32 bias)) -> Reshape back
        key = ("r2", x)
        if key not in sh.q:
            sh.q[key] = g.node("Reshape", [x, g.const(np.array([-1, K], np.int64), "shp")])
        x2 = sh.q[key]
        xq, s, zp = q_input(g, sh, x2, L)
        xd = g.node("DequantizeLinear", [xq, s, zp])
        wd = g.node("DequantizeLinear", [g.const(L.Wq, "Wq"), g.const(L.s_w, "s_w"), g.const(L.zp_w, "zp_w")], axis=1)
        bq, sb, _ = L.bias_i32()
        bd = g.node("DequantizeLinear", [g.const(bq, "bq"), g.const(sb, "s_b"), g.const(np.zeros(N, np.int32), "zp_b")], axis=0)
        y2 = g.node("Gemm", [xd, wd, bd])
        if ("shape3", x) not in sh.q:  # original [B, S] taken from x at runtime (dynamic dims)
            sh.q[("shape3", x)] = g.node("Concat", [g.node("Slice", [g.node("Shape", [x]), g.const(np.array([0], np.int64), "st"),
                                                                 g.const(np.array([2], np.int64), "en")]),
                                                  g.const(np.array([-1], np.int64), "m1")], axis=0)
        return g.node("Reshape", [y2, sh.q[("shape3", x)]])

    if form.startswith("mmi"):
        # QuantizeLinear -> MatMulInteger -> Cast -> Mul(scale) [-> Add(bias)]
        # flags in the name: _const (scale product folded into one [N] constant), _nozpw (no B zero point),
        # _nobias, _ovr (s_x/s_w as overridable initializers = graph inputs), _swapmul (Mul(scale, cast)),
        # _swapsc (Mul(s_w, s_x)), _biasfirst (Add(b, y))
        xq, s, zp = q_input(g, sh, x, L)
        ins = [xq, g.const(L.Wq, "Wq"), zp]
        if "_nozpw" not in form:
            ins.append(g.const(L.zp_w, "zp_w"))
        c = g.node("Cast", [g.node("MatMulInteger", ins)], to=F32)
        if "_const" in form:
            sc = g.const((np.float32(L.s_x) * L.s_w).astype(np.float32), "s_xw")
        else:
            ovr = "_ovr" in form
            sx = g.const(np.float32(L.s_x), "s_x_sc", overridable=ovr)
            sw = g.const(L.s_w, "s_w", overridable=ovr)
            sc = g.node("Mul", [sw, sx] if "_swapsc" in form else [sx, sw])
        y = g.node("Mul", [sc, c] if "_swapmul" in form else [c, sc])
        if "_nobias" in form:
            return y
        return g.node("Add", [g.const(L.b, "b"), y] if "_biasfirst" in form else [y, g.const(L.b, "b")])

    if form == "contrib_mitf":  # explicit com.microsoft.MatMulIntegerToFloat with bias
        xq, s, zp = q_input(g, sh, x, L)
        return g.node("MatMulIntegerToFloat",
                      [xq, g.const(L.Wq, "Wq"), s, g.const(L.s_w, "s_w"), zp, g.const(L.zp_w, "zp_w"), g.const(L.b, "b")],
                      domain="com.microsoft")
    raise ValueError(form)


# ----------------------------------------------------------------------------------------------
# scenarios
# ----------------------------------------------------------------------------------------------
def gelu_erf(g: G, x: str) -> str:
    d = g.node("Div", [x, g.const(np.float32(np.sqrt(2.0)), "sqrt2")])
    e = g.node("Add", [g.node("Erf", [d]), g.const(np.float32(1.0), "one")])
    return g.node("Mul", [g.node("Mul", [x, e]), g.const(np.float32(0.5), "half")])


def np_gelu(x):
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf)(x / np.sqrt(2.0)))


class Scenario:
    def __init__(self, name: str, kind: str, M: int, shapes: list[tuple[int, int]], seed: int = 0,
                 symbolic: bool = True):
        self.name, self.kind, self.M, self.symbolic = name, kind, M, symbolic
        rng = np.random.default_rng(seed)
        self.K0 = shapes[0][0]
        self.x = rng.standard_normal((1, M, self.K0)).astype(np.float32)
        self.layers = [QLinear(rng, K, N) for K, N in shapes]
        for L in self.layers[:3] if kind == "qkv" else self.layers[:1]:
            L.calibrate(self.x)
        if kind == "ffn":  # calibrate L2 on the float GELU output; LN params
            self.h_fp = np_gelu(self.layers[0].ref_fp32(self.x)).astype(np.float32)
            self.layers[1].calibrate(self.h_fp)
            self.gamma = (1 + 0.1 * rng.standard_normal(self.K0)).astype(np.float32)
            self.beta = (0.1 * rng.standard_normal(self.K0)).astype(np.float32)

    def build(self, form: str) -> onnx.ModelProto:
        g, sh = G(), Shared()
        B, S = ("batch", "seq") if self.symbolic else (1, self.M)
        xin = helper.make_tensor_value_info("x", F32, [B, S, self.K0])
        if self.kind == "single":
            ys = [linear(form, g, sh, "x", self.layers[0], self.M)]
        elif self.kind == "qkv":
            ys = [linear(form, g, sh, "x", L, self.M) for L in self.layers]
        elif self.kind == "ffn":
            h = gelu_erf(g, linear(form, g, sh, "x", self.layers[0], self.M))
            y = linear(form, g, sh, h, self.layers[1], self.M)
            r = g.node("Add", [y, "x"])
            ys = [g.node("LayerNormalization", [r, g.const(self.gamma, "gamma"), g.const(self.beta, "beta")],
                         axis=-1, epsilon=1e-5)]
        if self.kind == "ffn":
            shapes = [[B, S, self.K0]]
        else:
            shapes = [[B, S, L.N] for L in self.layers]
        out_vi = [helper.make_tensor_value_info(y, F32, sh_) for y, sh_ in zip(ys, shapes, strict=False)]
        return g.model([xin], out_vi)

    def reference(self, form: str) -> list[np.ndarray]:
        """Float64 reference of the intended integer math for `form` (fp32/dyn: plain float math)."""
        static = form not in ("fp32", "dyn", "qdyn_real")

        def lin(L, x):
            if not static:
                return L.ref_fp32(x)
            if form == "qdq_gemm":
                return L.ref(x, bias=L.bias_i32()[2])
            return L.ref(x)

        if self.kind == "single":
            return [lin(self.layers[0], self.x)]
        if self.kind == "qkv":
            return [lin(L, self.x) for L in self.layers]
        h = np_gelu(lin(self.layers[0], self.x)).astype(np.float32)  # what the graph feeds L2 (float32)
        r = lin(self.layers[1], h) + self.x
        mu = r.mean(-1, keepdims=True)
        var = ((r - mu) ** 2).mean(-1, keepdims=True)
        return [(r - mu) / np.sqrt(var + 1e-5) * self.gamma + self.beta]


# ----------------------------------------------------------------------------------------------
# ORT
# ----------------------------------------------------------------------------------------------
def make_session(model: onnx.ModelProto, tmp: str, tag: str, disable_cf: bool = False):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opt = os.path.join(tmp, f"{tag}.opt.onnx")
    so.optimized_model_filepath = opt
    kw = {"disabled_optimizers": ["ConstantFolding"]} if disable_cf else {}
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"], **kw)
    hist = collections.Counter(n.op_type for n in onnx.load(opt, load_external_data=False).graph.node)
    return sess, hist


def fmt_hist(h: collections.Counter) -> str:
    return " ".join(f"{k}x{v}" if v > 1 else k for k, v in sorted(h.items(), key=lambda kv: (-kv[1], kv[0])))


FORMS = [
    # (label, form, disable ConstantFolding at session level)
    ("fp32 MatMul+Add", "fp32", False),
    ("quantize_dynamic() output", "qdyn_real", False),
    ("dynamic pattern by hand (shared DQL)", "dyn", False),
    ("1 QDQ MatMul + Add (baseline)", "qdq", False),
    ("2a Q>MMI>Cast>Mul(Mul(s_x,s_w))>Add", "mmi", False),
    ("2b  ... scale product as [N] const", "mmi_const", False),
    ("2c  ... Mul node, no bias", "mmi_nobias", False),
    ("2d  ... Mul node, no zp_w", "mmi_nozpw", False),
    ("2e  ... Mul node, s_x/s_w overridable init", "mmi_ovr", False),
    ("2f  ... Mul node, ConstantFolding disabled", "mmi", True),
    ("2g  ... ovr, Mul(scale, cast)", "mmi_ovr_swapmul", False),
    ("2h  ... ovr, Mul(s_w, s_x)", "mmi_ovr_swapsc", False),
    ("2i  ... ovr, Add(b, y)", "mmi_ovr_biasfirst", False),
    ("2j  ... ovr, no zp_w", "mmi_ovr_nozpw", False),
    ("3 Reshape>QDQ Gemm(DQ int32 bias)>Reshape", "qdq_gemm", False),
    ("X contrib MatMulIntegerToFloat(+bias)", "contrib_mitf", False),
]


def run_scenario(sc: Scenario, runs: int, tmp: str, forms=FORMS) -> list[dict]:
    feed = {"x": sc.x}
    rows = []
    for label, form, dcf in forms:
        tag = f"{sc.name}_{form}_{int(dcf)}".replace(",", "_").replace(" ", "")
        row = {"scenario": sc.name, "label": label, "form": form, "dcf": dcf}
        try:
            if form == "qdyn_real":
                from onnxruntime.quantization import QuantType, quantize_dynamic
                src, dst = os.path.join(tmp, tag + ".f32.onnx"), os.path.join(tmp, tag + ".qd.onnx")
                onnx.save(sc.build("fp32"), src)
                quantize_dynamic(src, dst, per_channel=True, weight_type=QuantType.QInt8)
                model = onnx.load(dst)
            else:
                model = sc.build(form)
            sess, hist = make_session(model, tmp, tag, dcf)
        except Exception as e:  # noqa: BLE001
            row.update(error=str(e).splitlines()[0][:120])
            rows.append(row)
            continue
        outs = sess.run(None, feed)
        refs = sc.reference(form)
        err = max(float(np.abs(o.astype(np.float64) - r).max()) for o, r in zip(outs, refs, strict=False))
        scale = max(float(np.abs(r).max()) for r in refs)
        row.update(sess=sess, hist=hist, err=err, rel=err / scale, times=[])
        rows.append(row)
    live = [r for r in rows if "sess" in r]
    for r in live:  # warm-up
        for _ in range(20):
            r["sess"].run(None, feed)
    per_round = 10
    for _ in range(max(1, runs // per_round)):
        for r in live:
            s = r["sess"]
            for _ in range(per_round):
                t0 = time.perf_counter()
                s.run(None, feed)
                r["times"].append(time.perf_counter() - t0)
    for r in live:
        r["ms"] = 1e3 * float(np.median(r["times"]))
        r["p10"] = 1e3 * float(np.percentile(r["times"], 10))
        del r["sess"], r["times"]
    return rows


def print_table(rows: list[dict]) -> None:
    cur = None
    for r in rows:
        if r["scenario"] != cur:
            cur = r["scenario"]
            base = next((x["ms"] for x in rows if x["scenario"] == cur and x["form"] == "qdq" and "ms" in x), None)
            print(f"\n== {cur}")
            print(f"{'candidate':44s} {'med ms':>8s} {'p10 ms':>8s} {'vs QDQ':>7s} {'max|err|':>9s} {'rel':>8s}  optimized graph (ORT_ENABLE_ALL)")
        if "error" in r:
            print(f"{r['label']:44s} ERROR: {r['error']}")
            continue
        rel_b = f"{r['ms'] / base:6.2f}x" if base else "   -  "
        note = " (err vs fp32 math)" if r["form"] in ("fp32", "dyn", "qdyn_real") else ""
        print(f"{r['label']:44s} {r['ms']:8.3f} {r['p10']:8.3f} {rel_b:>7s} {r['err']:9.2e} {r['rel']:8.1e}  {fmt_hist(r['hist'])}{note}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="only M=128 (384,1536) single + qkv + ffn")
    ap.add_argument("--static-shapes", choices=["no", "some", "only"], default="some",
                    help="x is [batch, seq, K] (symbolic, like an exported MiniLM) by default; 'some' adds static-shape "
                         "copies of single M=128 (384,1536) and the FFN chain; 'only' makes every scenario static")
    a = ap.parse_args()
    print(f"onnxruntime {ort.__version__}  onnx {onnx.__version__}  numpy {np.__version__}  threads=2  runs={a.runs}")
    sym = a.static_shapes != "only"
    tag = "[batch,seq,K]" if sym else "static [1,M,K]"
    scen = []
    for M in (128, 1):
        for K, N in ((384, 384), (384, 1536), (1536, 384)):
            if a.quick and (M != 128 or (K, N) != (384, 1536)):
                continue
            scen.append(Scenario(f"single M={M} K={K} N={N} x {tag}", "single", M, [(K, N)], symbolic=sym))
    for M in ((128,) if a.quick else (128, 1)):
        scen.append(Scenario(f"QKV shared input M={M} 3x(384,384) x {tag}", "qkv", M, [(384, 384)] * 3, symbolic=sym))
        scen.append(Scenario(f"FFN chain M={M} L1(384,1536)>GELU>L2(1536,384)>+x>LN x {tag}", "ffn", M,
                             [(384, 1536), (1536, 384)], symbolic=sym))
    if a.static_shapes == "some":
        scen.append(Scenario("single M=128 K=384 N=1536 x static [1,128,384]", "single", 128, [(384, 1536)], symbolic=False))
        scen.append(Scenario("FFN chain M=128 x static [1,128,384]", "ffn", 128, [(384, 1536), (1536, 384)], symbolic=False))
    all_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sc in scen:
            rows = run_scenario(sc, a.runs, tmp)
            print_table(rows)
            sys.stdout.flush()
            all_rows += rows


if __name__ == "__main__":
    main()
