"""Token streaming latency: engine emits a token → the client has it.

Measured per chunk as ``client time.time() - Chunk.emitted_at`` (the engine
stamps ``emitted_at`` with time.time() when it sends the chunk; client and
engines run on this machine, so they share one clock). One token per chunk:
K null engines with ``tokens_per_step=1`` and ``step_delay_s`` = the decode
step time (default 5 ms, a real engine's pace; 0 = back to back, the worst
case: every stream's tokens at once). 1 and 256 concurrent streams of
``max_tokens`` tokens.

Setups, interleaved in each repetition:
  rb router / rb direct          trainer_bridge.AsyncClient.stream through the
                                 head / straight to one engine (received_at is
                                 stamped when the client hands the chunk over)
  rb router (raw) / direct (raw) bench RawDriver (lean zmq client): the
                                 transport without the client library's cost
  http direct / vllm-router p2   the HTTP twin: http_peer with the same step
                                 delay, SSE events carrying a bench-only
                                 ``emitted_at``; aiohttp client

Run: ``python -m bench.stream_latency`` (``--quick``: fewer repetitions).
``--max-seconds`` bounds the measuring: the case running when it passes keeps
its complete repetitions, later ones are listed as skipped, and the JSON is
written all the same. ``--no-plot`` / ``--plot-from JSON`` draw the PNG apart.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import peer_side as PS
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

ORDER = ["rb router", "rb direct", "rb router (raw)", "rb direct (raw)", "vllm-router p2", "http direct"]


async def run_delay(
    args: argparse.Namespace, delay_ms: float, deadline: H.Deadline
) -> tuple[dict[str, Any], str | None]:
    """{case: summary} for one step delay, and why vllm-router's rows are missing (None: they ran)."""
    prompt = PS.prompt_ids(args.prompt_len)
    out: dict[str, Any] = {}
    with H.Procs() as procs:
        peers = PS.start_http_peers(
            procs,
            args.engines,
            tokens_per_event=1,
            tag=f"peer_d{delay_ms:g}_",
            extra=["--step-delay-ms", str(delay_ms)],
        )
        started, why = PS.try_vllm_routers(procs, peers, ["power_of_two"], tag=f"vr_d{delay_ms:g}")
        if why:
            print(f"  skipping vllm-router p2: {why}", flush=True)
        vr_url = started["power_of_two"][0] if started else ""
        cl = RB.start_cluster(
            procs,
            args.engines,
            backend=NULL_BACKEND,
            tag=f"rb_d{delay_ms:g}",
            backend_options={"tokens_per_step": 1, "step_delay_s": delay_ms / 1e3},
        )
        rb_router = RB.make_client(cl.frontend)
        rb_direct = RB.make_client(next(iter(cl.engines.values())))
        raw_router = RB.RawDriver(cl.frontend)
        raw_direct = RB.RawDriver(next(iter(cl.engines.values())))
        sess = PS.make_session(max(args.streams) + 8)
        try:
            await RB.wait_healthy(rb_router, args.engines, 120, procs)
            for u in (peers[0], vr_url):
                if u:
                    await PS.wait_ready(sess, u)
            for c in args.streams:
                n = max(c, args.min_streams)
                key = f"delay={delay_ms:g}ms streams={c}"
                if deadline.remaining() <= 0:
                    out[key] = {"streams": c, "n": n, "step_delay_ms": delay_ms, "skipped": "--max-seconds passed"}
                    print(f"  skipped {key}: --max-seconds passed", flush=True)
                    continue
                spec = RB.RbLoad(n, c, args.max_tokens, True, prompt, record_stream_lag=True)
                hspec = lambda url, n=n, c=c: PS.HttpLoad(
                    url, n, c, args.max_tokens, True, prompt, record_stream_lag=True
                )
                setups: dict[str, Callable[[], Awaitable[H.RunResult]]] = {
                    "rb router": functools.partial(RB.rb_load, rb_router, spec),
                    "rb direct": functools.partial(RB.rb_load, rb_direct, spec),
                    "rb router (raw)": functools.partial(RB.raw_load, raw_router, spec),
                    "rb direct (raw)": functools.partial(RB.raw_load, raw_direct, spec),
                    "vllm-router p2": functools.partial(PS.http_load, sess, hspec(vr_url)),
                    "http direct": functools.partial(PS.http_load, sess, hspec(peers[0])),
                }
                if not vr_url:
                    setups.pop("vllm-router p2")
                runs, cut = await H.interleaved_within(setups, reps=args.reps, deadline=deadline)
                case: dict[str, Any] = {"streams": c, "n": n, "step_delay_ms": delay_ms, "setups": {}}
                if cut:
                    case["truncated" if runs else "skipped"] = "--max-seconds passed"
                for name, rs in runs.items():
                    per_rep = []
                    for r in rs:
                        lags = r.extra.pop("lags_s", [])
                        per_rep.append(
                            {
                                "lag_p50_ms": H.percentile(lags, 50) * 1e3,
                                "lag_p99_ms": H.percentile(lags, 99) * 1e3,
                                "chunks": len(lags),
                                **r.summary(),
                            }
                        )
                    case["setups"][name] = {
                        "lag_p50_ms": H.spread([p["lag_p50_ms"] for p in per_rep]),
                        "lag_p99_ms": H.spread([p["lag_p99_ms"] for p in per_rep]),
                        "stream_p50_ms": H.spread([p["p50_ms"] for p in per_rep]),
                        "errors": sum(p["errors"] for p in per_rep),
                        "runs": per_rep,
                    }
                out[key] = case
                print(
                    f"  done {key}{' (cut by --max-seconds)' if cut else ''} ({deadline.remaining():.0f}s left)",
                    flush=True,
                )
        finally:
            await sess.close()
            await rb_router.close()
            await rb_direct.close()
            await raw_router.close()
            await raw_direct.close()
    return out, why


