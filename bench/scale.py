"""Scale: 1, 8, 32, 64 null engines behind one router on this 2-core machine.

For each engine count K (a fresh cluster each time, its HTTP twin up beside it):
- router requests/s and the router process's CPU (psutil) under load:
  N requests, max_tokens=1, concurrency C, driven by bench RawDriver (a lean
  zmq client, so the router — not the client library — is what saturates)
  and by trainer_bridge.AsyncClient;
- the HTTP twin (unless --no-http; without vllm-router on PATH its rows are
  left out and the JSON says why): K http_peers behind vllm-router p2, driven
  by aiohttp and by bench.http_lean.LeanHttp (the raw driver's equal). All
  four load arms run once per rep in rotated order (bench/README's rules),
  and "x vllm-router" pairs equal clients per rep: raw zmq with lean http,
  AsyncClient with aiohttp;
- control fan-out round trip: ``pause("abort")`` then ``resume()`` through the
  head (publish on the control bus, gather K acks), timed by the client, R
  times, p50/p99 — and a ``Stats`` query as a plain fan-out — against the
  fan-out an HTTP RL stack does for pause: ``POST /pause`` then ``POST
  /resume`` to each of K servers with asyncio.gather over a keep-alive aiohttp
  session, the two alternated round by round.

Run: ``python -m bench.scale`` (``--quick``: K = 1, 8, 32 and fewer requests).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench import harness as H
from bench import http_lean as HL
from bench import peer_side as PS
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND


async def timed_rounds(fn: Any, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


RB_RAW, RB_BRIDGE = "rb router (raw)", "rb router (bridge)"
# setup -> (client, the vllm-router setup driven by an equal client)
CLIENTS = {RB_RAW: ("raw zmq", "vllm-router (lean)"), RB_BRIDGE: ("AsyncClient", "vllm-router")}


def client_of(name: str) -> str:
    if name in CLIENTS:
        return CLIENTS[name][0]
    return "lean http" if name.endswith("(lean)") else "aiohttp"


async def one_k(args: argparse.Namespace, k: int, deadline: H.Deadline) -> dict[str, Any]:
    """One engine count: the rollout-bus cluster and (--http) its HTTP twin up
    at once, their load arms interleaved in every rep, then the fan-outs."""
    prompt = PS.prompt_ids(args.prompt_len)
    res: dict[str, Any] = {"engines": k}
    with H.Procs() as procs:
        t0 = time.monotonic()
        cl = RB.start_cluster(procs, k, backend=NULL_BACKEND, tag=f"scale{k}")
        client = RB.make_client(cl.frontend)
        raw = RB.RawDriver(cl.frontend)
        peers: list[str] = []
        vr: Any = None
        if args.http:
            peers = PS.start_http_peers(procs, k, tag=f"scale{k}_peer", startup_s=deadline.cap(120))
            pol = "power_of_two" if k >= 2 else "round_robin"  # vllm-router: p2 needs >= 2 workers
            started, why = PS.try_vllm_routers(procs, peers, [pol], tag=f"scale{k}_vr")
            vr = started.get(pol)
            if why:
                res["vllm_router_skipped"] = why
                print(f"  K={k}: no vllm-router rows: {why}", flush=True)
        sess = PS.make_session(max(args.concurrency, k) + 8)
        lean = HL.LeanHttp(vr[0]) if vr else None
        try:
            await RB.wait_healthy(client, k, deadline.cap(180), procs)
            res["startup_s"] = time.monotonic() - t0
            if vr:
                await PS.wait_ready(sess, vr[0])
            await asyncio.sleep(0.5)  # let the last joins settle
            n, c = args.requests, args.concurrency
            spec = RB.RbLoad(n, c, 1, False, prompt)
            setups = {
                RB_RAW: H.with_cpu([cl.router_pid], lambda: RB.raw_load(raw, spec)),
                RB_BRIDGE: H.with_cpu([cl.router_pid], lambda: RB.rb_load(client, spec)),
            }
            if vr and lean:
                spec_h = PS.HttpLoad(vr[0], n, c, 1, False, prompt)
                res["vllm_router_policy"] = pol
                setups["vllm-router"] = H.with_cpu([vr[1].pid], lambda: PS.http_load(sess, spec_h))
                setups["vllm-router (lean)"] = H.with_cpu([vr[1].pid], lambda: HL.lean_load(lean, spec_h))
            # every arm once per rep, in rotated order (the HTTP twin's included: same machine state)
            order: list[list[str]] = [[] for _ in range(args.reps)]
            runs = await H.interleaved(
                setups,
                reps=args.reps,
                warmup=1,
                deadline=deadline,
                on_run=lambda name, rep, _r: order[rep].append(name),
            )
            res["order"] = order  # the arms as they ran, per rep
            res["load"] = {name: H.summarize_reps(rs) for name, rs in runs.items()}
            res["vs_vllm_router"] = {
                name: H.paired_ratios([r.rps for r in runs[name]], [r.rps for r in runs[other]])
                for name, (_, other) in CLIENTS.items()
                if other in runs
            }
            res["router_counters"] = (await client.stats()).get("counters")
            await fanouts(args, client, sess, peers, res)
        finally:
            await client.close()
            await raw.close()
            await sess.close()
            if lean:
                await lean.close()
    return res


async def fanouts(args: argparse.Namespace, client: Any, sess: Any, peers: list[str], res: dict[str, Any]) -> None:
    """Pause+resume through the head (and a Stats fan-out) against the HTTP
    stack's asyncio.gather of POST /pause, /resume to every server, the two
    alternated round by round."""
    from bus.protocol import Stats

    async def post_all(path: str) -> None:
        async def one(u: str) -> None:
            async with sess.post(u + path, data=b"{}", headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{u}{path}: HTTP {r.status}")

        await asyncio.gather(*(one(u) for u in peers))

    await client.pause("abort")
    await client.resume()
    if peers:
        await post_all("/pause")
        await post_all("/resume")
    pr, pause_only, http = [], [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        await client.pause("abort")
        t1 = time.perf_counter()
        await client.resume()
        pr.append(time.perf_counter() - t)
        pause_only.append(t1 - t)
        if peers:
            t = time.perf_counter()
            await post_all("/pause")
            await post_all("/resume")
            http.append(time.perf_counter() - t)
    res["pause_resume_ms"] = H.latency_summary(pr)
    res["pause_only_ms"] = H.latency_summary(pause_only)
    if http:
        res["http_pause_resume_ms"] = H.latency_summary(http)
    res["stats_fanout_ms"] = H.latency_summary(await timed_rounds(lambda: client.control(Stats()), args.rounds))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30, help="pause/resume round trips per engine count")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--no-http", dest="http", action="store_false")
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.requests, args.reps, args.rounds = [1, 8, 32], 600, 2, 10
        args.max_seconds = min(args.max_seconds, 150)

    async def go() -> int:
        t0 = time.monotonic()
        deadline = H.Deadline(args.max_seconds, "scale")
        res = []
        for k in args.engines:
            deadline.check(f"K={k}")
            res.append(await one_k(args, k, deadline))
            print(f"  done K={k} ({deadline.remaining():.0f}s left)", flush=True)
        rows = []
        for r in res:
            for name, sm in r["load"].items():
                vs = r.get("vs_vllm_router", {}).get(name)
                rows.append(
                    {
                        "engines": str(r["engines"]),
                        "setup": name.replace("vllm-router", f"vllm-router {r.get('vllm_router_policy', '')}"),
                        "client": client_of(name),
                        "req/s": H.fmt_spread(sm["req_per_s"], 0),
                        "x vllm-router (same client class)": H.fmt(vs["median"]) if vs else "",
                        "p50 ms": H.fmt(sm["p50_ms"]["median"]),
                        "p99 ms": H.fmt(sm["p99_ms"]["median"]),
                        "router CPU%": H.fmt_spread(sm["cpu_pct"], 0) if "cpu_pct" in sm else "-",
                        "err": str(sm["errors"]),
                    }
                )
        H.print_table(
            rows,
            title=f"Scale: router under load (max_tokens=1, c={args.concurrency}, "
            f"{args.requests} requests, {args.reps} reps, median [min-max])",
        )
        crow = []
        for r in res:
            crow.append(
                {
                    "engines": str(r["engines"]),
                    "startup s": H.fmt(r.get("startup_s")),
                    "pause+resume p50 ms": H.fmt(r["pause_resume_ms"]["p50_ms"]),
                    "p99 ms": H.fmt(r["pause_resume_ms"]["p99_ms"]),
                    "pause p50 ms": H.fmt(r["pause_only_ms"]["p50_ms"]),
                    "stats fan-out p50 ms": H.fmt(r["stats_fanout_ms"]["p50_ms"]),
                    "HTTP pause+resume p50 ms": H.fmt(r["http_pause_resume_ms"]["p50_ms"])
                    if "http_pause_resume_ms" in r
                    else "-",
                    "HTTP p99 ms": H.fmt(r["http_pause_resume_ms"]["p99_ms"]) if "http_pause_resume_ms" in r else "-",
                }
            )
        H.print_table(
            crow,
            title=f"Scale: control fan-out round trip ({args.rounds} rounds; rollout-bus: "
            "client -> head -> PUB -> K acks; HTTP: asyncio.gather POST to K servers)",
        )
        H.write_json("scale", {"config": vars(args), "elapsed_s": time.monotonic() - t0, "results": res})
        ks = [r["engines"] for r in res]
        names = sorted({n for r in res for n in r["load"]}, key=lambda n: (not n.startswith("rb"), n))
        series_rps = {}
        series_cpu = {}
        for n in names:
            pts = [(r["engines"], r["load"][n]) for r in res if n in r["load"]]
            series_rps[n] = (
                [x for x, _ in pts],
                [s["req_per_s"]["median"] for _, s in pts],
                [s["req_per_s"]["min"] for _, s in pts],
                [s["req_per_s"]["max"] for _, s in pts],
            )
            series_cpu[n] = ([x for x, _ in pts], [s["cpu_pct"]["median"] for _, s in pts])
        fan = {
            "rollout-bus pause+resume p50": (ks, [r["pause_resume_ms"]["p50_ms"] for r in res]),
            "rollout-bus pause+resume p99": (ks, [r["pause_resume_ms"]["p99_ms"] for r in res]),
        }
        if all("http_pause_resume_ms" in r for r in res):
            fan["HTTP gather pause+resume p50"] = (ks, [r["http_pause_resume_ms"]["p50_ms"] for r in res])
            fan["HTTP gather pause+resume p99"] = (ks, [r["http_pause_resume_ms"]["p99_ms"] for r in res])
        H.plot_lines(
            "scale",
            [
                {
                    "title": "router requests/s (max_tokens=1)",
                    "xlabel": "engines",
                    "ylabel": "requests/s",
                    "series": series_rps,
                    "logx": True,
                },
                {
                    "title": "router process CPU % (100 = one core)",
                    "xlabel": "engines",
                    "ylabel": "CPU %",
                    "series": series_cpu,
                    "logx": True,
                },
                {
                    "title": "control fan-out: pause + resume round trip",
                    "xlabel": "engines",
                    "ylabel": "ms",
                    "series": fan,
                    "logx": True,
                    "logy": True,
                },
            ],
            suptitle=f"Scale on {H.machine_info()['cpu_count']} cores: null engines behind one router",
            note="all engines, routers and the client share this machine",
        )
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
