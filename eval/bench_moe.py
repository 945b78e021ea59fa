"""Mixture-of-experts decoders: ONNX Runtime's QMoE kernel against the standard-op expert dispatch, same run.

A Hugging Face folder of random bf16 weights at the width of a published mixture of experts (``--case``: OLMoE-1B-7B,
64 experts of 1024, 8 per token; Qwen3-30B-A3B, 128 experts of 768, 8 per token; Mixtral-8x7B, 8 experts of 14336,
2 per token; gpt-oss-20b, 32 experts of 2880, 4 per token, clamped SwiGLU with biases; ``eval/bench_families.py``'s
configs, fewer layers) is quantized layer-wise with INT4 RTN (group 128; gpt-oss 32,
no calibration: the graphs differ, the weights do not), and the decoders are timed interleaved in one process
(:func:`quantkit.evaluate.decode.measure_decode` / ``measure_prefill``, 2 threads):

* ``fp32``: the float ``MoE`` kernel per block;
* ``int4 QMoE`` at ``accuracy_level`` 0 and 4: one ``QMoE`` node per block (what quantkit ships);
* ``int4 dispatch`` at level 0 and 4: the same packed weights through the standard-op dispatch (per expert
  ``NonZero`` / ``Gather`` / three ``MatMulNBits`` / ``ScatterND``), what quantkit writes when one node cannot hold
  the experts (the builder's QMoE choice switched off in this process);

plus the largest difference of each INT4 decoder's logits from the level-0 dispatch's on a 64-token prompt (the
kernel against the math, whole model). Random weights: the figures are speed and agreement, not quality.

    flock /tmp/quantkit-bench.lock python eval/bench_moe.py --case olmoe qwen3_moe

Writes ``eval/results/moe_<cpu class>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))
sys.path.insert(0, str(ROOT))

CASES = {"olmoe": 2, "qwen3_moe": 1, "mixtral": 1, "gpt_oss": 1}
GROUP = {"gpt_oss": 32}  # K = 2880: a multiple of 32 (its MXFP4 block), not of 128 (QMoE needs K % group == 0)
MIXTRAL = {"from": "mistralai/Mixtral-8x7B-v0.1 (width; 1 of its 32 layers)", "config": {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2,
    "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2}}  # fmt: skip


def _build(folder: Path, out: Path, level: int, fused: bool, group: int = 128) -> Path:
    from quantkit.frontends import llm_builder
    from quantkit.layerwise import quantize_llm_layerwise
    from quantkit.recipe import load_recipe
    from quantkit.recipe.plan import PrecisionPlan

    plan = PrecisionPlan.from_recipe(load_recipe({
        "version": 1, "model": {"source": str(folder)}, "calibration": {"layerwise": True},
        "quantization": {"default": {"format": "int4", "group_size": group, "algorithm": "rtn"}}}))  # fmt: skip
    keep = llm_builder._qmoe_weights
    if not fused:
        llm_builder._qmoe_weights = lambda *a, **k: None  # the standard-op dispatch, same packed weights
    try:
        res = quantize_llm_layerwise(folder, out / "model.onnx", plan, None, work_dir=out.parent / f"w-{out.name}",
                                     accuracy_level=level, progress=False)  # fmt: skip
    finally:
        llm_builder._qmoe_weights = keep
    return Path(res.path)


def run_case(case: str, work: Path) -> dict[str, Any]:
    import onnx
    from bench_families import _CHILD_GEN, FAMILIES, _child

    from quantkit.evaluate.decode import measure_decode, measure_prefill
    from quantkit.frontends.llm_builder import LLMSession, build_llm

    spec = MIXTRAL if case == "mixtral" else FAMILIES[case]
    layers = CASES[case]
    hf = work / "hf"
    hf.mkdir(parents=True)
    made = _child(_CHILD_GEN, str(hf), json.dumps(spec["config"]), str(layers))
    row: dict[str, Any] = {"case": case, "from": spec["from"], "layers": layers, "params": made.get("params"),
                           "group_size": GROUP.get(case, 128),
                           "load_start": [round(x, 2) for x in os.getloadavg()]}
    models: dict[str, Path] = {}
    t0 = time.perf_counter()
    models["fp32"] = build_llm(hf, work / "fp32" / "model.onnx")
    row["fp32_build_s"] = round(time.perf_counter() - t0, 1)
    for level in (0, 4):
        for fused in (True, False):
            name = f"int4 {'QMoE' if fused else 'dispatch'} level {level}"
            t0 = time.perf_counter()
            models[name] = _build(hf, work / f"q{level}{int(fused)}", level, fused, GROUP.get(case, 128))
            row[f"{name} build_s"] = round(time.perf_counter() - t0, 1)
            ops = [n.op_type for n in onnx.load(str(models[name]), load_external_data=False).graph.node]
            row[f"{name} ops"] = {k: ops.count(k) for k in ("QMoE", "MoE", "MatMulNBits", "NonZero", "ScatterND")}
    ids = np.random.default_rng(0).integers(3, 30000, (1, 64)).astype(np.int64)
    ref = LLMSession(models["int4 dispatch level 0"], threads=2)(ids)
    scale = float(np.abs(ref).max())
    row["logits_vs_dispatch_level0"] = {
        k: round(float(np.abs(LLMSession(p, threads=2)(ids) - ref).max()) / scale, 7)
        for k, p in models.items() if k.startswith("int4") and k != "int4 dispatch level 0"}  # fmt: skip
    dec = measure_decode({k: str(p) for k, p in models.items()}, past_len=128, threads=2, repeat=40, rounds=3)
    pre = measure_prefill({k: str(p) for k, p in models.items()}, seq_len=128, threads=2, repeat=10, rounds=3)
    row["decode_ms"] = {k: round(v.median_ms, 3) for k, v in dec.items()}
    row["prefill128_ms"] = {k: round(v.median_ms, 2) for k, v in pre.items()}
    row["load_end"] = [round(x, 2) for x in os.getloadavg()]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs="+", choices=sorted(CASES), default=["olmoe"])
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    from provenance import run_record

    from quantkit.report.build import environment
    from quantkit.scheme.target import detect_cpu

    results = ROOT / "eval" / "results" / f"moe_{detect_cpu().cpu_class}.json"
    data: dict[str, Any] = json.loads(results.read_text()) if results.is_file() else {}
    rows = [r for r in data.get("cases", []) if r["case"] not in args.case]
    for case in args.case:
        work = Path(tempfile.mkdtemp(prefix=f"bench-moe-{case}-", dir=args.workdir))
        try:
            row = {**run_case(case, work), "date": time.strftime("%Y-%m-%d %H:%M")}
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps(row), flush=True)
        rows.append(row)
        data["cases"] = rows
        rec = run_record()
        commands: list[str] = data.get("commands") or [str((data.get("environment") or {}).get("command", ""))]
        commands = [c for c in commands if c]
        if rec["command"] not in commands:
            commands.append(rec["command"])
        data["commands"] = commands  # every run the file holds rows of (each row has its own date and load)
        data["environment"] = {**environment(), **rec, "command": "; ".join(commands)}
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
