"""Per-token decode with the KV cache: the INT4 recipe's model vs onnxruntime-genai's builder, in lockstep.

    python eval/bench_decode.py --model out/llama-int4/model.onnx --genai PEER_CACHE/b128/genai_rtn/model_pinned.onnx

(the genai model is what ``eval/bench_int4.py --methods genai:rtn --peer-cache PEER_CACHE`` builds and pins).
Also builds a variant with RTN weights and a 4-bit group-32 lm_head (genai's lm_head precision), to separate
the lm_head's share.  Every model decodes 64 greedy tokens after the same 128-token prompt, one step each in turn
(:func:`quantkit.evaluate.decode.measure_generation`), so they see the same machine noise; prefill of 1 x 128
tokens is timed interleaved.  Writes ``eval/results/decode_vs_genai.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the recipe's output model.onnx")
    ap.add_argument("--genai", required=True, help="onnxruntime-genai's INT4 model (KV dims pinned)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from quantkit.evaluate.decode import measure_generation, measure_prefill
    from quantkit.frontends.llm import built_decoder_path, smollm2_folder
    from quantkit.layerwise import quantize_llm_layerwise
    from quantkit.recipe import load_recipe
    from quantkit.recipe.plan import PrecisionPlan
    from quantkit.report.build import environment

    folder = smollm2_folder()
    with tempfile.TemporaryDirectory() as tmp:
        rec = load_recipe({"version": 1, "quantization": {
            "default": {"format": "int4", "group_size": 128, "algorithm": "rtn"},
            "overrides": [{"layer": "lm_head", "format": "int4", "group_size": 32, "algorithm": "rtn"}]}})
        h4 = quantize_llm_layerwise(folder, Path(tmp) / "h4" / "model.onnx", PrecisionPlan.from_recipe(rec), None,
                                    work_dir=Path(tmp) / "w", progress=False).path
        models = {"fp32": str(built_decoder_path(folder)), "recipe": args.model,
                  "rtn_lm_head_int4_g32": str(h4), "genai_int4_rtn_g128": args.genai}
        gen = measure_generation(models, prompt_len=128, new_tokens=64, rounds=args.rounds, threads=args.threads)
        pre = measure_prefill(models, seq_len=128, warmup=3, repeat=20, threads=args.threads)
    out = {"environment": environment(),
           "models": {k: {"decode_ms": gen[k]["median_ms"], "decode_mean_ms": gen[k]["mean_ms"],
                          "prefill_ms": pre[k].median_ms} for k in models}}
    path = ROOT / "eval" / "results" / "decode_vs_genai.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["models"], indent=1))


if __name__ == "__main__":
    main()
