"""Placement on a Ray cluster (trainer_bridge/ray/cluster.py): a local Ray
instance (4 logical CPUs, no dashboard, a small object store), the torch
backend, real processes and sockets.

Ray's own processes (gcs_server, raylet, agents, workers) are children of the
test process while it runs; `ray.shutdown()` must end them all, and nothing a
RayCluster started may outlive its `shutdown()` (checked by the cluster mark in
each child's environment, so a process re-parented away from the tree is
still found).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bus.errors import BadRequest, EngineDead
from bus.proctree import descendants
from tests.cluster import ROOT, Streams, child_env, live_children, wait_until
from trainer_bridge.ray.actors import CLUSTER_ENV
from trainer_bridge.ray.cluster import RayCluster, _process_hooks, _restore_hooks
from trainer_bridge.ray.placement import plan_engines

pytestmark = pytest.mark.slow

MASK = ("GPU-6f1c2a3b-0000-1111-2222-333344445555", "GPU-7e2d3c4b-0000-1111-2222-333344445555")
LONG = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance on loopback for the module, ended (and checked
    gone, workers included) when the module ends."""
    before = {p.pid for p in live_children()}
    hooks = _process_hooks()
    saved_mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Issue 33 §1: the node's mask names its GPUs by UUID; Ray maps the ids it
    # assigns through it, and nothing of ours may renumber them on the way.
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(MASK)
    ray.init(
        num_cpus=4,
        num_gpus=2,  # logical only (no CUDA here): Ray still assigns ids and sets CUDA_VISIBLE_DEVICES
        include_dashboard=False,
        object_store_memory=80 * 1024 * 1024,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    _RAY_ROOTS[:] = [p for p in psutil.Process().children() if p.pid not in before]
    assert _RAY_ROOTS, "ray.init() started no process of its own"
    yield
    tree = [p for p in live_children() if p.pid not in before]  # gcs_server, raylet, agents, workers
    ray.shutdown()
    _restore_hooks(hooks)  # the rest of the suite keeps pytest's SIGTERM handling
    if saved_mask is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved_mask
    _RAY_ROOTS.clear()
    _, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, f"ray.shutdown() left {[(p.pid, p.name()) for p in alive]}"


_RAY_ROOTS: list[psutil.Process] = []


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Overrides conftest's check for this module: the raylet starts and pools
    worker processes across tests, so those (the module's Ray, ended and checked
    by `local_ray`) are left out; anything else a test leaves fails it. What a
    RayCluster starts lives under Ray workers: `leftovers()` checks it by mark."""
    before = {p.pid for p in live_children()}
    yield
    ray_tree = {d.pid for r in _RAY_ROOTS for d in [r, *descendants(r.pid)]}
    leaked = [p for p in live_children() if p.pid not in before and p.pid not in ray_tree]
    for p in leaked:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not leaked, f"leaked processes: {[(p.pid, p.name()) for p in leaked]}"


def _perturbed(tiny_model: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, prm in m.named_parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.05)
    return m.eval()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _by_id(c) -> dict:
    return {e["engine_id"]: e for e in c.engines()}


def _ray_or_marked() -> set[int]:
    """Every process on the machine that is Ray's or a RayCluster's (by its mark)."""
    out = set()
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.name() in ("gcs_server", "raylet") or p.name().startswith("ray::") or CLUSTER_ENV in p.environ():
                out.add(p.pid)
    return out


def _marked(pid: int) -> bool:
    with contextlib.suppress(psutil.Error, OSError):
        return CLUSTER_ENV in psutil.Process(pid).environ()
    return False


def test_launch_ray_local_serves_and_leaves_nothing():
    before = _ray_or_marked()
    p = subprocess.run(
        [
            sys.executable,
            "launch.py",
            "--ray",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--engines",
            "1",
            "--once",
        ],
        cwd=ROOT,
        env=child_env(ROLLOUT_BUS_LOG_LEVEL="WARNING"),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^e0\s+tcp://127\.0\.0\.1:\d+\s+torch\s+\S+\s+healthy", p.stdout, re.M), p.stdout
    assert "on Ray (local): 1 engine actor(s)" in p.stdout
    wait_until(lambda: not (_ray_or_marked() - before), 20, "launch.py --ray's processes to exit")


@pytest.mark.timeout(150)
def test_start_generate_kill_failover_restart_shutdown(local_ray, tiny_model):
    rc = RayCluster.start(2, host="127.0.0.1", heartbeat_interval_s=0.2, max_restarts=2, ready_timeout_s=90)
    try:
        c = rc.client(timeout_s=60, control_timeout_s=30)
        es = _by_id(c)
        assert set(es) == {"e0", "e1"}
        assert all(e["backend"] == "torch" and e["data_address"].startswith("tcp://127.0.0.1:") for e in es.values())
        rs = c.generate([[4, 5, 6]] * 8, {"max_tokens": 4})
        assert {r.engine_id for r in rs} == {"e0", "e1"}

        # a committed update: a restarted engine must come back STALE
        policy = _perturbed(tiny_model)
        assert {r["weight_version"] for r in c.update_weights(policy.named_parameters()).values()} == {1}

        # kill an engine's actor mid-stream: its requests fail over, none is lost
        pid0 = rc.engine_pid(0)
        s = Streams(c, [[7, 8, 9, i] for i in range(4)], LONG)
        wait_until(lambda: min(s.counts()) >= 5, 60, "every stream to start")
        assert c.health()["engines"]["e0"]["outstanding"] >= 1, "nothing ran on e0 to fail over"
        rc.kill_engine(0)
        s.join(timeout=90)
        for i in range(4):
            toks, vers, _ = s.kept(i)
            assert len(toks) == LONG["max_tokens"] and set(vers) == {1}, (i, len(toks), set(vers))
        # e0's streams were re-submitted to e1 (the restarted e0 is stale: no traffic)
        assert {cs[-1].engine_id for cs in s.chunks} == {"e1"}
        wait_until(lambda: not _running(pid0), 30, "the killed actor's node process to exit (PDEATHSIG)")

        # Ray restarts the actor: a new incarnation, stale until synced
        def e0_back():
            e = c.health()["engines"].get("e0")
            return e if e and e["incarnation"] != es["e0"]["incarnation"] and e["state"] == "stale" else None

        e0 = wait_until(e0_back, 60, "Ray to restart e0 (stale: cluster weight version 1)", interval=0.2)
        assert e0["weight_version"] == 0 and not e0["healthy"]
        assert rc.engine_pid(0) != pid0
        assert c.sync_stale(policy.named_parameters())["e0"]["weight_version"] == 1
        wait_until(lambda: c.health()["engines"]["e0"]["healthy"], 10, "e0 to serve again")
        rs = c.generate([[4, 5, 6]] * 8, {"max_tokens": 4})
        assert {r.engine_id for r in rs} == {"e0", "e1"} and {v for r in rs for v in r.token_versions} == {1}
    finally:
        rc.shutdown()
    assert rc.leftovers() == []


@pytest.mark.timeout(120)
def test_colocated_on_a_trainer_placement_group_and_crash_restart(local_ray):
    """SkyRL-style: the trainer made the placement group (one GPU per bundle)
    and its workers hold half of each bundle's GPU and its CPU; one tp=2 engine
    shares both bundles (0.2 of each GPU, no CPU) and its node process sees
    both GPUs. A crashed node process takes its actor down and Ray restarts
    both. The trainer's group outlives the cluster."""
    pg = placement_group([{"CPU": 1, "GPU": 1}] * 2, strategy="PACK")
    assert pg.wait(timeout_seconds=30)

    @ray.remote(num_cpus=1, num_gpus=0.5)
    class Trainer:
        def where(self) -> tuple[str, list]:
            return ray.get_runtime_context().get_placement_group_id(), ray.get_gpu_ids()

    trainers = [
        Trainer.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
        ).remote()
        for b in (0, 1)
    ]
    placed = ray.get([t.where.remote() for t in trainers], timeout=30)
    assert [p for p, _ in placed] == [pg.id.hex()] * 2
    trainer_gpus = ",".join(str(g) for _, ids in placed for g in ids)
    rc = RayCluster.start(
        1,
        tp=2,
        use_gpu=True,
        backend="torch",
        host="127.0.0.1",
        placement_group=pg,
        bundle_indices=[[0, 1]],
        heartbeat_interval_s=0.2,
        ready_timeout_s=90,
    )
    try:
        where = ray.get(rc.engines[0].placement.remote(), timeout=30)
        assert where["placement_group"] == pg.id.hex()
        assert where["resources"] == {"GPU": 0.2}, where  # a share of the trainer's GPU, no CPU
        assert where["cuda_visible_devices"] == trainer_gpus  # the GPUs of both bundles, shared with the trainer
        assert sorted(trainer_gpus.split(",")) == sorted(MASK)  # the node's own names, not renumbered
        c = rc.client(timeout_s=60)
        inc = c.engines()[0]["incarnation"]
        pid = rc.engine_pid(0)
        os.kill(pid, signal.SIGKILL)  # the node process crashes; its actor exits; Ray restarts it

        def back():
            es = c.engines()
            return es and es[0]["incarnation"] != inc and es[0]["healthy"]

        wait_until(back, 60, "Ray to restart the crashed engine", interval=0.2)
        assert c.generate([4, 5, 6], {"max_tokens": 3}).engine_id == "e0"
    finally:
        rc.shutdown()
    assert rc.leftovers() == []
    assert placement_group_table(pg)["state"] == "CREATED"  # the caller's group is left alone
    for t in trainers:
        ray.kill(t)
    remove_placement_group(pg)


