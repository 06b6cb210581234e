"""The launcher's supervision of its child processes, and the run folders it owns.

`Supervisor` starts the head and engine processes (`Child`), restarts a crashed
one (bounded by --max-restarts each; the head on the same ports, so live
engines re-register with it), and on stop SIGTERMs the whole tree, waits
--grace-s and SIGKILLs the rest (bus.proctree). Its signal handler only flips
`state`; the launcher's loops call `check` and act on it.

A child that cannot start (bus.runtime.FATAL_EXIT: its one-line reason in its
fatal file) is not restarted. A head that cannot start, or every engine given
up, stops the launch at once; `fatal` is the one line the launcher prints.
Children run in a session of their own: a Ctrl-C on the terminal reaches the
launcher only, which stops them with SIGTERM (no KeyboardInterrupt in a child).

Run folders (/tmp/rbus-*) hold a launcher's IPC sockets and token; each carries
the owner's pid and create time, so a later launch removes the folders of
launchers that died with kill -9 (their `finally` never ran).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import psutil
import structlog

from bus.proctree import terminate_tree
from bus.runtime import FATAL_EXIT, FATAL_FILE_ENV

log = structlog.get_logger("launch")
# Children run from the checkout, as `python launch.py` does from a fresh clone.
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root, above launcher/


class State(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    gave_up: str | None = None  # "cannot start: why" / "gave up: why" (None: it runs or will be)

    def start(self) -> None:
        # Own session: the terminal's SIGINT goes to the launcher's process
        # group only; the launcher ends its children itself (SIGTERM).
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=HERE, start_new_session=True)
        self.started_at = time.monotonic()

    def fatal_reason(self, rc: int) -> str:
        """The child's one-line reason for FATAL_EXIT (its fatal file), else its exit code."""
        path = self.env.get(FATAL_FILE_ENV)
        try:
            if path:
                with open(path, encoding="utf-8") as f:
                    return f.read().strip() or f"exit code {rc}"
        except OSError:
            pass  # it died before writing one: the exit code is all there is
        return f"exit code {rc}"


class Supervisor:
    def __init__(self, max_restarts: int, grace_s: float) -> None:
        self.children: dict[str, Child] = {}
        self.max_restarts = max_restarts
        self.grace_s = grace_s
        self.state = State.RUNNING
        self.exit_code = 0
        self.fatal: str | None = None  # the one line that ended the launch

    def request_stop(self, *_: Any) -> None:
        """Signal handler: only flips the state; `watch` does the work."""
        self.state = State.STOPPING

    def add(self, child: Child) -> Child:
        self.children[child.name] = child
        child.start()
        return child

    def check(self) -> None:
        """Restart crashed children (bounded, --max-restarts each). The head
        restarts with the same argv, so on the same ports: live engines see
        its Rejoin and register again within a second or two (their weight
        versions with them), clients reconnect by themselves. A head past its
        restarts is fatal."""
        for c in self.children.values():
            rc = c.proc.poll() if c.proc else None
            if rc is None or self.state is State.STOPPING:
                continue
            if rc == FATAL_EXIT or c.restarts >= self.max_restarts:
                c.proc = None
                c.gave_up = (
                    f"cannot start: {c.fatal_reason(rc)}"
                    if rc == FATAL_EXIT
                    else f"gave up: it exited with code {rc} after {c.restarts} restart(s) "
                    f"(--max-restarts {self.max_restarts})"
                )
                log.info("child_gave_up", child=c.name, rc=rc, reason=c.gave_up)
                if c.name == "head":
                    self.stop_fatal(f"the head {c.gave_up}")
                    return
                continue
            c.restarts += 1
            log.warning(
                "head_restart" if c.name == "head" else "engine_restart", child=c.name, rc=rc, restart=c.restarts
            )
            c.start()
        engines = [c for c in self.children.values() if c.name != "head"]
        if engines and all(c.gave_up for c in engines):
            self.stop_fatal(f"engine {engines[0].name} {engines[0].gave_up}")

    def gave_up(self) -> list[Child]:
        """The children that will not run again, in start order."""
        return [c for c in self.children.values() if c.gave_up]

    def stop_fatal(self, reason: str) -> None:
        """Stop the launch for `reason` (the launcher prints it, exit code 1)."""
        if self.fatal is None:
            self.fatal = reason
        self.exit_code = 1
        self.state = State.STOPPING

    def alive(self) -> list[psutil.Process]:
        procs: list[psutil.Process] = []
        for c in self.children.values():
            if c.proc is None:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):  # exited since the poll: nothing to end
                p = psutil.Process(c.proc.pid)
                procs.append(p)
                procs.extend(p.children(recursive=True))
        return procs

    def shutdown(self) -> None:
        """SIGTERM the whole tree, wait grace_s, SIGKILL the rest (bus.proctree)."""
        killed = terminate_tree([c.proc for c in self.children.values() if c.proc is not None], self.grace_s)
        if killed:
            log.warning("killed_after_grace", pids=killed, grace_s=self.grace_s)


_RUN_OWNER = "launcher.pid"  # in a run folder: "<pid> <create time>" of the launcher that made it


def mark_run_dir(run_dir: str) -> None:
    """Record which launcher owns `run_dir`, so a later launch can tell that a
    folder left by a kill -9 belongs to a dead process (remove_stale_run_dirs)."""
    me = psutil.Process()
    with open(os.path.join(run_dir, _RUN_OWNER), "w") as f:
        f.write(f"{me.pid} {me.create_time()}")


def remove_stale_run_dirs(tmp: str | None = None) -> list[str]:
    """Remove the /tmp/rbus-* run folders of launchers that are gone (killed
    with -9: their `finally` never ran). Only folders of this user that carry
    a launcher.pid whose process is dead (or whose pid was reused: another
    create time) are touched. Returns the folders removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp):
        d = os.path.join(tmp, name)
        if not name.startswith("rbus-") or not os.path.isdir(d) or os.path.islink(d):
            continue
        try:
            if os.stat(d).st_uid != os.getuid():
                continue
            with open(os.path.join(d, _RUN_OWNER)) as f:
                pid_s, created_s = f.read().split()
            pid, created = int(pid_s), float(created_s)
        except (OSError, ValueError):
            continue  # not a launcher's run folder (or not ours): leave it
        try:
            alive = abs(psutil.Process(pid).create_time() - created) < 1e-3
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            alive = False
        except psutil.Error:
            alive = True  # cannot tell: keep it
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log.info("stale_run_dir_removed", path=d, pid=pid)
    return removed
