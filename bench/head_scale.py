"""Head scale: what one head costs per request against the number of engines
behind it (1, 4, 16, 64 null engines; issue 33's design question).

For each engine count K, a fresh head + K null engines on loopback, and the
head process's CPU (psutil) measured in three regimes, reps interleaved:

- ``request``: N requests of max_tokens=1 at concurrency C, not streamed
  (RawDriver, so the head is what saturates, not a client library): the cost
  of admitting, placing, dispatching and relaying one request;
- ``stream``: N streamed requests of 32 tokens, the engines emitting 4 tokens
  per step (8 chunks a request, as a decode stream does): the relay cost;
- ``idle``: no requests, K engines heartbeating (the head's floor at K).

What the table gives per K: requests/s on this machine, the head's CPU %,
and head CPU µs per request (cpu_s / requests: robust to the engines and the
client sharing the cores); ``1e6 / µs`` is the requests/s one head core could
serve, the figure docs/DESIGN-scale.md reasons from ("net of idle": less the
heartbeat floor of K engines over the run, which is paid whatever the load).

Run: ``python -m bench.head_scale`` (``--quick``: K = 1, 4, 16, fewer requests;
``--engines 1 4 16 64``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench import harness as H
from bench import peer_side as PS
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

STREAM_TOKENS = 32
TOKENS_PER_STEP = 4


async def idle_cpu(pid: int, seconds: float) -> float:
    m = H.CpuMeter([pid])
    m.start()
    await asyncio.sleep(seconds)
    return m.stop()["cpu_pct"]


def per_request_us(r: H.RunResult, idle_pct: float) -> None:
    """Head CPU µs per completed request, into the run's extra (with_cpu's
    cpu_s); net: less the idle floor (heartbeats of K engines) over the run."""
    r.extra["head_us_per_req"] = 1e6 * r.extra["cpu_s"] / max(1, r.n)
    idle_s = idle_pct / 100.0 * r.wall_s
    r.extra["head_net_us_per_req"] = 1e6 * max(0.0, r.extra["cpu_s"] - idle_s) / max(1, r.n)


async def one_k(args: argparse.Namespace, k: int, deadline: H.Deadline) -> dict[str, Any]:
    prompt = PS.prompt_ids(args.prompt_len)
    res: dict[str, Any] = {"engines": k}
    with H.Procs() as procs:
        t0 = time.monotonic()
        opts = {"tokens_per_step": TOKENS_PER_STEP}
        cl = RB.start_cluster(procs, k, backend=NULL_BACKEND, backend_options=opts, tag=f"hs{k}")
        client = RB.make_client(cl.frontend)
        raw = RB.RawDriver(cl.frontend)
        try:
            await RB.wait_healthy(client, k, deadline.cap(240), procs)
            res["startup_s"] = time.monotonic() - t0
            await asyncio.sleep(1.0)  # the last joins settle
            res["idle_head_cpu_pct"] = await idle_cpu(cl.router_pid, args.idle_s)
            req = RB.RbLoad(args.requests, args.concurrency, 1, False, prompt)
            strm = RB.RbLoad(args.requests // 2, args.concurrency, STREAM_TOKENS, True, prompt)

            def measured(spec: RB.RbLoad) -> Any:
                run = H.with_cpu([cl.router_pid], lambda: RB.raw_load(raw, spec))

                async def go() -> H.RunResult:
                    r = await run()
                    per_request_us(r, res["idle_head_cpu_pct"])
                    return r

                return go

            runs = await H.interleaved(
                {"request": measured(req), "stream": measured(strm)}, reps=args.reps, warmup=1, deadline=deadline
            )
            res["load"] = {}
            for name, rs in runs.items():
                sm = H.summarize_reps(rs)
                for key in ("head_us_per_req", "head_net_us_per_req"):
                    sm[key] = H.spread([r.extra[key] for r in rs])
                res["load"][name] = sm
        finally:
            await client.close()
            await raw.close()
    return res


def table(res: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    for r in res:
        for name, sm in r["load"].items():
            us = sm["head_net_us_per_req"]["median"]
            rows.append(
                {
                    "engines": str(r["engines"]),
                    "regime": name,
                    "req/s": H.fmt_spread(sm["req_per_s"], 0),
                    "head CPU%": H.fmt_spread(sm["cpu_pct"], 0),
                    "head µs/req": H.fmt_spread(sm["head_us_per_req"], 0),
                    "net of idle": H.fmt_spread(sm["head_net_us_per_req"], 0),
                    "1-core req/s": H.fmt(1e6 / us if us else None, 0),
                    "idle head CPU%": H.fmt(r["idle_head_cpu_pct"], 1),
                    "err": str(sm["errors"]),
                }
            )
    H.print_table(
        rows,
        title=f"Head scale: one head, K null engines (request: max_tokens=1; stream: {STREAM_TOKENS} tokens in "
        f"{STREAM_TOKENS // TOKENS_PER_STEP} chunks; c={args.concurrency}, {args.reps} reps, median [min-max])",
    )


def plot(res: list[dict[str, Any]]) -> None:
    ks = [r["engines"] for r in res]
    rps: dict[str, Any] = {}
    us: dict[str, Any] = {}
    for n in ("request", "stream"):
        sms = [r["load"][n] for r in res]
        rps[n] = (ks, [s["req_per_s"]["median"] for s in sms], [s["req_per_s"]["min"] for s in sms],
                  [s["req_per_s"]["max"] for s in sms])  # fmt: skip
        us[n] = (ks, [s["head_us_per_req"]["median"] for s in sms], [s["head_us_per_req"]["min"] for s in sms],
                 [s["head_us_per_req"]["max"] for s in sms])  # fmt: skip
    idle = {"idle head CPU %": (ks, [r["idle_head_cpu_pct"] for r in res])}
    H.plot_lines(
        "head_scale",
        [
            {
                "title": "requests/s through one head",
                "xlabel": "engines",
                "ylabel": "req/s",
                "series": rps,
                "logx": True,
            },
            {"title": "head CPU per request", "xlabel": "engines", "ylabel": "µs", "series": us, "logx": True},
            {
                "title": "idle head (heartbeats only)",
                "xlabel": "engines",
                "ylabel": "CPU %",
                "series": idle,
                "logx": True,
            },
        ],  # fmt: skip
        suptitle=f"Head scale on {H.machine_info()['cpu_count']} cores: null engines behind one head",
        note="head, engines and client share this machine: µs/request is the portable figure",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--max-seconds", type=float, default=420)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.engines, args.requests, args.reps, args.idle_s = [1, 4, 16], 400, 2, 1.0
        args.max_seconds = min(args.max_seconds, 150)

    async def go() -> int:
        t0 = time.monotonic()
        deadline = H.Deadline(args.max_seconds, "head_scale")
        res = []
        for k in args.engines:
            deadline.check(f"K={k}")
            res.append(await one_k(args, k, deadline))
            print(f"  done K={k} ({deadline.remaining():.0f}s left)", flush=True)
        table(res, args)
        H.write_json("head_scale", {"config": vars(args), "elapsed_s": time.monotonic() - t0, "results": res})
        plot(res)
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
