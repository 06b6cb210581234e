"""The GPU benchmarks' CPU dry run (bench/gpu/throughput.py, bench/gpu/weight_update.py
with --cpu): the phase machinery, launch.py, the rollout-bus paths and the JSON are
real (torch backend, tiny model); the vLLM paths are skipped with a reason."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.cluster import ROOT, run_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


def _run(module: str, out: str, *args: str, **env: str) -> dict:
    rc, log = run_module(["-m", module, "--cpu", "--out-dir", out, *args], 80, ROLLOUT_BUS_LOG_LEVEL="WARNING", **env)
    assert rc == 0, log[-6000:]
    return json.loads(Path(out, "gpu_" + module.split(".")[-1] + ".json").read_text())  # bench.gpu.X writes gpu_X.json


def test_gpu_throughput_dry_run(tmp_path):
    doc = _run(
        "bench.gpu.throughput",
        str(tmp_path),
        "--prompts",
        "6",
        "--max-tokens",
        "5",
        "--warmup-n",
        "2",
        "--ttft-n",
        "2",
        "--ttft-rounds",
        "1",
    )
    runs = {r["path"]: r for r in doc["runs"]}
    assert all("vLLM" in runs[p]["skipped"] for p in ("llm", "asyncllm", "http"))
    rb = runs["rb"]
    assert rb["ok"], rb.get("error")
    for mode in ("generate batch", "6 AsyncClient streams"):
        m = rb["modes"][mode]
        assert m["tokens"] == m["expected_tokens"] == 30 and m["errors"] == 0 and m["tokens_per_s"] > 0
    assert rb["ttft"]["n"] == 2 and rb["ttft"]["p50_ms"] > 0


def test_gpu_weight_update_dry_run(tmp_path):
    doc = _run("bench.gpu.weight_update", str(tmp_path), "--streams", "2", "--updates", "1", "--gap-s", "0.1")
    ipc = doc["ipc"]
    assert ipc["ok"], ipc.get("error")
    assert [u.get("error") for u in ipc["updates"]] == [None, None]
    assert [u["weight_version"] for u in ipc["updates"]] == [1, 2]
    assert all(u["first_token_ms"] is not None for u in ipc["updates"])
    assert ipc["load"]["stream_errors"] == 0 and ipc["floor"]["bytes"] == ipc["bytes"] > 0
    assert "skipped" in doc["nccl"]


def test_gpu_weight_update_dry_run_pipelined(tmp_path):
    """--pause pipe-abort: update_weights(pause="abort"), pause/update/resume sent
    back to back; every update says which path it took (zmq: two round trips)."""
    doc = _run(
        "bench.gpu.weight_update",
        str(tmp_path),
        *("--streams", "2", "--updates", "1", "--gap-s", "0.1", "--pause", "pipe-abort"),
    )
    ipc = doc["ipc"]
    assert ipc["ok"], ipc.get("error")
    assert [u.get("error") for u in ipc["updates"]] == [None, None]
    assert [u["weight_version"] for u in ipc["updates"]] == [1, 2]
    assert [u["path"] for u in ipc["updates"]] == ["two_trip", "two_trip"]
    assert all(u["pause_ms"] is None and u["e2e_ms"] > 0 for u in ipc["updates"])
    assert all(u["first_token_ms"] is not None for u in ipc["updates"])
    assert {"Pause", "Resume"} <= set(ipc["updates"][1]["control_ms"])
    assert ipc["summary"]["paths"] == {"two_trip": 1}


def test_gpu_interleaved_dry_run(tmp_path):
    doc = _run("bench.gpu.interleaved", str(tmp_path))
    res = doc["result"]
    assert res["ok"], doc.get("error")
    assert set(res["reps"]) == {"rb batch", "rb streams"}
    for mode, reps in res["reps"].items():
        assert [r["rep"] for r in reps] == [0, 1], mode
        assert all(r["tokens"] == r["expected_tokens"] == 16 * 16 for r in reps), reps
    # rotated order: each mode runs first once
    assert {r["slot"] for r in res["reps"]["rb batch"]} == {0, 1}
    tt = res["ttft"]
    assert [len(r) for r in tt["rounds"]["rb"]] == [4, 4] and tt["errors"]["rb"] == []
    assert tt["p50_ms"]["rb"] > 0


def test_paired_ratios_pair_reps_by_index():
    from bench.gpu.interleaved import paired_ratios

    reps = {
        "LLM.generate": [{"rep": 0, "tokens_per_s": 100.0}, {"rep": 1, "tokens_per_s": 50.0}],
        "rb batch": [
            {"rep": 0, "tokens_per_s": 110.0},
            {"rep": 1, "tokens_per_s": 45.0},
            {"rep": 2, "tokens_per_s": 9},
        ],
    }
    (row,) = paired_ratios(reps)
    # medians of the paths (105 / 75 = 1.4) would flatter; paired: 1.1 and 0.9
    assert row["ratio"] == "rb batch / LLM.generate" and row["reps"] == 2
    assert (row["min"], row["max"], row["median"]) == (0.9, 1.1, 1.0) and row["meets"]


def test_paired_ttft_compares_round_by_round():
    from bench.gpu.interleaved import paired_ttft

    rounds = {"rb": [[10.0, 12.0, 11.0], [30.0, 31.0, 32.0]], "AsyncLLM": [[9.0, 10.0, 11.0], [27.0, 28.0, 29.0]]}
    (row,) = paired_ttft(rounds)
    assert row["diff"] == "TTFT p50 rb - AsyncLLM (ms)" and row["rounds"] == 2
    assert (row["min"], row["max"], row["median"]) == (1.0, 3.0, 2.0) and row["meets"] is True
    rounds["rb"][1] = [40.0, 41.0, 42.0]
    assert paired_ttft(rounds)[0]["meets"] is False


def test_a_phase_killed_at_its_limit_keeps_what_it_checkpointed(tmp_path):
    from bench.gpu import common as G

    res = G.run_phase("ck", "tests.test_bench_gpu_dry:_checkpoint_then_hang", {}, 6.0, tmp_path, log=lambda _m: None)
    assert res["ok"] is False and "ran past its limit of 6s" in res["error"]
    assert res["reps"] == {"rb batch": [{"rep": 0, "tokens_per_s": 1.0}]}


def _checkpoint_then_hang(spec: dict) -> dict:
    """A phase (run by run_phase in a child) that checkpoints one rep, then hangs."""
    import time

    from bench.gpu import common as G

    spec["_partial"]["reps"] = {"rb batch": [{"rep": 0, "tokens_per_s": 1.0}]}
    G.checkpoint(spec)
    time.sleep(60)
    return {}


def _bench(module: str, *args: str, timeout_s: float = 80) -> None:
    """python -m bench.<module> args..., which must exit 0."""
    rc, log = run_module(["-m", f"bench.{module}", *args], timeout_s)
    assert rc == 0, log[-3000:]


def test_gpu_plan_copy_dry_run(tmp_path):
    """bench/gpu/plan_copy.py on the CPU, 2 layers and a small vocabulary: every
    way of copying writes exactly the sources (bit for bit)."""
    out = tmp_path / "copy.json"
    _bench("gpu.plan_copy", "--device", "cpu", "--reps", "2", "--layers", "2", "--vocab", "1000", "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["tensors"] == 2 + 12 * 2 and doc["copies_equal_sources"] is True
    assert {"loop", "foreach", "flat", "hybrid_1MiB"} <= set(doc) and doc["flat"]["ms"] > 0


def test_gpu_first_step_plots_a_recorded_run(tmp_path):
    """bench/gpu/first_step.py needs vLLM's engine core (GPU only); its PNG is
    rebuilt here from the recorded H200 run (tests/data/gpu_first_step.json), so
    the script stays importable and its report code runs in CI."""
    src = Path(ROOT) / "tests" / "data" / "gpu_first_step.json"
    doc = json.loads(src.read_text())
    assert doc["info"]["cudagraph_capture_sizes_max"] == 512 and doc["resume"] and doc["cold"]
    (tmp_path / "run.json").write_text(src.read_text())
    _bench("gpu.first_step", "--plot-from", str(tmp_path / "run.json"))
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_gpu_prefix_placement_dry_run(tmp_path):
    """Both policies through launch.py with two model-less engines (`--gpus 0,0`:
    the second engine joins once the first is up, the one-GPU path): every
    request answered, and prefix placement keeps each prompt's samples on one
    engine (the vLLM hit rate is n/a without vLLM; the ideal-cache estimate is not)."""
    doc = _run(
        "bench.gpu.prefix_placement", str(tmp_path), "--cpu-backend", "null",
        "--prompts", "4", "--samples", "3", "--vllm-router", "", "--gpus", "0,0",
    )  # fmt: skip
    table = doc["summary"]
    assert set(table) == {"least_loaded", "prefix"}
    for pol, row in table.items():
        assert row["ok"] and row["reps"] == 1 and row["errors"] == 0, (pol, row)
        rep = doc["policies"][pol]["reps"][0]
        assert rep["tokens"] == rep["expected_tokens"] == 4 * 3 * 2
        assert rep["prefix_cache_hit_rate"] is None and 0 < rep["ideal_cache_hit_rate"] <= 1
    assert table["prefix"]["split_prompts"] == 0
    assert doc["policies"]["prefix"]["head_stats"]["placed"] >= 12
    assert len(doc["policies"]["prefix"]["launch_argv"]) == 2  # head + engine, then the joined engine


# The dev extra installs vllm-router: CI (CI=true) runs this test, a missing router fails it there.
@pytest.mark.skipif(
    shutil.which("vllm-router") is None and not os.environ.get("CI"),
    reason='vllm-router is not on PATH (pip install -e ".[dev]" installs it)',
)
def test_gpu_prefix_placement_vllm_router_arm_dry_run(tmp_path):
    """The vllm-router arm's plumbing with no model: the real router (cache_aware,
    power_of_two) in front of two `bench.http_peer --prefix-cache` servers, token-id
    prompts, hit rates scraped from their /metrics; beside a rollout-bus arm
    (`launch.py --engines 2`), every arm alive, reps in rotated order."""
    doc = _run(
        "bench.gpu.prefix_placement", str(tmp_path), "--cpu-backend", "null", "--policies", "prefix",
        "--vllm-router", "cache_aware,power_of_two", "--prompts", "4", "--samples", "3", "--reps", "2",
    )  # fmt: skip
    table = doc["summary"]
    assert set(table) == {"prefix", "vllm-router:cache_aware", "vllm-router:power_of_two"}
    assert len(doc["policies"]["prefix"]["launch_argv"]) == 1 and table["prefix"]["reps"] == 2
    del table["prefix"]
    for arm, row in table.items():
        assert row["ok"] and row["reps"] == 2 and row["errors"] == 0, (arm, row)
        for rep in doc["policies"][arm]["reps"]:
            assert rep["tokens"] == rep["expected_tokens"] == 4 * 3 * 2
            assert sum(rep["per_engine"].values()) == 12
            # the servers' counters (an unbounded cache) agree with the estimate from the placements
            assert rep["prefix_cache_hit_rate"] == rep["ideal_cache_hit_rate"] > 0
    assert table["vllm-router:cache_aware"]["split_prompts"] == 0
    arms = ["prefix", "vllm-router:cache_aware", "vllm-router:power_of_two"]
    assert doc["phase"]["order"] == [arms, arms[1:] + arms[:1]]


def test_gpu_prefix_placement_without_vllm_router_records_why(tmp_path):
    """No vllm-router on PATH: its rows say why, the run does not fail."""
    doc = _run(
        "bench.gpu.prefix_placement", str(tmp_path), "--cpu-backend", "null", "--policies", "",
        "--vllm-router", "cache_aware", PATH="/usr/bin:/bin",
    )  # fmt: skip
    assert "vllm-router is not on PATH" in doc["vllm_router_skipped"]
    row = doc["policies"]["vllm-router:cache_aware"]
    assert not row["ok"] and row["error"].startswith("skipped: vllm-router is not on PATH")


def test_vllm_metrics_and_the_peers_prefix_counter():
    """The Prometheus parsing of the vLLM counters (labels summed), and
    http_peer's unbounded-cache count (hits stop at the first missed block)."""
    from bench.gpu.prefix_vllm_router import parse_counters
    from bench.http_peer import PrefixCounter

    text = (
        "# HELP vllm:prefix_cache_hits_total x\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:request_success_total{finished_reason="length",model_name="m"} 7.0\n'
        "vllm:prefix_cache_hits_created 1.7e9\n"
    )
    assert parse_counters(text) == {"prefix_cache_queries": 100.0, "prefix_cache_hits": 48.0, "requests": 7.0}
    c = PrefixCounter()
    a = list(range(48))
    c.add(a)
    c.add(a[:32] + [999] * 16 + a[:16])  # two blocks shared, then a miss: the later equal block is no hit
    assert (c.queries, c.hits, c.requests) == (112, 32, 2)
    from bench.gpu.prefix_placement import ideal_cache_hits  # one counter per engine

    assert ideal_cache_hits([("e0", a), ("e1", a), ("e0", a[:32] + [999] * 16 + a[:16])]) == (32, 160)


