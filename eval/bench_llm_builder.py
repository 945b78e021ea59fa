"""Benchmark of the streaming LLaMA builder (quantkit.frontends.llm_builder).

(a) SmolLM2-135M (real weights): logits of the built FP32 graph vs transformers on a real
    sentence (full prefill, and prefill + token-by-token decode through the KV cache); then,
    interleaved in the same run, prefill latency at 128 tokens and per-token generation cost
    for 64 tokens after a 128-token prompt of

    * the built graph (GroupQueryAttention + KV cache: one token per step), and
    * the existing torch-exported full-sequence graph (``load_model("smollm2-135m")``), which
      has no cache: generating token t means a forward over all 128 + t tokens.

(b) synthetic LLaMA-shaped folders with random bf16 weights written as sharded safetensors
    (1.1B shape: hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab 32000; 11 and 22
    layers; ``--shape 7b`` for hidden 4096 / 32 layers): the build runs in a child process that
    reports its peak RSS (``VmHWM``; ``ru_maxrss`` would inherit the parent's), wall time and the bytes written.  A peak
    RSS that does not grow with the layer count is the streaming property.

    python eval/bench_llm_builder.py                  # both parts, writes eval/results/llm_builder.md
    python eval/bench_llm_builder.py --part synthetic --layers 11 22 --shape 1.1b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "num_hidden_layers": 22,
             "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000, "num_hidden_layers": 32,
           "max_position_embeddings": 4096, "tie_word_embeddings": False},
}  # fmt: skip
SENTENCE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife."
)


# --------------------------------------------------------------------------- (a) SmolLM2


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def bench_smollm2(
    work: Path, *, threads: int, rounds: int, prompt_len: int, new_tokens: int
) -> dict[str, Any]:
    import onnx_ir as ir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.frontends import load_model
    from quantkit.frontends.llm import smollm2_folder
    from quantkit.frontends.llm_builder import LLMSession, build_llm

    folder = smollm2_folder()
    t0 = time.perf_counter()
    built = build_llm(folder, work / "smollm2-built" / "model.onnx")
    build_s = time.perf_counter() - t0
    old = work / "smollm2-torch" / "model.onnx"
    old.parent.mkdir(parents=True, exist_ok=True)
    ir.save(load_model("smollm2-135m").model, old, external_data="model.onnx.data")

    # --- fidelity on a real sentence
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = np.asarray([tok(SENTENCE)["input_ids"]], np.int64)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    del hf
    sess = LLMSession(built, threads=threads)
    full = sess(ids)
    sess.reset()
    half = ids.shape[1] // 2
    parts = [sess(ids[:, :half])] + [sess(ids[:, t : t + 1]) for t in range(half, ids.shape[1])]
    stepwise = np.concatenate(parts, axis=1)
    old_s = _session(old, threads)
    old_logits = old_s.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    fid = {
        "tokens": int(ids.shape[1]),
        "max_abs_logit": float(np.abs(ref).max()),
        "built_prefill_max_abs_diff": float(np.abs(full - ref).max()),
        "built_kv_decode_max_abs_diff": float(np.abs(stepwise - ref).max()),
        "torch_graph_max_abs_diff": float(np.abs(old_logits - ref).max()),
        "argmax_agree_built": float((full.argmax(-1) == ref.argmax(-1)).mean()),
    }

    # --- latency, interleaved: prefill 1 x prompt_len; generation of new_tokens after it
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, (1, prompt_len), dtype=np.int64)
    tokens = rng.integers(3, 1000, (1, new_tokens), dtype=np.int64)  # fixed "generated" ids
    built_s = sess

    def built_prefill() -> float:
        built_s.reset()
        t = time.perf_counter()
        built_s(prompt)
        return (time.perf_counter() - t) * 1e3

    def old_forward(x: np.ndarray) -> float:
        t = time.perf_counter()
        old_s.run(["logits"], {"input_ids": x, "attention_mask": np.ones_like(x)})
        return (time.perf_counter() - t) * 1e3

    def built_generate() -> list[float]:
        built_prefill()
        out = []
        for j in range(new_tokens):
            t = time.perf_counter()
            built_s(tokens[:, j : j + 1])
            out.append((time.perf_counter() - t) * 1e3)
        return out

    def old_generate() -> list[float]:  # no cache: step j re-runs all prompt_len + j + 1 tokens
        seq = np.concatenate([prompt, tokens], axis=1)
        return [old_forward(seq[:, : prompt_len + j + 1]) for j in range(new_tokens)]

    for _ in range(2):  # warm-up
        built_prefill()
        old_forward(prompt)
    pre_b, pre_o, dec_b, dec_o = [], [], [], []
    for _ in range(rounds):
        for _ in range(5):
            pre_b.append(built_prefill())
            pre_o.append(old_forward(prompt))
        dec_b += built_generate()
        dec_o += old_generate()
    lat = {
        "threads": threads,
        "rounds": rounds,
        "prefill_built_ms": float(np.median(pre_b)),
        "prefill_torch_ms": float(np.median(pre_o)),
        "decode_built_ms": float(np.median(dec_b)),
        "decode_torch_ms": float(np.median(dec_o)),
        "decode_built_mean_ms": float(np.mean(dec_b)),
        "decode_torch_mean_ms": float(np.mean(dec_o)),
    }
    return {
        "build_s": build_s,
        "fidelity": fid,
        "latency": lat,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
    }


# --------------------------------------------------------------------------- (b) synthetic


_CHILD_GEN = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
folder, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
H, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
hd = H // nh
g = torch.Generator().manual_seed(0)
def rnd(*shape, std=0.02):
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
def layer(i):
    p = f"model.layers.{i}"
    return {f"{p}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": rnd(nh * hd, H), f"{p}.self_attn.k_proj.weight": rnd(nkv * hd, H),
            f"{p}.self_attn.v_proj.weight": rnd(nkv * hd, H), f"{p}.self_attn.o_proj.weight": rnd(H, nh * hd),
            f"{p}.mlp.gate_proj.weight": rnd(I, H), f"{p}.mlp.up_proj.weight": rnd(I, H),
            f"{p}.mlp.down_proj.weight": rnd(H, I)}
per = max(1, (1 << 30) // sum(t.numel() * 2 for t in layer(0).values()))  # ~1 GB shards
groups = [None] + [list(range(s, min(L, s + per))) for s in range(0, L, per)]  # None: the embedding shard
weight_map, total = {}, 0
for k, grp in enumerate(groups):  # one shard in memory at a time
    d = {"model.embed_tokens.weight": rnd(V, H)} if grp is None else {}
    for i in grp or []:
        d.update(layer(i))
    if k == len(groups) - 1:
        d.update({"model.norm.weight": torch.ones(H, dtype=torch.bfloat16), "lm_head.weight": rnd(V, H)})
    name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file(d, str(folder / name), metadata={"format": "pt"})
    total += sum(t.numel() * 2 for t in d.values())
    weight_map.update({n: name for n in d})
    del d
(folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **cfg}
(folder / "config.json").write_text(json.dumps(config, indent=2))
"""

