"""launch.py: starts, serves, and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bus import protocol as P
from tests.cluster import ROOT, child_env, wait_until
from trainer_bridge import Client

# Tests of the launcher's own work (supervision, signals, joining, CURVE) run
# null engines: no model to import and load per engine. test_demo_runs_and_exits_cleanly
# and test_curve_multi_node_zmq_weight_update keep the default (torch) backend.
NULL = ("--backend", "null")


def _launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "launch.py", "--port", "0", "--grace-s", "5", *args],
        cwd=ROOT,
        env=child_env(ROLLOUT_BUS_LOG_LEVEL="WARNING"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _tree(p: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_demo_runs_and_exits_cleanly():
    p = _launch("--demo", "--once")
    out, _ = p.communicate(timeout=150)
    assert p.returncode == 0, out
    assert re.search(r"^e0\s+ipc://\S+\s+torch\s+\S+\s+healthy", out, re.M), out
    assert re.search(r"^e1\s+", out, re.M)
    assert "trainer connects to: tcp://127.0.0.1:" in out
    assert "demo: 32 requests" in out and "tokens/s" in out
    assert "demo: tokens per engine" in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_the_whole_tree(sig):
    p = _launch("--engines", "2", *NULL)
    addr = None
    deadline = time.monotonic() + 120
    lines = []
    while addr is None and time.monotonic() < deadline:
        line = p.stdout.readline()
        lines.append(line)
        m = re.search(r"trainer connects to: (tcp://\S+)", line)
        if m:
            addr = m.group(1)
        if not line and p.poll() is not None:
            break
    assert addr, "".join(lines)
    tree = _tree(p)
    assert len(tree) >= 3  # head + 2 engines
    with Client(addr, timeout_s=30) as c:
        assert len(c.generate([[4, 5], [6, 7]], {"max_tokens": 3})) == 2
    p.send_signal(sig)
    p.communicate(timeout=60)
    assert p.returncode == 0
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(x.pid, x.cmdline()) for x in alive]


def test_crashed_engine_is_restarted():
    p = _launch("--engines", "1", "--max-restarts", "2", *NULL)
    try:
        addr = None
        deadline = time.monotonic() + 120
        while addr is None and time.monotonic() < deadline:
            m = re.search(r"trainer connects to: (tcp://\S+)", p.stdout.readline())
            addr = m.group(1) if m else None
        assert addr
        with Client(addr, timeout_s=30) as c:
            inc0 = c.engines()[0]["incarnation"]
            pid0 = c.engines()[0]["pid"]
            os.kill(pid0, signal.SIGKILL)

            def restarted():
                es = c.engines()
                return es and es[0]["incarnation"] != inc0 and es[0]["healthy"]

            wait_until(restarted, 60, "the supervisor to restart e0", interval=0.2)
            assert c.generate([4, 5, 6], {"max_tokens": 2}).token_ids
    finally:
        tree = _tree(p)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        psutil.wait_procs(tree, timeout=10)


def test_crashed_head_is_restarted_and_the_engines_rejoin_it():
    """Issue 22: a dead head used to stop everything; now the supervisor
    restarts it on the same ports, the live engines re-register (Rejoin) and
    the trainer's client reconnects by itself."""
    p = _launch("--engines", "1", "--max-restarts", "2", *NULL)
    try:
        addr = _read_address(p)
        with Client(addr, timeout_s=30) as c:
            c.wait_ready(1, timeout_s=60)
            inc = c.engines()[0]["incarnation"]
            heads = [x for x in _tree(p) if "router_node" in " ".join(x.cmdline())]
            assert len(heads) == 1
            heads[0].kill()

            def served() -> bool:
                try:
                    h = c.wait_ready(1, timeout_s=2)
                except Exception:  # the head is restarting: HeadUnavailable / RequestTimeout
                    return False
                return [e["incarnation"] for e in h["engines"].values()] == [inc]  # the same engine, re-registered

            wait_until(served, 60, "the restarted head to serve the live engine", interval=0.2)
            assert c.generate([4, 5, 6], {"max_tokens": 2}).samples[0].token_ids
            new = [x for x in _tree(p) if "router_node" in " ".join(x.cmdline())]
            assert [x.pid for x in new] != [heads[0].pid]
    finally:
        tree = _tree(p)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        psutil.wait_procs(tree, timeout=10)


