"""Placement on a Ray cluster: the head and N engine nodes as Ray actors.

    import ray
    from trainer_bridge.ray_cluster import RayCluster

    ray.init()                                   # or the trainer's own cluster
    with RayCluster.start(2, backend="torch") as rc:
        client = rc.client()
        client.generate([4, 5, 6], {"max_tokens": 8})
        rc.kill_engine(0)                        # Ray restarts the actor; the head fails over

Ray only *places, starts, restarts and tears down* processes here; ZeroMQ stays
the data and control plane. Each actor owns one child process running the same
entry point launch.py starts (`python -m router_node`, `python -m engine_node`),
so an engine placed this way registers, heartbeats and fails over exactly as a
launched one. Why a child process and not a thread in the actor:

- signals: the node entry points install SIGTERM/SIGINT handlers, which only the
  main thread of a process may do, and Ray's worker owns its main thread's signals;
- sockets: ZeroMQ contexts and the engine's own subprocesses (vLLM's EngineCore)
  must not live inside a Ray worker that Ray may kill or fork around;
- GPUs: Ray sets CUDA_VISIBLE_DEVICES in the actor from its GPU bundle(s); the
  child inherits it (or, for tp over per-GPU bundles, gets the ids the bundles hold).

Ownership and hazards:

- The child is spawned from a dedicated "owner" thread that lives as long as the
  actor process: the child dies with its parent through PR_SET_PDEATHSIG
  (bus.runtime), which fires when the *thread* that forked it exits, so the child
  must not be spawned from a short-lived thread.
- A child that exits on its own (a crash) takes its actor down (`os._exit`), so Ray's
  `max_restarts` restarts it: the restarted actor starts a new child, a new
  incarnation, which the head treats as a restart (its in-flight requests are
  re-submitted elsewhere; it is STALE until synced when weights were committed).
- Killing the actor (`kill_engine`, or Ray losing it) SIGKILLs the child through
  PDEATHSIG (ROLLOUT_BUS_PDEATHSIG=SIGKILL): the engine dies as a crashed one does,
  the head re-submits its requests elsewhere, and nothing drains while Ray already
  starts the replacement. `shutdown` is the graceful path (SIGTERM, drain, grace).
  A restarted actor also ends whatever its previous life left (a pid file on the
  node) before it starts a new child, so two lives of one engine never share a GPU.
- Every child carries ROLLOUT_BUS_RAY_CLUSTER=<cluster id> in its environment, so
  `leftovers()` finds anything re-parented away from the actor.

The colocated (SkyRL-style) layout: pass the trainer's placement group and the
bundles each engine shares (`bundle_indices`, `tp` per engine); engine actors
then take a fraction of each bundle's GPU (`gpu_share`, default 0.2) and no CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
import uuid
from collections.abc import Sequence
from typing import Any

import psutil
import structlog

from bus.errors import BadRequest, EngineDead, RequestTimeout
from trainer_bridge.client import Client

log = structlog.get_logger("ray_cluster")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_ENV = "ROLLOUT_BUS_RAY_CLUSTER"  # marks every child process of one RayCluster
COLOCATED_GPU_SHARE = 0.2  # SkyRL's fraction for an engine sharing a trainer's GPU bundle


# ---------------------------------------------------------------- planning (no I/O)


@dataclasses.dataclass(frozen=True)
class EnginePlacement:
    """Where one engine actor goes and what it asks Ray for."""

    engine_id: str
    bundles: tuple[int, ...]  # bundle indices; the actor sits on bundles[0]
    num_cpus: float
    num_gpus: float  # on bundles[0]
    probe_gpus: bool  # tp over several per-GPU bundles: look their GPU ids up first


@dataclasses.dataclass(frozen=True)
class Plan:
    own_bundles: list[dict[str, float]] | None  # the placement group to create; None: the caller's
    engines: list[EnginePlacement]


def plan_engines(
    num_engines: int,
    *,
    tp: int = 1,
    use_gpu: bool = False,
    prefix: str = "e",
    given_bundle_count: int | None = None,
    bundle_indices: Sequence[Sequence[int] | int] | None = None,
    gpu_share: float | None = None,
    cpus_per_engine: float | None = None,
) -> Plan:
    """Bundles and resources for `num_engines` engines of `tp` GPUs each.

    Own placement group (`given_bundle_count` None): one bundle per engine holding
    its `tp` GPUs (`use_gpu`) and `cpus_per_engine` CPUs (default 1); the actor takes
    the whole bundle. A given placement group (the trainer's, colocated): engine i
    shares bundles `bundle_indices[i]` (default: i*tp … i*tp+tp-1), one GPU each, of
    which it takes `gpu_share` (default 0.2) and `cpus_per_engine` CPUs (default 0)."""
    if num_engines < 1:
        raise BadRequest(f"num_engines must be >= 1, got {num_engines}", field="num_engines")
    if tp < 1:
        raise BadRequest(f"tp must be >= 1, got {tp}", field="tp")
    if given_bundle_count is None:
        if bundle_indices is not None:
            raise BadRequest("bundle_indices needs a placement_group", field="bundle_indices")
        cpus = 1.0 if cpus_per_engine is None else float(cpus_per_engine)
        bundle: dict[str, float] = {"CPU": cpus} if cpus > 0 else {}
        if use_gpu:
            bundle["GPU"] = float(tp)
        if not bundle:
            raise BadRequest("an engine's bundle needs a CPU or a GPU", field="cpus_per_engine")
        engines = [
            EnginePlacement(f"{prefix}{i}", (i,), cpus, float(tp) if use_gpu else 0.0, False)
            for i in range(num_engines)
        ]
        return Plan([dict(bundle) for _ in range(num_engines)], engines)

    share = COLOCATED_GPU_SHARE if gpu_share is None else float(gpu_share)
    if use_gpu and not 0 < share <= 1:
        raise BadRequest(f"gpu_share must be in (0, 1], got {share}", field="gpu_share")
    cpus = 0.0 if cpus_per_engine is None else float(cpus_per_engine)
    if bundle_indices is None:
        groups = [tuple(range(i * tp, (i + 1) * tp)) for i in range(num_engines)]
    else:
        groups = [(b,) if isinstance(b, int) else tuple(b) for b in bundle_indices]
    if len(groups) != num_engines:
        raise BadRequest(
            f"bundle_indices has {len(groups)} entries for {num_engines} engine(s)", field="bundle_indices"
        )
    seen: set[int] = set()
    for g in groups:
        if not g or (use_gpu and len(g) != tp):
            raise BadRequest(
                f"each engine needs {tp if use_gpu else 'at least 1'} bundle(s) (one GPU each), got {list(g)}",
                field="bundle_indices",
            )
        bad = [b for b in g if not 0 <= b < given_bundle_count]
        if bad:
            raise BadRequest(
                f"bundle index {bad[0]} is outside the placement group's {given_bundle_count} bundles",
                field="bundle_indices",
            )
        if use_gpu and seen & set(g):
            raise BadRequest(f"bundles {sorted(seen & set(g))} are given to two engines", field="bundle_indices")
        seen |= set(g)
    engines = [
        EnginePlacement(f"{prefix}{i}", g, cpus, share if use_gpu else 0.0, use_gpu and len(g) > 1)
        for i, g in enumerate(groups)
    ]
    return Plan(None, engines)


# ---------------------------------------------------------------- inside the actors


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class _ProcessOwner:
    """One child process owned by a Ray actor (see the module doc for why).

    `pidfile` remembers the child across actor restarts: a restarted actor first
    ends the child its previous life left behind (already signalled by
    PDEATHSIG, maybe not yet gone)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], pidfile: str, grace_s: float) -> None:
        self.name = name
        self.pidfile = pidfile
        self.proc_env = env
        self._stopping = threading.Event()
        _end_previous_life(pidfile, grace_s)
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
        return _node_ip()

    def placement(self) -> dict[str, Any]:
        """Where Ray put this actor: placement group id (hex or None), assigned
        resources (e.g. {"GPU": 0.2}) and the GPUs its node process sees
        (None: Ray's own CUDA_VISIBLE_DEVICES for the actor, inherited)."""
        import ray

        ctx = ray.get_runtime_context()
        pg = ctx.get_placement_group_id()
        return {
            "placement_group": pg,
            "resources": ctx.get_assigned_resources(),
            "cuda_visible_devices": self.proc_env.get("CUDA_VISIBLE_DEVICES"),
        }

    def stop(self, grace_s: float) -> list[int]:
        """SIGTERM → grace → SIGKILL the child's tree; the pids that needed SIGKILL."""
        from bus.proctree import terminate_tree

        self._stopping.set()
        killed = terminate_tree(self.proc, grace_s)
        with contextlib.suppress(OSError):
            os.remove(self.pidfile)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.pidfile))  # the last one out removes the run dir
        return killed


