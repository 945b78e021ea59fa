"""The memory guard: a run's peak memory is estimated before any work, compared with the memory available, and
measured while the run goes.

* :func:`available_memory` - what this run may use: the memory the system still has (psutil) or the room under
  the container's cgroup limit, whichever is smaller, plus what the process already holds; or the limit set in
  ``QUANTKIT_MEMORY_LIMIT`` (``"3GB"``, ``"512MiB"``, a number of bytes) or passed as ``limit=``, which stands for
  all of it (tests, a shared machine).
* estimates, from ``config.json`` and the weight sizes in the checkpoint's headers (safetensors headers, ONNX
  external-data file sizes; no tensor is read): :func:`layerwise_estimate` (a decoder streamed block by block,
  :mod:`quantkit.layerwise`), :func:`whole_graph_estimate` (the FP32 model held and run whole), one
  :class:`Estimate` per run with its peak per phase.
* :func:`check_fits` - a :class:`~quantkit.errors.MemoryBudgetError` naming the estimate, the memory available
  and the setting that fits, before any work; :func:`announce` - the line every LLM run prints at its start
  (``memory: expected peak ~X GB of Y GB available ...``).
* :func:`choose_baseline` - how a layer-wise run evaluates its FP32 baseline (``evaluation.fp32_baseline``): held
  whole, or streamed block by block (:mod:`quantkit.evaluate.streamed`) when the FP32 weights are larger than the
  streamed run's own estimated peak, decided from the estimates before any work.
* :class:`PeakMeter` - the measured peak of the process and its children (the summed RSS, sampled, and the
  process's own high-water mark, reset at the start), which the report records beside the estimate.

The coefficients below were fitted to measured peaks (per phase, on synthetic LLaMA-shaped folders; whole runs:
``eval/bench_memory_estimate.py``, ``eval/results/memory_estimate.json``): each names the arrays it stands for.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import MemoryBudgetError, QuantkitError

log = logging.getLogger("quantkit")

__all__ = [
    "ENV_LIMIT",
    "BASELINE_SETTINGS",
    "Available",
    "Baseline",
    "DecoderSizes",
    "Estimate",
    "PeakMeter",
    "announce",
    "available_memory",
    "check_fits",
    "choose_baseline",
    "decoder_sizes",
    "gb",
    "latency_phase",
    "layerwise_estimate",
    "onnx_weight_bytes",
    "parse_bytes",
    "process_tree_rss",
    "run_floor",
    "whole_graph_estimate",
]

ENV_LIMIT = "QUANTKIT_MEMORY_LIMIT"
"""Environment variable: the memory a run may use (bytes, or a number with kB / MB / GB / KiB / MiB / GiB)."""

# -- fitted constants (bytes unless said otherwise) ---------------------------------------------------------
BASE_BYTES = 420 << 20
"""Python, numpy, onnx, ONNX Runtime, torch and transformers imported, a tokenizer loaded: a run's floor."""
RTN_TEMP_BYTES = 200 << 20
"""Round-to-nearest of a column slice (16 MB of float32 weights) and the error rows of the report: ~12 slices."""
GPTQ_HESSIAN_COPIES = 1.1
"""GPTQ on a layer with K inputs, beside ``Σxᵀx``: the one ``K x K`` array (float64 up to
:data:`~quantkit.algorithms.gptq.FLOAT64_MAX_K` inputs, float32 above: ``precision: auto``) the damped, reordered
Hessian is gathered into and factorized in place (then the report's float32 ``H / count``), in units of that array
(measured 2026-12-06 on 2 cores: K = 5632, N = 2048 in float32, 0.31 GB above the floor with the band and the slice)."""
GPTQ_FLOAT64_MAX_K = 4096
""":data:`quantkit.algorithms.gptq.FLOAT64_MAX_K` (repeated: this module imports no numerics; a test keeps them equal)."""
GPTQ_BAND_BYTES = 128 << 20
"""GPTQ: the band of float64 Hessian rows gathered at a time (64 MB) and its reordered copy."""
GPTQ_SLICE_COPIES = 1.3
"""GPTQ: the working copies of a column slice of W (the rows in processing order, the codes, the finiteness check)
in units of the slice in the working dtype; slices of 256 MB of float32 (measured: K = 4096, N = 49152 in float32:
1.23)."""
AWQ_WEIGHT_COPIES = 10.0
"""AWQ: float32 copies of a layer's weights alive during the scale search (scaled, rounded, dequantized, the
error; fitted: 1.1B shape, gate_proj and lm_head)."""
SIGNROUND_WEIGHT_COPIES = 20.0
"""SignRound: float32 copies of a layer's weights alive while the rounding is optimised (the weights, the rounding
offsets, their gradient and its sign, the best so far, ...; fitted: 1.1B shape, down_proj 19, lm_head 20)."""
ROUNDED_TABLE_BYTES = 4 + 1
"""A table rounded whole (a tied embedding before the first block, an lm_head after the last): per parameter its
float32 transpose (``quantkit.layerwise._f32_transposed``, converted in row blocks) and the uint8 codes the column
slices are written into; the packed codes and scales (``bits / 8 + 4 / 32``) and the stored tensor come on top.
Measured (int4, RTN, bf16 tables; ``eval/results/embedding_phase.json``)."""
SESSION_COPIES = 2.0
"""A block run in ONNX Runtime to collect statistics: its float32 weights in the serialized graph and in the
session."""
WHOLE_GRAPH_COPIES = 5.5
"""The whole-graph path: the FP32 weights in the loaded model, the prepared copy, the serialized protos handed
to ONNX Runtime, the sessions and the emitted model (measured: 5.7 on SmolLM2, 5.3 on a 2-block 1.1B shape)."""
EVAL_SESSION_COPIES = 1.15
"""A built decoder run in ONNX Runtime: its weights (file bytes) plus the session's own buffers."""
LOGITS_COPIES = 2.0
"""Perplexity of one window: the logits and their log-softmax (float32 ``seq x vocab``; measured on SmolLM2's
512-token windows of a 49152-token vocabulary)."""

