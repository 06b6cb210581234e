"""bench/gpu/scale_out.py on CPU (issue 33 §2, §5): the dry run (launch.py
with N null engines, the phase machinery, the JSON; vLLM's arms skipped with
the reason), and losing one engine of three under the GRPO stream load: a real
SIGKILL of a real engine node under a real launcher, whose supervisor restarts
it; no request lost or truncated, the restarted engine serves again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import scale_kill as K
from bench.gpu import scale_out as SO
from tests.cluster import run_module

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(120)
def test_scale_out_dry_run(tmp_path):
    args = ["--engines", "2", "--arms", "rb", "--workloads", "grpo", "--ttft-concurrency", "4"]
    rc, log = run_module(["-m", "bench.gpu.scale_out", "--cpu", "--out-dir", str(tmp_path), *args], 110)
    assert rc == 0, log[-6000:]
    doc = json.loads(Path(tmp_path, "gpu_scale_out.json").read_text())
    assert [p["engines"] for p in doc["phases"]] == [2] and all(p["ok"] for p in doc["phases"])
    want = 4 * 4 * 8  # --cpu: 4 prompts × 4 samples × 8 tokens
    for p in doc["phases"]:
        for arm in ("rb batch", "rb stream"):
            (rep,) = p["arms"][arm]["reps"]
            assert rep["grpo"]["tokens"] == want and rep["grpo"]["errors"] == 0, rep
            assert [t["4"]["n"] for t in p["arms"][arm]["ttft"]] == ([4] if arm == "rb stream" else [])
    assert set(doc["skipped"]) == {"vllm-dp", "vllm-router", "asyncllm"}
    assert all("--cpu" in why for why in doc["skipped"].values())
    assert {r["arm"] for r in SO.summarize(doc)} == {"rb batch", "rb stream"}
    assert Path(tmp_path, "gpu_scale_out.png").is_file()


def test_the_ideal_is_n_times_the_arms_own_one_engine_figure():
    def phase(n, tps):
        rep = {"grpo": {"tokens_per_s": tps, "errors": 0}}
        return {"engines": n, "arms": {"a": {"reps": [rep], "ttft": [{"4": {"n": 4, "p50_ms": 1, "p99_ms": 2}}]}}}

    doc = {"config": {"workloads": "grpo", "ttft_concurrency": "4"}, "phases": [phase(1, 100.0), phase(4, 300.0)]}
    four = [r for r in SO.summarize(doc) if r["engines"] == 4][0]
    assert (four["ideal"], four["of_ideal"], four["ttft4_p99_ms"]) == (400.0, 0.75, 2)


@pytest.mark.timeout(120)
def test_losing_one_engine_of_three_under_load_loses_no_request(tmp_path):
    """fe0cb18 had no such bench; the properties are the runtime's: failover
    keeps the tokens so far (no request lost or truncated), the launcher's
    supervisor restarts the node and the head places on it again."""
    a = SO.parse(["--cpu", "--engines", "3", "--kill-one"])
    spec = {
        **SO.base_spec(a, SO.G.model_of(a), tmp_path),
        "engines": 3, "kill_at_s": 2.0, "kill_duration_s": 5.0, "kill_concurrency": 24, "grpo_max_tokens": 24,
        "ready_timeout_s": 40.0, "request_timeout_s": 40.0,  # a failure names its stage inside the test's timeout
    }  # fmt: skip
    spec["cpu_options"] = {"tokens_per_step": 1, "step_delay_s": 0.01}  # streams that live across the kill
    k = K.phase_kill(spec)
    assert k["requests_lost_or_truncated"] == 0, k["bad_sample"]
    assert k["requests_complete"] == k["requests_sent"] > 24
    assert k["restart_healthy_after_s"] > 0 and k["restarted_engine_served"] >= 1, k
    assert k["victim"] == "e2" and max(k["tokens_per_s_series"]) > 0


def test_runs_of_separate_device_calls_merge_into_one_table(tmp_path):
    """One device call holds one N; `--plot-from a.json,b.json` puts their phases side by side."""
    docs = []
    for n, tps in ((1, 100.0), (4, 360.0)):
        rep = {"grpo": {"tokens_per_s": tps, "errors": 0}}
        doc = {"config": {"workloads": "grpo", "ttft_concurrency": "4"},
               "phases": [{"engines": n, "arms": {"rb stream": {"reps": [rep], "ttft": []}}}]}  # fmt: skip
        path = tmp_path / f"n{n}.json"
        path.write_text(json.dumps(doc))
        docs.append(str(path))
    assert SO.main(["--plot-from", ",".join(docs)]) == 0
    four = [r for r in SO.summarize(SO.merged(docs)) if r["engines"] == 4][0]
    assert four["of_ideal"] == 0.9
    assert (tmp_path / "gpu_scale_out_merged.png").is_file()
