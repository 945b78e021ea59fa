"""How much of a 4-bit linear's output error each rounding / grid choice leaves, in-sample and on held-out text.

    python eval/int4_layer_error.py [--blocks 1,15,29] [--variants recipe,refit2,...] [--cache DIR]

For SmolLM2-135M (the built-in ``smollm2-135m`` checkpoint, FP32 in transformers) the inputs of q/k/v, o_proj,
gate/up and down_proj of a few blocks (and of the lm_head, ``--lm-head``) are gathered on two sets of 16 windows of
512 tokens: the calibration texts of ``recipes/llama-int4.yaml`` (Pride and Prejudice and the Python docs, the first
half of each) and held-out text (Mansfield Park, the second half of the Python docs).  Each linear ``W`` ``[K, N]``
is rounded by every variant against the calibration Hessian ``H`` and scored by its relative output error
``tr(dW^T H dW) / tr(W^T H W)`` under both Hessians, summed over the linears.  This is a proxy: FP32 inputs (not the
quantized blocks' outputs), no int8 activations (``accuracy_level`` 4), one layer at a time - cheap and without the
~0.25 build-to-build noise of a perplexity, so it ranks rounding choices; a full build and
``eval/bench_int4_gap.py`` measure what ships.  The Hessians are cached (``--cache``, default
``$QUANTKIT_CACHE/int4-layer-error`` or ``~/.cache/quantkit/int4-layer-error``).

Results are printed, one line per linear and a total; eval/results/recipe_history.md (llama-int4, session 40) has
the table this produced.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.scale_refit import refit_scales
from quantkit.algorithms.signround import refit_rounds, signround, signround_refine
from quantkit.algorithms.woq import WOQResult

Variant = Callable[[np.ndarray, np.ndarray], WOQResult]


def _sr(g: int = 128, sym: bool = False, **kw: object) -> Variant:
    opts = {"iters": 50, "refit": 1, "refit_iters": 50, **kw}
    return lambda W, H: signround(W, hessian=H, symmetric=sym, group_size=g, **opts)


def _damped(H: np.ndarray, percdamp: float = 0.01) -> np.ndarray:
    return H + percdamp * float(np.mean(np.diag(H))) * np.eye(len(H))


def joint_offset_refit(w: np.ndarray, H: np.ndarray, res: WOQResult) -> WOQResult:
    """Scales and continuous offsets per group for fixed codes (``W_hat = s q - t``, one ``2G x 2G`` system per
    column), the zero points then rounded to ``t / s`` and the scales refitted for them (a prototype)."""
    K, N = res.codes.shape
    g, G = res.group_size, res.scales.shape[0]
    starts = np.arange(0, K, g)
    Q = res.codes.astype(np.float64)
    HW = H @ w.astype(np.float64)
    A = np.zeros((N, 2 * G, 2 * G))
    A[:, G:, G:] = np.add.reduceat(np.add.reduceat(H, starts, axis=0), starts, axis=1)
    for h in range(G):
        rows = slice(starts[h], min(K, starts[h] + g))
        P = H[:, rows] @ Q[rows]
        A[:, :G, h] = np.add.reduceat(Q * P, starts, axis=0).T
        A[:, G:, h] = -np.add.reduceat(P, starts, axis=0).T
    A[:, :G, G:] = A[:, G:, :G].transpose(0, 2, 1)
    b = np.concatenate([np.add.reduceat(Q * HW, starts, axis=0).T, -np.add.reduceat(HW, starts, axis=0).T], axis=1)
    x = np.linalg.solve(A + 1e-12 * np.eye(2 * G), b[..., None])[..., 0]
    s, t = x[:, :G].T, x[:, G:].T
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s > 0, t / s, res.zero_points)
    z = np.clip(np.round(z), 0, 2**res.bits - 1).astype(res.zero_points.dtype)
    moved = float(np.mean(z != res.zero_points))
    print(f"    (zero points moved: {moved:.4%})", flush=True)
    out = WOQResult(res.codes, np.where(s > 0, s, res.scales).astype(np.float32), z, res.bits, g, res.symmetric)
    out = signround_refine(w, _damped(H), refit_scales(w, H, out), iters=50, learn_clip=False, relaxed=True)
    return refit_scales(w, H, out)


VARIANTS: dict[str, Variant] = {
    "norefit": lambda W, H: signround(W, hessian=H, symmetric=False, group_size=128, iters=50),
    "recipe": _sr(),  # the asymmetric g128 recipe's body: SignRound, refit, 50 steps again, refit
    "refit2": _sr(refit=2),
    "damp0.05": _sr(percdamp=0.05), "damp0.1": _sr(percdamp=0.1), "damp0.3": _sr(percdamp=0.3),
    "damp1.0": _sr(percdamp=1.0),
    "zero_points": lambda W, H: joint_offset_refit(W, H, _sr()(W, H)),
    "gptq_refit": lambda W, H: gptq(W, hessian=H, symmetric=False, group_size=128, refit=True),
    "gptq_signround": lambda W, H: refit_rounds(W, _damped(H), gptq(W, hessian=H, symmetric=False, group_size=128,
                                                                   refit=True), refit=2, refit_iters=50),
    "sym": _sr(sym=True), "g64sym": _sr(64, True), "g64": _sr(64), "g32sym": _sr(32, True), "g32": _sr(32),
}


def _windows(tok: object, sources: list[tuple[str, str]], count: int = 8, seq: int = 512) -> list[list[int]]:
    from quantkit.data.text import load_text

    out = []
    for src, half in sources:
        ids = tok(load_text(src))["input_ids"]  # type: ignore[operator]
        ids = ids[: len(ids) // 2] if half == "first" else ids[len(ids) // 2:]
        n = len(ids)
        out += [ids[j * (n - seq) // count:][:seq] for j in range(count)]
    return out


def collect(cache: Path, blocks: list[int]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Weights, calibration Hessians and held-out Hessians (cached as one .npz per block set)."""
    path = cache / f"hessians_{'-'.join(map(str, blocks))}.npz"
    if not path.is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from quantkit.llm_run import resolve_llm_folder

        folder = resolve_llm_folder("smollm2-135m")
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        arrays: dict[str, np.ndarray] = {}
        for split, sources in (("cal", [("austen:prideprejudice", "first"), ("pydoc", "first")]),
                               ("held", [("austen:mansfieldpark", "first"), ("pydoc", "second")])):
            acc: dict[str, np.ndarray] = {}
            rows: dict[str, int] = {}

            def hook(name: str, acc: dict[str, np.ndarray] = acc, rows: dict[str, int] = rows) -> Callable[..., None]:
                def f(_mod: object, inp: tuple[torch.Tensor, ...]) -> None:
                    x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
                    acc[name] = acc.get(name, 0) + (x.T @ x).numpy()
                    rows[name] = rows.get(name, 0) + x.shape[0]
                return f

            handles = []
            for b in blocks:
                layer = model.model.layers[b]
                for name, mod in ((f"{b}.qkv", layer.self_attn.q_proj), (f"{b}.o", layer.self_attn.o_proj),
                                  (f"{b}.gate_up", layer.mlp.gate_proj), (f"{b}.down", layer.mlp.down_proj)):
                    handles.append(mod.register_forward_pre_hook(hook(name)))
            handles.append(model.lm_head.register_forward_pre_hook(hook("lm_head")))
            with torch.no_grad():
                for w in _windows(tok, sources):
                    model(torch.tensor([w]))
            for h in handles:
                h.remove()
            arrays.update({f"{split}/{k}": v / rows[k] for k, v in acc.items()})
        for b in blocks:
            layer = model.model.layers[b]
            att, mlp = layer.self_attn, layer.mlp
            for name, mods in ((f"{b}.qkv", (att.q_proj, att.k_proj, att.v_proj)), (f"{b}.o", (att.o_proj,)),
                               (f"{b}.gate_up", (mlp.gate_proj, mlp.up_proj)), (f"{b}.down", (mlp.down_proj,))):
                arrays[f"W/{name}"] = torch.cat([m.weight.detach() for m in mods]).T.numpy().astype(np.float32)
        arrays["W/lm_head"] = model.lm_head.weight.detach().T.numpy().astype(np.float32)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    d = np.load(path)
    pick = lambda pre: {k.split("/", 1)[1]: d[k] for k in d.files if k.startswith(pre + "/")}  # noqa: E731
    return pick("W"), pick("cal"), pick("held")


