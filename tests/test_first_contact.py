"""Issue 35's first-contact table, as a newcomer meets it: the launcher run as
a user runs it (a subprocess, each case bound by the wall clock: a refused
flag answers within 5 s, before any process starts; an engine that cannot
start ends the launch within 30 s, in one line), and the client's first
mistakes (an address without its scheme, a head that is not there, a head
reached as `localhost`). The SkyRL rows (the Tinker path's sessions, a
`model=` the cluster does not serve) are in tests/test_skyrl_adapter.py; the
README's flags in tests/test_readme.py."""

from __future__ import annotations

import argparse
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from bus.errors import BadRequest, HeadUnavailable
from bus.proctree import terminate_tree
from tests.cluster import ROOT, child_env, free_port

REFUSED_WITHIN_S = 5.0
CANNOT_START_WITHIN_S = 30.0


def _launch(*args: str, timeout_s: float, **env: str) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds) of `python launch.py ARGS`; its
    whole tree goes when it overruns."""
    p = subprocess.Popen(
        [sys.executable, "launch.py", *args],
        cwd=ROOT, env=child_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=timeout_s + 30)
    finally:
        terminate_tree(p, 3.0)
    return p.returncode, out, err, time.monotonic() - t0


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--backend", "foo", "--once"], {}, "argument --backend: invalid choice: 'foo'"),
        (["--backend", "no_such_package.backend:make_backend"], {}, "argument --backend:"),
        (["--backend", "null", "--model", "/nonexistent"], {}, "--model: no such folder: /nonexistent"),
        (["--port", "99999"], {}, "argument --port: 99999 is out of range"),
        (["--port", "65534"], {}, "argument --port: 65534 leaves no room"),
        (["--engines", "-1"], {}, "argument --engines: -1"),
        (["--backend-options", "notjson"], {}, "argument --backend-options: not JSON"),
        (["--join", "127.0.0.1:5555"], {}, "--join: '127.0.0.1:5555' is not of the form tcp://HOST:PORT"),
        ([], {"ROLLOUT_BUS_LOG_LEVEL": "bogus"}, "ROLLOUT_BUS_LOG_LEVEL='bogus'"),
    ],
    ids=["backend", "backend-module", "model", "port-range", "port-plus-2", "engines", "options", "join", "log-level"],
)
def test_a_bad_flag_is_refused_before_any_process_starts(args, env, says):
    rc, out, err, took = _launch(*args, timeout_s=REFUSED_WITHIN_S, **env)
    assert rc == 2 and says in err, (rc, out, err)
    assert "Traceback" not in err and not out
    assert err.strip().splitlines()[-1].startswith("launch.py: error: "), err
    assert took <= REFUSED_WITHIN_S, f"refused after {took:.1f}s"


def test_a_taken_port_is_named_with_its_flag_and_nothing_restarts():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 2))  # the control port: the last of the head's three
        taken.listen()
        rc, out, err, took = _launch(
            "--port", str(port), "--backend", "null", "--once", "--grace-s", "2", timeout_s=REFUSED_WITHIN_S
        )
    assert rc == 1, (out, err)
    lines = err.strip().splitlines()
    assert lines == [lines[-1]] and f"port {port + 2} on 127.0.0.1 is taken" in lines[-1] and "--port" in lines[-1]
    assert took <= REFUSED_WITHIN_S + 5  # the launcher's imports, then the check: no head was started


def test_an_engine_that_cannot_load_its_model_ends_the_launch_in_one_line(tmp_path):
    """A model folder without a model: the engine reports one line and is
    not restarted; the launcher exits at once with it (was: 4 tracebacks per
    engine, then waiting out --ready-timeout-s)."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    rc, out, err, took = _launch(
        "--port", "0", "--engines", "1", "--backend", "torch", "--model", str(empty), "--once", "--grace-s", "2",
        timeout_s=CANNOT_START_WITHIN_S, ROLLOUT_BUS_LOG_LEVEL="WARNING",
    )  # fmt: skip
    assert rc == 1, (out, err)
    assert "Traceback" not in err and "engine_restart" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("launch.py: ")]
    assert "e0 cannot start: " in line and "Unrecognized model" in line and str(empty) in line, line
    assert took <= CANNOT_START_WITHIN_S, f"ended after {took:.1f}s"


