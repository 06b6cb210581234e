"""Prefix-aware placement on a GRPO-shaped workload: `--policy prefix` vs
`least_loaded`, two engines on one GPU (issue 24 §2).

The workload: P prompts (default 64) × S samples (default 8), every sample
sent as its OWN request (as a trainer that does not use n > 1 sends them),
all at once; every prompt = one long shared system prompt (default 1000
token ids) + a question of its own (32-128 ids). Per policy, a fresh cluster
(`launch.py --engines 1 --gpus 0 --gpu-memory-utilization F --policy X`, then
a second `launch.py --join` engine on the same GPU once the first is up; both
start with a cold prefix cache) serves a small warm-up batch with
another system prompt, then the workload, R times (--reps).

Reported per policy and rep: tokens/s (generated tokens / wall of the
batch), vLLM's prefix-cache hit rate (prompt tokens found cached / looked up,
summed over both engines from the backend's `prefix_cache_hits` /
`prefix_cache_queries` counters: `log_stats` is turned on for this), the
placement itself (requests per engine; prompts whose samples landed on more
than one engine) and an "ideal-cache" hit rate computed from the placements
alone (blocks of 16 ids a request shares with an earlier request on the same
engine, as an unbounded prefix cache would hit): the one number the CPU dry
run can show, since the torch backend has no prefix cache.

vllm-router is NOT in this run: it needs two more vLLM OpenAI servers on the
GPU and the vllm-router wheel, which the device image does not carry
(bench/README.md).

    python -m bench.gpu.prefix_placement --model /tmp/q05 --out-dir $OUT   # GPU
    python -m bench.gpu.prefix_placement --cpu --out-dir /tmp/pp           # dry run (torch backend, tiny model)
    python -m bench.gpu.prefix_placement --cpu --cpu-backend null  # placement only (CI)

Writes gpu_prefix_placement.{json,txt,png} in --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G

NAME = "gpu_prefix_placement"
BLOCK = 16  # ids per block of the ideal-cache estimate (vLLM's default block size)


# ---------------------------------------------------------------- workload


def workload(spec: dict[str, Any], vocab: int, salt: int) -> list[tuple[int, list[int]]]:
    """[(prompt index, token ids)] in send order: prompt-major, each sample alone."""
    w = spec["workload"]
    rng = random.Random(w["seed"] * 1000 + salt)
    lo = 10  # clear of special ids at the bottom of the vocabulary
    system = [rng.randrange(lo, vocab) for _ in range(w["system_tokens"])]
    prompts = [
        system + [rng.randrange(lo, vocab) for _ in range(rng.randint(w["question_min"], w["question_max"]))]
        for _ in range(w["prompts"])
    ]
    return [(i, p) for i, p in enumerate(prompts) for _ in range(w["samples"])]


def ideal_cache_hits(placed: list[tuple[str, list[int]]]) -> tuple[int, int]:
    """(prompt ids an unbounded per-engine prefix cache would hit, prompt ids):
    full blocks a request shares with an earlier request on its engine."""
    seen: dict[str, set[tuple[int, ...]]] = {}
    hit = total = 0
    for engine, prompt in placed:
        blocks = seen.setdefault(engine, set())
        total += len(prompt)
        matched = True
        for i in range(0, len(prompt) - BLOCK + 1, BLOCK):
            key = tuple(prompt[: i + BLOCK])
            if matched and key in blocks:
                hit += BLOCK
            else:
                matched = False
                blocks.add(key)
    return hit, total


# ---------------------------------------------------------------- the phase (child process)


def phase_policy(spec: dict[str, Any]) -> dict[str, Any]:
    cpu = bool(spec.get("cpu"))
    out: dict[str, Any] = {"policy": spec["policy"], "reps": []}
    spec["_partial"].update(out)
    options: dict[str, Any] = {} if cpu else {"log_stats": True, **spec.get("engine", {})}

    def cluster(extra: list[str]) -> G.RbCluster:
        return G.RbCluster(
            spec["model"],
            spec["cpu_backend"] if cpu else "vllm",
            engines=1,
            gpus=None if cpu else "0",
            gpu_memory_utilization=None if cpu else spec["gpu_fraction"],
            max_model_len=None if cpu else spec["max_model_len"],
            backend_options=options,
            ready_timeout_s=spec["ready_timeout_s"],
            log_dir=Path(spec["log_dir"]),
            extra_args=extra,
        )

    # The second engine joins once the first is up: two vLLM engines profiling
    # the one GPU's memory at the same time can fail each other's start.
    with cluster(["--policy", spec["policy"]]) as cl:
        first_s, _ = cl.wait_ready()
        with cluster(["--join", cl.address, "--engine-id-prefix", "b", "--advertise-host", H.LOOPBACK]) as joined:
            cl.engines = 2
            second_s, engines = cl.wait_ready()
            out["engine_start_s"] = [round(first_s, 1), round(second_s, 1)]
            out["engines"] = [e.get("engine_id") for e in engines]
            out["launch_argv"] = [cl.argv[1:], joined.argv[1:]]
            asyncio.run(_run(spec, cl.address, out))
    return out


async def _run(spec: dict[str, Any], address: str, out: dict[str, Any]) -> None:
    from trainer_bridge import AsyncClient

    vocab = spec["vocab"]
    params = {
        "max_tokens": spec["max_tokens"],
        "temperature": spec["temperature"],
        "ignore_eos": True,
    }
    ac = AsyncClient(address, timeout_s=spec["request_timeout_s"], control_timeout_s=60)
    try:
        warm = workload({**spec, "workload": {**spec["workload"], "prompts": 2, "samples": 2}}, vocab, salt=999)
        await asyncio.gather(*(ac.generate(p, {**params, "max_tokens": 4}) for _, p in warm))
        for rep in range(spec["reps"]):
            reqs = workload(spec, vocab, salt=rep)  # a new system prompt per rep: no carry-over between reps
            before = await _engine_counters(ac)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(ac.generate(p, params) for _, p in reqs), return_exceptions=True)
            wall = time.perf_counter() - t0
            after = await _engine_counters(ac)
            out["reps"].append(_summarize(rep, reqs, results, wall, before, after, spec))
            out["head_stats"] = (await ac.stats()).get("prefix")
            G.checkpoint(spec)
    finally:
        await ac.close()


async def _engine_counters(ac: Any) -> dict[str, dict[str, Any]]:
    from bus import protocol as P

    res = await ac.control(P.Stats(), strict=False, timeout_s=30)
    return {eid: dict(r.detail or {}) for eid, r in res.items()}


def _summarize(
    rep: int,
    reqs: list[tuple[int, list[int]]],
    results: list[Any],
    wall: float,
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    spec: dict[str, Any],
) -> dict[str, Any]:
    errors = [r for r in results if isinstance(r, BaseException)]
    ok = [(i, p, r) for (i, p), r in zip(reqs, results, strict=True) if not isinstance(r, BaseException)]
    tokens = sum(len(r.token_ids) for _, _, r in ok)
    per_engine: dict[str, int] = {}
    homes: dict[int, set[str]] = {}
    for i, _, r in ok:
        per_engine[r.engine_id] = per_engine.get(r.engine_id, 0) + 1
        homes.setdefault(i, set()).add(r.engine_id)
    ideal_hit, ideal_total = ideal_cache_hits([(r.engine_id, p) for _, p, r in ok])
    q = h = 0
    have_counters = False
    for eid, a in after.items():
        b = before.get(eid, {})
        if "prefix_cache_queries" in a:
            have_counters = True
            q += a["prefix_cache_queries"] - b.get("prefix_cache_queries", 0)
            h += a.get("prefix_cache_hits", 0) - b.get("prefix_cache_hits", 0)
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
        "split_prompts": sum(1 for s in homes.values() if len(s) > 1),
        "ideal_cache_hit_rate": round(ideal_hit / ideal_total, 4) if ideal_total else None,
        "prefix_cache_hit_rate": round(h / q, 4) if have_counters and q else None,
        "prefix_cache_queries": q if have_counters else None,
        "prefix_cache_hits": h if have_counters else None,
    }


# ---------------------------------------------------------------- report


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


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
        f"{w['system_tokens']} ids, {w['max_tokens']} new tokens; {doc.get('gpu')} {doc.get('date')}",
        f"{'policy':<14} {'tokens/s':>10} {'vLLM prefix hit':>16} {'ideal-cache hit':>16} {'split prompts':>14} "
        f"{'errors':>7}  requests per engine",
    ]
    for pol, r in table.items():
        if not r["reps"]:
            lines.append(f"{pol:<14} FAILED: {str(r.get('error'))[:200]}")
            continue

        def pct(v: Any) -> str:
            return "n/a" if v is None else f"{100 * v:.1f}%"

        lines.append(
            f"{pol:<14} {r['tokens_per_s'] or 0:>10.0f} {pct(r['prefix_cache_hit_rate']):>16} "
            f"{pct(r['ideal_cache_hit_rate']):>16} {r['split_prompts']:>14} {r['errors']:>7}  {r['per_engine']}"
        )
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
        **dict(seed=0, gpu_fraction=0.4, max_model_len=2048, ready_timeout_s=300.0, request_timeout_s=300.0),
        **dict(budget_s=540.0, min_phase_s=60.0),
    )
    ap.add_argument(
        "--cpu-backend",
        default="torch",
        help="--cpu: torch (tiny model) or null (no model: placement only, fast)",
    )
    ap.add_argument("--policies", default="least_loaded,prefix")
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
    spec = {
        "model": model,
        "cpu": a.cpu,
        "cpu_backend": a.cpu_backend,
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
    }
    env = G.probe_env()
    doc = G.result_doc(NAME, a, env, policies={})
    budget = G.Budget(a.budget_s)
    policies = [p for p in a.policies.split(",") if p]
    for pol in policies:
        left = budget.left()
        if left < a.min_phase_s:
            doc["policies"][pol] = {"ok": False, "error": f"skipped: {left:.0f}s of --budget-s left", "reps": []}
            continue
        # each policy takes its share of what is left (engine starts included)
        share = left / (len(policies) - policies.index(pol))
        res = G.run_phase(f"{NAME}_{pol}", "bench.gpu.prefix_placement:phase_policy", {**spec, "policy": pol},
                          share, log_dir)  # fmt: skip
        doc["policies"][pol] = {k: v for k, v in res.items() if k != "traceback"}
        if not res.get("ok"):
            doc["policies"][pol]["traceback"] = res.get("traceback")
        summarize(doc)
        G.write_doc(od / f"{NAME}.json", doc)
        if not a.cpu:
            G.wait_gpu_idle(60)
    summarize(doc)
    doc["wall_s"] = round(budget.elapsed(), 1)
    G.write_doc(od / f"{NAME}.json", doc)
    text = report(doc)
    (od / f"{NAME}.txt").write_text(text + "\n")
    plot(doc, od / f"{NAME}.png")
    return 0 if all(r.get("ok") for r in doc["policies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