def _end_previous_life(pidfile: str, grace_s: float) -> None:
    try:
        with open(pidfile) as f:
            prev = json.load(f)
        p = psutil.Process(int(prev["pid"]))
        if abs(p.create_time() - float(prev["create_time"])) > 0.01:
            return  # the pid was reused by someone else
    except (OSError, ValueError, KeyError, psutil.Error):
        return
    from bus.proctree import terminate_tree

    log.warning("ray_ending_previous_life", pidfile=pidfile, pid=p.pid)
    terminate_tree(p, grace_s)


def _child_env(cluster_id: str, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[CLUSTER_ENV] = cluster_id
    env["ROLLOUT_BUS_PDEATHSIG"] = "SIGKILL"  # the actor died: the node dies as if crashed
    env.update(extra)
    return env


def _run_dir(cluster_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"rbus-ray-{cluster_id}")


class HeadActor(_ProcessOwner):
    """`python -m router_node` bound on this node (any free ports unless `port`)."""

    def __init__(self, cluster_id: str, host: str | None, port: int, args: list[str], env: dict[str, str]) -> None:
        self.host = host or _node_ip()
        bind = self.host
        self.advertise = _node_ip() if bind in ("0.0.0.0", "*") else bind
        run = _run_dir(cluster_id)
        os.makedirs(run, exist_ok=True)
        self.ready_file = os.path.join(run, "head.json")
        with contextlib.suppress(OSError):
            os.remove(self.ready_file)  # a restarted head must not read its last life's file
        argv = [
            sys.executable, "-m", "router_node",
            "--frontend", f"tcp://{bind}:{port or '*'}", "--events", f"tcp://{bind}:*", "--control", f"tcp://{bind}:*",
            "--ready-file", self.ready_file, *args,
        ]  # fmt: skip
        super().__init__("head", argv, _child_env(cluster_id, env), os.path.join(run, "head.pid"), 10.0)

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


class EngineActor(_ProcessOwner):
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
    ) -> None:
        bind = host or _node_ip()
        advertise = _node_ip() if bind in ("0.0.0.0", "*") else bind
        if model is None:  # the tiny model, built on this node (not the driver's path)
            from engine_node.tiny_model import ensure_tiny_model

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
        pidfile = os.path.join(_run_dir(cluster_id), f"{engine_id}.pid")
        super().__init__(engine_id, argv, _child_env(cluster_id, extra), pidfile, 15.0)


