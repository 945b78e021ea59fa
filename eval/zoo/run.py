"""The conformance zoo: every model through quantkit's default recipe path and ONNX Runtime's
``quantize_static``, side by side, in one run.

For each model (``eval/zoo/zoo_models.py``: ONNX file + ``.npz`` calibration / evaluation crops):

* **quantkit** as a user runs it: ``quantkit calibrate --recipe r.yaml`` with a minimal recipe (the model,
  the calibration ``.npz``, the evaluation ``.npz``; every other key at its default, so the run measures
  its own latency and its latency guard may keep slow layers in float), in its own process: wall time and
  peak RSS are its own; the table also gives the calibrate + lower stages alone.
* **ORT** ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations, MinMax) with
  ``reduce_range`` off and on, each in its own process; the better of the two by output SQNR is ORT's row.
* For every model: the census of ONNX Runtime's optimized graph (quantized kernels / float GEMM-like ops
  left / stray Q-DQ inside the graph), output SQNR and top-1 agreement against FP32 on the evaluation
  crops (this CPU's fused kernels), kernel-vs-math (the same model at ``ORT_DISABLE_ALL``: SQNR of the
  fused output against the QDQ reference), and batch-1 latency of FP32 and every quantized model,
  interleaved in one process.

Usage::

    python eval/zoo/run.py --models ci                       # the CI subset
    python eval/zoo/run.py --models all --out eval/results/zoo_x86-vnni.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from zoo_models import ALL, CI_SUBSET, ENCODERS, HF_FOLDERS, PROBES, SEGMENTATION, SPEECH, build, cache_root  # noqa: E402

GEMM_OPS = {"Conv", "MatMul", "Gemm", "FusedConv", "FusedGemm", "FusedMatMul", "NhwcFusedConv"}


LAUNCHER = """
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss}, f)
"""


def _timed(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd``; wall seconds and its peak RSS (MiB).

    The peak comes from ``wait4`` in a small launcher process that starts ``cmd``: Linux counts in a child's
    ``ru_maxrss`` the resident memory of the process it was forked from (exec records the old address
    space's peak), so a command started by this driver - which holds sessions of every model it measured -
    would report the driver's peak (equal values across models).  Started from the launcher (~15 MiB), the
    figure is the command's own.  The wall time includes the launcher's start (~50 ms)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zoo-rss-") as tmp:
        stats = Path(tmp) / "rusage.json"
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", LAUNCHER, str(stats), *cmd], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, check=False)
        wall = time.perf_counter() - t
        got = json.loads(stats.read_text()) if stats.is_file() else {"rc": proc.returncode, "maxrss_kb": 0}
    return {"rc": got["rc"], "wall_s": wall, "peak_rss_mb": got["maxrss_kb"] / 1024 or None,
            "log_tail": proc.stdout[-1500:]}


ORT_WORKER = """
import os, sys, tempfile, numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
src, dst, cal, rr = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
data = np.load(cal)
names = list(data.files)
n = len(data[names[0]])
class R(CalibrationDataReader):
    def __init__(self):
        self.i = 0
    def get_next(self):
        if self.i >= n:
            return None
        self.i += 1
        return {k: data[k][self.i - 1 : self.i] for k in names}
with tempfile.TemporaryDirectory(prefix="zoo-ort-") as work:  # removed after (it was left behind in /tmp)
    os.chdir(work)  # its calibrator writes augmented models into the working directory
    quantize_static(src, dst, R(), quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, reduce_range=rr)
    os.chdir(os.path.dirname(os.path.abspath(dst)))
