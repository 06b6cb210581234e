"""Inside a RayCluster's actors: each owns one node process (`python -m
router_node` or `python -m engine_node`), spawned from a thread that lives as
long as the actor (see trainer_bridge/ray/cluster.py for why a child process,
PDEATHSIG and the pid file across actor restarts)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import psutil
import structlog

from bus.errors import RequestTimeout
from bus.proctree import terminate_tree
from engine_node.tiny_model import ensure_tiny_model
from trainer_bridge.ray.keys import place_keys, with_curve_dir

log = structlog.get_logger("ray_cluster")

ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # the checkout, above trainer_bridge/ray/
CLUSTER_ENV = "ROLLOUT_BUS_RAY_CLUSTER"  # marks every child process of one RayCluster


def node_ip() -> str:
    import ray  # the optional ray extra: actors run inside Ray

    return ray.util.get_node_ip_address()


class ProcessOwner:
    """One child process owned by a Ray actor (see the module doc for why).

    `pidfile` remembers the child across actor restarts: a restarted actor first
    ends the child its previous life left behind (already signalled by
    PDEATHSIG, maybe not yet gone)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], pidfile: str, grace_s: float) -> None:
        self.name = name
        self.pidfile = pidfile
        self.proc_env = env
        self._stopping = threading.Event()
        end_previous_life(pidfile, grace_s)
        started: queue.Queue[subprocess.Popen | BaseException] = queue.Queue()
        # The owner thread spawns the child and lives as long as it: PDEATHSIG
        # is tied to this thread, and a child exiting on its own ends the actor.
        threading.Thread(target=self._own, args=(argv, env, started), name=f"own-{name}", daemon=True).start()
        got = started.get(timeout=60)
        if isinstance(got, BaseException):
            raise got
        self.proc: subprocess.Popen = got
        p = psutil.Process(self.proc.pid)
        os.makedirs(os.path.dirname(pidfile), exist_ok=True)
        with open(pidfile, "w") as f:
            json.dump({"pid": p.pid, "create_time": p.create_time()}, f)

    def _own(self, argv: list[str], env: dict[str, str], started: queue.Queue) -> None:
        # Ray's worker threads block SIGINT, and a child inherits its forking
        # thread's signal mask: unblock everything for the fork so the node's
        # SIGINT/SIGTERM handlers work, then restore this thread's mask.
        mask = signal.pthread_sigmask(signal.SIG_SETMASK, set())
        try:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT)
        except BaseException as e:  # reported to __init__, which raises it in the actor
            started.put(e)
            return
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        started.put(proc)
        rc = proc.wait()
        if self._stopping.is_set():
            return
        log.error("ray_child_exited", child=self.name, rc=rc)
        # Not ray.actor.exit_actor(): that is an intended exit, never restarted.
        os._exit(1)

    def pid(self) -> int:
        return self.proc.pid

    def node_ip(self) -> str:
        return node_ip()

    def placement(self) -> dict[str, Any]:
        """Where Ray put this actor: placement group id (hex or None), assigned
        resources (e.g. {"GPU": 0.2}) and the GPUs its node process sees
        (None: Ray's own CUDA_VISIBLE_DEVICES for the actor, inherited)."""
        import ray

        ctx = ray.get_runtime_context()
        pg = ctx.get_placement_group_id()
        return {
            "node_id": ctx.get_node_id(),
            "placement_group": pg,
            "resources": ctx.get_assigned_resources(),
            "cuda_visible_devices": self.proc_env.get("CUDA_VISIBLE_DEVICES"),
        }

    key_dir: str | None = None  # the CURVE keys placed on this node (ray/keys.place_keys)

    def stop(self, grace_s: float) -> list[int]:
        """SIGTERM → grace → SIGKILL the child's tree; the pids that needed SIGKILL."""
        self._stopping.set()
        killed = terminate_tree(self.proc, grace_s)
        if self.key_dir:
            shutil.rmtree(self.key_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(self.pidfile)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.pidfile))  # the last one out removes the run dir
        return killed


