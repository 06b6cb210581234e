"""The rollout-bus arms of bench/gpu/prefix_placement.py: one `launch.py`
cluster per `--policy`, two engines (one per GPU), driven by the product's
`AsyncClient`; the interface bench/gpu/prefix_vllm_router.py's VrArm has
(`send`, `counters`, `extra`, `close`)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G


def start(stack: contextlib.ExitStack, spec: dict[str, Any], pol: str, rec: dict[str, Any]) -> RbArm:
    """A rollout-bus cluster (launch.py) with --policy `pol` and two engines:
    one per GPU, started at once (`--engines 2 --gpus A,B`); on one GPU the
    second joins once the first is up (two start-ups on one GPU can fail each
    other)."""
    cpu = bool(spec.get("cpu"))
    gpus = spec["gpus"]
    options: dict[str, Any] = {} if cpu else {"log_stats": True, **spec.get("engine", {})}

    def cluster(engines: int, gpu: str | None, extra: list[str]) -> G.RbCluster:
        return G.RbCluster(
            spec["model"], spec["cpu_backend"] if cpu else "vllm", engines=engines, gpus=None if cpu else gpu,
            gpu_memory_utilization=None if cpu else spec["gpu_fraction"],
            max_model_len=None if cpu else spec["max_model_len"], backend_options=options,
            ready_timeout_s=spec["ready_timeout_s"], log_dir=Path(spec["log_dir"]), extra_args=extra,
        )  # fmt: skip

    together = gpus[0] != gpus[1]  # --cpu: engines on no GPU; --gpus 0,0 still takes the --join path
    # a cluster that fails to start is ended here, not at the phase's end: its engines hold GPU memory
    with contextlib.ExitStack() as mine:
        cl = mine.enter_context(
            cluster(2 if together else 1, ",".join(gpus) if together else gpus[0], ["--policy", pol])
        )
        starts = [cl.wait_ready()[0]]
        argv = [cl.argv[1:]]
        if not together:
            joined = mine.enter_context(
                cluster(1, gpus[1], ["--join", cl.address, "--engine-id-prefix", "b", "--advertise-host", H.LOOPBACK])
            )
            cl.engines = 2
            starts.append(cl.wait_ready()[0])
            argv.append(joined.argv[1:])
        _, engines = cl.wait_ready()
        stack.push(mine.pop_all())  # started: the phase's stack ends it
    rec.update(engine_start_s=[round(s, 1) for s in starts], launch_argv=argv,
               engines=[e.get("engine_id") for e in engines])  # fmt: skip
    return RbArm(cl.address, spec["request_timeout_s"])


class RbArm:
    """A rollout-bus cluster as a bench arm (the interface VR.VrArm has)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        from trainer_bridge import AsyncClient

        self.ac = AsyncClient(address, timeout_s=timeout_s, control_timeout_s=60)

    async def _one(self, prompt: list[int], params: dict[str, Any]) -> tuple[str, int]:
        r = await self.ac.generate(prompt, params)
        if isinstance(r, list):  # n > 1: never sent here (every sample is its own request)
            raise TypeError("expected one result per request (n=1)")
        return r.engine_id, len(r.token_ids)

    async def send(self, reqs: list[tuple[int, list[int]]], params: dict[str, Any]) -> list[Any]:
        return await asyncio.gather(*(self._one(p, params) for _, p in reqs), return_exceptions=True)

    async def counters(self) -> dict[str, dict[str, Any]]:
        from bus import protocol as P

        res = await self.ac.control(P.Stats(), strict=False, timeout_s=30)
        return {eid: dict(getattr(r, "detail", None) or {}) for eid, r in res.items()}

    async def extra(self) -> dict[str, Any]:
        return {"head_stats": (await self.ac.stats()).get("prefix")}

    async def close(self) -> None:
        await self.ac.close()
