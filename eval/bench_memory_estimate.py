"""The memory guard's estimate against the measured peak (quantkit.memory; issue 27).

Each case runs ``quantkit calibrate`` in a child process, as users run it, and compares

* the estimate printed at the start of the run (``memory: expected peak ~X GB of Y GB available``, also in
  ``report.json`` as ``memory.estimated_peak_bytes``, with one figure per phase),
* the peak quantkit measured itself (``memory.measured_peak_bytes``: the process tree's RSS, sampled, and the
  process's own high-water mark), and
* the peak of the whole command measured from outside (``eval/rss_tree.py``'s sampler: the summed RSS of the
  process and its children every 0.1 s, the output folder's save included).

Cases (``--case``; one heavy run at a time):

* ``smollm2-recipe``: ``recipes/llama-int4.yaml`` (the ``smollm2-135m`` built-in; SignRound + a GPTQ lm_head,
  16 x 512-token windows, perplexity on two texts, latency);
* ``smollm2-plain``: a plain recipe on the built-in - int4, RTN, group 128, two 64-token calibration windows, no
  ``calibration.layerwise`` key (so: streamed), latency measured (``evaluation.fp32_baseline: auto`` holds the
  0.54 GB FP32 baseline whole: its weights are smaller than the streamed run's own peak);
* ``smollm2-whole``: the same with ``calibration.layerwise: false`` (the whole-graph path) and no latency;
* ``synthetic-1.1b`` / ``synthetic-7b``: a LLaMA-shaped folder of random bf16 weights written tensor by tensor
  (``eval/bench_llm_builder.py``'s generator: 1.1B = 22 layers, hidden 2048, intermediate 5632, 32 heads / 4 KV
  heads, vocab 32000; 7B = 32 layers, hidden 4096, intermediate 11008, 32 heads), the plain recipe (int4, RTN,
  group 128, two 64-token windows of random ids, no ``layerwise`` key), with the default latency measurement: the
  FP32 weights (4.4 / 27 GB) exceed the streamed run's own peak, so ``evaluation.fp32_baseline: auto`` streams
  the baseline (latency of the FP32 and quantized decoders truncated to the first k blocks that fit, "measured on
  k of L blocks"; :mod:`quantkit.evaluate.streamed`).  The 1.1B case then builds the same folder again with
  ``calibration.layerwise: true`` (the same arguments) and records whether both emitted the same model (sha256 of
  ``model.onnx`` and ``model.onnx.data``, and the graph up to the MatMulNBits accuracy level, which
  ``export.accuracy_level: auto`` may pick by timing; ``--same-model`` asks the same of other synthetic cases);
* ``synthetic-1.1b-whole``: the 1.1B folder with ``calibration.layerwise: false`` - the whole graph, which is
  expected to be refused before any work (the row records the message and how long the refusal took);
* ``synthetic-7b-latency-phase``: the streamed FP32 baseline's latency phase alone, on the 7B shape: a 2-block
  folder of the 7B widths is quantized (``--no-latency``), then, in a fresh process per ``k`` (1 and 2), the FP32
  and quantized decoders truncated to ``k`` blocks are built, cut and timed
  (:func:`quantkit.evaluate.streamed.truncated_latency`) under :class:`quantkit.memory.PeakMeter`; the row sets the
  measured peak beside the estimate of that phase (``latency on k of L blocks``), which does not depend on the
  depth - what the 32-block 7B run's phase is, without its other phases around it.

    python eval/bench_memory_estimate.py --case smollm2-plain synthetic-1.1b

Rows go into ``eval/results/memory_estimate.json`` (one per case, replaced when a case runs again);
``python eval/render_results.py`` renders them into ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
RESULTS = ROOT / "eval" / "results" / "memory_estimate.json"
CASES = ("smollm2-recipe", "smollm2-plain", "smollm2-whole", "synthetic-1.1b", "synthetic-1.1b-whole", "synthetic-7b",
         "synthetic-7b-latency-phase")


def _plain(source: str, cal: dict[str, Any], **calibration: Any) -> dict[str, Any]:
    return {"version": 1, "name": "plain-int4", "model": {"source": source},
            "calibration": {"data": cal, **calibration},
            "quantization": {"default": {"format": "int4", "group_size": 128, "algorithm": "rtn"}},
            "report": {"formats": ["json"]}}  # fmt: skip


def _tree_peak(proc: subprocess.Popen[str], out: list[int], every: float = 0.1) -> None:
    from rss_tree import _tree_rss_kib

    while proc.poll() is None:
        out[0] = max(out[0], _tree_rss_kib(proc.pid) * 1024)
        time.sleep(every)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(16 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_digests(out: Path) -> dict[str, str]:
    return {n: _sha256(out / n) for n in ("model.onnx", "model.onnx.data") if (out / n).is_file()}


def _graph_without_levels(path: Path) -> bytes:
    """The graph of ``path`` (no weights) with every MatMulNBits accuracy_level set to 0: the model up to the level
    ``export.accuracy_level: auto`` picks by timing (quantkit.int4_kernel), which may differ between two runs."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    for n in m.graph.node:
        for a in n.attribute:
            if n.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    return m.SerializeToString()


