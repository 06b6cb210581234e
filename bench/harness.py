"""Benchmark harness: timing, statistics, tables, JSON/PNG output, processes.

Honesty rules this module helps to keep:
- warm up before measuring (``measure(..., warmup=...)``);
- repeat (``reps``) and report the median and spread across repetitions;
- compare two setups by *paired* ratios: interleave them inside each
  repetition (``interleaved``) and take the median of the per-repetition
  ratios, so slow drift of a noisy machine hits both sides alike;
- bound everything: ``Deadline`` for phases, ``Procs`` kills every process
  tree it started (also on error / Ctrl-C), addresses are loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def latency_summary(lat_s: Sequence[float]) -> dict[str, float]:
    """Seconds in, milliseconds out."""
    return {
        "n": len(lat_s),
        "p50_ms": percentile(lat_s, 50) * 1e3,
        "p90_ms": percentile(lat_s, 90) * 1e3,
        "p99_ms": percentile(lat_s, 99) * 1e3,
        "mean_ms": (sum(lat_s) / len(lat_s) * 1e3) if lat_s else math.nan,
        "max_ms": (max(lat_s) * 1e3) if lat_s else math.nan,
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and spread of one metric across repetitions."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "rel_spread": math.nan, "reps": 0}
    m = median(vals)
    return {
        "median": m,
        "min": min(vals),
        "max": max(vals),
        # (max - min) / median: how much the repetitions disagree
        "rel_spread": (max(vals) - min(vals)) / m if m else math.nan,
        "reps": len(vals),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Per-repetition ratios num[i]/den[i] (measured side by side), summarized."""
    return spread([ratio(a, b) for a, b in zip(num, den)])


def fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def fmt_spread(s: dict[str, float], nd: int = 2) -> str:
    """'median [min–max]'."""
    if not s or s.get("reps", 0) == 0:
        return "-"
    if s["reps"] == 1:
        return fmt(s["median"], nd)
    return f"{fmt(s['median'], nd)} [{fmt(s['min'], nd)}-{fmt(s['max'], nd)}]"


# -------------------------------------------------------------- measuring


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


class DeadlineExceeded(RuntimeError):
    pass


class Deadline:
    def __init__(self, seconds: float, what: str = "benchmark") -> None:
        self.what = what
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def check(self, where: str = "") -> None:
        if self.remaining() <= 0:
            raise DeadlineExceeded(f"{self.what}: deadline passed{' at ' + where if where else ''}")

    def cap(self, seconds: float) -> float:
        """min(seconds, remaining), at least a small positive number."""
        return max(0.05, min(seconds, self.remaining()))


# ------------------------------------------------------------------ output


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Print rows (dicts) as an aligned text table; returns the text."""
    if not rows:
        text = f"{title or ''}\n(no rows)"
        print(text, flush=True)
        return text
    cols = list(columns) if columns else list(rows[0].keys())
    cells = [[fmt(r.get(c)) if not isinstance(r.get(c), str) else r.get(c) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        info["cpu_count_physical"] = psutil.cpu_count(logical=False)
        info["mem_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        pass
    return info


def _jsonable(o: Any) -> Any:
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, RunResult):
        return o.summary()
    if isinstance(o, Path):
        return str(o)
    return o


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(_jsonable(doc), indent=2, sort_keys=False) + "\n")
    print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}.png"


_COLORS: dict[str, Any] = {}


def color_for(label: str) -> Any:
    """The same color for the same series label in every panel and figure of a run."""
    if label not in _COLORS:
        palette = [f"C{i}" for i in range(10)] + ["black", "olive", "teal", "navy", "maroon"]
        _COLORS[label] = palette[len(_COLORS) % len(palette)]
    return _COLORS[label]


def plot_lines(
    name: str,
    panels: Sequence[dict[str, Any]],
    *,
    suptitle: str | None = None,
    note: str | None = None,
) -> Path:
    """One PNG with one subplot per panel.

    panel = {"title", "xlabel", "ylabel", "series": {label: (xs, ys, yerr_lo?, yerr_hi?)},
             "logx": bool, "logy": bool, "hline": float | None}
    yerr_lo/hi are absolute lower/upper values (e.g. min/max across reps)."""
    plt = _plt()
    n = len(panels)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, s in panel["series"].items():
            xs, ys = list(s[0]), list(s[1])
            if len(s) >= 4 and s[2] is not None:
                lo = [max(0.0, y - lv) for y, lv in zip(ys, s[2])]
                hi = [max(0.0, h - y) for y, h in zip(ys, s[3])]
                ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label, color=color_for(label))
            else:
                ax.plot(xs, ys, marker="o", label=label, color=color_for(label))
        if panel.get("hline") is not None:
            ax.axhline(panel["hline"], color="gray", lw=0.8, ls="--")
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
            xt = sorted({x for s in panel["series"].values() for x in s[0]})
            ax.set_xticks(xt)
            ax.set_xticklabels([str(x) for x in xt])
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _finish_figure(plt, fig, list(axes.flat)[n:], name, suptitle, note, top=0.96)


def _finish_figure(
    plt: Any, fig: Any, unused_axes: list[Any], name: str, suptitle: str | None, note: str | None, *, top: float
) -> Path:
    """Hide unused panels, title, footnote, save as bench/results/<name>.png."""
    for ax in unused_axes:
        ax.axis("off")
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="dimgray")
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, top if suptitle else 1))
    path = png_path(name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path.relative_to(REPO_ROOT)}", flush=True)
    return path


def plot_bars(
    name: str,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    ylabel: str,
    title: str | None = None,
    errs: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None,
    logy: bool = False,
    note: str | None = None,
) -> Path:
    """Grouped bars: one group per x label, one bar per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) * 0.6), 4.2))
    k = max(1, len(series))
    width = 0.8 / k
    for i, (label, ys) in enumerate(series.items()):
        xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
        yerr = None
        if errs and label in errs:
            lo, hi = errs[label]
            yerr = [[max(0.0, y - lv) for y, lv in zip(ys, lo)], [max(0.0, h - y) for y, h in zip(ys, hi)]]
        ax.bar(xs, ys, width=width, label=label, yerr=yerr, capsize=3 if yerr else 0, color=color_for(label))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _finish_figure(plt, fig, [], name, None, note, top=1.0)


