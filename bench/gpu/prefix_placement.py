"""Prefix-aware placement on a GRPO-shaped workload, side by side (issue 24 §2):
rollout-bus `--policy least_loaded` and `--policy prefix` against vllm-router
(`cache_aware`, its prefix-aware policy; `consistent_hash`, `power_of_two` as
references), two vLLM engines per arm, one on each of two GPUs.

The workload: P prompts (default 64) × S samples (default 8), every sample
sent as its OWN request (as a trainer that does not use n > 1 sends them),
all at once; every prompt = one long shared system prompt (default 1000
token ids) + a question of its own (32-128 ids), 128 new tokens, ignore_eos.

The arms (all alive at once, in ONE phase):
- rollout-bus, one cluster per `--policies` entry: `launch.py --engines 2
  --gpus 0,1 --gpu-memory-utilization F --policy X` (both engines start at
  once, one per GPU; with `--gpus 0,0` the second joins with `--join` once the
  first is up), `AsyncClient.generate` per request;
- vllm-router, one process per `--vllm-router` policy, all in front of the
  SAME two vLLM OpenAI api_servers (one per GPU, started at once), aiohttp
  `/v1/completions` with token-id prompts (bench/gpu/prefix_vllm_router.py).
Start-ups run one arm after another (each takes both GPUs at once: never two
vLLM start-ups on one GPU together), then each arm serves a warm-up batch.
Rep r then runs every arm once, in an order rotated by r; every (rep, arm)
has its own system prompt, so nothing is cached from before.

Why interleaved rather than a fresh cluster per arm in turn: the device VMs'
pace drifts by up to ±20 % from minute to minute (tests/gpu/RESULTS.md runs
17-21), and sequential arms would compare different minutes; the router
references cost only a router process each here (they share the servers),
where a fresh cluster per arm costs a start-up round (~40-90 s) each. The
cost: three engines per GPU (`--gpu-fraction` 0.25 each) and three start-up
rounds before the first rep, about as long as sequential arms would take.

Reported per arm and rep: tokens/s (generated tokens / wall of the batch),
vLLM's prefix-cache hit rate (prompt tokens found cached / looked up, summed
over both engines: rollout-bus from the backend's `prefix_cache_hits` /
`prefix_cache_queries` stats counters, `log_stats` on; vllm-router from the
servers' `/metrics` `vllm:prefix_cache_hits_total` / `..._queries_total`,
before and after), requests per engine, prompts whose samples landed on more
than one engine and an "ideal-cache" hit rate computed from the placements
alone (blocks of 16 ids a request shares with an earlier request on the same
engine, as an unbounded prefix cache would hit); the last two need to know
each request's engine, which vLLM's server does not say (n/a there). The
CPU dry run (`--cpu`; torch or null engines, `bench.http_peer --prefix-cache`
servers behind the real vllm-router) exercises all of it but the numbers.

    python -m bench.gpu.prefix_placement --model /tmp/q05 --out-dir $OUT    # GPU (bench/gpu/run_prefix_on_device.sh)
    python -m bench.gpu.prefix_placement --cpu --out-dir /tmp/pp            # dry run (torch backend, tiny model)
    python -m bench.gpu.prefix_placement --cpu --cpu-backend null --vllm-router cache_aware  # plumbing only (CI)

`--budget-s` bounds the whole run (start-ups included): a rep is not started
when the last one would not fit. Writes gpu_prefix_placement.{json,txt,png}
in --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import prefix_rb_arm as RB
from bench.gpu import prefix_vllm_router as VR
from bench.http_peer import PrefixCounter

NAME = "gpu_prefix_placement"


# ---------------------------------------------------------------- workload


def workload(spec: dict[str, Any], vocab: int, salt: int, arm: int = 0) -> list[tuple[int, list[int]]]:
    """[(prompt index, token ids)] in send order: prompt-major, each sample alone.
    The shape (question lengths) follows `salt`; the ids follow `salt` and
    `arm`, so every arm of one rep gets its own system prompt of the same shape."""
    w = spec["workload"]
    shape = random.Random(w["seed"] * 1000 + salt)
    rng = random.Random((w["seed"] * 1000 + salt) * 64 + arm)
    lo = 10  # clear of special ids at the bottom of the vocabulary
    system = [rng.randrange(lo, vocab) for _ in range(w["system_tokens"])]
    lens = [shape.randint(w["question_min"], w["question_max"]) for _ in range(w["prompts"])]
    prompts = [system + [rng.randrange(lo, vocab) for _ in range(n)] for n in lens]
    return [(i, p) for i, p in enumerate(prompts) for _ in range(w["samples"])]


def ideal_cache_hits(placed: list[tuple[str, list[int]]]) -> tuple[int, int]:
    """(prompt ids an unbounded per-engine prefix cache would hit, prompt ids):
    full blocks a request shares with an earlier request on its engine (one
    bench.http_peer.PrefixCounter per engine: the HTTP twin counts the same)."""
    caches: dict[str, PrefixCounter] = {}
    for engine, prompt in placed:
        caches.setdefault(engine, PrefixCounter()).add(prompt)
    return sum(c.hits for c in caches.values()), sum(c.queries for c in caches.values())


# ---------------------------------------------------------------- the phase (child process)


def phase_all(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_all(spec))


async def _all(spec: dict[str, Any]) -> dict[str, Any]:
    """Start every arm (rollout-bus clusters first, one after another, then the
    vLLM servers and the routers), warm each up, then the reps: rep r runs every
    arm once, in an order rotated by r."""
    end = time.monotonic() + spec["limit_s"]
    out: dict[str, Any] = {"arms": {}, "order": []}
    spec["_partial"].update(out)
    arms: dict[str, Any] = {}
    vr_pols = spec["vllm_router"]
    with H.Procs(log_dir=Path(spec["log_dir"])) as procs, contextlib.ExitStack() as stack:
        session = VR.make_session() if vr_pols else None
        try:
            for pol in spec["policies"]:
                rec = out["arms"].setdefault(pol, {"reps": []})
                try:
                    arms[pol] = RB.start(stack, spec, pol, rec)
                except Exception as e:  # a failed arm is a row with its error; the others still run
                    rec["error"] = f"start: {type(e).__name__}: {e}"[:2000]
                G.checkpoint(spec)
            if vr_pols:
                await _start_vr(procs, session, spec, vr_pols, out, arms)
            for k, (name, arm) in enumerate(arms.items()):
                warm = workload({**spec, "workload": {**spec["workload"], "prompts": 2, "samples": 2}},
                                spec["vocab"], salt=999, arm=k)  # fmt: skip
                res = await arm.send(warm, {**_params(spec), "max_tokens": 4})
                bad = [repr(r)[:200] for r in res if isinstance(r, BaseException)]
                if bad:  # recorded; the reps say whether the arm recovered
                    out["arms"][name]["warmup_errors"] = bad
            await _reps(spec, arms, out, end)
        finally:
            for arm in arms.values():
                await arm.close()
            if session is not None:
                await session.close()
    return out


def _params(spec: dict[str, Any]) -> dict[str, Any]:
    return {"max_tokens": spec["max_tokens"], "temperature": spec["temperature"], "ignore_eos": True}


async def _reps(spec: dict[str, Any], arms: dict[str, Any], out: dict[str, Any], end: float) -> None:
    names = list(arms)
    rep_s = 0.0
    for rep in range(spec["reps"]):
        if rep and time.monotonic() + 1.3 * rep_s > end:
            out["stopped"] = f"rep {rep} skipped: the last took {rep_s:.0f}s, {end - time.monotonic():.0f}s left"
            break
        t_rep = time.monotonic()
        order = names[rep % len(names) :] + names[: rep % len(names)]
        out["order"].append(order)
        for name in order:
            # every (rep, arm) has its own system prompt: no arm hits a cache another arm filled
            reqs = workload(spec, spec["vocab"], salt=rep, arm=names.index(name))
            arm = arms[name]
            before = await arm.counters()
            t0 = time.perf_counter()
            results = await arm.send(reqs, _params(spec))
            wall = time.perf_counter() - t0
            after = await arm.counters()
            out["arms"][name]["reps"].append(_summarize(rep, reqs, results, wall, before, after, spec))
            extra = await arm.extra()
            if extra:
                out["arms"][name].update(extra)
            G.checkpoint(spec)
        rep_s = time.monotonic() - t_rep


async def _start_vr(
    procs: H.Procs, session: Any, spec: dict[str, Any], pols: list[str], out: dict[str, Any], arms: dict[str, Any]
) -> None:
    names = [f"vllm-router:{p}" for p in pols]
    for n in names:
        out["arms"].setdefault(n, {"reps": []})
    try:
        urls, starts = await VR.start_servers(procs, session, spec)
        routers = VR.start_routers(procs, urls, pols)
    except Exception as e:  # every vllm-router row says why; the rollout-bus arms still run
        procs.kill_all()  # the servers that did start hold GPU memory
        for n in names:
            out["arms"][n]["error"] = f"start: {type(e).__name__}: {e}"[:2000]
        return
    for pol, n in zip(pols, names, strict=True):
        out["arms"][n].update(server_start_s=starts, servers=urls, router=routers[pol])
        arms[n] = VR.VrArm(session, routers[pol], urls, spec["model"], spec["request_timeout_s"])


def _summarize(
    rep: int,
    reqs: list[tuple[int, list[int]]],
    results: list[Any],
    wall: float,
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    spec: dict[str, Any],
) -> dict[str, Any]:
    """One arm's rep. `results`: per request (engine or None, generated tokens)
    or the exception; `before`/`after`: per engine, the prefix-cache counters
    (and, from vLLM servers, requests)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    ok = [(i, p, r[0], r[1]) for (i, p), r in zip(reqs, results, strict=True) if not isinstance(r, BaseException)]
    tokens = sum(n for *_, n in ok)
    known = bool(ok) and all(e is not None for _, _, e, _ in ok)  # vLLM servers' ids do not name the server
    per_engine: dict[str, int] = {}
    homes: dict[int, set[str]] = {}
    for i, _, e, _ in ok if known else ():
        per_engine[e] = per_engine.get(e, 0) + 1
        homes.setdefault(i, set()).add(e)
    q = h = 0
    have_counters = False
    for eid, a in after.items():
        b = before.get(eid, {})
        if "prefix_cache_queries" in a:
            have_counters = True
            q += int(a["prefix_cache_queries"] - b.get("prefix_cache_queries", 0))
            h += int(a.get("prefix_cache_hits", 0) - b.get("prefix_cache_hits", 0))
        if not known and "requests" in a:
            per_engine[eid] = int(a["requests"] - b.get("requests", 0))
    ideal = ideal_cache_hits([(e, p) for _, p, e, _ in ok]) if known else (0, 0)
    return {
        "rep": rep,
        "requests": len(reqs),
        "errors": len(errors),
        "error_sample": [repr(e)[:200] for e in errors[:3]],
        "tokens": tokens,
        "expected_tokens": len(reqs) * spec["max_tokens"],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
        "per_engine": dict(sorted(per_engine.items())),
        "split_prompts": sum(1 for s in homes.values() if len(s) > 1) if known else None,
        "ideal_cache_hit_rate": round(ideal[0] / ideal[1], 4) if ideal[1] else None,
        "prefix_cache_hit_rate": round(h / q, 4) if have_counters and q else None,
        "prefix_cache_queries": q if have_counters else None,
        "prefix_cache_hits": h if have_counters else None,
    }


