"""Fault soak (issue 22, "Tests"): head kill -9 / restart and trainer kill -9
inside `paused()`, alternating every --fault-every-s, for --minutes on CPU.

The cluster is `python launch.py` (torch backend, 2 engines, free ports, a
short --lease-s): the launcher supervises and restarts a dead head on the
same ports, the engines re-register (Rejoin). One AsyncClient runs
--concurrency workers looping generate / stream of 100-400 tokens; every
request's start, end and outcome is recorded.

Faults, alternating:
  head     kill -9 of the launcher's router_node child; a probe measures
           when the cluster serves again.
  trainer  a subprocess connects, enters `with client.paused("keep"):` and is
           kill -9'd ~1 s later; the head's lease must release the pause
           within lease_s + 3 s (is_paused() false and a request served).

Criteria: every request ended (no hang past --hang-s); every error is of a
request on a dead head: in flight at a kill and ended with HeadUnavailable
within 2 s of it, or issued between the kill and the cluster serving again
(HeadUnavailable, or NoHealthyEngine from the new head before its engines
re-registered; counted apart); no other error; every
request that finished produced its full max_tokens; the cluster serves again
after every head kill (time reported) and every trainer kill's pause is gone
within lease_s + 3 s; RSS of the engines grows < 25% warm-up → end.

    python -m bench.soak_faults --minutes 30      # the issue's run
    python -m bench.soak_faults --minutes 2 --fault-every-s 20

Writes bench/results/soak_faults.json; exit code 1 when a criterion fails, 2
when none failed but one could not be judged: memory growth needs at least 8
RSS samples (--sample-every-s), and a shorter run says "memory: not judged"
instead of passing it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

from bench import report as H
from bus.proctree import terminate_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ERROR_WINDOW_S = 2.0  # a request in flight at a head kill ends with HeadUnavailable within this
GROWTH_LIMIT = 0.25
# Typed errors of a request issued between a head kill and the cluster serving
# again: HeadUnavailable (no head, connect_timeout_s) or NoHealthyEngine (the
# new head is up, its engines have not re-registered yet, ~1 s).
RECOVERY_ERRORS = ("HeadUnavailable", "NoHealthyEngine")

TRAINER = """
import sys, time
from trainer_bridge import Client
c = Client(sys.argv[1])
c.wait_ready(timeout_s=30)
with c.paused("keep"):
    print("PAUSED", flush=True)
    time.sleep(3600)
