"""The HTTP side of the comparisons: what RL frameworks (SkyRL) run today.

- K ``bench.http_peer`` servers (OpenAI-compatible, no model, answer at once);
- ``vllm-router`` (pip ``vllm-router``: a Rust router, tokio/axum/reqwest,
  launched with its ``vllm-router`` console script) in front of them, policy
  ``consistent_hash`` or ``power_of_two``;
- a load driver: one asyncio process, aiohttp ``ClientSession`` with a pooled
  keep-alive ``TCPConnector`` (connections reused across requests), C worker
  tasks pulling from one queue of N requests. Every response is fully read and
  parsed (SSE events decoded with msgspec), as a trainer would; and, beside it,
  ``bench.http_lean.LeanHttp`` (rows "(lean)"): a raw-socket reader that only
  counts tokens, the equal of the rollout-bus side's raw zmq driver.

``python -m bench.peer_side`` measures this side alone (direct to one
http_peer vs through vllm-router) and writes bench/results/peer_side.json/.png.
``bench.router_overhead`` reuses these pieces next to rollout-bus.

vllm-router notes (0.1.17, checked here): it probes ``GET /health`` on every
worker at startup and every ``--health-check-interval-secs``; power_of_two
also polls ``GET /get_load`` every 5 s (vLLM has no such route and answers
404, so does http_peer: the router then relies on its own in-flight counts);
consistent_hash keys on the ``X-Session-ID`` header (else on the request
body, i.e. the same prompt always lands on one worker) and logs every
decision at INFO, so it runs with ``--log-level warning``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from bench import harness as H
from bench import http_lean as HL

_dec = msgspec.json.Decoder()
POLICIES = ("consistent_hash", "power_of_two")


def prompt_ids(n: int = 512, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- processes


def start_http_peers(
    procs: H.Procs,
    k: int,
    *,
    tokens_per_event: int = 1,
    impl: str = "raw",
    tag: str = "peer",
    startup_s: float = 20.0,
    extra: list[str] | None = None,
) -> list[str]:
    ports = H.free_ports(k)
    started = []
    for i, port in enumerate(ports):
        p = procs.start(
            f"{tag}{i}",
            [
                sys.executable,
                "-m",
                "bench.http_peer",
                "--port",
                str(port),
                "--tokens-per-event",
                str(tokens_per_event),
                "--impl",
                impl,
                *(extra or []),
            ],
        )
        started.append((p, port))
    for p, port in started:
        H.wait_port(port, startup_s, proc=p)
    return [f"http://{H.LOOPBACK}:{port}" for _, port in started]


def vllm_router_missing() -> str | None:
    """Why the vllm-router rows cannot run here (None: they can). The benches
    then run without them and record this reason instead of failing."""
    if shutil.which("vllm-router") is None:
        return "vllm-router is not on PATH (pip install vllm-router: its Rust binary wheel, 0.1.17)"
    return None


def vllm_router_binary() -> str:
    exe = shutil.which("vllm-router")
    if exe is None:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router")
    return exe


def start_vllm_router(
    procs: H.Procs,
    worker_urls: list[str],
    policy: str,
    *,
    tag: str = "vllm_router",
    startup_s: float = 30.0,
    extra: list[str] | None = None,
) -> tuple[str, Any]:
    port, prom = H.free_ports(2)
    argv = [
        vllm_router_binary(),
        "--host",
        H.LOOPBACK,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        H.LOOPBACK,
        "--prometheus-port",
        str(prom),
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        str(int(startup_s)),
        "--log-level",
        "warning",
        *(extra or []),
    ]
    p = procs.start(f"{tag}_{policy}", argv)
    try:
        H.wait_port(port, startup_s, proc=p)
    except Exception as e:
        raise RuntimeError(f"vllm-router did not start: {e}\n{procs.log_tail(f'{tag}_{policy}')}") from e
    return f"http://{H.LOOPBACK}:{port}", p


def try_vllm_routers(
    procs: H.Procs, worker_urls: list[str], policies: list[str], *, tag: str = "vllm_router"
) -> tuple[dict[str, tuple[str, Any]], str | None]:
    """One vllm-router per policy, or none and why: not on PATH, or a launcher
    that does not start (a wheel without its Python deps, a binary that does not
    load). The router benches then run without its rows and record the reason."""
    why = vllm_router_missing()
    if why:
        return {}, why
    started: dict[str, tuple[str, Any]] = {}
    before = len(procs.procs)
    try:
        for policy in policies:
            started[policy] = start_vllm_router(procs, worker_urls, policy, tag=tag)
    except (RuntimeError, TimeoutError, OSError) as e:
        # Every router this call started leaves the Procs, the one that failed included:
        # a dead child in it would fail the bench's start-up check (rb_side.wait_healthy).
        for _, p in list(procs.procs[before:]):
            procs.stop(p)
        return {}, f"its rows are left out: {e}"
    return started, None


async def wait_ready(session: Any, url: str, deadline_s: float = 30.0) -> None:
    """Until one completion through `url` succeeds (the router has its workers)."""
    end = time.monotonic() + deadline_s
    body = msgspec.json.encode({"model": "null", "prompt": [1, 2, 3], "max_tokens": 1})
    last: Any = None
    while time.monotonic() < end:
        try:
            async with session.post(
                url + "/v1/completions", data=body, headers={"content-type": "application/json"}
            ) as r:
                if r.status == 200:
                    await r.read()
                    return
                last = f"HTTP {r.status}: {(await r.text())[:200]}"
        except Exception as e:
            last = e
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {deadline_s}s: {last}")


# ------------------------------------------------------------------- driver


def make_session(concurrency: int, timeout_s: float = 120.0) -> Any:
    import aiohttp

    conn = aiohttp.TCPConnector(
        limit=concurrency + 8,
        limit_per_host=concurrency + 8,
        keepalive_timeout=120,
        force_close=False,
        enable_cleanup_closed=True,
        ttl_dns_cache=None,
    )
    return aiohttp.ClientSession(
        connector=conn,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )


@dataclass
class HttpLoad:
    url: str  # base, e.g. http://127.0.0.1:1234
    n: int
    concurrency: int
    max_tokens: int
    stream: bool
    prompt: list[int]
    sessions: int = 0  # >0: X-Session-ID = "traj-{i % sessions}"
    per_request_timeout_s: float = 60.0
    record_stream_lag: bool = False  # keep client time.time() - event "emitted_at" (http_peer field)


async def http_load(session: Any, spec: HttpLoad) -> H.RunResult:
    """N requests at concurrency C; per-request latency = send → last byte."""
    base = {
        "model": "null",
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": spec.stream,
        "return_token_ids": True,
    }
    body = msgspec.json.encode(base)
    url = spec.url + "/v1/completions"
    hdr = {"content-type": "application/json"}
    lags: list[float] = []
    rec = spec.record_stream_lag

    async def request(i: int) -> tuple[int, float | None, bool]:
        h = hdr if not spec.sessions else {**hdr, "X-Session-ID": f"traj-{i % spec.sessions}"}
        first, got, finished = None, 0, False
        async with session.post(url, data=body, headers=h) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            if not spec.stream:
                ch = _dec.decode(await r.read())["choices"][0]
                return len(ch["token_ids"]), time.perf_counter(), ch.get("finish_reason") is not None
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                ev = _dec.decode(data)
                if rec and "emitted_at" in ev:
                    lags.append(time.time() - ev["emitted_at"])
                for ch in ev.get("choices", ()):
                    n = len(ch.get("token_ids") or ())
                    if n and first is None:
                        first = time.perf_counter()
                    got += n
                    if ch.get("finish_reason"):
                        finished = True
        return got, first, finished

    return await H.run_load(
        spec.n, spec.concurrency, request, expected_tokens=spec.max_tokens, timeout_s=spec.per_request_timeout_s,
        stream=spec.stream, lags=lags if rec else None,
    )  # fmt: skip


# -------------------------------------------------------------- standalone


def n_for(concurrency: int, base_n: int) -> int:
    """Enough requests that each of C workers sends several (bounded)."""
    return max(base_n, 4 * concurrency)


async def measure_peer_side(args: argparse.Namespace) -> dict[str, Any]:
    deadline = H.Deadline(args.max_seconds, "peer_side")
    prompt = prompt_ids(args.prompt_len)
    cases = [(1, False), (args.stream_tokens, True)]
    results: dict[str, Any] = {}
    with H.Procs() as procs:
        peers = start_http_peers(procs, args.engines, tokens_per_event=args.tokens_per_event)
        routers = {pol: start_vllm_router(procs, peers, pol) for pol in args.policies}
        targets = {"direct (1 http_peer)": peers[0], **{f"vllm-router {p}": u for p, (u, _) in routers.items()}}
        # CPU of the process that routes: the router (direct: the one peer it talks to)
        router_pids = {f"vllm-router {p}": [proc.pid] for p, (_, proc) in routers.items()}
        sess = make_session(max(args.concurrency) + 8)
        # lean: the same targets through bench.http_lean.LeanHttp (the raw zmq driver's equal)
        leans = {f"{name} (lean)": HL.LeanHttp(u) for name, u in targets.items()}
        router_pids |= {f"{name} (lean)": pids for name, pids in router_pids.items()}
        try:
            for u in targets.values():
                await wait_ready(sess, u)
            for max_tokens, stream in cases:
                for c in args.concurrency:
                    n = n_for(c, args.requests)
                    key = f"max_tokens={max_tokens}{' stream' if stream else ''} c={c}"
                    setups: dict[str, Callable[[], Awaitable[H.RunResult]]] = {
                        name: functools.partial(
                            http_load,
                            sess,
                            HttpLoad(
                                u, n, c, max_tokens, stream, prompt, sessions=max(1, c) if "consistent" in name else 0
                            ),
                        )
                        for name, u in targets.items()
                    }
                    for lname, drv in leans.items():
                        spec = HttpLoad(
                            "", n, c, max_tokens, stream, prompt, sessions=max(1, c) if "consistent" in lname else 0
                        )
                        setups[lname] = functools.partial(HL.lean_load, drv, spec)
                    setups = {name: H.with_cpu(router_pids.get(name, []), fn) for name, fn in setups.items()}
                    runs = await H.interleaved(setups, reps=args.reps, warmup=1, deadline=deadline)
                    direct = {
                        name: "direct (1 http_peer)" + (" (lean)" if name.endswith("(lean)") else "") for name in runs
                    }
                    results[key] = {
                        "max_tokens": max_tokens,
                        "stream": stream,
                        "concurrency": c,
                        "n": n,
                        "setups": {
                            name: {"summary": H.summarize_reps(rs), "runs": [r.summary() for r in rs]}
                            for name, rs in runs.items()
                        },
                        "ratios_vs_direct": {
                            name: {
                                "p50": H.paired_ratios(
                                    [r.summary()["p50_ms"] for r in rs],
                                    [r.summary()["p50_ms"] for r in runs[direct[name]]],
                                ),
                                "req_per_s": H.paired_ratios([r.rps for r in rs], [r.rps for r in runs[direct[name]]]),
                            }
                            for name, rs in runs.items()
                            if not name.startswith("direct")
                        },
                    }
                    print(f"  done {key} ({deadline.remaining():.0f}s left)", flush=True)
        finally:
            await sess.close()
            for drv in leans.values():
                await drv.close()
    return results


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, r in results.items():
        for name, s in r["setups"].items():
            sm = s["summary"]
            rat = r["ratios_vs_direct"].get(name)
            rows.append(
                {
                    "case": key,
                    "setup": name,
                    "client": "lean http" if name.endswith("(lean)") else "aiohttp",
                    "p50 ms": H.fmt_spread(sm["p50_ms"]),
                    "p99 ms": H.fmt_spread(sm["p99_ms"]),
                    "req/s": H.fmt_spread(sm["req_per_s"], 0),
                    "p50 x direct": H.fmt(rat["p50"]["median"]) if rat else "1",
                    "req/s x direct": H.fmt(rat["req_per_s"]["median"]) if rat else "1",
                    "router CPU%": (
                        H.fmt_spread(sm["cpu_pct"], 0)
                        if "cpu_pct" in sm and sm["cpu_pct"]["reps"] and sm["cpu_pct"]["median"] > 0
                        else "-"
                    ),
                    "err": str(sm["errors"]),
                }
            )
    return rows


def plot(results: dict[str, Any], name: str) -> None:
    panels = []
    for stream in (False, True):
        sub = {k: v for k, v in results.items() if v["stream"] == stream}
        if not sub:
            continue
        label = "max_tokens=64 stream" if stream else "max_tokens=1"
        for metric, ylabel in (("p50_ms", "p50 latency (ms)"), ("req_per_s", "requests/s")):
            series: dict[str, Any] = {}
            for v in sub.values():
                for setup, s in v["setups"].items():
                    sp = s["summary"][metric]
                    xs, ys, lo, hi = series.setdefault(setup, ([], [], [], []))
                    xs.append(v["concurrency"])
                    ys.append(sp["median"])
                    lo.append(sp["min"])
                    hi.append(sp["max"])
            panels.append(
                {
                    "title": f"{label}: {ylabel}",
                    "xlabel": "concurrency",
                    "ylabel": ylabel,
                    "series": series,
                    "logx": True,
                    "logy": metric == "p50_ms",
                }
            )
    H.plot_lines(
        name,
        panels,
        suptitle="HTTP side: http_peer direct vs behind vllm-router",
        note="median across repetitions, bars = min..max; one aiohttp client process; 2-core machine",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="HTTP side alone: http_peer direct vs vllm-router")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--requests", type=int, default=400, help="requests per run (at least 4 x concurrency)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--tokens-per-event", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.reps = [1, 64], 200, 2

    async def run() -> int:
        t0 = time.monotonic()
        res = await measure_peer_side(args)
        H.print_table(
            table_rows(res), title=f"HTTP side ({args.engines} http_peer servers, {args.reps} reps, median [min-max])"
        )
        H.write_json(
            "peer_side",
            {
                "config": vars(args),
                "results": res,
                "elapsed_s": time.monotonic() - t0,
                "driver": "aiohttp ClientSession, keep-alive pool, 1 process; (lean): bench.http_lean.LeanHttp "
                "(raw socket, tokens counted, no JSON decode); x direct pairs each with its own client's direct",
            },
        )
        plot(res, "peer_side")
        return 0

    H.run_main(run)
    return 0


if __name__ == "__main__":
    main()
