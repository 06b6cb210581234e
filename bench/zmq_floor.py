"""The floor under issue 24 §1's hop target: what a forwarding process adds to a
zmq round trip when it runs NO Python per message.

Three processes on loopback TCP, c=1, one ~2 KB message each way (a 512-id
prompt's msgpack body is about that size):

    direct       DEALER client -> ROUTER echo server (a Python loop)
    zmq.proxy    DEALER client -> zmq.proxy (libzmq's C loop: ROUTER front,
                 DEALER back) -> the same echo server
    py forward   DEALER client -> the least a Python forwarder does per message
                 (poll both sockets, recv_multipart, send_multipart; no decode)
                 -> the same echo server

`--transport ipc` runs the same over Unix-domain sockets (one host's
processes) instead of loopback TCP.

Each rep runs the three once, in an order rotated by the rep (after one
warm-up round); "added" is the paired difference of the two p50s within each
rep. A
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
import json
import multiprocessing as mp
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from bench import plots, report

PAYLOAD_BYTES = 2100
WARMUP = 200
START_TIMEOUT_S = 10.0  # every wait below names it


def _bind(sock: zmq.Socket, where: str) -> str:
    """`where`: "tcp" (a free loopback port) or "ipc://<folder>/<name>" (measure()'s
    folder, removed when it ends); the address bound."""
    if where.startswith("ipc://"):
        sock.bind(where)
        return where
    return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _echo(where: str, addr_out: Any) -> None:
    s = zmq.Context().socket(zmq.ROUTER)
    addr_out.put(_bind(s, where))
    while True:
        s.send_multipart(s.recv_multipart(copy=False), copy=False)


def _front_and_back(where: str, back_addr: str, addr_out: Any) -> tuple[zmq.Socket, zmq.Socket]:
    """A forwarder's ROUTER front (bound, its address sent back) and DEALER back (connected)."""
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    addr_out.put(_bind(front, where))
    back.connect(back_addr)
    return front, back


def _proxy(where: str, back_addr: str, addr_out: Any) -> None:
    zmq.proxy(*_front_and_back(where, back_addr, addr_out))


def _py_forward(where: str, back_addr: str, addr_out: Any) -> None:
    front, back = _front_and_back(where, back_addr, addr_out)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        for sock, _ in poller.poll():
            if sock is front:
                back.send_multipart(front.recv_multipart(copy=False), copy=False)
            else:
                front.send_multipart(back.recv_multipart(copy=False), copy=False)


def _round_trips_us(ctx: zmq.Context, addr: str, n: int) -> list[float]:
    c = ctx.socket(zmq.DEALER)
    c.setsockopt(zmq.RCVTIMEO, int(START_TIMEOUT_S * 1000))  # a dead peer: zmq.Again, not a hang
    c.connect(addr)
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


def _started(target: Any, *args: Any) -> tuple[Any, str]:
    q: Any = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*args, q), daemon=True)
    p.start()
    try:
        return p, str(q.get(timeout=START_TIMEOUT_S))
    except queue.Empty:
        p.kill()
        raise TimeoutError(f"{target.__name__} did not bind within START_TIMEOUT_S={START_TIMEOUT_S}") from None


ARMS = ("direct", "proxy", "pyfwd")


