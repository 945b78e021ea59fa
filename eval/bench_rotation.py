"""The randomized Hadamard rotation (``quantization.rotation: hadamard``) on SmolLM2-135M: exact in FP32, and its
effect on INT4 weight-only quantization, with and without.

Usage::

    python eval/bench_rotation.py                       # FP32 exactness + the four INT4 runs below
    python eval/bench_rotation.py --runs rtn,rtn+hadamard --skip-exactness
    python eval/bench_rotation.py --runs rtn+hadamard@1 --skip-exactness    # another seed of the signs
    python eval/bench_rotation.py --runs "" --skip-exactness --online rtn    # time an online Hadamard

* **exactness**: the FP32 decoder built with the rotation vs the one built without it (the cached FP32 baseline),
  on windows of *Emma*: max |logit difference|, greedy-token agreement, perplexity of both;
* **runs**: ``quantkit calibrate`` on ``recipes/llama-int4.yaml`` (SignRound, groups of 128, GPTQ lm_head,
  calibrated on *Pride and Prejudice* + Python docs) and on the same recipe with plain RTN everywhere (no
  override: a tied table stays one shared 4-bit table without the rotation), each ``none`` and ``hadamard``;
  one process per run, one after the other.  Perplexity on *Emma* (the recipe's evaluation), Python docs and
  *Northanger Abbey* (added here: a third held-out text that neither calibration nor the recipe's evaluation
  touches), FP32 and INT4; size vs FP32; the run's wall time and the machine's load before and after it.

* **online** (``--online RUN``): decode and prefill time of RUN's model as built, with an online Hadamard transform
  of every down_proj's input inserted in Kronecker form, and as one dense MatMul (timing only: the weights are not
  changed to match), interleaved.

Results accumulate: a run already in the file is replaced, the others kept (``--work`` keeps the output folders;
``--refresh`` re-reads them).  Writes ``eval/results/int4_rotation_<cpu class>.json`` (``--out``); ``python eval/render_results.py`` renders it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
RECIPE = ROOT / "recipes" / "llama-int4.yaml"
NORTHANGER = {"kind": "text", "source": "austen:northangerabbey", "mode": "windows", "seq_len": 512, "count": 8,
              "seed": 0}  # fmt: skip
RUNS = ("rtn", "rtn+hadamard", "recipe", "recipe+hadamard")


def _load() -> list[float]:
    return [round(float(x), 2) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _parse(run: str) -> tuple[str, str, int]:
    """``rtn`` / ``recipe``, ``+hadamard`` or not, ``@seed`` (default 0): ``(base, rotation, seed)``."""
    head, _, seed = run.partition("@")
    base, _, rot = head.partition("+")
    if base not in ("rtn", "recipe") or rot not in ("", "hadamard") or (seed and (not rot or not seed.isdigit())):
        raise SystemExit(f"unknown run {run!r}; allowed: {', '.join(RUNS)}, a rotated one with @<seed>")
    return base, rot or "none", int(seed or 0)


def _recipe(run: str) -> dict[str, Any]:
    rec = copy.deepcopy(yaml.safe_load(RECIPE.read_text()))
    base, rot, seed = _parse(run)
    rec["name"] = f"rotation-{run.replace('+', '-').replace('@', '-seed')}"
    q = rec["quantization"]
    if base == "rtn":
        q["default"]["algorithm"], q["default"]["algorithm_options"] = "rtn", {}
        q["overrides"] = []
    q["rotation"] = rot
    q["rotation_seed"] = seed
    rec["evaluation"]["extra"] = [*rec["evaluation"].get("extra", []), NORTHANGER]
    return rec


def _order(row: dict[str, Any]) -> tuple[int, int, int]:
    base, rot, seed = _parse(row["run"])
    return (base == "recipe", rot != "none", seed)


def _run(run: str, work: Path) -> dict[str, Any]:
    rec_path = work / f"{run}.yaml"
    rec_path.write_text(yaml.safe_dump(_recipe(run), sort_keys=False))
    out = work / run
    cli = Path(sys.executable).with_name("quantkit")
    cmd = [str(cli), "calibrate", "--recipe", str(rec_path), "--output", str(out), "--overwrite"]
    load0, t0 = _load(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{run}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return {**_row(run, out), "wall_s": round(wall, 1), "load_before": load0, "load_after": _load(),
            "command": " ".join(["quantkit", *cmd[1:]]), "date": time.strftime("%Y-%m-%d %H:%M")}


def _row(run: str, out: Path) -> dict[str, Any]:
    """What a run's ``report.json`` (in ``out``) says: perplexities, size, latency, the rotation, the W4A8 check."""
    rep = json.loads((out / "report.json").read_text())
    q = rep.get("quality", {})
    ppl = {"emma": {"fp32": q["perplexity_fp32"]["ppl"], "quantized": q["perplexity_quantized"]["ppl"]}}
    for label, row in (q.get("perplexity_extra") or {}).items():
        name = label.split(":")[-1]
        ppl[name] = {"fp32": row["fp32"]["ppl"], "quantized": row["quantized"]["ppl"]}
    lat = rep.get("latency") or {}
    base, rot, seed = _parse(run)
    return {
        "run": run, "algorithm": "SignRound + GPTQ lm_head" if base == "recipe" else "RTN",
        "rotation": rot, "seed": seed if rot != "none" else None,
        "perplexity": ppl, "size_ratio": rep["size"]["ratio"], "quantized_bytes": rep["size"]["quantized_bytes"],
        "quantize_s": round(float(rep["timings"].get("quantize_s", 0.0)), 1),
        "latency_x_fp32": {k: v.get("speedup") for k, v in lat.items() if isinstance(v, dict) and "speedup" in v},
        "latency_ms": {k: {"fp32": v.get("fp32_ms"), "quantized": v.get("quantized_ms")} for k, v in lat.items()
                       if isinstance(v, dict) and "quantized_ms" in v},
        "w4a8_max_added_error": (rep.get("w4a8_check") or {}).get("max_added_error"),
        "rotation_note": (rep.get("notes") or {}).get("rotation"),
        "output_sqnr_db": _by_kind(rep.get("layers") or [], "output_sqnr_db"),
        "weight_rel_error": _by_kind(rep.get("layers") or [], "weight_rel_error"),
        "recipe": {k: v for k, v in rep["settings"]["quantization"].items()
                   if k in ("default", "overrides", "rotation", "rotation_seed")},
    }  # fmt: skip


