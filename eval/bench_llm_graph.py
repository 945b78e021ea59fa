"""The LLM graph quantkit quantizes: full-sequence torch export vs the built KV-cache decoder.

Runs ``recipes/llama-int4.yaml`` (AWQ + GPTQ g128, lm_head int8_weight) once per graph (``model.graph:
full_sequence`` / ``decoder``), each in a child process under ``/usr/bin/time -v`` (wall time, peak RSS),
one after the other; then, optionally, perplexity of both FP32 and both quantized models on held-out
*Northanger Abbey* (16 x 512-token windows).  Within one recipe run FP32 and quantized latency are
interleaved; across the two runs compare the speedups, not the absolute milliseconds.

    python eval/bench_llm_graph.py --out eval/results/llm_graph.json [--northanger]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(graph: str, work: Path) -> dict:
    rec = yaml.safe_load((ROOT / "recipes" / "llama-int4.yaml").read_text())
    rec["model"]["graph"] = graph
    rpath = work / f"llama-int4-{graph}.yaml"
    rpath.write_text(yaml.safe_dump(rec))
    out = work / f"out-{graph}"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "quantkit.cli", "calibrate", "--recipe", str(rpath),
           "--output", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{graph}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    rep = json.loads((out / "report.json").read_text())
    return {"graph": graph, "wall_s": wall, "peak_rss_mb": int(rss.group(1)) / 1024 if rss else None,
            "quality": rep.get("quality"), "latency": rep.get("latency"), "timings": rep.get("timings"),
            "census": rep.get("census", {}).get("quantized_kernels"), "size": rep.get("size"),
            "model": str(out / "model.onnx")}


def northanger(results: list[dict]) -> None:
    from quantkit.data import make_dataset, model_inputs
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.frontends import load_model, load_onnx

    for r in results:
        loaded = load_model("smollm2-135m", graph=r["graph"])
        spec = {"kind": "text", "source": "austen:northangerabbey", "mode": "windows", "seq_len": 512, "count": 16}
        ev = make_dataset(spec, inputs=model_inputs(loaded.model), tokenizer=loaded.tokenizer, split="evaluation")
        import onnx_ir as ir

        r["northanger_fp32"] = perplexity(ir.to_proto(loaded.model).SerializeToString(), ev)
        r["northanger_quantized"] = perplexity(ir.to_proto(load_onnx(r["model"])).SerializeToString(), ev)
        print(r["graph"], r["northanger_fp32"], r["northanger_quantized"], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "llm_graph.json")
    ap.add_argument("--graphs", default="full_sequence,decoder")
    ap.add_argument("--northanger", action="store_true")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-llm-graph-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for g in args.graphs.split(","):
        r = run_recipe(g, work)
        print(json.dumps({k: r[k] for k in ("graph", "wall_s", "peak_rss_mb", "quality", "latency")}, indent=1),
              flush=True)
        results.append(r)
        args.out.write_text(json.dumps(results, indent=1))
    if args.northanger:
        northanger(results)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