def title_of(cfg: dict[str, Any]) -> str:
    return (
        f"Token streaming latency: engine emit -> client receive, {cfg['max_tokens']} tokens per stream, "
        f"1 token per chunk, {cfg['engines']} null engines ({cfg['reps']} reps, median [min-max])"
    )


def table_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, case in res.items():
        for name in ORDER:
            s = case.get("setups", {}).get(name)
            if s:
                rows.append(
                    {
                        "case": key,
                        "setup": name,
                        "lag p50 ms": H.fmt_spread(s["lag_p50_ms"], 3),
                        "lag p99 ms": H.fmt_spread(s["lag_p99_ms"], 3),
                        "stream p50 ms": H.fmt(s["stream_p50_ms"]["median"]),
                        "err": str(s["errors"]),
                    }
                )
    return rows


def plot(res: dict[str, Any], title: str) -> None:
    groups = [g for g, case in res.items() if case.get("setups")]
    panels = []
    for metric, label in (("lag_p50_ms", "p50 lag (ms)"), ("lag_p99_ms", "p99 lag (ms)")):
        series = {
            n: [res[g]["setups"][n][metric]["median"] for g in groups]
            for n in ORDER
            if all(n in res[g]["setups"] for g in groups)
        }
        errs = {
            n: (
                [res[g]["setups"][n][metric]["min"] for g in groups],
                [res[g]["setups"][n][metric]["max"] for g in groups],
            )
            for n in series
        }
        panels.append(
            {
                "title": label,
                "ylabel": "ms",
                "groups": [g.replace(" ", "\n") for g in groups],
                "series": series,
                "errs": errs,
                "logy": True,
            }
        )
    H.plot_bar_panels(
        "stream_latency",
        panels,
        suptitle=title,
        note="lag = client time.time() - emitted_at stamped by the engine (same machine clock)",
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--min-streams", type=int, default=8, help="streams per run at least (c=1: sequential)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--step-delay-ms", type=float, nargs="+", default=[5.0, 0.0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=600, help="measuring stops here; what was measured is written")
    ap.add_argument("--quick", action="store_true", help="2 reps, 5 ms steps only, 4 streams at least")
    ap.add_argument("--no-plot", action="store_true", help="write no PNG (--plot-from draws it later)")
    ap.add_argument("--plot-from", type=Path, help="only draw the PNG (and print the table) from this JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.step_delay_ms, args.min_streams = 2, [5.0], 4
        args.max_seconds = min(args.max_seconds, 120)
    if args.plot_from:
        doc = json.loads(args.plot_from.read_text())
        H.print_table(table_rows(doc["results"]), title=title_of(doc["config"]))
        plot(doc["results"], title_of(doc["config"]))
        return

    async def go() -> int:
        t0 = time.monotonic()
        deadline = H.Deadline(args.max_seconds, "stream_latency")
        res: dict[str, Any] = {}
        vr_skipped: str | None = None
        for d in args.step_delay_ms:
            if deadline.remaining() > 0:
                got, why = await run_delay(args, d, deadline)
                res.update(got)
                vr_skipped = vr_skipped or why
            else:  # no clusters started for a delay with no time left
                for c in args.streams:
                    res[f"delay={d:g}ms streams={c}"] = {"streams": c, "step_delay_ms": d, "skipped": "--max-seconds"}
        title = title_of(vars(args))
        H.print_table(table_rows(res), title=title)
        short = [k for k, v in res.items() if v.get("skipped") or v.get("truncated")]
        if short:
            print(f"--max-seconds {args.max_seconds:g} passed: cut short or skipped {short}", flush=True)
        H.write_json(
            "stream_latency",
            {
                "config": vars(args),
                "elapsed_s": time.monotonic() - t0,
                "results": res,
                "vllm_router_skipped": vr_skipped,  # None: its rows ran
            },
        )
        if not args.no_plot:
            plot(res, title)
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