def test_gpu_rl_step_dry_run(tmp_path):
    """bench/gpu/rl_step.py on CPU: an in-flight update block (streams in a
    process of their own) and SkyRL's colocated order with the split wake."""
    doc = _run(
        "bench.gpu.rl_step",
        str(tmp_path),
        *("--configs", "keep:packed:other", "--streams", "2", "--steps", "1", "--gap-s", "0.1"),
        *("--stream-max-tokens", "48", "--gen-prompts", "2", "--gen-tokens", "4", "--request-timeout-s", "60"),
    )
    rb = doc["rb"]
    assert rb["ok"], rb.get("error")
    blk = rb["inflight"]["keep:packed:other"]
    assert "error" not in blk and blk["summary"]["errors"] == 0, blk
    assert blk["summary"]["all_streams_ms"] is not None  # every stream went on past the update
    steps = rb["colocated"]
    assert len(steps) == 2 and not any("error" in s for s in steps), steps
    assert all(s["gen_tokens"] == 8 for s in steps)
    assert "--cpu" in doc["vllm"]["skipped"]
    assert doc["summary"]["colocated"]["rb"]["wake_kv_ms"] is not None


def test_the_shared_parser_takes_cpu_defaults_and_given_flags_win():
    from bench.gpu import common as G

    def parse(argv):  # a fresh parser per run, as each bench's parse() builds one
        ap = G.bench_parser("A bench.\n\nMore.", cpu_help="dry run", budget_s=500.0, seed=0)
        ap.add_argument("--prompts", type=int, default=512)
        return G.parse_args(ap, argv, {"prompts": 16, "budget_s": 240.0})

    a = parse(["--cpu", "--prompts", "3"])
    assert (a.cpu, a.prompts, a.budget_s, a.seed, a.model, a.plot_from) == (True, 3, 240.0, 0, None, None)
    b = parse(["--budget-s", "9"])  # no --cpu: the bench's own defaults
    assert (b.cpu, b.prompts, b.budget_s) == (False, 512, 9.0)
    assert parse(["--dry-run"]).prompts == 16
    with pytest.raises(SystemExit, match="--model is required"):
        G.model_of(b)