_HWM = r"""
def hwm_kb():  # VmHWM resets at exec; ru_maxrss would start at the parent's high-water mark
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"""

_CHILD_BUILD = (
    _HWM
    + r"""
import json, sys, time
t0 = time.perf_counter()
import torch, safetensors, onnx  # what the builder imports, so that "after import" is the baseline
from quantkit.frontends.llm_builder import build_llm
imported = hwm_kb()
t1 = time.perf_counter()
build_llm(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
print(json.dumps({"build_s": t2 - t1, "import_s": t1 - t0, "import_rss_kb": imported,
                  "peak_rss_kb": hwm_kb()}))
"""
)

_CHILD_RUN = (
    _HWM
    + r"""
import json, sys, time
import numpy as np
from quantkit.frontends.llm_builder import LLMSession
t0 = time.perf_counter()
s = LLMSession(sys.argv[1], threads=int(sys.argv[2]))
t1 = time.perf_counter()
lg = s(np.arange(3, 35, dtype=np.int64)[None])
t2 = time.perf_counter()
steps = []
for j in range(4):
    t = time.perf_counter(); lg = s(np.asarray([[int(lg[0, -1].argmax())]])); steps.append(time.perf_counter() - t)
print(json.dumps({"session_s": t1 - t0, "prefill32_s": t2 - t1, "decode_ms": 1e3 * float(np.median(steps)),
                  "finite": bool(np.isfinite(lg).all()), "peak_rss_kb": hwm_kb()}))
"""
)


