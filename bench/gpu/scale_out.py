"""Scale-out: one front feeding N engines (1, 2, 4; one per GPU), the same
requests on every arm (issue 33 §2), and losing one engine of N (§5, --kill-one).

Arms (bench/gpu/scale_arms.py): rollout-bus (launch.py, N vLLM engine nodes)
as a batch (`generate` of the whole list) and as one AsyncClient stream per
request, with the default policy and with `--policy prefix`; vLLM's own data
parallelism, `vllm serve --data-parallel-size N` over HTTP (its internal load
balancer; N api_server processes by vLLM's default) and `AsyncLLM` with
data_parallel_size=N in one process; vllm-router (each of --vllm-router's
policies, the best reported) over N `vllm serve` servers; and the ideal, N ×
the arm's own one-engine figure of the same run.

Workloads, identical on every arm: `throughput` (bench.gpu.throughput's set:
512 prompts of 64-512 random ids, 256 new tokens, temperature 1.0) and `grpo`
(bench.gpu.prefix_placement's shape: 64 prompts × 8 samples sharing a 1,000-id
system prefix, 128 new tokens; each (rep, arm) gets its own prefix so no arm
reads a cache another filled). TTFT p50/p99 at 64 and 512 concurrent.

Every engine count N is one phase process (bench.gpu.common.run_phase): its
arms start one after another, each while the others are idle (vLLM's start-up
memory profile fails when another process frees GPU memory meanwhile), then
reps run every arm once in an order rotated per rep. AsyncLLM lives in the
driver's process by design, so it is a phase of its own right after (its reps
are not interleaved with the others': say so when quoting it).

    python -m bench.gpu.scale_out --model /tmp/q05 --engines 1,2,4 --out-dir $OUT
    python -m bench.gpu.scale_out --model /tmp/q05 --engines 4 --kill-one --out-dir $OUT
    python -m bench.gpu.scale_out --cpu             # dry run: null engines, vLLM arms skipped with the reason
    python -m bench.gpu.scale_out --plot-from gpu_scale_out.json

--engines is limited to the GPUs this job sees (an inherited CUDA_VISIBLE_DEVICES
counts). Writes gpu_scale_out.json (after every phase) and gpu_scale_out.png
(tokens/s against engines, one line per arm); prints the tables last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import prefix_placement as PP
from bench.gpu import scale_arms as A
from bench.gpu import scale_kill as K

NAME = "gpu_scale_out"
TTFT_CONCURRENCY = (64, 512)

CPU_DEFAULTS = dict(
    engines="1,2", prompts=24, min_len=8, max_len=32, max_tokens=8, grpo_prompts=4, grpo_samples=4,
    system_tokens=64, grpo_max_tokens=8, ttft_max_tokens=4, ttft_concurrency="8", reps=1, budget_s=240.0,
    ready_timeout_s=120.0, vllm_router="",
)  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run: null (or torch) engines, a small set; vLLM arms skipped with the reason",
        **dict(seed=0, gpu_fraction=0.12, max_model_len=2048, ready_timeout_s=300.0, request_timeout_s=300.0),
        **dict(budget_s=560.0, phase_limit_s=540.0, gpu_idle_timeout_s=30.0),
    )
    ap.add_argument("--engines", default="1,2,4", help="engine counts, one engine per GPU (capped by visible GPUs)")
    ap.add_argument("--arms", default="rb,rb-prefix,vllm-dp,vllm-router,asyncllm", help="comma list of arm groups")
    ap.add_argument("--workloads", default="throughput,grpo")
    ap.add_argument("--cpu-backend", default="null", help="--cpu: null (no model, paced steps) or torch")
    ap.add_argument("--vllm-router", default="cache_aware,power_of_two", help="vllm-router policies (best reported)")
    ap.add_argument("--engine-args", default='{"max_num_seqs": 1024, "max_num_batched_tokens": 8192}',
                    help="JSON: vLLM engine arguments of every engine of every arm")  # fmt: skip
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--grpo-prompts", type=int, default=64)
    ap.add_argument("--grpo-samples", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--grpo-max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--ttft-max-tokens", type=int, default=32)
    ap.add_argument("--ttft-concurrency", default=",".join(map(str, TTFT_CONCURRENCY)))
    K.add_args(ap)
    return G.parse_args(ap, argv, CPU_DEFAULTS)


def visible_gpu_count() -> int:
    from launcher.config import visible_gpus  # lazy: the launcher's own reading of the mask

    def count() -> int:
        try:
            import torch

            return int(torch.cuda.device_count())
        except ImportError:
            return 0

    return len(visible_gpus(os.environ, count)[0])


def engine_counts(a: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(counts to run, counts dropped for want of GPUs)."""
    want = [int(x) for x in a.engines.split(",") if x.strip()]
    if a.cpu:
        return want, []
    have = visible_gpu_count()
    return [n for n in want if n <= have], [n for n in want if n > have]