def measure(n: int, reps: int, transport: str = "tcp") -> dict[str, Any]:
    procs = []
    ctx = zmq.Context()
    folder = tempfile.TemporaryDirectory(prefix="zmqfloor-")

    def where(name: str) -> str:
        return f"ipc://{folder.name}/{name}" if transport == "ipc" else "tcp"

    try:
        echo, echo_addr = _started(_echo, where("echo"))
        procs.append(echo)
        proxy, proxy_addr = _started(_proxy, where("proxy"), echo_addr)
        procs.append(proxy)
        pyfwd, pyfwd_addr = _started(_py_forward, where("pyfwd"), echo_addr)
        procs.append(pyfwd)
        print(f"processes: echo {echo.pid}, zmq.proxy {proxy.pid}, py forward {pyfwd.pid}", flush=True)
        addrs = {"direct": echo_addr, "proxy": proxy_addr, "pyfwd": pyfwd_addr}
        for addr in addrs.values():  # warm-up: connections, caches, the forwarders' first messages
            _round_trips_us(ctx, addr, max(1, n // 10))
        rows: list[dict[str, Any]] = []
        for rep in range(reps):
            # The arms' order rotates per rep, so drift within a rep hits each arm in turn.
            order = ARMS[rep % len(ARMS) :] + ARMS[: rep % len(ARMS)]
            got = {arm: _round_trips_us(ctx, addrs[arm], n) for arm in order}
            d, v, f = got["direct"], got["proxy"], got["pyfwd"]
            row: dict[str, float] = {
                "rep": rep,
                "direct_p50_us": statistics.median(d),
                "proxy_p50_us": statistics.median(v),
                "pyfwd_p50_us": statistics.median(f),
                "direct_p99_us": statistics.quantiles(d, n=100)[98],
                "proxy_p99_us": statistics.quantiles(v, n=100)[98],
                "pyfwd_p99_us": statistics.quantiles(f, n=100)[98],
            }
            row["added_p50_us"] = row["proxy_p50_us"] - row["direct_p50_us"]
            row["pyfwd_added_p50_us"] = row["pyfwd_p50_us"] - row["direct_p50_us"]
            rows.append({**row, "order": list(got)})  # the arms as they ran
        return {
            "n": n,
            "transport": transport,
            "reps": rows,
            "added_p50_us_median": statistics.median(r["added_p50_us"] for r in rows),
            "pyfwd_added_p50_us_median": statistics.median(r["pyfwd_added_p50_us"] for r in rows),
        }
    finally:
        ctx.term()
        for p in procs:
            p.kill()
            p.join(START_TIMEOUT_S)
        folder.cleanup()


def _report(res: dict[str, Any], name: str, plot: bool) -> None:
    """Print the table (and draw the PNG) of one result."""
    print(
        f"zmq round trip over {res.get('transport', 'tcp')}, c=1, {PAYLOAD_BYTES} B each way, {res['n']} per setup and rep (µs)"
    )
    print(
        "| rep | direct p50 | zmq.proxy p50 | added p50 | py forward p50 | added p50 | direct p99 | zmq.proxy p99 |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for r in res["reps"]:
        print(
            f"| {r['rep']} | {r['direct_p50_us']:.0f} | {r['proxy_p50_us']:.0f} | {r['added_p50_us']:.0f} "
            f"| {r['pyfwd_p50_us']:.0f} | {r['pyfwd_added_p50_us']:.0f} "
            f"| {r['direct_p99_us']:.0f} | {r['proxy_p99_us']:.0f} |"
        )
    print(f"added by a C forwarder, median over reps: {res['added_p50_us_median']:.0f} µs (issue 24 §1 target: ≤ 100)")
    print(f"added by the least Python forwarder, median over reps: {res['pyfwd_added_p50_us_median']:.0f} µs")
    if plot:
        plots.plot_bars(
            name,
            [f"rep {r['rep']}" for r in res["reps"]],
            {
                "direct p50": [r["direct_p50_us"] for r in res["reps"]],
                "through zmq.proxy p50": [r["proxy_p50_us"] for r in res["reps"]],
                "through a Python forwarder p50": [r["pyfwd_p50_us"] for r in res["reps"]],
            },
            ylabel="round trip, µs",
            title=f"zmq round trip over {res.get('transport', 'tcp')}, c=1: direct vs a C and a Python forwarder",
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="round trips per setup and rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="loopback TCP or Unix-domain sockets")
    ap.add_argument("--name", default="zmq_floor", help="the JSON/PNG name")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--plot-from", type=Path, help="only print the table and draw the PNG (as --name) from this JSON")
    a = ap.parse_args(argv)
    if a.plot_from is not None:
        _report(json.loads(a.plot_from.read_text()), a.name, True)
        return 0
    res = measure(a.n, a.reps, a.transport)
    _report(res, a.name, not a.no_plot)
    report.write_json(a.name, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
