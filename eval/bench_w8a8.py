"""INT8 W8A8 (dynamic activations) on SmolLM2-135M: quantkit (SmoothQuant + per-token scales) vs
ONNX Runtime's ``quantize_dynamic`` (per-tensor activation scale at run time), same run.

Usage::

    python eval/bench_w8a8.py                        # 16 x 512-token windows of Emma
    python eval/bench_w8a8.py --methods quantkit:per_token,ort:dynamic --eval 4

Methods: ``fp32``; ``ort:dynamic`` (``quantize_dynamic``, per-channel int8 weights, MatMul only);
``quantkit:<granularity>[:<smoothquant>]`` with granularity ``per_token`` | ``per_tensor`` and
smoothquant ``auto`` (default) | ``none`` | an alpha, optionally ``@<isa>`` for the CPU class the
int8 weights are built for (``portable`` / ``x86-avx2``: pair-safe codes, exact on x86 without VNNI;
default: the running CPU's class).  The table says for every model whether it is exact on x86 without
VNNI (from its weights: int16 pair saturation of the u8 x s8 kernels).  quantkit variants apply the format to every
linear layer of the decoder blocks; the tied embedding / lm_head is 8-bit weight-only as in
``recipes/llama-mixed.yaml`` (ORT's ``quantize_dynamic`` quantizes the lm_head MatMul to W8A8 too).
Each method quantizes in its own process (wall time, peak RSS); perplexity on the same held-out
windows; prefill (1 x 128 tokens) and one-token-forward latency of all models measured interleaved.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama-mixed.yaml"
DEFAULT = "ort:dynamic,quantkit:per_token,quantkit:per_token:none,quantkit:per_tensor"


def _slug(m: str) -> str:
    return m.replace(":", "_").replace("@", "_at_")


def worker(method: str, out: Path) -> None:
    import onnx_ir as ir

    t0 = time.perf_counter()
    kind, _, rest = method.partition(":")
    target = out / f"{_slug(method)}.onnx"
    info: dict[str, Any] = {}
    if kind == "fp32":
        from quantkit.frontends import load_model

        ir.save(load_model("smollm2-135m").model, target, external_data=target.name + ".data")
    elif kind == "ort":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(out / "fp32.onnx"), str(target), per_channel=True, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul"], use_external_data_format=True,
                         # the decoder graph's GroupQueryAttention outputs have no inferred type
                         extra_options={"DefaultTensorType": 1})  # onnx.TensorProto.FLOAT
    else:
        import yaml

        from quantkit.api import save_model
        from quantkit.data import make_dataset, model_inputs
        from quantkit.frontends import load_model
        from quantkit.prep.pipeline import prepare
        from quantkit.recipe import load_recipe
        from quantkit.search.linear import LinearSpace

        rest, _, isa = rest.partition("@")
        gran, _, sq = rest.partition(":")
        alpha: Any = "auto" if not sq else (None if sq == "none" else float(sq))
        d = yaml.safe_load(RECIPE.read_text())
        d["search"]["candidates"] = [{"name": "int8", "format": "int8_dynamic", "granularity": gran,
                                      "smoothquant": alpha}]
        if isa:
            d["target"] = {"isa": isa}
        rec = load_recipe(d)
        loaded = load_model("smollm2-135m")
        fm = prepare(loaded.model).model
        cal = make_dataset(rec.calibration.data.model_dump(), inputs=model_inputs(fm),  # type: ignore[union-attr]
                           tokenizer=loaded.tokenizer, split="calibration")
        sp = LinearSpace.build(fm, rec, cal, progress=False)
        m = sp.emit({u.name: "int8" for u in sp.units})
        save_model(m, target, "always")
        alphas = [sp.int8_artifact(u, "int8").alpha for u in sp.units]
        info["smoothed_units"] = sum(a is not None for a in alphas)
        info["units"] = len(alphas)
    info["wall_s"] = time.perf_counter() - t0
    info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"{_slug(method)}.json").write_text(json.dumps(info))


def _size(p: Path) -> int:
    data = p.with_name(p.name + ".data")
    return p.stat().st_size + (data.stat().st_size if data.exists() else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT)
    ap.add_argument("--eval", type=int, default=16, help="evaluation windows of 512 tokens (Emma)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, Path(args.out_dir))
        return
    from provenance import run_record

    from quantkit.data import make_dataset, model_inputs
    from quantkit.evaluate.decode import measure_decode, measure_prefill
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.frontends import load_model
    from quantkit.lowering.verify import census
    from quantkit.report.build import environment

    methods = ["fp32", *args.methods.split(",")]
    isas = ("auto", "portable", "x86-vnni", "x86-avx2", "arm64")
    for m in methods[1:]:
        kind, _, rest = m.partition(":")
        rest, _, isa = rest.partition("@")
        gran, _, sq = rest.partition(":")
        ok = (kind == "ort" and rest == "dynamic" and not isa) or (
            kind == "quantkit" and gran in ("per_token", "per_tensor") and (not isa or isa in isas)
            and (sq in ("", "auto", "none") or sq.replace(".", "", 1).isdigit()))
        if not ok:
            raise SystemExit(f"unknown method {m!r}; allowed: ort:dynamic, quantkit:<per_token|per_tensor>"
                             f"[:<auto|none|alpha>][@<{'|'.join(isas)}>]")
    loaded = load_model("smollm2-135m")
    ev = make_dataset({"kind": "text", "source": "austen:emma", "mode": "windows", "seq_len": 512, "count": args.eval},
                      inputs=model_inputs(loaded.model), tokenizer=loaded.tokenizer, split="evaluation")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        paths = {}
        for m in methods:
            print(f"[bench] {m} ...", flush=True)
            subprocess.run([sys.executable, __file__, "--worker", m, "--out-dir", str(tmp)], check=True, cwd=ROOT)
            results[m] = json.loads((tmp / f"{_slug(m)}.json").read_text())
            paths[m] = tmp / f"{_slug(m)}.onnx"
            results[m]["size_mb"] = _size(paths[m]) / 2**20
            results[m]["ppl"] = perplexity(str(paths[m]), ev)["ppl"]
            if m != "fp32":
                import onnx

                from quantkit.lowering.kernel_check import portability

                results[m]["kernels"] = dict(census(str(paths[m])).quantized_kernels)
                port = portability(onnx.load(str(paths[m])))
                results[m]["exact_x86_avx2"] = port["classes"]["x86-avx2"]["exact"]
                results[m]["layers_at_risk"] = len(port["layers_at_risk"])
            print(f"[bench] {m}: ppl {results[m]['ppl']:.3f}, {results[m]['size_mb']:.1f} MB", flush=True)
        pre = measure_prefill({m: str(p) for m, p in paths.items()}, seq_len=128, warmup=3, repeat=20)
        dec = measure_decode({m: str(p) for m, p in paths.items()}, warmup=5, repeat=40)
        for m in methods:
            results[m]["prefill_ms"] = pre[m].median_ms
            results[m]["decode_ms"] = dec[m].median_ms
    env = {**environment(), **run_record()}
    print("\nenvironment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"perplexity on {args.eval} x 512-token windows of Emma; prefill 1 x 128 tokens; decode = one-token forward\n")
    hdr = (f"{'method':<34}{'ppl':>9}{'vs FP32':>9}{'size MB':>9}{'quant s':>9}{'prefill ms':>12}{'x FP32':>8}"
           f"{'decode ms':>11}  exact on x86-avx2")
    print(hdr)
    print("-" * len(hdr))
    f = results["fp32"]
    for m, r in results.items():
        exact = "" if m == "fp32" else ("yes" if r["exact_x86_avx2"] else f"NO ({r['layers_at_risk']} layers at risk)")
        print(f"{m:<34}{r['ppl']:>9.3f}{r['ppl'] / f['ppl'] - 1:>+9.1%}{r['size_mb']:>9.1f}{r.get('wall_s', 0):>9.1f}"
              f"{r['prefill_ms']:>12.2f}{f['prefill_ms'] / r['prefill_ms']:>8.2f}{r['decode_ms']:>11.2f}  {exact}")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