_CHILD_LAYERWISE = (
    _HWM
    + r"""
import json, sys, time
from pathlib import Path
import numpy as np
t0 = time.perf_counter()
import torch, safetensors, onnx, onnxruntime  # noqa: F401 - imported first: "after import" is the baseline
from quantkit.layerwise import quantize_llm_layerwise
from quantkit.recipe import load_recipe
from quantkit.recipe.plan import PrecisionPlan
imported = hwm_kb()
folder, out, algo, windows, group = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
algo, _, opt = algo.partition(":")  # "rtn:noclip" = plain min-max RTN (no per-group clipping search)
default = {"format": "int4", "group_size": group, "algorithm": algo}
if opt == "noclip":
    default["algorithm_options"] = {"clip": False}
rec = load_recipe({"version": 1, "quantization": {"default": default}})
vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
win = None if algo == "rtn" else np.random.default_rng(0).integers(0, vocab, tuple(windows)).astype(np.int64)
t1 = time.perf_counter()
res = quantize_llm_layerwise(folder, out, PrecisionPlan.from_recipe(rec), win, work_dir=out.parent / "work",
                             progress=False)
t2 = time.perf_counter()
print(json.dumps({"build_s": t2 - t1, "import_s": t1 - t0, "import_rss_kb": imported, "peak_rss_kb": hwm_kb(),
                  "layers_quantized": len(res.rows), "calibration_tokens": res.calibration_tokens}))
"""
)


def _synthetic(work: Path, shape: str, n: int, suffix: str) -> tuple[Path, Path, float]:
    """A random bf16 LLaMA folder of ``shape`` with ``n`` layers (made in a child process): folder, out, seconds."""
    cfg = dict(SHAPES[shape], num_hidden_layers=n)
    hf, out = work / f"synthetic-{shape}-{n}", work / f"synthetic-{shape}-{n}-{suffix}"
    hf.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _child(_CHILD_GEN + "\nprint('{}')", str(hf), json.dumps(cfg))
    return hf, out, time.perf_counter() - t0


def bench_layerwise(work: Path, *, shape: str, layers: list[int], algorithm: str, windows: tuple[int, int],
                    group: int, run_check: int, threads: int) -> list[dict[str, Any]]:
    """Synthetic folders quantized to INT4 block by block (quantkit.layerwise): peak RSS, time, disk."""
    rows = []
    for n in layers:
        hf, out, gen_s = _synthetic(work, shape, n, "int4")
        out.mkdir(parents=True, exist_ok=True)
        res = _child(_CHILD_LAYERWISE, str(hf), str(out / "model.onnx"), algorithm, json.dumps(list(windows)),
                     str(group))  # fmt: skip
        row = {"shape": shape, "layers": n, "algorithm": algorithm, "group": group,
               "windows": list(windows) if algorithm != "rtn" else None, "input_GB": _du(hf) / 1e9,
               "output_GB": _du(out) / 1e9, "gen_s": gen_s, **{k: v for k, v in res.items() if not k.endswith("_kb")},
               "peak_rss_MB": res["peak_rss_kb"] / 1024, "import_rss_MB": res["import_rss_kb"] / 1024}  # fmt: skip
        shutil.rmtree(hf)  # before the run check: the disk holds one model at a time
        rows.append(_run_check(row, out, n <= run_check, threads))
    return rows