_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
STAGE_STATS_BYTES = 1 << 30
"""The statistics (``Σxᵀx``, float64 ``K x K``) one run of a block gathers at most for the layers of one calibration
stage (a mixture of experts: every expert's gate / up, then every expert's down; :mod:`quantkit.layerwise`)."""
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def return_free_memory() -> None:
    """Hand memory this process freed back to the system: a garbage collection, then (Linux, glibc) ``malloc_trim``.

    glibc keeps freed heap memory for reuse, and after a large array is freed it serves arrays up to 32 MB from
    the heap instead of fresh memory maps (its dynamic mmap threshold): a phase that allocates and frees many such
    arrays (the layer-wise build) leaves them counted in the process's RSS until it ends.  Called between phases,
    before the next one's peak (the evaluation's sessions)."""
    import gc
    import sys

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl has no malloc_trim): nothing to hand back this way
            pass


def gb(n: float) -> str:
    """``n`` bytes as ``"1.23 GB"`` (decimal gigabytes; two decimals under 10 GB)."""
    return f"{n / 1e9:.2f} GB" if n < 10e9 else f"{n / 1e9:.1f} GB"


def parse_bytes(text: str | int, where: str = ENV_LIMIT) -> int:
    """``"3GB"`` / ``"512 MiB"`` / ``"2.5e9"`` / ``3000000000`` as bytes; :class:`QuantkitError` naming ``where``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise QuantkitError(f"{where} {text!r} is not a memory size; allowed: a number of bytes or a number "
                                "with kB, MB, GB, TB, KiB, MiB, GiB or TiB (e.g. 3GB)")  # fmt: skip
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise QuantkitError(f"{where} {text!r}: allowed: a memory size of at least 1 byte")
    return value


# ---------------------------------------------------------------------------------------- memory available


@dataclass(frozen=True)
class Available:
    """The memory a run may use (``bytes``: its peak may reach this) and where the figure comes from."""

    bytes: int
    source: str


def process_tree_rss(pid: int | None = None) -> int:
    """Summed resident memory of process ``pid`` (default: this one) and all its children, in bytes.

    On Linux the children come from ``/proc/<pid>/task/<tid>/children`` and the sizes from ``/proc/<pid>/statm``: a
    few small reads per process of the tree.  psutil's ``children()`` scans every process of the machine instead
    (~5 ms with 72 processes, more on a busy machine), and :class:`PeakMeter` calls this ten times a second while
    the main thread works: that scan took ~7% of a 2-core machine's samples during a CNN's quantization.  Elsewhere
    (no ``children`` files) psutil does it."""
    root = os.getpid() if pid is None else int(pid)
    if _proc_children_supported():
        total, todo, seen = 0, [root], set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            rss = _statm_rss(p)
            if rss is None:
                if p == root:
                    return 0
                continue
            total += rss
            todo.extend(_proc_children(p))
        return total
    import psutil

    try:
        proc = psutil.Process(root)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += int(q.memory_info().rss)
        except psutil.Error:
            pass
    return total


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_CHILDREN_FILES: bool | None = None


def _proc_children_supported() -> bool:
    """Whether this kernel lists each task's children in ``/proc/<pid>/task/<tid>/children`` (CONFIG_PROC_CHILDREN)."""
    global _CHILDREN_FILES
    if _CHILDREN_FILES is None:
        _CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return _CHILDREN_FILES


