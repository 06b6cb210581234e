"""Router overhead: rollout-bus router vs vllm-router, side by side in one run.

Setups (all on this machine, loopback only, measured interleaved in every
repetition so machine noise hits them alike):

  HTTP side (what SkyRL runs): K ``bench.http_peer`` servers (no model)
    http direct            aiohttp client → one http_peer
    vllm-router c_hash     aiohttp client → vllm-router --policy consistent_hash
                           (X-Session-ID per trajectory) → K http_peers
    vllm-router p2         … --policy power_of_two
  rollout-bus side: K engine nodes with the ``null`` backend (no model)
    rb direct              trainer_bridge.AsyncClient → one engine node
    rb router              AsyncClient → head (least_loaded, power of two)
    rb router+session      AsyncClient → head, session_id per trajectory
                           (sticky-least-loaded)
    rb direct/router (raw) the same two paths driven by bench.rb_side.RawDriver,
                           a lean benchmark-owned zmq client, to separate the
                           router's cost from trainer_bridge's per-chunk cost

Both servers return max_tokens deterministic tokens at once; streaming
sends one message per token on both sides (null ``tokens_per_step=1``, one
SSE event per token). Each side is driven by one asyncio process of its own
natural client (aiohttp with keep-alive pool / the product's AsyncClient),
C worker tasks over N requests; every response is fully parsed. Overheads are
paired ratios router/direct within each repetition, medians reported.

Run: ``python -m bench.router_overhead`` (``--quick`` for a reduced set).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import harness as H
from bench import peer_side as PS
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

HTTP_DIRECT, VR_CH, VR_P2 = "http direct", "vllm-router c_hash", "vllm-router p2"
RB_DIRECT, RB_ROUTER, RB_SESSION = "rb direct", "rb router", "rb router+session"
RAW_DIRECT, RAW_ROUTER = "rb direct (raw)", "rb router (raw)"
DIRECT_OF = {
    VR_CH: HTTP_DIRECT,
    VR_P2: HTTP_DIRECT,
    RB_ROUTER: RB_DIRECT,
    RB_SESSION: RB_DIRECT,
    RAW_ROUTER: RAW_DIRECT,
}
ORDER = [HTTP_DIRECT, VR_CH, VR_P2, RB_DIRECT, RB_ROUTER, RB_SESSION, RAW_DIRECT, RAW_ROUTER]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = H.Deadline(args.max_seconds, "router_overhead")
    prompt = PS.prompt_ids(args.prompt_len)
    cases = [(1, False)] + ([(args.stream_tokens, True)] if args.stream_tokens else [])
    results: dict[str, Any] = {}
    with H.Procs() as procs:
        # -- HTTP side
        peers = PS.start_http_peers(procs, args.engines, tokens_per_event=1)
        missing = PS.vllm_router_missing()
        if missing:
            print(f"  skipping the vllm-router setups: {missing}", flush=True)
        vr = (
            {}
            if missing
            else {
                VR_CH: PS.start_vllm_router(procs, peers, "consistent_hash"),
                VR_P2: PS.start_vllm_router(procs, peers, "power_of_two"),
            }
        )
        # -- rollout-bus side
        cl = RB.start_cluster(procs, args.engines, backend=NULL_BACKEND, backend_options={"tokens_per_step": 1})
        rb_router = RB.make_client(cl.frontend)
        rb_direct = RB.make_client(next(iter(cl.engines.values())))
        raw_router = RB.RawDriver(cl.frontend)
        raw_direct = RB.RawDriver(next(iter(cl.engines.values())))
        sess = PS.make_session(max(args.concurrency) + 8)
        cpu_pids = {
            **{name: [v[1].pid] for name, v in vr.items()},
            RB_ROUTER: [cl.router_pid],
            RB_SESSION: [cl.router_pid],
            RAW_ROUTER: [cl.router_pid],
        }
        try:
            await RB.wait_healthy(rb_router, args.engines, 120, procs)
            await PS.wait_ready(sess, peers[0])
            for name in vr:
                await PS.wait_ready(sess, vr[name][0])
            for max_tokens, stream in cases:
                for c in args.concurrency:
                    n = PS.n_for(c, args.requests)
                    key = f"max_tokens={max_tokens}{' stream' if stream else ''} c={c}"

                    # The loop's values are bound as defaults: a setup never sees a later iteration's.
                    def http(url: str, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream):
                        return lambda: PS.http_load(sess, PS.HttpLoad(url, n, c, mt, st, prompt, sessions=sessions))

                    def rbl(
                        client: Any, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream
                    ):
                        return lambda: RB.rb_load(client, RB.RbLoad(n, c, mt, st, prompt, sessions=sessions))

                    def raw(drv: Any, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream):
                        return lambda: RB.raw_load(drv, RB.RbLoad(n, c, mt, st, prompt, sessions=sessions))

                    setups = {
                        HTTP_DIRECT: http(peers[0], 0),
                        VR_CH: http(vr[VR_CH][0] if vr else "", c),
                        VR_P2: http(vr[VR_P2][0] if vr else "", 0),
                        RB_DIRECT: rbl(rb_direct, 0),
                        RB_ROUTER: rbl(rb_router, 0),
                        RB_SESSION: rbl(rb_router, c),
                        RAW_DIRECT: raw(raw_direct, 0),
                        RAW_ROUTER: raw(raw_router, 0),
                    }
                    for name in (VR_CH, VR_P2):
                        if name not in vr:
                            setups.pop(name)
                    if args.no_raw:
                        setups.pop(RAW_DIRECT), setups.pop(RAW_ROUTER)
                    setups = {k: H.with_cpu(cpu_pids.get(k, []), fn) for k, fn in setups.items()}
                    runs = await H.interleaved(setups, reps=args.reps, warmup=1, deadline=deadline)
                    results[key] = summarize_case(runs, max_tokens=max_tokens, stream=stream, concurrency=c, n=n)
                    print(f"  done {key} ({deadline.remaining():.0f}s left)", flush=True)
        finally:
            await sess.close()
            await rb_router.close()
            await rb_direct.close()
            await raw_router.close()
            await raw_direct.close()
    return results


def summarize_case(runs: dict[str, list[H.RunResult]], **meta: Any) -> dict[str, Any]:
    out: dict[str, Any] = {**meta, "setups": {}, "overhead_vs_own_direct": {}, "rb_vs_vllm_router": {}}
    for name, rs in runs.items():
        out["setups"][name] = {"summary": H.summarize_reps(rs), "runs": [r.summary() for r in rs]}
    p50 = {k: [r.summary()["p50_ms"] for r in rs] for k, rs in runs.items()}
    p99 = {k: [r.summary()["p99_ms"] for r in rs] for k, rs in runs.items()}
    rps = {k: [r.rps for r in rs] for k, rs in runs.items()}
    for name, direct in DIRECT_OF.items():
        if name in runs and direct in runs:
            out["overhead_vs_own_direct"][name] = {
                "p50": H.paired_ratios(p50[name], p50[direct]),
                "p99": H.paired_ratios(p99[name], p99[direct]),
                "req_per_s": H.paired_ratios(rps[name], rps[direct]),
                # added latency in ms (router p50 - direct p50), per repetition
                "p50_added_ms": H.spread([a - b for a, b in zip(p50[name], p50[direct], strict=True)]),
            }
    for rb, vrn in ((RB_ROUTER, VR_P2), (RB_SESSION, VR_CH), (RAW_ROUTER, VR_P2)):
        if rb in runs and vrn in runs:
            out["rb_vs_vllm_router"][f"{rb} / {vrn}"] = {
                "p50": H.paired_ratios(p50[rb], p50[vrn]),
                "req_per_s": H.paired_ratios(rps[rb], rps[vrn]),
            }
    return out


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, r in results.items():
        for name in ORDER:
            if name not in r["setups"]:
                continue
            sm = r["setups"][name]["summary"]
            ov = r["overhead_vs_own_direct"].get(name)
            cpu = sm.get("cpu_pct")
            rows.append(
                {
                    "case": key,
                    "setup": name,
                    "p50 ms": H.fmt_spread(sm["p50_ms"]),
                    "p99 ms": H.fmt_spread(sm["p99_ms"]),
                    "req/s": H.fmt_spread(sm["req_per_s"], 0),
                    "p50 x direct": H.fmt(ov["p50"]["median"]) if ov else "",
                    "+ms p50": H.fmt(ov["p50_added_ms"]["median"]) if ov else "",
                    "req/s x direct": H.fmt(ov["req_per_s"]["median"]) if ov else "",
                    "router CPU%": H.fmt(cpu["median"], 0) if ov and cpu and cpu["reps"] else "",
                    "err": str(sm["errors"]),
                }
            )
    return rows


def plot(results: dict[str, Any], name: str, title: str) -> None:
    panels = []
    for stream in (False, True):
        sub = [v for v in results.values() if v["stream"] == stream]
        if not sub:
            continue
        label = f"max_tokens={sub[0]['max_tokens']}{' stream' if stream else ''}"
        for metric, ylabel, logy in (("p50_ms", "p50 latency (ms)", True), ("req_per_s", "requests/s", False)):
            series: dict[str, Any] = {}
            for setup in ORDER:
                pts = [(v["concurrency"], v["setups"][setup]["summary"][metric]) for v in sub if setup in v["setups"]]
                if pts:
                    series[setup] = (
                        [x for x, _ in pts],
                        [s["median"] for _, s in pts],
                        [s["min"] for _, s in pts],
                        [s["max"] for _, s in pts],
                    )
            panels.append(
                {
                    "title": f"{label}: {ylabel}",
                    "xlabel": "concurrency",
                    "ylabel": ylabel,
                    "series": series,
                    "logx": True,
                    "logy": logy,
                }
            )
        series = {}
        for setup in DIRECT_OF:
            pts = [
                (v["concurrency"], v["overhead_vs_own_direct"][setup]["p50"])
                for v in sub
                if setup in v["overhead_vs_own_direct"]
            ]
            if pts:
                series[setup] = (
                    [x for x, _ in pts],
                    [s["median"] for _, s in pts],
                    [s["min"] for _, s in pts],
                    [s["max"] for _, s in pts],
                )
        panels.append(
            {
                "title": f"{label}: router p50 / its own direct p50",
                "xlabel": "concurrency",
                "ylabel": "x direct (1 = no overhead)",
                "series": series,
                "logx": True,
                "hline": 1.0,
            }
        )
    H.plot_lines(
        name,
        panels,
        suptitle=title,
        note="median across repetitions, bars = min..max; each side driven by one asyncio client process "
        "(aiohttp keep-alive / trainer_bridge.AsyncClient); same machine, same run",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2, help="engines behind each router (K)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--requests", type=int, default=400, help="requests per run (at least 4 x concurrency)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=64, help="0: skip the streaming case")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--quick", action="store_true", help="c=1,64; 200 requests; 2 reps")
    ap.add_argument("--name", default="router_overhead")
    ap.add_argument("--no-raw", action="store_true", help="skip the RawDriver setups")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.reps = [1, 64], 200, 2
        args.max_seconds = min(args.max_seconds, 150)

    async def go() -> int:
        t0 = time.monotonic()
        res = await run(args)
        title = (
            f"Router overhead, {args.engines} engines per router, prompt {args.prompt_len} tokens "
            f"({args.reps} reps, median [min-max])"
        )
        H.print_table(table_rows(res), title=title)
        print(
            "drivers: HTTP side = aiohttp ClientSession (keep-alive pool); rollout-bus side = "
            "trainer_bridge.AsyncClient, and (raw) = bench RawDriver (plain zmq DEALER + add_reader); "
            "one asyncio process, C tasks per setup, responses fully parsed; setups interleaved per rep"
        )
        H.write_json(
            args.name,
            {
                "config": vars(args),
                "elapsed_s": time.monotonic() - t0,
                "results": res,
                "vllm_router_skipped": PS.vllm_router_missing(),  # None: its rows ran
                "drivers": {
                    "http": "aiohttp.ClientSession, TCPConnector keep-alive pool, one process",
                    "rollout_bus": "trainer_bridge.AsyncClient (zmq DEALER), one process",
                    "rollout_bus_raw": "bench.rb_side.RawDriver: plain zmq DEALER read via loop.add_reader, bus.codec",
                },
            },
        )
        plot(res, args.name, title)
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