def test_plan_own_and_given_placement_groups():
    own = plan_engines(2, tp=2, use_gpu=True, cpus_per_engine=1)
    assert own.own_bundles == [{"CPU": 1.0, "GPU": 2.0}] * 2
    assert [(e.engine_id, e.bundles, e.num_gpus, e.probe_gpus) for e in own.engines] == [
        ("e0", (0,), 2.0, False),
        ("e1", (1,), 2.0, False),
    ]
    given = plan_engines(2, tp=2, use_gpu=True, given_bundle_count=4)  # SkyRL: one GPU per bundle, in order
    assert given.own_bundles is None
    assert [(e.bundles, e.num_cpus, e.num_gpus, e.probe_gpus) for e in given.engines] == [
        ((0, 1), 0.0, 0.2, True),
        ((2, 3), 0.0, 0.2, True),
    ]
    cpu = plan_engines(1, given_bundle_count=2, bundle_indices=[1])
    assert cpu.engines[0].bundles == (1,) and cpu.engines[0].num_gpus == 0.0


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"num_engines": 0}, "num_engines"),
        ({"tp": 0}, "tp"),
        ({"bundle_indices": [[0]]}, "bundle_indices"),  # without a placement group
        ({"given_bundle_count": 2, "tp": 2, "use_gpu": True}, "bundle_indices"),  # 2 engines × 2 GPUs > 2 bundles
        ({"given_bundle_count": 4, "tp": 2, "use_gpu": True, "bundle_indices": [[0, 1], [1, 2]]}, "bundle_indices"),
        ({"given_bundle_count": 4, "bundle_indices": [[0]]}, "bundle_indices"),  # one entry for two engines
        ({"given_bundle_count": 2, "use_gpu": True, "gpu_share": 1.5}, "gpu_share"),
        ({"cpus_per_engine": 0}, "cpus_per_engine"),
    ],
)
def test_plan_rejects_bad_layouts_naming_the_field(kw, field):
    kw = {"num_engines": 2, **kw}
    with pytest.raises(BadRequest) as ei:
        plan_engines(kw.pop("num_engines"), **kw)
    assert ei.value.field == field