def _statm_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None  # the process ended


def _proc_children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's, as a child belongs to the thread that forked it)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children", "rb") as fh:
                kids.extend(int(x) for x in fh.read().split())
        except (OSError, ValueError):
            continue  # the thread ended
    return kids


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room() -> int | None:
    """Bytes still free under this process's cgroup memory limit (page cache that can be dropped counts as
    free), or None without a limit.  cgroup v2 (``memory.max``) and v1 (``memory.limit_in_bytes``)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrl, rel = parts
        rel = rel.lstrip("/")
        if ctrl == "":  # v2
            base, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in ctrl.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file")
        else:
            continue
        for d in (base / rel, base):  # inside a container the cgroup's own folder is often the mount's root
            limit = _read_int(d / files[0])
            used = _read_int(d / files[1])
            if limit is None or used is None or limit >= 1 << 60:
                continue
            rooms.append(max(0, limit - used + _inactive_file(d / files[2], files[3])))
            break
    return min(rooms) if rooms else None


def available_memory(limit: int | str | None = None) -> Available:
    """The memory this run may use, as :class:`Available`.

    ``limit`` (bytes or ``"3GB"``), else ``$QUANTKIT_MEMORY_LIMIT``, stands for the whole of it.  Otherwise: the
    memory the system has available (psutil; free plus reclaimable cache) or the room under the cgroup limit,
    whichever is smaller, plus the resident memory of this process and its children (already in use by the run)."""
    if limit is not None:
        return Available(parse_bytes(limit, "limit"), f"limit {limit} passed")
    env = os.environ.get(ENV_LIMIT, "").strip()
    if env:
        return Available(parse_bytes(env), f"{ENV_LIMIT}={env}")
    import psutil

    free, source = int(psutil.virtual_memory().available), "available memory"
    room = _cgroup_room()
    if room is not None and room < free:
        free, source = room, "room under the cgroup memory limit"
    return Available(free + process_tree_rss(), f"{source} + this process")


# ---------------------------------------------------------------------------------------------- estimates


@dataclass
class Estimate:
    """The expected peak memory of a run: one figure per phase (the whole process, children included)."""

    path: str  # what runs: "layer-wise (streamed block by block)", "whole-graph", ...
    phases: dict[str, int]
    basis: str = ""  # what the figures were computed from
    weights_bytes: int = 0  # the model's weights in FP32 (what the estimate scales with)

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values()) if self.phases else 0

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k]) if self.phases else ""

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "estimated_peak_bytes": int(self.peak_bytes), "peak_phase": self.peak_phase,
                "phases": {k: int(v) for k, v in self.phases.items()}, "basis": self.basis}  # fmt: skip


def announce(est: Estimate, avail: Available) -> str:
    """Log (and return) the line every LLM run prints at its start."""
    line = (f"memory: expected peak ~{gb(est.peak_bytes)} of {gb(avail.bytes)} available ({est.path}; largest at "
            f"{est.peak_phase}; {avail.source})")  # fmt: skip
    log.info("%s", line)
    return line


def check_fits(est: Estimate, avail: Available, *, what: str, instead: str) -> None:
    """Refuse, before any work, a run whose estimate exceeds the memory available.

    Raises:
        MemoryBudgetError: naming ``what`` runs, the estimate and its phase, the memory available and its
            source, and ``instead`` (the recipe key or setting that fits).
    """
    if est.peak_bytes <= avail.bytes:
        return
    raise MemoryBudgetError(
        f"{what} would need ~{gb(est.peak_bytes)} of memory at its peak ({est.path}; largest at {est.peak_phase}; "
        f"estimated from {est.basis or 'the weight sizes'}), more than the {gb(avail.bytes)} available "
        f"({avail.source}); "
        f"{instead}. Nothing was run"
    )


@dataclass(frozen=True)
class DecoderSizes:
    """A decoder checkpoint's sizes from its safetensors headers (no tensor read)."""

    params: int
    stored_bytes: int
    blocks: int
    block_stored: int  # bytes of the largest block, as stored
    block_linear: int  # parameters of that block's 2-D tensors (its linear layers)
    largest_linear: int  # parameters of the largest 2-D tensor inside a block
    max_k: int  # the widest linear input (intermediate_size for down_proj)
    widest_n: int  # the widest linear output inside a block
    embedding: int  # parameters of the embedding table
    head: int  # parameters of a separate lm_head (0: tied / absent)
    hidden: int
    vocab: int
    itemsize: float  # stored bytes per parameter
    block_shapes: tuple[tuple[int, int], ...] = ()  # (K, N) of the largest block's linear layers
    experts: int = 0  # experts in the largest block (a mixture of experts), 0: a dense block
    expert_linear: int = 0  # parameters of that block's expert linears

    @property
    def fp32_bytes(self) -> int:
        return 4 * self.params