def _by_kind(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Mean of ``key`` over the report's layer rows, by kind (``q_proj`` ... ``down_proj``, ``lm_head``, the
    embedding)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if isinstance(r.get(key), (int, float)):
            by.setdefault(str(r["layer"]).rsplit(".", 1)[-1], []).append(float(r[key]))
    return {k: round(float(np.mean(v)), 4) for k, v in by.items()}


def exactness(seed: int, windows: int, work: Path) -> dict[str, Any]:
    """The FP32 decoder built with the rotation vs without, on ``windows`` x 512 tokens of Emma."""
    from transformers import AutoTokenizer

    from quantkit.algorithms.rotation import HadamardRotation
    from quantkit.data.text import load_text
    from quantkit.frontends.llm import built_decoder_path
    from quantkit.frontends.llm_builder import LLMSession, build_llm, read_decoder_config
    from quantkit.llm_run import resolve_llm_folder

    folder = resolve_llm_folder("smollm2-135m")
    plain = built_decoder_path(folder)
    rot = HadamardRotation(read_decoder_config(folder), seed)
    t0 = time.perf_counter()
    rotated = build_llm(folder, work / "fp32-hadamard" / "model.onnx", transform=rot, genai_config=False)
    build_s = time.perf_counter() - t0
    ids = np.asarray(AutoTokenizer.from_pretrained(str(folder))(load_text("austen:emma"))["input_ids"], np.int64)
    ids = ids[: windows * 512].reshape(windows, 512)
    # the float32 floor: the same checkpoint in float64 (transformers, eager attention) is the exact logits; the
    # unrotated FP32 graph and transformers' own FP32 forward differ from them by float32 rounding alone, so the
    # rotated graph is as exact as float32 allows when its distance to them is of the same size
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float64, attn_implementation="eager")
    hf.eval()
    diff, agree, nll = 0.0, 0, {"plain": 0.0, "rotated": 0.0}
    to64 = {"plain": 0.0, "rotated": 0.0, "transformers_fp32": 0.0}
    scale = 0.0
    for w in ids:
        out = {}
        for name, path in (("plain", plain), ("rotated", rotated)):
            lg = LLMSession(path)(w[None])[0].astype(np.float64)
            out[name] = lg
            m = lg[:-1].max(-1, keepdims=True)
            logp = lg[:-1] - m - np.log(np.exp(lg[:-1] - m).sum(-1, keepdims=True))
            nll[name] += float(-logp[np.arange(511), w[1:]].sum())
        with torch.no_grad():
            exact = hf(torch.from_numpy(w[None])).logits[0].numpy()
            hf.float()
            out["transformers_fp32"] = hf(torch.from_numpy(w[None])).logits[0].double().numpy()
            hf.double()
        for k in to64:
            to64[k] = max(to64[k], float(np.abs(out[k] - exact).max()))
        diff = max(diff, float(np.abs(out["plain"] - out["rotated"]).max()))
        scale = max(scale, float(np.abs(out["plain"]).max()))
        agree += int((out["plain"].argmax(-1) == out["rotated"].argmax(-1)).sum())
    n = windows * 511
    return {"tokens": int(ids.size), "max_abs_logit_diff": diff, "max_abs_logit": scale,
            "max_abs_logit_diff_to_float64": to64,
            "float64_note": ("each FP32 model's max |logit - exact| on the same tokens, exact = the checkpoint's "
                             "forward in float64 (transformers, eager attention): plain and rotated are the ONNX "
                             "graphs quantkit builds, transformers_fp32 the same checkpoint's forward in float32"),
            "greedy_agreement": agree / (windows * 512), "build_s": round(build_s, 1),
            "perplexity": {k: float(np.exp(v / n)) for k, v in nll.items()}, "rotation_note": rot.describe()}  # fmt: skip