def _run_check(row: dict[str, Any], out: Path, run: bool, threads: int) -> dict[str, Any]:
    """Load and run the built model in ORT (a child process) when ``run``; remove it; print and return the row."""
    if run:
        try:
            row["run"] = _child(_CHILD_RUN, str(out / "model.onnx"), str(threads))
        except RuntimeError as e:
            row["run"] = {"error": str(e)[-300:]}
    shutil.rmtree(out)
    print(json.dumps(row), flush=True)
    return row


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _child(code: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False
    )
    if r.returncode != 0:
        raise RuntimeError(f"child failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_synthetic(
    work: Path, *, shape: str, layers: list[int], run_check: int, threads: int
) -> list[dict[str, Any]]:
    rows = []
    for n in layers:
        cfg = dict(SHAPES[shape], num_hidden_layers=n)
        hf, out, gen_s = _synthetic(work, shape, n, "onnx")
        res = _child(_CHILD_BUILD, str(hf), str(out / "model.onnx"))
        H, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        kvd = cfg["num_key_value_heads"] * H // cfg["num_attention_heads"]
        block = 4 * (2 * H * H + 2 * H * kvd + 3 * H * inter)
        row = {
            "shape": shape, "layers": n, "params_M": (n * block / 4 + 2 * V * H) / 1e6,
            "input_GB": _du(hf) / 1e9, "output_GB": _du(out) / 1e9, "gen_s": gen_s,
            "build_s": res["build_s"], "peak_rss_MB": res["peak_rss_kb"] / 1024,
            "import_rss_MB": res["import_rss_kb"] / 1024, "block_fp32_MB": block / 2**20,
            "embedding_fp32_MB": 4 * V * H / 2**20,
        }  # fmt: skip
        shutil.rmtree(hf)
        rows.append(_run_check(row, out, n <= run_check, threads))
    return rows


# --------------------------------------------------------------------------- report


