"""A dead engine node takes its backend's processes with it (issue 13, item 6,
the CPU half): engine_node/child_watch.py, exercised by a fault-injection
backend that spawns two children and a grandchild (tests/fault_children_backend.py)
under launch.py's supervisor. The GPU half is tests/gpu/test_vllm_kill.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from engine_node import child_watch
from tests.cluster import ROOT, child_env, wait_until
from tests.fault_children_backend import ROLES
from tests.test_launch import _read_address, _tree
from trainer_bridge import Client

GONE_WITHIN_S = 3.0  # child_watch polls every 0.2 s; PDEATHSIG is immediate


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _helpers(pid_dir: str) -> dict[str, tuple[int, str]]:
    out = {}
    for role in ROLES:
        try:
            with open(os.path.join(pid_dir, f"{role}.pid")) as f:
                pid, mode = f.read().split()
        except (OSError, ValueError):
            continue
        out[role] = (int(pid), mode)
    return out


@pytest.fixture
def pid_dir(tmp_path):
    """Where the helpers write their pids. Teardown kills any helper still
    alive (they are re-parented away from the test's tree, so conftest's leak
    check cannot see them): found by this test's own folder in their argv."""
    d = str(tmp_path)
    yield d
    left = [x for x in psutil.process_iter(["cmdline"]) if d in (x.info["cmdline"] or [])]
    for x in left:
        x.kill()
    assert not [x for x in left if not _dead(x.pid)], "helpers outlived the test"


def test_start_time_and_arm_without_a_node(monkeypatch):
    me = child_watch.start_time(os.getpid())
    assert me and me == child_watch.start_time(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    assert child_watch.start_time(p.pid) == ""
    monkeypatch.delenv(child_watch.NODE_PID_ENV, raising=False)
    assert child_watch.arm() == "off"
    monkeypatch.setenv(child_watch.NODE_PID_ENV, str(os.getpid()))
    assert child_watch.arm() == "off"  # we are the node


def test_kill_9_node_takes_its_children_and_the_supervisor_restarts_it(tiny_model, pid_dir):
    opts = json.dumps({"pid_dir": pid_dir, "threads": 1})
    p = subprocess.Popen(
        [sys.executable, "launch.py", "--port", "0", "--grace-s", "5", "--engines", "1", "--max-restarts", "2",
         "--backend", "tests.fault_children_backend:factory", "--model", tiny_model, "--backend-options", opts],
        cwd=ROOT, env=child_env(ROLLOUT_BUS_LOG_LEVEL="WARNING"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        addr = _read_address(p)
        first = wait_until(lambda: len(_helpers(pid_dir)) == 3 and _helpers(pid_dir), 30, "3 helper pid files")
        assert {r: m for r, (_, m) in first.items()} == {
            "child-a": "watch-parent",
            "child-b": "watch-parent",
            "grandchild": "watch-node",
        }
        for f in os.listdir(pid_dir):
            os.unlink(os.path.join(pid_dir, f))
        with Client(addr, timeout_s=30) as c:
            e = c.engines()[0]
            inc0, node = e["incarnation"], e["pid"]
            assert node in {x.pid for x in _tree(p)}
            t0 = time.monotonic()
            os.kill(node, signal.SIGKILL)
            wait_until(lambda: all(_dead(pid) for pid, _ in first.values()), GONE_WITHIN_S, "the helpers to die")
            gone_s = time.monotonic() - t0

            def restarted():
                es = c.engines()
                return es and es[0]["incarnation"] != inc0 and es[0]["healthy"]

            wait_until(restarted, 60, "the supervisor to restart the engine", interval=0.2)
            healthy_s = time.monotonic() - t0
            assert c.generate([4, 5, 6], {"max_tokens": 2}).token_ids
            second = wait_until(lambda: len(_helpers(pid_dir)) == 3 and _helpers(pid_dir), 30, "the new helpers")
            assert not any(_dead(pid) for pid, _ in second.values())
        print(f"TIMING helpers_gone_s={gone_s:.2f} restart_healthy_s={healthy_s:.2f}")
        tree = _tree(p)
    finally:
        tree = tree or _tree(p)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        _, alive = psutil.wait_procs(tree, timeout=10)
    assert p.returncode == 0
    assert not [x for x in alive if not _dead(x.pid)], "launch.py left processes behind"


def test_a_node_that_stops_cleanly_takes_its_children_too(cluster_factory, tiny_model, pid_dir):
    """SIGTERM: the node drains and exits; its helpers go with it."""
    backend = "tests.fault_children_backend:factory"
    cl = cluster_factory(1, backend=backend, model=tiny_model, backend_options={"pid_dir": pid_dir})
    helpers = wait_until(lambda: len(_helpers(pid_dir)) == 3 and _helpers(pid_dir), 60, "3 helpers")
    cl.kill("e0", signal.SIGTERM)
    wait_until(lambda: all(_dead(pid) for pid, _ in helpers.values()), GONE_WITHIN_S, "the helpers to die")