def _gpu_ids() -> tuple[str, list[str]]:
    """(node id, GPU ids) of the bundle this task was placed on."""
    import ray

    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


# ---------------------------------------------------------------- the driver side


class RayCluster:
    """A head and engine nodes placed as Ray actors; `start` makes one."""

    def __init__(
        self,
        *,
        cluster_id: str,
        head: Any,
        engines: list[Any],
        plan: Plan,
        addresses: dict[str, str],
        pg: Any,
        own_pg: bool,
        own_ray: bool,
        curve_dir: str | None,
    ) -> None:
        self.cluster_id = cluster_id
        self.head = head
        self.engines = engines  # Ray actor handles, engine i ↔ plan.engines[i]
        self.plan = plan
        self.addresses = addresses
        self.frontend = addresses["frontend"]
        self.placement_group = pg
        self._own_pg = own_pg
        self._own_ray = own_ray
        self.curve_dir = curve_dir
        self._clients: list[Client] = []
        self._closed = False
        self._saved_hooks: tuple[Any, ...] = ()

    @property
    def engine_ids(self) -> list[str]:
        return [e.engine_id for e in self.plan.engines]

    @classmethod
    def start(
        cls,
        num_engines: int = 2,
        *,
        tp: int = 1,
        backend: str = "torch",
        model: str | None = None,
        placement_group: Any = None,
        bundle_indices: Sequence[Sequence[int] | int] | None = None,
        use_gpu: bool | None = None,
        gpu_share: float | None = None,
        cpus_per_engine: float | None = None,
        strategy: str = "PACK",
        host: str | None = None,
        port: int = 0,
        engine_id_prefix: str = "e",
        backend_options: dict[str, Any] | None = None,
        heartbeat_interval_s: float = 0.5,
        seed: int = 0,
        policy: str = "least_loaded",
        curve_dir: str | None = None,
        router_args: Sequence[str] = (),
        engine_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        max_restarts: int = 3,
        ready_timeout_s: float = 300.0,
        address: str | None = None,
    ) -> RayCluster:
        """Place a head and `num_engines` engines of `tp` GPUs each, wait until
        every engine is healthy (deadline `ready_timeout_s`) and return the cluster.

        `placement_group` + `bundle_indices`: share the trainer's bundles (colocated,
        see `plan_engines`); without one a placement group is made (`strategy`) and
        removed at shutdown. `model` None: the tiny test model, built on each node
        (torch backend). `host`: the address the head and engines bind and advertise
        (default: each node's IP). `max_restarts`: Ray restarts of each engine actor.
        Ray is initialised (`address`) when it is not yet; then `shutdown` ends it."""
        import ray
        from ray.util.placement_group import placement_group as make_pg
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        use_gpu = backend == "vllm" if use_gpu is None else use_gpu
        if model is None and backend != "torch" and ":" not in backend:
            raise BadRequest(f"model is required with the {backend} backend", field="model")
        plan = plan_engines(
            num_engines,
            tp=tp,
            use_gpu=use_gpu,
            prefix=engine_id_prefix,
            given_bundle_count=None if placement_group is None else placement_group.bundle_count,
            bundle_indices=bundle_indices,
            gpu_share=gpu_share,
            cpus_per_engine=cpus_per_engine,
        )
        own_ray = not ray.is_initialized()
        saved = _process_hooks()
        if own_ray:
            ray.init(address=address)
        cluster_id = uuid.uuid4().hex[:10]
        extra_env = {"ROLLOUT_BUS_LOG_LEVEL": os.environ.get("ROLLOUT_BUS_LOG_LEVEL", "INFO"), **(env or {})}
        common = ["--heartbeat-interval-s", str(heartbeat_interval_s)]
        if curve_dir:
            common += ["--curve-dir", curve_dir]
        opts = dict(backend_options or {})
        if backend == "vllm":
            opts.setdefault("tp", tp)
        if backend == "torch":  # OpenMP spin-waits: an engine uses the CPUs it was given
            opts.setdefault("threads", max(1, int(plan.engines[0].num_cpus or 1)))
        pg = placement_group
        rc: RayCluster | None = None
        head: Any = None
        engines: list[Any] = []
        try:
            if plan.own_bundles is not None:
                pg = make_pg(plan.own_bundles, strategy=strategy, name=f"rollout-bus-{cluster_id}")
            if not pg.wait(timeout_seconds=ready_timeout_s):
                raise RequestTimeout(
                    f"placement group {pg.bundle_specs} not placed after ready_timeout_s={ready_timeout_s}",
                    field="ready_timeout_s",
                )
            # The head goes next to the driver (the trainer), off any bundle.
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
            head = (
                ray.remote(HeadActor)
                .options(num_cpus=0, max_restarts=0, scheduling_strategy=here, name=f"rollout-bus-head-{cluster_id}")
                .remote(
                    cluster_id, host, port, ["--policy", policy, "--seed", str(seed), *common, *router_args], extra_env
                )
            )
            addrs: dict[str, str] = ray.get(head.addresses.remote(ready_timeout_s), timeout=ready_timeout_s + 30)
            cvd = _probe_gpus(plan, pg, ready_timeout_s)
            for i, ep in enumerate(plan.engines):
                engines.append(
                    ray.remote(EngineActor)
                    .options(
                        num_cpus=ep.num_cpus,
                        num_gpus=ep.num_gpus,
                        max_restarts=max_restarts,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            pg, placement_group_bundle_index=ep.bundles[0]
                        ),
                        name=f"rollout-bus-{ep.engine_id}-{cluster_id}",
                    )
                    .remote(
                        cluster_id,
                        ep.engine_id,
                        addrs,
                        host,
                        backend,
                        model,
                        opts,
                        [*common, "--seed", str(seed), *engine_args],
                        extra_env,
                        cvd[i],
                    )  # fmt: skip
                )
            ray.get([e.pid.remote() for e in engines], timeout=ready_timeout_s)
            rc = cls(
                cluster_id=cluster_id,
                head=head,
                engines=engines,
                plan=plan,
                addresses=addrs,
                pg=pg,
                own_pg=plan.own_bundles is not None,
                own_ray=own_ray,
                curve_dir=curve_dir,
            )
            rc._saved_hooks = saved
            rc.wait_ready(num_engines, ready_timeout_s)
            log.info("ray_cluster_ready", cluster_id=cluster_id, frontend=rc.frontend, engines=rc.engine_ids)
            return rc
        except BaseException:
            if rc is not None:
                rc.shutdown()
            else:  # nothing to hand back: end what was started here
                _kill_all([*engines, *([head] if head is not None else [])], 10.0)
                if plan.own_bundles is not None and pg is not None:
                    with contextlib.suppress(Exception):
                        ray.util.remove_placement_group(pg)
                if own_ray:
                    ray.shutdown()
                    _restore_hooks(saved)
            raise

    # ---- use

    def client(self, **kw: Any) -> Client:
        """A Client on the head's frontend (closed with the cluster)."""
        kw.setdefault("curve_dir", self.curve_dir)
        c = Client(self.frontend, **kw)
        self._clients.append(c)
        return c

    def wait_ready(self, num_engines: int | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        """Health once `num_engines` (default: all) engines are healthy (deadline:
        timeout_s). An actor dead for good (its restarts used up: a node process
        that cannot start) or a dead head raises EngineDead at once, not at the deadline."""
        want = len(self.engines) if num_engines is None else num_engines
        deadline = time.monotonic() + timeout_s
        with Client(self.frontend, curve_dir=self.curve_dir, timeout_s=30, control_timeout_s=30) as c:
            while True:
                h = c.health()
                if sum(1 for e in h["engines"].values() if e["healthy"]) >= want:
                    return h
                dead = self.dead(timeout_s=0.5)
                if dead:
                    raise EngineDead(
                        f"Ray actor(s) {dead} died before the cluster was ready (restarts used up: "
                        "their node process exits at start; its log went to the driver and Ray's worker logs)"
                    )
                if time.monotonic() > deadline:
                    raise RequestTimeout(
                        f"fewer than {want} healthy engine(s) after timeout_s={timeout_s}: {h}", field="timeout_s"
                    )

    def dead(self, timeout_s: float = 1.0) -> list[str]:
        """Actors (engine ids, "head") that Ray reports dead for good; a restarting one is not."""
        import ray
        from ray.exceptions import RayActorError

        def failing(actors: dict[str, Any]) -> dict[str, Any]:
            refs = {name: a.pid.remote() for name, a in actors.items()}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
            out = {}
            for name, ref in refs.items():
                if ref in ready:
                    try:
                        ray.get(ref)
                    except RayActorError:
                        out[name] = actors[name]
            return out

        # A call in flight when an actor dies fails even if Ray restarts it; a
        # call to a restarting actor waits for the new life. So: failing twice = dead.
        first = failing({"head": self.head, **dict(zip(self.engine_ids, self.engines, strict=True))})
        return sorted(failing(first)) if first else []

    def engine_pid(self, i: int, timeout_s: float = 60.0) -> int:
        """The pid of engine i's node process (on its Ray node)."""
        import ray

        return ray.get(self.engines[i].pid.remote(), timeout=timeout_s)

    def kill_engine(self, i: int, *, restart: bool = True) -> None:
        """Kill engine i's actor (its node process gets SIGKILL through PDEATHSIG);
        with `restart` Ray restarts it (bounded by max_restarts) as a new incarnation."""
        import ray

        ray.kill(self.engines[i], no_restart=not restart)

    def leftovers(self) -> list[psutil.Process]:
        """Processes on this machine still carrying this cluster's mark (none after shutdown)."""
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.environ().get(CLUSTER_ENV) == self.cluster_id:
                    out.append(p)
        return out

    # ---- teardown

    def shutdown(self, grace_s: float = 10.0) -> None:
        """End the engines, then the head (SIGTERM → grace → SIGKILL, inside each
        actor), kill the actors, remove the placement group made by `start`, and
        end Ray if `start` initialised it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        import ray

        for c in self._clients:
            c.close()
        self._clients.clear()
        _kill_all(self.engines, grace_s)
        _kill_all([self.head], grace_s)
        if self._own_pg:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.placement_group)
        shutil.rmtree(_run_dir(self.cluster_id), ignore_errors=True)  # single-node leftovers only
        if self._own_ray:
            ray.shutdown()
            _restore_hooks(self._saved_hooks)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _process_hooks() -> tuple[Any, ...]:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), sys.excepthook


def _restore_hooks(saved: tuple[Any, ...]) -> None:
    """ray.init() installs a SIGTERM handler and an excepthook in the driver and
    ray.shutdown() leaves them: put the process's own back."""
    if not saved:
        return
    term, intr, hook = saved
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, intr)
    sys.excepthook = hook