"""


def _recipe(folder: Path, paths: dict[str, Path], *, guard: bool = True, fidelity_guard: bool = True) -> Path:
    import yaml

    rec: dict[str, Any] = {"version": 1, "name": "zoo", "model": {"source": str(paths["model"])},
                           "calibration": {"data": {"kind": "npz", "path": str(paths["calibration"])}},
                           "evaluation": {"data": {"kind": "npz", "path": str(paths["evaluation"])}}}
    if "hf_folder" in paths:  # a Hugging Face folder and folders of photos / recordings: quantkit exports and
        rec["model"]["source"] = str(paths["hf_folder"])  # prepares the data with the folder's own processor
        for split in ("calibration", "evaluation"):
            audio = any(paths[f"{split}_data"].glob("*.wav"))
            rec[split]["data"] = ({"kind": "audio", "path": str(paths[f"{split}_data"]), "seconds": 1.0, "hop": 0.1}
                                  if audio else {"kind": "images", "path": str(paths[f"{split}_data"])})
    if not guard:
        rec["report"] = {"latency": {"guard": False}}
    if not fidelity_guard:
        rec["evaluation"]["fidelity_guard"] = False
    path = folder / ("recipe-int8.yaml" if not guard else "recipe-nofg.yaml" if not fidelity_guard else "recipe.yaml")
    path.write_text(yaml.safe_dump(rec))
    return path


def _feeds(npz: Path) -> list[dict[str, np.ndarray]]:
    data = np.load(npz)
    names = list(data.files)
    return [{k: data[k][i : i + 1] for k in names} for i in range(len(data[names[0]]))]


def _census(path: Path) -> dict[str, Any]:
    import onnx

    from quantkit.lowering.verify import census
    from quantkit.report.build import classify_leftovers, float_islands

    cen = census(onnx.load(str(path), load_external_data=False))
    # quantkit's classification, applied to every quantizer alike: a Q that feeds only fused kernels or a DQ
    # where an int8 chain hands over to float ops is needed; a DQ into an op that has no int8 kernel (LayerNorm,
    # an unfolded BatchNorm) whose result is quantized again enters a float island (counted apart, with the
    # op); "stray" is a float<->int8 round trip for nothing
    kinds = classify_leftovers(cen)
    stray = [d for d, k in kinds if k == "stray"]
    float_ops = sum(v for k, v in cen.op_counts.items() if k.split(".")[-1] in GEMM_OPS)
    islands = float_islands(cen)
    return {"fused": sum(cen.quantized_kernels.values()), "float_gemm": float_ops, "stray": len(stray),
            "qdq_inside": sum(1 for _, k in kinds if k != "boundary"),
            "float_islands": sum(1 for _, k in kinds if k == "float_island"),
            "island_ops": {op: v["count"] for op, v in islands.items()},
            "kernels": cen.quantized_kernels, "stray_nodes": stray[:5]}


def _fidelity(fp32: Any, q: Any, q_ref: Any, feeds: list[dict[str, np.ndarray]], classify: bool) -> dict[str, Any]:
    from quantkit.evaluate.metrics import sqnr_db

    ref, got, math = [], [], []
    for f in feeds:
        ref.append(fp32.run(None, f)[0])
        got.append(q.run(None, f)[0])
        math.append(q_ref.run(None, f)[0])
    r, g, m = (np.concatenate(a).astype(np.float64) for a in (ref, got, math))
    out = {"sqnr_db": sqnr_db(r, g), "kernel_vs_math_sqnr_db": sqnr_db(m, g), "qdq_math_sqnr_db": sqnr_db(r, m),
           # per evaluation sample: signal and error energy of the output against FP32 (the bootstrap interval)
           "per_sample": {"signal": [float(np.sum(x.astype(np.float64) ** 2)) for x in ref],
                          "noise": [float(np.sum((y.astype(np.float64) - x) ** 2)) for x, y in zip(ref, got, strict=True)]}}
    if classify:
        out["top1_agreement"] = float(np.mean(r.argmax(-1) == g.argmax(-1)))
        out["kernel_vs_math_top1"] = float(np.mean(m.argmax(-1) == g.argmax(-1)))
    return out


def _target_check(path: Path, isa: str, feeds: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Is the quantized model at ``path`` exact on CPU class ``isa`` for every input (its int8 weight pairs, as
    quantkit's report judges it)?  When not: the layers at risk, and the largest fraction of int32 accumulators
    the class's kernel gets wrong on the first evaluation samples (NumPy emulation of the saturating int16 pair
    sums on the QDQ reference's input codes) - its measured SQNR, this CPU's exact arithmetic, is then only an
    upper bound of what it computes on that class."""
    import onnx

    from quantkit.evaluate.latency import make_session
    from quantkit.lowering.kernel_check import emulate_saturation, portability, with_outputs

    model = onnx.load(str(path))
    table = portability(model)
    verdict = table["classes"][isa]
    out: dict[str, Any] = {"isa": isa, "exact": bool(verdict["exact"]), "why": verdict["why"],
                           "layers_at_risk": len(table["layers_at_risk"])}
    if verdict["exact"]:
        return out
    risky = {r["layer"] for r in table["layers_at_risk"]}
    producer = {o: n for n in model.graph.node for o in n.output}
    codes = sorted({producer[n.input[0]].input[0] for n in model.graph.node
                    if n.name in risky and n.input[0] in producer
                    and producer[n.input[0]].op_type == "DequantizeLinear"})
    sess = make_session(with_outputs(model, codes), level="disabled")
    names = [o.name for o in sess.get_outputs()]
    worst: dict[str, float] = {}
    for f in feeds[:4]:
        env = dict(zip(names, sess.run(None, f), strict=True))
        for k, v in emulate_saturation(model, env, risky).items():
            worst[k] = max(worst.get(k, 0.0), v)
    if worst:
        layer = max(worst, key=lambda k: worst[k])
        out["worst_wrong_accumulators"] = {"layer": layer, "fraction": round(worst[layer], 4),
                                           "samples": min(4, len(feeds))}
    return out


