"""INT8 benchmark: quantkit vs ONNX Runtime's own quantizer, same model, same samples, same run.

Usage::

    python eval/bench_int8.py --model efficientnet-lite0            # vs quantize_static (QDQ, per-channel, MinMax)
    python eval/bench_int8.py --model all-MiniLM-L6-v2              # vs quantize_static and quantize_dynamic
    python eval/bench_int8.py --methods quantkit,quantkit@x86-avx2,quantkit@portable,ort_static_u8,ort_static_u8_rr

Method names: ``quantkit`` (the recipe as shipped: ``target.isa: auto``), ``quantkit@<isa>`` (the recipe
built for a CPU class: x86-vnni | x86-avx2 | portable | arm64), ``quantkit:<calibrator>[+bc]``,
``ort_static_u8`` / ``ort_static_u8_rr`` (``reduce_range``: 7-bit weights) / ``ort_static_s8`` /
``ort_dynamic``, and ``<method>+int16`` (the same model run with ONNX Runtime's
``session.x64quantprecision=1``, which moves int8 weights outside [-64, 64] to the exact, slower u8 x u8
path).  Every quantized model is also checked for kernel exactness: its fused kernels on this CPU
against its own QDQ math (ORT_DISABLE_ALL) over the evaluation set, and, from its weights, whether it
is exact on x86 CPUs without VNNI (int16 pair saturation; emulated on the first sample).

Each quantizer runs in its own subprocess so that its wall time and peak RSS
(``ru_maxrss``) are its own.  Latency of all emitted models is then measured in one
process, interleaved, on the same batch-1 input; fidelity on the same evaluation
samples.  The table is printed with the environment and written as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

RECIPES = {
    "efficientnet-lite0": "recipes/efficientnet-int8.yaml",
    "all-MiniLM-L6-v2": "recipes/minilm-int8.yaml",
}
ROOT = Path(__file__).resolve().parents[1]


def _datasets(recipe_path: str, n_cal: int | None, n_eval: int | None) -> tuple[Any, Any, Any, Any]:
    from quantkit.data import make_dataset, model_inputs
    from quantkit.frontends import load_model
    from quantkit.prep.pipeline import prepare
    from quantkit.recipe import load_recipe

    rec = load_recipe(recipe_path)
    loaded = load_model(rec.model.source)
    fmodel = prepare(loaded.model).model
    inputs = model_inputs(fmodel)
    cal_spec = rec.calibration.data.model_dump()
    ev_spec = rec.evaluation.data.model_dump() if rec.evaluation.data else cal_spec
    if n_cal:
        cal_spec["count"] = n_cal
    if n_eval:
        ev_spec["count"] = n_eval
    cal = make_dataset(cal_spec, inputs=inputs, tokenizer=loaded.tokenizer, split="calibration")
    ev = make_dataset(ev_spec, inputs=inputs, tokenizer=loaded.tokenizer, split="evaluation")
    return rec, fmodel, cal, ev


def worker(method: str, recipe_path: str, n_cal: int | None, out_dir: str) -> None:
    """Quantize with one method; write model + timing/RSS JSON into out_dir."""
    import onnx_ir as ir

    rec, fmodel, cal, _ = _datasets(recipe_path, n_cal, None)
    out = Path(out_dir)
    float_path = out / "fp32.onnx"
    if method == "fp32":
        ir.save(fmodel, float_path)
        info = {"wall_s": 0.0}
    elif method.startswith("quantkit"):
        # quantkit[@isa][:calibrator][+bc]  (bc = bias correction); the statistics cache is off so that
        # every calibrator pays for its own pass, like ONNX Runtime's do.
        from quantkit.api import quantize
        from quantkit.recipe import load_recipe

        name, _, calib = method.partition(":")
        calib, bc = (calib[:-3], True) if calib.endswith("+bc") else (calib, False)
        d = rec.model_dump(mode="json")
        if "@" in name:
            d["target"]["isa"] = name.split("@", 1)[1]
        if n_cal:
            d["calibration"]["data"]["count"] = n_cal
        if calib:  # "quantkit" alone = the recipe as shipped; "quantkit:<calibrator>[+bc]" overrides
            d["calibration"]["calibrator"] = calib
            d["quantization"]["bias_correction"] = bc
        t = time.perf_counter()
        res = quantize(None, None, load_recipe(d), progress=False, measure_latency=False, evaluate=False,
                       use_cache=False)
        wall = time.perf_counter() - t
        res.save(out / _slug(method), report=True)
        info = {"wall_s": wall, "calibrate_s": res.timings["calibrate_s"], "quantized_layers": len(res.plan.layers)}
    else:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_dynamic,
            quantize_static,
        )

        ir.save(fmodel, float_path)

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = iter(cal.batches(1))

            def get_next(self) -> dict[str, np.ndarray] | None:
                return next(self.it, None)

        t = time.perf_counter()
        target = out / f"{_slug(method)}.onnx"
        base, _, cm = method.partition(":")
        calibrate_method = getattr(CalibrationMethod, cm or "MinMax")
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)  # ORT's calibrator writes augmented models into the working directory
            if base in ("ort_static_u8", "ort_static_u8_rr"):
                quantize_static(str(float_path), str(target), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                                calibrate_method=calibrate_method, reduce_range=base.endswith("_rr"))
            elif base == "ort_static_s8":
                quantize_static(str(float_path), str(target), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                                calibrate_method=CalibrationMethod.MinMax,
                                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
            elif base == "ort_dynamic":
                quantize_dynamic(str(float_path), str(target), per_channel=True, weight_type=QuantType.QInt8)
            else:
                raise SystemExit(f"unknown method {method}")
        info = {"wall_s": time.perf_counter() - t}
    info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"{_slug(method)}.json").write_text(json.dumps(info))


BASE_METHODS = ("fp32", "quantkit", "ort_static_u8", "ort_static_u8_rr", "ort_static_s8", "ort_dynamic")
ISAS = ("auto", "portable", "x86-vnni", "x86-avx2", "arm64")


def check_method(method: str) -> None:
    """Refuse a misspelt method before any work starts (not late, inside a worker)."""
    base = method.removesuffix("+int16")
    head = base.split(":", 1)[0]
    name, _, isa = head.partition("@")
    ok = name in BASE_METHODS and (not isa or (name == "quantkit" and isa in ISAS))
    if not ok:
        raise SystemExit(
            f"unknown method {method!r}; allowed: {', '.join(BASE_METHODS)}, quantkit@<isa> ({', '.join(ISAS)}), "
            "quantkit:<calibrator>[+bc], ort_static_u8:<MinMax|Entropy|Percentile>, and <method>+int16"
        )


def _slug(method: str) -> str:
    return method.replace(":", "_").replace("+", "_").replace("@", "_at_")


def _kernel_exactness(path: Path, ev: Any) -> dict[str, Any]:
    """Fused kernels of this CPU vs the model's own QDQ math over the whole evaluation set, layers that
    part (alone, on reference inputs), and exactness on x86 without VNNI (weights; emulated saturation)."""
    import onnx

    from quantkit.lowering.kernel_check import kernel_vs_reference, portability

    proto = onnx.load(str(path))
    port = portability(proto)
    at_risk = {r["layer"] for r in port["layers_at_risk"]}
    chk = kernel_vs_reference(proto, ev.batches(1), samples=len(ev), layer_samples=2, emulate=at_risk)
    top1 = [v["top1_agreement"] for v in chk.outputs.values() if "top1_agreement" in v]
    return {
        "kernel_vs_qdq_top1": min(top1) if top1 else float("nan"),
        "kernel_vs_qdq_sqnr_db": min(v["sqnr_db"] for v in chk.outputs.values()),
        "layers_parted": sum(1 for r in chk.layers if r["off"] > 1e-3),
        "exact_x86_avx2": port["classes"]["x86-avx2"]["exact"],
        "emulated_worst": max(chk.emulated_avx2.values(), default=0.0),
    }


def _int16_session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_session_config_entry("session.x64quantprecision", "1")
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _int16_fidelity(fbytes: bytes, path: Path, ev: Any, metric: str) -> dict[str, Any]:
    from quantkit.evaluate.latency import make_session
    from quantkit.evaluate.metrics import FidelityAccumulator

    s_f, s_q = make_session(fbytes), _int16_session(path)
    names = [o.name for o in s_f.get_outputs()]
    acc = FidelityAccumulator(classification={"classification": True}.get(metric))
    for feed in ev.batches(16):
        for n, r, g in zip(names, s_f.run(names, feed), s_q.run(names, feed), strict=True):
            if np.issubdtype(r.dtype, np.floating):
                acc.update(n, r, g)
    return acc.summary()


def model_path(method: str, out_dir: Path) -> Path:
    if method.startswith("quantkit"):
        return out_dir / _slug(method) / "model.onnx"
    return out_dir / f"{_slug(method)}.onnx"


def run_worker(method: str, recipe_path: str, n_cal: int | None, out_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", method, "--recipe", recipe_path, "--out-dir", str(out_dir)]
    if n_cal:
        cmd += ["--calib", str(n_cal)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((out_dir / f"{_slug(method)}.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="efficientnet-lite0", choices=sorted(RECIPES))
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--calib", type=int, default=None, help="calibration samples (default: the recipe's)")
    ap.add_argument("--eval", type=int, default=None, help="evaluation samples (default: the recipe's)")
    ap.add_argument("--methods", default=None, help="comma list (default depends on the model)")
    ap.add_argument("--rss-scaling", action="store_true", help="also quantize with 2x calibration samples")
    ap.add_argument("--repeat", type=int, default=60)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    recipe_path = args.recipe or str(ROOT / RECIPES[args.model])
    if args.worker:
        worker(args.worker, recipe_path, args.calib, args.out_dir)
        return

    from provenance import run_record

    from quantkit.evaluate.latency import compare_latency, make_session
    from quantkit.lowering.verify import census
    from quantkit.pipeline import evaluate_fidelity
    from quantkit.report.build import environment

    default_methods = ["ort_static_u8", "ort_static_s8"] if args.model == "efficientnet-lite0" else [
        "ort_static_u8", "ort_dynamic"]
    methods = args.methods.split(",") if args.methods else ["quantkit", *default_methods]
    for m in methods:
        check_method(m)
    rec, fmodel, cal, ev = _datasets(recipe_path, args.calib, args.eval)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        run_worker("fp32", recipe_path, args.calib, tmp)
        paths = {"fp32": tmp / "fp32.onnx"}
        int16: list[str] = []
        for m in methods:
            if m.endswith("+int16"):
                int16.append(m)
                continue
            print(f"[bench] quantizing with {m} ...", flush=True)
            results[m] = run_worker(m, recipe_path, args.calib, tmp)
            paths[m] = model_path(m, tmp)
        if args.rss_scaling:
            n2 = 2 * len(cal)
            (tmp / "x2").mkdir()
            for m in [m for m in methods if m.startswith("quantkit")]:
                print(f"[bench] {m} with {n2} calibration samples ...", flush=True)
                results[f"{m} (2x calib)"] = run_worker(m, recipe_path, n2, tmp / "x2")
        fbytes = paths["fp32"].read_bytes()
        results["fp32"] = {"wall_s": 0.0}
        for m, p in paths.items():
            results[m]["size_bytes"] = p.stat().st_size
            if m != "fp32":
                cen = census(str(p))
                results[m]["kernels"] = dict(cen.quantized_kernels)
                results[m]["leftover_q"] = cen.leftover_q
                results[m]["leftover_dq"] = cen.leftover_dq
                results[m]["float_conv"] = cen.op_counts.get("Conv", 0) + cen.op_counts.get("FusedConv", 0)
                fid = evaluate_fidelity(fbytes, p.read_bytes(), ev, batch_size=16, metric=rec.evaluation.metric)
                results[m]["fidelity"] = fid
                results[m].update(_kernel_exactness(p, ev))
        feed = next(iter(ev.batches(1)))
        sessions = {m: make_session(str(p)) for m, p in paths.items()}
        for m in int16:
            base = m.removesuffix("+int16")
            if base not in paths:
                raise SystemExit(f"{m}: list {base} before it")
            results[m] = {"wall_s": results[base]["wall_s"], "size_bytes": results[base]["size_bytes"],
                          "fidelity": _int16_fidelity(fbytes, paths[base], ev, rec.evaluation.metric)}
            sessions[m] = _int16_session(paths[base])
        lat = compare_latency(sessions, feed, warmup=10, repeat=args.repeat, rounds=5)
        for m, latm in lat.items():
            results[m]["latency_ms"] = latm.median_ms
            results[m]["latency_p90_ms"] = latm.p90_ms
            results[m]["speedup_vs_fp32"] = lat["fp32"].median_ms / latm.median_ms
        env = {**environment(), **run_record()}
        env["feed"] = lat["fp32"].shape
        env["calibration_samples"] = len(cal)
        env["evaluation_samples"] = len(ev)
    print()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print()
    hdr = f"{'method':<28}{'quant s':>9}{'peak RSS MB':>13}{'size MB':>9}{'lat ms':>9}{'p90 ms':>9}{'x FP32':>8}  fidelity / kernels"
    print(hdr)
    print("-" * len(hdr))
    for m, r in results.items():
        fid = r.get("fidelity", {})
        fs = "; ".join(
            ", ".join(f"{k}={v:.4f}" for k, v in d.items() if k in ("top1_agreement", "top5_agreement", "mean_kl", "sqnr_db", "mean_cosine"))
            for d in fid.values()
        )
        extra = f" | {r.get('kernels', '')} leftover Q/DQ={r.get('leftover_q', '-')}/{r.get('leftover_dq', '-')}" if m != "fp32" else ""
        if "kernel_vs_qdq_top1" in r:
            extra += (f" | kernels vs own QDQ math: top-1 {r['kernel_vs_qdq_top1']:.3f}, layers parted "
                      f"{r['layers_parted']}; exact on x86-avx2: {'yes' if r['exact_x86_avx2'] else 'NO'}"
                      + (f" (emulated: up to {100 * r['emulated_worst']:.1f}% accumulators wrong)"
                         if r.get("emulated_worst") else ""))
        print(f"{m:<28}{r.get('wall_s', 0):>9.2f}{r.get('peak_rss_mb', 0):>13.0f}{r.get('size_bytes', 0) / 2**20:>9.2f}"
              f"{r.get('latency_ms', float('nan')):>9.3f}{r.get('latency_p90_ms', float('nan')):>9.3f}"
              f"{r.get('speedup_vs_fp32', float('nan')):>8.2f}  {fs}{extra}")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
