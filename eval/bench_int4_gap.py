"""How much of the FP32-to-RTN perplexity gap a quantized SmolLM2 decoder closes on held-out text, measured in one
process against the baselines: FP32 (quantkit's built KV-cache decoder), ONNX Runtime's RTN g128
(``MatMulNBitsQuantizer`` on that same FP32 decoder, its default settings otherwise; symmetric - the gap the issue
names - and asymmetric, with the gap against the better of the two as ``gap_closed_vs_best_rtn``) and the model given (e.g. the
llama-int4 recipe's output).  Texts: *Persuasion* (16 x 512-token windows of its evaluation half; no recipe or test
calibrates on it) and Python's documentation (8 windows).  With each gap against the better RTN, its 95% bootstrap
interval over the windows (``gap_closed_vs_best_rtn_ci95``).

Usage::

    quantkit calibrate --recipe recipes/llama-int4.yaml --output out/llama-int4
    python eval/bench_int4_gap.py out/llama-int4/model.onnx --out eval/results/int4_gap_x86-vnni.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

TEXTS = (("austen:persuasion", 16), ("pydoc", 8))


def _bytes(p: str) -> int:
    return os.path.getsize(p) + (os.path.getsize(p + ".data") if os.path.exists(p + ".data") else 0)


def ort_rtn(fp32: str, dst: str, symmetric: bool = True) -> str:
    """ONNX Runtime's round-to-nearest 4-bit weights (blocks of 128) of the FP32 decoder, built once into ``dst``.

    Symmetric: ``RTNWeightOnlyQuantConfig`` (the baseline the issue names).  Asymmetric: ``MatMulNBitsQuantizer``'s
    default, ``DefaultWeightOnlyQuantConfig(is_symmetric=False)`` (its C++ min-max quantizer, a 4-bit zero point per
    block) - ``RTNWeightOnlyQuantConfig`` with ``is_symmetric=False`` fails on this model in onnxruntime 1.32 (it
    packs the zero points of a 576-row weight, 5 blocks per column, into a shape that needs an even count)."""
    if not os.path.exists(dst):
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
            RTNWeightOnlyQuantConfig,
        )

        os.makedirs(os.path.dirname(dst), exist_ok=True)
        algo = (RTNWeightOnlyQuantConfig() if symmetric
                else DefaultWeightOnlyQuantConfig(block_size=128, is_symmetric=False))
        q = MatMulNBitsQuantizer(onnx.load(fp32), block_size=128, is_symmetric=symmetric, algo_config=algo)
        q.process()
        q.model.save_model_to_file(dst, use_external_data_format=True)
    return dst


def gap_interval(per_window: dict[str, list[list[float]]], rtn: str, *, resamples: int = 2000,
                 seed: int = 0) -> list[float]:
    """95% bootstrap interval of the gap closed, ``(ppl_rtn - ppl_q) / (ppl_rtn - ppl_fp32)``, over the windows:
    each resample draws windows with replacement, the same windows for the three models (paired), and recomputes
    every perplexity from the windows' NLL sums and token counts.  It says how much the figure depends on which
    windows of the text were drawn (not how it varies from build to build)."""
    arr = {k: np.asarray(v, np.float64) for k, v in per_window.items()}
    n = len(arr["fp32"])
    idx = np.random.default_rng(seed).integers(0, n, (resamples, n))

    def ppl(k: str) -> np.ndarray:
        a = arr[k]
        return np.exp(a[idx, 0].sum(axis=1) / a[idx, 1].sum(axis=1))

    f, r, q = ppl("fp32"), ppl(rtn), ppl("quantized")
    gap = (r - q) / (r - f)
    return [round(float(x), 4) for x in np.percentile(gap, [2.5, 97.5])]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="the quantized decoder's model.onnx")
    ap.add_argument("--out")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "quantkit" / "bench-int4-gap"))
    args = ap.parse_args()

    import onnxruntime as ort

    from quantkit.data import InputInfo, make_dataset
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.frontends.hf_folder import load_hf_tokenizer
    from quantkit.frontends.llm import built_decoder_path, smollm2_folder
    from quantkit.frontends.llm_builder import read_decoder_config
    from quantkit.llm_run import _LM_INPUTS
    from quantkit.scheme.target import detect_cpu

    folder = smollm2_folder()
    fp32 = str(built_decoder_path(folder))
    cfg = read_decoder_config(folder)
    tok = load_hf_tokenizer(folder)
    inputs = _LM_INPUTS + [InputInfo(f"past_key_values.{i}.{kv}", np.dtype(np.float32),
                                     (None, cfg.num_key_value_heads, None, cfg.head_dim))
                           for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]
    models = {"fp32": fp32, "ort_rtn_g128": ort_rtn(fp32, os.path.join(args.work, "ort-rtn-g128", "model.onnx")),
              "ort_rtn_g128_asym": ort_rtn(fp32, os.path.join(args.work, "ort-rtn-g128-asym", "model.onnx"), False),
              "quantized": args.model}
    out: dict[str, Any] = {"model": args.model,
                           "size_ratio_to_fp32": {k: round(_bytes(p) / _bytes(fp32), 4) for k, p in models.items()}}
    for src, count in TEXTS:
        ds = make_dataset({"kind": "text", "source": src, "mode": "windows", "seq_len": 512, "count": count,
                           "seed": 0}, inputs=inputs, tokenizer=tok, split="evaluation")
        res = {k: perplexity(p, ds, per_batch=True) for k, p in models.items()}
        row: dict[str, Any] = {k: r["ppl"] for k, r in res.items()}
        row["gap_closed"] = (row["ort_rtn_g128"] - row["quantized"]) / (row["ort_rtn_g128"] - row["fp32"])
        # against ORT's stronger RTN setting too (the smaller gap), whichever of the two it is on this text
        best_key = min(("ort_rtn_g128", "ort_rtn_g128_asym"), key=lambda k: row[k])
        best = row[best_key]
        row["gap_closed_vs_best_rtn"] = (best - row["quantized"]) / (best - row["fp32"])
        row["gap_closed_vs_best_rtn_ci95"] = gap_interval({k: res[k]["per_batch"] for k in ("fp32", best_key,
                                                                                          "quantized")}, best_key)
        out[src] = row
        print(src, row, flush=True)
    cpu = detect_cpu()
    out["environment"] = {"cpu": cpu.model_name, "cpu_class": cpu.cpu_class, "cores": os.cpu_count(),
                          "onnxruntime": ort.__version__, "python": platform.python_version(),
                          "date": time.strftime("%Y-%m-%d"), "load_average": [round(x, 2) for x in os.getloadavg()],
                          "command": " ".join(["python", "eval/bench_int4_gap.py", *sys.argv[1:]])}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
