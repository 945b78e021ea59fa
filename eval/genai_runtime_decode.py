"""Per-token decode of model folders under onnxruntime-genai's own runtime (run with the peer venv's Python).

    eval/.venv-peers/bin/python eval/genai_runtime_decode.py recipe=out/llama-int4 genai=PEER/b128/genai_rtn

Each folder needs a ``genai_config.json`` (quantkit writes one beside every built decoder; the genai
builder writes its own).  Every round, the models take turns (the order rotates each round): a fresh
``og.Generator`` appends the same random prompt of ``--prompt-len`` tokens (timed: prefill), then
``--new-tokens`` calls of ``generate_next_token`` are timed one by one (greedy).  This is the runtime
onnxruntime-genai's users run its models with (IO binding, the KV cache in one buffer shared by
past and present when the config asks for it), so it is that builder's strongest setting.  The
``search`` options and the threads are set the same for every model through ``og.Config.overlay``.

Prints one JSON object: ``{name: {"decode_ms": median of the per-round medians, "rounds": [...],
"prefill_ms": ..., "share_buffer": ...}}``.  Imports nothing from quantkit (the peer venv has none of it).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="name=folder")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--share-buffer", choices=["config", "on", "off"], default="config",
                    help="past_present_share_buffer: as each folder's config says, or forced")
    args = ap.parse_args()
    import onnxruntime_genai as og

    total = args.prompt_len + args.new_tokens
    models = {}
    share = {}
    for spec in args.models:
        name, folder = spec.split("=", 1)
        cfg = og.Config(folder)
        search: dict[str, object] = {"max_length": total, "do_sample": False, "top_k": 1}
        if args.share_buffer != "config":
            search["past_present_share_buffer"] = args.share_buffer == "on"
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": args.threads, "inter_op_num_threads": 1}}}, "search": search}))
        models[name] = og.Model(cfg)
        conf = json.load(open(f"{folder}/genai_config.json"))
        share[name] = search.get("past_present_share_buffer", conf.get("search", {}).get("past_present_share_buffer"))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 1000, args.prompt_len).astype(np.int32)
    names = list(models)
    per_round: dict[str, list[float]] = {k: [] for k in names}
    prefill: dict[str, list[float]] = {k: [] for k in names}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            params = og.GeneratorParams(models[name])
            params.set_search_options(max_length=total, do_sample=False, top_k=1)
            gen = og.Generator(models[name], params)
            t0 = time.perf_counter()
            gen.append_tokens(prompt)
            t_prefill = (time.perf_counter() - t0) * 1e3
            steps = []
            for _ in range(args.new_tokens if rnd else 4):
                t0 = time.perf_counter()
                gen.generate_next_token()
                steps.append((time.perf_counter() - t0) * 1e3)
                if gen.is_done():
                    break
            del gen
            if rnd:
                per_round[name].append(float(np.median(steps)))
                prefill[name].append(t_prefill)
    out = {k: {"decode_ms": float(np.median(per_round[k])), "rounds": per_round[k],
               "prefill_ms": float(np.median(prefill[k])), "share_buffer": share[k]} for k in names}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