def _with_online_rotation(model: Path, out: Path, dense: bool) -> Path:
    """``model`` with an online Hadamard transform of every down_proj's input (``[.., I]``) inserted - for timing
    only: the down_proj weights are not rotated to match, so the logits are not the model's.  ``dense``: one
    ``[I, I]`` float32 MatMul; else the Kronecker form ``I = a x b``: Reshape ``[.., a, b]``, MatMul by ``H_b``,
    MatMul of ``H_a`` from the left, Reshape back (``(a + b) I`` multiply-adds instead of ``I²``)."""
    import onnx
    from onnx import helper, numpy_helper

    from quantkit.algorithms.rotation import _factors, hadamard, random_hadamard

    m = onnx.load(str(model), load_external_data=False)
    g = m.graph
    nodes = list(g.node)
    new_nodes, inits = [], []
    for nd in nodes:
        if nd.op_type == "MatMulNBits" and nd.name.endswith("mlp.down_proj"):
            k = next(a.i for a in nd.attribute if a.name == "K")
            x, p = nd.input[0], nd.name + "/online_hadamard"
            if dense:
                q = random_hadamard(k, np.random.default_rng(0))[0].astype(np.float32)
                inits.append(numpy_helper.from_array(q, p + ".H"))
                new_nodes.append(helper.make_node("MatMul", [x, p + ".H"], [p + "/out"], name=p))
            else:
                fs = _factors(k)
                assert fs is not None and len(fs) == 2, fs
                a, b = fs
                ha = (hadamard(a)[0] / np.sqrt(a)).astype(np.float32)
                hb = (hadamard(b)[0] / np.sqrt(b)).astype(np.float32)
                inits += [numpy_helper.from_array(ha, p + ".Ha"), numpy_helper.from_array(hb, p + ".Hb"),
                          numpy_helper.from_array(np.array([0, 0, a, b], np.int64), p + ".shape4"),
                          numpy_helper.from_array(np.array([0, 0, k], np.int64), p + ".shape3")]
                new_nodes += [helper.make_node("Reshape", [x, p + ".shape4"], [p + "/r"], name=p + "/Reshape"),
                              helper.make_node("MatMul", [p + "/r", p + ".Hb"], [p + "/b"], name=p + "/MatMul_b"),
                              helper.make_node("MatMul", [p + ".Ha", p + "/b"], [p + "/a"], name=p + "/MatMul_a"),
                              helper.make_node("Reshape", [p + "/a", p + ".shape3"], [p + "/out"],
                                               name=p + "/Reshape_1")]  # fmt: skip
            nd.input[0] = p + "/out"
        new_nodes.append(nd)
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(inits)
    out.write_bytes(m.SerializeToString())
    return out


