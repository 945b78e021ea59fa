"""INT8 static quantization of a small residual CNN (residual Adds + a channel Concat) trained on
Fashion-MNIST: quantkit, per CPU target, against ONNX Runtime's ``quantize_static``, same run.

What it measures, on the full Fashion-MNIST test set (10k images unless ``--eval-count``):

* accuracy of the FP32 model and of every quantized model as users run it, with ONNX Runtime's fused
  integer kernels (``ORT_ENABLE_ALL``), and of the same quantized model run as plain QDQ math
  (``ORT_DISABLE_ALL``, the reference the quantizer designs for);
* top-1 agreement of each quantized model with FP32;
* whether the fused kernels agree with the QDQ math (quantkit: its own kernel check in the report;
  ONNX Runtime baselines: fused and QDQ-math predictions agree on >= 99% of the test images);
* whether the int8 arithmetic is exact on saturating x86-avx2 CPUs (from the weights);
* batch-1 latency of every model, interleaved in one run.

Data and model: Fashion-MNIST comes from Debian's ``dataset-fashion-mnist`` package (``apt-get
download`` + ``dpkg-deb -x``, cached under ``$QUANTKIT_CACHE/fashion-mnist`` or
``~/.cache/quantkit/fashion-mnist``).  The CNN (~90k parameters) is trained here with a fixed seed on
the CPU and cached as ONNX, so reruns skip training (``--retrain`` forces it).  Calibration uses 256
*training* images; nothing is tuned to this data.

Usage::

    python eval/bench_residual_cnn.py
    python eval/bench_residual_cnn.py --targets auto,portable --eval-count 2000 --out results.json
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_VERSION = "rescnn-v1"  # bump when the architecture or the training recipe changes
SEED = 0
BATCH = 128
LR = 2e-3
CAL_COUNT = 256
QK_EVAL_COUNT = 1000  # test images handed to quantize() for its own fidelity report and kernel check
IDX_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


def stage(msg: str) -> None:
    """Print a stage message (flushed, so it interleaves properly with progress bars)."""
    print(f"\n== {msg}", flush=True)


# ---------------------------------------------------------------------------------------- data
def cache_root() -> Path:
    """``$QUANTKIT_CACHE/fashion-mnist`` if set, else ``~/.cache/quantkit/fashion-mnist``."""
    base = os.environ.get("QUANTKIT_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "quantkit"
    return root / "fashion-mnist"


def fetch_fashion_mnist(root: Path) -> Path:
    """Download and extract Debian's ``dataset-fashion-mnist``; return the folder with the IDX files."""
    data_dir = root / "usr" / "share" / "datasets" / "fashion-mnist"
    if all((data_dir / f).is_file() for f in IDX_FILES.values()):
        print(f"dataset already extracted in {data_dir}")
        return data_dir
    root.mkdir(parents=True, exist_ok=True)
    debs = sorted(root.glob("dataset-fashion-mnist_*.deb"))
    if not debs:
        print(f"apt-get download dataset-fashion-mnist (into {root})", flush=True)
        proc = subprocess.run(["apt-get", "download", "dataset-fashion-mnist"], cwd=root,
                              capture_output=True, text=True)
        debs = sorted(root.glob("dataset-fashion-mnist_*.deb"))
        if proc.returncode != 0 or not debs:
            raise SystemExit(f"apt-get download dataset-fashion-mnist failed (exit {proc.returncode}):\n"
                             f"{proc.stdout}{proc.stderr}")
    deb = debs[-1]
    print(f"dpkg-deb -x {deb.name} {root}", flush=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    missing = [f for f in IDX_FILES.values() if not (data_dir / f).is_file()]
    if missing:
        listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True).stdout
        raise SystemExit(f"{deb.name} does not hold {missing} under {data_dir}; it holds:\n{listing}")
    return data_dir


def read_idx(path: Path) -> np.ndarray:
    """Parse a gzip-compressed IDX file (unsigned-byte data) into an array."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = raw[0] * 256 + raw[1], raw[2], raw[3]
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} bytes")
    return data.reshape(dims)


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 [N,28,28] -> float32 [N,1,28,28] in [-1, 1] (the model's input)."""
    return ((images.astype(np.float32) / 255.0 - 0.5) / 0.5)[:, None]


