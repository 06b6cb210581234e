"""The router benches' arms and bounds (bench/router_overhead.py, bench/stream_latency.py;
issue 24 §1): the spinning-head arm is built, paired and summarized; a passed
--max-seconds keeps complete rounds and the JSON is still written. The
summaries are checked without I/O; one tiny real run per bench (real head,
engines and sockets) checks the arm end to end and the deadline path."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bench import harness as H
from bench import router_overhead as RO
from tests.cluster import run_module


def _run(p50_ms: float, rps: float) -> H.RunResult:
    lat = [p50_ms / 1e3] * 5
    return H.RunResult(lat, wall_s=5 / rps, tokens=5, extra={"cpu_pct": 50.0, "cpu_s": 0.1})


def test_spin_setups_are_paired_and_summarized():
    spin50, spin200 = RO.spin_setup(50), RO.spin_setup(200)
    runs = {
        RO.VR_P2: [_run(0.5, 800), _run(0.6, 700)],
        RO.VR_P2_LEAN: [_run(0.4, 1000), _run(0.5, 900)],
        RO.HTTP_DIRECT: [_run(0.3, 1000), _run(0.3, 1000)],
        RO.LEAN_DIRECT: [_run(0.2, 1500), _run(0.2, 1500)],
        RO.RB_ROUTER: [_run(0.7, 600), _run(0.7, 600)],
        RO.RAW_DIRECT: [_run(0.2, 2000), _run(0.2, 2000)],
        RO.RAW_ROUTER: [_run(0.6, 500), _run(0.6, 500)],
        spin200: [_run(0.3, 900), _run(0.4, 900)],
        spin50: [_run(0.5, 600), _run(0.5, 600)],
    }
    case = RO.summarize_case(runs, max_tokens=64, stream=True, concurrency=1, n=5)
    ov = case["overhead_vs_own_direct"]
    assert RO.direct_of(spin50) == RO.direct_of(spin200) == RO.RAW_DIRECT
    assert ov[spin200]["p50_added_ms"]["median"] == pytest.approx(0.15)
    assert ov[spin50]["p50"]["median"] == pytest.approx(2.5)
    assert case["spin_vs_plain_head"][spin200]["p50"]["median"] == pytest.approx(0.35 / 0.6)
    # equal clients only (issue 36): the lean zmq driver against the lean HTTP reader, AsyncClient against aiohttp
    pairs = set(case["rb_vs_vllm_router"])
    assert pairs == {
        f"{RO.RB_ROUTER} / {RO.VR_P2}",
        f"{RO.RAW_ROUTER} / {RO.VR_P2_LEAN}",
        f"{spin50} / {RO.VR_P2_LEAN}",
        f"{spin200} / {RO.VR_P2_LEAN}",
    }
    assert case["overhead_vs_own_direct"][RO.VR_P2_LEAN]["p50"]["median"] == pytest.approx(2.25)  # / lean direct
    rows = RO.table_rows({"k": case})
    # spinning heads after the plain ones, by spin; their CPU% shown; every row names its client
    assert [(r["setup"], r["client"]) for r in rows] == [
        (RO.HTTP_DIRECT, "aiohttp"), (RO.VR_P2, "aiohttp"), (RO.RB_ROUTER, "AsyncClient"),
        (RO.LEAN_DIRECT, "lean http"), (RO.VR_P2_LEAN, "lean http"),
        (RO.RAW_DIRECT, "raw zmq"), (RO.RAW_ROUTER, "raw zmq"), (spin50, "raw zmq"), (spin200, "raw zmq"),
    ]  # fmt: skip
    assert rows[-1]["router CPU%"] == "50"
    full, lean = RO.target_lines({"k": case})
    assert "AsyncClient vs aiohttp" in full and f"{RO.RB_ROUTER} 0.80" in full and "vllm-router p2 (750" in full
    assert "raw zmq vs lean http" in lean and f"{spin200} 0.95" in lean and "p2 (lean) (950" in lean
    assert "(750" not in lean and "(raw)" not in full and "(lean)" not in full  # never across classes


def test_a_passed_deadline_keeps_complete_rounds():
    async def go() -> tuple[dict[str, list[H.RunResult]], bool]:
        async def one() -> H.RunResult:
            await asyncio.sleep(0.05)
            return _run(1.0, 100)

        # warm-up (2 runs) + round 1 (2 runs) fit in 0.25 s; round 2 is cut after one setup
        deadline = H.Deadline(0.25, "test")
        return await H.interleaved_within({"a": one, "b": one}, reps=5, deadline=deadline)

    runs, truncated = asyncio.run(go())
    assert truncated
    assert set(runs) == {"a", "b"} and len(runs["a"]) == len(runs["b"]) >= 1


def _bench(tmp_path, module: str, *args: str) -> dict:
    t0 = time.monotonic()
    rc, log = run_module(["-m", module, "--no-plot", *args], 170, ROLLOUT_BUS_BENCH_OUT=str(tmp_path))
    assert rc == 0, log[-6000:]
    name = module.rsplit(".", 1)[1]
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"{name}.json"]  # --no-plot: the JSON only
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    doc["_wall_s"] = time.monotonic() - t0
    return doc


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_router_overhead_runs_the_spinning_head(tmp_path):
    doc = _bench(
        tmp_path, "bench.router_overhead",
        "--concurrency", "1", "--requests", "12", "--reps", "1", "--stream-tokens", "0", "--spin-us", "100",
        "--no-raw", "--max-seconds", "120",
    )  # fmt: skip
    # --no-raw drops the lean drivers' setups (raw zmq, lean http), the spinning head's included
    assert not any(
        s.startswith(RO.SPIN_PREFIX) or RO.client_of(s) in (RO.RAW_ZMQ, RO.LEAN_HTTP)
        for r in doc["results"].values()
        for s in r["setups"]
    )
    doc = _bench(
        tmp_path, "bench.router_overhead",
        "--concurrency", "1", "--requests", "12", "--reps", "1", "--stream-tokens", "4", "--spin-us", "100",
        "--max-seconds", "120",
    )  # fmt: skip
    spin = RO.spin_setup(100)
    for key in ("max_tokens=1 c=1", "max_tokens=4 stream c=1"):
        r = doc["results"][key]
        assert r["setups"][spin]["summary"]["errors"] == 0
        assert r["setups"][spin]["summary"]["n_per_rep"] == 12
        assert spin in r["overhead_vs_own_direct"] and spin in r["spin_vs_plain_head"]
        # the lean HTTP reader (the raw driver's equal) counted every token of a real http_peer's answers
        lean = r["setups"][RO.LEAN_DIRECT]["summary"]
        assert lean["errors"] == 0 and lean["n_per_rep"] == 12
        assert [x["tokens"] for x in r["setups"][RO.LEAN_DIRECT]["runs"]] == [12 * r["max_tokens"]]
    assert doc["config"]["spin_us"] == [100]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_stream_latency_writes_its_json_when_the_deadline_passes(tmp_path):
    # 10 ms are gone before the first case starts (start-up): every case is skipped, the JSON written
    doc = _bench(
        tmp_path, "bench.stream_latency", "--streams", "1", "2", "--step-delay-ms", "0", "--max-seconds", "0.01"
    )
    assert doc["_wall_s"] < 60
    cases = doc["results"].values()
    assert len(cases) == 2 and all(c.get("skipped") for c in cases)