def base_spec(a: argparse.Namespace, model: str, log_dir: Path) -> dict[str, Any]:
    return {
        "model": model, "cpu": a.cpu, "cpu_backend": a.cpu_backend, "log_dir": str(log_dir),
        "cpu_options": {"tokens_per_step": 1, "step_delay_s": 0.002} if a.cpu_backend == "null" else {},
        "gpu_fraction": a.gpu_fraction, "max_model_len": a.max_model_len, "engine_args": json.loads(a.engine_args),
        "ready_timeout_s": a.ready_timeout_s, "request_timeout_s": a.request_timeout_s, "reps": a.reps,
        "workloads": a.workloads.split(","), "temperature": a.temperature, "seed": a.seed,
        "throughput": {"n": a.prompts, "min_len": a.min_len, "max_len": a.max_len, "max_tokens": a.max_tokens},
        "workload": {"seed": a.seed, "prompts": a.grpo_prompts, "samples": a.grpo_samples,
                     "system_tokens": a.system_tokens, "question_min": 32 if not a.cpu else 4,
                     "question_max": 128 if not a.cpu else 16},
        "grpo_max_tokens": a.grpo_max_tokens,
        "ttft": {"max_tokens": a.ttft_max_tokens, "concurrency": [int(x) for x in a.ttft_concurrency.split(",") if x]},
        "vllm_router": [p for p in a.vllm_router.split(",") if p],
    }  # fmt: skip


def skip_reasons(a: argparse.Namespace) -> dict[str, str]:
    """Arm groups that cannot run here, with why (rows in the table, not failures)."""
    from bench.peer_side import vllm_router_missing

    out: dict[str, str] = {}
    for arm in ("vllm-dp", "vllm-router", "asyncllm"):
        if a.cpu:
            out[arm] = "--cpu: vLLM's own arms need vLLM on GPUs (not run in the dry run)"
        elif importlib.util.find_spec("vllm") is None:
            out[arm] = "vllm is not importable"
    if "vllm-router" not in out and (why := vllm_router_missing()):
        out["vllm-router"] = why
    return out


# ---------------------------------------------------------------- requests


def requests_of(spec: dict[str, Any], workload: str, rep: int, arm: int) -> tuple[list[list[int]], dict[str, Any]]:
    """(prompts, params) of one workload for (rep, arm); the throughput set is
    the same on every arm and rep (bench.gpu.throughput resets the prefix cache
    between reps; here the 64-512 random prompts share no prefix to hit)."""
    vocab = G.model_vocab(spec["model"])
    if workload == "throughput":
        t = spec["throughput"]
        prompts = G.make_prompts(t["n"], t["min_len"], t["max_len"], vocab, spec["seed"])
        return prompts, {"max_tokens": t["max_tokens"], "temperature": spec["temperature"], "ignore_eos": True}
    reqs = PP.workload(spec, vocab, salt=rep, arm=arm)
    return [p for _, p in reqs], {"max_tokens": spec["grpo_max_tokens"], "temperature": spec["temperature"],
                                  "ignore_eos": True}  # fmt: skip