# ---------------------------------------------------------------- report


def _median(xs: list[float]) -> float | None:
    # statistics.median: with an even count (2 reps) the mean of the middle two,
    # not the upper one (which reported the better rep as the median)
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for pol, res in doc.get("policies", {}).items():
        reps = res.get("reps") or []
        table[pol] = {
            "ok": res.get("ok"),
            "error": res.get("error"),
            "reps": len(reps),
            "tokens_per_s": _median([r["tokens_per_s"] for r in reps]),
            "prefix_cache_hit_rate": _median([r["prefix_cache_hit_rate"] for r in reps]),
            "ideal_cache_hit_rate": _median([r["ideal_cache_hit_rate"] for r in reps]),
            "split_prompts": _median([r["split_prompts"] for r in reps]),
            "errors": sum(r["errors"] for r in reps),
            "per_engine": reps[-1]["per_engine"] if reps else None,
        }
    doc["summary"] = table
    return table


def report(doc: dict[str, Any]) -> str:
    table = doc.get("summary") or summarize(doc)
    w = doc["config"]
    lines = [
        f"{NAME}: {w['prompts']} prompts x {w['samples']} samples (separate requests), shared system prompt "
        f"{w['system_tokens']} ids, {w['max_tokens']} new tokens, arms interleaved over {w['reps']} reps; "
        f"{doc.get('gpu')} {doc.get('date')}",
        f"{'arm':<28} {'tokens/s':>10} {'vLLM prefix hit':>16} {'ideal-cache hit':>16} {'split prompts':>14} "
        f"{'errors':>7}  requests per engine",
    ]

    def pct(v: Any) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    for pol, r in table.items():
        if not r["reps"]:
            lines.append(f"{pol:<28} FAILED: {str(r.get('error'))[:200]}")
            continue
        split = "n/a" if r["split_prompts"] is None else f"{r['split_prompts']:g}"
        lines.append(
            f"{pol:<28} {r['tokens_per_s'] or 0:>10.0f} {pct(r['prefix_cache_hit_rate']):>16} "
            f"{pct(r['ideal_cache_hit_rate']):>16} {split:>14} {r['errors']:>7}  {r['per_engine']}"
        )
    if w.get("cpu") and any(p.startswith("vllm-router") for p in table):
        lines.append("(--cpu: the vllm-router rows' 'vLLM prefix hit' is bench.http_peer's unbounded-cache count)")
    if doc.get("vllm_router_skipped"):
        lines.append(f"vllm-router arms skipped: {doc['vllm_router_skipped']}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(doc: dict[str, Any], png: Path) -> None:
    try:
        from bench.plots import _plt

        plt = _plt()
    except Exception as e:  # matplotlib missing on the device: redraw here with --plot-from
        print(f"no plot ({e!r})")
        return
    table = doc.get("summary") or summarize(doc)
    pols = [p for p, r in table.items() if r["reps"]]
    if not pols:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(pols, [table[p]["tokens_per_s"] or 0 for p in pols], color="#4477aa")
    axes[0].set_ylabel("tokens/s (median of reps)")
    x = range(len(pols))
    axes[1].bar([i - 0.2 for i in x], [100 * (table[p]["prefix_cache_hit_rate"] or 0) for p in pols], 0.4,
                label="vLLM prefix cache")  # fmt: skip
    axes[1].bar([i + 0.2 for i in x], [100 * (table[p]["ideal_cache_hit_rate"] or 0) for p in pols], 0.4,
                label="ideal cache (from placements)")  # fmt: skip
    axes[1].set_xticks(list(x), pols)
    axes[1].set_ylabel("prompt tokens hit (%)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{NAME}: {doc['config']['prompts']}x{doc['config']['samples']} GRPO requests, 2 engines")
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}", flush=True)


