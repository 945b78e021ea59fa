"""The LLM graph quantkit quantizes: full-sequence torch export vs the built KV-cache decoder.

Runs ``recipes/llama-int4.yaml`` (AWQ + GPTQ g128, lm_head int8_weight) once per graph (``model.graph:
full_sequence`` / ``decoder``), each in a child process under ``/usr/bin/time -v`` (wall time, peak RSS),
one after the other; then, optionally, perplexity of both FP32 and both quantized models on held-out
*Northanger Abbey* (16 x 512-token windows).  Within one recipe run FP32 and quantized latency are
interleaved; across the two runs compare the speedups, not the absolute milliseconds.

    python eval/bench_llm_graph.py --out eval/results/llm_graph.json [--northanger] [--cross]
    python eval/bench_llm_graph.py --parallel --out eval/results/llm_graph_parallel.json
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


def start_recipe(graph: str, work: Path, latency: bool = True) -> tuple[subprocess.Popen[str], float, Path]:
    rec = yaml.safe_load((ROOT / "recipes" / "llama-int4.yaml").read_text())
    rec["model"]["graph"] = graph
    if not latency:
        rec["report"]["latency"]["enabled"] = False
    rpath = work / f"llama-int4-{graph}.yaml"
    rpath.write_text(yaml.safe_dump(rec))
    out = work / f"out-{graph}"
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "quantkit.cli", "calibrate", "--recipe", str(rpath),
           "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, time.perf_counter(), out


def finish_recipe(graph: str, proc: subprocess.Popen[str], t0: float, out: Path) -> dict:
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{graph}: exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}")

    def num(pattern: str) -> float | None:
        m = re.search(pattern, stderr)
        return float(m.group(1)) if m else None

    rss = num(r"Maximum resident set size \(kbytes\): (\d+)")
    rep = json.loads((out / "report.json").read_text())
    return {"graph": graph, "wall_s": wall, "peak_rss_mb": rss / 1024 if rss else None,
            "user_s": num(r"User time \(seconds\): ([\d.]+)"), "sys_s": num(r"System time \(seconds\): ([\d.]+)"),
            "quality": rep.get("quality"), "latency": rep.get("latency"), "timings": rep.get("timings"),
            "census": rep.get("census", {}).get("quantized_kernels"), "size": rep.get("size"),
            "model": str(out / "model.onnx")}


def run_recipe(graph: str, work: Path, latency: bool = True) -> dict:
    return finish_recipe(graph, *start_recipe(graph, work, latency))


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


def cross(work: Path, steps: int = 32, rounds: int = 2) -> dict[str, float]:
    """The two INT4 models against each other, interleaved: prefill of 128 tokens, then ``steps`` generated
    tokens (decoder: one token with the KV cache; full sequence: a forward over the whole prefix)."""
    import numpy as np

    from quantkit.evaluate.latency import make_session

    dec = make_session(str(work / "out-decoder" / "model.onnx"), threads=2)
    full = make_session(str(work / "out-full_sequence" / "model.onnx"), threads=2)
    ids = np.random.default_rng(0).integers(3, 1000, (1, 128)).astype(np.int64)
    past_names = [i.name for i in dec.get_inputs() if i.name.startswith("past_key_values.")]
    present = [n.replace("past_key_values.", "present.") for n in past_names]
    shape = {i.name: i.shape for i in dec.get_inputs()}
    res: dict[str, list[float]] = {"dec_prefill": [], "full_prefill": [], "dec_step": [], "full_step": []}
    for rnd in range(rounds):
        past = {n: np.zeros((1, shape[n][1], 0, shape[n][3]), np.float32) for n in past_names}
        mask = np.ones((1, 128), np.int64)
        t = time.perf_counter()
        outs = dec.run(["logits", *present], {"input_ids": ids, "attention_mask": mask, **past})
        a = time.perf_counter() - t
        t = time.perf_counter()
        full.run(["logits"], {"input_ids": ids, "attention_mask": mask})
        res["dec_prefill"].append(a)
        res["full_prefill"].append(time.perf_counter() - t)
        past, seq = dict(zip(past_names, outs[1:], strict=True)), ids
        for _ in range(steps):
            tok = np.array([[int(np.argmax(outs[0][0, -1])) % 1000]], np.int64)
            seq = np.concatenate([seq, tok], 1)
            mask = np.ones_like(seq)
            t = time.perf_counter()
            outs = dec.run(["logits", *present], {"input_ids": tok, "attention_mask": mask, **past})
            a = time.perf_counter() - t
            t = time.perf_counter()
            full.run(["logits"], {"input_ids": seq, "attention_mask": mask})
            b = time.perf_counter() - t
            past = dict(zip(past_names, outs[1:], strict=True))
            if rnd:
                res["dec_step"].append(a)
                res["full_step"].append(b)
    return {k: float(np.median(v)) * 1e3 for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "llm_graph.json")
    ap.add_argument("--graphs", default="full_sequence,decoder")
    ap.add_argument("--northanger", action="store_true")
    ap.add_argument("--cross", action="store_true",
                    help="after the runs: the two INT4 models against each other (prefill, generated tokens)")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--parallel", action="store_true",
                    help="run the graphs at the same time (same machine load for both; no latency: it would "
                    "time one run against the other's load)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-llm-graph-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    if args.parallel:
        started = {g: start_recipe(g, work, latency=False) for g in args.graphs.split(",")}
        results = [finish_recipe(g, *s) for g, s in started.items()]
        print(json.dumps([{k: r[k] for k in ("graph", "wall_s", "user_s", "sys_s", "peak_rss_mb", "quality",
                                              "timings")} for r in results], indent=1))
        args.out.write_text(json.dumps(results, indent=1))
        return
    for g in args.graphs.split(","):
        r = run_recipe(g, work)
        print(json.dumps({k: r[k] for k in ("graph", "wall_s", "peak_rss_mb", "quality", "latency")}, indent=1),
              flush=True)
        results.append(r)
        args.out.write_text(json.dumps(results, indent=1))
    if args.northanger:
        northanger(results)
        args.out.write_text(json.dumps(results, indent=1))
    if args.cross:
        print(json.dumps(cross(work)), flush=True)


if __name__ == "__main__":
    main()
