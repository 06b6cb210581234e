"""bench/gpu/rl_loop.py's CPU dry run (issue 37 §4): the harness (arms in
processes of their own, READY / RUN / STEPS over pipes, interleaved rounds,
medians, table, JSON, PNG) and the rollout-bus arm on torch engines, colocated
(sleep, wake by tags, zmq push); the in-process-LLM and nccl arms need vLLM and
GPUs and are skipped with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster import run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


def test_gpu_rl_loop_dry_run(tmp_path):
    rc, log = run_module(["-m", "bench.gpu.rl_loop", "--cpu", "--out-dir", str(tmp_path)], 190)
    assert rc == 0, log[-6000:]
    doc = json.loads(Path(tmp_path, "gpu_rl_loop.json").read_text())
    assert set(doc["skipped"]) == {"inproc", "rb_nccl"} and "--cpu" in doc["skipped"]["inproc"]
    steps = doc["result"]["rb1"]["steps"]
    assert doc["result"]["rb1"]["errors"] == []
    assert [(s["round"], s["step"]) for s in steps] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    for s in steps:  # every phase of the colocated step measured; same weights on both sides
        assert all(s[k] > 0 for k in ("generate_s", "sleep_s", "train_s", "sync_s", "wake_s")), s
        assert s["mismatch_mean_abs"] < 1e-4 and s["mismatch_stale_frac"] == 0.0, s
    row = doc["summary"]["rb1"]
    assert row["steps"] == 4 and row["errors"] == 0 and row["steps_per_s"] > 0
    assert Path(tmp_path, "gpu_rl_loop.png").stat().st_size > 10_000
    assert "| rb1 | 4 |" in log
