"""README command 1, run as a new user runs it: a fresh clone, a fresh virtual environment, an empty quantkit cache,
the output to a file (as in a CI log), every line time-stamped as it arrives.

The command is read from the README itself (its first ``bash`` block), so this measures what the README says.
Writes the wall time, the time by stage (pip, then the run's own ``timings`` from its report), the longest silence
between two log lines (quantkit promises a line at least every 20 s) and the run's figures (perplexity, size,
latency, memory, greedy agreement, the INT4 kernel chosen).

Usage::

    python eval/bench_readme.py --out eval/results/readme_main_job_x86-vnni.json [--work /tmp/readme-run]

pip's wheels come from its own cache (not measured: a first download depends on the network). Needs ~3 GB in
``--work``; the folder is removed first when this script wrote it (its ``.bench-readme`` marker; any other
non-empty folder is refused) and kept afterwards for inspection.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def readme_command(readme: Path) -> str:
    """The first ``bash`` block of the README (command 1)."""
    m = re.search(r"```bash\n(.+?)\n```", readme.read_text(encoding="utf-8"), re.S)
    if m is None:
        raise SystemExit(f"{readme}: no ```bash block")
    return m.group(1).strip()


def run_logged(cmd: str, cwd: Path, env: dict[str, str], log: Path) -> tuple[int, list[tuple[float, str]], float]:
    """Run ``cmd`` in bash; returns (exit code, [(seconds since start, line)], wall seconds)."""
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    with log.open("w", encoding="utf-8") as fh:
        proc = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)  # fmt: skip
        assert proc.stdout is not None  # noqa: S101 - PIPE was asked for

        def read() -> None:
            assert proc.stdout is not None  # noqa: S101
            for line in proc.stdout:
                t = time.perf_counter() - t0
                lines.append((t, line.rstrip("\n")))
                fh.write(f"{t:9.2f} {line}")
                fh.flush()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        rc = proc.wait()
        reader.join()
    return rc, lines, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the results JSON")
    ap.add_argument("--work", default="/tmp/quantkit-readme-run")
    ap.add_argument("--repo", default=str(ROOT), help="the repository to clone (its HEAD)")
    args = ap.parse_args()
    work = Path(args.work)
    marker = work / ".bench-readme"
    if work.exists() and any(work.iterdir()) and not marker.is_file():
        raise SystemExit(f"--work {work} exists and was not written by this script (no {marker.name}): give an empty "
                         "or new folder")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)  # only a folder this script made before (its marker is there)
    work.mkdir(parents=True)
    marker.write_text("written by eval/bench_readme.py; removed and rewritten by its next run\n", encoding="utf-8")
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", args.repo, str(clone)], check=True)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    cmd = readme_command(clone / "README.md")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUANTKIT_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    env["QUANTKIT_CACHE"] = str(work / "cache")
    load_start = list(os.getloadavg())
    rc, lines, wall = run_logged(cmd, clone, env, work / "log.txt")
    load_end = list(os.getloadavg())
    first_q = next((t for t, line in lines if line.startswith("quantkit")), None)
    gaps = [(b[0] - a[0], a[1]) for a, b in zip(lines, lines[1:], strict=False)]
    q_gaps = [(g, w) for (g, w), (t, _) in zip(gaps, lines[1:], strict=True) if first_q is not None and t > first_q]
    rep_path = clone / "out" / "llama-int4" / "report.json"
    rep: dict[str, Any] = json.loads(rep_path.read_text(encoding="utf-8")) if rep_path.is_file() else {}
    q = rep.get("quality", {})
    lat = rep.get("latency", {})
    mem = rep.get("memory", {})
    ga = q.get("greedy_agreement", {})
    timings = {k: round(float(v), 1) for k, v in rep.get("timings", {}).items()}
    ppl = {"main": {"fp32": q.get("perplexity_fp32", {}).get("ppl"), "quantized": q.get("perplexity_quantized", {}).get("ppl")}}
    for name, e in (q.get("perplexity_extra") or {}).items():
        ppl[name] = {"fp32": (e.get("fp32") or {}).get("ppl"), "quantized": (e.get("quantized") or {}).get("ppl")}
    environment = {**{k: rep.get("environment", {}).get(k) for k in ("cpu", "cores", "onnxruntime", "python")},
                   "cpu_class": rep.get("measurement", {}).get("cpu_class"),
                   "date": time.strftime("%Y-%m-%d"), "commit": head,
                   "command": f"python eval/bench_readme.py --out {args.out} (README command 1 on a fresh clone: {cmd}; "
                              "QUANTKIT_CACHE empty, pip's wheel cache kept, output to a file, every line time-stamped)",
                   "load_average_at_start": [round(x, 2) for x in load_start],
                   "load_average_at_end": [round(x, 2) for x in load_end]}  # fmt: skip
    out: dict[str, Any] = {
        "environment": environment,
        "exit_code": rc,
        "wall_s_total_including_pip": round(wall, 1),
        "stages_s": {"pip installs (until quantkit's first line)": round(first_q, 1) if first_q is not None else None,
                     **{f"report timings.{k}": v for k, v in timings.items()}},  # fmt: skip
        "perplexity": ppl,
        "size_ratio": round(float(rep.get("size", {}).get("ratio", float("nan"))), 3),
        "latency_x_fp32": {k: round(float(v["speedup"]), 2) for k, v in lat.items() if isinstance(v, dict) and "speedup" in v},
        "memory_gb": {"estimated_peak": round(mem.get("estimated_peak_bytes", 0) / 1e9, 2),
                      "measured_peak": round(mem.get("measured_peak_bytes", 0) / 1e9, 2)},  # fmt: skip
        "greedy_agreement": {k: ga.get(k) for k in ("prompts", "prefix_agreement", "position_agreement",
                                                   "teacher_forced_agreement")},  # fmt: skip
        "int4_kernel": rep.get("int4_kernel", {}).get("why"),
        "longest_gap_between_log_lines_s": round(max(gaps)[0], 1) if gaps else None,
        "longest_gap_after": max(gaps)[1][:160] if gaps else None,
        "longest_gap_quantkit_s": round(max(q_gaps)[0], 1) if q_gaps else None,
        "longest_gap_quantkit_after": max(q_gaps)[1][:160] if q_gaps else None,
        "log_lines": len(lines),
    }
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, args.out)
    print(json.dumps(out, indent=1))
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
