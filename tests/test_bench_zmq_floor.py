"""bench/zmq_floor.py: a real echo server, a real zmq.proxy process and the
least Python forwarder, a short run over TCP and over IPC; the JSON holds every
rep's paired figures and the order its arms ran in (rotated per rep), and the
bench leaves no process."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from tests.cluster import run_module

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_zmq_floor_measures_direct_and_through_a_c_and_a_python_forwarder(tmp_path: Path, transport: str) -> None:
    argv = ["-m", "bench.zmq_floor", "--n", "200", "--reps", "2", "--no-plot", "--transport", transport, "--name", "zf"]
    rc, out = run_module(argv, 45, ROLLOUT_BUS_BENCH_OUT=str(tmp_path))
    assert rc == 0, out[-3000:]
    doc = json.loads((tmp_path / "zf.json").read_text())
    assert doc["transport"] == transport and [r["rep"] for r in doc["reps"]] == [0, 1]
    # the arms' order rotates per rep (fe0cb18: direct, proxy, py forward every rep)
    assert [r["order"] for r in doc["reps"]] == [["direct", "proxy", "pyfwd"], ["proxy", "pyfwd", "direct"]]
    for r in doc["reps"]:
        for k in ("direct", "proxy", "pyfwd"):
            assert 0 < r[f"{k}_p50_us"] <= r[f"{k}_p99_us"], (k, r)
        assert r["added_p50_us"] == pytest.approx(r["proxy_p50_us"] - r["direct_p50_us"])
        assert r["pyfwd_added_p50_us"] == pytest.approx(r["pyfwd_p50_us"] - r["direct_p50_us"])
    assert "added by a C forwarder" in out and "added by the least Python forwarder" in out
    line = next(x for x in out.splitlines() if x.startswith("processes: "))
    pids = [int(w.rstrip(",")) for w in line.split() if w.rstrip(",").isdigit()]
    assert len(pids) == 3
    rc, again = run_module(
        ["-m", "bench.zmq_floor", "--plot-from", str(tmp_path / "zf.json"), "--name", "zf2"],
        45,
        ROLLOUT_BUS_BENCH_OUT=str(tmp_path),
    )
    assert rc == 0 and (tmp_path / "zf2.png").stat().st_size > 0, again[-2000:]
    assert [x for x in again.splitlines() if x.startswith("| 0 |")] == [
        x for x in out.splitlines() if x.startswith("| 0 |")
    ]
    assert not [q for q in pids if psutil.pid_exists(q) and psutil.Process(q).status() != psutil.STATUS_ZOMBIE], line