# ---------------------------------------------------------------- main


# --cpu: a reduced workload (flags given still win)
CPU_DEFAULTS: dict[str, Any] = dict(
    prompts=6, samples=4, system_tokens=64, question_min=8, question_max=24, max_tokens=2
)
CPU_DEFAULTS.update(reps=1, budget_s=240.0, min_phase_s=20.0)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run: torch backend, tiny model, a reduced workload",
        **dict(seed=0, gpu_fraction=None, max_model_len=2048, ready_timeout_s=300.0, request_timeout_s=300.0),
        **dict(budget_s=300.0, min_phase_s=60.0),
    )
    ap.add_argument(
        "--cpu-backend",
        default="torch",
        help="--cpu: torch (tiny model) or null (no model: placement only, fast)",
    )
    ap.add_argument("--policies", default="least_loaded,prefix", help="rollout-bus --policy arms (one cluster each)")
    ap.add_argument(
        "--vllm-router",
        default="cache_aware,consistent_hash,power_of_two",
        metavar="POLICY[,POLICY]",
        help=f"vllm-router arms, all in front of one pair of vLLM servers ({', '.join(VR.POLICIES)}); "
        "empty: none. Without vllm-router (or vLLM, on a GPU) they are rows with the reason",
    )
    ap.add_argument(
        "--engine-args",
        default='{"max_num_seqs": 1024, "max_num_batched_tokens": 8192}',
        help="JSON: vLLM engine arguments of EVERY engine (rollout-bus backend options, api_server flags), so no "
        "arm runs on other scheduler defaults (these are the api_server's own on an H100/H200)",
    )
    ap.add_argument(
        "--gpus",
        default=None,
        help="the two GPUs, one engine of every arm on each (default 0,1; 0,0 on a one-GPU machine; "
        "--gpu-fraction defaults to 0.25 on two GPUs, 0.12 on one)",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--question-min", type=int, default=32)
    ap.add_argument("--question-max", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    return G.parse_args(ap, argv, CPU_DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if G.replot(a, report, plot):
        return 0
    od = G.out_dir(a.out_dir)
    null = a.cpu and a.cpu_backend != "torch"
    model = (a.model or "null") if null else G.model_of(a)
    log_dir = G.log_dir_of(a, od, NAME)
    env = G.probe_env()
    gpus = ((a.gpus or ("0,1" if env.get("gpus", 0) >= 2 or a.cpu else "0")).split(",") * 2)[:2]
    if a.gpu_fraction is None:  # three engines per GPU (two rollout-bus clusters, one api_server), six on one
        a.gpu_fraction = 0.25 if gpus[0] != gpus[1] else 0.12
    vr_pols = [p for p in a.vllm_router.split(",") if p]
    VR.check_policies(vr_pols)
    spec = {
        "model": model,
        "cpu": a.cpu,
        "cpu_backend": a.cpu_backend,
        "gpus": gpus,
        "vocab": 32000 if null else G.model_vocab(model),
        "workload": {
            "prompts": a.prompts,
            "samples": a.samples,
            "system_tokens": a.system_tokens,
            "question_min": a.question_min,
            "question_max": a.question_max,
            "seed": a.seed,
        },
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "reps": a.reps,
        "gpu_fraction": a.gpu_fraction,
        "max_model_len": a.max_model_len,
        "ready_timeout_s": a.ready_timeout_s,
        "request_timeout_s": a.request_timeout_s,
        "log_dir": str(log_dir),
        "policies": [p for p in a.policies.split(",") if p],
        "vllm_router": vr_pols,
        "engine": json.loads(a.engine_args),
    }
    doc = G.result_doc(NAME, a, env, policies={}, vllm_router_env=VR.env_note())
    budget = G.Budget(a.budget_s)
    why = VR.missing(a.cpu) if vr_pols else None
    if why:  # the rows stay, with the reason (as the CPU router benches record vllm_router_skipped)
        doc["vllm_router_skipped"] = why
        spec["vllm_router"] = []
    # every arm in ONE phase: all alive at once, reps interleaved (the module docstring says why)
    spec["limit_s"] = budget.left() - 15  # the phase's own deadline for starting another rep
    res = G.run_phase(NAME, "bench.gpu.prefix_placement:phase_all", spec, budget.left(), log_dir)
    arms = res.get("arms") or {}
    for pol in [*spec["policies"], *(f"vllm-router:{p}" for p in vr_pols)]:
        rec = arms.get(pol) or {"reps": []}
        err = rec.get("error") or (f"skipped: {why}" if why and pol.startswith("vllm-router") else None)
        if not rec["reps"] and not err:
            err = res.get("error") or "no rep finished"
        doc["policies"][pol] = {**rec, "ok": bool(rec["reps"]) and not rec.get("error"), "error": err}
    doc["phase"] = {k: v for k, v in res.items() if k != "arms"}
    summarize(doc)
    doc["wall_s"] = round(budget.elapsed(), 1)
    G.write_doc(od / f"{NAME}.json", doc)
    text = report(doc)
    (od / f"{NAME}.txt").write_text(text + "\n")
    plot(doc, od / f"{NAME}.png")
    return (
        0 if all(r.get("ok") for r in doc["policies"].values() if not str(r.get("error")).startswith("skipped")) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
