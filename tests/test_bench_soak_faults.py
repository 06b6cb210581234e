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

pytestmark = [pytest.mark.timeout(300)]


@pytest.mark.slow
def test_soak_faults_dry_run(tmp_path):
    out = tmp_path / "soak_faults.json"
    argv = [
        "-m", "bench.soak_faults", "--minutes", "0.75", "--fault-every-s", "12", "--concurrency", "4",
        "--sample-every-s", "2",  # 8+ RSS samples, so memory is judged
    ]  # fmt: skip
    rc, log = run_module([*argv, "--out", str(out)], 280, ROLLOUT_BUS_LOG_LEVEL="WARNING")
    assert rc == 0, log[-6000:]
    doc = json.loads(Path(out).read_text())
    assert doc["passed"] and all(doc["criteria"].values()), doc["criteria"]
    assert doc["head_kills"] >= 1 and doc["trainer_kills"] >= 1
    assert doc["outcomes"].get("finished", 0) > 0
    assert doc["pause_released_max_s"] <= doc["lease_s"] + 3.0


def _judged(n_rss: int, growth: float) -> tuple[dict, bool]:
    """The fault soak's verdict over a made-up record: every request finished,
    one head kill served again, one trainer kill released; n_rss engine RSS
    samples growing by `growth` from first to last."""
    import argparse

    from bench import soak_faults as SF

    a = argparse.Namespace(minutes=0.1, fault_every_s=1.0, lease_s=3.0, concurrency=1)
    s = SF.Soak(a, launcher=None, front="")  # type: ignore[arg-type]  # report() reads the record only
    s.requests = [{"kind": "generate", "max_tokens": 4, "start": 0.0, "end": 0.1, "outcome": "finished"}]
    s.head_faults = [{"t": 1.0, "serves_again_s": 1.0}]
    s.trainer_faults = [{"t": 2.0, "ok": True, "released_s": 1.0}]
    s.rss = [
        {"t": float(i), "head_mib": 50.0, "engines_mib": 100.0 * (1 + growth * i / max(1, n_rss - 1))}
        for i in range(n_rss)
    ]
    return SF.report(s, a)


def test_too_few_rss_samples_are_not_judged_and_not_a_pass(capsys):
    # fe0cb18: _growth returned 0.0 below 8 samples, so a short run passed the memory check unmeasured
    from bench import soak_faults as SF

    out, passed = _judged(5, growth=0.9)
    assert out["criteria"]["engine_rss_growth_below_25pct"] is None and not passed
    assert out["verdict"] == "NOT JUDGED" and out["not_judged"] == ["memory: not judged (5 samples < 8)"]
    SF.print_table(out)
    assert "memory: not judged (5 samples < 8)" in capsys.readouterr().out
    out, passed = _judged(12, growth=0.0)
    assert passed and out["verdict"] == "PASS" and out["rss_engines_growth"] == 0.0
    out, passed = _judged(12, growth=0.9)
    assert not passed and out["verdict"] == "FAIL" and out["criteria"]["engine_rss_growth_below_25pct"] is False
