"""The rollout-bus side of the comparisons: a head (router_node) and K engine
nodes started as real processes, and load drivers over trainer_bridge.

How this side is driven: one asyncio process using
``trainer_bridge.AsyncClient`` (one zmq DEALER, the product's own client; every
chunk decoded into a StreamChunk), C worker tasks pulling from one queue of N
requests — the same shape as the aiohttp driver of ``bench.peer_side``.
"Direct" means the same client connected straight to one engine node's data
socket (no head on the path); "router" means connected to the head's frontend.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench import harness as H
from bus import roles
from bus.auth import TOKEN_FILE_ENV, find_token, new_token, write_token
from bus.codec import split_chunks
from bus.frames import pack_tokens, token_count


@dataclass
class Cluster:
    frontend: str
    engines: dict[str, str]  # engine id -> data address
    router_pid: int
    engine_pids: dict[str, int]
    procs: H.Procs


def bench_token(procs: H.Procs) -> list[str]:
    """The bench run's join token (one per run, as launch.py makes one per
    cluster): the flag for the head and engines. Clients of this process
    find it through $ROLLOUT_BUS_TOKEN_FILE (make_client, RawDriver): every
    socket authenticates its peer at the handshake (bus/roles.py)."""
    path = procs.log_dir / "bench.token"
    procs.log_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        write_token(str(path), new_token())
    os.environ[TOKEN_FILE_ENV] = str(path)
    return ["--token-file", str(path)]


def start_cluster(
    procs: H.Procs,
    k: int,
    *,
    backend: str = "null",
    model: str = "null",
    backend_options: dict[str, Any] | None = None,
    policy: str = "least_loaded",
    tag: str = "rb",
    startup_s: float = 120.0,
    router_args: list[str] | None = None,
    heartbeat_interval_s: float = 0.5,
    log_level: str = "WARNING",
) -> Cluster:
    """Head + k engine nodes on loopback TCP; returns once all k are healthy."""
    env = {"ROLLOUT_BUS_LOG_LEVEL": log_level}
    fe, ev, ctl = H.free_ports(3)
    ready = procs.log_dir / f"{tag}_router_ready.json"
    procs.log_dir.mkdir(parents=True, exist_ok=True)
    ready.unlink(missing_ok=True)
    token = bench_token(procs)
    router = procs.start(
        f"{tag}_router",
        [
            sys.executable,
            "-m",
            "router_node",
            "--frontend",
            f"tcp://{H.LOOPBACK}:{fe}",
            "--events",
            f"tcp://{H.LOOPBACK}:{ev}",
            "--control",
            f"tcp://{H.LOOPBACK}:{ctl}",
            "--policy",
            policy,
            "--heartbeat-interval-s",
            str(heartbeat_interval_s),
            "--ready-file",
            str(ready),
            *token,
            *(router_args or []),
        ],
        env=env,
    )
    H.wait_port(fe, 60, proc=router)
    data_ports = H.free_ports(2 * k)
    engines: dict[str, str] = {}
    pids: dict[str, int] = {}
    for i in range(k):
        eid = f"{tag}-e{i}"
        data = f"tcp://{H.LOOPBACK}:{data_ports[2 * i]}"
        p = procs.start(
            f"{tag}_engine{i}",
            [
                sys.executable,
                "-m",
                "engine_node",
                "--engine-id",
                eid,
                "--head-events",
                f"tcp://{H.LOOPBACK}:{ev}",
                "--head-control",
                f"tcp://{H.LOOPBACK}:{ctl}",
                "--data-address",
                data,
                "--weight-address",
                f"tcp://{H.LOOPBACK}:{data_ports[2 * i + 1]}",
                "--backend",
                backend,
                "--model",
                model,
                "--backend-options",
                json.dumps(backend_options or {}),
                "--heartbeat-interval-s",
                str(heartbeat_interval_s),
                "--advertise-host",
                H.LOOPBACK,
                *token,
                "--direct-clients",  # the "direct" setups send straight to an engine
            ],
            env=env,
        )
        engines[eid] = data
        pids[eid] = p.pid
    return Cluster(f"tcp://{H.LOOPBACK}:{fe}", engines, router.pid, pids, procs)


async def wait_healthy(client: Any, k: int, timeout_s: float, procs: H.Procs | None = None) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < end:
        try:
            h = await asyncio.wait_for(client.health(), 5)
            last = h
            if sum(1 for e in h["engines"].values() if e.get("healthy")) >= k:
                return h
        except Exception as e:
            last = e
        if procs is not None:
            dead = [n for n, p in procs.procs if p.poll() is not None]
            if dead:
                logs = "\n".join(procs.log_tail(n, 15) for n in dead)
                raise RuntimeError(f"process(es) exited during startup: {dead}\n{logs}")
        await asyncio.sleep(0.1)
    raise TimeoutError(f"fewer than {k} healthy engines after {timeout_s}s: {last}")


def make_client(address: str, timeout_s: float = 120.0) -> Any:
    from trainer_bridge import AsyncClient

    return AsyncClient(address, timeout_s=timeout_s, control_timeout_s=60.0)


@dataclass
class RbLoad:
    n: int
    concurrency: int
    max_tokens: int
    stream: bool
    prompt: list[int]
    sessions: int = 0  # >0: session_id = "traj-{i % sessions}"
    per_request_timeout_s: float = 60.0
    record_stream_lag: bool = False  # keep received_at - emitted_at per chunk


async def rb_load(client: Any, spec: RbLoad) -> H.RunResult:
    """N requests at concurrency C through `client` (trainer_bridge.AsyncClient)."""
    from bus.protocol import SamplingParams

    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    lags: list[float] = []

    async def request(i: int) -> tuple[int, float | None, bool]:
        sid = f"traj-{i % spec.sessions}" if spec.sessions else None
        if not spec.stream:
            res = await client.generate(spec.prompt, params, session_id=sid, timeout_s=spec.per_request_timeout_s)
            return len(res.token_ids), time.perf_counter(), bool(res.finish_reason)
        got, first, finished = 0, None, False
        async for ch in client.stream(spec.prompt, params, session_id=sid, timeout_s=spec.per_request_timeout_s):
            if ch.token_ids and first is None:
                first = time.perf_counter()
            got += len(ch.token_ids)
            if spec.record_stream_lag and ch.token_ids:
                lags.append(ch.received_at - ch.emitted_at)
            finished = finished or ch.finish_reason is not None
        return got, first, finished

    return await H.run_load(
        spec.n, spec.concurrency, request, expected_tokens=spec.max_tokens, timeout_s=spec.per_request_timeout_s,
        stream=spec.stream, lags=lags if spec.record_stream_lag else None,
    )  # fmt: skip


# ------------------------------------------------------- raw zmq driver


class RawDriver:
    """A minimal wire-protocol client owned by the benchmark: one plain zmq
    DEALER read through ``loop.add_reader`` on its FD (drained without
    per-message futures), Generate frames built with ``bus.codec``, every
    Chunk/Error decoded with msgspec and its token frame counted. It exists to
    measure the router and engine without trainer_bridge's own per-chunk cost
    (the rollout-bus twin of a lean HTTP client: bench.http_lean.LeanHttp, which
    is what it is compared with; never aiohttp). Not a product API."""

    def __init__(self, address: str) -> None:
        import zmq

        from bus.codec import Codec
        from bus.endpoint import open_socket

        self._zmq = zmq
        self.ctx = zmq.Context()
        found = find_token(address)  # $ROLLOUT_BUS_TOKEN_FILE (bench_token)
        plain = roles.as_role(found[0] if found else None, roles.CLIENT)
        self.sock = open_socket(self.ctx, zmq.DEALER, connect=address, plain=plain)
        self.codec = Codec()
        self.pending: dict[str, list[Any]] = {}  # rid -> [future, tokens, t_first, finish]
        self._ids = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lags: list[float] | None = None  # set to [] to record time.time() - Chunk.emitted_at

    def _ensure_reader(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.sock.fileno(), self._drain)

    def _drain(self) -> None:
        zmq = self._zmq
        sock = self.sock
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            whole, whole_bufs = self.codec.decode(frames)
            for msg, bufs in split_chunks(whole, whole_bufs):  # a Chunk or a ChunkBatch
                self._on_msg(msg, bufs)

    def _on_msg(self, msg: Any, bufs: list[Any]) -> None:
        from bus import protocol as P

        st = self.pending.get(msg.request_id)
        if st is None:
            return
        if isinstance(msg, P.Chunk):
            n = token_count(bufs[0]) if bufs else 0
            if n and st[2] is None:
                st[2] = time.perf_counter()
            st[1] += n
            if self.lags is not None and n:
                self.lags.append(time.time() - msg.emitted_at)
            if msg.finish_reason is not None:
                st[3] = msg.finish_reason
                del self.pending[msg.request_id]
                if not st[0].done():
                    st[0].set_result(None)
        elif isinstance(msg, P.Error):
            del self.pending[msg.request_id]
            if not st[0].done():
                st[0].set_exception(RuntimeError(f"{msg.code}: {msg.message}"))

    async def generate(
        self, prompt_bytes: bytes, params: Any, *, stream: bool, session_id: str | None, timeout_s: float
    ) -> tuple[int, float | None, str | None]:
        from bus import protocol as P

        self._ensure_reader()
        self._ids += 1
        rid = f"raw-{self._ids}"
        fut = self._loop.create_future()  # type: ignore[union-attr]
        st: list[Any] = [fut, 0, None, None]
        self.pending[rid] = st
        msg = P.Generate(request_id=rid, params=params, session_id=session_id, stream=stream, timeout_s=timeout_s)
        self.sock.send_multipart(self.codec.encode(msg, [prompt_bytes]))
        self._loop.call_soon(self._drain)  # type: ignore[union-attr]  # sending may eat the FD edge
        try:
            await asyncio.wait_for(fut, timeout_s + 2)
        finally:
            self.pending.pop(rid, None)
        return st[1], st[2], st[3]

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close(linger=0)
        self.ctx.term()


async def raw_load(driver: RawDriver, spec: RbLoad) -> H.RunResult:
    """Same shape as rb_load, through RawDriver."""
    from bus.protocol import SamplingParams

    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    prompt = pack_tokens(list(spec.prompt))
    driver.lags = [] if spec.record_stream_lag else None

    async def request(i: int) -> tuple[int, float | None, bool]:
        sid = f"traj-{i % spec.sessions}" if spec.sessions else None
        got, first, finish = await driver.generate(
            prompt, params, stream=spec.stream, session_id=sid, timeout_s=spec.per_request_timeout_s
        )
        return got, first, finish is not None

    return await H.run_load(
        spec.n, spec.concurrency, request, expected_tokens=spec.max_tokens, timeout_s=spec.per_request_timeout_s,
        stream=spec.stream, lags=driver.lags,
    )  # fmt: skip
