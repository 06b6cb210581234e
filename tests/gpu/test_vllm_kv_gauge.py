"""Issue 36 row 2 on a real engine: the head's Prometheus gauge
`rollout_bus_engine_kv_usage` follows vLLM's KV cache. A head + one vLLM
engine node (subprocesses, as launch.py starts them) with a deliberately small
cache (`num_gpu_blocks_override`: 96 blocks of 16 tokens), filled by 24 long
concurrent requests: the gauge rises above 0.5 while they run and falls back
under 0.05 after. fe0cb18 (log_stats off) kept it at 0.0 throughout.

One GPU: `TESTS=tests/gpu/test_vllm_kv_gauge.py bash tests/gpu/run_on_device.sh`."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from tests.cluster import wait_until
from tests.gpu.common import ENGINE_OPTS, prompts, record_timing

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

BLOCKS = 96  # × 16 tokens = 1,536 tokens of KV: 24 × (64 + 400) overfills it


def _gauge(url: str) -> tuple[float, float]:
    """(kv_usage of e0, in_flight) from the head's /metrics."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    return vals['rollout_bus_engine_kv_usage{engine="e0"}'], vals["rollout_bus_in_flight"]


def test_kv_gauge_rises_with_the_cache_and_falls_after(model_dirs, tmp_path):
    from tests.cluster import Cluster

    ready = tmp_path / "head.json"
    # max_model_len under the cache (vLLM refuses a cache that cannot hold one whole sequence)
    opts = {
        **ENGINE_OPTS,
        "enable_lora": False,
        "max_model_len": 1024,
        "num_gpu_blocks_override": BLOCKS,
        "block_size": 16,
    }
    c = Cluster(1, backend="vllm", model=model_dirs["A"], backend_options=opts,
                router_args=["--metrics-port", "0", "--ready-file", str(ready)])  # fmt: skip
    try:
        c.wait_ready(1, timeout_s=240)
        url = json.loads(ready.read_text())["metrics"]
        cl = c.client(timeout_s=180)
        idle0, _ = _gauge(url)
        out: list = []
        t = threading.Thread(
            target=lambda: out.extend(
                cl.generate(prompts(24, 64, seed=3), {"max_tokens": 400, "temperature": 1.0, "ignore_eos": True})
            ),
            daemon=True,
        )
        t.start()
        series = []

        def filled():
            kv, fl = _gauge(url)
            series.append(kv)
            return kv > 0.5 and fl > 0

        wait_until(filled, 60, "the kv gauge to rise above 0.5 under 24 long requests", interval=0.05)
        t.join(180)
        assert len(out) == 24 and all(len(r.samples[0].token_ids) == 400 for r in out)

        def drained():
            kv, fl = _gauge(url)
            series.append(kv)
            return kv < 0.05 and fl == 0

        wait_until(drained, 30, "the kv gauge to fall back after the requests", interval=0.1)
        record_timing("kv_gauge", idle_before=idle0, peak=max(series), after=series[-1], samples=len(series))
        assert max(series) > 0.5
    except BaseException:
        print(c.log("e0")[-5000:])
        raise
    finally:
        c.close()