def _loss(H: np.ndarray, D: np.ndarray) -> float:
    D = D.astype(np.float64)
    return float(np.sum((H @ D) * D))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="1,15,29")
    ap.add_argument("--variants", default="recipe,refit2,gptq_refit,sym,g64sym,g32sym",
                    help=f"comma list of: {', '.join(VARIANTS)}")
    ap.add_argument("--layers", default="qkv,o,gate_up,down", help="which linears of each block")
    ap.add_argument("--lm-head", action="store_true", help="the lm_head alone instead (slow: 49152 columns)")
    ap.add_argument("--cache", default=str(Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))
                                           / "int4-layer-error"))
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; allowed: {list(VARIANTS)}")
    W, cal, held = collect(Path(args.cache), blocks)
    layers = ["lm_head"] if args.lm_head else [f"{b}.{t}" for b in blocks for t in args.layers.split(",")]
    total = {v: [0.0, 0.0] for v in names}
    for n in layers:
        w, H, Hh = W[n], cal[n], held[n]
        base, baseh = _loss(H, w), _loss(Hh, w)
        parts = []
        for v in names:
            t = time.perf_counter()
            D = VARIANTS[v](w, H).dequantize() - w
            a, b = _loss(H, D) / base, _loss(Hh, D) / baseh
            total[v][0] += a
            total[v][1] += b
            parts.append(f"{v} {b:.3e} ({a:.3e} in-sample, {time.perf_counter() - t:.1f} s)")
        print(f"{n}: " + "; ".join(parts), flush=True)
    print("total held-out (in-sample): " + "; ".join(f"{v} {b:.4e} ({a:.4e})" for v, (a, b) in total.items()))


if __name__ == "__main__":
    main()
