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
  ``calibration.layerwise`` key (so: streamed), latency measured (the FP32 baseline beside the quantized model);
* ``smollm2-whole``: the same with ``calibration.layerwise: false`` (the whole-graph path) and no latency;
* ``synthetic-1.1b`` / ``synthetic-7b``: a LLaMA-shaped folder of random bf16 weights written tensor by tensor
  (``eval/bench_llm_builder.py``'s generator: 1.1B = 22 layers, hidden 2048, intermediate 5632, 32 heads / 4 KV
  heads, vocab 32000; 7B = 32 layers, hidden 4096, intermediate 11008, 32 heads), the plain recipe (int4, RTN,
  group 128, two 64-token windows of random ids, no ``layerwise`` key), ``--no-latency`` for the 1.1B (its FP32
  baseline would be evaluated beside it: the 4.4 GB FP32 decoder; the 7B's does not fit and is skipped anyway);
* ``synthetic-1.1b-whole``: the 1.1B folder with ``calibration.layerwise: false`` - the whole graph, which is
  expected to be refused before any work (the row records the message and how long the refusal took).

    python eval/bench_memory_estimate.py --case smollm2-plain synthetic-1.1b

Rows go into ``eval/results/memory_estimate.json`` (one per case, replaced when a case runs again);
``python eval/render_results.py`` renders them into ``docs/results.md``.
"""

from __future__ import annotations

import argparse
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
CASES = ("smollm2-recipe", "smollm2-plain", "smollm2-whole", "synthetic-1.1b", "synthetic-1.1b-whole", "synthetic-7b")


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


def run_case(case: str, work: Path, keep: bool = False) -> dict[str, Any]:
    """Set up ``case`` in ``work``, run ``quantkit calibrate`` under the sampler, return its row."""
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
        if shape == "1.1b":
            args.append("--no-latency")
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
    }  # fmt: skip
    row["estimate_over_measured"] = round(row["estimated_GB"] / max(row["tree_peak_GB"], 1e-9) - 1, 3)
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
        lines.append(f"| {r['case']} | {(r['path'] or '').split(',')[0]} | {r['estimated_GB']:.2f} ({r['peak_phase']}) "
                     f"| {r['measured_GB']:.2f} / {r['tree_peak_GB']:.2f} | {100 * r['estimate_over_measured']:+.0f}% "
                     f"| {r['wall_s']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs="*", choices=CASES, default=[])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the output folders")
    args = ap.parse_args()
    from provenance import run_record

    from quantkit.report.build import environment

    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    rows: list[dict[str, Any]] = data if isinstance(data, list) else data.get("memory_estimate", [])
    for case in args.case:
        work = Path(tempfile.mkdtemp(prefix=f"bench-mem-{case}-", dir=args.workdir))
        try:
            row = run_case(case, work, keep=args.keep)
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