def render(smol: dict[str, Any] | None, synth: list[dict[str, Any]]) -> str:
    import onnxruntime

    lines = ["# Streaming LLaMA builder (`quantkit.frontends.llm_builder`)", ""]
    lines.append(f"`python eval/bench_llm_builder.py`; onnxruntime {onnxruntime.__version__}, "
                 f"{os.cpu_count()} CPU cores (shared machine), {time.strftime('%Y-%m-%d')}.")  # fmt: skip
    lines.append("")
    if smol:
        f, lat = smol["fidelity"], smol["latency"]
        lines += [
            "## SmolLM2-135M-Instruct, FP32",
            "",
            f"Built in {smol['build_s']:.1f} s.  Logits vs transformers (FP32) on a {f['tokens']}-token sentence "
            f"(max |logit| {f['max_abs_logit']:.1f}):",
            "",
            "| graph | max abs logit diff |",
            "|---|---|",
            f"| built, one prefill | {f['built_prefill_max_abs_diff']:.2e} |",
            f"| built, half prefill + token-by-token decode with KV cache | {f['built_kv_decode_max_abs_diff']:.2e} |",
            f"| torch-exported full-sequence graph | {f['torch_graph_max_abs_diff']:.2e} |",
            "",
            f"Latency, medians, {lat['threads']} intra-op threads, {lat['rounds']} interleaved rounds: prefill of "
            f"1x{smol['prompt_len']} tokens; generation of {smol['new_tokens']} tokens after a "
            f"{smol['prompt_len']}-token prompt (built: one token per step with the KV cache; torch graph: "
            f"no cache, step t re-runs all {smol['prompt_len']}+t tokens).  Absolute times come from a "
            f"shared machine (load {os.getloadavg()[0]:.0f} on {os.cpu_count()} cores when this was rendered, "
            "other jobs running): compare within a row, both columns were timed interleaved.",
            "",
            "| | built (GQA + KV cache) | torch-exported full sequence | ratio |",
            "|---|---|---|---|",
            f"| prefill 1x{smol['prompt_len']} (ms) | {lat['prefill_built_ms']:.1f} | {lat['prefill_torch_ms']:.1f} "
            f"| {lat['prefill_torch_ms'] / lat['prefill_built_ms']:.2f}x |",
            f"| per generated token, median (ms) | {lat['decode_built_ms']:.2f} | {lat['decode_torch_ms']:.1f} "
            f"| {lat['decode_torch_ms'] / lat['decode_built_ms']:.1f}x |",
            f"| per generated token, mean (ms) | {lat['decode_built_mean_ms']:.2f} | "
            f"{lat['decode_torch_mean_ms']:.1f} | {lat['decode_torch_mean_ms'] / lat['decode_built_mean_ms']:.1f}x |",
            "",
        ]
    if synth:
        lines += [
            "## Synthetic LLaMA folders (random bf16 weights, sharded safetensors) -> FP32 ONNX",
            "",
            "Build in a child process; peak RSS = `VmHWM` of that process (not `ru_maxrss`: on Linux a child "
            "inherits its parent's high-water mark through fork + exec) (import of the builder, "
            "torch, onnx and safetensors included, shown separately).  FP32 sizes of one block and of the "
            "embedding are listed for scale: tensors are read in their stored dtype one block at a time and "
            "converted / transposed in 16 MB row chunks while written, so the peak is about import + the "
            "largest group read at once (here the bf16 embedding or lm_head, 125 MB) and does not grow "
            "with the depth.",
            "",
            "| shape | layers | params (M) | bf16 in (GB) | fp32 out (GB) | build (s) | peak RSS (MB) "
            "| after import (MB) | 1 block fp32 (MB) | embedding fp32 (MB) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in synth:
            lines.append(
                f"| {r['shape']} | {r['layers']} | {r['params_M']:.0f} | {r['input_GB']:.2f} | {r['output_GB']:.2f} "
                f"| {r['build_s']:.1f} | {r['peak_rss_MB']:.0f} | {r['import_rss_MB']:.0f} "
                f"| {r['block_fp32_MB']:.0f} | {r['embedding_fp32_MB']:.0f} |"
            )
        runs = [r for r in synth if "run" in r]
        if runs:
            lines += ["", "Smoke run of the built graph under ORT (32-token prefill + 4 decode steps):", "",
                      "| shape | layers | session (s) | prefill 32 (s) | decode (ms/token) | finite | peak RSS (MB) |",
                      "|---|---|---|---|---|---|---|"]  # fmt: skip
            for r in runs:
                x = r["run"]
                if "error" in x:
                    lines.append(f"| {r['shape']} | {r['layers']} | error: {x['error'][:80]} | | | | |")
                    continue
                lines.append(
                    f"| {r['shape']} | {r['layers']} | {x['session_s']:.1f} | {x['prefill32_s']:.2f} "
                    f"| {x['decode_ms']:.0f} | {x['finite']} | {x['peak_rss_kb'] / 1024:.0f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "smollm2", "synthetic", "layerwise"], default="all")
    ap.add_argument("--algorithm", default="rtn",
                    help="--part layerwise: rtn | rtn:noclip (plain min-max) | gptq | awq")
    ap.add_argument("--windows", type=int, nargs=2, default=[8, 512], metavar=("N", "SEQ"),
                    help="--part layerwise: calibration windows (random token ids) for gptq / awq")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.1b")
    ap.add_argument("--layers", type=int, nargs="+", default=[11, 22])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument(
        "--run-check", type=int, default=11, metavar="MAX_LAYERS",
        help="load and run the built synthetic graphs of at most this many layers in ORT (0: none)",
    )  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "eval" / "results" / "llm_builder.md")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="bench-llm-builder-", dir=args.workdir))
    try:
        smol = synth = None
        if args.part in ("all", "smollm2"):
            smol = bench_smollm2(work, threads=args.threads, rounds=args.rounds, prompt_len=args.prompt_len,
                                 new_tokens=args.new_tokens)  # fmt: skip
            print(json.dumps(smol, indent=1), flush=True)
        if args.part == "layerwise":
            rows = bench_layerwise(work, shape=args.shape, layers=args.layers, algorithm=args.algorithm,
                                   windows=tuple(args.windows), group=args.group_size, run_check=args.run_check,
                                   threads=args.threads)  # fmt: skip
            path = ROOT / "eval" / "results" / "llm_layerwise.json"
            prev = json.loads(path.read_text()) if path.is_file() else []
            path.write_text(json.dumps(prev + rows, indent=1))
            return
        if args.part in ("all", "synthetic"):
            synth = bench_synthetic(work, shape=args.shape, layers=args.layers, run_check=args.run_check,
                                    threads=args.threads)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    prev_path = args.out.with_suffix(".json")
    if args.part != "all" and prev_path.is_file():  # keep the other part of an earlier run
        prev = json.loads(prev_path.read_text())
        smol = smol if smol is not None else prev.get("smollm2")
        synth = synth if synth is not None else prev.get("synthetic")
    text = render(smol, synth or [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    (args.out.with_suffix(".json")).write_text(json.dumps({"smollm2": smol, "synthetic": synth}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