"""


class Launcher:
    """`python launch.py` in its own process group; stdout collected."""

    def __init__(self, lease_s: float, engines: int) -> None:
        argv = [
            sys.executable, os.path.join(ROOT, "launch.py"), "--backend", "torch", "--engines", str(engines),
            "--port", "0", "--lease-s", str(lease_s), "--max-restarts", "1000", "--ready-timeout-s", "120",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        self.lines: list[str] = []
        self.front: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "trainer connects to:" in line:
                self.front = line.split("trainer connects to:")[1].split()[0]
            if "serving;" in line:
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s) or self.front is None:
            raise RuntimeError(f"launch.py not serving within {timeout_s}s:\n" + "\n".join(self.lines[-30:]))
        return self.front

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def role_pids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {"head": [], "engine": []}
        for p in self.children():
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "router_node" in cmd:
                out["head"].append(p.pid)
            elif "engine_node" in cmd:
                out["engine"].append(p.pid)
        return out


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            total += p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
        except psutil.Error:
            pass
    return total / 2**20


class Soak:
    def __init__(self, a: argparse.Namespace, launcher: Launcher, front: str) -> None:
        self.a = a
        self.launcher = launcher
        self.front = front
        self.requests: list[dict[str, Any]] = []
        self.head_faults: list[dict[str, Any]] = []
        self.trainer_faults: list[dict[str, Any]] = []
        self.rss: list[dict[str, float]] = []
        self.t0 = time.monotonic()
        self.head_down: list[list[float]] = []  # [kill, served again] in monotonic time

    async def _one(self, client: Any, rng: random.Random, vocab: int) -> None:
        from bus.errors import RolloutBusError

        kind = rng.choice(("generate", "stream"))
        max_tokens = rng.randrange(100, 401)
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randrange(4, 24))]
        params = {"max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}
        rec: dict[str, Any] = {"kind": kind, "max_tokens": max_tokens, "start": time.monotonic()}
        self.requests.append(rec)
        try:
            if kind == "generate":
                r = await asyncio.wait_for(client.generate(prompt, params), self.a.hang_s)
                n, fin = len(r.token_ids), r.finish_reason
            else:
                n, fin = 0, None

                async def run() -> None:
                    nonlocal n, fin
                    async for ch in client.stream(prompt, params):
                        n += len(ch.token_ids)
                        fin = ch.finish_reason or fin

                await asyncio.wait_for(run(), self.a.hang_s)
            rec["outcome"] = "finished" if n == max_tokens else f"short:{n}:{fin}"
        except asyncio.TimeoutError:
            rec["outcome"] = "hang"
        except RolloutBusError as e:
            rec["outcome"] = type(e).__name__
            rec["error"] = str(e)[:300]
        except Exception as e:  # untyped: a defect
            rec["outcome"] = f"untyped:{type(e).__name__}"
            rec["error"] = str(e)[:300]
        rec["end"] = time.monotonic()

    async def _worker(self, client: Any, end: float, seed: int, vocab: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            await self._one(client, rng, vocab)
            if self.requests[-1].get("outcome") != "finished":
                await asyncio.sleep(0.2)  # the client reconnects by itself; do not spin

    async def _serves(self, client: Any, deadline_s: float) -> float | None:
        """Seconds until a 1-token request is served (None: not within deadline_s)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline_s:
            try:
                await asyncio.wait_for(client.generate([5, 6, 7], {"max_tokens": 1}), 5)
                return time.monotonic() - t0
            except Exception:
                await asyncio.sleep(0.1)
        return None

    async def _head_fault(self, client: Any) -> None:
        heads = self.launcher.role_pids()["head"]
        if not heads:
            self.head_faults.append({"t": time.monotonic() - self.t0, "error": "no head process found"})
            return
        kill = time.monotonic()
        os.kill(heads[0], signal.SIGKILL)
        window = [kill, float("inf")]
        self.head_down.append(window)
        back = await self._serves(client, self.a.recover_s)
        window[1] = kill + back if back is not None else float("inf")
        new = self.launcher.role_pids()["head"]
        self.head_faults.append(
            {"t": kill - self.t0, "killed_pid": heads[0], "new_pid": new[0] if new else None, "serves_again_s": back}
        )

    async def _trainer_fault(self, client: Any) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TRAINER, self.front, stdout=asyncio.subprocess.PIPE, env=env
        )
        rec: dict[str, Any] = {"t": time.monotonic() - self.t0}
        self.trainer_faults.append(rec)
        try:
            assert p.stdout is not None
            line = await asyncio.wait_for(p.stdout.readline(), 60)
            rec["paused"] = line.strip() == b"PAUSED"
            rec["is_paused_before_kill"] = await client.is_paused()
            await asyncio.sleep(1.0)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            if p.returncode is None:
                p.kill()
            await p.wait()
        kill = time.monotonic()
        limit = self.a.lease_s + 3.0
        released = None
        while time.monotonic() - kill < limit + 10:
            try:
                if not await client.is_paused():
                    released = time.monotonic() - kill
                    break
            except Exception:
                pass
            await asyncio.sleep(0.1)
        rec["released_s"] = released
        rec["serves_after_s"] = await self._serves(client, 10) if released is not None else None
        rec["ok"] = bool(
            rec.get("paused") and rec.get("is_paused_before_kill") and released is not None and released <= limit
        ) and (rec["serves_after_s"] is not None)

    async def _faults(self, client: Any, end: float) -> None:
        i = 0
        while True:
            await asyncio.sleep(max(0.0, min(self.a.fault_every_s, end - time.monotonic())))
            if time.monotonic() >= end - 5:
                return
            await (self._head_fault if i % 2 == 0 else self._trainer_fault)(client)
            i += 1

    async def _sampler(self, end: float) -> None:
        while time.monotonic() < end:
            roles = self.launcher.role_pids()
            self.rss.append(
                {
                    "t": time.monotonic() - self.t0,
                    "head_mib": _rss_mib(roles["head"]),
                    "engines_mib": _rss_mib(roles["engine"]),
                }
            )
            await asyncio.sleep(self.a.sample_every_s)

    async def run(self) -> None:
        from trainer_bridge import AsyncClient

        client = AsyncClient(self.front)
        try:
            await client.wait_ready(timeout_s=60)
            vocab = 200
            end = time.monotonic() + self.a.minutes * 60
            self.t0 = time.monotonic()
            tasks = [self._worker(client, end, i, vocab) for i in range(self.a.concurrency)]
            await asyncio.gather(*tasks, self._faults(client, end), self._sampler(end))
        finally:
            await client.close()

    def classify(self) -> dict[str, Any]:
        """Each error explained by a head kill (in flight at it, or issued while the head was down)."""
        latencies, on_dead, unexplained = [], 0, []
        on_dead_by: dict[str, int] = {}
        for r in self.requests:
            out = r.get("outcome")
            if out in (None, "finished"):
                continue
            if out not in RECOVERY_ERRORS:
                unexplained.append(r)
                continue
            hit = None
            for kill, back in self.head_down:
                if out == "HeadUnavailable" and r["start"] <= kill <= r["end"]:
                    hit = ("inflight", r["end"] - kill)
                    break
                if kill <= r["start"] <= back + 1.0:
                    hit = ("on_dead", 0.0)
                    on_dead_by[out] = on_dead_by.get(out, 0) + 1
                    break
            if hit is None:
                unexplained.append(r)
            elif hit[0] == "inflight":
                r["error_after_kill_s"] = hit[1]
                latencies.append(hit[1])
            else:
                on_dead += 1
        return {"latencies": latencies, "on_dead": on_dead, "on_dead_by": on_dead_by, "unexplained": unexplained}


