"""`launch.py --ray`: the head and engines as Ray actors (trainer_bridge/ray/cluster.py)."""

from __future__ import annotations

import argparse
import signal
import sys
import time

import structlog

from launcher.config import engine_backend_options
from launcher.local import ensure_curve_keys
from launcher.output import print_table, run_demo
from trainer_bridge.ray.cluster import RayCluster

log = structlog.get_logger("launch")


def run_on_ray(a: argparse.Namespace) -> int:
    """--ray: the head and engines as Ray actors (trainer_bridge/ray/cluster.py).
    Ray places, restarts (engine actors, up to --max-restarts) and tears down;
    ZeroMQ carries requests and control as with any launch."""
    try:
        import ray
    except ImportError:
        print(
            'launch.py --ray needs the ray extra, which is not installed: pip install -e ".[ray]" (ray==2.60.0)',
            file=sys.stderr,
        )
        return 2

    local = a.ray == "local"
    host = a.host if local or a.host != "127.0.0.1" else None  # None: each node's IP
    if local:  # rollout-bus moves nothing through Ray's object store: keep it small
        loopback = "127.0.0.1" if a.host == "127.0.0.1" else None  # no traffic off this machine
        ray.init(include_dashboard=False, object_store_memory=128 * 1024 * 1024, _node_ip_address=loopback)
    else:
        ray.init(address=a.ray)
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        backend = a.backend if a.backend != "auto" else ("vllm" if gpus else "torch")
        n = a.engines if a.engines is not None else (gpus // a.tp if backend == "vllm" else 2)
        if a.gpus:  # Ray assigns each engine actor its GPUs (mapped through the raylet's own mask)
            raise SystemExit(
                "--ray with --gpus: Ray places the GPUs; start each Ray node with the GPUs it may use "
                "(CUDA_VISIBLE_DEVICES=… ray start … --num-gpus N)"
            )
        # --curve: the key folder on this (the driver's) machine, made when missing; each
        # actor writes the part its node needs onto its node (trainer_bridge/ray/keys.py)
        curve_dir = ensure_curve_keys(a)
        with RayCluster.start(
            n, tp=a.tp, backend=backend, model=a.model, host=host, port=a.port,
            backend_options=engine_backend_options(a, backend), heartbeat_interval_s=a.heartbeat_interval_s,
            seed=a.seed, policy=a.policy, curve_dir=curve_dir, max_restarts=a.max_restarts,
            ready_timeout_s=a.ready_timeout_s,
            engine_id_prefix=a.engine_id_prefix or "e",
        ) as rc:  # fmt: skip
            client = rc.client(timeout_s=120, control_timeout_s=30, client_key=a.client_key)
            print_table(client.engines(), rc.frontend, backend, curve_dir=curve_dir, client_key=a.client_key)
            print(f"on Ray ({a.ray}): {n} engine actor(s), Ray restarts each up to {a.max_restarts} times", flush=True)
            if a.demo:
                run_demo(client)
            if a.once:
                return 0
            print("serving; Ctrl-C to stop", flush=True)
            while not stop:  # Ray restarts engines; a dead head stops everything, as in _run
                if "head" in rc.dead(timeout_s=1.0):
                    log.error("head_died")
                    return 1
                time.sleep(1.0)
            return 0
    finally:
        ray.shutdown()