def load_data(data_dir: Path) -> dict[str, np.ndarray]:
    """The four Fashion-MNIST arrays, images as uint8 [N,28,28], labels as int64 [N]."""
    out = {k: read_idx(data_dir / f) for k, f in IDX_FILES.items()}
    for k in ("train_labels", "test_labels"):
        out[k] = out[k].astype(np.int64)
    return out


# ---------------------------------------------------------------------------------------- model
def build_model() -> Any:
    """A small CNN with two residual Adds and one channel Concat (~90k parameters)."""
    import torch
    from torch import nn

    def cbr(cin: int, cout: int, k: int = 3, stride: int = 1, relu: bool = True) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]
        if relu:
            layers.append(nn.ReLU(inplace=True))
        return nn.Sequential(*layers)

    class Residual(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.body = nn.Sequential(cbr(c, c), cbr(c, c, relu=False))
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.body(x) + x)

    class Branches(nn.Module):
        def __init__(self, cin: int, c1: int, c3: int) -> None:
            super().__init__()
            self.b1 = cbr(cin, c1, k=1)
            self.b3 = cbr(cin, c3, k=3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.b1(x), self.b3(x)], dim=1)

    class ResidualCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                cbr(1, 32, stride=2),  # 28 -> 14
                Residual(32),
                cbr(32, 48, stride=2),  # 14 -> 7
                Branches(48, 24, 24),  # concat -> 48 channels
                Residual(48),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            )
            self.head = nn.Linear(48, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x))

    return ResidualCNN()


def train_and_export(data: dict[str, np.ndarray], epochs: int, path: Path) -> dict[str, Any]:
    """Train the CNN on the CPU (fixed seed) and export it to ONNX at ``path``."""
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    model = build_model()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params} parameters; training {epochs} epoch(s), batch {BATCH}, Adam lr {LR}", flush=True)
    x = torch.from_numpy(normalise(data["train_images"]))
    y = torch.from_numpy(data["train_labels"])
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    steps = epochs * ((len(x) + BATCH - 1) // BATCH)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=steps, pct_start=0.15)
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x), generator=gen)
        total, correct, loss_sum = 0, 0, 0.0
        for i in range(0, len(x), BATCH):
            idx = perm[i : i + BATCH]
            logits = model(x[idx])
            loss = torch.nn.functional.cross_entropy(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
            loss_sum += loss.item() * len(idx)
        print(f"  epoch {epoch + 1}/{epochs}: loss {loss_sum / total:.4f}, train acc {100 * correct / total:.2f}%"
              f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    export_onnx(model, path)
    return {"params": params, "epochs": epochs, "train_s": train_s}


def export_onnx(model: Any, path: Path) -> None:
    """Export with the TorchScript exporter (dynamic batch); fall back to the dynamo exporter."""
    import torch

    example = torch.from_numpy(np.zeros((2, 1, 28, 28), np.float32))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    try:
        torch.onnx.export(model.eval(), (example,), str(tmp), input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}}, opset_version=17, dynamo=False)
    except Exception as exc:  # noqa: BLE001 - any exporter failure: try the other exporter
        print(f"torch.onnx.export(dynamo=False) failed ({type(exc).__name__}: {exc}); trying dynamo=True",
              flush=True)
        torch.onnx.export(model.eval(), (example,), str(tmp), input_names=["input"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("N")},), opset_version=17, dynamo=True,
                          external_data=False)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- evaluation