def _read_address(p: subprocess.Popen, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        seen.append(line)
        m = re.search(r"trainer connects to: (tcp://\S+)", line)
        if m:
            return m.group(1)
        if not line and p.poll() is not None:
            break
    raise AssertionError("no address printed:\n" + "".join(seen))


def test_multi_node_head_and_join_on_loopback():
    import socket as _s

    with _s.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = subprocess.Popen(
        [sys.executable, "launch.py", "--head", "--port", str(port), "--grace-s", "5"],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    procs = [head]
    try:
        addr = _read_address(head)
        assert addr == f"tcp://127.0.0.1:{port}"
        worker = subprocess.Popen(
            [sys.executable, "launch.py", "--join", addr, "--engines", "2", "--engine-id-prefix", "nodeB-", "--grace-s", "5", *NULL],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        procs.append(worker)
        _read_address(worker)
        with Client(addr, timeout_s=30) as c:
            es = {e["engine_id"]: e for e in c.engines()}
            assert set(es) == {"nodeB-0", "nodeB-1"}
            assert all(e["data_address"].startswith("tcp://127.0.0.1:") for e in es.values())
            rs = c.generate([[4, 5, 6]] * 6, {"max_tokens": 3})
            assert {r.engine_id for r in rs} <= set(es)
    finally:
        trees = [_tree(p) for p in procs]
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
        for t in trees:
            psutil.wait_procs(t, timeout=10)


def test_curve_secured_cluster(tmp_path):
    from bus.errors import AuthRefused

    keys = str(tmp_path / "keys")
    p = _launch("--curve", "--curve-dir", keys, *NULL)
    tree = []
    try:
        addr = _read_address(p)
        tree = _tree(p)
        with Client(addr, timeout_s=30, curve_dir=keys) as c:
            assert c.generate([4, 5, 6], {"max_tokens": 3}).token_ids
        # no keys: refused at once, told that the cluster is secured (issue 23; was a timeout)
        with Client(addr, timeout_s=20, control_timeout_s=20) as stranger:
            t0 = time.monotonic()
            with pytest.raises(AuthRefused) as ei:
                stranger.health()
            assert ei.value.field == "curve_dir" and time.monotonic() - t0 < 5
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        psutil.wait_procs(tree, timeout=10)


def test_curve_multi_node_zmq_weight_update(tmp_path):
    """--curve across nodes: every TCP socket is CURVE, the engines' weight
    sockets included, so a zmq weight update must connect with the keys too."""
    import socket as _s

    import torch

    keys = str(tmp_path / "keys")
    with _s.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--grace-s", "5", "--curve", "--curve-dir", keys]
    head = subprocess.Popen(
        [sys.executable, "launch.py", "--head", "--port", str(port), *common],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    procs = [head]
    trees = []
    try:
        addr = _read_address(head)
        worker = subprocess.Popen(
            [sys.executable, "launch.py", "--join", addr, "--engines", "1", "--engine-id-prefix", "nodeB-", *common],
            cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        procs.append(worker)
        _read_address(worker)
        trees = [_tree(p) for p in procs]
        with Client(addr, timeout_s=30, control_timeout_s=30, curve_dir=keys) as c:
            (engine,) = c.engines()
            assert engine["weight_address"].startswith("tcp://127.0.0.1:")
            before = c.generate([4, 5, 6], {"max_tokens": 4, "temperature": 0.0})
            assert before.token_versions == [0] * 4
            from transformers import AutoModelForCausalLM

            from engine_node.tiny_model import ensure_tiny_model

            policy = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.01)
            res = c.update_weights(policy.named_parameters(), timeout_s=60)
            assert res["nodeB-0"]["weight_version"] == 1
            assert isinstance(res["nodeB-0"], P.WeightsCommitted)
            after = c.generate([4, 5, 6], {"max_tokens": 4, "temperature": 0.0})
            assert after.token_versions == [1] * 4
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
        for t in trees:
            psutil.wait_procs(t, timeout=10)


# ------------------------------------------------------------ first contact (issue 23), no processes


def test_keys_options_in_any_position(tmp_path, capsys):
    import launcher.keys

    assert launcher.keys.keys_main(["init", "--curve-dir", str(tmp_path / "a")]) == 0  # as KeyFileError suggests
    assert launcher.keys.keys_main(["--curve-dir", str(tmp_path / "b"), "init"]) == 0
    assert (tmp_path / "a" / "head.key").exists() and (tmp_path / "b" / "head.key").exists()
    assert launcher.keys.keys_main(["list", "--curve-dir", str(tmp_path / "a")]) == 0
    assert "default" in capsys.readouterr().out


def test_flags_the_readme_names_exist_and_log_level_reaches_children(monkeypatch):
    import launcher.config

    a = launcher.config.parse_args(["--session-placement", "outstanding", "--log-level", "info"])
    assert a.session_placement == "outstanding" and a.log_level == "INFO"
    with pytest.raises(SystemExit):
        launcher.config.parse_args(["--session-placement", "nope"])
    assert launcher.config.parse_args([]).log_level is None  # resolved in main: $ROLLOUT_BUS_LOG_LEVEL, else WARNING


def test_client_line_for_a_curve_cluster():
    import launcher.output

    assert launcher.output.client_line("tcp://h:1") == "trainer_bridge.Client('tcp://h:1')"
    assert launcher.output.client_line("tcp://h:1", "/k") == "trainer_bridge.Client('tcp://h:1', curve_dir='/k')"
    line = launcher.output.client_line("tcp://h:1", "/k", "alice")
    assert line == "trainer_bridge.Client('tcp://h:1', curve_dir='/k', client_key='alice')"


def test_ray_without_the_extra_names_it(monkeypatch, capsys):
    import launcher.config
    import launcher.ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    assert launcher.ray.run_on_ray(launcher.config.parse_args(["--ray", "local"])) == 2
    assert 'pip install -e ".[ray]"' in capsys.readouterr().err