@pytest.mark.timeout(90)
def test_an_engine_that_cannot_start_is_reported_not_waited_for(local_ray):
    """A node process that exits at start (no such model) takes its actor down
    each life; once max_restarts are used up, start() raises EngineDead naming
    the engine long before ready_timeout_s, and leaves nothing behind."""
    t0 = time.monotonic()
    with pytest.raises(EngineDead, match=r"\['e0'\]"):
        RayCluster.start(1, model="/nonexistent/model", host="127.0.0.1", max_restarts=0, ready_timeout_s=80)
    assert time.monotonic() - t0 < 60
    wait_until(lambda: not [p for p in _ray_or_marked() if _marked(p)], 20, "the failed cluster's processes to exit")


@pytest.mark.timeout(120)
def test_engine_processes_see_the_gpus_ray_gave_through_the_nodes_mask(local_ray):
    """Issue 33 §1 on Ray: one GPU bundle per engine; each node process's own
    environment holds the GPU Ray assigned its actor, named as the raylet's
    mask names it (a UUID here), two engines on two different GPUs."""
    rc = RayCluster.start(
        2, use_gpu=True, backend="null", model="null", host="127.0.0.1", heartbeat_interval_s=0.2, ready_timeout_s=90
    )
    try:
        seen = [psutil.Process(rc.engine_pid(i)).environ().get("CUDA_VISIBLE_DEVICES") for i in range(2)]
        assert sorted(seen) == sorted(MASK), seen
        where = ray.get([e.placement.remote() for e in rc.engines], timeout=30)
        assert [w["cuda_visible_devices"] for w in where] == seen  # what placement() reports is what they see
    finally:
        rc.shutdown()
    assert rc.leftovers() == []