def tally(results: list[Any], want: int, wall: float) -> dict[str, Any]:
    ok = [r for r in results if isinstance(r, int) and r == want]
    errs = [r for r in results if not (isinstance(r, int) and r == want)]
    return {"tokens": sum(ok), "wall_s": round(wall, 3), "tokens_per_s": sum(ok) / wall if wall > 0 else None,
            "errors": len(errs), "error_sample": [repr(e)[:200] for e in errs[:3]]}  # fmt: skip


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# ---------------------------------------------------------------- phases (child processes)


def phase_arms(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_arms(spec))


async def _start_group(group: str, spec: dict[str, Any], stack: Any, procs: Any, session: Any) -> dict[str, Any]:
    if group in ("rb", "rb-prefix"):
        pol = "prefix" if group == "rb-prefix" else "least_loaded"
        cl = A.rb_cluster(spec, pol, stack)
        return {f"{group} batch": A.RbArm(cl, False, spec["request_timeout_s"]),
                f"{group} stream": A.RbArm(cl, True, spec["request_timeout_s"])}  # fmt: skip
    if group == "vllm-dp":
        return {"vllm-dp http": A.HttpArm(session, await A.start_dp_server(procs, session, spec), spec["model"])}
    if group == "vllm-router":
        routers = await A.start_routers_over_servers(procs, session, spec, spec["vllm_router"])
        return {f"vllm-router {pol}": A.HttpArm(session, url, spec["model"]) for pol, url in routers.items()}
    if group == "asyncllm":
        return {"asyncllm dp": A.start_asyncllm(spec)}
    raise ValueError(f"unknown arm group {group!r}")


async def _arms(spec: dict[str, Any]) -> dict[str, Any]:
    end = time.monotonic() + spec["limit_s"]
    out: dict[str, Any] = {"engines": spec["engines"], "arms": {}, "order": []}
    spec["_partial"].update(out)
    arms: dict[str, Any] = {}
    with H.Procs(log_dir=Path(spec["log_dir"])) as procs, contextlib.ExitStack() as stack:
        session = A.VR.make_session()
        try:
            for group in spec["groups"]:  # one after another: the others idle while each starts
                t0 = time.monotonic()
                try:
                    started = await _start_group(group, spec, stack, procs, session)
                except Exception as e:  # a failed arm is a row with its error; the others still run
                    out["arms"][group] = {"error": f"start: {type(e).__name__}: {e}"[:2000]}
                    G.checkpoint(spec)
                    continue
                for name, arm in started.items():
                    arms[name] = arm
                    out["arms"][name] = {"start_s": round(time.monotonic() - t0, 1), "reps": [], "ttft": []}
                G.checkpoint(spec)
            for arm in arms.values():  # warm-up: every arm compiles / fills its graphs before rep 0
                prompts, params = requests_of(spec, "throughput", 0, 0)
                await arm.send(prompts[:8], {**params, "max_tokens": 4})
            await _reps(spec, arms, out, end)
        finally:
            for arm in arms.values():
                with contextlib.suppress(Exception):
                    await arm.close()
            await session.close()
    return out


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
            row: dict[str, Any] = {"rep": rep}
            for w in spec["workloads"]:
                prompts, params = requests_of(spec, w, rep, names.index(name))
                t0 = time.perf_counter()
                res = await arms[name].send(prompts, params)
                row[w] = tally(res, params["max_tokens"], time.perf_counter() - t0)
            out["arms"][name]["reps"].append(row)
            if not name.endswith(" batch"):  # a batch call has no first token to time (its stream twin does)
                out["arms"][name]["ttft"].append(await _ttft(spec, arms[name], rep, names.index(name)))
            G.checkpoint(spec)
        rep_s = time.monotonic() - t_rep


async def _ttft(spec: dict[str, Any], arm: Any, rep: int, k: int) -> dict[str, Any]:
    vocab = G.model_vocab(spec["model"])
    t = spec["throughput"]
    out = {}
    for c in spec["ttft"]["concurrency"]:
        prompts = G.make_prompts(c, t["min_len"], t["max_len"], vocab, spec["seed"] + 1000 + 37 * rep + k)
        first = await arm.first_tokens(prompts, {"max_tokens": spec["ttft"]["max_tokens"],
                                                 "temperature": spec["temperature"], "ignore_eos": True})  # fmt: skip
        out[str(c)] = {"n": len(first), "p50_ms": (pct(first, 50) or 0) * 1e3, "p99_ms": (pct(first, 99) or 0) * 1e3}
    return out


