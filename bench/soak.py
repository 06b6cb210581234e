"""Soak: a saturated mixed load for --minutes on CPU (issue 13, item 7).

A head and 2 torch engine nodes (tiny model) as real processes; one
AsyncClient runs --concurrency workers, each looping over a random mix of
generate, stream, sample (n=2) and cancel-after-the-first-chunk; every
--control-every-s the control loop runs pause (abort / keep, alternating) →
update_weights (the model's own tensors over zmq) → resume.

Counted: requests and tokens per kind, errors (must be 0), hangs (an op that
did not finish within --hang-s; must be 0), control cycles and their times.
Sampled every --sample-every-s: RSS and open file descriptors of every
process (head, engines with their children, this client). Growth compares
the end of the run (mean of the last 3 samples) with the end of the warm-up
(mean of the 3 samples after the first 10% of the run): must stay < 5%.

    python -m bench.soak --minutes 30     # the issue's run
    python -m bench.soak --minutes 3      # a quick check

Writes bench/results/soak.json and soak.png; exit code 1 when a criterion fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter
from typing import Any

import psutil

from bench import harness as H
from bench import rb_side as RB

GROWTH_LIMIT = 0.05
KINDS = ("generate", "stream", "sample", "cancel")


class Stats:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.hangs: Counter[str] = Counter()
        self.error_samples: list[str] = []
        self.control: list[dict[str, float]] = []


async def _one(client: Any, kind: str, rng: random.Random, vocab: int, st: Stats) -> None:
    prompt = [rng.randrange(4, vocab) for _ in range(rng.randrange(4, 24))]
    params = {"max_tokens": rng.randrange(8, 64), "temperature": 1.0, "ignore_eos": True}
    if kind == "generate":
        r = await client.generate(prompt, params)
        st.tokens[kind] += len(r.token_ids)
    elif kind == "sample":
        r = await client.sample(prompt, 2, params)
        st.tokens[kind] += sum(len(s.tokens) for s in r.sequences)
    elif kind == "stream":
        async for ch in client.stream(prompt, params):
            st.tokens[kind] += len(ch.token_ids)
    else:  # cancel after the first chunk: the stream must still end ("cancelled")
        rid = f"soak-c-{time.monotonic_ns()}-{rng.randrange(1 << 30)}"
        params["max_tokens"] = 2000
        finish = None
        async for ch in client.stream(prompt, params, request_id=rid):
            st.tokens[kind] += len(ch.token_ids)
            if ch.token_ids and finish is None:
                finish = "asked"
                await client.cancel(rid)
            if ch.finish_reason:
                finish = ch.finish_reason
        if finish not in ("cancelled", "length"):
            raise RuntimeError(f"cancelled stream ended with {finish!r}")


async def _worker(client: Any, end: float, seed: int, vocab: int, hang_s: float, st: Stats) -> None:
    rng = random.Random(seed)
    while time.monotonic() < end:
        kind = rng.choices(KINDS, weights=(3, 3, 2, 1))[0]
        try:
            await asyncio.wait_for(_one(client, kind, rng, vocab, st), hang_s)
            st.requests[kind] += 1
        except asyncio.TimeoutError:
            st.hangs[kind] += 1
        except Exception as e:
            st.errors[kind] += 1
            if len(st.error_samples) < 20:
                st.error_samples.append(f"{kind}: {type(e).__name__}: {e}")


async def _control_loop(client: Any, end: float, every_s: float, named: list, hang_s: float, st: Stats) -> None:
    i = 0
    while True:
        await asyncio.sleep(max(0.0, min(every_s, end - time.monotonic())))
        if time.monotonic() >= end:
            return
        mode = ("abort", "keep")[i % 2]
        i += 1
        try:
            t0 = time.perf_counter()
            await asyncio.wait_for(client.pause(mode), hang_s)
            t1 = time.perf_counter()
            await asyncio.wait_for(client.update_weights(named), hang_s)
            t2 = time.perf_counter()
            await asyncio.wait_for(client.resume(), hang_s)
            t3 = time.perf_counter()
            st.control.append({"pause_s": t1 - t0, "update_s": t2 - t1, "resume_s": t3 - t2})
            st.requests["control_cycle"] += 1
        except asyncio.TimeoutError:
            st.hangs["control_cycle"] += 1
        except Exception as e:
            st.errors["control_cycle"] += 1
            if len(st.error_samples) < 20:
                st.error_samples.append(f"control ({mode}): {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(client.resume(), hang_s)
            except Exception:
                pass


def _tree(pid: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _usage(pids: dict[str, int]) -> dict[str, dict[str, float]]:
    """{process name: {rss_mib, fds}}, a process with its children summed."""
    out = {}
    for name, pid in pids.items():
        rss, fds = 0, 0
        for p in _tree(pid):
            try:
                rss += p.memory_info().rss
                fds += p.num_fds()
            except psutil.Error:
                pass
        out[name] = {"rss_mib": rss / 2**20, "fds": float(fds)}
    return out


async def _sampler(pids: dict[str, int], end: float, every_s: float, samples: list) -> None:
    t_start = time.monotonic()
    while True:
        samples.append((time.monotonic() - t_start, _usage(pids)))
        if time.monotonic() >= end:
            return
        await asyncio.sleep(max(0.0, min(every_s, end - time.monotonic())))


def growth(samples: list, warmup_s: float) -> dict[str, dict[str, float]]:
    """Per process: RSS and fds at the end of the warm-up and at the end, and the growth."""
    after = [u for t, u in samples if t >= warmup_s]
    if len(after) < 2:
        raise ValueError(f"{len(samples)} samples: too few after the warm-up ({warmup_s:.0f}s); run longer")
    k = max(1, min(3, len(after) // 4))
    first, last = after[:k], after[-k:]
    out = {}
    for name in after[0]:
        row: dict[str, float] = {}
        for key in ("rss_mib", "fds"):
            a = sum(u[name][key] for u in first) / k
            b = sum(u[name][key] for u in last) / k
            row[f"{key}_warm"] = a
            row[f"{key}_end"] = b
            row[f"{key}_growth"] = (b - a) / a if a else 0.0
        out[name] = row
    return out


async def soak(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from engine_node.tiny_model import ensure_tiny_model, hf_quiet

    model = ensure_tiny_model()
    with hf_quiet():
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    named = [(k, v.detach().clone()) for k, v in m.named_parameters()]
    del m
    st = Stats()
    samples: list = []
    with H.Procs() as procs:
        threads = max(1, (os.cpu_count() or 1) // a.engines)
        cl = RB.start_cluster(
            procs,
            a.engines,
            backend="torch",
            model=model,
            tag="soak",
            backend_options={"threads": threads},
            heartbeat_interval_s=a.heartbeat_interval_s,
        )
        client = RB.make_client(cl.frontend, timeout_s=a.hang_s)
        try:
            await RB.wait_healthy(client, a.engines, 300, procs)
            vocab = min(e["vocab_size"] for e in await client.engines())
            await client.generate([5, 6, 7], {"max_tokens": 4})
            pids = {"head": cl.router_pid, **cl.engine_pids, "client": os.getpid()}
            seconds = a.minutes * 60
            t0 = time.monotonic()
            end = t0 + seconds
            tasks = [_worker(client, end, 1000 + i, vocab, a.hang_s, st) for i in range(a.concurrency)]
            tasks.append(_control_loop(client, end, a.control_every_s, named, a.hang_s, st))
            tasks.append(_sampler(pids, end, a.sample_every_s, samples))
            await asyncio.gather(*tasks)
            wall = time.monotonic() - t0
            dead = [n for n, p in procs.procs if p.poll() is not None]
            head_counters = (await client.stats()).get("counters", {})  # failovers, engine_dead: false deaths show here
        finally:
            await client.close()
    g = growth(samples, a.warmup * seconds)
    return {"stats": st, "samples": samples, "growth": g, "wall_s": wall, "dead": dead, "head": head_counters}


def main(argv: list[str] | None = None) -> int:
    H.setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16, help="request workers (the load stays saturated)")
    ap.add_argument("--control-every-s", type=float, default=20.0)
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of the run before growth is measured")
    ap.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=0.5,
        help="engines' heartbeat (the head declares an engine dead after 3 missed): raise it on an oversubscribed machine",
    )
    ap.add_argument("--hang-s", type=float, default=120.0, help="an op not done within this is a hang")
    a = ap.parse_args(argv)
    r = asyncio.run(soak(a))
    st: Stats = r["stats"]
    g = r["growth"]
    rows = [
        {
            "process": name,
            **{k: v for k, v in row.items()},
            "ok": max(row["rss_mib_growth"], row["fds_growth"]) < GROWTH_LIMIT,
        }
        for name, row in g.items()
    ]
    for row in rows:
        for k in ("rss_mib_growth", "fds_growth"):
            row[k] = f"{100 * row[k]:+.2f}%"
    n_req = sum(v for k, v in st.requests.items() if k != "control_cycle")
    errors, hangs = sum(st.errors.values()), sum(st.hangs.values())
    ctl = st.control
    summary = [
        {
            "minutes": a.minutes,
            "requests": n_req,
            "req/s": n_req / r["wall_s"],
            "tokens": sum(st.tokens.values()),
            **{k: st.requests[k] for k in KINDS},
            "control cycles": st.requests["control_cycle"],
            "pause ms (max)": 1e3 * max((c["pause_s"] for c in ctl), default=0.0),
            "update ms (med)": 1e3 * H.median([c["update_s"] for c in ctl]) if ctl else 0.0,
            "errors": errors,
            "hangs": hangs,
            "dead": len(r["dead"]),
        }
    ]
    title = f"soak: {a.minutes:g} min, {a.engines} torch engines, {a.concurrency} workers, control every {a.control_every_s:g}s"
    H.print_table(summary, title=title)
    H.print_table(
        rows, title=f"growth after the warm-up ({100 * a.warmup:.0f}% of the run); limit {100 * GROWTH_LIMIT:.0f}%"
    )
    for e in st.error_samples:
        print("error:", e)
    print(f"head counters: {r['head']}; load average now: {os.getloadavg()}")
    ok = errors == 0 and hangs == 0 and not r["dead"] and all(row["ok"] for row in rows)
    H.write_json(
        "soak",
        {
            "title": title,
            "ok": ok,
            "summary": summary,
            "growth": g,
            "errors": dict(st.errors),
            "hangs": dict(st.hangs),
            "error_samples": st.error_samples,
            "head_counters": r["head"],
            "load_average": os.getloadavg(),
            "tokens": dict(st.tokens),
            "control": ctl,
            "samples": [{"t": t, **u} for t, u in r["samples"]],
            "args": vars(a),
        },
    )
    names = list(g)
    ts = [t for t, _ in r["samples"]]
    H.plot_lines(
        "soak",
        [
            {
                "title": "RSS (process + children)",
                "xlabel": "seconds",
                "ylabel": "MiB",
                "series": {n: (ts, [u[n]["rss_mib"] for _, u in r["samples"]]) for n in names},
                "logy": True,
            },
            {
                "title": "open file descriptors",
                "xlabel": "seconds",
                "ylabel": "fds",
                "series": {n: (ts, [u[n]["fds"] for _, u in r["samples"]]) for n in names},
            },
        ],
        suptitle=title,
        note=f"{n_req} requests, {errors} errors, {hangs} hangs; growth measured after {100 * a.warmup:.0f}% of the run",
    )
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
