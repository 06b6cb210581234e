"""A real Ray cluster on the GPU machine (issue 33 §4): two Ray nodes on the one
host, engines placed by Ray placement groups on the GPUs, reached over TCP with
CURVE (`RayCluster.start(curve_dir=...)`, what `launch.py --ray ADDRESS --curve`
runs: each actor writes its node's part of the key folder onto its node).

The Ray cluster: `ray start --head` with the first half of the GPUs and the
custom resource `rb_node_a`, then `ray start --address …` with
--node-ip-address 127.0.0.2 (another loopback address) and ports of its own
(two raylets on one host; tried on CPU: two nodes, tasks land on each by
their resource), with the other half and
`rb_node_b`, each under its own CUDA_VISIBLE_DEVICES (Ray maps the ids it
assigns through the raylet's mask). N = torch.cuda.device_count() (skipped
under 2; an odd N gives the head node the extra GPU).

1. N engines (qwen05, one per GPU, a PACK placement group spanning both
   nodes): every engine on its own physical GPU, both nodes used; the rb arm
   of bench/gpu/scale_out.py (the 512-prompt throughput set, one batch
   `generate`) through the Ray-placed cluster, then through a local
   launch.py cluster of N engines in the same test: Ray >= 0.95x local.
2. Under the GRPO-shaped load (64 prompts x 8 samples, streams): `kill -9`
   of one Ray-placed engine's node process: 0 requests lost or truncated,
   Ray restarts the actor and the engine serves again.
3. N - 1 engines and the trainer on the GPU Ray left free (the driver is
   not a Ray task): one NCCL update (ROLLOUT_BUS_GPU_NCCL_MODEL, default the
   qwen05 model; the 7B preset on x4), every engine on the new version.

Needs ray importable WITH gcs_server and raylet: tests/gpu/make_ray_kit.sh
build (README.md in this folder: its own device call). Timings go to
ROLLOUT_BUS_GPU_TIMINGS (record_timing)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import pytest

from tests.gpu.common import gpu_count, record_timing

pytestmark = [pytest.mark.timeout(900)]

HEAD_PORT = 6391
MODEL = os.environ.get("ROLLOUT_BUS_GPU_BENCH_MODEL", "/tmp/q05")
NCCL_MODEL = os.environ.get("ROLLOUT_BUS_GPU_NCCL_MODEL", MODEL)
OPTS = {"gpu_memory_utilization": 0.8, "max_model_len": 2048}
# Token auth (on by default in ray 2.60) off: both nodes and the driver are on loopback of one host.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
# Two raylets on one host: the ports each binds on every interface must differ.
NODE_PORTS = {
    "a": ["--min-worker-port", "11000", "--max-worker-port", "11999", "--dashboard-agent-listen-port", "52365"],
    "b": ["--min-worker-port", "12000", "--max-worker-port", "12999", "--dashboard-agent-listen-port", "52366",
          "--node-manager-port", "6401", "--object-manager-port", "6402", "--metrics-export-port", "6403",
          "--dashboard-agent-grpc-port", "6404", "--runtime-env-agent-port", "6405"],
}  # fmt: skip


def _ray_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", *args],
        env={**os.environ, **RAY_ENV, **(env or {})},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert p.returncode == 0, f"ray {' '.join(args)}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def two_node_ray(tmp_path_factory):
    """Two Ray nodes on this host (127.0.0.1 and 127.0.0.2), the GPUs split
    between them; the test process connects as the driver. `ray stop --force`
    at the end ends both nodes' processes."""
    n = gpu_count()
    if n < 2:
        pytest.skip(f"a two-node Ray cluster on GPUs needs 2 GPUs, {n} visible")
    try:
        import ray
    except ImportError:
        pytest.skip("ray is not importable (tests/gpu/make_ray_kit.sh build)")
    here = os.path.dirname(ray.__file__)
    if not os.path.exists(os.path.join(here, "core/src/ray/raylet/raylet")):
        pytest.skip("this ray has no raylet (make_device_kit.sh's strip): use tests/gpu/make_ray_kit.sh's")
    a = n - n // 2
    gpus_a, gpus_b = ",".join(map(str, range(a))), ",".join(map(str, range(a, n)))
    common = ["--num-cpus", "8", "--disable-usage-stats"]
    os.environ.update(RAY_ENV)  # the driver (this process) and the actors' workers alike
    try:
        _ray_cli(
            "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(HEAD_PORT), "--num-gpus", str(a),
            "--resources", '{"rb_node_a": 1}', "--include-dashboard=false", *common, *NODE_PORTS["a"],
            env={"CUDA_VISIBLE_DEVICES": gpus_a},
        )  # fmt: skip
        _ray_cli(
            "start", "--address", f"127.0.0.1:{HEAD_PORT}", "--node-ip-address", "127.0.0.2",
            "--num-gpus", str(n - a), "--resources", '{"rb_node_b": 1}', *common, *NODE_PORTS["b"],
            env={"CUDA_VISIBLE_DEVICES": gpus_b},
        )  # fmt: skip
        ray.init(address=f"127.0.0.1:{HEAD_PORT}", _node_ip_address="127.0.0.1", log_to_driver=False)
        nodes = [x for x in ray.nodes() if x["Alive"]]
        assert len(nodes) == 2 and int(ray.cluster_resources().get("GPU", 0)) == n, (nodes, ray.cluster_resources())
        yield {"gpus": n, "a": gpus_a, "b": gpus_b}
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        with contextlib.suppress(Exception):
            _ray_cli("stop", "--force")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from bus.auth import KeyDir

    return KeyDir(str(tmp_path_factory.mktemp("curve") / "keys")).init().root


