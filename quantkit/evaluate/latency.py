"""Latency of ONNX Runtime sessions, measured the same way for every model in one run."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import onnxruntime as ort


@dataclass(frozen=True)
class Latency:
    """Wall-clock latency of ``session.run`` on one fixed feed (milliseconds)."""

    median_ms: float
    p90_ms: float
    mean_ms: float
    min_ms: float
    runs: int
    warmup: int
    threads: int
    shape: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def make_session(
    model: bytes | str, *, threads: int | None = None, level: str = "all", arena: bool = True,
    stop_spinning: bool = True,
) -> ort.InferenceSession:
    """A CPU session with all graph optimizations (what a deployment would use).

    ``arena=False`` frees each run's buffers when it ends instead of keeping them in ORT's memory arena: for
    LLMs, whose logits alone are ``seq x vocab`` floats (200 MB at 1024 x 49152 tokens), this keeps two
    sessions timed side by side from holding two arenas of them (SmolLM2, prefill 1024: 1.33 -> 1.07 GB peak,
    same speed).

    ``stop_spinning`` (the default): the intra-op threads stop spinning as soon as a run returns
    (``session.force_spinning_stop``; within a run they spin as ONNX Runtime's default has them).  Otherwise a
    session's threads keep spinning for a while after its run and slow whatever runs next on a small machine -
    another session timed next: 2 cores, ResNeXt-50 int8 took 25-45 ms instead of 15 ms for the first 2-3 runs
    after a switch, which made an A/B's rounds bimodal (24 or 15 ms for the same model).  Turning spinning off
    altogether (``allow_spinning = 0``) removes that too but slows the runs themselves, unevenly: a model of many
    small int8 kernels more than its float twin (EfficientNet-B0: the latency guard then put 60 layers in float).
    Measured on 2 cores with two ResNeXt-50 sessions taking turns: 10-11 ms per run with the stop from the
    first run of each turn, 11-13 with spinning off, 12-37 ms with ONNX Runtime's default."""
    so = ort.SessionOptions()
    if stop_spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    so.enable_cpu_mem_arena = arena
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[level]
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def measure_latency(
    session: ort.InferenceSession,
    feed: Mapping[str, np.ndarray],
    *,
    warmup: int = 5,
    repeat: int = 30,
    threads: int = 0,
) -> Latency:
    """Median / p90 over ``repeat`` timed runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        session.run(None, dict(feed))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        session.run(None, dict(feed))
        times.append((time.perf_counter() - t0) * 1e3)
    arr = np.asarray(times)
    shape = ", ".join(f"{k}={list(v.shape)}" for k, v in feed.items())
    return Latency(
        median_ms=float(np.median(arr)),
        p90_ms=float(np.percentile(arr, 90)),
        mean_ms=float(arr.mean()),
        min_ms=float(arr.min()),
        runs=repeat,
        warmup=warmup,
        threads=threads,
        shape=shape,
    )


SETTLE_MS = 10.0
"""Untimed runs of a session before each round's timed ones, until about this many milliseconds have passed (at
least one run, at most :data:`SETTLE_RUNS`): after another model ran, a session's first runs are slow while its
weights come back into the caches (MobileNetV3-Small at batch 1 on 2 cores: its 1st-6th runs 1.03, 0.85, 0.76,
0.73, 0.69, 0.66 ms, then 0.64) - timed, those runs favoured the model with fewer bytes of weights (its int8 twin
looked 1.25x faster than FP32 with 6 runs per round, 0.92x in the steady state)."""
SETTLE_RUNS = 10


def settle(session: ort.InferenceSession, feed: Mapping[str, np.ndarray]) -> None:
    """Run ``session`` untimed for about :data:`SETTLE_MS` (1 to :data:`SETTLE_RUNS` runs): see there."""
    t0 = time.perf_counter()
    session.run(None, dict(feed))
    one = (time.perf_counter() - t0) * 1e3
    for _ in range(min(SETTLE_RUNS, int(np.ceil(SETTLE_MS / max(one, 1e-3)))) - 1):
        session.run(None, dict(feed))


def compare_latency(
    sessions: Mapping[str, ort.InferenceSession],
    feed: Mapping[str, np.ndarray],
    *,
    warmup: int = 5,
    repeat: int = 30,
    threads: int = 0,
    rounds: int = 3,
) -> dict[str, Latency]:
    """Time several sessions on the same feed, interleaved in ``rounds`` (their order rotated from round to
    round) so that machine noise (another process, frequency changes, the previous session's spinning threads)
    hits all of them alike; each session's runs are pooled before taking the median.  Each round of a session
    starts with untimed runs (:func:`settle`): the figures are the steady state, not the caches refilling after
    the other model ran."""
    from quantkit.frontends.kv_cache import match_cache_feed

    pooled: dict[str, list[float]] = {k: [] for k in sessions}
    # a KV-cache decoder's (zero) past in each session's own cache type: float32, or int8 (export.kv_cache)
    feeds = {k: match_cache_feed(s, feed) for k, s in sessions.items()}
    for k, s in sessions.items():
        for _ in range(warmup):
            s.run(None, dict(feeds[k]))
    per_round = max(1, repeat // rounds)
    names = list(sessions)
    for r in range(rounds):
        # the order rotates between rounds: a session's intra-op threads spin a while after its runs and slow the
        # one timed next (a 2-core machine: MobileNetV2's FP32 model 12.5 ms timed after nothing, 9.1 ms timed last)
        for k in names[r % len(names):] + names[: r % len(names)]:
            s = sessions[k]
            settle(s, feeds[k])
            for _ in range(per_round):
                t0 = time.perf_counter()
                s.run(None, dict(feeds[k]))
                pooled[k].append((time.perf_counter() - t0) * 1e3)
    shape = ", ".join(f"{k}={list(v.shape)}" for k, v in feed.items())
    out = {}
    for k, ts in pooled.items():
        arr = np.asarray(ts)
        out[k] = Latency(
            median_ms=float(np.median(arr)), p90_ms=float(np.percentile(arr, 90)), mean_ms=float(arr.mean()),
            min_ms=float(arr.min()), runs=len(ts), warmup=warmup, threads=threads, shape=shape,
        )
    return out


def load_average() -> list[float]:
    """The system load average over 1, 5 and 15 minutes (``os.getloadavg``; empty where there is none)."""
    try:
        return [round(float(x), 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return []