def test_launch_ray_with_curve_places_each_nodes_keys_and_serves(tmp_path):
    """Issue 33 §4: `launch.py --ray --curve` (refused on main): the key folder
    is made on the driver, each actor writes the part its node needs onto its
    node (ray/keys), the head and engine run CURVE on TCP, the launcher's
    client gets in with its key, and the placed copies go with the actors."""
    keys = str(tmp_path / "keys")
    before = _ray_or_marked()
    p = subprocess.run(
        [sys.executable, "launch.py", "--ray", "local", "--host", "127.0.0.1", "--port", "0", "--engines", "1",
         "--curve", "--curve-dir", keys, "--once"],
        cwd=ROOT, env=child_env(ROLLOUT_BUS_LOG_LEVEL="WARNING"), capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^e0\s+tcp://127\.0\.0\.1:\d+\s+torch\s+\S+\s+healthy", p.stdout, re.M), p.stdout
    assert os.path.exists(os.path.join(keys, "head.key_secret")), "the key folder was made on the driver"
    wait_until(lambda: not (_ray_or_marked() - before), 20, "launch.py --ray's processes to exit")
    import glob
    import tempfile

    assert not glob.glob(os.path.join(tempfile.gettempdir(), "rbus-ray-*", "keys-*")), "a placed key folder stayed"


def test_ray_keys_give_each_role_its_part_privately(tmp_path):
    from bus.auth import KeyDir
    from trainer_bridge.ray.keys import key_files, place_keys, with_curve_dir

    KeyDir(str(tmp_path / "k")).init()
    head, engine = key_files(str(tmp_path / "k"), "head"), key_files(str(tmp_path / "k"), "engine")
    assert "head.key_secret" in head and "engines/engine.key" in head and "clients/default.key" in head
    assert set(engine) == {"head.key", "clients/default.key", "engines/engine.key", "engines/engine.key_secret"}
    assert not any(k.startswith("clients/") and k.endswith("_secret") for k in (*head, *engine)), "no client secret"
    folder = place_keys(engine, str(tmp_path / "placed"))
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert all(os.stat(os.path.join(folder, k)).st_mode & 0o777 == 0o600 for k in engine)
    assert KeyDir(folder).engine().secret  # bus.auth reads the placed copy as a key folder
    assert with_curve_dir(["--curve-dir", "/x", "--seed", "0"], folder) == ["--curve-dir", folder, "--seed", "0"]
    with pytest.raises(ValueError, match="not inside"):
        place_keys({"../evil.key": "x"}, str(tmp_path / "bad"))
