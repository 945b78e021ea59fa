"""How much of the FP32-to-RTN perplexity gap a quantized SmolLM2 decoder closes on held-out text, measured in one
process against the baselines: FP32 (quantkit's built KV-cache decoder), ONNX Runtime's RTN g128
(``MatMulNBitsQuantizer`` on that same FP32 decoder, its default settings otherwise; symmetric - the gap the issue
names - and asymmetric, with the gap against the better of the two as ``gap_closed_vs_best_rtn``) and the model given (e.g. the
llama-int4 recipe's output).  Texts: *Persuasion* (16 x 512-token windows of its evaluation half; no recipe or test
calibrates on it) and Python's documentation (8 windows).

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
        row: dict[str, Any] = {k: perplexity(p, ds)["ppl"] for k, p in models.items()}
        row["gap_closed"] = (row["ort_rtn_g128"] - row["quantized"]) / (row["ort_rtn_g128"] - row["fp32"])
        # against ORT's stronger RTN setting too (the smaller gap), whichever of the two it is on this text
        best = min(row["ort_rtn_g128"], row["ort_rtn_g128_asym"])
        row["gap_closed_vs_best_rtn"] = (best - row["quantized"]) / (best - row["fp32"])
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
