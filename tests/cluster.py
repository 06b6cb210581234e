"""Test harness: a real head and real engine nodes as subprocesses.

Every process is started here and killed here (`bus.proctree.terminate_tree`:
SIGTERM, grace, SIGKILL of the whole tree); `assert_no_leaks` fails a test that leaves one behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil

from bus import roles
from bus.auth import new_token, read_token, token_path_for, write_token
from bus.errors import HeadUnavailable, RequestTimeout
from bus.proctree import terminate_tree
from bus.roles import Plain
from trainer_bridge import Client

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("ROLLOUT_BUS_LOG_LEVEL", "WARNING")
    env.update(extra)
    return env


class Cluster:
    """A head plus `n_engines` engine nodes on IPC sockets in a private folder."""

    def __init__(
        self,
        n_engines: int = 2,
        *,
        backend: str = "torch",
        model: str = "null",
        router_args: list[str] | None = None,
        engine_args: list[str] | None = None,
        backend_options: dict[str, Any] | None = None,
        heartbeat_interval_s: float = 0.2,
        tcp: bool = False,
    ) -> None:
        """`tcp`: head and engines on loopback TCP (free ports) instead of IPC
        files, so CURVE applies (`--curve-dir` in router_args/engine_args)."""
        self.dir = tempfile.mkdtemp(prefix="rbt-")
        self.tcp = tcp
        self.backend = backend
        self.model = model
        self.engine_args = list(engine_args or [])
        self.backend_options = backend_options or {}
        self.hb = heartbeat_interval_s
        if tcp:
            self.frontend, self.events, self.control = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
        else:
            self.frontend = f"ipc://{self.dir}/front"
            self.events = f"ipc://{self.dir}/events"
            self.control = f"ipc://{self.dir}/control"
        self.procs: dict[str, subprocess.Popen] = {}
        self.clients: list[Client] = []
        # The join token, where launch.py would publish it for this frontend: a
        # Client(cluster.frontend) in this process finds it by itself.
        token_path = token_path_for(self.frontend)
        assert token_path is not None
        self.token_file = write_token(token_path, new_token())
        self.head_args = [
            "-m", "router_node", "--frontend", self.frontend, "--events", self.events,
            "--control", self.control, "--heartbeat-interval-s", str(self.hb),
            "--token-file", self.token_file, *(router_args or []),
        ]  # fmt: skip
        self.head = self._spawn("head", self.head_args)
        for i in range(n_engines):
            self.start_engine(f"e{i}")

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        p = subprocess.Popen([sys.executable, *args], env=child_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[name] = p
        return p

    def data_address(self, eid: str) -> str:
        return "tcp://127.0.0.1:*" if self.tcp else f"ipc://{self.dir}/{eid}.data"

    def start_engine(
        self, eid: str, *, extra: list[str] | None = None, engine_id: str | None = None, token_file: str | None = None
    ) -> subprocess.Popen:
        """Process `eid` (its log name, addresses) serving as `engine_id` (default
        `eid`), presenting `token_file` (default the cluster's; "": none)."""
        weights = "tcp://127.0.0.1:*" if self.tcp else f"ipc://{self.dir}/{eid}.weights"
        token_file = self.token_file if token_file is None else token_file
        token = ["--token-file", token_file] if token_file else []
        return self._spawn(
            eid,
            [
                "-m", "engine_node", "--engine-id", engine_id or eid, "--head-events", self.events,
                "--head-control", self.control, "--data-address", self.data_address(eid),
                "--weight-address", weights, "--backend", self.backend,
                "--model", self.model, "--backend-options", json.dumps(self.backend_options),
                "--heartbeat-interval-s", str(self.hb), *token, *self.engine_args, *(extra or []),
            ],
        )  # fmt: skip

    def credential(self, role: str = roles.CLIENT) -> Plain:
        """`role`'s PLAIN credential in this cluster (bus/roles.py): a raw socket
        applies it (`.apply(sock, None)`) before connecting, or the handshake fails."""
        plain = roles.as_role(read_token(self.token_file), role)
        assert plain is not None
        return plain

    def client(self, address: str | None = None, **kw: Any) -> Client:
        kw.setdefault("token_file", self.token_file)  # an engine's address too (--direct-clients)
        kw.setdefault("timeout_s", 60)
        kw.setdefault("control_timeout_s", 30)
        c = Client(address or self.frontend, **kw)
        self.clients.append(c)
        return c

    def wait_ready(self, n: int | None = None, timeout_s: float = 90) -> dict[str, Any]:
        """Health once `n` engines (default: every engine process) are healthy.
        Fails at once, with the exited processes' log tails, when the head or
        so many engine processes have exited that `n` can no longer be reached
        (an engine whose backend failed to start exits: waiting out timeout_s
        for it cost a GPU run 240 s)."""
        n = n if n is not None else sum(1 for k in self.procs if k != "head")
        c = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return c.wait_ready(n, max(0.05, min(1.0, deadline - time.monotonic())))
            except (RequestTimeout, HeadUnavailable) as e:  # a head still starting answers nothing yet
                if time.monotonic() >= deadline:
                    raise RequestTimeout(f"within timeout_s={timeout_s}: {e.message}", field="timeout_s") from e
            gone = {k: p.returncode for k, p in self.procs.items() if p.poll() is not None}
            alive_engines = sum(1 for k, p in self.procs.items() if k != "head" and p.returncode is None)
            if "head" in gone or alive_engines < n:
                tails = "\n".join(f"--- {k} (exit {rc}):\n{self.log(k)[-3000:]}" for k, rc in gone.items())
                raise RuntimeError(f"{n} engine(s) can no longer become ready: exited {gone}\n{tails}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait(timeout=30)

    def restart_head(self) -> subprocess.Popen:
        """A new head process on the same addresses (kill the old one first)."""
        self.head = self._spawn("head", self.head_args)
        return self.head

    def log(self, name: str) -> str:
        with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        terminate_tree(list(self.procs.values()), grace_s=10, kill_wait_s=5)
        try:
            os.remove(self.token_file)
        except FileNotFoundError:
            pass

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_module(argv: list[str], timeout_s: float, **env: str) -> tuple[int, str]:
    """Run `python -m ...` (argv after the interpreter) from the repository root in
    its own session; (returncode, output). On overrun or any error its whole tree
    goes: what a bench starts (clusters, trainers, servers) are its descendants."""
    p = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout_s)
    finally:
        terminate_tree(p, 3.0)
        if p.stdout is not None:
            p.stdout.close()  # an overrun leaves the pipe open: a ResourceWarning failed the NEXT test
    return p.returncode, out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@contextlib.contextmanager
def leak_checked_cluster(n: int, ready_timeout_s: float = 90, **kw: Any) -> Iterator[Cluster]:
    """`Cluster(n, **kw)`, ready, for a module's tests; when the module is
    done every process it started must be gone: a leaked one is killed and
    fails the module (the per-test check cannot see a module fixture's)."""
    before = {p.pid for p in live_children()}
    with Cluster(n, **kw) as c:
        c.wait_ready(n, timeout_s=ready_timeout_s)
        yield c
    leaked = [p for p in live_children() if p.pid not in before]
    for p in leaked:
        p.kill()
    assert not leaked, f"the module's cluster leaked processes: {[p.pid for p in leaked]}"


def wait_until(pred, timeout_s: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval)


class Streams:
    """Streaming requests in threads, recording every chunk."""

    def __init__(self, client, ps, params, **kw):
        self.chunks: list[list] = [[] for _ in ps]
        self.errors: list[Exception | None] = [None] * len(ps)
        self.threads = []
        for i, p in enumerate(ps):
            t = threading.Thread(target=self._run, args=(client, i, p, params, kw), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, client, i, p, params, kw):
        try:
            for ch in client.stream(p, params, **kw):
                self.chunks[i].append(ch)
        except Exception as e:
            self.errors[i] = e

    def counts(self) -> list[int]:
        return [sum(len(c.token_ids) for c in cs) for cs in self.chunks]

    def tokens(self, i: int) -> list[int]:
        return [t for c in self.chunks[i] for t in c.token_ids]

    def count(self, i: int) -> int:
        return sum(len(c.token_ids) for c in self.chunks[i])

    def kept(self, i: int, sample: int = 0) -> tuple[list[int], list[int], int]:
        """What a consumer keeps: tokens (and versions) since the last restart."""
        toks: list[int] = []
        vers: list[int] = []
        restarts = 0
        for c in self.chunks[i]:
            if c.sample_index != sample:
                continue
            if c.restarts > restarts:
                restarts = c.restarts
                toks.clear()
                vers.clear()
            toks += c.token_ids
            vers += [c.weight_version] * len(c.token_ids)
        return toks, vers, restarts

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream never finished"
        assert self.errors == [None] * len(self.errors), self.errors


class HangingUpListener:
    """FAKE peer (fault injection): a TCP listener that closes every connection
    at once, as a peer refusing the handshake does when it closes before the
    other side read its greeting (libzmq then says NO_DETAIL, not PROTOCOL).
    A context manager; `hangups` counts the connections it closed."""

    def __init__(self) -> None:
        import socket

        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.hangups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.close()
            self.hangups += 1

    def __enter__(self) -> HangingUpListener:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
