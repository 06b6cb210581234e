"""The vLLM worker's per-update CPU work (issue 21 §2): what the engine-side
write costs in Python around the copy, for a 7B-shaped layout, on CPU.

The real worker extension (engine_node/backends/vllm/worker_ext.py) on a fake
CPU worker whose model is tests/vllm_like.py's vLLM-shaped stand-in with 28
layers: the 339 checkpoint tensors and the fused qkv_proj / gate_up_proj of a
Qwen2-7B, at small dims, so the copies are tiny and what is timed is the
bookkeeping (keys, validation, source views, launches). Three ways, each a
steady state after the plan was learned (updates 2..N of the same layout):

  zero_copy  rollout_bus_apply_ipc with keep_maps (the trainer's zero-copy
             cuda_ipc: one bucket per tensor, the same handles every update)
  nccl       rollout_bus_commit after rollout_bus_recv_nccl into the kept
             staging (the receive is timed apart: its broadcast is a stand-in)
  packed     rollout_bus_apply_ipc without keep_maps (new maps every update:
             nothing can be kept)

and `replay` (the plan's copies alone, through the worker's own kept replay
when there is one) for the floor of this layout on this CPU. Medians of --reps,
wall (perf_counter) and process CPU time; --profile prints cProfile's top
functions of the zero-copy update. The copies run on CPU here: the GPU side of
the same write is bench/gpu/plan_copy.py.

    python -m bench.worker_write [--reps 300] [--layers 28] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from bus.tensors import pack_bucket, plan_buckets
from engine_node.backends.vllm import worker_ipc
from engine_node.backends.vllm.worker_ext import RolloutBusWorkerExtension
from tests import vllm_like


class _Worker(RolloutBusWorkerExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.device = torch.device("cpu")
        self.model = model
        self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)


class _Comm:  # stands in for PyNcclCommunicator: broadcast() fills from `pending`
    rank = 1

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def broadcast(self, buf: torch.Tensor, src: int) -> None:
        buf.copy_(self.pending.pop(0))


def _metas(named: list[tuple[str, torch.Tensor]]) -> tuple[list[list[Any]], list[int]]:
    """One tensor per bucket, as trainer_bridge.transports.cuda_ipc.plan_zero_copy lays them out."""
    metas = [
        [n, str(t.dtype).removeprefix("torch."), list(t.shape), i, 0, t.numel() * t.element_size()]
        for i, (n, t) in enumerate(named)
    ]
    return metas, [m[5] for m in metas]


def _fresh_metas(metas: list[list[Any]]) -> list[list[Any]]:
    """What an RPC hands the worker: new lists every call."""
    return [[m[0], m[1], list(m[2]), m[3], m[4], m[5]] for m in metas]


def _timed(fn: Callable[[int], Any], reps: int) -> dict[str, float]:
    """fn(k) for k = -5..-1 (warm-up), then 0..reps-1 timed."""
    for k in range(-5, 0):
        fn(-1 - k)
    walls, cpus = [], []
    for k in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn(k)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return {
        "wall_ms": round(statistics.median(walls) * 1e3, 3),
        "cpu_ms": round(statistics.median(cpus) * 1e3, 3),
        "wall_min_ms": round(min(walls) * 1e3, 3),
    }


def run(reps: int, layers: int, profile: bool) -> dict[str, Any]:
    vllm_like.Cfg.layers = layers
    torch.set_num_threads(1)
    params = {n: t.clone().contiguous() for n, t in vllm_like.checkpoint(vllm_like.VllmLikeModel(seed=5), seed=1)}
    named = list(params.items())
    metas, sizes = _metas(named)
    handles = [n.encode() for n, _ in named]
    worker_ipc.open_ipc_handle = lambda h, dev: params[h.decode()].reshape(-1).view(torch.uint8)  # type: ignore[assignment]
    out: dict[str, Any] = {"tensors": len(named), "layers": layers, "reps": reps}

    w = _Worker(vllm_like.VllmLikeModel(seed=5))

    # what each RPC would hand the worker (new lists), made before the clock runs
    pool = [(_fresh_metas(metas), list(sizes), list(handles)) for _ in range(reps + 5)]

    def zero_copy(k: int) -> Any:
        m, s, h = pool[k] if -5 <= k < reps else (_fresh_metas(metas), list(sizes), list(handles))
        return w.rollout_bus_apply_ipc(f"z{k}", m, s, h, {"keep_maps": True})

    out["zero_copy_first_path"] = zero_copy(10**6)["path"]
    out["zero_copy"] = _timed(zero_copy, reps)
    last = zero_copy(10**6 + 1)
    out["zero_copy_last"] = {k: last.get(k) for k in ("path", "views_reused", "maps_kept", "copy_s")}
    kept = w._rb().get("kept")
    replay = kept.replay.run if kept is not None else None
    if replay is None:  # a tree without the worker's kept replay: the plan's own apply
        plan = next(iter(w._rb()["plans"].values()))
        srcs = plan.sources(dict(named))

        def replay() -> int:
            return plan.apply(srcs=srcs)

    out["replay"] = _timed(lambda k: replay(), reps)
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for k in range(100):
            zero_copy(2 * 10**6 + k)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)

    wn = _Worker(vllm_like.VllmLikeModel(seed=5))
    comm = _Comm()
    st = wn._rb()

    def joined(a: dict[str, Any], make: Any = None) -> dict[str, Any]:
        st.update(nccl=comm, nccl_key="g")
        return {"rank": 1, "reused": True}

    wn._rb_nccl = joined  # type: ignore[method-assign]
    flat = [params[n].reshape(-1).view(torch.uint8) for n, _ in named]

    def nccl_recv(k: int) -> Any:
        comm.pending = list(flat)
        return wn.rollout_bus_recv_nccl(f"n{k}", {}, _fresh_metas(metas), list(sizes))

    def nccl_commit(k: int) -> Any:
        return wn.rollout_bus_commit(f"n{k}")

    nccl_recv(10**6)
    out["nccl_first_path"] = nccl_commit(10**6)["path"]
    recv_t, commit_t = [], []
    for k in range(reps + 5):
        t0 = time.perf_counter()
        nccl_recv(k)
        t1 = time.perf_counter()
        nccl_commit(k)
        if k >= 5:
            recv_t.append(t1 - t0)
            commit_t.append(time.perf_counter() - t1)
    out["nccl_recv_wall_ms"] = round(statistics.median(recv_t) * 1e3, 3)
    out["nccl_commit_wall_ms"] = round(statistics.median(commit_t) * 1e3, 3)

    # packed: ~60 buckets, as the trainer's packed cuda_ipc sends 7B (256 MiB each)
    pmetas_t, psizes, ptensors = plan_buckets(named, sum(sizes) // 60)
    pmetas = [[m.name, m.dtype, list(m.shape), m.bucket, m.offset, m.nbytes] for m in pmetas_t]
    pbufs = {f"p/{i}": pack_bucket(i, pmetas_t, psizes, ptensors) for i in range(len(psizes))}
    phandles = [f"p/{i}".encode() for i in range(len(psizes))]
    out["packed_buckets"] = len(psizes)
    wp = _Worker(vllm_like.VllmLikeModel(seed=5))

    def packed(k: int) -> Any:
        # new maps every update (a fresh view per open, as cudaIpcOpenMemHandle gives)
        worker_ipc.open_ipc_handle = lambda h, dev: pbufs[h.decode()][:]  # type: ignore[assignment]
        return wp.rollout_bus_apply_ipc(f"p{k}", _fresh_metas(pmetas), list(psizes), list(phandles), {})

    packed(10**6)
    out["packed"] = _timed(packed, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=28, help="28: Qwen2-7B's 339 tensors; 24: the 0.5B's 290")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = run(a.reps, a.layers, a.profile)
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