MIN_RSS_SAMPLES = 8  # fewer: the run is too short to tell growth from start-up


def _growth(rss: list[dict[str, float]], key: str) -> float | None:
    """Growth of `key` from the end of the warm-up (10% of the samples) to the
    end; None (not judged) with fewer than MIN_RSS_SAMPLES samples."""
    if len(rss) < MIN_RSS_SAMPLES:
        return None
    warm = rss[max(1, len(rss) // 10) :][:3]
    last = rss[-3:]
    w = sum(s[key] for s in warm) / len(warm)
    e = sum(s[key] for s in last) / len(last)
    return (e - w) / w if w else 0.0


def report(s: Soak, a: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    c = s.classify()
    outcomes: dict[str, int] = {}
    for r in s.requests:
        outcomes[r.get("outcome", "unended")] = outcomes.get(r.get("outcome", "unended"), 0) + 1
    hangs = outcomes.get("hang", 0) + outcomes.get("unended", 0)
    late = [x for x in c["latencies"] if x > ERROR_WINDOW_S]
    serves = [f.get("serves_again_s") for f in s.head_faults]
    released = [f.get("released_s") for f in s.trainer_faults]
    eng_growth = _growth(s.rss, "engines_mib")
    criteria = {
        "no_hangs": hangs == 0,
        "errors_only_head_unavailable_on_dead_head": not c["unexplained"],
        "inflight_errors_within_2s": not late,
        "head_restarts_serve_again": bool(s.head_faults) and all(x is not None for x in serves),
        "trainer_pause_released_within_lease_plus_3s": bool(s.trainer_faults)
        and all(f.get("ok") for f in s.trainer_faults),
        # None: not judged (too few samples): never a pass of the check
        "engine_rss_growth_below_25pct": None if eng_growth is None else eng_growth < GROWTH_LIMIT,
    }
    verdict, _ = H.verdict(criteria)
    out = {
        "minutes": a.minutes,
        "fault_every_s": a.fault_every_s,
        "lease_s": a.lease_s,
        "concurrency": a.concurrency,
        "requests": len(s.requests),
        "outcomes": outcomes,
        "tokens": sum(r["max_tokens"] for r in s.requests if r.get("outcome") == "finished"),
        "head_kills": len(s.head_faults),
        "inflight_errors": len(c["latencies"]),
        "inflight_error_max_s": max(c["latencies"], default=None),
        "errors_issued_on_dead_head": c["on_dead"],
        "errors_issued_on_dead_head_by_class": c["on_dead_by"],
        "unexplained_errors": [
            {k: r.get(k) for k in ("kind", "outcome", "error")} | {"t": r["start"] - s.t0}
            for r in c["unexplained"][:20]
        ],
        "serves_again_max_s": max((x for x in serves if x is not None), default=None),
        "head_faults": s.head_faults,
        "trainer_kills": len(s.trainer_faults),
        "pause_released_max_s": max((x for x in released if x is not None), default=None),
        "trainer_faults": s.trainer_faults,
        "rss_head_max_mib": max((x["head_mib"] for x in s.rss), default=0.0),
        "rss_engines_growth": eng_growth,
        "rss": s.rss,
        "rss_samples": len(s.rss),
        "not_judged": [] if eng_growth is not None else [memory_not_judged(len(s.rss))],
        "criteria": criteria,
        "verdict": verdict,
        "passed": verdict == "PASS",
    }
    return out, out["passed"]


def memory_not_judged(n: int) -> str:
    return f"memory: not judged ({n} samples < {MIN_RSS_SAMPLES})"


def print_table(r: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)

    g = r["rss_engines_growth"]

    rows = [
        ("requests", f(r["requests"]), ""),
        ("outcomes", json.dumps(r["outcomes"]), ""),
        ("head kills", f(r["head_kills"]), f"serves again max {f(r['serves_again_max_s'])} s"),
        (
            "in-flight HeadUnavailable",
            f(r["inflight_errors"]),
            f"max {f(r['inflight_error_max_s'])} s after the kill (limit {ERROR_WINDOW_S})",
        ),
        (
            "refused while the head recovered",
            f(r["errors_issued_on_dead_head"]),
            json.dumps(r["errors_issued_on_dead_head_by_class"]),
        ),
        ("unexplained errors", f(len(r["unexplained_errors"])), "must be 0"),
        ("trainer kills", f(r["trainer_kills"]), f"pause released max {f(r['pause_released_max_s'])} s"),
        ("head RSS max (MiB)", f(r["rss_head_max_mib"]), ""),
        (
            "engines RSS growth",
            memory_not_judged(r["rss_samples"]) if g is None else f"{g * 100:.1f}%",
            f"limit {GROWTH_LIMIT * 100:.0f}%",
        ),
    ]
    rows += [(f"criterion {k}", H.criterion(v), "") for k, v in r["criteria"].items()]
    rows.append(("verdict", r["verdict"], ""))
    w = max(len(x[0]) for x in rows)
    for name, val, note in rows:
        print(f"{name.ljust(w)}  {val}  {note}".rstrip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        "soak_faults", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--fault-every-s", type=float, default=150.0)
    ap.add_argument("--lease-s", type=float, default=3.0, help="the head's --lease-s (launch.py --lease-s)")
    ap.add_argument("--hang-s", type=float, default=120.0, help="a request not ended within this is a hang")
    ap.add_argument("--recover-s", type=float, default=60.0, help="the most a head restart may take to serve again")
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak_faults.json"))
    a = ap.parse_args(argv)

    launcher = Launcher(a.lease_s, a.engines)
    seen: list[psutil.Process] = []

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        front = launcher.wait_ready(180)
        seen = launcher.children()
        soak = Soak(a, launcher, front)
        asyncio.run(soak.run())
        result, ok = report(soak, a)
    finally:
        terminate_tree(launcher.proc, grace_s=5, extra=[*seen, *launcher.children()])
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    print_table(result)
    print(f"\nwrote {a.out}")
    return H.verdict(result["criteria"])[1]


if __name__ == "__main__":
    sys.exit(main())
