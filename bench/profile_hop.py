"""Where a message's time goes: the head and an engine node under cProfile
(deterministic: call counts do not depend on the machine's load), driven by
bench.rb_side.RawDriver at concurrency 1.

Phases (each after a warm-up; the profilers are switched on by SIGUSR1 once
the warm-up is over and dump at exit):
  hop     N requests, max_tokens 1, through the head (head's per-message cost)
  stream  N/8 requests of 64 streamed tokens (tokens_per_step 1) straight to
          engine 0 (the engine node's per-chunk cost)

Prints, per process, the Python function calls per request / per chunk and
the top functions by own time; writes bench/results/profile_hop.json.
Compare runs of this script with each other only (cProfile slows the
profiled code; its call counts are exact, its times are not).

Run: ``python -m bench.profile_hop [--requests 2000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

ROLES = {"router_node": "router_node.main:run_router_node", "engine_node": "engine_node.node:run_engine_node"}


def child_main(role: str, out: str, argv: list[str]) -> int:
    """Run one process's entry point with a cProfile that SIGUSR1 switches on."""
    import cProfile
    import importlib

    mod, fn = ROLES[role].split(":")
    entry = getattr(importlib.import_module(mod), fn)
    prof = cProfile.Profile()
    on: list[bool] = []

    def enable(*_: Any) -> None:
        prof.enable()
        on.append(True)

    signal.signal(signal.SIGUSR1, enable)
    try:
        return int(entry(argv) or 0)
    finally:
        prof.disable()
        if on:
            prof.dump_stats(out)