def decoder_sizes(folder: str | os.PathLike[str]) -> DecoderSizes:
    """:class:`DecoderSizes` of the Hugging Face folder ``folder`` (headers checked as the builder checks them)."""
    from quantkit.frontends.checkpoint import checkpoint_tensors
    from quantkit.frontends.families import is_multimodal, text_tensor_name

    tensors = checkpoint_tensors(Path(folder))
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        raw = None
    if is_multimodal(raw):  # a vision-language checkpoint: its text decoder's tensors only
        tensors = {g: t for k, t in tensors.items() if (g := text_tensor_name(k)) is not None}
    blocks: dict[int, dict[str, Any]] = {}
    outside: dict[str, tuple[int, ...]] = {}
    params = stored = 0
    for name, t in tensors.items():
        n = math.prod(t.shape)
        b = n * _DTYPE_BYTES.get(t.dtype, 4)
        shape, linear = tuple(t.shape), True
        if t.dtype == "U8":  # MXFP4 experts (gpt-oss): blocks [E, N, K / 32, 16] of two codes a byte, exponents
            if name.endswith("_blocks") and len(shape) == 4:
                shape = (shape[0], shape[2] * shape[3] * 2, shape[1])  # as the [E, K, N] tensor it decodes to
                n = math.prod(shape)
            else:  # an exponent per 32 values: bytes, not parameters
                n, linear = 0, False
        elif len(shape) == 3 and name.endswith(".weight"):  # [E, N, K] (Granite-MoE) -> [E, K, N]
            shape = (shape[0], shape[2], shape[1])
        elif name.endswith("_bias"):  # gpt-oss's expert biases [E, N]: not a linear
            linear = False
        params += n
        stored += b
        m = _BLOCK.search(name)
        if m is None:
            outside[name] = t.shape
            continue
        blk = blocks.setdefault(int(m.group(1)), {"stored": 0, "linear": 0, "largest": 0, "k": 0, "n": 0,
                                                  "shapes": [], "experts": set(), "expert_linear": 0})  # fmt: skip
        blk["stored"] += b
        e = _EXPERT.search(name)
        if e is not None:
            blk["experts"].add(int(e.group(1)))
            blk["expert_linear"] += n if len(t.shape) == 2 else 0
        if linear and len(shape) == 3:  # experts stored together, taken as [experts, K, N] (gpt-oss, Qwen3-VL-MoE as
            # published; Granite-MoE's ".weight" transposed above; a store the other way round swaps K and N in the
            # estimate only - the builder tells them apart by the config's sizes)
            ne, kk, nn = (int(v) for v in shape)
            blk["experts"].update(range(ne))
            blk["expert_linear"] += n
            blk["shapes"] += [(kk, nn)] * ne
            blk["linear"] += n
            blk["largest"] = max(blk["largest"], nn * kk)
            blk["n"], blk["k"] = max(blk["n"], nn), max(blk["k"], kk)
        if linear and len(t.shape) == 2:
            blk["shapes"].append((int(t.shape[1]), int(t.shape[0])))
            blk["linear"] += n
            blk["largest"] = max(blk["largest"], n)
            blk["n"], blk["k"] = max(blk["n"], t.shape[0]), max(blk["k"], t.shape[1])  # HF layout [N, K]
    big: dict[str, Any] = max(blocks.values(), key=lambda b: b["stored"]) if blocks else {"stored": 0, "linear": 0, "largest": 0,
                                                                          "k": 0, "n": 0, "shapes": [],
                                                                          "experts": set(), "expert_linear": 0}  # fmt: skip
    mats = {k: s for k, s in outside.items() if len(s) == 2}
    emb_name = next((k for k in mats if k.endswith("embed_tokens.weight") or k.endswith("wte.weight")),
                    max(mats, key=lambda k: math.prod(mats[k]), default=None))  # fmt: skip
    emb = mats.get(emb_name, (0, 0)) if emb_name else (0, 0)
    head = next((s for k, s in mats.items() if k.endswith("lm_head.weight")), None)
    return DecoderSizes(
        params=params, stored_bytes=stored, blocks=len(blocks), block_stored=big["stored"],
        block_linear=big["linear"], largest_linear=big["largest"], max_k=big["k"], widest_n=big["n"],
        embedding=math.prod(emb), head=math.prod(head) if head else 0, hidden=emb[1] if len(emb) == 2 else 0,
        vocab=emb[0] if emb else 0, itemsize=stored / max(params, 1), block_shapes=tuple(big["shapes"]),
        experts=len(big["experts"]), expert_linear=big["expert_linear"],
    )  # fmt: skip


