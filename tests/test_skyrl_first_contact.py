"""Issue 23's first-contact list, as a newcomer meets it: what `python
launch.py` prints and in which order, one `--log-level` for the head and the
engines, one JSON object per log line, an idle resume that records no resume
timing, `bench.all` writing outside the tracked tree, pre-commit hooks from the
installed packages, and the docs agreeing on the suite's time and the CPU torch
install line. (tests/test_launch.py covers `keys` options in any position, the
README's flags, the CURVE client line's text, a keyless client against a CURVE
head failing fast, and `--ray` without the extra.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bus import protocol as P
from bus.proctree import terminate_tree
from engine_node.timings import read_timings
from tests.cluster import ROOT, child_env

SERVING = "serving; Ctrl-C to stop"


def _launch_until_serving(*args: str, timeout_s: float = 90) -> list[str]:
    """`launch.py --backend null` with the user's environment (no
    ROLLOUT_BUS_LOG_LEVEL), stdout + stderr as one stream; every line up to
    "serving", then the tree is stopped."""
    env = child_env()
    env.pop("ROLLOUT_BUS_LOG_LEVEL", None)
    p = subprocess.Popen(
        [sys.executable, "launch.py", "--port", "0", "--grace-s", "5", "--backend", "null", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if not line and p.poll() is not None:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith(SERVING):
                tree = psutil.Process(p.pid).children(recursive=True)
                return lines
        raise AssertionError("launch.py never served:\n" + "\n".join(lines))
    finally:
        # launch.py drains its tree on SIGTERM; whatever is left after the
        # grace (or never reached "serving", so `tree` is empty) is killed.
        terminate_tree(p, 30.0, extra=tree)
        p.communicate(timeout=10)


def test_a_default_launch_prints_the_table_and_the_client_line_first(tmp_path):
    """No JSON before the table; the first line is the table's header; a
    --curve cluster's client line carries its key folder (issue 23)."""
    keys = str(tmp_path / "keys")
    lines = _launch_until_serving("--engines", "2", "--curve", "--curve-dir", keys)
    assert lines[0].split()[:2] == ["engine", "address"], lines
    assert not [x for x in lines if x.lstrip().startswith("{")], lines  # quiet: no event log by default
    (client,) = [x for x in lines if x.startswith("trainer connects to: ")]
    assert f"curve_dir={keys!r}" in client, client
    assert lines[-1] == SERVING


def test_one_log_level_for_every_process_one_json_object_per_line():
    """`--log-level info` shows the head's and the engines' event logs (not
    only the launcher's): JSON lines on a pipe, each one whole object."""
    lines = _launch_until_serving("--engines", "2", "--log-level", "info")
    events = [json.loads(x) for x in lines if x.startswith("{")]  # raises on two objects spliced on one line
    assert all(isinstance(e, dict) and "event" in e for e in events)
    names = {e["event"] for e in events}
    assert "router_serving" in names  # the head
    assert {e.get("engine_id") for e in events if e["event"] == "engine_serving"} == {"e0", "e1"}  # each engine


def test_an_idle_resume_records_no_resume_timing(cluster_factory):
    """`resume_timing … first_output_ms 8694` after an idle resume read like an
    8.7 s stall (issue 23): a resume that found nothing parked, held or running
    records nothing; a later request is not its "first output"."""
    cl = cluster_factory(1, backend="null", model="null", heartbeat_interval_s=1.0)
    cl.wait_ready(1)
    c = cl.client()
    c.pause("abort")
    c.resume()
    time.sleep(0.3)
    assert c.generate([5, 6], {"max_tokens": 3}).token_ids
    (r,) = c.control(P.Stats()).values()
    assert read_timings(r.detail).resumes == []


def test_bench_all_writes_outside_the_tracked_tree_unless_asked(monkeypatch, tmp_path, capsys):
    import bench.all as B

    outs: list[str] = []
    monkeypatch.setattr(B, "run_one", lambda name, quick, budget, extra, out: (outs.append(out), (0, 0.0))[1])
    assert B.main(["--quick", "--only", "core_overhead"]) == 0
    (default,) = outs
    assert Path(default).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve())
    assert not Path(default).resolve().is_relative_to(Path(ROOT).resolve())
    assert B.main(["--only", "core_overhead", "--out", str(tmp_path)]) == 0
    assert outs[1] == str(tmp_path)
    os.rmdir(default)
    assert f"results go to {default}" in capsys.readouterr().out


def test_pre_commit_hooks_run_from_the_installed_packages():
    """Nothing fetched at hook-install time: every hook is a local one that
    runs a module of this environment (issue 23: it cloned a source repository)."""
    import importlib.util

    import yaml

    cfg = yaml.safe_load((Path(ROOT) / ".pre-commit-config.yaml").read_text())
    hooks = [h for r in cfg["repos"] for h in r["hooks"]]
    assert {r["repo"] for r in cfg["repos"]} == {"local"} and hooks
    for h in hooks:
        assert h["language"] == "system", h
        m = re.fullmatch(r"python -m (\w+)( .*)?", h["entry"])
        assert m and importlib.util.find_spec(m.group(1)) is not None, h


def test_the_docs_agree_on_the_suite_time_and_the_cpu_torch_line():
    readme = (Path(ROOT) / "README.md").read_text()
    contributing = (Path(ROOT) / "CONTRIBUTING.md").read_text()
    ci = (Path(ROOT) / ".ci" / "run").read_text()
    minutes = {
        "README": re.findall(r"CPU, about (\d+) minutes on 2 cores", readme),
        "CONTRIBUTING": re.findall(r"CPU suite, ~(\d+) minutes on 2 cores", contributing),
        ".ci/run": re.findall(r"~(\d+)-minute suite", ci),
    }
    assert all(len(v) == 1 for v in minutes.values()) and len({v[0] for v in minutes.values()}) == 1, minutes
    # The CPU-only torch build on Linux (PyPI alone gives the CUDA build there), on 3.11 and 3.12 alike.
    (pin,) = set(re.findall(r"pip install (torch==\S+) && pip install -e", readme))
    assert f"pip install {pin} --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "Python 3.10 to 3.12" in readme


def _readme_and_docs() -> str:
    """The README and docs/*.md, where its detail moved (issue 35: the README <= 300 lines)."""
    pages = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def test_the_readme_spells_out_wait_ready_and_model_name():
    readme = _readme_and_docs()
    assert "wait_ready(" in readme and not re.search(r"wait_ready\(\d", readme)  # a bare 2 reads like seconds
    assert "model_name=" in readme and "connect" in readme[readme.index("model_name=") - 200 :][:400]


def test_the_flags_the_readme_names_are_in_launch_help():
    out = subprocess.run(
        [sys.executable, "launch.py", "--help"], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60
    ).stdout
    readme = _readme_and_docs()
    for flag in ("--session-placement", "--log-level", "--curve", "--curve-dir", "--ray", "--demo", "--once"):
        assert flag in out and flag in readme, flag
