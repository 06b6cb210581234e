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
    http direct (lean)     the HTTP twins of the raw setups: bench.http_lean.LeanHttp
    vllm-router … (lean)   (a raw-socket HTTP/1.1 reader that counts tokens without
                           decoding JSON), as lean as RawDriver
    rb router spin N (raw) ``--spin-us N [M ...]`` only: RawDriver → one more head
                           per value, started with ``--busy-poll-us N`` (spins on
                           a non-blocking poll while requests are in flight), in
                           front of K engines of its own; paired against
                           ``rb direct (raw)`` (the engines are alike: the engine
                           node has no busy-poll knob) and against
                           ``rb router (raw)``; its CPU% shows what spinning costs

Equal clients only (issue 36 row 3): a rollout-bus setup is compared with a
vllm-router setup driven by a client of its own class: the product's
AsyncClient with aiohttp (both full clients decoding every message), the raw
zmq driver with the lean HTTP reader (both count tokens, decode next to
nothing). Every row says its client (column "client"); the "x vllm-router"
ratios and the target lines pair within a class, never across.

Both servers return max_tokens deterministic tokens at once; streaming
sends one message per token on both sides (null ``tokens_per_step=1``, one
SSE event per token). Each side is driven by one asyncio process of its own
natural client (aiohttp with keep-alive pool / the product's AsyncClient),
C worker tasks over N requests. Overheads are
paired ratios router/direct within each repetition, medians reported.

Run: ``python -m bench.router_overhead`` (``--quick`` for a reduced set).
``--max-seconds`` bounds the measuring: when it passes, the case running keeps
its complete repetitions, later cases are listed as skipped, and the JSON is
written all the same. ``--no-plot`` / ``--plot-from JSON`` draw the PNG apart.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import http_lean as HL
from bench import peer_side as PS
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

HTTP_DIRECT, VR_CH, VR_P2 = "http direct", "vllm-router c_hash", "vllm-router p2"
RB_DIRECT, RB_ROUTER, RB_SESSION = "rb direct", "rb router", "rb router+session"
RAW_DIRECT, RAW_ROUTER = "rb direct (raw)", "rb router (raw)"
LEAN_DIRECT, VR_CH_LEAN, VR_P2_LEAN = "http direct (lean)", "vllm-router c_hash (lean)", "vllm-router p2 (lean)"
AIOHTTP, ASYNC_CLIENT, RAW_ZMQ, LEAN_HTTP = "aiohttp", "AsyncClient", "raw zmq", "lean http"
# The clients compared with each other: full with full, lean with lean.
EQUAL = {AIOHTTP: "full", ASYNC_CLIENT: "full", RAW_ZMQ: "lean", LEAN_HTTP: "lean"}
SPIN_PREFIX = "rb router spin "
DIRECT_OF = {
    VR_CH: HTTP_DIRECT,
    VR_P2: HTTP_DIRECT,
    RB_ROUTER: RB_DIRECT,
    RB_SESSION: RB_DIRECT,
    RAW_ROUTER: RAW_DIRECT,
    VR_CH_LEAN: LEAN_DIRECT,
    VR_P2_LEAN: LEAN_DIRECT,
}
ORDER = [
    HTTP_DIRECT, VR_CH, VR_P2, RB_DIRECT, RB_ROUTER, RB_SESSION,
    LEAN_DIRECT, VR_CH_LEAN, VR_P2_LEAN, RAW_DIRECT, RAW_ROUTER,
]  # fmt: skip
# rollout-bus setup / vllm-router setup, paired per repetition: equal clients only
VS_VLLM_ROUTER = ((RB_ROUTER, VR_P2), (RB_SESSION, VR_CH), (RAW_ROUTER, VR_P2_LEAN), (RAW_ROUTER, VR_CH_LEAN))


def spin_setup(us: int) -> str:
    """The setup of a head started with --busy-poll-us `us`, driven by RawDriver."""
    return f"{SPIN_PREFIX}{us}us (raw)"


def client_of(name: str) -> str:
    """The client a setup is driven by."""
    if name.endswith("(lean)"):
        return LEAN_HTTP
    if name.endswith("(raw)"):
        return RAW_ZMQ
    return ASYNC_CLIENT if name.startswith("rb ") else AIOHTTP


def direct_of(name: str) -> str | None:
    """The direct twin a router setup is paired with (None: a direct setup)."""
    return DIRECT_OF.get(name) or (RAW_DIRECT if name.startswith(SPIN_PREFIX) else None)


def order_of(names: Any) -> list[str]:
    """Table/plot order: ORDER, then the spinning heads by spin."""
    spins = sorted(
        (n for n in names if n.startswith(SPIN_PREFIX)), key=lambda n: int(n[len(SPIN_PREFIX) :].split("us", 1)[0])
    )
    return [n for n in ORDER if n in names] + spins


async def run(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """{case: summary}, and why vllm-router's rows are missing (None: they ran)."""
    deadline = H.Deadline(args.max_seconds, "router_overhead")
    prompt = PS.prompt_ids(args.prompt_len)
    cases = [(1, False)] + ([(args.stream_tokens, True)] if args.stream_tokens else [])
    results: dict[str, Any] = {}
    with H.Procs() as procs:
        # -- HTTP side
        peers = PS.start_http_peers(procs, args.engines, tokens_per_event=1)
        started, why = PS.try_vllm_routers(procs, peers, ["consistent_hash", "power_of_two"])
        if why:
            print(f"  skipping the vllm-router setups: {why}", flush=True)
        vr = {VR_CH: started["consistent_hash"], VR_P2: started["power_of_two"]} if started else {}
        # -- rollout-bus side
        null_opts = {"tokens_per_step": 1}
        cl = RB.start_cluster(procs, args.engines, backend=NULL_BACKEND, backend_options=null_opts)
        # A spinning head gets engines of its own: an engine registers with one head.
        spins = {
            spin_setup(us): RB.start_cluster(
                procs,
                args.engines,
                backend=NULL_BACKEND,
                backend_options=null_opts,
                tag=f"rbspin{us}",
                router_args=["--busy-poll-us", str(us)],
            )
            for us in args.spin_us
            if us > 0
        }
        rb_router = RB.make_client(cl.frontend)
        rb_direct = RB.make_client(next(iter(cl.engines.values())))
        raw_router = RB.RawDriver(cl.frontend)
        raw_direct = RB.RawDriver(next(iter(cl.engines.values())))
        raw_spins = {name: RB.RawDriver(scl.frontend) for name, scl in spins.items()}
        sess = PS.make_session(max(args.concurrency) + 8)
        lean = {LEAN_DIRECT: HL.LeanHttp(peers[0])}
        lean |= {name + " (lean)": HL.LeanHttp(v[0]) for name, v in vr.items()}
        cpu_pids = {
            **{name: [v[1].pid] for name, v in vr.items()},
            **{name + " (lean)": [v[1].pid] for name, v in vr.items()},
            RB_ROUTER: [cl.router_pid],
            RB_SESSION: [cl.router_pid],
            RAW_ROUTER: [cl.router_pid],
            **{name: [scl.router_pid] for name, scl in spins.items()},
        }
        try:
            await RB.wait_healthy(rb_router, args.engines, 120, procs)
            for scl in spins.values():
                spin_client = RB.make_client(scl.frontend)
                try:
                    await RB.wait_healthy(spin_client, args.engines, 120, procs)
                finally:
                    await spin_client.close()
            await PS.wait_ready(sess, peers[0])
            for name in vr:
                await PS.wait_ready(sess, vr[name][0])
            for max_tokens, stream in cases:
                for c in args.concurrency:
                    n = PS.n_for(c, args.requests)
                    key = f"max_tokens={max_tokens}{' stream' if stream else ''} c={c}"
                    if deadline.remaining() <= 0:
                        results[key] = skipped_case(max_tokens=max_tokens, stream=stream, concurrency=c, n=n)
                        print(f"  skipped {key}: --max-seconds passed", flush=True)
                        continue

                    # The loop's values are bound as defaults: a setup never sees a later iteration's.
                    def http(url: str, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream):
                        return lambda: PS.http_load(sess, PS.HttpLoad(url, n, c, mt, st, prompt, sessions=sessions))

                    def rbl(
                        client: Any, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream
                    ):
                        return lambda: RB.rb_load(client, RB.RbLoad(n, c, mt, st, prompt, sessions=sessions))

                    def raw(drv: Any, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream):
                        return lambda: RB.raw_load(drv, RB.RbLoad(n, c, mt, st, prompt, sessions=sessions))

                    def lean_http(
                        name: str, sessions: int, n: int = n, c: int = c, mt: int = max_tokens, st: bool = stream
                    ):
                        spec = PS.HttpLoad("", n, c, mt, st, prompt, sessions=sessions)
                        return lambda: HL.lean_load(lean[name], spec)

                    setups = {
                        HTTP_DIRECT: http(peers[0], 0),
                        VR_CH: http(vr[VR_CH][0] if vr else "", c),
                        VR_P2: http(vr[VR_P2][0] if vr else "", 0),
                        RB_DIRECT: rbl(rb_direct, 0),
                        RB_ROUTER: rbl(rb_router, 0),
                        RB_SESSION: rbl(rb_router, c),
                        LEAN_DIRECT: lean_http(LEAN_DIRECT, 0),
                        VR_CH_LEAN: lean_http(VR_CH_LEAN, c),
                        VR_P2_LEAN: lean_http(VR_P2_LEAN, 0),
                        RAW_DIRECT: raw(raw_direct, 0),
                        RAW_ROUTER: raw(raw_router, 0),
                        **{name: raw(drv, 0) for name, drv in raw_spins.items()},
                    }
                    drop = [name for name in (VR_CH, VR_P2, VR_CH_LEAN, VR_P2_LEAN) if name not in {*vr, *lean}]
                    drop += (
                        [LEAN_DIRECT, VR_CH_LEAN, VR_P2_LEAN, RAW_DIRECT, RAW_ROUTER, *raw_spins] if args.no_raw else []
                    )
                    for name in drop:
                        setups.pop(name, None)
                    setups = {k: H.with_cpu(cpu_pids.get(k, []), fn) for k, fn in setups.items()}
                    runs, cut = await H.interleaved_within(setups, reps=args.reps, deadline=deadline)
                    meta = {"max_tokens": max_tokens, "stream": stream, "concurrency": c, "n": n}
                    results[key] = summarize_case(runs, **meta, truncated=cut) if runs else skipped_case(**meta)
                    print(
                        f"  done {key}{' (cut by --max-seconds)' if cut else ''} ({deadline.remaining():.0f}s left)",
                        flush=True,
                    )
        finally:
            await sess.close()
            for client in (rb_router, rb_direct, raw_router, raw_direct, *raw_spins.values(), *lean.values()):
                await client.close()
    return results, why


def skipped_case(**meta: Any) -> dict[str, Any]:
    """A case --max-seconds left no time for: in the JSON as skipped, no rows."""
    return {**meta, "skipped": "--max-seconds passed", "setups": {}, "overhead_vs_own_direct": {}}


def summarize_case(runs: dict[str, list[H.RunResult]], **meta: Any) -> dict[str, Any]:
    out: dict[str, Any] = {**meta, "setups": {}, "overhead_vs_own_direct": {}, "rb_vs_vllm_router": {}}
    for name, rs in runs.items():
        out["setups"][name] = {"summary": H.summarize_reps(rs), "runs": [r.summary() for r in rs]}
    p50 = {k: [r.summary()["p50_ms"] for r in rs] for k, rs in runs.items()}
    p99 = {k: [r.summary()["p99_ms"] for r in rs] for k, rs in runs.items()}
    rps = {k: [r.rps for r in rs] for k, rs in runs.items()}
    for name in runs:
        direct = direct_of(name)
        if direct is not None and direct in runs:
            out["overhead_vs_own_direct"][name] = {
                "p50": H.paired_ratios(p50[name], p50[direct]),
                "p99": H.paired_ratios(p99[name], p99[direct]),
                "req_per_s": H.paired_ratios(rps[name], rps[direct]),
                # added latency in ms (router p50 - direct p50), per repetition
                "p50_added_ms": H.spread([a - b for a, b in zip(p50[name], p50[direct], strict=True)]),
            }
    spins = [n for n in runs if n.startswith(SPIN_PREFIX)]
    for rb, vrn in (*VS_VLLM_ROUTER, *((n, VR_P2_LEAN) for n in spins), *((n, VR_CH_LEAN) for n in spins)):
        if rb in runs and vrn in runs:
            out["rb_vs_vllm_router"][f"{rb} / {vrn}"] = {
                "p50": H.paired_ratios(p50[rb], p50[vrn]),
                "req_per_s": H.paired_ratios(rps[rb], rps[vrn]),
            }
    if RAW_ROUTER in runs:
        out["spin_vs_plain_head"] = {
            n: {
                "p50": H.paired_ratios(p50[n], p50[RAW_ROUTER]),
                "req_per_s": H.paired_ratios(rps[n], rps[RAW_ROUTER]),
            }
            for n in spins
        }
    return out


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, r in results.items():
        for name in order_of(r["setups"]):
            sm = r["setups"][name]["summary"]
            ov = r["overhead_vs_own_direct"].get(name)
            cpu = sm.get("cpu_pct")
            rows.append(
                {
                    "case": key,
                    "setup": name,
                    "client": client_of(name),
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
        names = order_of({n for v in sub for n in v["setups"]})
        for metric, ylabel, logy in (("p50_ms", "p50 latency (ms)", True), ("req_per_s", "requests/s", False)):
            series: dict[str, Any] = {}
            for setup in names:
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
        for setup in (n for n in names if direct_of(n)):
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
        note="median across repetitions, bars = min..max; one asyncio client process per setup: aiohttp / "
        "AsyncClient, and (raw) zmq / (lean) HTTP; same machine, same run",
    )


def target_lines(results: dict[str, Any]) -> list[str]:
    """Issue 24 §1's targets read off a run: the head's added p50 at c=1
    (max_tokens 1; target <= 0.100 ms) and streamed req/s against vllm-router's
    best policy (target >= 1.0x at c=1, lead kept at c >= 64), each rollout-bus
    setup against vllm-router driven by an equal client (AsyncClient vs
    aiohttp, raw zmq vs lean HTTP)."""
    lines = []
    for key, r in results.items():
        setups = r.get("setups", {})
        if not setups:
            continue
        rps = {name: s["summary"]["req_per_s"]["median"] for name, s in setups.items()}
        if r["max_tokens"] == 1 and r["concurrency"] == 1:
            added = {
                f"{name} [{client_of(name)}]": ov["p50_added_ms"]["median"]
                for name, ov in r["overhead_vs_own_direct"].items()
                if name != RB_SESSION
            }
            lines.append(f"{key}: p50 added over direct, ms (target <= 0.100): " + fmt_map(added, 3))
        if r["stream"]:
            for cls, vrs, ours in (
                ("AsyncClient vs aiohttp", (VR_CH, VR_P2), (RB_ROUTER, RB_SESSION)),
                ("raw zmq vs lean http", (VR_CH_LEAN, VR_P2_LEAN), (RAW_ROUTER,)),
            ):
                lean_class = EQUAL[client_of(ours[0])] == "lean"
                mine = {n: rps[n] for n in order_of(rps) if n in ours or (lean_class and n.startswith(SPIN_PREFIX))}
                best = max(((rps[n], n) for n in vrs if n in rps), default=None)
                if not mine:
                    continue
                if best:
                    ratios = {n: v / best[0] for n, v in mine.items()}
                    lines.append(
                        f"{key}, {cls}: req/s / {best[1]} ({best[0]:,.0f}; target >= 1.0): " + fmt_map(ratios, 2)
                    )
                else:
                    lines.append(f"{key}, {cls}: req/s (no vllm-router rows): " + fmt_map(mine, 0))
    return lines


def fmt_map(d: dict[str, float], nd: int) -> str:
    return ", ".join(f"{k} {H.fmt(v, nd)}" for k, v in d.items())


def title_of(cfg: dict[str, Any]) -> str:
    us = [u for u in cfg.get("spin_us") or [] if u > 0]
    spin = f", spinning heads --busy-poll-us {'/'.join(map(str, us))}" if us else ""
    return (
        f"Router overhead, {cfg['engines']} engines per router, prompt {cfg['prompt_len']} tokens{spin} "
        f"({cfg['reps']} reps, median [min-max])"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2, help="engines behind each router (K)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--requests", type=int, default=400, help="requests per run (at least 4 x concurrency)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=64, help="0: skip the streaming case")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-seconds", type=float, default=900, help="measuring stops here; what was measured is written")
    ap.add_argument("--quick", action="store_true", help="c=1,64; 200 requests; 2 reps")
    ap.add_argument("--name", default="router_overhead")
    ap.add_argument("--no-raw", action="store_true", help="skip the lean drivers' setups (raw zmq and lean http)")
    ap.add_argument(
        "--spin-us",
        type=int,
        nargs="*",
        default=[],
        help="per value N > 0: add 'rb router spin Nus (raw)', one more head started with --busy-poll-us N "
        "(with K engines of its own)",
    )
    ap.add_argument("--no-plot", action="store_true", help="write no PNG (--plot-from draws it later)")
    ap.add_argument("--plot-from", type=Path, help="only draw the PNG (and print the table) from this JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.reps = [1, 64], 200, 2
        args.max_seconds = min(args.max_seconds, 150)
    if args.plot_from:
        doc = json.loads(args.plot_from.read_text())
        H.print_table(table_rows(doc["results"]), title=title_of(doc["config"]))
        print("\n".join(target_lines(doc["results"])))
        plot(doc["results"], args.name, title_of(doc["config"]))
        return

    async def go() -> int:
        t0 = time.monotonic()
        res, vr_skipped = await run(args)
        title = title_of(vars(args))
        H.print_table(table_rows(res), title=title)
        print("issue 24 §1 (medians over repetitions):\n  " + "\n  ".join(target_lines(res)), flush=True)
        skipped = [k for k, v in res.items() if v.get("skipped")]
        cut = [k for k, v in res.items() if v.get("truncated")]
        if skipped or cut:
            print(f"--max-seconds {args.max_seconds:g} passed: cut short {cut}, skipped {skipped}", flush=True)
        print(
            "clients (column 'client'): aiohttp = aiohttp ClientSession (keep-alive pool, every SSE event "
            "decoded); AsyncClient = trainer_bridge.AsyncClient; raw zmq = bench RawDriver (plain zmq DEALER + "
            "add_reader); lean http = bench LeanHttp (raw socket, tokens counted, no JSON decode); one asyncio "
            "process, C tasks per setup; setups interleaved per rep; x vllm-router ratios pair equal clients only"
        )
        H.write_json(
            args.name,
            {
                "config": vars(args),
                "elapsed_s": time.monotonic() - t0,
                "results": res,
                "vllm_router_skipped": vr_skipped,  # None: its rows ran
                "drivers": {
                    "http": "aiohttp.ClientSession, TCPConnector keep-alive pool, one process",
                    "rollout_bus": "trainer_bridge.AsyncClient (zmq DEALER), one process",
                    "rollout_bus_raw": "bench.rb_side.RawDriver: plain zmq DEALER read via loop.add_reader, bus.codec",
                    "http_lean": "bench.http_lean.LeanHttp: asyncio.Protocol keep-alive pool, tokens counted by "
                    "commas, no JSON decode (the raw driver's equal)",
                    "equal_clients": "x vllm-router pairs: AsyncClient with aiohttp, raw zmq with lean http",
                },
            },
        )
        if not args.no_plot:
            plot(res, args.name, title)
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
