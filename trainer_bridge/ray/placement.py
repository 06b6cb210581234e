"""Where a RayCluster's engines go: bundles and resources per engine (planned
without I/O), and for tp over several per-GPU bundles the GPU ids those
bundles hold (probed with one tiny Ray task per bundle)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from bus.errors import BadRequest

COLOCATED_GPU_SHARE = 0.2  # SkyRL's fraction for an engine sharing a trainer's GPU bundle


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


def bundle_gpu_ids() -> tuple[str, list[str]]:
    """(node id, GPU ids) of the bundle this task was placed on."""
    import ray  # the optional ray extra

    return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]


def probe_gpus(plan: Plan, pg: Any, timeout_s: float) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES per engine: the GPU ids of its bundles, for engines
    spread over several per-GPU bundles; None (Ray's own setting) otherwise."""
    import ray  # the optional ray extra: imported where it is used
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    out: list[str | None] = []
    probe = ray.remote(bundle_gpu_ids)
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
