"""What a results file records besides :func:`quantkit.report.build.environment`: the command that wrote it
and the CPU class it ran on, so ``eval/render_results.py`` can show where every figure came from.

Used by the benchmarks as ``env = {**environment(), **run_record()}`` (``eval/`` is the running script's
folder, so ``from provenance import run_record`` finds this file).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def run_record() -> dict[str, str]:
    """``{"command": "python eval/bench_x.py --flags", "cpu_class": "x86-avx2"}`` for the running benchmark."""
    from quantkit.scheme.target import detect_cpu

    argv = list(sys.argv)
    script = Path(argv[0]).resolve() if argv and argv[0] else None
    root = Path(__file__).resolve().parents[1]
    if script is not None and script.is_relative_to(root):
        argv[0] = str(script.relative_to(root))
    return {"command": "python " + shlex.join(argv), "cpu_class": detect_cpu().cpu_class}