def _ray_cluster(n: int, keys: str, model: str = MODEL, **kw):
    from trainer_bridge.ray.cluster import RayCluster

    return RayCluster.start(
        n, backend="vllm", model=model, backend_options=dict(OPTS), curve_dir=keys, max_restarts=2,
        ready_timeout_s=400, heartbeat_interval_s=0.5, **kw,
    )  # fmt: skip


def _gpus_of(rc) -> list[tuple[str, str]]:
    """(Ray node id, physical GPU) of each engine: the CUDA_VISIBLE_DEVICES its node
    process got (Ray's id mapped through its raylet's mask: one host, so
    physical ids are the host's)."""
    import ray

    out = []
    for a in rc.engines:
        p = ray.get(a.placement.remote(), timeout=60)
        out.append((p["node_id"], str(p["cuda_visible_devices"])))
    return out


def _throughput(address: str, keys: str | None, reps: int = 2) -> dict:
    """The rb arm of scale_out (batch generate of the 512-prompt set): median tokens/s."""
    from bench import harness as H
    from bench.gpu import common as G
    from trainer_bridge import AsyncClient

    prompts = G.make_prompts(512, 64, 512, G.model_vocab(MODEL), 0)
    params = {"max_tokens": 256, "temperature": 1.0, "ignore_eos": True}

    async def run() -> list[float]:
        ac = AsyncClient(address, curve_dir=keys, timeout_s=600, control_timeout_s=60)
        try:
            await ac.generate(prompts[:64], {**params, "max_tokens": 16})  # warm-up
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                res = await ac.generate(prompts, params)
                wall = time.perf_counter() - t0
                got = sum(len(r.token_ids) for r in res)
                assert got == 512 * 256, f"{got} tokens of {512 * 256}"
                out.append(got / wall)
            return out
        finally:
            await ac.close()

    vals = asyncio.run(run())
    return {"tokens_per_s": H.median(vals), "reps": vals}


