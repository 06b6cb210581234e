"""The arms of bench/gpu/scale_out.py: N engines behind one front, each arm
with the same interface (`send(prompts, params)` → tokens per request or the
exception; `first_tokens(prompts, params)` → seconds to each first token;
`close()`), started one after another (the others idle) by `start_arm`.

- rollout-bus: `launch.py --engines N --gpus …` (one vLLM engine node per GPU;
  --cpu: torch or null engines), driven by the product's AsyncClient, as a
  batch (`generate` of the whole list, what `Client.generate` sends) or one
  `stream` per request; `--policy` least_loaded (default) or prefix.
- vLLM's own data parallelism over HTTP: `vllm serve --data-parallel-size N`
  (its internal load balancer), driven with aiohttp like bench.gpu.throughput.
- vllm-router over N `vllm serve` servers, one per GPU.
- AsyncLLM with data_parallel_size=N in the driver's process (DPLBAsyncMPClient
  in vLLM 0.24: N engine-core processes behind one in-process front).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import paths as PT
from bench.gpu import prefix_vllm_router as VR

Result = int | BaseException  # tokens a request got, or why it failed


class RbArm:
    """A launch.py cluster; `stream` False: one batch call for the whole list."""

    def __init__(self, cluster: G.RbCluster, stream: bool, timeout_s: float) -> None:
        from trainer_bridge import AsyncClient

        self.cluster = cluster
        self.stream = stream
        self.timeout_s = timeout_s
        self.ac = AsyncClient(cluster.address, timeout_s=timeout_s, control_timeout_s=60)

    async def _streamed(self, prompt: list[int], params: dict[str, Any], first: list[float] | None) -> int:
        t0 = time.perf_counter()
        got, fin = 0, None
        async for ch in self.ac.stream(prompt, params, timeout_s=self.timeout_s):
            if ch.token_ids and got == 0 and first is not None:
                first.append(time.perf_counter() - t0)
            got += len(ch.token_ids)
            fin = ch.finish_reason or fin
        if fin is None:
            raise RuntimeError(f"stream ended without a finish after {got} tokens")
        return got

    async def send(self, prompts: list[list[int]], params: dict[str, Any]) -> list[Result]:
        if not self.stream:
            try:
                res = await self.ac.generate(prompts, params, timeout_s=self.timeout_s)
            except Exception as e:  # the batch failed as one: every request of it counts as failed
                return [e] * len(prompts)
            if not isinstance(res, list):  # a list of prompts always comes back as a list
                raise TypeError(f"batch of {len(prompts)} came back as {type(res).__name__}")
            return [len(r.token_ids) for r in res]
        return await asyncio.gather(*(self._streamed(p, params, None) for p in prompts), return_exceptions=True)

    async def first_tokens(self, prompts: list[list[int]], params: dict[str, Any]) -> list[float]:
        first: list[float] = []
        await asyncio.gather(*(self._streamed(p, params, first) for p in prompts), return_exceptions=True)
        return first

    async def close(self) -> None:
        await self.ac.close()


class HttpArm:
    """An OpenAI completions front (vllm serve -dp N, or vllm-router) over aiohttp."""

    def __init__(self, session: Any, base: str, model: str) -> None:
        self.s, self.base, self.model = session, base, model

    def _body(self, p: list[int], params: dict[str, Any], stream: bool) -> dict[str, Any]:
        return {"model": self.model, "prompt": p, "max_tokens": params["max_tokens"], "stream": stream,
                "temperature": params.get("temperature", 1.0), "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip

    async def _one(self, p: list[int], params: dict[str, Any]) -> int:
        async with self.s.post(f"{self.base}/v1/completions", json=self._body(p, params, False)) as r:
            data = json.loads(await r.read())
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {str(data)[:200]}")
        c = data["choices"][0]
        return len(c["token_ids"]) if c.get("token_ids") is not None else int(data["usage"]["completion_tokens"])

    async def send(self, prompts: list[list[int]], params: dict[str, Any]) -> list[Result]:
        return await asyncio.gather(*(self._one(p, params) for p in prompts), return_exceptions=True)

    async def _first(self, p: list[int], params: dict[str, Any]) -> float:
        t = time.perf_counter()
        async with self.s.post(f"{self.base}/v1/completions", json=self._body(p, params, True)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            first = None
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    c = json.loads(line[6:])["choices"]
                    if c and (c[0].get("token_ids") or c[0].get("text")):
                        first = time.perf_counter() - t
        if first is None:
            raise RuntimeError("the stream ended without a token")
        return first

    async def first_tokens(self, prompts: list[list[int]], params: dict[str, Any]) -> list[float]:
        res = await asyncio.gather(*(self._first(p, params) for p in prompts), return_exceptions=True)
        return [x for x in res if isinstance(x, float)]

    async def close(self) -> None:
        return None


class AsyncLlmArm:
    """vLLM's AsyncLLM in this process with data_parallel_size=N."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._n = 0

    async def _one(self, p: list[int], params: dict[str, Any], first: list[float] | None) -> int:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._n += 1
        sp = SamplingParams(max_tokens=params["max_tokens"], temperature=params.get("temperature", 1.0),
                            ignore_eos=True, output_kind=RequestOutputKind.DELTA)  # fmt: skip
        t0, got, done = time.perf_counter(), 0, False
        async for out in self.engine.generate({"prompt_token_ids": p}, sp, f"s{self._n}"):
            n = len(out.outputs[0].token_ids)
            if n and got == 0 and first is not None:
                first.append(time.perf_counter() - t0)
            got += n
            done = out.finished
        if not done:
            raise RuntimeError(f"AsyncLLM request ended unfinished after {got} tokens")
        return got

    async def send(self, prompts: list[list[int]], params: dict[str, Any]) -> list[Result]:
        return await asyncio.gather(*(self._one(p, params, None) for p in prompts), return_exceptions=True)

    async def first_tokens(self, prompts: list[list[int]], params: dict[str, Any]) -> list[float]:
        first: list[float] = []
        await asyncio.gather(*(self._one(p, params, first) for p in prompts), return_exceptions=True)
        return first

    async def close(self) -> None:
        self.engine.shutdown()


