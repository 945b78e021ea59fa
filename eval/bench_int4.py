"""INT4 weight-only benchmark on SmolLM2-135M: quantkit (RTN / GPTQ / AWQ) vs ONNX Runtime's
``MatMulNBitsQuantizer`` (RTN symmetric / asymmetric, HQQ) at the same bits and block size.

Usage::

    python eval/bench_int4.py                      # all methods, 16 x 512-token windows of Emma
    python eval/bench_int4.py --methods quantkit:gptq,ort:rtn_sym --eval 8

Every method quantizes the same exported FP32 ONNX graph in its own process (wall time and peak
RSS are its own).  Perplexity is measured on the same held-out Jane Austen windows; prefill
(batch 1 x 128 tokens) and one-token-forward latency of every model are measured interleaved in
one process.  ONNX Runtime's GPTQ path is not run: it needs the working directory set to the
model folder, writes an output that references the FP32 weight file and took 16 minutes here.
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
RECIPE = ROOT / "recipes" / "llama-int4.yaml"
DEFAULT = "quantkit:rtn,quantkit:gptq,quantkit:awq,ort:rtn_sym,ort:rtn_asym,ort:hqq"


def _slug(m: str) -> str:
    return m.replace(":", "_")


def worker(method: str, out: Path, block: int) -> None:
    import onnx

    from quantkit.frontends import load_model

    t0 = time.perf_counter()
    kind, _, algo = method.partition(":")
    target = out / f"{_slug(method)}.onnx"
    if kind == "fp32":
        loaded = load_model("smollm2-135m")
        import onnx_ir as ir

        ir.save(loaded.model, target, external_data=target.name + ".data")
        info: dict[str, Any] = {}
    elif kind == "quantkit":
        import yaml

        from quantkit.api import quantize
        from quantkit.recipe import load_recipe

        d = yaml.safe_load(RECIPE.read_text())
        d["quantization"]["default"]["algorithm"] = "awq" if algo == "awq_gptq" else algo
        d["quantization"]["default"]["algorithm_options"] = (
            d["quantization"]["default"]["algorithm_options"] if algo == "gptq"
            else {"gptq": True} if algo == "awq_gptq" else {})
        d["quantization"]["default"]["group_size"] = block
        res = quantize(recipe=load_recipe(d), progress=False, evaluate=False, measure_latency=False)
        res.save(out / _slug(method), report=True)
        (out / _slug(method) / "model.onnx").rename(target)
        info = {"layers": len(res.report["layers"])}
    else:
        from onnxruntime.quantization import matmul_nbits_quantizer as mnq

        src = out / "fp32.onnx"
        model = onnx.load(str(src))
        if algo == "hqq":
            cfg: Any = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4)
        else:
            cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=algo == "rtn_sym", accuracy_level=4)
        q = mnq.MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=algo == "rtn_sym",
                                     accuracy_level=4, algo_config=cfg)
        q.process()
        onnx.save_model(q.model.model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=target.name + ".data", size_threshold=1024)
        info = {}
    info["wall_s"] = time.perf_counter() - t0
    info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"{_slug(method)}.json").write_text(json.dumps(info))


def _size(p: Path) -> int:
    data = p.with_name(p.name + ".data")
    return p.stat().st_size + (data.stat().st_size if data.exists() else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT)
    ap.add_argument("--eval", type=int, default=16, help="evaluation windows of 512 tokens")
    ap.add_argument("--text", default="emma",
                    help="held-out evaluation novel: emma | northangerabbey | sensesensibility | ... (the recipe "
                         "calibrates on Pride and Prejudice)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, Path(args.out_dir), args.block)
        return
    from quantkit.data import make_dataset
    from quantkit.evaluate.decode import measure_decode, measure_prefill
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.frontends import load_model
    from quantkit.lowering.verify import census
    from quantkit.report.build import environment

    methods = ["fp32", *args.methods.split(",")]
    allowed = {"quantkit": ("rtn", "gptq", "awq", "awq_gptq"), "ort": ("rtn_sym", "rtn_asym", "hqq")}
    for m in methods[1:]:
        kind, _, algo = m.partition(":")
        if algo not in allowed.get(kind, ()):
            raise SystemExit(f"unknown method {m!r}; allowed: " + ", ".join(
                f"{k}:{a}" for k, algos in allowed.items() for a in algos))
    loaded = load_model("smollm2-135m")
    from quantkit.data import model_inputs

    ev = make_dataset({"kind": "text", "source": f"austen:{args.text}", "mode": "windows", "seq_len": 512,
                       "count": args.eval},
                      inputs=model_inputs(loaded.model), tokenizer=loaded.tokenizer, split="evaluation")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        paths = {}
        for m in methods:
            print(f"[bench] {m} ...", flush=True)
            subprocess.run([sys.executable, __file__, "--worker", m, "--out-dir", str(tmp), "--block", str(args.block)],
                           check=True, cwd=ROOT)
            results[m] = json.loads((tmp / f"{_slug(m)}.json").read_text())
            paths[m] = tmp / f"{_slug(m)}.onnx"
            results[m]["size_mb"] = _size(paths[m]) / 2**20
            results[m]["ppl"] = perplexity(str(paths[m]), ev)["ppl"]
            if m != "fp32":
                cen = census(str(paths[m]))
                results[m]["kernels"] = dict(cen.quantized_kernels)
            print(f"[bench] {m}: ppl {results[m]['ppl']:.3f}, {results[m]['size_mb']:.1f} MB", flush=True)
        pre = measure_prefill({m: str(p) for m, p in paths.items()}, seq_len=128, warmup=3, repeat=20)
        dec = measure_decode({m: str(p) for m, p in paths.items()}, warmup=5, repeat=40)
        for m in methods:
            results[m]["prefill_ms"] = pre[m].median_ms
            results[m]["decode_ms"] = dec[m].median_ms
            results[m]["decode_label"] = dec[m].label
    env = environment()
    print("\nenvironment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"perplexity on {args.eval} x 512-token windows of {args.text} (evaluation split); block {args.block}, 4-bit; "
          f"decode = {results['fp32']['decode_label']}\n")
    hdr = f"{'method':<18}{'ppl':>9}{'size MB':>9}{'x FP32':>8}{'quant s':>9}{'RSS MB':>8}{'prefill ms':>12}{'decode ms':>11}  kernels"
    print(hdr)
    print("-" * len(hdr))
    fsize = results["fp32"]["size_mb"]
    for m, r in results.items():
        print(f"{m:<18}{r['ppl']:>9.3f}{r['size_mb']:>9.1f}{r['size_mb'] / fsize:>8.3f}{r.get('wall_s', 0):>9.1f}"
              f"{r.get('peak_rss_mb', 0):>8.0f}{r['prefill_ms']:>12.2f}{r['decode_ms']:>11.2f}  {r.get('kernels', '')}")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "results": results}, indent=2, default=str))


if __name__ == "__main__":
    main()