def onnx_weight_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of an ONNX model's weights: the file plus the external-data files its initializers name."""
    import onnx

    p = Path(path)
    total = p.stat().st_size
    if total > 64 << 20:  # the weights are in the file itself (a graph alone is small): no need to parse it
        return total
    try:
        m = onnx.load(str(p), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable model is refused by the loader, naming it
        return total
    files = set()
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                files.add(e.value)
    for f in files:
        q = (p.parent / f).resolve()
        if q.is_file():
            total += q.stat().st_size
    return total


def _algo_extra(algorithm: str, k: int, n: int) -> float:
    """What rounding one layer ``[K, N]`` needs beyond its float32 weights (and the statistics), by algorithm."""
    if algorithm == "gptq":
        step = max(256, (256 << 20) // (4 * k))  # quantkit.layerwise: GPTQ column slices of 256 MB of float32
        size = 8 if k <= GPTQ_FLOAT64_MAX_K else 4
        return GPTQ_HESSIAN_COPIES * size * k * k + GPTQ_BAND_BYTES + GPTQ_SLICE_COPIES * size * k * min(n, step)
    if algorithm in ("awq", "signround"):
        return 8 * k * k + (AWQ_WEIGHT_COPIES if algorithm == "awq" else SIGNROUND_WEIGHT_COPIES) * 4 * k * n
    return 0.0


def layerwise_estimate(sizes: DecoderSizes, *, bits: int, algorithms: Iterable[str], head_algorithm: str,
                       head_quantized: bool, tied: bool, windows: tuple[int, int] | None, max_rows: int = 4096,
                       evaluation: Mapping[str, Any] | None = None, base: int | None = None,
                       w4a8_bytes: int = 0) -> Estimate:
    """The peak of a layer-wise run (:mod:`quantkit.layerwise`, then :mod:`quantkit.llm_run`'s evaluation).

    Phases (each above :data:`BASE_BYTES`): the embedding table read (twice its stored bytes: the mapped shard
    and the copy; a tied table rounded before the first block: the tensor as stored, its float32 transpose, the
    codes and the packed codes, :data:`ROUNDED_TABLE_BYTES`; the packed table then stays for the build); one block
    (stored tensors, their float32 transposes, the packed result, RTN's temporaries; with statistics the block's
    ONNX Runtime session or the largest layer's GPTQ / AWQ arrays, whichever is larger, beside ``Σxᵀx``); the
    lm_head (as a block's layer, ``vocab`` columns wide); the evaluation (the sessions it holds at once: the FP32
    decoder and the quantized one when the FP32 baseline is evaluated whole, and the logits of a window).  A
    streamed FP32 baseline (:mod:`quantkit.evaluate.streamed`) adds its own phases instead: the FP32 perplexity
    block by block (one FP32 block graph and its session, then the lm_head in float32 beside a window's logits)
    and the latency of the FP32 and quantized decoders truncated to ``latency_blocks`` blocks (both sessions at
    once: the FP32 one built from the checkpoint, the quantized one cut from the emitted graph).

    ``bits``: the widest quantized format (4 / 8); ``algorithms``: those of the block layers; ``windows``:
    ``(count, seq_len)`` of the calibration windows (``None``: none, RTN); ``w4a8_bytes``: when the W4A8 check runs, its
    temporaries (:func:`quantkit.lowering.w4a8.check_bytes`; the blocks then run on the windows whatever the
    algorithm); ``evaluation``: ``{"fp32": "whole" |
    "streamed" | "off" (True / False: whole / off), "seq_len": int, "prefill": int, "perplexity": bool,
    "latency_blocks": int}`` - what the evaluation runs (the FP32 baseline and how, the longest window, the longest
    prefill timed, whether perplexity is computed, the blocks of the truncated decoders a streamed baseline times),
    or None when nothing is evaluated.  ``base``: the floor the phases add to (default :func:`run_floor`).
    """
    s = sizes
    base = run_floor() if base is None else base
    algos = set(algorithms) or {"rtn"}
    stats = windows is not None and (bool(algos - {"rtn"}) or w4a8_bytes > 0)
    # Σxᵀx (float64 K x K) only for an algorithm that reads statistics; the W4A8 check alone keeps a row sample
    hessian = bool(algos - {"rtn"})
    rows = min(max_rows, windows[0] * windows[1]) if windows else 0
    per_param = bits / 8 + 4 / 32  # packed codes and float32 scales of groups of >= 32
    block = s.block_stored + 4 * s.block_linear + 4 * s.largest_linear + per_param * s.block_linear + RTN_TEMP_BYTES
    if stats and windows is not None:
        states = 2 * 4 * windows[0] * windows[1] * s.hidden  # hidden states in and out (memory-mapped files)
        wide = max([n for _, n in s.block_shapes] + [s.hidden])
        # the block's session: its float32 weights; a mixture's experts are not among them - a stage's taps need no
        # expert weights (gate / up: the routed rows) or only packed ones (down: its own gate / up, rounded), and the
        # block that produces the next hidden states runs packed
        float_linear = s.block_linear - s.expert_linear + per_param / 4 * s.expert_linear
        session = SESSION_COPIES * 4 * float_linear + 4 * 4 * windows[1] * wide
        layer = max(((8 * k * k if hessian else 0) + 4 * rows * k + max(_algo_extra(a, k, n) for a in algos)
                     for k, n in s.block_shapes), default=0.0)  # fmt: skip
        if s.experts:  # a stage's statistics and row samples at once: the experts' inputs (capped per run)
            per = 8 * s.max_k * s.max_k if hessian else 0
            at_once = min(s.experts, max(1, STAGE_STATS_BYTES // per)) if per else s.experts
            layer += (at_once - 1) * (per + 4 * min(rows, max_rows) * s.max_k)
        block += states + max(session + (8 * s.max_k * s.max_k if hessian else 0), layer)
        block += w4a8_bytes
    # the table as read: the shard's mapped pages and the tensor copied out of them
    work: dict[str, float] = {"embedding": 2 * s.itemsize * s.embedding}
    rounded = tied and head_quantized
    # the tied table's packed codes (GatherBlockQuantized and the tied lm_head) stay alive until the build ends
    kept = per_param * s.embedding if rounded else 0.0
    if rounded:  # the table rounded (RTN) before the first block: its float32 transpose, codes, packed codes
        work["embedding"] = max(work["embedding"], (s.itemsize + ROUNDED_TABLE_BYTES + per_param) * s.embedding
                                + RTN_TEMP_BYTES)  # fmt: skip
    work["blocks"] = block + kept
    head = s.head or (s.embedding if tied else 0)
    head_stats = stats and head_algorithm != "rtn"
    if head and (not tied or head_stats):  # read from the checkpoint after the last block
        if not head_quantized:
            work["lm_head"] = 2 * s.itemsize * head
        elif head_stats:
            work["lm_head"] = (kept + s.itemsize * head + 8 * head + _algo_extra(head_algorithm, s.hidden, s.vocab)
                               + w4a8_bytes)  # fmt: skip
        else:  # rounded as the tied table is (above), then the W4A8 check's temporaries when it runs
            work["lm_head"] = (s.itemsize + ROUNDED_TABLE_BYTES + per_param) * head + RTN_TEMP_BYTES + w4a8_bytes
    elif head and rounded and w4a8_bytes and windows is not None:
        # the W4A8 check of the tied lm_head (quantkit.layerwise._Hook.tied_head): the table read again and its
        # float32 copy beside the packed codes, the check's temporaries
        work["lm_head (W4A8 check)"] = (s.itemsize + 4) * head + kept + w4a8_bytes
    ev = dict(evaluation or {})
    fp32 = ev.get("fp32")
    fp32 = "whole" if fp32 is True else "off" if not fp32 else str(fp32)
    keep = int(ev.get("latency_blocks") or 0) if fp32 == "streamed" else 0
    block_params = s.block_stored / max(s.itemsize, 1e-9)
    outside = max(s.params - s.blocks * block_params, 0.0)  # the embedding, a separate lm_head, the final norm
    phases = {k: int(base + v) for k, v in work.items()}
    if evaluation:
        embedded = 0 if tied and head_quantized else 4 * s.embedding  # an untied table stays float32
        q_bytes = (s.params - s.embedding) * per_param + embedded + (per_param * s.embedding if tied else 0)
        seq = int(ev.get("seq_len") or 0)
        logits = LOGITS_COPIES * 4 * seq * s.vocab
        wide = max([n for _, n in s.block_shapes] + [s.hidden])
        prefill_act = 4 * 4 * int(ev.get("prefill") or 0) * wide
        act = max(logits, prefill_act)
        if fp32 == "whole":
            phases["evaluation (FP32 and quantized)"] = int(base + EVAL_SESSION_COPIES * (s.fp32_bytes + q_bytes) + act)
        elif fp32 != "streamed" or ev.get("perplexity", True):
            phases["evaluation (quantized)"] = int(base + EVAL_SESSION_COPIES * q_bytes + act)
        if fp32 == "streamed" and ev.get("perplexity", True):
            # one FP32 block graph at a time (the block's tensors as stored, the serialized graph and its session,
            # one window's activations), then the final norm and the lm_head in float32 beside one window's logits
            head = s.head or s.embedding
            one_block = s.block_stored + SESSION_COPIES * 4 * block_params + 4 * 4 * seq * wide
            last = (s.itemsize + 4) * head + logits
            phases["FP32 baseline: perplexity block by block"] = int(base + max(one_block, last))
        if keep:
            # an untied embedding table is only gathered from: its external data is memory-mapped and only the rows
            # looked up become resident (the 7B shape's truncated decoders, k = 1 / 2 blocks: 2.36 / 3.49 GB
            # measured, 2.39 / 3.47 GB estimated so); a table the lm_head multiplies by (tied) is read whole
            gathered = 0 if tied else 4 * s.embedding
            fp32_k = 4 * (outside + keep * block_params) - gathered
            q_k = (keep * per_param * block_params + (embedded if tied else 0)
                   + per_param * (s.head or (s.embedding if tied else 0)))
            phases[latency_phase(keep, s.blocks)] = int(
                base + EVAL_SESSION_COPIES * (fp32_k + q_k) + prefill_act)
    basis = (f"config.json and the safetensors headers: {s.params / 1e9:.2f}B parameters, {s.blocks} blocks of "
             f"{s.block_stored / 1e6:.0f} MB as stored")  # fmt: skip
    return Estimate("layer-wise, streamed block by block", phases, basis, s.fp32_bytes)


def whole_graph_estimate(fp32_bytes: int, *, what: str, basis: str, activation_bytes: int = 0,
                         base: int | None = None) -> Estimate:
    """The peak of the whole-graph path on a model of ``fp32_bytes`` weights (held and run whole), plus the
    activations its calibration exposes at once (``calibration.max_batch_output_bytes``) when it collects any."""
    base = run_floor() if base is None else base
    return Estimate(f"whole-graph: {what}",
                    {"quantize": int(base + WHOLE_GRAPH_COPIES * fp32_bytes + activation_bytes)}, basis, fp32_bytes)


def run_floor() -> int:
    """What a run starts from: :data:`BASE_BYTES`, or what this process (and its children) holds already when
    that is more (a notebook, a test session)."""
    return max(BASE_BYTES, process_tree_rss())


# ---------------------------------------------------------------------------------------------- measuring


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakMeter:
    """The peak memory of this process and its children while the meter runs.

    A thread samples the summed RSS of the process tree every ``interval`` seconds; at the start the process's
    own high-water mark (``VmHWM``) is reset (Linux ``/proc/self/clear_refs``), so that a peak shorter than the
    sampling period is still caught for the process itself.  ``peak_bytes`` is the larger of the two."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm_reset = False
        self.seconds = 0.0

    def start(self) -> PeakMeter:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self._t0 = time.perf_counter()
        self._peak = process_tree_rss()
        self._thread = threading.Thread(target=self._run, name="quantkit-peak-meter", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, process_tree_rss())

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._thread = None
            self.seconds = time.perf_counter() - self._t0
        return self.peak_bytes

    @property
    def peak_bytes(self) -> int:
        now = max(self._peak, process_tree_rss())
        hwm = _vm_hwm() if self._hwm_reset else None
        return max(now, hwm or 0)

    def __enter__(self) -> PeakMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------ FP32 baseline

BASELINE_SETTINGS = ("auto", "whole", "streamed", "off")
"""``evaluation.fp32_baseline``: how a layer-wise run evaluates the FP32 model it compares with."""


def latency_phase(blocks: int, layers: int) -> str:
    """The memory phase of the truncated decoders' latency (:func:`quantkit.memory.layerwise_estimate`)."""
    return f"latency on {blocks} of {layers} blocks (FP32 and quantized)"


@dataclass
class Baseline:
    """What :func:`choose_baseline` decided: ``mode`` ``whole`` / ``streamed`` / ``off``, why, and the estimate of
    the run with it."""

    setting: str
    mode: str
    why: str
    layers: int
    estimate: Estimate
    latency_blocks: int = 0  # k: the blocks of the truncated decoders timed (streamed, latency on)
    own_peak_bytes: int = 0  # the streamed run's own estimated peak (no FP32 baseline)
    fp32_bytes: int = 0
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"setting": self.setting, "mode": self.mode, "why": self.why,
                               "fp32_bytes": int(self.fp32_bytes), "run_peak_bytes": int(self.own_peak_bytes),
                               "summary": self.text()}  # fmt: skip
        if self.mode == "streamed":
            out["perplexity"] = "block by block through the FP32 block graphs (equal to the whole decoder's)"
            out["latency_blocks"] = self.latency_blocks or None
            out["blocks"] = self.layers
        return out

    def text(self) -> str:
        """One line for the report's summary."""
        what = {"whole": "the FP32 decoder held whole",
                "streamed": "streamed block by block (perplexity block by block"
                            + (f"; latency measured on {self.latency_blocks} of {self.layers} blocks, FP32 and "
                               "quantized truncated alike)" if self.latency_blocks else ")"),
                "off": "not evaluated"}[self.mode]  # fmt: skip
        return f"{what}: {self.why}"


def choose_baseline(setting: str, *, perplexity: bool, latency: bool, fp32_bytes: int, layers: int,
                    estimate: Callable[[str, int], Estimate], avail: Available) -> Baseline:
    """Decide how the FP32 baseline runs, before any work (``setting``: ``evaluation.fp32_baseline``).

    ``estimate(mode, k)``: the run's estimate with the baseline ``whole`` / ``streamed`` (the truncated decoders of
    ``k`` blocks timed; 0: none) / ``off``.  The streamed run's own peak is ``estimate("off", 0)``'s.  ``auto``:
    ``whole`` when the FP32 weights are no larger than that peak and the whole baseline fits the memory available,
    else ``streamed`` (``off`` with a warning when even that does not fit but the run without it does).

    Raises:
        MemoryBudgetError: ``whole`` asked for and the run with it cannot fit (naming the streamed alternative).
    """
    if setting not in BASELINE_SETTINGS:
        raise QuantkitError(f"evaluation.fp32_baseline {setting!r}; allowed: {', '.join(BASELINE_SETTINGS)}")
    off = estimate("off", 0)
    own = off.peak_bytes

    def made(mode: str, why: str, est: Estimate, k: int = 0, warnings: list[str] | None = None) -> Baseline:
        return Baseline(setting, mode, why, layers, est, latency_blocks=k, own_peak_bytes=own, fp32_bytes=fp32_bytes,
                        warnings=warnings or [])  # fmt: skip

    if not (perplexity or latency):
        return made("off", "nothing is compared with it (no evaluation data, latency not measured)", off)
    if setting == "off":
        return made("off", "evaluation.fp32_baseline: off", off)

    def streamed() -> tuple[Estimate, int]:
        if not latency:
            return estimate("streamed", 0), 0
        k = layers
        while k > 1:  # the largest k whose truncated decoders fit the run's own peak (its other phases)
            est = estimate("streamed", k)
            phase = latency_phase(k, layers)
            rest = max((v for p, v in est.phases.items() if p != phase), default=0)
            if est.phases.get(phase, 0) <= rest:
                return est, k
            k -= 1
        return estimate("streamed", 1), 1

    whole = estimate("whole", 0)
    if setting == "whole":
        s_est, _ = streamed()
        check_fits(whole, avail, what="the run with its FP32 baseline held whole (evaluation.fp32_baseline: whole)",
                   instead=f"evaluation.fp32_baseline: streamed (or auto) evaluates it block by block (expected peak "
                           f"~{gb(s_est.peak_bytes)}), off skips it")  # fmt: skip
        return made("whole", "evaluation.fp32_baseline: whole", whole)
    if setting == "streamed":
        s_est, k = streamed()
        return made("streamed", "evaluation.fp32_baseline: streamed", s_est, k)
    if fp32_bytes <= own and whole.peak_bytes <= avail.bytes:
        return made("whole", f"auto: the FP32 weights ({gb(fp32_bytes)}) are no larger than the streamed run's own "
                             f"estimated peak ({gb(own)})", whole)  # fmt: skip
    why = (f"auto: the FP32 weights ({gb(fp32_bytes)}) exceed the streamed run's own estimated peak ({gb(own)})"
           if fp32_bytes > own else f"auto: held whole the run would peak at ~{gb(whole.peak_bytes)}, more than the "
                                    f"{gb(avail.bytes)} available ({avail.source})")  # fmt: skip
    s_est, k = streamed()
    if s_est.peak_bytes > avail.bytes >= own:
        return made("off", why + f"; streamed it would peak at ~{gb(s_est.peak_bytes)}, more than the "
                                 f"{gb(avail.bytes)} available", off,
                    warnings=[f"FP32 baseline not evaluated: even streamed block by block the run would peak at "
                              f"~{gb(s_est.peak_bytes)}, more than the {gb(avail.bytes)} available"])  # fmt: skip
    return made("streamed", why, s_est, k)