# ---------------------------------------------------------------- summary, report, plot


def summarize(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (N, arm, workload): median tokens/s and spread over reps, TTFT medians, errors."""
    rows = []
    for ph in doc.get("phases", []):
        for name, arm in (ph.get("arms") or {}).items():
            if "error" in arm:
                rows.append({"engines": ph["engines"], "arm": name, "error": arm["error"][:160]})
                continue
            for w in doc["config"]["workloads"].split(","):
                tps = [r[w]["tokens_per_s"] for r in arm["reps"] if r.get(w, {}).get("tokens_per_s")]
                row = {"engines": ph["engines"], "arm": name, "workload": w, "reps": len(tps),
                       "tokens_per_s": statistics.median(tps) if tps else None,
                       "min": min(tps, default=None), "max": max(tps, default=None),
                       "errors": sum(r[w]["errors"] for r in arm["reps"] if w in r)}  # fmt: skip
                for c in doc["config"]["ttft_concurrency"].split(","):
                    for q in ("p50_ms", "p99_ms"):
                        vals = [t[c][q] for t in arm["ttft"] if c in t and t[c]["n"]]
                        row[f"ttft{c}_{q}"] = statistics.median(vals) if vals else None
                rows.append(row)
    one = {(r["arm"], r.get("workload")): r["tokens_per_s"] for r in rows if r["engines"] == 1 and "error" not in r}
    for r in rows:
        base = one.get((r["arm"], r.get("workload")))
        if base and r.get("tokens_per_s"):
            r["ideal"] = base * r["engines"]
            r["of_ideal"] = r["tokens_per_s"] / r["ideal"]
    return rows


def report(doc: dict[str, Any]) -> str:
    rows = summarize(doc)
    table = []
    for r in rows:
        if "error" in r:
            table.append({"N": str(r["engines"]), "arm": r["arm"], "workload": "-", "tokens/s": r["error"]})
            continue
        spread = f"{H.fmt(r['tokens_per_s'], 0)} [{H.fmt(r['min'], 0)}-{H.fmt(r['max'], 0)}]"
        c = doc["config"]["ttft_concurrency"].split(",")
        table.append({"N": str(r["engines"]), "arm": r["arm"], "workload": r["workload"], "tokens/s": spread,
                      "of N×1": H.fmt(r.get("of_ideal"), 2),
                      **{f"TTFT@{x} p50/p99 ms": f"{H.fmt(r[f'ttft{x}_p50_ms'], 1)}/{H.fmt(r[f'ttft{x}_p99_ms'], 1)}"
                         for x in c},
                      "err": str(r["errors"])})  # fmt: skip
    for arm, why in (doc.get("skipped") or {}).items():
        table.append({"N": "-", "arm": arm, "workload": "-", "tokens/s": f"skipped: {why}"})
    for n in doc.get("dropped_engine_counts") or []:
        table.append({"N": str(n), "arm": "-", "workload": "-", "tokens/s": "skipped: more engines than visible GPUs"})
    H.print_table(table, title="Scale-out: tokens/s, median [min-max] over reps; of N×1 = / (N × the arm's N=1)")
    if doc.get("kill"):
        K.report(doc["kill"])
    return "ok"


def plot(doc: dict[str, Any], png: Path) -> Path | None:
    rows = [r for r in summarize(doc) if "error" not in r and r.get("tokens_per_s")]
    panels: list[dict[str, Any]] = []
    for w in doc["config"]["workloads"].split(","):
        series: dict[str, Any] = {}
        for arm in sorted({r["arm"] for r in rows if r["workload"] == w}):
            pts = sorted((r["engines"], r) for r in rows if r["workload"] == w and r["arm"] == arm)
            series[arm] = ([n for n, _ in pts], [r["tokens_per_s"] for _, r in pts], [r["min"] for _, r in pts],
                           [r["max"] for _, r in pts])  # fmt: skip
            ideal = [(n, r["ideal"]) for n, r in pts if r.get("ideal")]
            if arm.startswith("rb batch") and ideal:
                series["ideal: N × rb batch at 1"] = ([n for n, _ in ideal], [v for _, v in ideal])
        panels.append({"title": f"{w}: tokens/s", "xlabel": "engines (one per GPU)", "ylabel": "tokens/s",
                       "series": series})  # fmt: skip
    k = doc.get("kill") or {}
    if k.get("tokens_per_s_series"):
        ts = k["tokens_per_s_series"]
        xs = [round(i * k["bin_s"], 2) for i in range(len(ts))]
        panels.append({"title": f"kill -9 {k['victim']} of {k['engines']} at {k['killed_at_s']} s: tokens/s",
                       "xlabel": "seconds", "ylabel": "tokens/s", "series": {"rollout-bus streams": (xs, ts)},
                       "hline": 0.75 * (k.get("before_tokens_per_s") or 0)})  # fmt: skip
    panels = [p for p in panels if p["series"]]
    if not panels:
        return None
    # plot_lines writes under bench/results: a private name there, moved to `png`
    made = H.plot_lines(f"{NAME}.{os.getpid()}", panels, suptitle="Scale-out: one front, N engines",
                        note="ideal: N × the same arm's one-engine figure of this run")  # fmt: skip
    png.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(made), str(png))
    return png


def run(a: argparse.Namespace) -> dict[str, Any]:
    model = G.model_of(a)
    out = G.out_dir(a.out_dir)
    log_dir = G.log_dir_of(a, out, NAME)
    counts, dropped = engine_counts(a)
    skipped = skip_reasons(a)
    groups = [g for g in a.arms.split(",") if g and g not in skipped]
    doc = G.result_doc(NAME, a, G.probe_env(), phases=[], skipped=skipped, dropped_engine_counts=dropped)
    path = out / f"{NAME}.json"
    budget = G.Budget(a.budget_s)
    spec0 = base_spec(a, model, log_dir)
    if a.kill_one:
        n = max(counts) if counts else 0
        doc["kill"] = K.run_kill(spec0, n, budget, a, log_dir) if n >= 2 else {"error": "--kill-one needs >= 2 engines"}
        G.write_doc(path, doc)
        return doc
    for n in counts:
        for part in ([g for g in groups if g != "asyncllm"], [g for g in groups if g == "asyncllm"]):
            if not part:
                continue
            left = budget.left()
            if left < 60:
                doc.setdefault("not_run", []).append(f"N={n} {part}: budget: {left:.0f}s left")
                continue
            spec = {**spec0, "engines": n, "groups": part, "limit_s": min(a.phase_limit_s, left - 10)}
            name = f"scale_n{n}_{'asyncllm' if part == ['asyncllm'] else 'arms'}"
            res = G.run_phase(name, "bench.gpu.scale_out:phase_arms", spec, spec["limit_s"] + 30, log_dir)
            doc["phases"].append({**res, "engines": n})
            if not a.cpu:
                doc.setdefault("gpu_idle", []).append(G.wait_gpu_idle(a.gpu_idle_timeout_s))
            G.write_doc(path, doc)
    return doc


def merged(paths: list[str]) -> dict[str, Any]:
    """Several runs' JSON as one (a device call holds one N: `--plot-from a.json,b.json`);
    the first run's config, every run's phases."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(docs[0])
    out["phases"] = [ph for d in docs for ph in d.get("phases", [])]
    out["kill"] = next((d["kill"] for d in docs if d.get("kill")), None)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.plot_from and "," in a.plot_from:
        doc = merged(a.plot_from.split(","))
        report(doc)
        plot(doc, Path(a.plot_from.split(",")[0]).with_name(f"{NAME}_merged.png"))
        return 0
    if G.replot(a, report, plot):
        return 0
    doc = run(a)
    report(doc)
    png = G.out_dir(a.out_dir) / f"{NAME}.png"
    plot(doc, png)
    bad = [p for p in doc.get("phases", []) if not p.get("ok")]
    return 1 if bad or (doc.get("kill") or {}).get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
