"""Ending a process tree: the one implementation launch.py, the tests and the
benchmarks use.

`terminate_tree(roots, grace_s)`: SIGTERM every process of every tree (the
roots, their children, children of children), SIGCONT the stopped ones so
they can act on it, wait up to `grace_s`, SIGKILL whatever is left, wait up
to `kill_wait_s` more, and reap the roots. A root that leads its own process
group (started with `start_new_session=True`) also has its group signalled,
so a grandchild that was re-parented away from the tree is still reached.
Every wait has a deadline; nothing here raises for a process that is
already gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import TypeAlias

import psutil

Root: TypeAlias = int | psutil.Process | subprocess.Popen


def _pid(root: Root) -> int:
    return root if isinstance(root, int) else root.pid


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of `pid` (children of children included); [] when it is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _live(root: Root) -> psutil.Process | None:
    """The running process behind a root; None once it has exited (a reaped
    Popen's pid may belong to someone else by now, so it is never looked up)."""
    if isinstance(root, subprocess.Popen) and root.poll() is not None:
        return None
    try:
        p = root if isinstance(root, psutil.Process) else psutil.Process(_pid(root))
        return p if p.is_running() else None
    except psutil.NoSuchProcess:
        return None


def tree(roots: Iterable[Root]) -> list[psutil.Process]:
    """The roots that still run and all their descendants, each once."""
    seen: dict[int, psutil.Process] = {}
    for r in roots:
        p = _live(r)
        if p is None:
            continue
        seen.setdefault(p.pid, p)
        for d in descendants(p.pid):
            seen.setdefault(d.pid, d)
    return list(seen.values())


def _group_leaders(roots: Iterable[Root]) -> list[int]:
    """Process groups led by a root (started with start_new_session=True).

    A Popen's group is signalled even after the root itself exited: the group
    id stays reserved while any member lives, so this reaches exactly the
    orphans it left."""
    out = []
    mine = os.getpgrp()
    for r in roots:
        pid = _pid(r)
        if pid == mine:
            continue
        if isinstance(r, subprocess.Popen) and r.poll() is not None:
            # Exited: while its group has members, the kernel keeps the pid
            # number reserved, so a live process with this pid means the
            # group is gone (and the number reused): leave it alone.
            if not psutil.pid_exists(pid):
                out.append(pid)
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                out.append(pid)
    return out


def _group_members(pgids: Iterable[int]) -> list[psutil.Process]:
    """Live processes of these process groups (orphans re-parented away from the tree included)."""
    wanted = set(pgids)
    if not wanted:
        return []
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(p.pid) in wanted:
                out.append(p)
    return out


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            p.send_signal(sig)


def _signal_groups(pgids: Iterable[int], sig: int) -> None:
    for g in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, sig)


def _continue_stopped(procs: Iterable[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if p.status() == psutil.STATUS_STOPPED:
                p.send_signal(signal.SIGCONT)


def terminate_tree(
    roots: Root | Iterable[Root],
    grace_s: float = 5.0,
    *,
    kill_wait_s: float = 5.0,
    extra: Iterable[psutil.Process] = (),
) -> list[int]:
    """SIGTERM → grace → SIGKILL every process of the trees under `roots`.

    `roots`: pids, psutil.Process or subprocess.Popen objects (one or many).
    `extra`: processes seen earlier that may have been orphaned since (they
    are ended with the trees). Returns the pids that needed SIGKILL."""
    roots = [roots] if isinstance(roots, (int, psutil.Process, subprocess.Popen)) else list(roots)
    groups = _group_leaders(roots)
    procs = {p.pid: p for p in [*tree(roots), *_group_members(groups), *extra]}
    _signal(procs.values(), signal.SIGTERM)
    _signal_groups(groups, signal.SIGTERM)
    _continue_stopped(procs.values())
    _signal_groups(groups, signal.SIGCONT)
    _, left = psutil.wait_procs(list(procs.values()), timeout=max(0.0, grace_s))
    # Anything started during the grace period belongs to the tree too.
    for p in [*tree(roots), *_group_members(groups)]:
        if p.pid not in procs:
            left.append(p)
    _signal(left, signal.SIGKILL)
    _signal_groups(groups, signal.SIGKILL)
    psutil.wait_procs(left, timeout=max(0.0, kill_wait_s))
    end = time.monotonic() + max(0.0, kill_wait_s)
    for r in roots:  # reap our own children so no zombie or stale returncode stays behind
        if isinstance(r, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.wait(timeout=max(0.05, end - time.monotonic()))
    return sorted(p.pid for p in left)