def _same_model(recipe: dict[str, Any], work: Path, first: Path, args: list[str]) -> dict[str, Any]:
    """Build ``recipe`` again with ``calibration.layerwise: true`` (same arguments); whether the model is the same
    as ``first``'s (sha256 of the graph and of the weight file; the graph also up to the accuracy level)."""
    forced = json.loads(json.dumps(recipe))
    forced["calibration"]["layerwise"] = True
    path = work / "recipe-layerwise-true.yaml"
    path.write_text(yaml.safe_dump(forced))
    out = work / "out-layerwise-true"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", "-q", "--recipe", str(path), "--output",
                           str(out), *args], capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"layerwise: true: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    a, b = _model_digests(first), _model_digests(out)
    same_graph_up_to_level = _graph_without_levels(first / "model.onnx") == _graph_without_levels(out / "model.onnx")
    shutil.rmtree(out, ignore_errors=True)
    return {"same": a == b and bool(a), "same_weights": a.get("model.onnx.data") == b.get("model.onnx.data"),
            "same_graph_up_to_accuracy_level": same_graph_up_to_level, "sha256_layerwise_true": b, "args": args,
            "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


_PHASE_CHILD = """
import json, shutil, sys, time
from pathlib import Path
import torch, transformers  # what an LLM run has imported before its evaluation
from quantkit.memory import BASE_BYTES, PeakMeter, decoder_sizes, latency_phase, layerwise_estimate, process_tree_rss
from quantkit.evaluate.streamed import truncated_latency
from quantkit.recipe import load_recipe
hf, q, k, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
s = decoder_sizes(hf)
est = layerwise_estimate(s, bits=4, algorithms=["rtn"], head_algorithm="rtn", head_quantized=True, tied=False,
                         windows=None, evaluation={"fp32": "streamed", "prefill": 1024, "perplexity": False,
                                                   "latency_blocks": k}, base=BASE_BYTES)
floor = process_tree_rss()
m = PeakMeter().start()
t = time.perf_counter()
rows = truncated_latency(hf, q, k, load_recipe({"version": 1}).report.latency, work_dir=work, progress=False)
peak = m.stop()
shutil.rmtree(work, ignore_errors=True)
print(json.dumps({"k": k, "blocks": s.blocks, "floor_GB": round(floor / 1e9, 3), "measured_GB": round(peak / 1e9, 3),
                  "estimated_GB": round(est.phases[latency_phase(k, s.blocks)] / 1e9, 3),
                  "wall_s": round(time.perf_counter() - t, 1), "scope": rows["prefill"]["scope"],
                  "speedup": {a: round(b["speedup"], 2) for a, b in rows.items()}}))
"""


def run_latency_phase(work: Path) -> dict[str, Any]:
    """``synthetic-7b-latency-phase`` (module docstring)."""
    from bench_llm_builder import _CHILD_GEN, SHAPES, _child

    hf = work / "synthetic-7b-2-blocks"
    hf.mkdir(parents=True, exist_ok=True)
    _child(_CHILD_GEN + "\nprint('{}')", str(hf), json.dumps({**SHAPES["7b"], "num_hidden_layers": 2}))
    recipe = _plain(str(hf), {"kind": "npz", "path": str(work / "none.npz")})
    del recipe["calibration"]
    recipe["export"] = {"accuracy_level": 4}
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    load0, t0 = os.getloadavg(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", "-q", "--recipe", str(work / "recipe.yaml"),
                    "--output", str(work / "out"), "--no-latency"], check=True, env=env, capture_output=True)  # fmt: skip
    out = []
    for k in (1, 2):
        proc = subprocess.run([sys.executable, "-c", _PHASE_CHILD, str(hf), str(work / "out" / "model.onnx"), str(k),
                               str(work / f"lat{k}")], capture_output=True, text=True, env=env)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"latency phase k={k}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["estimate_over_measured"] = round(r["estimated_GB"] / r["measured_GB"] - 1, 3)
        print(f"  k={k}: measured {r['measured_GB']} GB, estimated {r['estimated_GB']} GB", flush=True)
        out.append(r)
    return {"case": "synthetic-7b-latency-phase", "phase_only": True, "model": "synthetic 7B widths, 2 blocks",
            "checkpoint_GB": sum(f.stat().st_size for f in hf.iterdir()) / 1e9, "measurements": out,
            "wall_s": round(time.perf_counter() - t0, 1), "load_start": [round(x, 2) for x in load0],
            "load_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip


def run_case(case: str, work: Path, keep: bool = False, same_model: bool = False) -> dict[str, Any]:
    """Set up ``case`` in ``work``, run ``quantkit calibrate`` under the sampler, return its row."""
    if case == "synthetic-7b-latency-phase":
        return run_latency_phase(work)
    args: list[str] = []
    folder_gb = None
    if case == "smollm2-recipe":
        recipe: Any = ROOT / "recipes" / "llama-int4.yaml"
    elif case.startswith("smollm2"):
        cal = {"kind": "text", "source": "austen:prideprejudice", "mode": "windows", "seq_len": 64, "count": 2}
        recipe = _plain("smollm2-135m", cal, **({"layerwise": False} if case == "smollm2-whole" else {}))
        if case == "smollm2-whole":
            args.append("--no-latency")
    else:
        from bench_llm_builder import _CHILD_GEN, SHAPES, _child

        shape = case.split("-")[1]
        whole = case.endswith("-whole")
        hf = work / f"synthetic-{shape}"
        hf.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        _child(_CHILD_GEN + "\nprint('{}')", str(hf), json.dumps(SHAPES[shape]))
        print(f"{case}: wrote {hf} in {time.perf_counter() - t0:.0f} s", flush=True)
        folder_gb = sum(f.stat().st_size for f in hf.iterdir()) / 1e9
        vocab = SHAPES[shape]["vocab_size"]
        ids = np.random.default_rng(0).integers(3, vocab, (2, 64)).astype(np.int64)
        np.savez(work / "cal.npz", input_ids=ids, attention_mask=np.ones_like(ids))
        recipe = _plain(str(hf), {"kind": "npz", "path": str(work / "cal.npz")},
                        **({"layerwise": False} if whole else {}))
        same_model = same_model or (shape == "1.1b" and not whole)
    recipe_dict = recipe if isinstance(recipe, dict) else None
    if isinstance(recipe, dict):
        path = work / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        recipe = path
    out = work / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "quantkit.cli", "calibrate", "-q", "--recipe", str(recipe), "--output", str(out),
           *args]  # fmt: skip
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    peak = [0]
    th = threading.Thread(target=_tree_peak, args=(proc, peak), daemon=True)
    th.start()
    assert proc.stdout is not None  # noqa: S101 - set by Popen
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "memory:" in line or "error" in line:
            print(f"  {line.rstrip()}", flush=True)
    proc.wait()
    th.join(timeout=5)
    wall = time.perf_counter() - t0
    if case.endswith("-whole") and case.startswith("synthetic"):
        err = [ln for ln in lines if ln.startswith("quantkit: error:")]
        return {"case": case, "refused": proc.returncode == 2, "returncode": proc.returncode, "wall_s": round(wall, 1),
                "tree_peak_GB": round(peak[0] / 1e9, 3), "error": err[-1] if err else "\n".join(lines[-5:]),
                "announced": next((ln for ln in lines if "memory: expected peak" in ln), None),
                "checkpoint_GB": folder_gb, "load_start": [round(x, 2) for x in load0], "cpus": os.cpu_count(),
                "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{case}: exit {proc.returncode}\n" + "\n".join(lines[-30:]))
    rep = json.loads((out / "report.json").read_text())
    mem = rep["memory"]
    digests = _model_digests(out)
    row = {
        "case": case, "model": rep.get("model"), "recipe": str(recipe.relative_to(ROOT)) if recipe.is_relative_to(ROOT)
        else yaml.safe_load(recipe.read_text()), "args": args,
        "path": mem.get("path"), "phases_GB": {k: round(v / 1e9, 3) for k, v in (mem.get("phases") or {}).items()},
        "peak_phase": mem.get("peak_phase"), "estimated_GB": round(mem["estimated_peak_bytes"] / 1e9, 3),
        "measured_GB": round(mem["measured_peak_bytes"] / 1e9, 3), "tree_peak_GB": round(peak[0] / 1e9, 3),
        "available_GB": round(mem.get("available_bytes", 0) / 1e9, 1), "checkpoint_GB": folder_gb,
        "fp32_GB": round(rep["size"]["fp32_bytes"] / 1e9, 3), "quantized_GB": round(rep["size"]["quantized_bytes"] / 1e9, 3),
        "wall_s": round(wall, 1), "load_start": [round(x, 2) for x in load0],
        "load_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        "warnings": rep.get("warnings", []), "date": time.strftime("%Y-%m-%d %H:%M"),
        "fp32_baseline": {k: v for k, v in (rep.get("fp32_baseline") or {}).items() if k in
                          ("setting", "mode", "why", "latency_blocks", "blocks")},
        "latency": {k: {"speedup": round(v["speedup"], 3), "fp32_ms": round(v["fp32_ms"], 3),
                        "quantized_ms": round(v["quantized_ms"], 3), "scope": v.get("scope", "whole model")}
                    for k, v in (rep.get("latency") or {}).items() if isinstance(v, dict) and "speedup" in v},
        "int4_kernel": {k: v for k, v in (rep.get("int4_kernel") or {}).items() if k in ("how", "shipped", "why")},
        "timings_s": {k: round(v, 1) for k, v in (rep.get("timings") or {}).items()
                      if k in ("quantize_s", "evaluate_s", "latency_s", "accuracy_level_s", "total_s")},
        "sha256": digests,
    }  # fmt: skip
    row["estimate_over_measured"] = round(row["estimated_GB"] / max(row["tree_peak_GB"], 1e-9) - 1, 3)
    if same_model and recipe_dict is not None:
        print(f"{case}: building it again with calibration.layerwise: true", flush=True)
        row["same_model_as_layerwise_true"] = _same_model(recipe_dict, work, out, args)
        print(f"  same model: {row['same_model_as_layerwise_true']['same']}", flush=True)
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def render(rows: list[dict[str, Any]]) -> str:
    """The table printed at the end (``docs/results.md`` renders the same rows: ``eval/render_results.py``)."""
    lines = ["| case | path | estimated GB (phase) | measured GB (report / outside) | error | wall s |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['case']} | refused: exit {r['returncode']} in {r['wall_s']:.1f} s | | | | |")
            continue
        if r.get("phase_only"):
            for m in r["measurements"]:
                lines.append(f"| {r['case']} | latency phase alone, k = {m['k']} | {m['estimated_GB']:.2f} | "
                             f"{m['measured_GB']:.2f} | {100 * m['estimate_over_measured']:+.0f}% | {m['wall_s']:.0f} |")
            continue
        lines.append(f"| {r['case']} | {(r['path'] or '').split(',')[0]} | {r['estimated_GB']:.2f} ({r['peak_phase']}) "
                     f"| {r['measured_GB']:.2f} / {r['tree_peak_GB']:.2f} | {100 * r['estimate_over_measured']:+.0f}% "
                     f"| {r['wall_s']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs="*", choices=CASES, default=[])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the output folders")
    ap.add_argument("--same-model", action="store_true",
                    help="every synthetic case: build again with calibration.layerwise: true and compare the model")
    args = ap.parse_args()
    from provenance import run_record

    from quantkit.report.build import environment

    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    rows: list[dict[str, Any]] = data if isinstance(data, list) else data.get("memory_estimate", [])
    for case in args.case:
        work = Path(tempfile.mkdtemp(prefix=f"bench-mem-{case}-", dir=args.workdir))
        try:
            row = run_case(case, work, keep=args.keep, same_model=args.same_model)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(row), flush=True)
        order = {c: i for i, c in enumerate(CASES)}
        rows = sorted([r for r in rows if r["case"] != case] + [row], key=lambda r: order.get(r["case"], 99))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        env = {**environment(), **run_record(), "command": "python eval/bench_memory_estimate.py --case "
               + " ".join(r["case"] for r in rows)}  # the rows' cases (each row records its own date and load)
        RESULTS.write_text(json.dumps({"environment": env, "memory_estimate": rows}, indent=1))
    print(render(rows))


if __name__ == "__main__":
    main()
