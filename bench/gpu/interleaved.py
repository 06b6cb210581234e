"""Throughput with every path alive at once on ONE GPU, reps interleaved
(issue 8 §5, the measurement the sequential gpu_throughput cannot make).

Why: a 0.5B model's vLLM engine core is CPU-bound, and on the device VMs its
pace moves by up to ±20 % from one minute to the next (tests/gpu/RESULTS.md,
runs 17-21). gpu_throughput runs each path in its own phase, one after the
other, so a ratio between paths is decided by which phase got the faster
minutes. Here `LLM.generate` (in-process), vLLM's OpenAI server + aiohttp, and
rollout-bus (launch.py, batch `generate` and 512 AsyncClient streams) are all
started first, each engine with `--gpu-fraction` of the GPU (same scheduler
defaults as alone), then rep i runs every mode once, in an order rotated by
i. The verdict uses PAIRED ratios: rollout-bus rep i / LLM.generate rep i
(measured within a minute of each other), median and range over the reps.
Then time to first token the same way: `AsyncLLM` in-process (a fourth engine),
rollout-bus streams and the HTTP server, round r of `--ttft-n` concurrent
requests on every path in rotated order; the verdict is the median over rounds
of (rollout-bus p50 of round r - AsyncLLM p50 of round r).

    python -m bench.gpu.interleaved --model /tmp/q05 --out-dir $OUT [--reps 5]
    python -m bench.gpu.interleaved --cpu      # dry run: rollout-bus (torch backend) only

Writes gpu_interleaved.{json,txt,png}. Targets (issue 8): rb / LLM.generate
>= 1.0, rb streams / HTTP >= 1.2, TTFT p50 rb - AsyncLLM <= 2 ms. A phase
killed at --limit-s still reports the reps it finished (checkpointed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import paths as GP

NAME = "gpu_interleaved"
PAIRS = [  # (numerator mode, denominator mode, target)
    ("rb batch", "LLM.generate", 1.0),
    ("rb streams", "LLM.generate", 1.0),
    ("rb streams", "HTTP", 1.2),
    ("rb batch", "HTTP", 1.2),
]
TTFT_PAIRS = [  # (path, reference path, target: the p50 difference in ms at most)
    ("rb", "AsyncLLM", 2.0),
    ("rb", "HTTP", None),
]


def phase_interleaved(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_interleaved(spec))


async def _interleaved(spec: dict[str, Any]) -> dict[str, Any]:
    ps = GP.prompt_sets(spec)
    cpu = bool(spec.get("cpu"))
    frac = spec["gpu_fraction"]
    eng = {**GP.engine_kwargs(spec), **({} if cpu else {"gpu_memory_utilization": frac})}
    params = {"max_tokens": spec["max_tokens"], "temperature": spec["temperature"], "ignore_eos": True}
    warm = {**params, "max_tokens": spec["warmup"]["max_tokens"]}
    out: dict[str, Any] = {"starts_s": {}}
    modes: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {}
    ttft: dict[str, Callable[[list[int]], Awaitable[float]]] = {}  # path -> first_token(prompt) seconds
    resets: dict[str, Callable[[], Awaitable[Any]]] = {}
    closers: list[Callable[[], Awaitable[Any]]] = []
    log_dir = Path(spec["log_dir"])
    with H.Procs(log_dir=log_dir) as procs:
        # -- rollout-bus (first: launch.py's engine claims its fraction before the others start)
        t0 = time.perf_counter()
        cl = G.RbCluster(
            spec["model"],
            "torch" if cpu else "vllm",
            engines=1,
            gpu_memory_utilization=None if cpu else frac,
            max_model_len=eng.get("max_model_len"),
            ready_timeout_s=spec["ready_timeout_s"],
            log_dir=log_dir,
        ).__enter__()
        closers.append(lambda: asyncio.to_thread(cl.close))
        try:
            await asyncio.to_thread(cl.wait_ready)
            out["starts_s"]["rollout-bus"] = round(time.perf_counter() - t0, 1)
            from trainer_bridge import AsyncClient

            ac = AsyncClient(cl.address, timeout_s=spec["request_timeout_s"], control_timeout_s=60)
            closers.append(ac.close)
            await ac.generate(ps["warm"], warm)

            async def rb_batch() -> dict[str, Any]:
                t = time.perf_counter()
                res = await ac.generate(ps["main"], params)
                assert isinstance(res, list)  # a batch in, a list out
                return _rep(sum(len(r.token_ids) for r in res), time.perf_counter() - t, spec)

            async def rb_streams() -> dict[str, Any]:
                async def one(p: list[int]) -> int:
                    n = 0
                    async for ch in ac.stream(p, params):
                        n += len(ch.token_ids)
                    return n

                r = await GP.gather_all(len(ps["main"]), lambda i: one(ps["main"][i]), spec["request_timeout_s"])
                return {**_rep(r["tokens"], r["wall_s"], spec), "errors": r["errors"]}

            async def rb_first(p: list[int]) -> float:
                t = time.perf_counter()
                first = None
                async for ch in ac.stream(p, {**params, "max_tokens": spec["ttft"]["max_tokens"]}):
                    if first is None and ch.token_ids:
                        first = time.perf_counter() - t
                return GP._got(first)

            modes["rb batch"], modes["rb streams"] = rb_batch, rb_streams
            resets["rb batch"] = resets["rb streams"] = ac.reset_prefix_cache
            ttft["rb"] = rb_first

            if not cpu and "http" in spec["paths"]:
                await _start_http(spec, eng, ps, procs, out, modes, resets, closers, ttft)
            if not cpu and "llm" in spec["paths"]:
                await _start_llm(spec, eng, ps, out, modes, resets)
            if not cpu and "asyncllm" in spec["paths"]:
                await _start_asyncllm(spec, eng, ps, out, closers, ttft)
            spec["_partial"].update(out)
            out["reps"] = await _run_reps(spec, modes, resets)
            out["ttft"] = await _run_ttft(spec, ttft, ps["ttft"])
        finally:
            for close in reversed(closers):
                try:
                    await close()
                except Exception:
                    pass
    return summarize(out)


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Medians and paired verdicts from whatever reps / rounds there are (a
    checkpoint of a phase killed at its limit included)."""
    reps = out.get("reps") or {}
    out["modes"] = {m: GP.median_of(v) for m, v in reps.items() if any(r.get("tokens_per_s") for r in v)}
    out["paired"] = paired_ratios(reps)
    if out.get("ttft"):
        out["ttft"]["paired"] = paired_ttft(out["ttft"].get("rounds") or {})
    return out