def test_engines_placed_on_two_ray_nodes_serve_over_curve_and_survive_a_kill(two_node_ray, keys):

    from tests.cluster import Streams, wait_until

    n = two_node_ray["gpus"]
    rc = _ray_cluster(n, keys, strategy="PACK")
    try:
        phys = _gpus_of(rc)
        assert len({node for node, _ in phys}) == 2, f"placement spans both Ray nodes: {phys}"
        assert sorted(g for _, g in phys) == [str(i) for i in range(n)], f"every engine on a GPU of its own: {phys}"
        c = rc.client(timeout_s=600, control_timeout_s=60)
        es = {e["engine_id"]: e for e in c.engines()}
        assert len(es) == n and all(e["data_address"].startswith("tcp://") for e in es.values())
        assert all(e.get("curve_key") for e in es.values()), "every engine speaks CURVE"
        on_ray = _throughput(rc.frontend, keys)
        record_timing("ray_gpu_rb_arm", engines=n, placement=[str(x) for x in phys], **on_ray)

        # kill -9 one Ray-placed engine under the GRPO-shaped load: nothing lost or truncated
        from bench.gpu import common as G

        prompts = G.make_prompts(64, 1032, 1128, G.model_vocab(MODEL), 1)  # a 1,000-id shared-prefix-sized shape
        shared = prompts[0][:1000]
        grpo = [shared + p[1000:] for p in prompts for _ in range(8)]
        params = {"max_tokens": 128, "temperature": 1.0, "ignore_eos": True}
        s = Streams(c, grpo, params)
        wait_until(lambda: sum(1 for k in s.counts() if k > 0) >= len(grpo) // 4, 120, "a quarter of the streams")
        victim = next(i for i, e in enumerate(rc.engine_ids) if c.health()["engines"][e]["outstanding"] > 0)
        pid0, t_kill = rc.engine_pid(victim), time.monotonic()
        os.kill(pid0, 9)
        s.join(timeout=300)
        lost = [i for i in range(len(grpo)) if len(s.kept(i)[0]) != params["max_tokens"]]
        eid = rc.engine_ids[victim]
        back = wait_until(
            lambda: (e := c.health()["engines"].get(eid)) and e["healthy"] and rc.engine_pid(victim) != pid0,
            300, f"Ray to restart {eid} and it to serve", interval=0.5,
        )  # fmt: skip
        record_timing(
            "ray_gpu_kill_one", engines=n, requests=len(grpo), lost=len(lost),
            restart_to_healthy_s=round(time.monotonic() - t_kill, 2), ok=bool(back),
        )  # fmt: skip
        assert not lost, f"{len(lost)} of {len(grpo)} streams lost or truncated"
    finally:
        rc.shutdown()
    assert rc.leftovers() == []

    # the same rb arm through a local launch.py cluster of N engines, in the same test
    from bench.gpu import common as G

    with G.RbCluster(MODEL, "vllm", engines=n, gpus=",".join(map(str, range(n))), ready_timeout_s=400,
                     gpu_memory_utilization=OPTS["gpu_memory_utilization"], max_model_len=2048) as cl:  # fmt: skip
        cl.wait_ready()
        local = _throughput(cl.address, None)
    x = on_ray["tokens_per_s"] / local["tokens_per_s"]
    record_timing("ray_gpu_vs_local", engines=n, ray=on_ray["tokens_per_s"], local=local["tokens_per_s"], x=round(x, 3))
    assert x >= 0.95, f"Ray-placed {on_ray} vs local {local}: {x:.3f}x"


def test_one_nccl_update_into_ray_placed_engines(two_node_ray, keys):
    """N - 1 Ray-placed engines; the trainer (this driver, not a Ray task) on the GPU Ray left free."""
    import torch
    from transformers import AutoModelForCausalLM

    n = two_node_ray["gpus"]
    rc = _ray_cluster(n - 1, keys, model=NCCL_MODEL, strategy="SPREAD")
    try:
        (free,) = set(range(n)) - {int(g) for _, g in _gpus_of(rc)}
        dev = f"cuda:{free}"
        c = rc.client(timeout_s=600, control_timeout_s=300)
        m = AutoModelForCausalLM.from_pretrained(NCCL_MODEL, dtype=torch.bfloat16).to(dev)
        v0 = c.health()["weight_version"]
        t0 = time.perf_counter()
        res = c.update_weights(
            list(m.named_parameters()), transport="nccl", device=dev, nccl_host="127.0.0.1", timeout_s=300
        )
        dt = time.perf_counter() - t0
        assert {r["weight_version"] for r in res.values()} == {v0 + 1} and len(res) == n - 1
        assert {e["weight_version"] for e in c.engines()} == {v0 + 1}, "every engine on the new version"
        record_timing("ray_gpu_nccl_update", engines=n - 1, trainer_gpu=free, first_update_s=round(dt, 3))
        out = c.generate([[5, 6, 7, 8]] * 8, {"max_tokens": 8, "temperature": 0.0})
        assert all(set(o.token_versions) == {v0 + 1} for o in out)
    finally:
        rc.shutdown()
    assert rc.leftovers() == []
