"""Run every benchmark: ``python -m bench.all [--quick] [--only NAME ...]``.

Each benchmark runs as its own ``python -m bench.<name>`` child (own process
group, killed with its whole tree on timeout or Ctrl-C), prints its table and
writes <out>/<name>.json + .png: a fresh folder under the system's temp dir
unless ``--out DIR`` (``--out bench/results`` updates the tracked, recorded
results). ``--quick`` passes ``--quick`` to each
and keeps the whole run under 5 minutes on a 2-core machine (each child has a
time budget; a child that overruns is killed and reported, the rest still run).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench import harness as H
from bus.proctree import terminate_tree

# name -> (budget seconds quick, budget seconds full)
BENCHMARKS = {
    "router_overhead": (100, 900),
    "stream_latency": (60, 600),
    "scale": (70, 900),
    "core_overhead": (45, 600),
    "e2e_torch": (55, 600),
    "control_plane": (40, 900),
}


def run_one(name: str, quick: bool, budget: float, extra: list[str], out: str) -> tuple[int | None, float]:
    argv = [
        sys.executable,
        "-m",
        f"bench.{name}",
        *(["--quick"] if quick else []),
        "--max-seconds",
        str(max(10, int(budget - 15))),
        *extra,
    ]
    env = dict(os.environ, ROLLOUT_BUS_BENCH_OUT=out)  # bench.report.RESULTS_DIR
    env["PYTHONPATH"] = str(H.REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=str(H.REPO_ROOT), env=env, start_new_session=True)
    try:
        rc = p.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        print(f"!! {name}: over its {budget:.0f}s budget, killed", flush=True)
        rc = None
    finally:
        terminate_tree(p, grace_s=8, kill_wait_s=5)
    return rc, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced set, < 5 minutes in all")
    ap.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    ap.add_argument(
        "--out",
        default=None,
        help="folder for the results (default: a new one under the temp dir; bench/results: the tracked ones)",
    )
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out) if a.out else tempfile.mkdtemp(prefix="rollout-bus-bench-")
    os.makedirs(out, exist_ok=True)
    print(f"results go to {out}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    t0 = time.monotonic()
    summary = []
    for name in a.only:
        budget = BENCHMARKS[name][0 if a.quick else 1]
        print(f"\n=== bench.{name}{' --quick' if a.quick else ''} (budget {budget}s) ===", flush=True)
        rc, took = run_one(name, a.quick, budget, [], out)
        summary.append(
            {
                "benchmark": name,
                "rc": "timeout" if rc is None else str(rc),
                "seconds": f"{took:.0f}",
                "results": f"{out}/{name}.json, .png" if rc == 0 else "-",
            }
        )
    print()
    H.print_table(summary, title=f"bench.all{' --quick' if a.quick else ''}: {time.monotonic() - t0:.0f}s in all")
    return 0 if all(s["rc"] == "0" for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
