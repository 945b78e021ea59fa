"""``quantkit`` command line: a thin layer over :mod:`quantkit.api`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError


def _common_args(p: argparse.ArgumentParser, recipe_help: str, default_out: str) -> None:
    p.add_argument("--recipe", required=True, help=recipe_help)
    p.add_argument("--output", "-o", default=None, help=f"output folder (default: {default_out})")
    p.add_argument("--model", default=None, help="override the recipe's model.source")
    p.add_argument("--calibration-data", default=None,
                   help="the calibration data instead of the recipe's: an .npz, an image folder, a folder of .wav "
                        "files, or text (a .txt file, pydoc, austen:<book>); the recipe's options that still apply "
                        "are kept")
    p.add_argument("--evaluation-data", default=None, help="the evaluation data instead of the recipe's (as above)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.add_argument("--verbose", "-v", action="store_true", help="debug messages too (logger 'quantkit' at DEBUG)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an --output folder that holds files quantkit did not write")


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quantkit", description="Post-training quantization to ONNX.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command")
    c = sub.add_parser("calibrate", help="calibrate, quantize, verify and report as a recipe says")
    _common_args(c, "recipe YAML file", "out/<recipe name>")
    c.add_argument("--no-latency", action="store_true", help="skip the latency measurement")
    c.add_argument("--no-cache", action="store_true", help="ignore cached calibration statistics")
    w = sub.add_parser(
        "sweep", help="mixed-precision search: sensitivity, cost, Pareto front, measured points"
    )
    _common_args(w, "recipe YAML file with a 'search' section", "out/<recipe name>-sweep")
    w.add_argument("--no-models", action="store_true", help="do not keep the emitted models of the points")
    w.add_argument("--no-cache", action="store_true", help="measure sensitivity and costs again")
    w.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="evaluate the points as Ray tasks on this cluster ('local': a new local one; needs ray)")
    v = sub.add_parser("validate", help="validate a recipe and print it resolved")
    v.add_argument("recipe", nargs="?", default=None, help="the recipe YAML (or --recipe, as calibrate takes it)")
    v.add_argument("--recipe", dest="recipe_opt", default=None, metavar="RECIPE", help=argparse.SUPPRESS)
    k = sub.add_parser(
        "verify", help="check an emitted int8 model on this machine: do the fused kernels compute its QDQ math?"
    )
    k.add_argument("model", help="the emitted model.onnx")
    k.add_argument("--data", default=None, help="inputs to run: an .npz file or a folder of them")
    k.add_argument("--samples", type=int, default=16, help="samples to compare (default 16)")
    g = sub.add_parser("generate", help="greedy text generation with an emitted LLM decoder (KV cache)")
    g.add_argument("--model", required=True, help="an output folder (model.onnx + tokenizer files) or its model.onnx")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--tokenizer", default=None, help="folder with the tokenizer (default: the model's folder)")
    g.add_argument("--threads", type=int, default=None, help="intra-op threads (default: ONNX Runtime's)")
    return p


def _override(rec_path: str, args: argparse.Namespace) -> dict[str, Any] | str:
    """Apply CLI path overrides to the recipe (as a dict, so validation still runs)."""
    if not (args.model or args.calibration_data or args.evaluation_data):
        return rec_path

    from quantkit.recipe.load import _resolve_paths, safe_load_yaml

    path = Path(rec_path)
    if not path.is_file():
        raise QuantkitError(f"recipe file {rec_path!r} does not exist")
    data = safe_load_yaml(path.read_text(encoding="utf-8"), str(path))
    if not isinstance(data, dict):
        raise QuantkitError(f"recipe {rec_path} must be a mapping at the top level")
    data = _resolve_paths(data, path.resolve().parent, str(path))
    if args.model:
        data.setdefault("model", {})["source"] = args.model
    for key, val in (("calibration", args.calibration_data), ("evaluation", args.evaluation_data)):
        if val:
            sec = data.setdefault(key, {})
            if not isinstance(sec, dict):
                raise QuantkitError(f"recipe {rec_path}: {key} must be a mapping (got {type(sec).__name__})")
            d = sec.get("data")
            sec["data"] = data_override(d if isinstance(d, dict) else {}, str(val))
    return data


TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
"""A ``--calibration-data`` / ``--evaluation-data`` file with one of these suffixes is text (``kind: text``)."""


def data_override(spec: dict[str, Any], value: str) -> dict[str, Any]:
    """The recipe's data spec ``spec`` with the data at ``value`` (a CLI ``--calibration-data`` /
    ``--evaluation-data``) in place of its own, keeping the options that still apply: an ``.npz`` file (or a
    folder holding some) is ``kind: npz``; for a text recipe (or a ``.txt`` / ``.md`` / ``.rst`` file) the value is the text ``source``
    (a file, ``pydoc``, ``austen:<book>``) with the recipe's mode, count, seq_len, seed and offset; a ``.wav`` file
    or a folder holding some is ``kind: audio`` (with an audio recipe's seconds, hop, sampling_rate, limit, seed and
    input); otherwise an
    image folder or file, with the recipe's preprocess, seed and input (and a ``sample_photos`` count as the
    ``limit`` of files read)."""
    kind = spec.get("kind")
    folder = Path(value).expanduser()
    if value.lower().endswith(".npz") or (folder.is_dir() and any(folder.glob("*.npz"))):
        return {"kind": "npz", "path": value}
    if kind == "audio" or value.lower().endswith(".wav") or (folder.is_dir() and any(folder.rglob("*.wav"))):
        kept: tuple[str, ...] = ("seconds", "hop", "sampling_rate", "limit", "seed", "input") if kind == "audio" else ()
        return {"kind": "audio", "path": value, **{k: spec[k] for k in kept if k in spec}}
    if kind == "text" or value.lower().endswith(TEXT_SUFFIXES):
        keep = ("mode", "count", "seq_len", "seed", "offset") if kind == "text" else ()
        return {"kind": "text", "source": value, **{k: spec[k] for k in keep if k in spec}}
    out: dict[str, Any] = {"kind": "images", "path": value}
    if kind in ("images", "sample_photos"):
        out.update({k: spec[k] for k in ("preprocess", "seed", "input", "limit") if k in spec})
        if kind == "sample_photos" and "count" in spec:
            out["limit"] = spec["count"]
    return out


EXIT_OK, EXIT_BUG, EXIT_USER, EXIT_KERNELS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
"""Exit codes: 0 ok; 1 an internal error (a bug: the traceback is saved, its path printed); 2 an error in
what the user gave (recipe, model, data, output folder); 3 ``verify``: the kernels part from the QDQ math;
130 interrupted (Ctrl-C or SIGTERM)."""


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def _setup_logging(verbose: bool = False) -> None:
    """One stderr handler however often :func:`main` is called (tests, notebooks); DEBUG with ``--verbose``."""
    qlog = logging.getLogger("quantkit")
    for h in list(qlog.handlers):
        if getattr(h, "_quantkit_cli", False):
            qlog.removeHandler(h)
    handler = logging.StreamHandler()  # binds the current sys.stderr
    handler.setFormatter(logging.Formatter("quantkit: %(message)s"))
    handler._quantkit_cli = True  # type: ignore[attr-defined]
    qlog.addHandler(handler)
    qlog.setLevel(logging.DEBUG if verbose else logging.INFO)
    qlog.propagate = False


def _save_traceback() -> str:
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="quantkit-crash-", suffix=".txt")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        traceback.print_exc(file=fh)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see :data:`EXIT_OK` ...)."""
    import signal

    args = _build_parser().parse_args(argv)
    _setup_logging(bool(getattr(args, "verbose", False)))
    previous = None
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not in the main thread: leave signals alone
        previous = None
    try:
        return _main(args)
    except BrokenPipeError:  # `quantkit validate R | head`: the reader went away
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - swallow the flush at exit
        except OSError:
            pass
        return EXIT_OK
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    from quantkit.report.output import SaveInterrupted

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.version:
        from quantkit import __version__

        print(__version__)
        return 0
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "validate":
            from quantkit.recipe import load_recipe

            if (args.recipe is None) == (args.recipe_opt is None):
                raise QuantkitError("validate takes one recipe: quantkit validate RECIPE.yaml (or --recipe RECIPE.yaml)")
            rec = load_recipe(args.recipe or args.recipe_opt)
            print(rec.model_dump_json(indent=2))
            return 0
    except QuantkitError as exc:
        print(f"quantkit: error: {exc}", file=sys.stderr)
        return EXIT_USER
    except SaveInterrupted as exc:
        print(f"quantkit: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt as exc:
        what = "terminated (SIGTERM)" if isinstance(exc, _Terminated) else "interrupted"
        print(f"quantkit: {what}; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - an internal bug: a short message, the traceback in a file
        path = _save_traceback()
        print(f"quantkit: internal error ({type(exc).__name__}: {exc}); this is a bug in quantkit. The full "
              f"traceback is in {path}", file=sys.stderr)
        return EXIT_BUG
    _build_parser().print_help()
    return EXIT_BUG


def _load(args: argparse.Namespace) -> Any:
    """The recipe with the command line's overrides; it remembers its file (an input never written over)."""
    from quantkit.recipe import load_recipe

    rec = load_recipe(_override(args.recipe, args))
    if rec._origin is None:
        rec._origin = str(Path(args.recipe).resolve())
    return rec


def _refuse_unbuildable_decoder(args: argparse.Namespace) -> None:
    """``calibration.layerwise: true`` on a Hugging Face folder: its ``config.json`` is checked against the decoder
    families (:func:`quantkit.frontends.families.read_config`: the ``model_type`` and every value the builder relies
    on) before onnx, onnx_ir, onnxruntime, torch or transformers are imported and before any tokenization or
    calibration, so an unsupported family is refused at once (exit 2), naming the supported ``model_type`` values and
    what to try instead.  It reports only what the full run would refuse anyway (the same check, the same message);
    anything it cannot decide from the recipe file alone - an unreadable recipe, another source, ``layerwise`` not
    literally true - is left to the full run."""
    from quantkit.frontends.families import read_config
    from quantkit.recipe.load import _resolve_one, safe_load_yaml

    path = Path(args.recipe)
    try:
        data = safe_load_yaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, QuantkitError):
        return
    if not isinstance(data, dict):
        return
    cal, model = data.get("calibration"), data.get("model")
    if not isinstance(cal, dict) or cal.get("layerwise") is not True:
        return
    if args.model:
        source = args.model  # as _override sets it: relative to the working directory
    elif isinstance(model, dict) and isinstance(model.get("source"), str):
        try:
            source = _resolve_one(model["source"], path.resolve().parent, "model.source", str(path))
        except QuantkitError:
            return
    else:
        return
    if Path(source).is_dir():  # as quantkit.llm_run.resolve_llm_folder finds the folder
        read_config(source)


def _calibrate(args: argparse.Namespace) -> int:
    _refuse_unbuildable_decoder(args)  # before the imports below (about 1.5 s of them)
    from quantkit.api import quantize
    from quantkit.recipe.load import recipe_inputs
    from quantkit.report.build import class_grid_line, greedy_line, int4_kernel_line, latency_per, w4a8_line
    from quantkit.report.output import check_output_dir

    rec = _load(args)
    out = Path(args.output) if args.output else Path("out") / rec.name
    check_output_dir(out, overwrite=args.overwrite, inputs=recipe_inputs(rec))  # before any work, not after it
    result = quantize(
        recipe=rec,
        progress=not args.quiet,
        measure_latency=False if args.no_latency else None,
        use_cache=not args.no_cache,
    )
    paths = result.save(out, overwrite=args.overwrite)
    rep = result.report
    print(f"quantized {len(rep['layers'])} layers; model: {paths['model']}")
    for k, p in paths.items():
        if k != "model":
            print(f"{k}: {p}")
    lat = rep.get("latency") or {}
    if "fp32" in lat:
        print(
            f"latency: FP32 {lat['fp32']['median_ms']:.2f} ms, quantized {lat['quantized']['median_ms']:.2f} ms "
            f"({lat['speedup']:.2f}x)"
        )
    for key in ("prefill", "prefill_long", "decode"):
        if key in lat:
            r = lat[key]
            print(
                f"latency [{r['label']}], {latency_per(key, r)}: FP32 {r['fp32_ms']:.2f} ms, quantized "
                f"{r['quantized_ms']:.2f} ms ({r['speedup']:.2f}x)"
            )
    for name, d in rep.get("fidelity", {}).items():
        shown = ", ".join(f"{k}={v:.4f}" for k, v in d.items() if k not in ("samples", "labelled_samples"))
        print(f"fidelity[{name}]: {shown}")
    q = rep.get("quality", {})
    if "perplexity_fp32" in q:
        print(
            f"perplexity: FP32 {q['perplexity_fp32']['ppl']:.3f}, quantized {q['perplexity_quantized']['ppl']:.3f} "
            f"({100 * q['perplexity_increase']:+.1f}%)"
        )
    for label, row in (q.get("perplexity_extra") or {}).items():
        if "increase" in row:
            print(f"perplexity [{label}]: FP32 {row['fp32']['ppl']:.3f}, quantized {row['quantized']['ppl']:.3f} "
                  f"({100 * row['increase']:+.1f}%)")
    print(
        f"size: {rep['size']['fp32_bytes'] / 2**20:.1f} MiB -> {rep['size']['quantized_bytes'] / 2**20:.1f} MiB "
        f"({rep['size']['ratio']:.3f})"
    )
    if rep.get("int4_kernel"):
        print(int4_kernel_line(rep["int4_kernel"]))
    if rep.get("by_cpu_class"):
        print(class_grid_line(rep["by_cpu_class"]))
    if rep.get("w4a8_check"):
        print(w4a8_line(rep["w4a8_check"], rep.get("int4_kernel")))
    if "greedy_agreement" in q:
        print(greedy_line(q["greedy_agreement"]))
    kern = rep.get("kernels") or {}
    if kern:
        tgt, cpu, chk = kern.get("target", {}), kern.get("cpu", {}), kern.get("check")
        port = (kern.get("portability") or {}).get("classes") or {}
        exact = [c for c, v in port.items() if v.get("exact")]
        line = (f"int8 kernels: target {tgt.get('isa')} ({tgt.get('cpu_class')}), this CPU {cpu.get('cpu_class')}; "
                f"exact for every input on: {', '.join(exact) or 'none'}")
        if chk:
            line += (f"; fused kernels vs QDQ math on {chk['samples']} samples: "
                     + ("agree" if chk.get("agree") else "DISAGREE"))
        elif kern.get("check_skipped"):
            line += f"; fused kernels vs QDQ math: not checked ({kern['check_skipped']})"
        print(line)
    for w in rep.get("warnings", []):
        print(f"WARNING: {w}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Exit 0 when this CPU's kernels compute the model's QDQ math (or no data was given), 3 when not."""
    from quantkit.pipeline import verify_model

    if args.samples < 1:
        raise QuantkitError(f"--samples {args.samples}: allowed: an integer >= 1 (the samples to compare)")
    rep = verify_model(args.model, args.data, samples=args.samples)
    tgt, cpu = rep["target"], rep["cpu"]
    print(f"model target: {tgt['isa']} ({tgt['cpu_class']}); this CPU: {cpu['model_name']}, class {cpu['cpu_class']}")
    for cls, v in rep["portability"]["classes"].items():
        print(f"  {cls:<9} exact for every input: {'yes' if v['exact'] else 'NO '}  {v['why']}")
    chk = rep.get("check")
    if chk:
        outs = "; ".join(f"{k}: SQNR {v['sqnr_db']:.1f} dB" + (f", top-1 {v['top1_agreement']:.3f}"
                                                              if "top1_agreement" in v else "")
                         for k, v in chk["outputs"].items())
        print(f"fused kernels vs QDQ math on {chk['samples']} samples: {'agree' if chk['agree'] else 'DISAGREE'} "
              f"({outs})")
    else:
        print("no --data: only the weights were checked")
    for w in rep["warnings"]:
        print(f"WARNING: {w}")
    return 0 if rep["ok"] else 3


def _generate(args: argparse.Namespace) -> int:
    """Prefill the prompt, then one token per step with the KV cache; print the text and the timings."""
    from quantkit.errors import ModelError
    from quantkit.frontends.llm_builder import ContextFullError, generate

    path = Path(args.model)
    model = path / "model.onnx" if path.is_dir() else path
    if not model.is_file():
        raise ModelError(f"--model {args.model!r}: no model.onnx there (give an output folder or its model.onnx)")
    tok = Path(args.tokenizer) if args.tokenizer else model.parent
    if not any((tok / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelError(f"no tokenizer files in {str(tok)!r}: pass --tokenizer FOLDER")
    if args.max_new_tokens < 1:
        raise QuantkitError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    try:
        out = generate(model, tok, args.prompt, args.max_new_tokens, threads=args.threads, return_timings=True)
    except ContextFullError as exc:  # the text so far is printed, then why it stopped
        print(args.prompt + exc.text)
        print(f"quantkit: error: {exc}", file=sys.stderr)
        return EXIT_USER
    if not isinstance(out, tuple):  # pragma: no cover - return_timings=True returns a pair
        raise QuantkitError("generate returned no timings")
    text, t = out
    print(args.prompt + text)
    steps = t["decode_ms"]
    per = f", decode {sorted(steps)[len(steps) // 2]:.1f} ms/token (median of {len(steps)})" if steps else ""
    print(f"[{len(t['tokens'])} tokens; prefill {t['prefill_ms']:.1f} ms{per}]", file=sys.stderr)
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from quantkit.search.sweep import sweep

    rec = _load(args)
    out = Path(args.output) if args.output else Path("out") / f"{rec.name}-sweep"
    res = sweep(recipe=rec, output=out, overwrite=args.overwrite, progress=not args.quiet,
                use_cache=not args.no_cache, save_models=not args.no_models, ray_address=args.ray)
    r = res.report
    key, label = r["quality_key"], r["quality_label"]
    fp = r["fp32"]
    print(
        f"FP32: {label} {fp.get(key, float('nan')):.4g}, latency {fp['latency_ms']:.2f} ms, "
        f"size {fp['size_bytes'] / 1e6:.1f} MB"
    )
    print(f"{'point':<34} {'pred. damage':>12} {label:>16} {'ms':>8} {'xFP32':>6} {'MB':>8}  front(lat/size)")
    for p in res.points:
        m = p.measured
        fr = "/".join("on" if p.on_measured_front.get(a) else "DOMINATED" for a in ("latency", "size"))
        print(
            f"{p.id[:34]:<34} {p.predicted['damage']:>12.4g} {m.get(key, float('nan')):>16.4g} "
            f"{m['latency_ms']:>8.2f} {m['speedup_vs_fp32']:>6.2f} {m['size_bytes'] / 1e6:>8.1f}  {fr}"
        )
    print(f"Spearman(predicted damage, measured {label}) = {r['spearman_predicted_damage_vs_measured']:.3f}")
    files = [pth for k, pth in res.paths.items() if not k.startswith("assignment:")]
    csvs = sorted({pth.parent for k, pth in res.paths.items() if k.startswith("assignment:")})
    for f in files:  # each output once
        print(f"wrote {f}")
    for d in csvs:
        n = sum(1 for k, pth in res.paths.items() if k.startswith("assignment:") and pth.parent == d)
        print(f"per-layer assignments: {d} ({n} CSV files, one per point)")
    models = [p.model_path for p in res.points if p.model_path]
    if models:
        print(f"models of the points: {Path(models[0]).parent.parent} ({len(models)} folders)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
