"""INT4 weight-only benchmark on SmolLM2-135M: quantkit (RTN / GPTQ / AWQ) vs ONNX Runtime's
``MatMulNBitsQuantizer`` (RTN symmetric / asymmetric, HQQ) at the same bits and block size.

Usage::

    python eval/bench_int4.py                      # all methods, 16 x 512-token windows of Emma
    python eval/bench_int4.py --methods quantkit:gptq,ort:rtn_sym --eval 8

Every method quantizes the same exported FP32 ONNX graph in its own process (wall time and peak
RSS are its own).  Perplexity is measured on the same held-out Jane Austen windows; prefill
(batch 1 x 128 tokens) and one-token-forward latency of every model are measured interleaved in
one process.  ONNX Runtime's GPTQ path is not run: it needs the working directory set to the
model folder, writes an output that references the FP32 weight file and took 16 minutes here.

Peers from other packages (``autoround:g<block>``, ``genai:rtn``, ``genai:k_quant``) run in their own
virtual environment ``eval/.venv-peers`` (git-ignored; never a dependency of quantkit)::

    python3 -m venv eval/.venv-peers
    eval/.venv-peers/bin/pip install torch==2.13.0          # first: the CPU wheel, no CUDA torch
    eval/.venv-peers/bin/pip install auto-round onnxruntime-genai onnx onnx-ir

    python eval/bench_int4.py --text northangerabbey \
        --methods quantkit:awq_gptq,ort:rtn_sym,ort:hqq,autoround:g128,genai:rtn,genai:k_quant

* ``autoround:g<block>`` -- Intel's ``auto-round`` (SignRound: signed-gradient tuning of rounding and
  clipping per decoder block), W4 symmetric, group ``--block``, calibrated on exactly the recipe's
  calibration tokens (Pride and Prejudice, 16 x 512, seed 0, made by quantkit and handed over as an
  .npz).  ``AUTOROUND_ITERS`` / ``AUTOROUND_BATCH`` below: auto-round's default 200 iterations take
  hours on 2 CPU cores (~3.5 s per iteration per block at batch 8), so fewer are run.  Its integer
  codes and scales (recovered exactly from the fake-quantized weights and the per-group scales it
  keeps on every layer) are lowered by quantkit to ``MatMulNBits`` in the FP32 graph, so the row runs
  through the same kernels as the others; auto-round leaves the tied embedding / lm_head FP32 (its
  default), which is in that row's size.  Quantization time and peak RSS are of the auto-round process.
* ``genai:<algo>`` -- ``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` with
  ``--extra_options block_size=<block> algo_config=<algo> accuracy_level=4`` (its own export with a KV
  cache, GroupQueryAttention, shared int4 embedding/lm_head).  Time and peak RSS are of the builder.
  Perplexity feeds each 512-token window with an empty past; ``decode ms`` is its one-token forward with
  an empty past (comparable to the other rows' one-token forward) and ``decode_kv ms`` the median
  per-token step of 64 greedy tokens after a 128-token prompt with its KV cache (n/a for graphs without one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "llama-int4.yaml"
MIX_RECIPE = ROOT / "recipes" / "llama-int4-mix.yaml"
DEFAULT = "quantkit:rtn,quantkit:gptq,quantkit:awq,ort:rtn_sym,ort:rtn_asym,ort:hqq"
PEER_VENV = ROOT / "eval" / ".venv-peers"
PEER_PY = PEER_VENV / "bin" / "python"
PEER_KINDS = ("autoround", "genai")
GENAI_ALGOS = ("rtn", "k_quant", "k_quant_mixed", "k_quant_last")
"""The builder's ``algo_config`` values run here (``k_quant_mixed`` / ``k_quant_last``: its k_quant with its own
8-bit selectors, ``matmul_mixed_precision=last_matmul:int8[,mixed_layers:int8]``)."""
# auto-round: its default is 200 iterations x batch 8 (lr 1/iters); on 2 CPU cores that is ~6 hours for
# SmolLM2's 30 blocks, so the benchmark runs fewer (stated in the table's footnote)
AUTOROUND_ITERS = 20
AUTOROUND_BATCH = 4


def _slug(m: str) -> str:
    return m.replace(":", "_")


RECIPE_VARIANTS = ("recipe", "mix_recipe", "genai_mixed", "genai_last")
"""``quantkit:<variant>`` runs recipes/llama-int4.yaml as it ships (``recipe``), recipes/llama-int4-mix.yaml as it
ships (``mix_recipe``), recipes/llama-int4.yaml with onnxruntime-genai's
``k_quant_mixed`` / ``k_quant_last`` choice of 8-bit layers written as overrides (``genai_mixed``, ``genai_last``:
the selection rule is the variable, the rounding stays the recipe's), or with a byte-budgeted search
(``mix<fraction>``, e.g. ``mix0.20``: the recipe plus a search over int4 g128 / 8-bit per linear, the emitted file
within that fraction of FP32; ``mix=genai_mixed``: at the size the ``genai_mixed`` row measured in this run; a
``+g<N>`` suffix, e.g. ``mix0.20+g32``, adds an int4 candidate with groups of N: finer scales for a few percent
more bytes, between int4 g128 and 8 bits; ``+scaled`` measures one candidate per unit and scales the others
(``search.sensitivity.measure: scaled``); ``+head`` drops the recipe's lm_head override, so that the tied lm_head is
searched too: 4 bits with the table stored apart for the embedding, or one 8-bit table shared by both)."""


def genai_mixed_layers(num_layers: int) -> list[int]:
    """The blocks onnxruntime-genai's builder gives 8-bit v / down projections under ``k_quant_mixed`` (its rule,
    after llama.cpp's Q4_K_M: the first and last eighth of the blocks, and every third block in between)."""
    lo = num_layers / 8
    return [i for i in range(num_layers)
            if i < lo or i >= 7 * lo or (i - round(lo)) % 3 == 2]


def recipe_variant(algo: str, mix_size: str | None = None) -> dict[str, Any]:
    import yaml

    d = yaml.safe_load((MIX_RECIPE if algo == "mix_recipe" else RECIPE).read_text())
    if algo == "mix_recipe":
        return d
    overrides = d["quantization"].setdefault("overrides", [])
    w8 = {"format": "int8_weight", "group_size": 128, "algorithm": "rtn", "algorithm_options": {}}
    if algo in ("genai_mixed", "genai_last"):
        # both selectors put the lm_head at 8 bits: here the tied table at 8 bits, stored once
        overrides[:] = [o for o in overrides if o.get("layer") != "lm_head"] + [{"layer": "lm_head", **w8}]
    if algo == "genai_mixed":
        from quantkit.frontends.llm import smollm2_folder
        from quantkit.frontends.llm_builder import read_decoder_config

        n = read_decoder_config(smollm2_folder()).num_hidden_layers
        for i in genai_mixed_layers(n):
            overrides += [{"layer": f"model.layers.{i}.self_attn.v_proj", **w8},
                          {"layer": f"model.layers.{i}.mlp.down_proj", **w8}]
    if algo.startswith("mix"):
        spec, *extra = algo.split("+")
        size = mix_size if spec == "mix=genai_mixed" else spec.removeprefix("mix")
        finer = [{"name": f"int4-{g}", "format": "int4", "group_size": int(g[1:])} for g in extra
                 if g not in ("head", "scaled")]
        if "head" in extra:  # the tied lm_head searched too (4 bits + the table stored apart, or one 8-bit table)
            overrides[:] = [o for o in overrides if o.get("layer") != "lm_head"]
        d["search"] = {
            "candidates": [{"name": "int4-g128", "format": "int4", "group_size": 128}, *finer, {"name": "w8", **w8}],
            "metric": "size", "target": {"size": float(size)}, "tie": "shared_input",
            "sensitivity": {"samples": 2, "seq_len": 128, "metric": "kl",
                            "measure": "scaled" if "scaled" in extra else "all"}}
    return d


def worker(method: str, out: Path, block: int) -> None:
    import onnx

    from quantkit.frontends import load_model

    t0 = time.perf_counter()
    kind, _, algo = method.partition(":")
    target = out / f"{_slug(method)}.onnx"
    if kind == "fp32":
        loaded = load_model("smollm2-135m")
        import onnx_ir as ir

        ir.save(loaded.model, target, external_data=target.name + ".data")
        info: dict[str, Any] = {}
    elif kind == "autoround":
        import numpy as np
        import onnx_ir as ir

        from quantkit.algorithms.woq import WOQResult
        from quantkit.lowering.nbits import lower_matmul_nbits

        model = load_model("smollm2-135m").model
        arrays = np.load(out / f"{_slug(method)}_codes.npz")
        names = sorted({k.rsplit(".", 1)[0] for k in arrays.files})
        for name in names:  # torch [N, K] / [N, kb] -> quantkit [K, N] / [kb, N]
            res = WOQResult(codes=np.ascontiguousarray(arrays[name + ".codes"].T),
                            scales=np.ascontiguousarray(arrays[name + ".scales"].T.astype(np.float32)),
                            zero_points=np.ascontiguousarray(arrays[name + ".zp"].T),
                            bits=4, group_size=block, symmetric=True)
            lower_matmul_nbits(model, name, res, accuracy_level=4)
        ir.save(model, target, external_data=target.name + ".data")
        info = {"lowered_layers": len(names)}
    elif kind == "quantkit" and (algo in RECIPE_VARIANTS or algo.startswith("mix")):
        from quantkit.api import quantize
        from quantkit.recipe import load_recipe

        d = recipe_variant(algo, os.environ.get("QK_BENCH_MIX_SIZE"))
        res = quantize(recipe=load_recipe(d), progress=False, evaluate=False, measure_latency=False)
        res.save(out / _slug(method), report=True)
        info = {"layers": len(res.report["layers"]), "layerwise": True, "size": res.report.get("size"),
                "path": str(out / _slug(method) / "model.onnx")}
        srch = res.report.get("search")
        if srch:
            info["search"] = {k: srch.get(k) for k in ("target", "counts", "budget_bytes", "embedding_apart_bytes",
                                                        "predicted_bytes_emitted", "emitted_bytes", "search_s")}
            info["eight_bit_layers"] = sorted(r["layer"] for r in srch["assignment"] if r["candidate"] == "w8")
    elif kind == "quantkit":
        import yaml

        from quantkit.api import quantize
        from quantkit.recipe import load_recipe

        d = yaml.safe_load(RECIPE.read_text())
        layerwise = algo.endswith("_lw")  # calibration.layerwise: block by block while the checkpoint streams
        algo = algo.removesuffix("_lw")
        d["calibration"]["layerwise"] = layerwise
        awq_opts = {"awq_gptq": {"gptq": True}, "awq_signround": {"signround": True},
                    "awq_gptq_signround": {"gptq": True, "signround": True}}
        d["quantization"]["default"]["algorithm"] = "awq" if algo in awq_opts else algo
        d["quantization"]["default"]["algorithm_options"] = (
            d["quantization"]["default"]["algorithm_options"] if algo == "gptq" else awq_opts.get(algo, {}))
        d["quantization"]["default"]["group_size"] = block
        res = quantize(recipe=load_recipe(d), progress=False, evaluate=False, measure_latency=False)
        res.save(out / _slug(method), report=True)
        info = {"layers": len(res.report["layers"]), "layerwise": layerwise}
        if (out / _slug(method) / "model.onnx.data").is_file():  # external data stays beside its graph
            info["path"] = str(out / _slug(method) / "model.onnx")
        else:
            (out / _slug(method) / "model.onnx").rename(target)
    else:
        from onnxruntime.quantization import matmul_nbits_quantizer as mnq

        src = out / "fp32.onnx"
        model = onnx.load(str(src))
        if algo == "hqq":
            cfg: Any = mnq.HQQWeightOnlyQuantConfig(block_size=block, bits=4)
        else:
            cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=algo == "rtn_sym", accuracy_level=4)
        q = mnq.MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=algo == "rtn_sym",
                                     accuracy_level=4, algo_config=cfg)
        q.process()
        onnx.save_model(q.model.model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=target.name + ".data", size_threshold=1024)
        info = {}
    info["wall_s"] = time.perf_counter() - t0
    info["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"{_slug(method)}.json").write_text(json.dumps(info))


def _peak_rss_mb() -> float:
    return max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024


def peer_autoround(out: Path, block: int, folder: str, calib: Path) -> None:
    """In eval/.venv-peers: auto-round W4 sym group ``block`` on the given calibration tokens; saves codes."""
    import numpy as np
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    d = np.load(calib)
    ids, mask = d["input_ids"], d["attention_mask"]
    data = [{"input_ids": torch.from_numpy(ids[i:i + 1]), "attention_mask": torch.from_numpy(mask[i:i + 1])}
            for i in range(len(ids))]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opts = {"scheme": "W4A16", "bits": 4, "group_size": block, "sym": True, "iters": AUTOROUND_ITERS,
            "nsamples": len(ids), "seqlen": int(ids.shape[1]), "batch_size": AUTOROUND_BATCH, "seed": 0,
            "amp": False, "enable_torch_compile": False}
    ar = AutoRound(model, tok, dataset=data, device_map="cpu", **opts)
    model, _ = ar.quantize()
    quant_s = time.perf_counter() - t0
    arrays: dict[str, Any] = {}
    worst = 0.0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or getattr(mod, "scale", None) is None:
            continue
        w = mod.weight.detach().double()
        n, k = w.shape
        s = mod.scale.detach().double().reshape(n, -1)
        zp = mod.zp
        zp = (zp.detach().reshape(n, -1).double() if torch.is_tensor(zp) and zp.numel() > 1
              else torch.full_like(s, float(zp.item() if torch.is_tensor(zp) else zp)))
        q = w / s.repeat_interleave(block, dim=1)[:, :k]
        codes = torch.round(q) + zp.repeat_interleave(block, dim=1)[:, :k]
        worst = max(worst, float((q - torch.round(q)).abs().max()))
        if codes.min() < 0 or codes.max() > 15:
            raise SystemExit(f"auto-round layer {name}: codes outside [0, 15]")
        arrays[name + ".codes"] = codes.to(torch.uint8).numpy()
        arrays[name + ".scales"] = s.float().numpy()
        arrays[name + ".zp"] = zp.to(torch.uint8).numpy()
    if worst > 1e-3:
        raise SystemExit(f"auto-round weights are not codes x scales (off-grid by {worst:.3g} steps)")
    slug = _slug(f"autoround:g{block}")
    np.savez(out / f"{slug}_codes.npz", **arrays)
    info = {"wall_s": quant_s, "peak_rss_mb": _peak_rss_mb(), "layers": len(arrays) // 3, "off_grid_steps": worst,
            "options": opts, "auto_round": _dist_version("auto-round")}
    (out / f"{slug}.peer.json").write_text(json.dumps(info))


def peer_genai(method: str, out: Path, block: int, folder: str) -> None:
    """In eval/.venv-peers: onnxruntime-genai's model builder, INT4 CPU, in a child process (timed, RSS)."""
    algo = method.partition(":")[2]
    dest = out / _slug(method)
    opts = [f"block_size={block}", f"algo_config={algo}", "accuracy_level=4"]
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", folder, "-o", str(dest), "-p", "int4",
           "-e", "cpu", "-c", str(out / "genai_cache"), "--extra_options", *opts]
    t0 = time.perf_counter()
    with open(out / f"{_slug(method)}.log", "w") as log:  # the builder's progress bars
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    info = {"wall_s": time.perf_counter() - t0, "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "options": opts, "onnxruntime_genai": _dist_version("onnxruntime-genai")}
    (out / f"{_slug(method)}.peer.json").write_text(json.dumps(info))


def _dist_version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


_PEER_SETUP = (
    "python3 -m venv eval/.venv-peers && eval/.venv-peers/bin/pip install torch==2.13.0 && "
    "eval/.venv-peers/bin/pip install auto-round onnxruntime-genai onnx onnx-ir"
)


def _run_peer(method: str, pdir: Path, block: int, folder: Path, calib: dict[str, Any] | None) -> Path:
    """Run (or reuse from ``pdir``) a peer in eval/.venv-peers; return the folder holding its outputs."""
    import numpy as np

    slug = _slug(method)
    pdir.mkdir(parents=True, exist_ok=True)
    lock = pdir / f"{slug}.lock"  # another run sharing --peer-cache is making it: wait
    while lock.exists():
        print(f"[bench] {method}: waiting for {lock} to go", flush=True)
        time.sleep(30)
    done = (pdir / f"{slug}.peer.json").is_file()
    if method.startswith("autoround:"):
        assert calib is not None
        cal = pdir / "calib.npz"
        if cal.is_file():
            old = np.load(cal)
            same = all(k in old.files and np.array_equal(old[k], v) for k, v in calib.items())
        else:
            same = False
        done = done and same and (pdir / f"{slug}_codes.npz").is_file()
        if not done:
            np.savez(cal, **calib)
        extra = ["--calib", str(cal)]
    else:
        done = done and (pdir / slug / "model.onnx").is_file()
        extra = []
    if done:
        print(f"[bench] {method}: reusing {pdir}", flush=True)
        return pdir
    lock.touch()
    try:
        subprocess.run([str(PEER_PY), __file__, "--peer", method, "--out-dir", str(pdir), "--block", str(block),
                        "--hf-folder", str(folder), *extra], check=True, cwd=ROOT)
    finally:
        lock.unlink()
    return pdir


def _pin_kv_dim(model: Path) -> Path:
    """Copy of a genai ``model.onnx`` (same folder, same weight file) with the KV inputs' symbolic last dim
    ``kv_cache_dim`` set to ``head_size`` from genai_config.json (quantkit's latency feeds need static dims)."""
    import onnx

    head = json.loads((model.parent / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    proto = onnx.load(str(model), load_external_data=False)
    for v in [*proto.graph.input, *proto.graph.output]:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param == "kv_cache_dim":
                d.dim_value = head
    pinned = model.with_name("model_pinned.onnx")
    onnx.save(proto, str(pinned))
    return pinned


class _EmptyPast:
    """A text dataset fed to a KV-cache graph: the whole window as prompt, empty past, positions 0..T-1."""

    def __init__(self, ds: Any, model_path: Path) -> None:
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        graph = onnx.load(str(model_path), load_external_data=False).graph
        self.ds, self.past, self.names = ds, {}, {i.name for i in graph.input}
        for i in graph.input:
            if i.name.startswith("past_key_values."):
                dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
                self.past[i.name] = (dims[1], dims[3], tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))

    def __len__(self) -> int:
        return len(self.ds)

    def batches(self, batch_size: int) -> Any:
        import numpy as np

        for b in self.ds.batches(batch_size):
            b = dict(b)
            n = b["input_ids"].shape[0]
            mask = b.get("attention_mask", np.ones_like(b["input_ids"]))
            if "position_ids" in self.names:
                b["position_ids"] = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int64)
            for name, (heads, dim, dt) in self.past.items():
                b[name] = np.zeros((n, heads, 0, dim), dt)
            yield b


def _has_past(path: Path) -> bool:
    import onnx

    return any(i.name.startswith("past_key_values.") for i in onnx.load(str(path), load_external_data=False).graph.input)


def _size(p: Path) -> int:
    data = p.with_name(p.name + ".data")
    return p.stat().st_size + (data.stat().st_size if data.exists() else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT)
    ap.add_argument("--eval", type=int, default=16, help="evaluation windows of 512 tokens")
    ap.add_argument("--text", default="emma",
                    help="held-out evaluation text(s), comma-separated: an Austen novel (emma | northangerabbey | "
                         "persuasion | ...) or a text source (pydoc: its evaluation split); the first sets 'ppl' (the recipe "
                         "calibrates on Pride and Prejudice)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--peer-cache", default=None,
                    help="keep the peers' outputs (auto-round codes, genai builds) in this folder and reuse them "
                         "when present (same method and block); their time and RSS are those of the run that made them")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--calib", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, Path(args.out_dir), args.block)
        return
    if args.peer:  # runs in eval/.venv-peers: no quantkit import
        if args.peer.startswith("autoround:"):
            peer_autoround(Path(args.out_dir), args.block, args.hf_folder, Path(args.calib))
        else:
            peer_genai(args.peer, Path(args.out_dir), args.block, args.hf_folder)
        return
    from provenance import run_record

    from quantkit.data import make_dataset
    from quantkit.evaluate.decode import measure_decode, measure_prefill
    from quantkit.evaluate.perplexity import perplexity
    from quantkit.frontends import load_model
    from quantkit.lowering.verify import census
    from quantkit.report.build import environment

    methods = ["fp32", *args.methods.split(",")]
    qk = ("rtn", "gptq", "awq", "awq_gptq", "signround", "awq_signround", "awq_gptq_signround")
    allowed = {"quantkit": qk + tuple(a + "_lw" for a in qk),  # _lw: calibration.layerwise
               "ort": ("rtn_sym", "rtn_asym", "hqq")}
    allowed |= {"autoround": (f"g{args.block}",), "genai": GENAI_ALGOS}  # peers, in eval/.venv-peers
    allowed["quantkit"] += RECIPE_VARIANTS
    for m in methods[1:]:
        kind, _, algo = m.partition(":")
        spec, *extra = algo.split("+")
        if kind == "quantkit" and all(g in ("head", "scaled") or g.startswith("g") and g[1:].isdigit()
                                      for g in extra) and (
                spec == "mix=genai_mixed" or spec.removeprefix("mix").replace(".", "", 1).isdigit()):
            continue
        if algo not in allowed.get(kind, ()):
            raise SystemExit(f"unknown method {m!r}; allowed: " + ", ".join(
                f"{k}:{a}" for k, algos in allowed.items() for a in algos))
    peers = [m for m in methods if m.partition(":")[0] in PEER_KINDS]
    if peers and not PEER_PY.exists():
        raise SystemExit(f"methods {peers} run in a separate virtual environment {PEER_VENV} that does not exist; "
                         f"create it (from the repository root) with:\n  {_PEER_SETUP}")
    loaded = load_model("smollm2-135m")
    from quantkit.data import model_inputs

    calib = None
    if any(m.startswith("autoround:") for m in methods):
        import yaml

        from quantkit.recipe import load_recipe

        spec = load_recipe(yaml.safe_load(RECIPE.read_text())).calibration.data.model_dump()
        cal = make_dataset(spec, inputs=model_inputs(loaded.model), tokenizer=loaded.tokenizer, split="calibration")
        (calib,) = list(cal.batches(len(cal)))
        calib = {k: calib[k] for k in ("input_ids", "attention_mask")}

    texts = [t if ":" in t or t == "pydoc" else f"austen:{t}" for t in args.text.split(",")]
    evs = {t: make_dataset({"kind": "text", "source": t, "mode": "windows", "seq_len": 512, "count": args.eval},
                           inputs=model_inputs(loaded.model), tokenizer=loaded.tokenizer, split="evaluation")
           for t in texts}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        paths = {}
        kv = [m for m in methods if m.startswith("genai:")]
        failed: dict[str, str] = {}
        for m in methods:
            print(f"[bench] {m} ...", flush=True)
            kind = m.partition(":")[0]
            if kind in PEER_KINDS:
                from quantkit.frontends.llm import smollm2_folder

                pdir = (Path(args.peer_cache) if args.peer_cache else tmp / "peers") / f"b{args.block}"
                try:
                    _run_peer(m, pdir, args.block, smollm2_folder(), calib)
                except subprocess.CalledProcessError as e:  # a peer that fails on this model is a result too
                    log = pdir / f"{_slug(m)}.log"
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
                    failed[m] = f"exit {e.returncode}: {tail[0] if tail else 'see its output above'}"
                    print(f"[bench] {m}: FAILED ({failed[m]}); going on without it", flush=True)
                    continue
                peer = json.loads((pdir / f"{_slug(m)}.peer.json").read_text())
            if kind == "genai":
                results[m] = peer
                built = pdir / _slug(m) / "model.onnx"
                paths[m] = _pin_kv_dim(built)
                results[m]["size_mb"] = _size(built) / 2**20
            else:
                if kind == "autoround":
                    link = tmp / f"{_slug(m)}_codes.npz"
                    if not link.exists():
                        link.symlink_to(pdir / f"{_slug(m)}_codes.npz")
                env = dict(os.environ)
                if m.split("+")[0] == "quantkit:mix=genai_mixed":  # the size the genai_mixed row measured here
                    size = results["quantkit:genai_mixed"]["size"]
                    env["QK_BENCH_MIX_SIZE"] = str(size["quantized_bytes"] / size["fp32_bytes"])
                subprocess.run([sys.executable, __file__, "--worker", m, "--out-dir", str(tmp), "--block",
                                str(args.block)], check=True, cwd=ROOT, env=env)
                results[m] = json.loads((tmp / f"{_slug(m)}.json").read_text())
                if kind == "autoround":  # time and RSS of auto-round itself; the lowering is extra
                    results[m] = {**peer, "lower_s": results[m]["wall_s"], "lowered_layers": results[m]["lowered_layers"]}
                paths[m] = Path(results[m].get("path") or tmp / f"{_slug(m)}.onnx")
            results[m].setdefault("size_mb", _size(paths[m]) / 2**20)
            results[m]["ppl_by_text"] = {t: perplexity(str(paths[m]), _EmptyPast(e, paths[m]) if m in kv else e)["ppl"]
                                         for t, e in evs.items()}
            results[m]["ppl"] = results[m]["ppl_by_text"][texts[0]]
            if m != "fp32":
                cen = census(str(paths[m]))
                results[m]["kernels"] = dict(cen.quantized_kernels)
            print(f"[bench] {m}: ppl " + ", ".join(f"{t} {v:.3f}" for t, v in results[m]["ppl_by_text"].items())
                  + f", {results[m]['size_mb']:.1f} MB", flush=True)
        methods = [m for m in methods if m not in failed]
        kv = [m for m in kv if m not in failed]
        pre = measure_prefill({m: str(p) for m, p in paths.items()}, seq_len=128, warmup=3, repeat=20)
        dec = measure_decode({m: str(p) for m, p in paths.items() if m not in kv}, warmup=5, repeat=40)
        if kv:  # one token with an empty past: the same work as the others' one-token forward
            dec |= measure_decode({m: str(paths[m]) for m in kv}, past_len=0, warmup=5, repeat=40)
        # per-token decode with the KV cache, every graph that has one, in lockstep (same machine noise)
        from quantkit.evaluate.decode import measure_generation

        with_kv = {m: str(p) for m, p in paths.items() if _has_past(p)}
        gen = measure_generation(with_kv, prompt_len=128, new_tokens=64, rounds=3) if with_kv else {}
        for m in methods:
            results[m]["prefill_ms"] = pre[m].median_ms
            results[m]["decode_ms"] = dec[m].median_ms
            results[m]["decode_label"] = dec[m].label
            results[m]["decode_kv_ms"] = gen[m]["median_ms"] if m in gen else None
    env = {**environment(), **run_record()}
    print("\nenvironment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print(f"perplexity on {args.eval} x 512-token windows of {args.text} (evaluation split); block {args.block}, 4-bit; "
          f"decode = {results['fp32']['decode_label']}\n")
    hdr = (f"{'method':<18}{'ppl':>9}{'size MB':>9}{'x FP32':>8}{'quant s':>9}{'RSS MB':>8}{'prefill ms':>12}"
           f"{'decode ms':>11}{'decode_kv ms':>14}  kernels")
    print(hdr)
    print("-" * len(hdr))
    fsize = results["fp32"]["size_mb"]
    for m, r in results.items():
        print(f"{m:<18}{r['ppl']:>9.3f}{r['size_mb']:>9.1f}{r['size_mb'] / fsize:>8.3f}{r.get('wall_s', 0):>9.1f}"
              f"{r.get('peak_rss_mb', 0):>8.0f}{r['prefill_ms']:>12.2f}{r['decode_ms']:>11.2f}"
              f"{'n/a' if r['decode_kv_ms'] is None else format(r['decode_kv_ms'], '.2f'):>14}  {r.get('kernels', '')}")
    notes = []
    for m, r in results.items():
        if m.startswith("autoround:"):
            o = r["options"]
            notes.append(f"{m}: auto-round {r.get('auto_round')} {o['scheme']} sym group {o['group_size']}, iters {o['iters']} "
                         f"(its default is 200: hours on 2 cores), batch {o['batch_size']}, nsamples {o['nsamples']} x "
                         f"seqlen {o['seqlen']} = the recipe's calibration tokens, fp32 tuning (amp off); its codes and "
                         f"scales lowered by quantkit to MatMulNBits (accuracy level 4, {r['lowered_layers']} layers, "
                         f"{r['lower_s']:.0f} s extra); tied embedding / lm_head left FP32 as auto-round does")
        elif m.startswith("genai:"):
            notes.append(f"{m}: onnxruntime-genai {r.get('onnxruntime_genai')} model builder -p int4 -e cpu "
                         f"--extra_options {' '.join(r['options'])}; decode ms = one token with an empty past")
    notes.append("decode_kv ms: median per-token step, 64 greedy tokens after a 128-token prompt, with the KV cache; "
                 "n/a for graphs without one. quant s / RSS MB: the quantizing process (child) alone")
    notes += [f"{m}: failed on this model, {why}" for m, why in failed.items()]
    print("\n" + "\n".join("* " + n for n in notes))
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "results": results, "failed": failed}, indent=2,
                                             default=str))


if __name__ == "__main__":
    main()
