"""Soak: a saturated mixed load for --minutes on CPU (issue 13, item 7).

A head and 2 torch engine nodes (tiny model) as real processes; one
AsyncClient runs --concurrency workers, each looping over a random mix of
generate, stream, sample (n=2) and cancel-after-the-first-chunk; every
--control-every-s the control loop runs pause (abort / keep, alternating) →
update_weights (the model's own tensors over zmq) → resume.

Counted: requests and tokens per kind, errors (must be 0), hangs (an op that
did not finish within --hang-s; must be 0), control cycles and their times.
Every answer is checked against what was asked (bench/token_check.py: each
request sends ignore_eos and max_tokens=N): every sample exactly N tokens,
finish "length", a stream's chunks in order (sample index, nothing after a
sample's final chunk, weight versions never going back); truncated, duplicated
and out-of-order tokens are counted, and any fails the soak. With the null
backend (`--backend null`, or a fault wrapper of it) every token is checked
against the backend's known series as well.
Sampled every --sample-every-s: RSS and open file descriptors of every
process (head, engines with their children, this client). Growth compares
the end of the run (mean of the last 3 samples) with the end of the warm-up
(mean of the 3 samples after the first 10% of the run): must stay < 5%.

    python -m bench.soak --minutes 30     # the issue's run
    python -m bench.soak --minutes 3      # a quick check

Writes bench/results/soak.json and soak.png; exit code 1 when a criterion
fails, 2 when none failed but the run was too short to judge memory growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from typing import Any

import psutil

from bench import harness as H
from bench import rb_side as RB
from bench import token_check as TC

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
        self.check = TC.Tally()  # every answer's tokens and finish against what was asked
        self.expect: TC.Expect | None = None  # the tokens a request must get, where the backend makes that known


async def _one(client: Any, kind: str, rng: random.Random, vocab: int, st: Stats) -> None:
    prompt = [rng.randrange(4, vocab) for _ in range(rng.randrange(4, 24))]
    n = rng.randrange(8, 64)
    params = {"max_tokens": n, "temperature": 1.0, "ignore_eos": True}
    expected = st.expect(prompt, n) if st.expect else None
    if kind == "generate":
        r = await client.generate(prompt, params)
        st.tokens[kind] += len(r.token_ids)
        faults = TC.classify(r.token_ids, n, r.finish_reason, expected)
        vs = r.token_versions
        if any(b < a for a, b in zip(vs, vs[1:], strict=False)):
            faults.append("out_of_order")
        st.check.add(kind, faults, f"{len(r.token_ids)}/{n} {r.finish_reason}")
    elif kind == "sample":
        r = await client.sample(prompt, 2, params)
        st.tokens[kind] += sum(len(s.tokens) for s in r.sequences)
        faults = [] if len(r.sequences) == 2 else ["truncated" if len(r.sequences) < 2 else "duplicated"]
        for s in r.sequences:
            faults += TC.classify(s.tokens, n, s.stop_reason, expected)
        st.check.add(kind, faults, f"{[len(s.tokens) for s in r.sequences]}/{n}")
    elif kind == "stream":
        sc = TC.StreamCheck(1)
        async for ch in client.stream(prompt, params):
            st.tokens[kind] += len(ch.token_ids)
            sc.feed(ch)
        st.check.add(kind, sc.done(n, expected), f"{len(sc.samples[0].tokens)}/{n} {sc.samples[0].finish}")
    else:  # cancel after the first chunk: the stream must still end ("cancelled")
        await _cancelled(client, prompt, params, rng, st)


async def _cancelled(client: Any, prompt: list[int], params: dict[str, Any], rng: random.Random, st: Stats) -> None:
    """A stream cancelled after its first chunk: it ends "cancelled" (or "length"
    if it finished first), its chunks in order; a "length" end has all its tokens."""
    rid = f"soak-c-{time.monotonic_ns()}-{rng.randrange(1 << 30)}"
    n = params["max_tokens"] = 2000
    sc = TC.StreamCheck(1)
    asked = False
    async for ch in client.stream(prompt, params, request_id=rid):
        st.tokens["cancel"] += len(ch.token_ids)
        sc.feed(ch)
        if ch.token_ids and not asked:
            asked = True
            await client.cancel(rid)
    s = sc.samples[0]
    if s.finish not in ("cancelled", "length"):
        raise RuntimeError(f"cancelled stream ended with {s.finish!r}")
    faults = sc.done(n, st.expect(prompt, n) if st.expect else None) if s.finish == "length" else list(sc.faults)
    if s.finish == "cancelled" and st.expect and s.tokens != st.expect(prompt, len(s.tokens)):
        faults.append("wrong_tokens")
    st.check.add("cancel", faults, f"{len(s.tokens)} {s.finish}")


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


def growth(samples: list, warmup_s: float) -> dict[str, dict[str, float]] | None:
    """Per process: RSS and fds at the end of the warm-up and at the end, and the
    growth; None when fewer than 2 samples came after the warm-up (not judged)."""
    after = [u for t, u in samples if t >= warmup_s]
    if len(after) < 2:
        return None
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


def _weights(backend: str) -> tuple[str, list]:
    """(model, the tensors each control cycle sends): the tiny model's own for
    torch; for a model-less backend (null, a fault wrapper of it) a few tensors."""
    import torch

    if backend != "torch":
        return "null", [(f"w{i}", torch.full((256, 64), float(i))) for i in range(4)]
    from transformers import AutoModelForCausalLM

    from engine_node.tiny_model import ensure_tiny_model, hf_quiet

    model = ensure_tiny_model()
    with hf_quiet():
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    named = [(k, v.detach().clone()) for k, v in m.named_parameters()]
    del m
    return model, named


async def soak(a: argparse.Namespace) -> dict[str, Any]:
    model, named = _weights(a.backend)
    st = Stats()
    samples: list = []
    with H.Procs() as procs:
        options = json.loads(a.backend_options)
        if a.backend == "torch":
            options.setdefault("threads", max(1, (os.cpu_count() or 1) // a.engines))
        cl = RB.start_cluster(
            procs,
            a.engines,
            backend=a.backend,
            model=model,
            tag="soak",
            backend_options=options,
            heartbeat_interval_s=a.heartbeat_interval_s,
        )
        client = RB.make_client(cl.frontend, timeout_s=a.hang_s)
        try:
            await RB.wait_healthy(client, a.engines, 300, procs)
            engines = await client.engines()
            vocab = min(e["vocab_size"] for e in engines)
            if all(e["backend"] == "null" for e in engines):  # its tokens are known: check each one
                st.expect = TC.null_series(vocab)
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
    ap.add_argument("--no-plot", action="store_true", help="write no PNG")
    ap.add_argument("--backend", default="torch", help="the engines' backend (`module:factory` for a fault wrapper)")
    ap.add_argument("--backend-options", default="{}", help="JSON options for --backend")
    a = ap.parse_args(argv)
    r = asyncio.run(soak(a))
    st: Stats = r["stats"]
    g = r["growth"]
    rows = growth_rows(g) if g is not None else []
    n_req = sum(v for k, v in st.requests.items() if k != "control_cycle")
    errors, hangs = sum(st.errors.values()), sum(st.hangs.values())
    ctl = st.control
    checks = st.check.as_dict()
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
            **{f: checks[f] for f in TC.FAULTS},
        }
    ]
    title = (
        f"soak: {a.minutes:g} min, {a.engines} {a.backend} engines, {a.concurrency} workers, "
        f"control every {a.control_every_s:g}s"
    )
    H.print_table(summary, title=title)
    n_samples = sum(1 for t, _ in r["samples"] if t >= a.warmup * a.minutes * 60)
    if g is not None:
        H.print_table(
            rows, title=f"growth after the warm-up ({100 * a.warmup:.0f}% of the run); limit {100 * GROWTH_LIMIT:.0f}%"
        )
    else:
        print(f"memory: not judged ({n_samples} samples after the warm-up < 2): run longer")
    for e in st.error_samples + st.check.samples:
        print("error:", e)
    print(f"head counters: {r['head']}; load average now: {os.getloadavg()}")
    criteria: dict[str, bool | None] = {
        "no_errors": errors == 0,
        "no_hangs": hangs == 0,
        "no_deaths": not r["dead"],
        # every answer checked: exactly max_tokens tokens, finish "length", in order, once
        "tokens_exact": st.check.total() == 0 and sum(st.check.checked.values()) > 0,
        "growth_below_5pct": all(row["ok"] for row in rows) if g is not None else None,
    }
    word, rc = H.verdict(criteria)
    for k, v in criteria.items():
        print(f"criterion {k}: {H.criterion(v)}")
    H.write_json(
        "soak",
        {
            "title": title,
            "ok": rc == 0,
            "verdict": word,
            "criteria": criteria,
            "token_checks": checks,
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
    if not a.no_plot:
        plot(r, title, f"{n_req} requests, {errors} errors, {hangs} hangs, {st.check.total()} token faults")
    print(word, flush=True)
    return rc


def growth_rows(g: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    rows = []
    for name, row in g.items():
        ok = max(row["rss_mib_growth"], row["fds_growth"]) < GROWTH_LIMIT
        shown = {k: f"{100 * v:+.2f}%" if k.endswith("_growth") else v for k, v in row.items()}
        rows.append({"process": name, **shown, "ok": ok})
    return rows


def plot(r: dict[str, Any], title: str, note: str) -> None:
    names = list(r["samples"][0][1]) if r["samples"] else []
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
        note=note,
    )


if __name__ == "__main__":
    raise SystemExit(main())
