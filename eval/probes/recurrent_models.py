"""Probe: recurrent models a user brings, through quantkit's default recipe beside ONNX Runtime's own quantizer.

Three models with random weights (torch, exported by the dynamo exporter as a user would): a 2-layer bidirectional
LSTM text classifier over a 30522-word embedding, a GRU classifier of the same shape (one direction), and a
speech-style net (two strided ``Conv1d`` then a GRU, per-frame logits).  Text models read token ids of real English
text (Python's reference docs, BERT's tokenizer, as the zoo's encoders do); the speech-style net random features.

For each: ``quantkit.quantize`` on the ONNX file with the default recipe (its latency guard on), and ONNX Runtime's
``quantize_dynamic`` (its LSTM quantizer: ``DynamicQuantizeLSTM``, ``MatMulInteger`` for the rest; ORT's static QDQ
quantizer has no recurrent kernel) - output SQNR against FP32 on held-out inputs, batch-1 latency of the three
interleaved in one process, file size.

Usage::

    python eval/probes/recurrent_models.py --out eval/results/recurrent_x86-vnni.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent / "zoo"))


def _models() -> dict[str, Any]:
    import torch

    vocab, emb, hidden = 30522, 128, 256

    class TextRnn(torch.nn.Module):
        def __init__(self, cell: str, bidirectional: bool) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, emb)
            rnn = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
            self.rnn = rnn(emb, hidden, num_layers=2, batch_first=True, bidirectional=bidirectional)
            self.head = torch.nn.Linear(hidden * (2 if bidirectional else 1), 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(self.emb(input_ids))[0].mean(1))

    class ConvGru(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Sequential(torch.nn.Conv1d(40, 128, 5, 2, 2), torch.nn.ReLU(),
                                            torch.nn.Conv1d(128, 128, 5, 2, 2), torch.nn.ReLU())
            self.gru = torch.nn.GRU(128, 192, batch_first=True)
            self.head = torch.nn.Linear(192, 30)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.head(self.gru(self.conv(features).transpose(1, 2))[0])

    torch.manual_seed(0)
    return {"bilstm": TextRnn("lstm", True).eval(), "gru": TextRnn("gru", False).eval(), "conv_gru": ConvGru().eval()}


def _data(name: str, work: Path) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    if name == "conv_gru":
        rng = np.random.default_rng(0)
        make = [{"features": rng.standard_normal((1, 40, 200)).astype(np.float32)} for _ in range(32)]
        return make[:16], make[16:]
    from zoo_models import text_npz

    out = []
    for split in ("calibration", "evaluation"):
        p = work / f"{split}.npz"
        text_npz(p, split, 16, 64)
        ids = np.load(p)["input_ids"]
        out.append([{"input_ids": ids[i:i + 1]} for i in range(len(ids))])
    return out[0], out[1]


def _sqnr(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    r, g = np.concatenate([x.ravel() for x in ref]), np.concatenate([x.ravel() for x in got])
    return float(10 * np.log10(np.sum(r.astype(np.float64) ** 2) / max(np.sum((r - g).astype(np.float64) ** 2), 1e-30)))


def run(repeat: int) -> dict[str, Any]:
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    import quantkit
    from quantkit.evaluate.latency import compare_latency, make_session

    rows: dict[str, Any] = {}
    for name, module in _models().items():
        with tempfile.TemporaryDirectory(prefix="recurrent-") as tmp:
            work = Path(tmp)
            cal, ev = _data(name, work)
            src, ort_path, qk_path = work / "fp32.onnx", work / "ort.onnx", work / "quantkit.onnx"
            key = next(iter(cal[0]))
            batch = torch.export.Dim("batch", min=1, max=64)
            torch.onnx.export(module, (torch.from_numpy(cal[0][key]),), str(src), input_names=[key],
                              output_names=["logits"], dynamo=True, external_data=False,
                              dynamic_shapes={key: {0: batch}})
            t = time.perf_counter()
            res = quantkit.quantize(str(src), cal, {"version": 1, "name": name}, evaluation_data=ev, progress=False)
            qk_s = time.perf_counter() - t
            import onnx_ir as ir

            ir.save(res.model, str(qk_path))
            t = time.perf_counter()
            quantize_dynamic(str(src), str(ort_path), weight_type=QuantType.QInt8, per_channel=True)
            ort_s = time.perf_counter() - t
            sessions = {k: make_session(str(p)) for k, p in (("fp32", src), ("quantkit", qk_path), ("ort", ort_path))}
            outs = {k: [s.run(None, f)[0] for f in ev] for k, s in sessions.items()}
            lat = compare_latency(sessions, ev[0], warmup=5, repeat=repeat, rounds=10)
            census = res.report["census"]["quantized_kernels"]
            kinds = {}
            for k, p in (("ort", ort_path),):
                import collections

                import onnx

                kinds[k] = dict(collections.Counter(n.op_type for n in onnx.load(str(p)).graph.node
                                                    if n.domain == "com.microsoft" or "Integer" in n.op_type))
            rows[name] = {
                "quantkit": {"sqnr_db": _sqnr(outs["fp32"], outs["quantkit"]), "kernels": census,
                             "x_fp32": lat["fp32"].median_ms / lat["quantkit"].median_ms,
                             "size_ratio": qk_path.stat().st_size / src.stat().st_size, "wall_s": qk_s,
                             "guard": (res.report.get("latency_guard") or {}).get("decision")},
                "ort_quantize_dynamic": {"sqnr_db": _sqnr(outs["fp32"], outs["ort"]), "kernels": kinds["ort"],
                                         "x_fp32": lat["fp32"].median_ms / lat["ort"].median_ms,
                                         "size_ratio": ort_path.stat().st_size / src.stat().st_size, "wall_s": ort_s},
                "fp32_ms": lat["fp32"].median_ms,
            }
            del sessions
            print(name, json.dumps(rows[name]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from provenance import run_record

    from quantkit.report.build import environment
    from quantkit.scheme.target import detect_cpu

    load0 = [round(x, 2) for x in os.getloadavg()]
    rows = run(args.repeat)
    env = {**environment(), **run_record(), "cpu": detect_cpu().model_name or platform.machine(),
           "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
           "load_average": {"start": load0, "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.out:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
