"""The processes a backend starts die with their engine node, however the node
dies (SIGKILL included), so a supervisor's restart finds its GPU memory free.

Two halves, one contract (the environment):

- node side, `export_node_pid()`: before the backend spawns anything (vLLM's
  EngineCore, a test backend's helpers), put the node's pid and start time in
  `os.environ`, which every child and grandchild inherits. Call it on the
  thread that will spawn: it records whether that is the main thread.
- child side, `arm()`: first thing in every process the backend starts,
  directly or not (vLLM: the worker extension's import; anything else: call it).
  - our parent is the node ("watch-parent"): prctl(PR_SET_PDEATHSIG, SIGKILL)
    when the node spawned us from its main thread, plus a poll of getppid()
    (re-parented = the node is gone). PR_SET_PDEATHSIG fires when the *thread*
    that spawned us exits, so it is not armed for a spawn from another thread
    (a short-lived start-up thread would kill us at once); the poll covers it.
  - our parent is someone else ("watch-node": a grandchild, e.g. a TP>1 vLLM
    worker under the EngineCore): poll the node's pid and start time (a reused
    pid is not the node); when the node is gone, SIGKILL our parent (an
    intermediate that may watch nothing) and exit.

Hazard: the window between a child's spawn and its `arm()` (start-up imports)
is not covered; a node killed in it leaves that child to the supervisor's
process-group sweep (bus.proctree). Linux only for prctl and start times;
elsewhere the pid poll alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

NODE_PID_ENV = "ROLLOUT_BUS_NODE_PID"
NODE_START_ENV = "ROLLOUT_BUS_NODE_START"  # /proc/<pid>/stat start time, ticks since boot ("" elsewhere)
NODE_PDEATHSIG_ENV = "ROLLOUT_BUS_NODE_PDEATHSIG"  # "1": the spawning thread is the node's main thread
POLL_S = 0.2  # how often a watch looks; the bound on a child outliving its node

_PR_SET_PDEATHSIG = 1


def start_time(pid: int) -> str:
    """A process's start time (field 22 of /proc/<pid>/stat), "" if unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else ""


def export_node_pid(env: dict[str, str] | None = None) -> dict[str, str]:
    """Mark `env` (default: os.environ) so that processes started from it die
    with this process. Returns the env."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    assert env is not None
    pid = os.getpid()
    env[NODE_PID_ENV] = str(pid)
    env[NODE_START_ENV] = start_time(pid)
    env[NODE_PDEATHSIG_ENV] = "1" if threading.current_thread() is threading.main_thread() else "0"
    return env


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not started or start_time(pid) in ("", started)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def arm(poll_s: float = POLL_S) -> str:
    """Die with the engine node named in the environment. Returns the mode:
    "watch-parent", "watch-node", or "off" (no node in the environment, or we
    are the node)."""
    try:
        node = int(os.environ.get(NODE_PID_ENV, "0"))
    except ValueError:
        return "off"
    if node <= 0 or node == os.getpid():
        return "off"
    started = os.environ.get(NODE_START_ENV, "")
    victim, victim_started = 0, ""
    if os.getppid() == node:
        mode = "watch-parent"
        if os.environ.get(NODE_PDEATHSIG_ENV) == "1":
            _set_pdeathsig(signal.SIGKILL)

        def gone() -> bool:
            return os.getppid() != node
    else:
        mode, victim = "watch-node", os.getppid()
        victim_started = start_time(victim)

        def gone() -> bool:
            return not _alive(node, started)

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        try:
            if victim > 1 and _alive(victim, victim_started):  # not a reused pid
                os.kill(victim, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os._exit(1)

    if gone():  # the node died before we armed: go now
        watch()
    threading.Thread(target=watch, name="rollout-bus-node-watch", daemon=True).start()
    return mode
