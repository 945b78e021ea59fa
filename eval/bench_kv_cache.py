"""The int8 KV cache (``export.kv_cache: int8``) on SmolLM2-135M: perplexity at a long context and cache memory,
float32 cache against int8 on the same INT4 weights.

Usage::

    python eval/bench_kv_cache.py                 # writes eval/results/kv_cache_int8_<cpu class>.json
    python eval/bench_kv_cache.py --windows 2 --seq 1024 --decode 256    # a quicker look

* the INT4 decoder is built layer-wise with RTN (groups of 128, every linear and the tied table; no calibration
  needed) once; both arms share its weights (the int8 graphs point at the same ``model.onnx.data``);
* the cache's scales are calibrated as the recipe does (:func:`quantkit.frontends.kv_cache.calibrate_kv_scales`) on
  ``llama-int4.yaml``'s calibration windows (*Pride and Prejudice* + Python docs, 16 x 512 tokens), once per scale
  policy (``rotary_pair``: the default; ``channel``: every channel's own absmax);
* perplexity on ``--windows`` windows of ``--seq`` tokens of *Emma* (a prefill from position 0: the kernel quantizes
  the new keys / values before attention reads them, so the prefill already runs on the int8 cache), and on the
  recipe's own 512-token windows;
* memory: the past K/V bytes at ``--seq`` positions, and in a child process per arm the peak RSS of a prompt of
  ``seq - decode`` tokens followed by ``--decode`` greedy steps in one shared cache buffer (as onnxruntime-genai
  runs it), with the median time per decoded token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status(key: str) -> int:
    """``VmHWM`` (peak) / ``VmRSS`` of this process in bytes (``ru_maxrss`` would carry the parent's peak across
    the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def _decode_child(path: str, seq: int, decode: int, threads: int) -> None:
    """In a fresh process: prompt of ``seq - decode`` tokens, ``decode`` greedy steps; print JSON."""
    from quantkit.frontends.llm_builder import LLMSession

    rss0 = _status("VmHWM")
    sess = LLMSession(path, threads=threads, max_length=seq)
    rss_loaded = _status("VmRSS")
    ids = np.random.default_rng(0).integers(100, 20000, (1, seq - decode)).astype(np.int64)
    t0 = time.perf_counter()
    logits = sess(ids, logits_to_keep=1)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    steps = []
    for _ in range(decode):
        nxt = np.asarray([[int(np.argmax(logits[0, -1]))]], np.int64)
        t0 = time.perf_counter()
        logits = sess(nxt)
        steps.append((time.perf_counter() - t0) * 1e3)
    cache = sum(a.nbytes for a in sess.arrays.values())
    print(json.dumps({"peak_rss_bytes": _status("VmHWM"), "rss_at_end_bytes": _status("VmRSS"),
                      "rss_after_load_bytes": rss_loaded, "peak_rss_before_load_bytes": rss0,
                      "cache_buffer_bytes": int(cache), "prefill_ms": prefill_ms,
                      "decode_ms_median": float(np.median(steps)), "decode_ms_p90": float(np.percentile(steps, 90)),
                      "prompt_tokens": seq - decode, "decode_steps": decode}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/quantkit-kv-cache-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory-only", action="store_true",
                    help="rerun the decode children only, into the existing JSON (the models in --work)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _decode_child(args.child[0], int(args.child[1]), int(args.child[2]), int(args.child[3]))
        return

    import onnx

    from quantkit.data import make_dataset
    from quantkit.evaluate.latency import load_average
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.frontends import _optional_tokenizer
    from quantkit.frontends.kv_cache import calibrate_kv_scales, int8_kv_cache, kv_cache_bytes
    from quantkit.frontends.llm import smollm2_folder
    from quantkit.frontends.llm_builder import read_decoder_config
    from quantkit.layerwise import quantize_llm_layerwise
    from quantkit.llm_run import _windows
    from quantkit.recipe import load_recipe
    from quantkit.recipe.load import load_recipe as load_file
    from quantkit.recipe.plan import PrecisionPlan
    from quantkit.report.build import environment
    from quantkit.scheme.target import detect_cpu

    if args.memory_only:
        from quantkit.evaluate.latency import load_average

        out = Path(args.out or ROOT / "eval" / "results" / "kv_cache_int8_x86-vnni.json")
        result = json.loads(out.read_text())
        load = {"start": load_average()}
        work = Path(args.work)
        for arm, p in (("float32", work / "model.onnx"), ("int8_rotary_pair", work / "model_int8_rotary_pair.onnx")):
            res = subprocess.run([sys.executable, __file__, "--child", str(p), str(args.seq), str(args.decode),
                                  str(args.threads)], capture_output=True, text=True, check=True)  # fmt: skip
            result["memory"][arm] = json.loads(res.stdout.strip().splitlines()[-1])
            print(arm, result["memory"][arm], flush=True)
        load["end"] = load_average()
        result["memory"]["load_average"] = load
        result["memory"]["command"] = "python " + " ".join(sys.argv)
        out.write_text(json.dumps(result, indent=1) + "\n")
        return

    t_all = time.perf_counter()
    env = environment()
    env["cpu_class"] = detect_cpu().cpu_class
    env["load_at_start"] = load_average()
    env["command"] = "python " + " ".join(sys.argv)
    folder = smollm2_folder()
    cfg = read_decoder_config(folder)
    tok = _optional_tokenizer(folder)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = load_file(ROOT / "recipes" / "llama-int4.yaml").model_dump(mode="json")
    rtn = {"version": 1, "name": "kv-bench", "model": {"source": "smollm2-135m"},
           "calibration": {"layerwise": True, "data": base["calibration"]["data"]},
           "quantization": {"default": {"format": "int4", "group_size": 128, "algorithm": "rtn",
                                        "weights": {"dtype": "int8", "symmetric": True}}}}  # fmt: skip
    rec = load_recipe(rtn)
    q = work / "model.onnx"
    t = time.perf_counter()
    if not q.is_file():
        quantize_llm_layerwise(folder, q, PrecisionPlan.from_recipe(rec), None, work_dir=work / "lw", progress=False)
    build_s = time.perf_counter() - t
    cal = _windows(rec, None, tok)
    arms: dict[str, Path] = {"float32": q}
    calib: dict[str, Any] = {"windows": list(cal.shape)}
    for policy in ("rotary_pair", "channel"):
        t = time.perf_counter()
        k, v = calibrate_kv_scales(q, cal, policy=policy, threads=args.threads)
        calib[f"{policy}_s"] = round(time.perf_counter() - t, 1)
        m = int8_kv_cache(onnx.load(str(q), load_external_data=False), k, v)
        p = work / f"model_int8_{policy}.onnx"  # the same external data file (model.onnx.data) beside it
        p.write_bytes(m.SerializeToString())
        arms[f"int8_{policy}"] = p
    from quantkit.data import InputInfo

    inputs = [InputInfo("input_ids", np.dtype(np.int64), (None, None)),
              InputInfo("attention_mask", np.dtype(np.int64), (None, None))]  # fmt: skip
    # the empty pasts as quantkit's evaluation binds them (float32; perplexity feeds each model its own type)
    inputs += [InputInfo(f"past_key_values.{i}.{kv}", np.dtype(np.float32), (None, cfg.num_key_value_heads, None,
                                                                            cfg.head_dim))
               for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]  # fmt: skip
    texts = {f"emma_{args.seq}": {"kind": "text", "source": "austen:emma", "mode": "windows", "seq_len": args.seq,
                                  "count": args.windows, "seed": 0},
             "emma_512": base["evaluation"]["data"]}  # fmt: skip
    ppl: dict[str, Any] = {}
    for label, spec in texts.items():
        ds = make_dataset(spec, inputs=inputs, tokenizer=tok, split="evaluation")
        ppl[label] = {"data": spec}
        for arm, p in arms.items():
            t = time.perf_counter()
            r = perplexity(str(p), ds, threads=args.threads)
            ppl[label][arm] = {"ppl": r["ppl"], "tokens": r["tokens"], "seconds": round(time.perf_counter() - t, 1)}
        for arm in arms:
            if arm != "float32":
                ppl[label][arm]["increase_vs_float32_cache"] = ppl[label][arm]["ppl"] / ppl[label]["float32"]["ppl"] - 1
        print(label, {a: round(ppl[label][a]["ppl"], 4) for a in arms}, flush=True)
    memory: dict[str, Any] = {"positions": args.seq, "past_kv_bytes": {
        kind: kv_cache_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, args.seq, kind)
        for kind in ("float32", "int8")}}  # fmt: skip
    for arm in ("float32", "int8_rotary_pair"):
        out = subprocess.run([sys.executable, __file__, "--child", str(arms[arm]), str(args.seq), str(args.decode),
                              str(args.threads)], capture_output=True, text=True, check=True)  # fmt: skip
        memory[arm] = json.loads(out.stdout.strip().splitlines()[-1])
        print(arm, memory[arm], flush=True)
    env["load_at_end"] = load_average()
    result = {"environment": env, "model": "smollm2-135m", "weights": "INT4 RTN, groups of 128, symmetric (every "
              "linear and the tied embedding / lm_head), built layer-wise; both cache arms share these weights",
              "kv_cache": "int8 PER_CHANNEL in GroupQueryAttention (kv_cache_bit_width 8), scales calibrated on the "
              "shipped decoder's present.* over the calibration windows",
              "calibration": calib, "build_s": round(build_s, 1), "perplexity": ppl, "memory": memory,
              "total_s": round(time.perf_counter() - t_all, 1)}  # fmt: skip
    out = Path(args.out or ROOT / "eval" / "results" / f"kv_cache_int8_{env['cpu_class']}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