def _fanout(tmp_path, phase: str) -> dict:
    argv = [f"--{phase}", "--engines", "2", "--streams", "2", "--updates", "1", "--stream-max-tokens", "64"]
    # a cluster and its trainer processes start here: more than _run's 80 s on a loaded 2-core box
    rc, log = run_module(["-m", "bench.gpu.fanout", "--cpu", "--out-dir", str(tmp_path), *argv], 200)
    assert rc == 0, log[-6000:]
    return json.loads(Path(tmp_path, "gpu_fanout.json").read_text())


@pytest.mark.timeout(220)
def test_gpu_fanout_nccl_dry_run(tmp_path):
    """bench/gpu/fanout.py --nccl (issue 33 §3) on CPU: one trainer -> 2 engines
    over gloo (the nccl path: one group, one broadcast per bucket) and the raw
    broadcast to the same receivers, under load, versions audited."""
    nc = _fanout(tmp_path, "nccl")["nccl"]
    assert nc["ok"], nc.get("error")
    assert nc["raw_broadcast"]["receivers"] == 2 and len(nc["raw_broadcast"]["per_rank"]) == 3
    assert [u.get("error") for u in nc["updates"]] == [None, None]
    assert nc["load"]["lost"] == 0 and nc["audit"]["exact"] and nc["all_or_none"]["ok"]


@pytest.mark.timeout(220)
def test_gpu_fanout_colocated_dry_run(tmp_path):
    """bench/gpu/fanout.py --colocated on CPU: 2 rank processes -> 2 engines
    over zmq (each rank feeds its own engine, one update), against one engine."""
    co = _fanout(tmp_path, "colocated")["colocated"]
    assert co["ok"], co.get("error")
    assert co["summary"]["one_version_each"] and len(co["reps"]["all"]) == 2
    assert all(r["engines"] == 2 and len(r["versions"]) == 2 for r in co["reps"]["all"])
