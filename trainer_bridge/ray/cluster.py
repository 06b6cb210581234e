"""Placement on a Ray cluster: the head and N engine nodes as Ray actors.

    import ray
    from trainer_bridge.ray.cluster import RayCluster

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
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psutil
import structlog

from bus.errors import BadRequest, EngineDead, RequestTimeout
from trainer_bridge.client import Client
from trainer_bridge.ray.actors import CLUSTER_ENV, EngineActor, HeadActor, run_dir
from trainer_bridge.ray.keys import key_files
from trainer_bridge.ray.placement import EnginePlacement, Plan, plan_engines, probe_gpus

log = structlog.get_logger("ray_cluster")


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
        ship_keys: bool = True,
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
        `curve_dir`: the key folder here; `ship_keys`: each actor places its node's part (ray/keys.py).
        Ray is initialised (`address`) when it is not yet; then `shutdown` ends it."""
        import ray  # the optional ray extra: imported where it is used

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
        keys = {role: key_files(curve_dir, role) for role in ("head", "engine")} if curve_dir and ship_keys else {}
        nodes = _NodeArgs(
            env=extra_env,
            head=["--policy", policy, "--seed", str(seed), *common, *router_args],
            engine=[*common, "--seed", str(seed), *engine_args],
            options=_engine_options(backend, backend_options, tp, plan),
            backend=backend,
            model=model,
            host=host,
            keys=keys,
        )
        return cls._place(
            plan, nodes, cluster_id, placement_group, strategy, port, max_restarts, ready_timeout_s, own_ray, saved,
            curve_dir,
        )  # fmt: skip

    @classmethod
    def _place(
        cls,
        plan: Plan,
        nodes: _NodeArgs,
        cluster_id: str,
        placement_group: Any,
        strategy: str,
        port: int,
        max_restarts: int,
        ready_timeout_s: float,
        own_ray: bool,
        saved: tuple[Any, ...],
        curve_dir: str | None,
    ) -> RayCluster:
        """`start`'s second half: the placement group, the head, the engines, readiness.
        A failure ends whatever was started here (and Ray, if `start` initialised it)."""
        import ray  # the optional ray extra
        from ray.util.placement_group import placement_group as make_pg

        pg = placement_group
        rc: RayCluster | None = None
        actors = _Started()
        try:
            if plan.own_bundles is not None:
                pg = make_pg(plan.own_bundles, strategy=strategy, name=f"rollout-bus-{cluster_id}")
            if not pg.wait(timeout_seconds=ready_timeout_s):
                raise RequestTimeout(
                    f"placement group {pg.bundle_specs} not placed after ready_timeout_s={ready_timeout_s}",
                    field="ready_timeout_s",
                )
            actors.head = _start_head_actor(cluster_id, nodes.host, port, nodes.head, nodes.env, nodes.keys.get("head"))
            addrs: dict[str, str] = ray.get(actors.head.addresses.remote(ready_timeout_s), timeout=ready_timeout_s + 30)
            cvd = probe_gpus(plan, pg, ready_timeout_s)
            for i, ep in enumerate(plan.engines):
                actors.engines.append(_start_engine_actor(pg, ep, max_restarts, cluster_id, addrs, nodes, cvd[i]))
            ray.get([e.pid.remote() for e in actors.engines], timeout=ready_timeout_s)
            rc = cls(
                cluster_id=cluster_id,
                head=actors.head,
                engines=actors.engines,
                plan=plan,
                addresses=addrs,
                pg=pg,
                own_pg=plan.own_bundles is not None,
                own_ray=own_ray,
                curve_dir=curve_dir,
            )
            rc._saved_hooks = saved
            rc.wait_ready(len(plan.engines), ready_timeout_s)
            log.info("ray_cluster_ready", cluster_id=cluster_id, frontend=rc.frontend, engines=rc.engine_ids)
            return rc
        except BaseException:
            if rc is not None:
                rc.shutdown()
            else:  # nothing to hand back: end what was started here
                actors.abandon(pg if plan.own_bundles is not None else None, own_ray, saved)
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
        shutil.rmtree(run_dir(self.cluster_id), ignore_errors=True)  # single-node leftovers only
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


@dataclasses.dataclass(frozen=True)
class _NodeArgs:
    """What `start` hands every node process: env, argv tails, the engines' backend."""

    env: dict[str, str]
    head: list[str]  # the head's argv after its addresses
    engine: list[str]  # each engine's argv after its backend options
    options: dict[str, Any]  # --backend-options
    backend: str
    model: str | None
    host: str | None
    keys: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # role -> key files (ray/keys)


@dataclasses.dataclass
class _Started:
    """The actors `RayCluster.start` made so far: what a failed start ends."""

    head: Any = None
    engines: list[Any] = dataclasses.field(default_factory=list)

    def abandon(self, own_pg: Any, own_ray: bool, saved_hooks: tuple[Any, ...]) -> None:
        """Kill the actors, remove the placement group `start` made (own_pg) and
        end Ray if `start` initialised it."""
        import ray  # the optional ray extra

        _kill_all([*self.engines, *([self.head] if self.head is not None else [])], 10.0)
        if own_pg is not None:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(own_pg)
        if own_ray:
            ray.shutdown()
            _restore_hooks(saved_hooks)


def _engine_options(backend: str, backend_options: dict[str, Any] | None, tp: int, plan: Plan) -> dict[str, Any]:
    opts = dict(backend_options or {})
    if backend == "vllm":
        opts.setdefault("tp", tp)
    if backend == "torch":  # OpenMP spin-waits: an engine uses the CPUs it was given
        opts.setdefault("threads", max(1, int(plan.engines[0].num_cpus or 1)))
    return opts


def _start_head_actor(
    cluster_id: str, host: str | None, port: int, args: list[str], env: dict[str, str], keys: dict[str, str] | None
) -> Any:
    """The head goes next to the driver (the trainer), off any bundle."""
    import ray  # the optional ray extra
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return (
        ray.remote(HeadActor)
        .options(num_cpus=0, max_restarts=0, scheduling_strategy=here, name=f"rollout-bus-head-{cluster_id}")
        .remote(cluster_id, host, port, args, env, keys)
    )


def _start_engine_actor(
    pg: Any,
    ep: EnginePlacement,
    max_restarts: int,
    cluster_id: str,
    addrs: dict[str, str],
    nodes: _NodeArgs,
    cuda_visible_devices: str | None,
) -> Any:
    """Engine `ep` on its first bundle; Ray restarts it up to `max_restarts` times."""
    import ray  # the optional ray extra
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return (
        ray.remote(EngineActor)
        .options(
            num_cpus=ep.num_cpus,
            num_gpus=ep.num_gpus,
            max_restarts=max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=ep.bundles[0]),
            name=f"rollout-bus-{ep.engine_id}-{cluster_id}",
        )
        .remote(
            cluster_id,
            ep.engine_id,
            addrs,
            nodes.host,
            nodes.backend,
            nodes.model,
            nodes.options,
            nodes.engine,
            nodes.env,
            cuda_visible_devices,
            nodes.keys.get("engine"),
        )  # fmt: skip
    )