# ---------------------------------------------------------------- starting


def gpu_list(spec: dict[str, Any]) -> list[str]:
    """--gpus of launch.py for N engines: indices 0..N-1 of what this job sees."""
    return [str(g) for g in range(spec["engines"])]


def gpu_ids(spec: dict[str, Any]) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of this job's first N GPUs, through an
    inherited mask (launcher.config.visible_gpus: a job given GPUs 4-7 uses 4-7)."""
    import os

    from launcher.config import visible_gpus  # lazy: the launcher's mapping, only where vLLM servers start

    seen, _ = visible_gpus(os.environ, lambda: spec["engines"])
    if len(seen) < spec["engines"]:
        raise RuntimeError(f"{spec['engines']} engines need {spec['engines']} GPUs; this job sees {seen}")
    return seen[: spec["engines"]]


def rb_cluster(spec: dict[str, Any], policy: str, stack: contextlib.ExitStack) -> G.RbCluster:
    """launch.py with N engines, one per GPU (--gpus 0..N-1 of what this job
    sees), started at once; the phase's stack ends it."""
    cpu = bool(spec.get("cpu"))
    options = dict(spec.get("cpu_options") or {}) if cpu else dict(spec.get("engine_args") or {})
    cl = G.RbCluster(
        spec["model"], spec["cpu_backend"] if cpu else "vllm", engines=spec["engines"],
        gpus=None if cpu else ",".join(gpu_list(spec)),
        gpu_memory_utilization=None if cpu else spec["gpu_fraction"],
        max_model_len=None if cpu else spec["max_model_len"], backend_options=options,
        ready_timeout_s=spec["ready_timeout_s"], log_dir=Path(spec["log_dir"]),
        log_level=spec.get("log_level", "WARNING"), extra_args=["--policy", policy, "--max-restarts", "5"],
    )  # fmt: skip
    with contextlib.ExitStack() as mine:
        mine.enter_context(cl)
        cl.wait_ready()
        stack.push(mine.pop_all())
    return cl


def vllm_flags(spec: dict[str, Any]) -> list[str]:
    """The engine flags every vLLM arm gets (the rollout-bus engines get the same as backend options)."""
    out = ["--gpu-memory-utilization", str(spec["gpu_fraction"]), "--max-model-len", str(spec["max_model_len"])]
    for k, v in (spec.get("engine_args") or {}).items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


async def start_dp_server(procs: H.Procs, session: Any, spec: dict[str, Any]) -> str:
    """`vllm serve --data-parallel-size N` on this job's first N GPUs."""
    import sys

    port = H.free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", spec["model"], "--host", H.LOOPBACK,
            "--port", str(port), "--disable-uvicorn-access-log", "--data-parallel-size", str(spec["engines"]),
            *vllm_flags(spec)]  # fmt: skip
    name = f"vllm-dp{spec['engines']}-{port}"
    proc = procs.start(name, argv, env=G.child_env({"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids(spec))}))
    base = f"http://{H.LOOPBACK}:{port}"
    await PT.wait_http_ready(session, base, proc, spec["ready_timeout_s"], procs.log_dir / f"{name}.log", name)
    return base


async def start_routers_over_servers(
    procs: H.Procs, session: Any, spec: dict[str, Any], policies: list[str]
) -> dict[str, str]:
    """N `vllm serve` servers (one per GPU, started at once) behind one
    vllm-router per policy: {policy: url}."""
    vspec = {**spec, "engine": spec.get("engine_args") or {}}
    ports = H.free_ports(spec["engines"])
    urls = [f"http://{H.LOOPBACK}:{p}" for p in ports]

    async def one(gpu: str, port: int, url: str) -> None:
        name = f"so_server{gpu}-{port}"
        proc = procs.start(name, VR.server_argv(vspec, port), env=G.child_env({"CUDA_VISIBLE_DEVICES": gpu}))
        await PT.wait_http_ready(session, url, proc, spec["ready_timeout_s"], procs.log_dir / f"{name}.log", name)

    await asyncio.gather(*(one(g, p, u) for g, p, u in zip(gpu_ids(spec), ports, urls, strict=True)))
    return VR.start_routers(procs, urls, policies)


def start_asyncllm(spec: dict[str, Any]) -> AsyncLlmArm:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kw = {"gpu_memory_utilization": spec["gpu_fraction"], "max_model_len": spec["max_model_len"],
          **(spec.get("engine_args") or {})}  # fmt: skip
    args = AsyncEngineArgs(model=spec["model"], data_parallel_size=spec["engines"], **kw)
    return AsyncLlmArm(AsyncLLM.from_engine_args(args))
