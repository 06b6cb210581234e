"""Fault injection: the torch backend plus helper processes of its own, shaped
like vLLM's (an EngineCore under the node, workers under it), so a CPU test can
kill -9 the node and see every one of them die (engine_node/child_watch.py).

`--backend tests.fault_children_backend:factory`, backend options:
  pid_dir   where each helper writes "<role>.pid" ("<pid> <watch mode>")
  the rest  the torch backend's options

Helpers: "child-a" spawned from the node's main thread (prctl PDEATHSIG and
the parent poll), "child-b" spawned from a short-lived thread (the parent poll
alone, as for a backend built off the main thread) which starts "grandchild"
(the node-pid poll, which also kills its parent).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

ROLES = ("child-a", "child-b", "grandchild")


def _spawn(role: str, pid_dir: str) -> subprocess.Popen:
    from engine_node.child_watch import export_node_pid

    env = export_node_pid(dict(os.environ))  # on the spawning thread: it decides PDEATHSIG
    return subprocess.Popen([sys.executable, "-m", "tests.fault_children_backend", role, pid_dir], env=env)


def factory(model: str, *, pid_dir: str, **options: Any) -> Any:
    from engine_node.backend import load_backend

    backend = load_backend("torch", model, **options)
    helpers = [_spawn("child-a", pid_dir)]
    t = threading.Thread(target=lambda: helpers.append(_spawn("child-b", pid_dir)))
    t.start()
    t.join()
    backend.fault_helpers = helpers  # owned by the node process; they end with it
    return backend


def _helper(role: str, pid_dir: str) -> None:
    from engine_node.child_watch import arm

    mode = arm()
    if role == "child-b":
        # The grandchild's env says the node is its grandparent: watch-node mode.
        subprocess.Popen([sys.executable, "-m", "tests.fault_children_backend", "grandchild", pid_dir])
    tmp = os.path.join(pid_dir, f".{role}.pid")
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {mode}")
    os.replace(tmp, os.path.join(pid_dir, f"{role}.pid"))
    deadline = time.monotonic() + 3600  # a bound even if every watch failed
    while time.monotonic() < deadline:
        time.sleep(1)


if __name__ == "__main__":
    _helper(sys.argv[1], sys.argv[2])
