"""Core overhead (issue 2): the bridge straight to one engine node vs through
the router, torch backend (tiny CPU model), max_tokens=1, concurrency 1 and 64.

One head + one engine node (torch backend, the tiny random-weight model
``engine_node.tiny_model.ensure_tiny_model()`` builds). Both setups use
``trainer_bridge.AsyncClient`` (one asyncio process, C tasks each awaiting
``generate(prompt, max_tokens=1)`` in a loop): one client connected to the
engine's data address, one to the head's frontend; the two are interleaved in
every repetition, and the router's overhead is the per-repetition ratio.

Run: ``python -m bench.core_overhead`` (``--quick``: fewer requests/reps).
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from typing import Any

from bench import harness as H
from bench import rb_side as RB


def tiny_model() -> str:
    from engine_node.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    deadline = H.Deadline(args.max_seconds, "core_overhead")
    model = tiny_model()
    rng = random.Random(0)
    prompt = [rng.randrange(10, 500) for _ in range(args.prompt_len)]
    results: dict[str, Any] = {"model": model}
    with H.Procs() as procs:
        cl = RB.start_cluster(procs, 1, backend="torch", model=model, tag="core")
        router = RB.make_client(cl.frontend)
        direct = RB.make_client(next(iter(cl.engines.values())))
        try:
            await RB.wait_healthy(router, 1, deadline.cap(180), procs)
            for c in args.concurrency:
                n = max(args.requests, 8 * c)
                spec = RB.RbLoad(n, c, 1, False, prompt)
                setups = {
                    "bridge -> engine (direct)": H.with_cpu(
                        [cl.engine_pids[next(iter(cl.engines))]], functools.partial(RB.rb_load, direct, spec)
                    ),
                    "bridge -> router -> engine": H.with_cpu(
                        [cl.router_pid], functools.partial(RB.rb_load, router, spec)
                    ),
                }
                runs = await H.interleaved(setups, reps=args.reps, warmup=1, deadline=deadline)
                d, r = runs["bridge -> engine (direct)"], runs["bridge -> router -> engine"]
                results[f"c={c}"] = {
                    "concurrency": c,
                    "n": n,
                    "setups": {
                        k: {"summary": H.summarize_reps(v), "runs": [x.summary() for x in v]} for k, v in runs.items()
                    },
                    "router_vs_direct": {
                        "p50": H.paired_ratios([x.summary()["p50_ms"] for x in r], [x.summary()["p50_ms"] for x in d]),
                        "p99": H.paired_ratios([x.summary()["p99_ms"] for x in r], [x.summary()["p99_ms"] for x in d]),
                        "req_per_s": H.paired_ratios([x.rps for x in r], [x.rps for x in d]),
                        "p50_added_ms": H.spread(
                            [x.summary()["p50_ms"] - y.summary()["p50_ms"] for x, y in zip(r, d, strict=True)]
                        ),
                    },
                }
                print(f"  done c={c} ({deadline.remaining():.0f}s left)", flush=True)
        finally:
            await router.close()
            await direct.close()
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.reps = 100, 3
        args.max_seconds = min(args.max_seconds, 120)

    async def go() -> int:
        t0 = time.monotonic()
        res = await run(args)
        rows = []
        for key, r in res.items():
            if not key.startswith("c="):
                continue
            for name, s in r["setups"].items():
                sm = s["summary"]
                router = "router" in name
                rv = r["router_vs_direct"]
                rows.append(
                    {
                        "concurrency": str(r["concurrency"]),
                        "path": name,
                        "p50 ms": H.fmt_spread(sm["p50_ms"]),
                        "p99 ms": H.fmt_spread(sm["p99_ms"]),
                        "req/s": H.fmt_spread(sm["req_per_s"], 0),
                        "p50 x direct": H.fmt(rv["p50"]["median"]) if router else "",
                        "+ms p50": H.fmt(rv["p50_added_ms"]["median"], 3) if router else "",
                        "req/s x direct": H.fmt(rv["req_per_s"]["median"]) if router else "",
                        "err": str(sm["errors"]),
                    }
                )
        title = (
            f"Core overhead: torch backend (tiny model), max_tokens=1, prompt {args.prompt_len} tokens, "
            f"{args.reps} reps, median [min-max]"
        )
        H.print_table(rows, title=title)
        print("driver: trainer_bridge.AsyncClient, one asyncio process, C tasks; direct and router interleaved per rep")
        H.write_json(
            "core_overhead",
            {
                "config": vars(args),
                "elapsed_s": time.monotonic() - t0,
                "results": res,
                "driver": "trainer_bridge.AsyncClient, one process, C tasks",
            },
        )
        cs = [k for k in res if k.startswith("c=")]
        names = ["bridge -> engine (direct)", "bridge -> router -> engine"]
        panels = []
        for metric, label in (
            ("p50_ms", "p50 latency (ms)"),
            ("p99_ms", "p99 latency (ms)"),
            ("req_per_s", "requests/s"),
        ):
            series = {n: [res[c]["setups"][n]["summary"][metric]["median"] for c in cs] for n in names}
            errs = {
                n: (
                    [res[c]["setups"][n]["summary"][metric]["min"] for c in cs],
                    [res[c]["setups"][n]["summary"][metric]["max"] for c in cs],
                )
                for n in names
            }
            panels.append(
                {
                    "title": label,
                    "ylabel": label,
                    "groups": [f"concurrency {c[2:]}" for c in cs],
                    "series": series,
                    "errs": errs,
                    "logy": metric != "req_per_s",
                }
            )
        H.plot_bar_panels("core_overhead", panels, suptitle=title)
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
