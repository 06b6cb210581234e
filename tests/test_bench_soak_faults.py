"""The fault soak's CPU dry run (bench/soak_faults.py, issue 22 "Tests"): a real
launch.py cluster (torch backend, tiny model), one head kill -9 (restarted by
the launcher) and one trainer kill -9 inside paused() in 45 s; the JSON's
criteria must all pass (no hang, only head-death errors within 2 s, the
restarted head serves, the lease releases the pause). The trainer fault starts
two fault periods plus the head fault's recovery in, and is skipped if that is
past the last 5 s: 2 x 12 s + recovery < 45 - 5 leaves the head fault 16 s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_soak_faults_dry_run(tmp_path):
    out = tmp_path / "soak_faults.json"
    argv = ["-m", "bench.soak_faults", "--minutes", "0.75", "--fault-every-s", "12", "--concurrency", "4"]
    rc, log = run_module([*argv, "--out", str(out)], 280, ROLLOUT_BUS_LOG_LEVEL="WARNING")
    assert rc == 0, log[-6000:]
    doc = json.loads(Path(out).read_text())
    assert doc["passed"] and all(doc["criteria"].values()), doc["criteria"]
    assert doc["head_kills"] >= 1 and doc["trainer_kills"] >= 1
    assert doc["outcomes"].get("finished", 0) > 0
    assert doc["pause_released_max_s"] <= doc["lease_s"] + 3.0