def test_ctrl_c_during_start_up_stops_every_child_quietly():
    """A terminal's Ctrl-C goes to the foreground process group: the engines
    were in it and died mid-import with KeyboardInterrupt tracebacks. They
    run in a session of their own; the launcher stops them with SIGTERM."""
    p = subprocess.Popen(
        [sys.executable, "launch.py", "--port", "0", "--backend", "null", "--engines", "2", "--grace-s", "5"],
        cwd=ROOT, env=child_env(ROLLOUT_BUS_LOG_LEVEL="WARNING"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the engines just started: importing, no handler yet
            tree = psutil.Process(p.pid).children(recursive=True)
            if sum("engine_node" in " ".join(c.cmdline()) for c in tree) >= 2:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the engines never started")
        # Not in the terminal's foreground group: its SIGINT cannot reach them
        # (whether a child in it printed its traceback before the launcher's
        # SIGTERM ended it was a race; this is not).
        assert all(os.getpgid(c.pid) != os.getpgid(p.pid) for c in tree)
        os.killpg(p.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, _ = p.communicate(timeout=30)
    finally:
        terminate_tree(p, 3.0, extra=tree)
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive


def test_the_banner_names_the_metrics_url():
    rc, out, err, _ = _launch(
        "--port", "0", "--backend", "null", "--engines", "1", "--metrics-port", "0", "--once", "--grace-s", "2",
        timeout_s=60,
    )  # fmt: skip
    assert rc == 0, (out, err)
    (line,) = [x for x in out.splitlines() if x.startswith("metrics: ")]
    assert line.startswith("metrics: http://127.0.0.1:") and line.endswith("/metrics"), line


# ------------------------------------------------------------ the parser, without processes


def test_every_flag_has_help_with_its_default():
    import launcher.config

    ap = launcher.config.build_parser()
    fmt = ap._get_formatter()
    for action in ap._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = fmt._expand_help(action) if action.help else ""
        flag = action.option_strings[0]
        assert text, f"{flag} has no help"
        if action.default is None:
            assert "None:" in text or "default" in text, f"{flag}: its help does not say what None means: {text}"
        else:
            assert "default" in text, f"{flag}: its help does not show its default: {text}"


def test_head_flags_given_to_launch_reach_the_head():
    """The README names head flags (--max-inflight-per-client, ...) bare:
    launch.py takes each and passes it on, only when given."""
    import launcher.config
    from router_node.config import RouterConfig
    from router_node.config import parse_args as head_args

    a = launcher.config.parse_args(["--max-inflight-per-client", "7", "--query-cache-s", "0.5", "--no-failover"])
    cfg = head_args(["--frontend", "tcp://127.0.0.1:1", *launcher.config.head_passthrough_argv(a)])
    assert (cfg.max_inflight_per_client, cfg.query_cache_s, cfg.failover) == (7, 0.5, False)
    assert launcher.config.head_passthrough_argv(launcher.config.parse_args([])) == []
    assert cfg.max_sessions_per_client == RouterConfig().max_sessions_per_client


# ------------------------------------------------------------ the client's first mistakes


def test_an_address_without_its_scheme_is_refused_by_the_constructor():
    from trainer_bridge import AsyncClient, Client

    for bad in ("127.0.0.1:27200", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "localhost", "ipc://"):
        for cls in (Client, AsyncClient):
            with pytest.raises(BadRequest) as e:
                cls(bad)
            assert e.value.field == "address" and "tcp://HOST:PORT" in e.value.message, e.value.message


_FAILED_CALL = """
import time, zmq
from bus.endpoint import open_socket
from trainer_bridge import Client, connection
made = []
def refusing(ctx, kind, **kw):  # zmq refuses the address after making the socket, as it did for a bare host:port
    made.append(open_socket(ctx, kind, connect="inproc://made-then-refused"))  # still referenced, as by the traceback
    raise zmq.ZMQError(zmq.EINVAL, "Invalid argument")
connection.open_monitored = refusing
c = Client("tcp://127.0.0.1:1")
try:
    c.health()
except zmq.ZMQError:
    pass
t0 = time.monotonic()
c.close() if CLOSE else None
print("closed in", round(time.monotonic() - t0, 3))
"""


@pytest.mark.parametrize("close", [True, False], ids=["close", "interpreter-exit"])
def test_close_and_exit_after_a_failed_call_neither_hang_nor_raise(close):
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", f"CLOSE = {close}\n" + _FAILED_CALL],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0 and "closed in" in p.stdout, p.stdout + p.stderr
    assert float(p.stdout.split()[-1]) < 1.0
    assert "Traceback" not in p.stderr and "client_close_failed" not in p.stderr, p.stderr
    assert time.monotonic() - t0 < 20  # was 10 s in close() (or at exit) alone, then RuntimeError


def test_a_local_head_s_token_is_found_by_any_of_its_local_names(tmp_path, monkeypatch):
    from bus.auth import find_token, new_token, token_path_for, write_token

    monkeypatch.setenv("ROLLOUT_BUS_TOKEN_DIR", str(tmp_path))
    monkeypatch.delenv("ROLLOUT_BUS_TOKEN_FILE", raising=False)
    token = new_token()
    published = write_token(token_path_for("tcp://127.0.0.1:27200"), token)  # type: ignore[arg-type]
    for name in ("127.0.0.1", "localhost", socket.gethostname()):
        assert find_token(f"tcp://{name}:27200") == (token, published), name
    assert find_token("tcp://localhost:27201") is None  # another port: another head
    assert find_token("tcp://example.invalid:27200") is None  # another host


def test_wait_ready_without_a_head_fails_within_the_connect_timeout_naming_the_address():
    """No timeout_s: nothing ever answered within connect_timeout_s ends the wait
    (the issue's 120 s). An explicit timeout_s is the time the caller gives a
    head that may still be starting; it ends with the same clean message."""
    from trainer_bridge import Client

    address = f"tcp://127.0.0.1:{free_port()}"
    for kwargs, knob, bound in (({}, "connect_timeout_s", (0.5, 5.0)), ({"timeout_s": 3.0}, "timeout_s", (2.5, 7.0))):
        with Client(address, connect_timeout_s=1.0) as c:
            t0 = time.monotonic()
            with pytest.raises(HeadUnavailable) as e:
                c.wait_ready(num_engines=2, **kwargs)
            took = time.monotonic() - t0
        text = str(e.value)
        assert bound[0] <= took < bound[1], f"{kwargs}: {took:.1f}s"
        assert address in text and e.value.field == knob and text.count("(field=") == 1, text
        assert "control_timeout_s" not in text


def test_the_first_model_build_prints_no_progress_bar_on_a_terminal(tmp_path):
    """The tokenizer's training bar (no newline at its end) ran into the
    launcher's table on a first run in a terminal."""
    code = f"from engine_node.tiny_model import _build_tokenizer; _build_tokenizer({str(tmp_path)!r}, 512)"
    main, sub = pty.openpty()
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=child_env(), stdout=sub, stderr=sub)
    os.close(sub)
    out = b""
    try:
        while chunk := _read(main):
            out += chunk
    finally:
        os.close(main)
        p.wait(timeout=60)
    assert p.returncode == 0 and out == b"", out[:300]


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the child closed the terminal
        return b""


# ------------------------------------------------------------ the skyrl extra

_IMPORTED_DISTS = """
import importlib.metadata as md, json, sys, typing
if sys.version_info < (3, 12):
    import typing_extensions
    typing.TypedDict = typing_extensions.TypedDict
before = set(sys.modules)
from skyrl.train.generators import SkyRLGymGenerator
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.tinker import types
tops = {m.split(".")[0] for m in set(sys.modules) - before}
dists = md.packages_distributions()
print(json.dumps(sorted({d for m in tops if m not in sys.stdlib_module_names for d in dists.get(m, ())})))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution `requirements` bring in, as their installed metadata declares them."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            deps = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        for d in deps:
            todo.append((Requirement(d), ""))
            todo.extend((Requirement(d), x) for x in req.extras)
    return seen


def test_the_skyrl_extra_declares_what_skyrl_s_generator_imports():
    """Issue 35: `pip install -e ".[skyrl]"`, then `from skyrl.train.generators
    import SkyRLGymGenerator`: ModuleNotFoundError loguru (skyrl 0.3.0 imports
    packages it does not declare). Every distribution those imports load is
    brought in by rollout-bus's dependencies or its skyrl extra. (.ci/run also
    installs the extra alone in a fresh venv and imports it.)"""
    import json

    import tomllib

    p = subprocess.run(
        [sys.executable, "-c", _IMPORTED_DISTS], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    if p.returncode != 0 and "ModuleNotFoundError: No module named 'skyrl" in p.stderr:
        pytest.skip("skyrl is not installed here (.ci/run installs it)")
    assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    declared = _closure(project["dependencies"] + project["optional-dependencies"]["skyrl"])
    missing = sorted(d for d in json.loads(p.stdout) if _norm(d) not in declared)
    assert not missing, f"skyrl's generator imports {missing}: the skyrl extra does not bring them in"
