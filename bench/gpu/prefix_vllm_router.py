"""The vllm-router arm of bench/gpu/prefix_placement.py (issue 24 §2).

Two vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``,
one per GPU, as bench/gpu/paths.py starts one) behind one ``vllm-router``
process per policy (``cache_aware``, vllm-router's default and its
prefix-aware policy, with its default knobs: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5; ``consistent_hash`` /
``power_of_two`` as references). All routers front the SAME two servers: a
rep gives every arm its own system prompt, so no arm hits another's cache.
The workload goes as ``POST /v1/completions`` with token-id prompts
(``prompt: [ids]``, ``max_tokens``, ``temperature``, ``ignore_eos``), no
session header (GRPO samples are separate requests).

Counted per rep from each server's ``/metrics`` (before/after):
``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (prompt
tokens found cached / looked up) and ``vllm:request_success_total`` (requests
per server). vLLM's completion ids do not name the server, so on the GPU the
placement of single requests (split prompts, the ideal-cache estimate) is n/a;
``bench.http_peer`` (the CPU dry run's servers) puts its port in the id.

``--cpu``: two ``bench.http_peer --prefix-cache`` servers (no model; their
``/metrics`` counts what an unbounded prefix cache would hit) stand in for
the api_servers, so the router, the driver and the scraping run for real.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from bench import harness as H
from bench import peer_side as PS
from bench.gpu import common as G
from bench.gpu import paths as GP

POLICIES = ("cache_aware", "consistent_hash", "power_of_two", "round_robin", "random")
COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "requests": "vllm:request_success_total",
}


def check_policies(policies: list[str]) -> None:
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"--vllm-router: unknown policy {bad} (vllm-router 0.1.17 has {list(POLICIES)})")


def missing(cpu: bool) -> str | None:
    """Why the arm cannot run here (None: it can)."""
    why = PS.vllm_router_missing()
    if why or cpu:
        return why
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (the api_servers need it)"
    return None


# ---------------------------------------------------------------- servers


def server_argv(spec: dict[str, Any], port: int) -> list[str]:
    """bench/gpu/paths.py's api_server command line (--disable-uvicorn-access-log),
    with the same engine arguments the rollout-bus engines get."""
    engine = {"gpu_memory_utilization": spec["gpu_fraction"], "max_model_len": spec["max_model_len"]}
    return GP.server_argv({"model": spec["model"], "engine": {**engine, **spec.get("engine", {})}}, port)


def peer_argv(port: int) -> list[str]:
    return [sys.executable, "-m", "bench.http_peer", "--port", str(port), "--prefix-cache"]


async def start_servers(procs: H.Procs, session: Any, spec: dict[str, Any]) -> tuple[list[str], list[float]]:
    """Two servers (GPU: api_servers, one per entry of spec["gpus"]; --cpu:
    http_peers). Servers on different GPUs start at once; two on one GPU one
    after the other (two vLLM start-ups profiling one GPU can fail each
    other). Returns (base urls, start seconds)."""
    cpu = bool(spec.get("cpu"))
    gpus = ["cpu", "cpu"] if cpu else spec["gpus"]
    ports = H.free_ports(2)
    urls = [f"http://{H.LOOPBACK}:{p}" for p in ports]
    starts = [0.0, 0.0]

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        name = f"vr_server{i}-{ports[i]}"
        env = None if cpu else G.child_env({"CUDA_VISIBLE_DEVICES": gpus[i]})
        argv = peer_argv(ports[i]) if cpu else server_argv(spec, ports[i])
        proc = procs.start(name, argv, env=env)
        await GP.wait_http_ready(
            session, urls[i], proc, spec["ready_timeout_s"], procs.log_dir / f"{name}.log", f"server {urls[i]}"
        )
        starts[i] = round(time.perf_counter() - t0, 1)

    if gpus[0] != gpus[1] or cpu:
        await asyncio.gather(one(0), one(1))
    else:
        await one(0)
        await one(1)
    return urls, starts


def start_routers(procs: H.Procs, urls: list[str], policies: list[str]) -> dict[str, str]:
    """One vllm-router per policy in front of the same servers: {policy: url}."""
    # vllm-router's worker probes go to the api_servers, already up: a short start deadline is enough
    return {pol: PS.start_vllm_router(procs, urls, pol, tag="vr", startup_s=60.0)[0] for pol in policies}


# ---------------------------------------------------------------- metrics


def parse_counters(text: str) -> dict[str, float]:
    """COUNTERS summed over their label sets, from Prometheus text."""
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = names.get(name)
        if key is not None:
            try:
                out[key] += float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return out


async def scrape(session: Any, urls: list[str]) -> dict[str, dict[str, float]]:
    async def one(u: str) -> dict[str, float]:
        async with session.get(f"{u}/metrics") as r:
            return parse_counters(await r.text())

    got = await asyncio.gather(*(one(u) for u in urls))
    return {f"s{i}": c for i, c in enumerate(got)}


# ---------------------------------------------------------------- the arm


class VrArm:
    """One router policy as a bench arm: `send(reqs, params)` -> per request
    (server or None, generated tokens) or the exception; `counters()`."""

    def __init__(self, session: Any, url: str, servers: list[str], model: str, timeout_s: float) -> None:
        self.session = session
        self.url = url + "/v1/completions"
        self.servers = servers
        self.by_port = {u.rsplit(":", 1)[1]: f"s{i}" for i, u in enumerate(servers)}
        self.model = model
        self.timeout_s = timeout_s

    async def _one(self, prompt: list[int], params: dict[str, Any]) -> tuple[str | None, int]:
        body = {"model": self.model, "prompt": prompt, **params}
        doc = await asyncio.wait_for(self._post(body), self.timeout_s)  # --request-timeout-s
        rid = str(doc.get("id", ""))  # http_peer: cmpl-PORT-N; vLLM: cmpl-<uuid> (no server in it)
        parts = rid.split("-")
        server = self.by_port.get(parts[1]) if len(parts) == 3 else None
        return server, int(doc["usage"]["completion_tokens"])

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            doc: dict[str, Any] = await r.json()
            return doc

    async def send(self, reqs: list[tuple[int, list[int]]], params: dict[str, Any]) -> list[Any]:
        return await asyncio.gather(*(self._one(p, params) for _, p in reqs), return_exceptions=True)

    async def counters(self) -> dict[str, dict[str, float]]:
        return await scrape(self.session, self.servers)

    async def extra(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        """The session is the phase's (shared by every router arm)."""


def make_session() -> Any:
    import aiohttp

    # 512 requests at once: no client-side pool limit (the router and the servers queue)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


def env_note() -> dict[str, Any]:
    return {"vllm_router": PS.vllm_router_missing() or "on PATH", "cpu_affinity": sorted(os.sched_getaffinity(0))}
