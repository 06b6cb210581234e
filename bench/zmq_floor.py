"""The floor under issue 24 §1's hop target: what a forwarding process adds to a
zmq round trip when it runs NO Python per message.

Three processes on loopback TCP, c=1, one ~2 KB message each way (a 512-id
prompt's msgpack body is about that size):

    direct       DEALER client -> ROUTER echo server (a Python loop)
    zmq.proxy    DEALER client -> zmq.proxy (libzmq's C loop: ROUTER front,
                 DEALER back) -> the same echo server

"added" is the paired difference of the two p50s within each rep. A
forwarder pays two extra loopback traversals and libzmq's thread hand-offs
(every send wakes the sending process's I/O thread; every receive crosses
from the I/O thread to the application thread), whatever language forwards
the bytes. The rollout-bus head adds its Python work on top of this floor
(bench.router_overhead measures the head itself).

    python -m bench.zmq_floor [--n 3000] [--reps 3]

Writes bench/results/zmq_floor.{json,png} (or $ROLLOUT_BUS_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import time
from typing import Any

import zmq

from bench import plots, report

PAYLOAD_BYTES = 2100
WARMUP = 200
START_TIMEOUT_S = 10.0  # every wait below names it


def _echo(port_out: Any) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port_out.put(s.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        s.send_multipart(s.recv_multipart(copy=False), copy=False)


def _proxy(back_port: int, port_out: Any) -> None:
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port_out.put(front.bind_to_random_port("tcp://127.0.0.1"))
    back.connect(f"tcp://127.0.0.1:{back_port}")
    zmq.proxy(front, back)


def _round_trips_us(ctx: zmq.Context, port: int, n: int) -> list[float]:
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.RCVTIMEO, int(START_TIMEOUT_S * 1000))  # a dead peer: zmq.Again, not a hang
    c.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * PAYLOAD_BYTES
    try:
        for _ in range(WARMUP):
            c.send(payload)
            c.recv()
        out = []
        for _ in range(n):
            t = time.perf_counter()
            c.send(payload)
            c.recv()
            out.append((time.perf_counter() - t) * 1e6)
        return out
    finally:
        c.close(linger=0)


def _started(target: Any, *args: Any) -> tuple[Any, int]:
    q: Any = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*args, q), daemon=True)
    p.start()
    try:
        return p, int(q.get(timeout=START_TIMEOUT_S))
    except queue.Empty:
        p.kill()
        raise TimeoutError(f"{target.__name__} did not bind within START_TIMEOUT_S={START_TIMEOUT_S}") from None


def measure(n: int, reps: int) -> dict[str, Any]:
    procs = []
    ctx = zmq.Context()
    try:
        echo, echo_port = _started(_echo)
        procs.append(echo)
        proxy, proxy_port = _started(_proxy, echo_port)
        procs.append(proxy)
        print(f"processes: echo {echo.pid}, zmq.proxy {proxy.pid}", flush=True)
        rows = []
        for rep in range(reps):
            d = _round_trips_us(ctx, echo_port, n)
            v = _round_trips_us(ctx, proxy_port, n)
            row = {
                "rep": rep,
                "direct_p50_us": statistics.median(d),
                "proxy_p50_us": statistics.median(v),
                "direct_p99_us": statistics.quantiles(d, n=100)[98],
                "proxy_p99_us": statistics.quantiles(v, n=100)[98],
            }
            row["added_p50_us"] = row["proxy_p50_us"] - row["direct_p50_us"]
            rows.append(row)
        return {"n": n, "reps": rows, "added_p50_us_median": statistics.median(r["added_p50_us"] for r in rows)}
    finally:
        ctx.term()
        for p in procs:
            p.kill()
            p.join(START_TIMEOUT_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="round trips per setup and rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    res = measure(a.n, a.reps)
    print(f"zmq round trip, c=1, {PAYLOAD_BYTES} B each way, {a.n} per setup and rep (µs)")
    print("| rep | direct p50 | zmq.proxy p50 | added p50 | direct p99 | zmq.proxy p99 |\n|---|---|---|---|---|---|")
    for r in res["reps"]:
        print(
            f"| {r['rep']} | {r['direct_p50_us']:.0f} | {r['proxy_p50_us']:.0f} | {r['added_p50_us']:.0f} "
            f"| {r['direct_p99_us']:.0f} | {r['proxy_p99_us']:.0f} |"
        )
    print(f"added by a C forwarder, median over reps: {res['added_p50_us_median']:.0f} µs (issue 24 §1 target: ≤ 100)")
    report.write_json("zmq_floor", res)
    if not a.no_plot:
        reps = [f"rep {r['rep']}" for r in res["reps"]]
        plots.plot_bars(
            "zmq_floor",
            reps,
            {
                "direct p50": [r["direct_p50_us"] for r in res["reps"]],
                "through zmq.proxy p50": [r["proxy_p50_us"] for r in res["reps"]],
            },
            ylabel="round trip, µs",
            title="zmq round trip, c=1: direct vs a C forwarder (zmq.proxy)",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
