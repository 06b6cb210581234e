"""Measuring: one load run (`run_load` → `RunResult`), repetitions interleaved
side by side (`interleaved`, `summarize_reps`) and the CPU use of processes
during a run (`CpuMeter`, `with_cpu`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.procs import Deadline, DeadlineExceeded
from bench.stats import latency_summary, percentile, spread


@dataclass
class RunResult:
    """One measured run: per-request latencies and the wall time of the batch."""

    latencies_s: list[float]
    wall_s: float
    errors: int = 0
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.latencies_s)

    @property
    def rps(self) -> float:
        return self.n / self.wall_s if self.wall_s > 0 else math.nan

    def summary(self) -> dict[str, Any]:
        d = latency_summary(self.latencies_s)
        d.update(req_per_s=self.rps, wall_s=self.wall_s, errors=self.errors, tokens=self.tokens)
        if self.tokens and self.wall_s > 0:
            d["tokens_per_s"] = self.tokens / self.wall_s
        d.update(self.extra)
        return d


async def run_load(
    n: int,
    concurrency: int,
    request: Callable[[int], Awaitable[tuple[int, float | None, bool]]],
    *,
    expected_tokens: int,
    timeout_s: float,
    stream: bool,
    lags: list[float] | None = None,
) -> RunResult:
    """N requests through `concurrency` workers pulling from one counter; the
    shape every driver (HTTP, trainer_bridge, raw zmq) shares.

    `request(i)` sends request i and returns (tokens received, perf_counter of
    the first token or None, finished). Latency is send → last byte; a request
    that fails, times out (`timeout_s` + 5) or comes back short is counted as
    an error, with a few samples kept."""
    lat: list[float] = []
    ttft: list[float] = []
    errors = tokens = next_i = 0
    err_sample: list[str] = []

    async def one(i: int) -> None:
        nonlocal errors, tokens
        t0 = time.perf_counter()
        try:
            got, first, finished = await asyncio.wait_for(request(i), timeout_s + 5)
            t1 = time.perf_counter()
            if not finished or got != expected_tokens:
                raise RuntimeError(f"incomplete: {got}/{expected_tokens} tokens, finished={finished}")
        except Exception as e:
            errors += 1
            if len(err_sample) < 3:
                err_sample.append(repr(e)[:300])
            return
        lat.append(t1 - t0)
        if first is not None:
            ttft.append(first - t0)
        tokens += got

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            await one(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    wall = time.perf_counter() - t0
    extra: dict[str, Any] = {}
    if stream and ttft:
        extra["ttft_p50_ms"] = percentile(ttft, 50) * 1e3
        extra["ttft_p99_ms"] = percentile(ttft, 99) * 1e3
    if lags is not None:
        extra["lags_s"] = lags
    if err_sample:
        extra["error_sample"] = err_sample
    return RunResult(lat, wall, errors=errors, tokens=tokens, extra=extra)


def summarize_reps(runs: Sequence[RunResult]) -> dict[str, Any]:
    """Median + spread across repetitions of p50, p99, req/s (and tokens/s)."""
    sums = [r.summary() for r in runs]
    out: dict[str, Any] = {"reps": len(runs)}
    for key in ("p50_ms", "p99_ms", "mean_ms", "req_per_s", "tokens_per_s", "cpu_pct", "ttft_p50_ms", "ttft_p99_ms"):
        vals = [s[key] for s in sums if key in s]
        if vals:
            out[key] = spread(vals)
    out["errors"] = sum(s["errors"] for s in sums)
    out["n_per_rep"] = sums[0]["n"] if sums else 0
    return out


async def interleaved(
    setups: dict[str, Callable[[], Awaitable[RunResult]]],
    *,
    reps: int,
    warmup: int = 1,
    deadline: Deadline | None = None,
    on_run: Callable[[str, int, RunResult], None] | None = None,
) -> dict[str, list[RunResult]]:
    """Run every setup once per repetition, in rotating order, after `warmup`
    unmeasured rounds. Returns {setup: [RunResult per rep]}."""
    names = list(setups)
    for _ in range(warmup):
        for name in names:
            if deadline:
                deadline.check(f"warm-up {name}")
            await setups[name]()
    out: dict[str, list[RunResult]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            if deadline:
                deadline.check(f"rep {rep} {name}")
            r = await setups[name]()
            out[name].append(r)
            if on_run:
                on_run(name, rep, r)
    return out


async def interleaved_within(
    setups: dict[str, Callable[[], Awaitable[RunResult]]], *, reps: int, deadline: Deadline
) -> tuple[dict[str, list[RunResult]], bool]:
    """`interleaved`, but a passed deadline keeps what was measured: every
    setup's first min(reps done) repetitions (complete rounds only, so paired
    ratios stay paired). Returns (runs, truncated); runs is {} when not one
    round finished."""
    got: dict[str, list[RunResult]] = {name: [] for name in setups}
    try:
        runs = await interleaved(
            setups, reps=reps, warmup=1, deadline=deadline, on_run=lambda name, _rep, r: got[name].append(r)
        )
        return runs, False
    except DeadlineExceeded:
        done = min(len(rs) for rs in got.values())
        return ({name: rs[:done] for name, rs in got.items()} if done else {}), True


class CpuMeter:
    """CPU seconds used by a set of processes (and their children) between
    start() and stop(); cpu_pct = 100 * cpu_s / wall_s (can exceed 100)."""

    def __init__(self, pids: Iterable[int]) -> None:
        import psutil

        self._procs = []
        for pid in pids:
            with contextlib.suppress(Exception):
                self._procs.append(psutil.Process(pid))
        self._t0 = 0.0
        self._c0 = 0.0

    def _cpu(self) -> float:
        total = 0.0
        for p in self._procs:
            with contextlib.suppress(Exception):
                t = p.cpu_times()
                total += t.user + t.system
                for c in p.children(recursive=True):
                    with contextlib.suppress(Exception):
                        ct = c.cpu_times()
                        total += ct.user + ct.system
        return total

    def start(self) -> None:
        self._c0 = self._cpu()
        self._t0 = time.monotonic()

    def stop(self) -> dict[str, float]:
        cpu = self._cpu() - self._c0
        wall = time.monotonic() - self._t0
        return {"cpu_s": cpu, "wall_s": wall, "cpu_pct": 100.0 * cpu / wall if wall > 0 else math.nan}


def with_cpu(pids: Iterable[int], fn: Callable[[], Awaitable[RunResult]]) -> Callable[[], Awaitable[RunResult]]:
    """Wrap a run so its RunResult.extra carries the CPU use of `pids` during it
    (keys cpu_s, cpu_pct: 100 = one core busy)."""
    pids = list(pids)

    async def run() -> RunResult:
        m = CpuMeter(pids)
        m.start()
        r = await fn()
        c = m.stop()
        r.extra["cpu_s"] = c["cpu_s"]
        r.extra["cpu_pct"] = c["cpu_pct"]
        return r

    return run
