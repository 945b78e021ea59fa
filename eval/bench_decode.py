"""Per-token decode with the KV cache: the INT4 recipe's model vs onnxruntime-genai's builder, same run.

    python eval/bench_decode.py --model out/llama-int4 --genai PEER_CACHE/b128/genai_rtn \\
        [--genai-python eval/.venv-peers/bin/python]

(the genai folder is what ``eval/bench_int4.py --methods genai:rtn --peer-cache PEER_CACHE`` builds; its
``model_pinned.onnx``, the same graph with the KV dims made static, is what quantkit's loop runs).

Three measurements, each comparing every model in one run:

1. **quantkit's loop, one model at a time**: each round the models take turns (the order rotates every
   round); a model prefills the same random 128-token prompt and decodes 64 greedy tokens alone
   (:func:`quantkit.evaluate.decode.measure_generation`, the KV cache in one buffer shared by past and present).
   Decoding models in lockstep (one step of each in turn) lets each model's weights evict the others' from the
   CPU caches; alone is how a user runs one model.  Per model: the median of the per-round medians; per pair:
   the ratio in every round (min / median / max).
2. **onnxruntime-genai's runtime** (``--genai-python``: a Python with ``onnxruntime-genai``): the same protocol
   through ``og.Generator`` (``eval/genai_runtime_decode.py``), how genai's users run its models; quantkit's
   folders carry a ``genai_config.json``.
3. **prefill** of 128 tokens, interleaved: quantkit's graphs asking for the last position's logits (what a
   generation loop asks, ``logits_to_keep``) and for all of them (like genai's graph, which has no such input).

Writes ``eval/results/decode_vs_genai.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def _onnx(folder_or_file: str, pinned: bool = False) -> str:
    p = Path(folder_or_file)
    if p.is_file():
        return str(p)
    if pinned and (p / "model_pinned.onnx").is_file():
        return str(p / "model_pinned.onnx")
    return str(p / "model.onnx")


def alone(models: dict[str, str], rounds: int, threads: int) -> dict[str, Any]:
    from quantkit.evaluate.decode import measure_generation

    names = list(models)
    per: dict[str, list[float]] = {k: [] for k in names}
    prompt: dict[str, list[float]] = {k: [] for k in names}
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for k in order:
            g = measure_generation({k: models[k]}, prompt_len=128, new_tokens=64, rounds=1, threads=threads)[k]
            per[k].append(g["median_ms"])
            prompt[k].append(g["prompt_ms"])
    return {k: {"decode_ms": float(np.median(per[k])), "rounds": per[k],
                "prompt_ms": float(np.median(prompt[k]))} for k in names}  # fmt: skip


def ratios(res: dict[str, Any], num: str, den: str) -> dict[str, float]:
    r = np.asarray(res[num]["rounds"]) / np.asarray(res[den]["rounds"])
    return {"min": float(r.min()), "median": float(np.median(r)), "max": float(r.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the recipe's output folder (or its model.onnx)")
    ap.add_argument("--genai", required=True, help="onnxruntime-genai builder's INT4 folder")
    ap.add_argument("--genai-python", help="a Python with onnxruntime-genai, for the runtime comparison")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from provenance import run_record

    from quantkit.evaluate.decode import measure_prefill
    from quantkit.frontends.llm import built_decoder_path, smollm2_folder
    from quantkit.report.build import environment

    fp32 = str(built_decoder_path(smollm2_folder()))
    ours = _onnx(args.model)
    genai = _onnx(args.genai, pinned=True)
    out: dict[str, Any] = {"environment": {**environment(), **run_record()}, "protocol": "128-token random prompt, 64 greedy tokens"}
    loop = alone({"recipe": ours, "genai_int4_rtn_g128": genai, "fp32": fp32}, args.rounds, args.threads)
    out["quantkit_loop_alone"] = loop
    out["quantkit_loop_ratio_genai_over_recipe"] = ratios(loop, "genai_int4_rtn_g128", "recipe")
    print(json.dumps({k: round(v["decode_ms"], 2) for k, v in loop.items()}), out["quantkit_loop_ratio_genai_over_recipe"])
    if args.genai_python:
        folder = str(Path(ours).parent)
        cmd = [args.genai_python, str(ROOT / "eval" / "genai_runtime_decode.py"), f"recipe={folder}",
               f"genai_int4_rtn_g128={Path(args.genai)}", "--rounds", str(args.rounds), "--threads", str(args.threads)]
        rt = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        out["genai_runtime"] = rt
        out["genai_runtime_ratio_genai_over_recipe"] = ratios(rt, "genai_int4_rtn_g128", "recipe")
        print(json.dumps({k: round(v["decode_ms"], 2) for k, v in rt.items()}), out["genai_runtime_ratio_genai_over_recipe"])
    pre_last = measure_prefill({"recipe": ours, "fp32": fp32, "genai_int4_rtn_g128": genai}, seq_len=128,
                               warmup=3, repeat=20, threads=args.threads)  # fmt: skip
    pre_all = measure_prefill({"recipe": ours, "fp32": fp32}, seq_len=128, warmup=3, repeat=20,
                              threads=args.threads, last_logits=False)  # fmt: skip
    out["prefill_128"] = {
        **{f"{k} ({'last-position' if 'last-position' in v.label else 'all'} logits)": v.median_ms
           for k, v in pre_last.items()},
        **{f"{k} (all logits)": v.median_ms for k, v in pre_all.items()},
    }
    print(json.dumps(out["prefill_128"], indent=1))
    path = ROOT / "eval" / "results" / "decode_vs_genai.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