def _kill_all(actors: list[Any], grace_s: float) -> None:
    """Stop each actor's child (in parallel, with a deadline), then kill the actors for good."""
    import ray

    refs = []
    for a in actors:
        with contextlib.suppress(Exception):
            refs.append(a.stop.remote(grace_s))
    if refs:
        # A dead or restarting actor answers with an error or not at all: its
        # child already got SIGKILL through PDEATHSIG.
        ray.wait(refs, num_returns=len(refs), timeout=grace_s + 15)
    for a in actors:
        with contextlib.suppress(Exception):
            ray.kill(a, no_restart=True)


def _probe_gpus(plan: Plan, pg: Any, timeout_s: float) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES per engine: the GPU ids of its bundles, for engines
    spread over several per-GPU bundles; None (Ray's own setting) otherwise."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    out: list[str | None] = []
    probe = ray.remote(_gpu_ids)
    for ep in plan.engines:
        if not ep.probe_gpus:
            out.append(None)
            continue
        refs = [
            probe.options(
                num_cpus=0,
                num_gpus=ep.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            ).remote()
            for b in ep.bundles
        ]
        found = ray.get(refs, timeout=timeout_s)
        nodes = {n for n, _ in found}
        if len(nodes) != 1:
            raise BadRequest(
                f"engine {ep.engine_id}'s bundles {list(ep.bundles)} are on {len(nodes)} nodes; tp runs on one",
                field="bundle_indices",
            )
        out.append(",".join(g for _, ids in found for g in ids[:1]))
    return out
