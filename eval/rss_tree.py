"""Peak memory of a whole command: the summed RSS of the process and all its children, sampled.

    python eval/rss_tree.py -- quantkit calibrate --recipe recipes/llama-int4.yaml --output out/llama-int4

``/usr/bin/time -v`` reports the largest single process, which misses a parent and a child that are alive
together (quantkit converts a GGUF in a child process).  This samples ``/proc/<pid>/status`` (VmRSS) of the
command's process tree every ``--every`` seconds and prints the peak (bytes, GB and GiB), when it happened,
and the command's own output lines that precede it (to name the phase).  Linux only; no dependencies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _tree_rss_kib(root: int) -> int:
    kids, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=float, default=0.25, help="sampling period, seconds")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[tuple[float, str]] = []
    peak, peak_t, peak_line = 0, 0.0, ""
    import threading

    def pump() -> None:
        assert proc.stdout is not None  # noqa: S101 - set by Popen above
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append((time.perf_counter() - t0, line.strip().split("\r")[-1]))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        while proc.poll() is None:
            kib = _tree_rss_kib(proc.pid)
            if kib > peak:
                peak, peak_t = kib, time.perf_counter() - t0
                peak_line = lines[-1][1] if lines else ""
            time.sleep(args.every)
    except KeyboardInterrupt:
        proc.terminate()
        raise
    reader.join(timeout=5)
    out = {"returncode": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1), "peak_bytes": peak * 1024,
           "peak_gb": round(peak * 1024 / 1e9, 3), "peak_gib": round(peak / 2**20, 3), "peak_at_s": round(peak_t, 1),
           "last_output_before_peak": peak_line[:200]}  # fmt: skip
    print(json.dumps(out), file=sys.stderr)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