def run_model(name: str, work: Path, *, repeat: int, isa: str | None = None) -> dict[str, Any]:
    from quantkit.evaluate.latency import make_session

    paths = build(name)
    folder = work / (name if isa is None else f"{name}-{isa}")
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if isa is not None:  # quantkit builds for that class exactly as on such a CPU (its `isa: auto`)
        env["QUANTKIT_CPU_CLASS"] = isa
    models: dict[str, Path] = {"fp32": paths["model"]}
    row: dict[str, Any] = {"model": name, "methods": {}}
    qk_out = folder / "quantkit"
    # --no-cache: a first run, as ORT's quantizer always does one (a cached rerun skips calibration)
    r = _timed([sys.executable, "-m", "quantkit.cli", "calibrate", "-q", "--overwrite", "--no-cache", "--recipe",
                str(_recipe(folder, paths)), "--output", str(qk_out)], env)
    row["methods"]["quantkit"] = r
    if r["rc"] == 0:
        models["quantkit"] = qk_out / "model.onnx"
        rep = json.loads((qk_out / "report.json").read_text())
        r["stages_s"] = {k: round(v, 2) for k, v in rep.get("timings", {}).items()}
        guard = rep.get("latency_guard") or {}
        r["guard_decision"] = guard.get("decision")
        r["shipped_in_float"] = bool((guard.get("fallback") or {}).get("fp32_faster"))
        fg = rep.get("fidelity_guard") or {}
        r["fidelity_guard_decision"] = fg.get("decision")
        # the model it would have shipped with the latency guard off (it shipped float) or the fidelity guard off (it
        # put layers back in float), each in the same run: its quality against ORT's, its speed
        for key, wanted, recipe in (
                ("quantkit_int8", r["shipped_in_float"], lambda: _recipe(folder, paths, guard=False)),
                ("quantkit_nofg", bool(fg.get("float_layers")), lambda: _recipe(folder, paths, fidelity_guard=False))):
            if not wanted:
                continue
            out = folder / key.replace("quantkit_", "quantkit-")
            rv = _timed([sys.executable, "-m", "quantkit.cli", "calibrate", "-q", "--overwrite", "--no-cache",
                         "--recipe", str(recipe()), "--output", str(out)], env)
            row["methods"][key] = rv
            if rv["rc"] == 0:
                models[key] = out / "model.onnx"
    for rr in (False, True):
        key = "ort_rr" if rr else "ort"
        dst = folder / f"{key}.onnx"
        r = _timed([sys.executable, "-c", ORT_WORKER, str(paths["model"]), str(dst), str(paths["calibration"]),
                    "1" if rr else "0"], env)
        row["methods"][key] = r
        if r["rc"] == 0:
            models[key] = dst
    feeds = _feeds(paths["evaluation"])
    classify = name not in ENCODERS and name not in SEGMENTATION and name not in SPEECH
    fp32 = make_session(str(paths["model"]))
    for key, path in list(models.items()):
        if key == "fp32":
            continue
        m = row["methods"][key]
        m["census"] = _census(path)
        try:
            m.update(_fidelity(fp32, make_session(str(path)), make_session(str(path), level="disabled"), feeds,
                               classify))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a quantized model ONNX Runtime cannot run is that tool's result
            m["run_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            models.pop(key)
            continue
        if isa is not None:
            m["target_check"] = _target_check(path, isa, feeds)
    _time_row(row, models, feeds[0], repeat)
    orts = [k for k in ("ort", "ort_rr") if "sqnr_db" in row["methods"][k]]
    if orts:
        row["ort_best"] = max(orts, key=lambda k: row["methods"][k]["sqnr_db"])
        if "per_sample" in row["methods"]["quantkit"]:
            row["sqnr_diff_ci95"] = sqnr_diff_interval(row["methods"]["quantkit"]["per_sample"],
                                                       row["methods"][row["ort_best"]]["per_sample"])
        for key, field in (("quantkit_int8", "int8_sqnr_diff_ci95"), ("quantkit_nofg", "nofg_sqnr_diff_ci95")):
            if "per_sample" in row["methods"].get(key, {}):
                row[field] = sqnr_diff_interval(row["methods"][key]["per_sample"],
                                                row["methods"][row["ort_best"]]["per_sample"])
    return row


LATENCY_ROUNDS = 10
"""Interleaved rounds of the batch-1 timing (every model ``repeat / rounds`` runs per round): a stall of the machine
hits all models of a round alike (3 rounds let one stall decide a 2 ms model's median)."""


def _time_row(row: dict[str, Any], models: dict[str, Path], feed: dict[str, np.ndarray], repeat: int) -> None:
    """Batch-1 latency of FP32 and every quantized model, interleaved (:data:`LATENCY_ROUNDS`), into ``row``."""
    from quantkit.evaluate.latency import compare_latency, make_session

    sessions = {k: make_session(str(p)) for k, p in models.items()}
    lat = compare_latency(sessions, feed, warmup=max(3, repeat // 10), repeat=repeat, rounds=LATENCY_ROUNDS)
    fp32_ms = lat["fp32"].median_ms
    row["fp32_ms"] = fp32_ms
    for key in models:
        if key != "fp32":
            row["methods"][key]["ms"] = lat[key].median_ms
            row["methods"][key]["x_fp32"] = fp32_ms / lat[key].median_ms


def retime(path: Path, repeat: int) -> dict[str, Any]:
    """Re-time the models of an earlier ``--out`` JSON (kept under the zoo's runs folder), machine otherwise idle:
    every row's latency columns are replaced, the rest kept; ``environment.retimed`` says when and how."""
    data = json.loads(path.read_text())
    work = cache_root() / "runs"
    load0 = [round(x, 2) for x in os.getloadavg()]
    for row in data["rows"]:
        name = row["model"]
        paths = build(name)
        models = {"fp32": paths["model"]}
        for key in row["methods"]:
            p = work / name / ({"quantkit": "quantkit/model.onnx", "quantkit_int8": "quantkit-int8/model.onnx",
                                "quantkit_nofg": "quantkit-nofg/model.onnx"}
                               .get(key) or f"{key}.onnx")
            if row["methods"][key].get("rc") == 0 and p.is_file():
                models[key] = p
        print(f"== {name}: {', '.join(models)}", flush=True)
        _time_row(row, models, _feeds(paths["evaluation"])[0], repeat)
    data["environment"]["retimed"] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "repeat": repeat, "rounds": LATENCY_ROUNDS,
        "load_average_at_start": load0, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(["python", "eval/zoo/run.py", *sys.argv[1:]])}
    return data


def sqnr_diff_interval(a: dict[str, list[float]], b: dict[str, list[float]], *, resamples: int = 2000,
                       seed: int = 0) -> list[float]:
    """95% bootstrap interval of ``SQNR(a) - SQNR(b)`` (dB) over the evaluation samples, resampled together (the
    same images for both).  On random-weight networks the output SQNR of two equally good quantizations differs
    by up to ~1 dB with the draw of images and a 1e-4 change of the scales; a gap is a loss only when its
    interval lies below 0."""
    rng = np.random.default_rng(seed)
    sa, na = np.asarray(a["signal"]), np.asarray(a["noise"])
    nb = np.asarray(b["noise"])
    idx = rng.integers(0, sa.size, size=(resamples, sa.size))
    sig = sa[idx].sum(1)
    diff = 10 * np.log10(sig / np.maximum(na[idx].sum(1), 1e-300)) - 10 * np.log10(sig / np.maximum(nb[idx].sum(1),
                                                                                                     1e-300))
    return [round(float(np.percentile(diff, 2.5)), 2), round(float(np.percentile(diff, 97.5)), 2)]


def _env() -> dict[str, Any]:
    import onnxruntime as ort

    from quantkit.scheme.target import detect_cpu

    info = detect_cpu()
    return {"cpu": info.model_name, "cpu_class": info.cpu_class, "onnxruntime": ort.__version__,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "cores": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "peak_rss": "per process (wait4 in a launcher)",
            "command": " ".join(["python", "eval/zoo/run.py", *sys.argv[1:]])}


def _islands(c: dict[str, Any]) -> str:
    """`` (n: op xk, ...)``: the DQs entering float islands (ops with no int8 kernel), empty when none."""
    ops = c.get("island_ops") or {}
    return f" ({c['float_islands']}: " + ", ".join(f"{k} x{v}" for k, v in ops.items()) + ")" if ops else ""


# quantkit's in-process stages (report.json "timings") that check, evaluate and measure the model it built: the rest
# of its wall time (process start and imports, load, prepare, calibrate + lower, saving) is the quantization
EVALUATION_STAGES = ("verify_s", "kernel_check_s", "evaluate_s", "latency_s", "latency_guard_s", "fidelity_guard_s")


def time_split(q: dict[str, Any], export: bool = False) -> dict[str, float] | None:
    """quantkit's wall time split into ``quantize_s`` (wall minus the evaluation stages: what ORT's
    ``quantize_static`` process does - start, load, calibrate, write the QDQ model) and ``evaluate_s`` (the
    evaluation stages: census, kernel check, fidelity, latency, latency guard); None without stage timings.
    ``export``: quantkit was given a Hugging Face folder (ORT the graph exported from it): its load stage, the
    export, is ``export_s`` and not part of ``quantize_s``."""
    st = q.get("stages_s") or {}
    if not st or not q.get("wall_s"):
        return None
    ev = sum(float(st.get(k, 0.0)) for k in EVALUATION_STAGES)
    xs = float(st.get("load_s", 0.0)) if export else 0.0
    return {"quantize_s": q["wall_s"] - ev - xs, "evaluate_s": ev, **({"export_s": xs} if export else {})}


def _in_float(q: dict[str, Any]) -> bool:
    """quantkit's latency guard shipped every layer in float (FP32 beat its best int8 model in an A/B)."""
    return bool(q.get("shipped_in_float"))


def _ci(ci: Any) -> str:
    return f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if isinstance(ci, list) and len(ci) == 2 else ""


def _table(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    rt = env.get("retimed") or {}
    lines = [f"CPU: {env['cpu']} ({env['cpu_class']}), {env['cores']} cores; onnxruntime {env['onnxruntime']}; "
             f"{env['date']}; `{env['command']}`" + (f" {env['note']}" if env.get("note") else "")
             + (f"; load average {env['load_average_at_start']} at start, {env['load_average_at_end']} at end"
                if env.get("load_average_at_start") and env.get("load_average_at_end") else "")
             + (f"; latency columns re-timed {rt['date']} (`{rt['command']}`, {rt['repeat']} runs per model in "
                f"{rt['rounds']} interleaved rounds, load average {rt['load_average_at_start']} at start, "
                f"{rt['load_average_at_end']} at end)" if rt else ""), "",
             "| model | quantkit fused/float/stray (float islands) | ORT | SQNR dB qk / ORT [qk - ORT, 95% CI] "
             "| top-1 qk / ORT | kernel-vs-math dB qk / ORT "
             "| x FP32 qk / ORT | x ORT | quantize s qk / ORT (x ORT) | qk evaluation s (x ORT) | wall s qk (x ORT) "
             "| peak RSS MiB qk / ORT |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    isa = env.get("isa")
    if isa:
        lines[0] += (f"; **quantkit built for `{isa}`** (`QUANTKIT_CPU_CLASS={isa}`, what `isa: auto` does on such a "
                     f"CPU), every model measured on this {env['cpu_class']} CPU")
        lines[2] = lines[2].replace("| top-1", f"| exact on {isa} qk / ORT | top-1")
        lines[3] += "---|"

    def f(v: Any, fmt: str = ".1f") -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    def exact(m: dict[str, Any]) -> str:
        t = m.get("target_check")
        if not t:
            return "-"
        if t["exact"]:
            return "yes"
        w = t.get("worst_wrong_accumulators")
        return f"no ({t['layers_at_risk']} layers" + (f", up to {w['fraction']:.1%} wrong" if w else "") + ")"

    def sq(m: dict[str, Any]) -> str:  # a model not exact on the target class: its figure here is an upper bound
        t = m.get("target_check")
        return ("<= " if t and not t["exact"] else "") + f(m.get("sqnr_db"))

    def x(a: Any, b: Any) -> str:
        return f(a / b, ".2f") if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"

    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['model']} | not built: {row['error']} |" + " |" * (len(lines[3].split("|")) - 4))
            continue
        q = row["methods"].get("quantkit", {})
        o = row["methods"].get(row.get("ort_best", "ort"), {})
        c = q.get("census", {})
        co = o.get("census", {})
        ort_cell = f"{co.get('fused', '-')}/{co.get('float_gemm', '-')}/{co.get('stray', '-')} ({row.get('ort_best', '-')})"
        if "ort_best" not in row and o.get("run_error"):  # neither of ORT's models runs
            ort_cell = f"its models fail in ONNX Runtime ({o['run_error'].split('Status Message: ')[-1][:110]})"
        sp = time_split(q, export=row["model"] in HF_FOLDERS) or {}
        qs, es, ow = sp.get("quantize_s"), sp.get("evaluate_s"), o.get("wall_s")
        xs = f" (+{f(sp['export_s'])} export)" if "export_s" in sp else ""
        lines.append(
            f"| {row['model']} | {c.get('fused', '-')}/{c.get('float_gemm', '-')}/{c.get('stray', '-')}{_islands(c)}"
            f"{' **float: no int8 layout faster than FP32 (guard)**' if _in_float(q) else ''} "
            f"| {ort_cell} "
            f"| {sq(q)} / {sq(o)}{_ci(row.get('sqnr_diff_ci95'))} "
            + (f"| {exact(q)} / {exact(o)} " if isa else "")
            + f"| {f(q.get('top1_agreement'), '.2f')} / {f(o.get('top1_agreement'), '.2f')} "
            f"| {f(q.get('kernel_vs_math_sqnr_db'))} / {f(o.get('kernel_vs_math_sqnr_db'))} "
            f"| {f(q.get('x_fp32'), '.2f')} / {f(o.get('x_fp32'), '.2f')} "
            f"| {x(q.get('x_fp32'), o.get('x_fp32'))} "
            f"| {f(qs)}{xs} / {f(ow)} ({x(qs, ow)}) "
            f"| {f(es)} ({x(es, ow)}) "
            f"| {f(q.get('wall_s'))} ({x(q.get('wall_s'), ow)}) "
            f"| {f(q.get('peak_rss_mb'), '.0f')} / {f(o.get('peak_rss_mb'), '.0f')} |")
        for key, label, ci in (("quantkit_int8", "int8 (guard off)", "int8_sqnr_diff_ci95"),
                               ("quantkit_nofg", "fidelity guard off", "nofg_sqnr_diff_ci95")):
            q8 = row["methods"].get(key)
            if not q8 or not q8.get("census"):
                continue
            c8 = q8["census"]
            lines.append(
                f"| {row['model']} {label} | {c8.get('fused', '-')}/{c8.get('float_gemm', '-')}/"
                f"{c8.get('stray', '-')}{_islands(c8)} | | {sq(q8)} / {sq(o)}{_ci(row.get(ci))} "
                + ("| | " if isa else "")
                + f"| {f(q8.get('top1_agreement'), '.2f')} / {f(o.get('top1_agreement'), '.2f')} "
                f"| {f(q8.get('kernel_vs_math_sqnr_db'))} / {f(o.get('kernel_vs_math_sqnr_db'))} "
                f"| {f(q8.get('x_fp32'), '.2f')} / {f(o.get('x_fp32'), '.2f')} | {x(q8.get('x_fp32'), o.get('x_fp32'))} "
                f"| | | | {f(q8.get('peak_rss_mb'), '.0f')} / {f(o.get('peak_rss_mb'), '.0f')} |")
    lines += ["", "Times are each tool's own process, wall clock. *quantize*: quantkit's wall time minus its evaluation "
              "stages (process start, load, prepare, calibrate + lower, writing the model), against the wall time of "
              "ORT's `quantize_static` process (the better setting's); *evaluation*: quantkit's " +
              ", ".join(f"`{k}`" for k in EVALUATION_STAGES) + " (report.json `timings`; ORT does none of it). "
              + ("*hf_* rows* (a Hugging Face folder, as a user brings it): quantkit exports the folder itself, ORT is "
                 "given that exported graph and the same pixels / features as `.npz`; quantkit's export (its `load_s`) "
                 "is shown apart, `(+N export)`, and is not in its quantize time. "
                 if any(r["model"] in HF_FOLDERS for r in rows) else "") +
              "SQNR interval: 95% bootstrap interval of quantkit's minus ORT's output SQNR over the evaluation samples "
              "(2000 resamples, the same images for both; a gap is a loss only when the interval lies below 0). "
              "*float (guard)*: quantkit's latency guard found FP32 faster than every int8 model it tried on this CPU "
              "and shipped the model unquantized (its SQNR is then FP32's own; ORT's row is its int8 model); the "
              "row below it, *int8 (guard off)*, is the int8 model quantkit builds with `report: {latency: {guard: "
              "false}}`, in the same run; *fidelity guard off*: where quantkit's fidelity guard shipped layers in "
              "float (an output below 20 dB SQNR, repaired by measurement), the model it builds with `evaluation: "
              "{fidelity_guard: false}`, in the same run (the guard's re-runs - lowering from the calibrated ranges, "
              "kernel check, evaluation, latency - are under evaluation, as the latency guard's are). "
              + (f"*exact on {isa}*: whether the model's int8 weight pairs keep the {isa} kernels' saturating int16 pair "
                 "sums exact for every input (quantkit's portability check); when not, the layers at risk and the "
                 "largest fraction of a layer's int32 accumulators that kernel gets wrong on 4 evaluation samples "
                 "(NumPy emulation), and the SQNR measured here (exact int32 arithmetic) is only an upper bound "
                 "(`<=`) of that model's on such a CPU; ORT's row is its better setting by that bound. Latency and "
                 "kernel-vs-math columns are this CPU's. " if isa else "")
              + ("Peak RSS: each process's own `ru_maxrss`, from `wait4` in a small launcher."
                 if env.get("peak_rss") else
                 "Peak RSS in this file is **not** per process (measured before the launcher: a child's `ru_maxrss` "
                 "then included the driver's resident memory; repeated values are the driver's peak).")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="ci", help=f"ci, all, or a comma list of: {', '.join((*ALL, *PROBES))}")
    ap.add_argument("--repeat", type=int, default=60, help="latency runs per model (interleaved rounds)")
    ap.add_argument("--out", help="write the rows and the environment as JSON here (and a .md beside it)")
    ap.add_argument("--table", help="print (and with --out rewrite) the table of an earlier --out JSON; no runs")
    ap.add_argument("--isa", choices=("x86-avx2", "x86-vnni", "arm64"),
                    help="build quantkit's models for this CPU class (QUANTKIT_CPU_CLASS) and check every quantized "
                         "model's exactness there; the figures are still measured on this CPU")
    ap.add_argument("--retime", help="re-time the models of an earlier --out JSON in place (latency columns only)")
    args = ap.parse_args()
    if args.retime:
        data = retime(Path(args.retime), args.repeat)
        Path(args.retime).write_text(json.dumps(data, indent=1))
        text = _table(data["rows"], data["environment"])
        Path(args.retime).with_suffix(".md").write_text(text + "\n")
        print(text)
        return
    if args.table:
        data = json.loads(Path(args.table).read_text())
        text = _table(data["rows"], data["environment"])
        print(text)
        if args.out:
            Path(args.out).with_suffix(".md").write_text(text + "\n")
        return
    names = CI_SUBSET if args.models == "ci" else ALL if args.models == "all" else tuple(args.models.split(","))
    work = cache_root() / "runs"
    env = _env()
    if args.isa:
        env["isa"] = args.isa
    rows = []
    for n in names:
        print(f"== {n}", flush=True)
        try:
            rows.append(run_model(n, work, repeat=args.repeat, isa=args.isa))
        except Exception as exc:  # noqa: BLE001 - a model that cannot be built (its exporter) is a row, not the end
            import traceback

            traceback.print_exc()
            rows.append({"model": n, "methods": {}, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"})
        print(_table(rows[-1:], env).splitlines()[4], flush=True)  # the model's row
        if args.out:  # after every model, beside the output: a run cut short keeps what it measured
            Path(args.out).with_suffix(".partial.json").write_text(
                json.dumps({"environment": {**env, "partial": True}, "rows": rows}, indent=1))
    text = _table(rows, env)
    print(text)
    env["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
        out.with_suffix(".partial.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