def online_cost(model: Path, rounds: int, tokens: int = 32, prompt: int = 128) -> dict[str, Any]:
    """Median ms per decoded token (and a ``prompt``-token prefill) of ``model`` as it is, with a Kronecker online
    Hadamard before every down_proj, and with a dense one; the three interleaved, ``rounds`` times."""
    from quantkit.frontends.llm_builder import LLMSession

    paths = {"as built": model,
             "online Hadamard (Kronecker, 4 ops)": _with_online_rotation(model, model.with_name("online_kron.onnx"), False),
             "online Hadamard (dense MatMul)": _with_online_rotation(model, model.with_name("online_dense.onnx"), True)}
    sessions = {k: LLMSession(p, threads=2) for k, p in paths.items()}
    ids = np.random.default_rng(0).integers(10, 40000, (1, prompt + tokens)).astype(np.int64)
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in paths}
    for _ in range(rounds):
        for k, sess in sessions.items():
            sess.reset()
            t0 = time.perf_counter()
            sess(ids[:, :prompt])
            times[k]["prefill"].append((time.perf_counter() - t0) * 1e3)
            for t in range(prompt, prompt + tokens):
                t0 = time.perf_counter()
                sess(ids[:, t : t + 1])
                times[k]["decode"].append((time.perf_counter() - t0) * 1e3)
    return {k: {"prefill_ms": round(float(np.median(v["prefill"])), 2), "decode_ms": round(float(np.median(v["decode"])), 3)}
            for k, v in times.items()} | {"rounds": rounds, "tokens": tokens, "prompt": prompt, "threads": 2,
                                           "load": _load(), "model": model.parent.name}  # fmt: skip


def main() -> None:
    from provenance import run_record

    from quantkit.report.build import environment

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}; a rotated one may end in @<seed> (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="the FP32 exactness check's rotation_seed (runs: <run>@<seed>)")
    ap.add_argument("--windows", type=int, default=2, help="512-token windows of Emma for the FP32 exactness check")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--online", default="", help="time an online Hadamard before down_proj in this run's model")
    ap.add_argument("--rounds", type=int, default=5, help="--online: interleaved rounds")
    ap.add_argument("--refresh", action="store_true",
                    help="re-read the recorded runs' report.json from --work (no run; wall time and load kept)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="where the runs' output folders go (default: a temp dir)")
    args = ap.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    for r in runs:
        _parse(r)
    env = {**environment(), **run_record(), "load_at_start": _load()}
    out = args.out or ROOT / "eval" / "results" / f"int4_rotation_{env['cpu_class']}.json"
    work = args.work or Path(tempfile.mkdtemp(prefix="quantkit-rotation-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    result["environment"] = env
    if not args.skip_exactness:
        result["fp32_exactness"] = {**exactness(args.seed, args.windows, work), "command": env["command"],
                                    "date": env["date"]}
        print(json.dumps(result["fp32_exactness"], indent=1), flush=True)
    if args.online:
        result["online_rotation_cost"] = {**online_cost(work / args.online / "model.onnx", args.rounds),
                                          "command": env["command"], "date": env["date"]}
        print(json.dumps(result["online_rotation_cost"], indent=1), flush=True)
    rows = {r["run"]: r for r in result.get("runs", [])}
    if args.refresh:
        rows = {k: {**r, **_row(k, work / k)} for k, r in rows.items()}
        result["runs"] = sorted(rows.values(), key=_order)
    for run in runs:
        rows[run] = _run(run, work)
        print(json.dumps(rows[run]), flush=True)
        result["runs"] = sorted(rows.values(), key=_order)
        result["environment"]["load_at_end"] = _load()
        _provenance(result)
        out.write_text(json.dumps(result, indent=1) + "\n")
    _provenance(result)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def _provenance(result: dict[str, Any]) -> None:
    """The file's ``environment.command``: every command its parts record (the exactness check, the online timing,
    each run's ``quantkit calibrate``), as they were run - parts accumulate over several invocations."""
    parts = [result.get("fp32_exactness", {}).get("command"), result.get("online_rotation_cost", {}).get("command"),
             *(r.get("command") for r in result.get("runs", []))]  # fmt: skip
    seen = [c for i, c in enumerate(parts) if c and c not in parts[:i]]
    result["environment"]["command"] = "; ".join(seen)


if __name__ == "__main__":
    main()