def batches(x: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for i in range(0, len(x), size):
        yield x[i : i + size]


def predict(session: Any, x: np.ndarray, batch: int = 500) -> np.ndarray:
    """Top-1 class of every image, from an ONNX Runtime session."""
    return np.concatenate([np.argmax(session.run(["logits"], {"input": b})[0], axis=1) for b in batches(x, batch)])


def ort_baseline(fp32_path: Path, cal: np.ndarray, out_path: Path, reduce_range: bool) -> None:
    """ONNX Runtime's ``quantize_static``: QDQ, per-channel QInt8 weights, QUInt8 activations, MinMax."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it = iter([{"input": cal[i : i + 1]} for i in range(len(cal))])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._it, None)

    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="ort-quant-") as tmp:
        os.chdir(tmp)  # ORT writes augmented models and calibration files into the cwd
        try:
            quantize_static(str(fp32_path), str(out_path), Reader(), quant_format=QuantFormat.QDQ,
                            per_channel=True, reduce_range=reduce_range, activation_type=QuantType.QUInt8,
                            weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
        finally:
            os.chdir(cwd)


def fmt_table(rows: list[dict[str, Any]]) -> str:
    """The results as a fixed-width text table."""
    head = ["method", "acc fused %", "acc QDQ-math %", "delta pts", "top-1 agree", "kernels=QDQ",
            "exact x86-avx2", "latency ms", "speedup"]

    def cell(v: Any, f: str = "") -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return format(v, f)

    lines = []
    for r in rows:
        lines.append([
            r["method"], cell(r["acc_fused"], ".2f"), cell(r["acc_qdq"], ".2f"), cell(r["delta_pts"], "+.2f"),
            cell(r["top1_agree_fp32"], ".4f"), cell(r["kernels_agree"]), cell(r["exact_x86_avx2"]),
            cell(r["latency_ms"], ".3f"), cell(r["speedup"], ".2f"),
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3, help="training epochs (default 3)")
    ap.add_argument("--targets", default="auto,portable,x86-vnni",
                    help="comma-separated quantkit target.isa values (default auto,portable,x86-vnni)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--eval-count", type=int, default=10000, help="test images to evaluate (default 10000)")
    ap.add_argument("--retrain", action="store_true", help="train again even if a cached model exists")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import onnx
    import onnx_ir as ir
    from provenance import run_record

    from quantkit.api import quantize
    from quantkit.evaluate.latency import compare_latency, make_session
    from quantkit.lowering.kernel_check import portability
    from quantkit.report.build import environment
    from quantkit.scheme.target import detect_cpu

    env = {**environment(), **run_record()}
    cpu = detect_cpu().as_dict()
    stage("environment")
    for k, v in env.items():
        print(f"  {k}: {v}")
    print(f"  cpu class: {cpu['cpu_class']} (flags: {', '.join(cpu['flags'])})")  # type: ignore[arg-type]

    root = cache_root()
    stage(f"data: Fashion-MNIST (cache {root})")
    data = load_data(fetch_fashion_mnist(root))
    print(f"  train {data['train_images'].shape}, test {data['test_images'].shape}")

    stage("model")
    onnx_path = root / f"{MODEL_VERSION}-e{args.epochs}-s{SEED}.onnx"
    info_path = onnx_path.with_suffix(".json")
    if onnx_path.is_file() and info_path.is_file() and not args.retrain:
        model_info = json.loads(info_path.read_text())
        print(f"  using cached {onnx_path} (trained {model_info['epochs']} epochs in {model_info['train_s']:.0f} s)")
    else:
        model_info = train_and_export(data, args.epochs, onnx_path)
        info_path.write_text(json.dumps(model_info))
        print(f"  exported {onnx_path}")
    fp32_bytes = onnx_path.read_bytes()

    n_eval = min(args.eval_count, len(data["test_images"]))
    x_test = normalise(data["test_images"][:n_eval])
    y_test = data["test_labels"][:n_eval]
    work = Path(tempfile.mkdtemp(prefix="bench-rescnn-"))
    atexit.register(shutil.rmtree, work, True)  # calibration npz and ORT models
    npz_path = work / "calibration.npz"
    cal = normalise(data["train_images"][:CAL_COUNT])  # training images, never test ones
    np.savez(npz_path, input=cal)
    print(f"  calibration: {npz_path} ({CAL_COUNT} training images); evaluation: {n_eval} test images")

    models: dict[str, bytes] = {"fp32": fp32_bytes}
    meta: dict[str, dict[str, Any]] = {"fp32": {}}
    quantize_s: dict[str, float] = {}
    qk_eval = [{"input": b} for b in batches(x_test[:QK_EVAL_COUNT], 100)]
    for isa in [t.strip() for t in args.targets.split(",") if t.strip()]:
        stage(f"quantkit: target.isa={isa}")
        recipe = {"version": 1, "name": "residual-cnn", "target": {"isa": isa},
                  "calibration": {"data": {"kind": "npz", "path": str(npz_path)}, "batch_size": 32},
                  "evaluation": {"metric": "classification"},
                  "report": {"latency": {"enabled": False}, "kernel_check_samples": 16}}
        t = time.perf_counter()
        res = quantize(str(onnx_path), None, recipe, evaluation_data=qk_eval, progress=True)
        quantize_s[isa] = time.perf_counter() - t
        kernels = res.report["kernels"]
        name = f"quantkit {isa}" + (f" ({kernels['target']['cpu_class']})" if isa == "auto" else "")
        models[name] = ir.to_proto(res.model).SerializeToString()
        meta[name] = {
            "kernels_agree": bool(kernels.get("check", {}).get("agree")) if "check" in kernels else None,
            "exact_x86_avx2": bool(kernels["portability"]["classes"]["x86-avx2"]["exact"]),
            "target": kernels["target"], "quantize_s": quantize_s[isa],
            "kernel_check_outputs": kernels.get("check", {}).get("outputs"),
            "layers_at_risk": len(kernels["portability"]["layers_at_risk"]),
        }
        print(f"  quantized in {quantize_s[isa]:.1f} s; kernels agree: {meta[name]['kernels_agree']}, "
              f"exact on x86-avx2: {meta[name]['exact_x86_avx2']}", flush=True)

    for reduce_range in (False, True):
        name = "ORT quantize_static" + (" reduce_range" if reduce_range else "")
        stage(name)
        path = work / f"ort{'-rr' if reduce_range else ''}.onnx"
        t = time.perf_counter()
        ort_baseline(onnx_path, cal, path, reduce_range)
        models[name] = path.read_bytes()
        meta[name] = {"exact_x86_avx2": bool(portability(onnx.load(path))["classes"]["x86-avx2"]["exact"]),
                      "quantize_s": time.perf_counter() - t}
        print(f"  quantized in {meta[name]['quantize_s']:.1f} s", flush=True)

    stage(f"accuracy on {n_eval} test images (fused = ORT_ENABLE_ALL, QDQ-math = ORT_DISABLE_ALL)")
    preds: dict[str, np.ndarray] = {}
    rows: list[dict[str, Any]] = []
    sessions = {}
    for name, blob in models.items():
        sessions[name] = make_session(blob)
        preds[name] = predict(sessions[name], x_test)
        row: dict[str, Any] = {"method": name, "acc_fused": 100 * float(np.mean(preds[name] == y_test)),
                               "acc_qdq": None, "delta_pts": None, "top1_agree_fp32": None,
                               "kernels_agree": None, "exact_x86_avx2": None, **meta[name]}
        if name != "fp32":
            p_ref = predict(make_session(blob, level="disabled"), x_test)
            row["acc_qdq"] = 100 * float(np.mean(p_ref == y_test))
            row["delta_pts"] = row["acc_fused"] - rows[0]["acc_fused"]
            row["top1_agree_fp32"] = float(np.mean(preds[name] == preds["fp32"]))
            row["fused_vs_qdq_agreement"] = float(np.mean(preds[name] == p_ref))
            if row["kernels_agree"] is None:  # ORT baselines: judge by the predictions
                row["kernels_agree"] = row["fused_vs_qdq_agreement"] >= 0.99
        print(f"  {name}: {row['acc_fused']:.2f}%", flush=True)
        rows.append(row)

    stage("batch-1 latency (interleaved, warmup 10, repeat 100)")
    lat = compare_latency(sessions, {"input": np.ascontiguousarray(x_test[:1])}, warmup=10, repeat=100)
    for row in rows:
        row["latency_ms"] = lat[row["method"]].median_ms
        row["speedup"] = lat["fp32"].median_ms / max(lat[row["method"]].median_ms, 1e-9)
        row["latency"] = lat[row["method"]].as_dict()

    wall = time.perf_counter() - t_start
    stage(f"results: Fashion-MNIST residual CNN ({model_info['params']} params), {n_eval} test images")
    print(f"cpu: {env['cpu']} ({cpu['cpu_class']}), {env['cores']} cores; onnxruntime {env['onnxruntime']}, "
          f"quantkit {env['quantkit']}")
    print(fmt_table(rows))
    print("delta: fused accuracy minus FP32, in points; top-1 agree: fused predictions equal to FP32's; "
          "kernels=QDQ: quantkit's kernel check / ORT rows fused-vs-QDQ predictions agree >= 99%; "
          "speedup: FP32 median ms / median ms")
    print(f"total wall time: {wall:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"environment": env, "cpu": cpu, "model": model_info,
                                        "onnx": str(onnx_path), "eval_count": n_eval,
                                        "calibration_count": CAL_COUNT, "rows": rows, "wall_s": wall},
                                       indent=2, default=str))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
