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
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench import harness as H
from bench import peer_side as PS
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

ORDER = ["rb router", "rb direct", "rb router (raw)", "rb direct (raw)", "vllm-router p2", "http direct"]


async def run_delay(args: argparse.Namespace, delay_ms: float, deadline: H.Deadline) -> dict[str, Any]:
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
        missing = PS.vllm_router_missing()
        if missing:
            print(f"  skipping vllm-router p2: {missing}", flush=True)
        vr_url = "" if missing else PS.start_vllm_router(procs, peers, "power_of_two", tag=f"vr_d{delay_ms:g}")[0]
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
                runs = await H.interleaved(setups, reps=args.reps, warmup=1, deadline=deadline)
                case: dict[str, Any] = {"streams": c, "n": n, "step_delay_ms": delay_ms, "setups": {}}
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
                out[f"delay={delay_ms:g}ms streams={c}"] = case
                print(f"  done delay={delay_ms:g}ms streams={c} ({deadline.remaining():.0f}s left)", flush=True)
        finally:
            await sess.close()
            await rb_router.close()
            await rb_direct.close()
            await raw_router.close()
            await raw_direct.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--min-streams", type=int, default=8, help="streams per run at least (c=1: sequential)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--step-delay-ms", type=float, nargs="+", default=[5.0, 0.0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.step_delay_ms, args.min_streams = 2, [5.0], 4
        args.max_seconds = min(args.max_seconds, 120)

    async def go() -> int:
        t0 = time.monotonic()
        deadline = H.Deadline(args.max_seconds, "stream_latency")
        res: dict[str, Any] = {}
        for d in args.step_delay_ms:
            res.update(await run_delay(args, d, deadline))
        rows = []
        for key, case in res.items():
            for name in ORDER:
                s = case["setups"].get(name)
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
        title = (
            f"Token streaming latency: engine emit -> client receive, {args.max_tokens} tokens per stream, "
            f"1 token per chunk, {args.engines} null engines ({args.reps} reps, median [min-max])"
        )
        H.print_table(rows, title=title)
        H.write_json("stream_latency", {"config": vars(args), "elapsed_s": time.monotonic() - t0, "results": res})
        groups = list(res)
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
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
