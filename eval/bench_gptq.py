"""GPTQ's float32 factorization and row loop (the default, the reference implementation's precision) against
float64 (``algorithm_options: {precision: float64}``), measured in one run:

1. ``--layers``: one wide layer at published widths (random weights, the Hessian of correlated inputs with outlier
   channels): time, peak memory above the process's own floor (sampled every 20 ms) and the output error
   ``tr(D^T H D)`` of each precision, every case in a fresh child process; ``--before DIR`` adds the GPTQ of another
   checkout (e.g. ``git worktree add /tmp/before 58bae39``: float64 with its copies) as a third column;
2. ``--model``: SmolLM2-135M (the real weights of the built-in) quantized end to end by ``quantkit calibrate`` with
   GPTQ on every layer and on the lm_head (groups of 128, asymmetric, 16 x 512-token windows of the recipe's two
   calibration texts), once per precision: held-out perplexity (*Persuasion*, Python's documentation) and the
   time and peak of the run as its report gives them; ``--noise`` (or ``--only-noise``, kept beside the rows already
   in ``--out``) adds float64 with 1% more damping: a change as negligible per layer, so the spread it causes in
   the layer-wise chain is the noise floor of the precisions' difference;
3. ``--real``: GPTQ float32 / float64 on the Hessians of 13 real SmolLM2 layers (transformers' forward, hooks on
   the layer inputs): the ratio of their output errors, layer by layer.

    python eval/bench_gptq.py --layers --before /tmp/before --model --out eval/results/gptq_precision_x86-vnni.json
    python eval/bench_gptq.py --model --only-noise --real --out eval/results/gptq_precision_x86-vnni.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(1, str(ROOT))
PRECISIONS = ("float64", "float32")
#: (label, K, N): a 1.1B LLaMA's down_proj, a 7B's q_proj and down_proj, GLM-4-9B's down_proj; N at most 4096
#: columns (quantkit's layer-wise build takes GPTQ in column slices of 256 MB of float32 anyway)
LAYERS = (("1.1B down_proj", 5632, 2048), ("7B q_proj", 4096, 4096), ("7B down_proj", 11008, 4096),
          ("GLM-4-9B down_proj", 13696, 4096))


def _child(K: int, N: int, precision: str) -> dict[str, Any]:
    import numpy as np
    import psutil

    sys.path.insert(0, os.environ.get("BENCH_GPTQ_CODE", str(ROOT)))
    from quantkit.algorithms.gptq import gptq
    from quantkit.calibrate.layer_stats import LayerStats

    rng = np.random.default_rng(0)
    st = LayerStats(K, max_rows=0)
    mix = (rng.standard_normal((K, K)) * (0.3 / np.sqrt(K)) + np.eye(K)).astype(np.float32)
    for _ in range(2):
        X = rng.standard_normal((1024, K)).astype(np.float32) @ mix
        X[:, :: max(1, K // 64)] *= 8.0  # outlier channels
        st.update(X)
    del X, mix
    W = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
    proc = psutil.Process()
    floor = proc.memory_info().rss
    peak = [floor]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    res = gptq(W, bits=4, group_size=128, symmetric=False, stats=st,
               **({} if precision == "before" else {"precision": precision}))
    seconds = time.perf_counter() - t0
    done.set()
    t.join()
    H = (st.H / st.count).astype(np.float32)
    d = W - res.effective_weight()
    err = float(np.sum((H @ d) * d, dtype=np.float64))
    ref = float(np.sum((H @ W) * W, dtype=np.float64))
    return {"seconds": round(seconds, 2), "peak_above_floor_gb": round((peak[0] - floor) / 2**30, 3),
            "output_sqnr_db": round(10 * np.log10(ref / err), 4)}


def layers(before: Path | None) -> list[dict[str, Any]]:
    rows = []
    for label, K, N in LAYERS:
        row: dict[str, Any] = {"layer": label, "K": K, "N": N}
        for p in (("before",) if before else ()) + PRECISIONS:
            env = {**os.environ, "BENCH_GPTQ_CODE": str(before if p == "before" else ROOT)}
            out = subprocess.run([sys.executable, __file__, "--child", str(K), str(N), p], capture_output=True,
                                 text=True, check=True, env=env)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            row[p] = r
            print(label, p, r, flush=True)
        row["float32_time_x"] = round(row["float32"]["seconds"] / row["float64"]["seconds"], 3)
        row["float32_peak_x"] = round(row["float32"]["peak_above_floor_gb"] / row["float64"]["peak_above_floor_gb"], 3)
        if before:
            row["float32_time_x_before"] = round(row["float32"]["seconds"] / row["before"]["seconds"], 3)
            row["float32_peak_x_before"] = round(row["float32"]["peak_above_floor_gb"]
                                                 / row["before"]["peak_above_floor_gb"], 3)
        row["sqnr_float32_minus_float64_db"] = round(row["float32"]["output_sqnr_db"] - row["float64"]["output_sqnr_db"],
                                                     4)
        rows.append(row)
    return rows


#: the end-to-end variants: label -> GPTQ options.  NOISE is the noise floor: a change as negligible per layer (1%
#: more or less damping) shows how far the layer-wise chain moves the perplexity by itself, for either precision.
VARIANTS: dict[str, dict[str, Any]] = {"float64": {"precision": "float64"}, "float32": {"precision": "float32"}}
NOISE = {"float64, percdamp 0.0101": {"precision": "float64", "percdamp": 0.0101},
         "float64, percdamp 0.0099": {"precision": "float64", "percdamp": 0.0099},
         "float32, percdamp 0.0101": {"precision": "float32", "percdamp": 0.0101}}


def _recipe(label: str, options: dict[str, Any]) -> dict[str, Any]:
    gptq = {"algorithm": "gptq", "algorithm_options": dict(options)}
    return {
        "version": 1, "name": "gptq-" + "".join(c if c.isalnum() else "-" for c in label), "model": {"source": "smollm2-135m"},
        "calibration": {"data": {"kind": "text", "source": "austen:prideprejudice+pydoc", "mode": "windows",
                                 "seq_len": 512, "count": 16, "seed": 0}, "layerwise": True},
        "quantization": {"default": {"format": "int4", "group_size": 128, "weights": {"symmetric": False}, **gptq},
                         "overrides": [{"layer": "lm_head", "format": "int4", "group_size": 128, **gptq}]},
        "evaluation": {"data": {"kind": "text", "source": "austen:persuasion", "mode": "windows", "seq_len": 512,
                                "count": 16, "seed": 0},
                       "extra": [{"kind": "text", "source": "pydoc", "mode": "windows", "seq_len": 512, "count": 8,
                                  "seed": 0}]},
        "report": {"formats": ["json"], "latency": {"enabled": False}},
    }  # fmt: skip


def model(work: Path, variants: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for i, (p, options) in enumerate(variants.items()):
        rec = work / f"gptq-{i}.yaml"
        rec.write_text(yaml.safe_dump(_recipe(p, options), sort_keys=False))
        out = work / f"out-{i}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantkit", "calibrate", "--recipe", str(rec), "--output", str(out)],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        rep = json.loads((out / "report.json").read_text())
        q, mem = rep.get("quality", {}), rep.get("memory", {})
        ppl = {"austen:persuasion": {"fp32": q.get("perplexity_fp32", {}).get("ppl"),
                                     "quantized": q.get("perplexity_quantized", {}).get("ppl")}}
        for name, e in (q.get("perplexity_extra") or {}).items():
            ppl[name] = {"fp32": (e.get("fp32") or {}).get("ppl"), "quantized": (e.get("quantized") or {}).get("ppl")}
        rows.append({"precision": p, "wall_s": round(wall, 1), "perplexity": ppl,
                     "timings_s": {k: round(float(v), 1) for k, v in rep.get("timings", {}).items()},
                     "gptq_layer_s": round(sum(float(r.get("seconds", 0)) for r in rep.get("layers", [])
                                               if r.get("algorithm") == "gptq"), 1),
                     "memory_gb": {"estimated_peak": round(mem.get("estimated_peak_bytes", 0) / 1e9, 2),
                                   "measured_peak": round(mem.get("measured_peak_bytes", 0) / 1e9, 2)}})
        print(p, rows[-1], flush=True)
    return rows


def real_hessians() -> list[dict[str, Any]]:
    """GPTQ float32 / float64 on the Hessians of real SmolLM2-135M layers (transformers' forward on 16 x 512 tokens
    of the recipe's calibration texts, hooks on the layer inputs): the output error ``tr(D^T H D)`` of each."""
    import numpy as np
    import torch
    import transformers

    from quantkit.algorithms.gptq import gptq
    from quantkit.calibrate.layer_stats import LayerStats
    from quantkit.data.text import load_text
    from quantkit.frontends.llm import smollm2_folder

    folder = smollm2_folder()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    net = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = load_text("austen:prideprejudice")[:200_000] + load_text("pydoc")[:200_000]
    ids = tok(text, return_tensors="pt").input_ids[0]
    names = [f"model.layers.{i}.{p}" for i in (0, 5, 15, 29) for p in ("self_attn.q_proj", "self_attn.o_proj",
                                                                       "mlp.down_proj")] + ["lm_head"]
    mods = dict(net.named_modules())
    stats = {n: LayerStats(mods[n].in_features, max_rows=0) for n in names}
    hooks = [mods[n].register_forward_pre_hook(lambda m, a, n=n: stats[n].update(a[0].detach().numpy()))
             for n in names]
    with torch.no_grad():
        for i in range(16):
            net(ids[i * 512:(i + 1) * 512][None])
    for h in hooks:
        h.remove()
    rows = []
    for n in names:
        W = mods[n].weight.detach().numpy().T.copy()
        H = stats[n].hessian()
        d = np.diag(H)
        ev = np.linalg.eigvalsh(H + 0.01 * d.mean() * np.eye(len(d)))
        row: dict[str, Any] = {"layer": n, "K": W.shape[0], "N": W.shape[1],
                               "damped_condition_number": float(f"{ev[-1] / ev[0]:.4g}")}
        for prec in PRECISIONS:
            r = gptq(W, bits=4, group_size=128, symmetric=False, stats=stats[n], precision=prec)
            D = (W - r.effective_weight()).astype(np.float64)
            row[f"output_error_{prec}"] = float(np.sum((H @ D) * D))
        row["error_float32_over_float64"] = round(row["output_error_float32"] / row["output_error_float64"], 6)
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--model", action="store_true")
    ap.add_argument("--real", action="store_true", help="float32 / float64 on real SmolLM2 layers' Hessians")
    ap.add_argument("--noise", action="store_true", help="--model: add the noise-floor variant (NOISE)")
    ap.add_argument("--only-noise", action="store_true", help="--model: run the noise-floor variant alone, kept "
                    "beside the rows already in --out")
    ap.add_argument("--variants", nargs="*", help="--model: only these labels (of VARIANTS / NOISE)")
    ap.add_argument("--before", type=Path, help="another checkout whose GPTQ is timed beside (--layers)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from provenance import run_record

    from quantkit.report.build import environment

    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}

    def record() -> dict[str, Any]:
        return {**environment(), **run_record(), "load_before": list(os.getloadavg())}

    if args.layers:
        env = record()
        result["layers"] = layers(args.before)
        if args.before:
            env["before"] = subprocess.run(["git", "-C", str(args.before), "log", "--oneline", "-1"],
                                           capture_output=True, text=True).stdout.strip()
        result["environment"] = {**env, "load_after": list(os.getloadavg())}  # (the page's provenance)
    if args.model:
        env = record()
        variants = NOISE if args.only_noise else {**VARIANTS, **(NOISE if args.noise else {})}
        if args.variants:
            variants = {k: v for k, v in variants.items() if k in args.variants}
        with tempfile.TemporaryDirectory(prefix="quantkit-bench-gptq-") as tmp:
            rows = model(Path(tmp), variants)
        if args.only_noise:
            done = {r["precision"] for r in rows}
            rows = [r for r in result.get("model", []) if r["precision"] not in done] + rows
            result["model_noise_environment"] = {**env, "load_after": list(os.getloadavg())}
        result["model"] = rows
        if not args.only_noise:
            result["model_environment"] = {**env, "load_after": list(os.getloadavg())}
    if args.real:
        env = record()
        result["real_hessians"] = real_hessians()
        result["real_hessians_environment"] = {**env, "load_after": list(os.getloadavg())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp_out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