async def _start_http(
    spec: dict[str, Any],
    eng: dict[str, Any],
    ps: dict[str, list[list[int]]],
    procs: H.Procs,
    out: dict[str, Any],
    modes: dict[str, Any],
    resets: dict[str, Any],
    closers: list[Any],
    ttft: dict[str, Any],
) -> None:
    import aiohttp

    port = H.free_port()
    base = f"http://{H.LOOPBACK}:{port}"
    t0 = time.perf_counter()
    name = f"api_server-{port}"
    proc = procs.start(name, GP.server_argv({**spec, "engine": eng}, port), env={"VLLM_SERVER_DEV_MODE": "1"})
    s = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=spec["request_timeout_s"])
    )
    closers.append(s.close)
    await GP.wait_http_ready(s, base, proc, spec["ready_timeout_s"], procs.log_dir / f"{name}.log")
    out["starts_s"]["HTTP"] = round(time.perf_counter() - t0, 1)

    async def complete(p: list[int], max_tokens: int) -> int:
        body = {
            "model": spec["model"],
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": spec["temperature"],
            "ignore_eos": True,
            "return_token_ids": True,
        }
        async with s.post(f"{base}/v1/completions", json=body) as r:
            data = json.loads(await r.read())
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {str(data)[:200]}")
        return int(data["usage"]["completion_tokens"])

    await GP.gather_all(
        len(ps["warm"]), lambda i: complete(ps["warm"][i], spec["warmup"]["max_tokens"]), spec["request_timeout_s"]
    )

    async def http() -> dict[str, Any]:
        r = await GP.gather_all(
            len(ps["main"]), lambda i: complete(ps["main"][i], spec["max_tokens"]), spec["request_timeout_s"]
        )
        return {**_rep(r["tokens"], r["wall_s"], spec), "errors": r["errors"]}

    async def reset() -> None:
        async with s.post(f"{base}/reset_prefix_cache") as rr:
            await rr.read()

    async def first_token(p: list[int]) -> float:
        body = {
            "model": spec["model"],
            "prompt": p,
            "max_tokens": spec["ttft"]["max_tokens"],
            "temperature": spec["temperature"],
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        t = time.perf_counter()
        first = None
        async with s.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            async for line in resp.content:
                if first is None and line.startswith(b"data: {"):
                    c = json.loads(line[6:])["choices"]
                    if c and (c[0].get("token_ids") or c[0].get("text")):
                        first = time.perf_counter() - t
        return GP._got(first)

    modes["HTTP"], resets["HTTP"] = http, reset
    ttft["HTTP"] = first_token


async def _start_asyncllm(
    spec: dict[str, Any],
    eng: dict[str, Any],
    ps: dict[str, list[list[int]]],
    out: dict[str, Any],
    closers: list[Any],
    ttft: dict[str, Any],
) -> None:
    """AsyncLLM in-process: the TTFT reference (issue 8: within 2 ms of it)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec["model"], **eng))
    closers.append(lambda: asyncio.to_thread(engine.shutdown))
    out["starts_s"]["AsyncLLM"] = round(time.perf_counter() - t0, 1)
    sp = SamplingParams(
        temperature=spec["temperature"],
        max_tokens=spec["ttft"]["max_tokens"],
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    ids = iter(range(1 << 30))

    async def first_token(p: list[int]) -> float:
        t = time.perf_counter()
        first = None
        async for o in engine.generate({"prompt_token_ids": p}, sp, request_id=f"t{next(ids)}"):
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - t
        return GP._got(first)

    # its CUDA graphs and first steps: one warm round on the warm-up prompts
    n = max(1, spec["ttft"]["n"])
    await asyncio.gather(*(first_token(p) for p in ps["warm"][:n]))
    ttft["AsyncLLM"] = first_token


async def _start_llm(
    spec: dict[str, Any],
    eng: dict[str, Any],
    ps: dict[str, list[list[int]]],
    out: dict[str, Any],
    modes: dict[str, Any],
    resets: dict[str, Any],
) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    # LLM is synchronous: it lives on ONE worker thread (made, used and reset there).
    llm = await asyncio.to_thread(LLM, model=spec["model"], **eng)
    out["starts_s"]["LLM"] = round(time.perf_counter() - t0, 1)
    sp = SamplingParams(
        temperature=spec["temperature"], max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False
    )
    wsp = SamplingParams(
        temperature=spec["temperature"], max_tokens=spec["warmup"]["max_tokens"], ignore_eos=True, detokenize=False
    )

    def gen(prompts: list[list[int]], p: Any) -> int:
        res = llm.generate([{"prompt_token_ids": x} for x in prompts], p, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res)

    await asyncio.to_thread(gen, ps["warm"], wsp)

    async def llm_rep() -> dict[str, Any]:
        t = time.perf_counter()
        n = await asyncio.to_thread(gen, ps["main"], sp)
        return _rep(n, time.perf_counter() - t, spec)

    async def reset() -> None:
        await asyncio.to_thread(llm.reset_prefix_cache)

    modes["LLM.generate"], resets["LLM.generate"] = llm_rep, reset


async def _run_reps(
    spec: dict[str, Any], modes: dict[str, Any], resets: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    names = list(modes)
    reps: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    for i in range(spec["reps"]):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotated: no mode always first
        for m in order:
            try:
                await resets[m]()
            except Exception:
                pass
            try:
                reps[m].append({**await modes[m](), "rep": i, "slot": order.index(m)})
            except Exception as e:
                reps[m].append({"error": repr(e)[:300], "rep": i})
            spec["_partial"]["reps"] = reps
            G.checkpoint(spec)
    return reps


async def _run_ttft(
    spec: dict[str, Any], paths: dict[str, Callable[[list[int]], Awaitable[float]]], prompts: list[list[int]]
) -> dict[str, Any]:
    """Round r: ttft.n concurrent requests (the same prompts) on every path,
    paths in an order rotated by r. Per path and round: first-token ms."""
    t = spec["ttft"]
    names = list(paths)
    rounds: dict[str, list[list[float]]] = {m: [] for m in names}
    errors: dict[str, list[str]] = {m: [] for m in names}
    res: dict[str, Any] = {"n": t["n"], "max_tokens": t["max_tokens"], "rounds": rounds, "errors": errors}
    for r in range(t["rounds"]):
        batch = prompts[r * t["n"] : (r + 1) * t["n"]]
        order = names[r % len(names) :] + names[: r % len(names)]
        for m in order:
            got = await asyncio.gather(
                *(asyncio.wait_for(paths[m](p), spec["request_timeout_s"]) for p in batch), return_exceptions=True
            )
            rounds[m].append([round(x * 1e3, 3) for x in got if isinstance(x, float)])
            errors[m] += [repr(x)[:200] for x in got if isinstance(x, BaseException)][:3]
        spec["_partial"]["ttft"] = res
        G.checkpoint(spec)
    res["p50_ms"] = {m: round(H.percentile([v for rr in rs for v in rr], 50), 3) for m, rs in rounds.items() if any(rs)}
    return res


def paired_ttft(rounds: dict[str, list[list[float]]]) -> list[dict[str, Any]]:
    """Per round: p50 of the path - p50 of the reference; median and range."""
    rows = []
    for path, ref, target in TTFT_PAIRS:
        a, b = rounds.get(path) or [], rounds.get(ref) or []
        diffs = sorted(H.median(x) - H.median(y) for x, y in zip(a, b, strict=False) if x and y)
        if not diffs:
            continue
        med = H.median(diffs)
        rows.append(
            {
                "diff": f"TTFT p50 {path} - {ref} (ms)",
                "median": round(med, 2),
                "min": round(diffs[0], 2),
                "max": round(diffs[-1], 2),
                "rounds": len(diffs),
                "target": f"<= {target}" if target is not None else "-",
                "meets": None if target is None else med <= target,
            }
        )
    return rows


def _rep(tokens: int, wall: float, spec: dict[str, Any]) -> dict[str, Any]:
    expected = spec["prompts"]["n"] * spec["max_tokens"]
    return {"tokens": tokens, "expected_tokens": expected, "wall_s": wall, "tokens_per_s": tokens / wall}


def paired_ratios(reps: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """num rep i / den rep i for every rep both measured: median and range,
    against the target."""
    rows = []
    for num, den, target in PAIRS:
        a = {r["rep"]: float(r["tokens_per_s"]) for r in reps.get(num, []) if r.get("tokens_per_s")}
        b = {r["rep"]: float(r["tokens_per_s"]) for r in reps.get(den, []) if r.get("tokens_per_s")}
        ratios = sorted(a[i] / b[i] for i in a if i in b)
        if not ratios:
            continue
        med = H.median(ratios)
        rows.append(
            {
                "ratio": f"{num} / {den}",
                "median": round(med, 3),
                "min": round(ratios[0], 3),
                "max": round(ratios[-1], 3),
                "reps": len(ratios),
                "target": target,
                "meets": med >= target,
            }
        )
    return rows


def report(doc: dict[str, Any]) -> str:
    res = doc.get("result") or {}
    rows = []
    for m, reps in (res.get("reps") or {}).items():
        vals = [round(r["tokens_per_s"]) for r in reps if r.get("tokens_per_s")]
        med = (res.get("modes") or {}).get(m, {}).get("tokens_per_s")
        rows.append({"mode": m, "median tok/s": f"{med:,.0f}" if med else "-", "reps tok/s": str(vals)})
    text = H.print_table(rows, title=f"{NAME}: every path alive on one GPU, reps interleaved ({doc.get('gpu')})")
    pr = [
        {**r, "meets": "yes" if r["meets"] else "NO", "range": f"{r['min']}-{r['max']}"}
        for r in res.get("paired") or []
    ]
    text += "\n\n" + H.print_table(
        [{k: r[k] for k in ("ratio", "median", "range", "reps", "target", "meets")} for r in pr],
        title="paired ratios (rep i of one path / rep i of the other)",
    )
    tt = res.get("ttft") or {}
    if tt.get("paired") or tt.get("p50_ms"):
        p50 = ", ".join(f"{m} {v:.1f} ms" for m, v in (tt.get("p50_ms") or {}).items())
        text += "\n\n" + H.print_table(
            [
                {
                    **{k: r[k] for k in ("diff", "median", "rounds", "target")},
                    "range": f"{r['min']}-{r['max']}",
                    "meets": "-" if r["meets"] is None else ("yes" if r["meets"] else "NO"),
                }
                for r in tt.get("paired") or []
            ],
            title=f"time to first token, {tt.get('n')} concurrent, max_tokens {tt.get('max_tokens')}, "
            f"rounds interleaved (p50 over all: {p50})",
        )
    if doc.get("error"):
        text += f"\n\nERROR: {doc['error']}"
    return text


def plot(doc: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no PNG ({e!r})", flush=True)
        return
    reps = (doc.get("result") or {}).get("reps") or {}
    fig, ax = plt.subplots(figsize=(8, 4))
    for m, rs in reps.items():
        xs = [r["rep"] for r in rs if r.get("tokens_per_s")]
        ys = [r["tokens_per_s"] for r in rs if r.get("tokens_per_s")]
        ax.plot(xs, ys, "o-", label=m)
    ax.set_xlabel("rep (every path once per rep, rotated order)")
    ax.set_ylabel("tokens/s")
    ax.set_title("interleaved throughput, one GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}", flush=True)


# --cpu: a small set (flags given still win)
CPU_DEFAULTS: dict[str, Any] = dict(prompts=16, min_len=8, max_len=32, max_tokens=16, reps=2, warmup_n=4)
CPU_DEFAULTS.update(warmup_max_tokens=4, limit_s=240.0, ttft_n=4, ttft_rounds=2, ttft_max_tokens=4)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run: rollout-bus on the torch backend only",
        **dict(seed=0, gpu_fraction=0.2, max_model_len=2048, ready_timeout_s=240.0, request_timeout_s=300.0),
    )
    ap.add_argument(
        "--paths", default="llm,http,rb,asyncllm", help="comma list of llm, http, rb, asyncllm (rb always runs)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--warmup-n", type=int, default=512)
    ap.add_argument("--warmup-max-tokens", type=int, default=32)
    ap.add_argument("--ttft-n", type=int, default=16, help="concurrent requests per TTFT round")
    ap.add_argument("--ttft-rounds", type=int, default=10)
    ap.add_argument("--ttft-max-tokens", type=int, default=64)
    ap.add_argument("--limit-s", type=float, default=540.0, help="the whole run (engine starts included)")
    return G.parse_args(ap, argv, CPU_DEFAULTS)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if G.replot(a, report, plot):
        return 0
    od = G.out_dir(a.out_dir)
    model = G.model_of(a)
    log_dir = G.log_dir_of(a, od, NAME)
    spec = {
        "model": model,
        "cpu": a.cpu,
        "paths": [p for p in a.paths.split(",") if p],
        "gpu_fraction": a.gpu_fraction,
        "engine": {} if a.cpu else {"max_model_len": a.max_model_len},
        "prompts": {"n": a.prompts, "min_len": a.min_len, "max_len": a.max_len, "seed": a.seed},
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "reps": a.reps,
        "warmup": {"n": a.warmup_n, "max_tokens": a.warmup_max_tokens},
        "ttft": {"n": a.ttft_n, "rounds": a.ttft_rounds, "max_tokens": a.ttft_max_tokens},
        "ready_timeout_s": a.ready_timeout_s,
        "request_timeout_s": a.request_timeout_s,
        "log_dir": str(log_dir),
    }
    env = G.probe_env()
    doc = G.result_doc(NAME, a, env)
    t0 = time.perf_counter()
    res = G.run_phase(NAME, "bench.gpu.interleaved:phase_interleaved", spec, a.limit_s, log_dir)
    doc["result"] = {k: v for k, v in res.items() if k != "traceback"}
    if not res.get("ok") and res.get("reps"):
        summarize(doc["result"])  # a checkpoint: the reps / rounds it finished
    if not res.get("ok"):
        doc["error"] = res.get("error")
        doc["traceback"] = res.get("traceback")
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    G.write_doc(od / f"{NAME}.json", doc)
    text = report(doc)  # print_table prints as it builds
    (od / f"{NAME}.txt").write_text(text + "\n")
    plot(doc, od / f"{NAME}.png")
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