def end_previous_life(pidfile: str, grace_s: float) -> None:
    try:
        with open(pidfile) as f:
            prev = json.load(f)
        p = psutil.Process(int(prev["pid"]))
        if abs(p.create_time() - float(prev["create_time"])) > 0.01:
            return  # the pid was reused by someone else
    except (OSError, ValueError, KeyError, psutil.Error):
        return
    log.warning("ray_ending_previous_life", pidfile=pidfile, pid=p.pid)
    terminate_tree(p, grace_s)


def child_env(cluster_id: str, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[CLUSTER_ENV] = cluster_id
    env["ROLLOUT_BUS_PDEATHSIG"] = "SIGKILL"  # the actor died: the node dies as if crashed
    env.update(extra)
    return env


def run_dir(cluster_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"rbus-ray-{cluster_id}")


class HeadActor(ProcessOwner):
    """`python -m router_node` bound on this node (any free ports unless `port`)."""

    def __init__(
        self,
        cluster_id: str,
        host: str | None,
        port: int,
        args: list[str],
        env: dict[str, str],
        keys: dict[str, str] | None = None,
    ) -> None:
        self.host = host or node_ip()
        bind = self.host
        self.advertise = node_ip() if bind in ("0.0.0.0", "*") else bind
        run = run_dir(cluster_id)
        os.makedirs(run, exist_ok=True)
        if keys:  # --curve: the head's part of the key folder, on this node
            self.key_dir = place_keys(keys, os.path.join(run, "keys-head"))
            args = with_curve_dir(args, self.key_dir)
        self.ready_file = os.path.join(run, "head.json")
        with contextlib.suppress(OSError):
            os.remove(self.ready_file)  # a restarted head must not read its last life's file
        argv = [
            sys.executable, "-m", "router_node",
            "--frontend", f"tcp://{bind}:{port or '*'}", "--events", f"tcp://{bind}:*", "--control", f"tcp://{bind}:*",
            "--ready-file", self.ready_file, *args,
        ]  # fmt: skip
        super().__init__("head", argv, child_env(cluster_id, env), os.path.join(run, "head.pid"), 10.0)

    def stop(self, grace_s: float) -> list[int]:
        with contextlib.suppress(OSError):
            os.remove(self.ready_file)
        return super().stop(grace_s)

    def addresses(self, timeout_s: float) -> dict[str, str]:
        """The head's bound addresses, as other nodes reach them (deadline: timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the head exited with {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RequestTimeout(
                    f"the head was not ready after ready_timeout_s={timeout_s}", field="ready_timeout_s"
                )
            time.sleep(0.05)
        with open(self.ready_file) as f:
            addrs = json.load(f)
        return {k: v.replace("0.0.0.0", self.advertise) for k, v in addrs.items() if isinstance(v, str)}


class EngineActor(ProcessOwner):
    """`python -m engine_node` for one engine id, on TCP so any node reaches it."""

    def __init__(
        self,
        cluster_id: str,
        engine_id: str,
        head: dict[str, str],
        host: str | None,
        backend: str,
        model: str | None,
        options: dict[str, Any],
        args: list[str],
        env: dict[str, str],
        cuda_visible_devices: str | None,
        keys: dict[str, str] | None = None,
    ) -> None:
        bind = host or node_ip()
        if keys:  # --curve: the engine credential and allow-list, on this node
            self.key_dir = place_keys(keys, os.path.join(run_dir(cluster_id), f"keys-{engine_id}"))
            args = with_curve_dir(args, self.key_dir)
        advertise = node_ip() if bind in ("0.0.0.0", "*") else bind
        if model is None:  # the tiny model, built on this node (not the driver's path)
            model = ensure_tiny_model()
        argv = [
            sys.executable, "-m", "engine_node", "--engine-id", engine_id,
            "--head-events", head["events"], "--head-control", head["control"],
            "--data-address", f"tcp://{bind}:*", "--weight-address", f"tcp://{bind}:*",
            "--advertise-host", advertise, "--backend", backend, "--model", model,
            "--backend-options", json.dumps(options), *args,
        ]  # fmt: skip
        extra = dict(env)
        if cuda_visible_devices is not None:  # tp over per-GPU bundles: the ids they hold, in order
            extra["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        pidfile = os.path.join(run_dir(cluster_id), f"{engine_id}.pid")
        super().__init__(engine_id, argv, child_env(cluster_id, extra), pidfile, 15.0)