def _cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid` (/proc, clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ir(path: Path) -> int:
    """Instructions executed while instrumentation was on (callgrind's totals)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):  # (summary: reads 0 once instrumentation was switched off)
            return int(line.split()[1])
    raise ValueError(f"no totals in {path}")


def _top(path: Path, per: int, n: int = 18) -> dict[str, Any]:
    st = pstats.Stats(str(path))
    rows = []
    total_calls = 0
    total_tt = 0.0
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        total_calls += nc
        total_tt += tt
        rows.append((tt, nc, 0.0, f"{name} ({os.path.basename(file)}:{line})"))
    rows.sort(reverse=True)
    return {
        "calls_per_unit": round(total_calls / per, 1),
        "own_us_per_unit": round(1e6 * total_tt / per, 1),
        "top": [
            {"fn": f, "own_us_per_unit": round(1e6 * tt / per, 2), "calls_per_unit": round(nc / per, 2)}
            for tt, nc, _ct, f in rows[:n]
        ],
    }


async def _phase(args: argparse.Namespace, procs: H.Procs, out_dir: Path, phase: str) -> dict[str, Any]:
    prof = {"router": out_dir / f"{phase}_router.prof", "engine": out_dir / f"{phase}_engine.prof"}
    for p in prof.values():
        p.unlink(missing_ok=True)
    fe, ev, ctl, data, weights = H.free_ports(5)
    me = [sys.executable, "-m", "bench.profile_hop", "--child"]
    grind = {role: out_dir / f"{phase}_{role}.callgrind" for role in ("router", "engine")}

    def under(role: str, argv: list[str]) -> list[str]:
        if not args.callgrind:
            return argv
        grind[role].unlink(missing_ok=True)
        # Instrumentation starts after the warm-up (callgrind_control -i on).
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={grind[role]}", *argv]

    router = procs.start(
        f"prof_{phase}_router",
        under("router", [*me, "router_node", str(prof["router"]), "--", "--frontend", f"tcp://{H.LOOPBACK}:{fe}",
         "--events", f"tcp://{H.LOOPBACK}:{ev}", "--control", f"tcp://{H.LOOPBACK}:{ctl}",
         "--policy", args.policy, "--heartbeat-interval-s", "0.5", *RB.bench_token(procs)]),
        env={"ROLLOUT_BUS_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    H.wait_port(fe, 300, proc=router)
    engine = procs.start(
        f"prof_{phase}_engine",
        under("engine", [*me, "engine_node", str(prof["engine"]), "--", "--engine-id", "p-e0",
         "--head-events", f"tcp://{H.LOOPBACK}:{ev}", "--head-control", f"tcp://{H.LOOPBACK}:{ctl}",
         "--data-address", f"tcp://{H.LOOPBACK}:{data}", "--weight-address", f"tcp://{H.LOOPBACK}:{weights}",
         "--backend", NULL_BACKEND, "--model", "null",
         "--backend-options", json.dumps({"tokens_per_step": 1}), "--heartbeat-interval-s", "0.5",
         "--advertise-host", H.LOOPBACK, *RB.bench_token(procs), "--direct-clients"]),
        env={"ROLLOUT_BUS_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    client = RB.make_client(f"tcp://{H.LOOPBACK}:{fe}")
    try:
        await RB.wait_healthy(client, 1, 600, procs)
    finally:
        await client.close()
    if phase == "hop":
        drv = RB.RawDriver(f"tcp://{H.LOOPBACK}:{fe}")
        spec, units = RB.RbLoad(args.requests, 1, 1, False, list(range(1, 17))), args.requests
    else:
        n = max(1, args.requests // 8)
        drv = RB.RawDriver(f"tcp://{H.LOOPBACK}:{data}")
        spec, units = RB.RbLoad(n, 1, 64, True, list(range(1, 17))), n * 64
    try:
        await RB.raw_load(drv, RB.RbLoad(50, 1, spec.max_tokens, spec.stream, spec.prompt))  # warm-up
        if args.callgrind:
            for child in (router, engine):
                subprocess.run(["callgrind_control", "-i", "on", str(child.pid)], check=True, capture_output=True)
        elif not args.cpu_only:
            for child in (router, engine):
                os.kill(child.pid, signal.SIGUSR1)
        await asyncio.sleep(0.2)
        cpu0 = {role: _cpu_s(c.pid) for role, c in (("router", router), ("engine", engine))}
        t0 = time.perf_counter()
        res = await RB.raw_load(drv, spec)
        wall = time.perf_counter() - t0
        if args.callgrind:  # off before the exit: the interpreter's shutdown is not per-message work
            for child in (router, engine):
                subprocess.run(["callgrind_control", "-i", "off", str(child.pid)], check=True, capture_output=True)
        cpu = {role: _cpu_s(c.pid) - cpu0[role] for role, c in (("router", router), ("engine", engine))}
    finally:
        await drv.close()
    for child in (engine, router):
        child.send_signal(signal.SIGTERM)  # a clean exit writes the profile (valgrind takes seconds)
        try:
            child.wait(120)
        except subprocess.TimeoutExpired:
            pass
        procs.stop(child)
    out: dict[str, Any] = {"units": units, "unit": "request" if phase == "hop" else "chunk", "wall_s": round(wall, 3)}
    lat = sorted(res.latencies_s)
    out["errors"] = res.errors
    # Process CPU (every thread, libzmq's I/O thread included) per unit: the
    # number to compare between runs without the profiler (--cpu-only).
    out["cpu_us_per_unit"] = {role: round(1e6 * v / units, 1) for role, v in cpu.items()}
    out["p50_ms"] = round(1e3 * lat[len(lat) // 2], 3) if lat else None
    for role, path in list(prof.items()):
        if path.exists() and not (args.cpu_only or args.callgrind):
            out[role] = _top(path, units)
        if args.callgrind and grind[role].exists():
            out.setdefault("instructions_per_unit", {})[role] = round(_ir(grind[role]) / units)
    return out


async def main_async(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"requests": args.requests, "policy": args.policy}
    with H.Procs() as procs:
        for phase in ("hop", "stream"):
            results[phase] = await _phase(args, procs, out_dir, phase)
    for phase in ("hop", "stream"):
        r = results[phase]
        print(f"{phase}: p50 {r['p50_ms']} ms, CPU µs per {r['unit']}: {r['cpu_us_per_unit']}")
        if "instructions_per_unit" in r:
            print(f"{phase}: instructions per {r['unit']}: {r['instructions_per_unit']}")
        for role in ("router", "engine"):
            if role not in r:
                continue
            t = r[role]  # fmt: skip
            print(
                f"\n== {phase}: {role}: {t['calls_per_unit']} calls / {r['unit']}, {t['own_us_per_unit']} µs own (profiled)"
            )
            for row in t["top"]:
                print(f"  {row['own_us_per_unit']:8.2f} µs {row['calls_per_unit']:7.2f}x  {row['fn']}")
    dest = Path(args.json or "bench/results/profile_hop.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {dest}")
    return 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        role, out = sys.argv[2], sys.argv[3]
        rest = sys.argv[sys.argv.index("--") + 1 :]
        sys.exit(child_main(role, out, rest))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--policy", default="least_loaded")
    ap.add_argument("--out-dir", default="/tmp/rollout-bus-profile")
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--callgrind",
        action="store_true",
        help="head and engine under valgrind's callgrind (no cProfile): instructions per request / chunk, repeatable",
    )
    ap.add_argument("--cpu-only", action="store_true", help="no profiler: process CPU per request / chunk only")
    args = ap.parse_args()
    H.run_main(lambda: main_async(args))


if __name__ == "__main__":
    main()
