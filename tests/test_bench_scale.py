"""bench/scale.py runs its vllm-router arms interleaved with the rollout-bus
arms in every rep (issue 36 row 4; fe0cb18 ran them in a phase of their own,
after the rollout-bus cluster was gone) and pairs equal clients: the raw zmq
driver with the lean HTTP reader, AsyncClient with aiohttp. A real head, null
engines, http_peers and a real run of the bench; vllm-router itself is
replaced by tests/stand_in_vllm_router.py (a stand-in named as such: this
test is about the arms' order and pairing, not about vllm-router's figures)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.cluster import run_module

pytestmark = [pytest.mark.timeout(120)]

ARMS = ["rb router (raw)", "rb router (bridge)", "vllm-router", "vllm-router (lean)"]


def test_vllm_router_arms_are_interleaved_with_the_rollout_bus_arms(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "vllm-router"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m tests.stand_in_vllm_router "$@"\n')
    shim.chmod(0o755)
    argv = ["-m", "bench.scale", "--engines", "2", "--requests", "40", "--concurrency", "8", "--reps", "2"]
    rc, log = run_module(
        [*argv, "--rounds", "2", "--max-seconds", "90"],
        110,
        ROLLOUT_BUS_BENCH_OUT=str(tmp_path),
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    )
    assert rc == 0, log[-4000:]
    (r,) = json.loads((tmp_path / "scale.json").read_text())["results"]
    assert "vllm_router_skipped" not in r, r.get("vllm_router_skipped")
    # every arm once per rep, the order rotated rep by rep
    assert r["order"] == [ARMS, ARMS[1:] + ARMS[:1]]
    assert all(r["load"][a]["errors"] == 0 and r["load"][a]["reps"] == 2 for a in ARMS), r["load"]
    assert set(r["vs_vllm_router"]) == {"rb router (raw)", "rb router (bridge)"}
    rows = [line for line in log.splitlines() if line.startswith("2 ")]  # the table's K=2 rows name their client
    assert any("rb router (raw)" in x and "raw zmq" in x for x in rows), log[-3000:]
    assert any("power_of_two (lean)" in x and "lean http" in x for x in rows), log[-3000:]
    assert any("power_of_two" in x and "aiohttp" in x for x in rows), log[-3000:]
