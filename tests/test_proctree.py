"""bus.proctree.terminate_tree: the one way launch.py, the tests and the
benchmarks end a process tree."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil

from bus.proctree import terminate_tree, tree

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
PARENT = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    f"subprocess.Popen([sys.executable, '-c', {STUBBORN!r}]); time.sleep(60)"
)


def _wait_children(p: subprocess.Popen, n: int) -> list[psutil.Process]:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        kids = psutil.Process(p.pid).children(recursive=True)
        if len(kids) >= n:
            return kids
        time.sleep(0.05)
    raise AssertionError(f"{p.pid} did not start {n} children")


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_terminate_tree_kills_stubborn_grandchildren_and_stopped_processes():
    stubborn = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    grandchild = _wait_children(stubborn, 1)[0]
    polite.send_signal(signal.SIGSTOP)  # stopped: only acts on SIGTERM once continued
    t0 = time.monotonic()
    killed = terminate_tree([stubborn, polite], grace_s=1.0, kill_wait_s=5)
    assert time.monotonic() - t0 < 10
    # the polite one ended on SIGTERM (after SIGCONT); the stubborn ones needed SIGKILL
    assert set(killed) == {stubborn.pid, grandchild.pid}
    assert stubborn.returncode is not None and polite.returncode is not None
    assert _gone(grandchild)
    assert tree([stubborn, polite]) == []


def test_terminate_tree_reaches_orphans_of_an_exited_group_leader():
    # The leader exits at once, leaving its child (same process group) behind.
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {STUBBORN!r}])"],
        start_new_session=True,
    )
    leader.wait(timeout=20)
    orphans = [p for p in psutil.process_iter() if _in_group(p, leader.pid)]
    assert orphans, "the orphan should still run in the leader's group"
    terminate_tree(leader, grace_s=0.5, kill_wait_s=5)
    assert all(_gone(p) for p in orphans)


def _in_group(p: psutil.Process, pgid: int) -> bool:
    import os

    try:
        return p.pid != pgid and os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE
    except (OSError, psutil.NoSuchProcess):
        return False


def test_terminate_tree_on_nothing_left_is_quick():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=20)
    t0 = time.monotonic()
    assert terminate_tree(p, grace_s=5) == []
    assert time.monotonic() - t0 < 1