# --------------------------------------------------------------- processes


def free_port() -> int:
    """A currently free TCP port on loopback (small race, fine for benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_port(port: int, deadline_s: float, host: str = LOOPBACK, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before listening on {port}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {deadline_s:.0f}s")


class Procs:
    """Starts child processes in their own process groups and kills every
    tree it started on exit (SIGTERM, grace, SIGKILL; descendants found with
    psutil too). Also installs SIGTERM → SystemExit so `with` blocks unwind."""

    def __init__(self, log_dir: Path | None = None, grace_s: float = 3.0) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.grace_s = grace_s
        # Logs stay out of the repository: /tmp/rollout-bus-bench/<pid>/<name>.log
        self.log_dir = log_dir or (Path(tempfile.gettempdir()) / "rollout-bus-bench" / str(os.getpid()))
        self._prev_term = None

    def __enter__(self) -> Procs:
        if _is_main_thread():
            self._prev_term = signal.signal(signal.SIGTERM, _raise_exit)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill_all()
        if self._prev_term is not None:
            signal.signal(signal.SIGTERM, self._prev_term)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        log: bool = True,
    ) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{name}.log", "wb") if log else subprocess.DEVNULL
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        pp = str(REPO_ROOT)
        full_env["PYTHONPATH"] = pp + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
        if env:
            full_env.update(env)
        p = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(cwd or REPO_ROOT),
            env=full_env,
            start_new_session=True,  # own process group: killpg reaches the whole tree
        )
        if log:
            out.close()
        self.procs.append((name, p))
        return p

    def log_tail(self, name: str, n: int = 30) -> str:
        try:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError:
            return ""

    def pids(self) -> list[int]:
        return [p.pid for _, p in self.procs if p.poll() is None]

    def stop(self, p: subprocess.Popen) -> None:
        _kill_tree(p, self.grace_s)
        self.procs = [(n, q) for n, q in self.procs if q is not p]

    def kill_all(self) -> None:
        procs, self.procs = self.procs, []
        # SIGTERM everyone first, then wait once, then SIGKILL the stragglers.
        trees = []
        for _, p in procs:
            trees.append((p, _descendants(p.pid)))
            _signal_group(p, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        for p, _ in trees:
            with contextlib.suppress(Exception):
                p.wait(timeout=max(0.0, end - time.monotonic()))
        for p, desc in trees:
            _signal_group(p, signal.SIGKILL)
            for d in desc:
                with contextlib.suppress(Exception):
                    d.kill()
            with contextlib.suppress(Exception):
                p.wait(timeout=2)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)  # pgid == pid (start_new_session)


def _kill_tree(p: subprocess.Popen, grace_s: float) -> None:
    desc = _descendants(p.pid)
    _signal_group(p, signal.SIGTERM)
    with contextlib.suppress(Exception):
        p.wait(timeout=grace_s)
    _signal_group(p, signal.SIGKILL)
    for d in desc:
        with contextlib.suppress(Exception):
            d.kill()
    with contextlib.suppress(Exception):
        p.wait(timeout=2)


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


def run_main(coro_fn: Callable[[], Awaitable[int | None]]) -> None:
    """asyncio.run with Ctrl-C → exit 130 (Procs context managers still unwind)."""
    try:
        rc = asyncio.run(coro_fn())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
    sys.exit(rc or 0)


def plot_bar_panels(
    name: str, panels: Sequence[dict[str, Any]], *, suptitle: str | None = None, note: str | None = None
) -> Path:
    """Several grouped-bar panels in one PNG.

    panel = {"title", "ylabel", "groups": [x labels], "series": {label: [y per group]},
             "errs": {label: (lo list, hi list)} (optional), "logy": bool}"""
    plt = _plt()
    n = len(panels)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.8 * cols, 4.4 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        groups, series = p["groups"], p["series"]
        k = max(1, len(series))
        width = 0.8 / k
        for i, (label, ys) in enumerate(series.items()):
            xs = [g + (i - (k - 1) / 2) * width for g in range(len(groups))]
            ys = [0.0 if (y is None or (isinstance(y, float) and math.isnan(y))) else y for y in ys]
            yerr = None
            if p.get("errs") and label in p["errs"]:
                lo, hi = p["errs"][label]
                yerr = [
                    [max(0.0, y - (lv or 0)) for y, lv in zip(ys, lo)],
                    [max(0.0, (h or 0) - y) for y, h in zip(ys, hi)],
                ]
            ax.bar(xs, ys, width=width, label=label, yerr=yerr, capsize=2 if yerr else 0, color=color_for(label))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=8)
        ax.set_ylabel(p.get("ylabel", ""))
        if p.get("logy"):
            ax.set_yscale("log")
        ax.set_title(p.get("title", ""), fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return _finish_figure(plt, fig, list(axes.flat)[n:], name, suptitle, note, top=0.95)
