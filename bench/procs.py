"""Processes, ports and deadlines for benchmarks: `Procs` starts children in
their own process groups and ends every tree it started on exit
(`bus.proctree.terminate_tree`), loopback ports, `Deadline` for phases, and
`run_main` (the benchmarks' entry point: logging configured, Ctrl-C → 130).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from bench.report import REPO_ROOT
from bus.proctree import terminate_tree

LOOPBACK = "127.0.0.1"


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


class Procs:
    """Starts child processes in their own process groups and ends every
    tree it started on exit (`bus.proctree.terminate_tree`: SIGTERM, grace,
    SIGKILL). Also installs SIGTERM → SystemExit so `with` blocks unwind."""

    def __init__(self, log_dir: Path | None = None, grace_s: float = 3.0) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.grace_s = grace_s
        # Logs stay out of the repository: /tmp/rollout-bus-bench/<pid>/<name>.log
        self.log_dir = log_dir or (Path(tempfile.gettempdir()) / "rollout-bus-bench" / str(os.getpid()))
        self._prev_term: Any = None

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
        out: Any = open(self.log_dir / f"{name}.log", "wb") if log else subprocess.DEVNULL
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
        terminate_tree(p, self.grace_s, kill_wait_s=2)
        self.procs = [(n, q) for n, q in self.procs if q is not p]

    def kill_all(self) -> None:
        # Every tree at once: SIGTERM everyone, wait one grace, SIGKILL the stragglers.
        procs, self.procs = self.procs, []
        terminate_tree([p for _, p in procs], self.grace_s, kill_wait_s=2)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def setup_logging() -> None:
    """structlog for a benchmark process (entry points configure logging, libraries
    never do): WARNING unless ROLLOUT_BUS_LOG_LEVEL says otherwise, on stderr."""
    from bus.runtime import configure_logging

    configure_logging(os.environ.get("ROLLOUT_BUS_LOG_LEVEL", "WARNING"))


def run_main(coro_fn: Callable[[], Coroutine[Any, Any, int | None]]) -> None:
    """The benchmarks' entry point: structlog configured (an entry point's job;
    WARNING unless ROLLOUT_BUS_LOG_LEVEL says otherwise, on stderr so tables stay
    clean), asyncio.run, Ctrl-C → exit 130 (Procs context managers still unwind)."""
    setup_logging()
    rc: int | None
    try:
        rc = asyncio.run(coro_fn())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
    sys.exit(rc or 0)
