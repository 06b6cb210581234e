"""bench/weights_streamed.py's dry run (--gb 0.02 --reps 1): head, 2 torch
engines and a trainer process per mode, all real; the JSON says every mode
committed on both engines and measured its memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_weights_streamed_dry_run(tmp_path: Path) -> None:
    argv = ["-m", "bench.weights_streamed", "--gb", "0.02", "--reps", "1", "--bucket-mb", "4"]
    argv += ["--out-dir", str(tmp_path), "--no-plot", "--trainer-timeout-s", "60", "--timeout-s", "30"]
    # On overrun (or any error) the bench's whole tree goes: head, engines and
    # trainers run in their own sessions but are its descendants.
    rc, out = run_module(argv, 100, ROLLOUT_BUS_LOG_LEVEL="WARNING")
    assert rc == 0, out[-4000:]
    doc = json.loads((tmp_path / "weights_streamed.json").read_text())
    assert [r["mode"] for r in doc["rows"]] == ["streamed", "streamed_mmap", "list", "old"]
    runs = doc["runs"]
    assert sorted(r["mode"] for r in runs) == ["list", "old", "streamed", "streamed_mmap"]
    for r in runs:
        assert len(r["committed"]) == 2 and r["version"][1] > r["version"][0], r
        assert r["bytes"] > 15e6 and r["seconds"] > 0 and r["sampled_hz"] > 50, r
        assert r["peak_extra_mib"] > 0, r
    by = {r["mode"]: r for r in runs}
    # The materialized modes hold the whole update (~19 MiB) at their peak.
    assert by["list"]["peak_extra_mib"] >= r["bytes"] / 2**20 * 0.9
