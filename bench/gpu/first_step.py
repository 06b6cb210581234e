"""Where does a resume's first token go inside vLLM's engine core? (issue 8 §4:
resume -> first new token is 40-50 ms on an H200 where the target is 30; the
core-side trace of tests/gpu/RESULTS.md run 29 put all of it between the core
scheduling the first re-submitted request and that request's first output.)

vLLM's EngineCore runs IN THIS PROCESS (no busy loop, no sockets): the same
engine arguments as the vllm backend, the same EngineCoreRequests
(`vllm/requests.build_request`, a fresh prefix-cache salt per resume, as after
a weight commit), stepped by hand, every step timed. Per scenario and rep:

  1. `--streams` requests (random prompts of --prompt-min..--prompt-max ids)
     decode until each has --gen-tokens tokens (the load of the weight bench);
  2. all are aborted and drained (what pause("abort") does);
  3. the first K of them come back as prompt + tokens so far under a new salt
     (K = the resume ramp's admission), stepped until the first new token
     (first_ms); then the rest are added and stepped until every one has a
     token (all_ms).

Also "cold": K fresh prompts into an idle engine (time to first token).
--profile: the first-token window of one resume per K under torch.profiler
(CPU + CUDA; top ops by self CPU and by CUDA time) and cProfile (top Python
functions), into the text report. The JSON has every step's duration.

    python3 -m bench.gpu.first_step --model /tmp/q05 --out-dir $OUT      # on a GPU
    python3 -m bench.gpu.first_step --plot-from gpu_first_step.json        # the PNG again
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu import common as G


def engine(a: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """vLLM's EngineCore in this process, built as the vllm backend builds it."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor import Executor

    from engine_node.backends.vllm.engine_core import load_vllm_api

    api = load_vllm_api()
    kw: dict[str, Any] = dict(
        model=a.model,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_model_len=a.max_model_len,
        enable_sleep_mode=not a.cpu,
        seed=0,
    )
    kw.update(json.loads(a.engine_args or "{}"))
    cfg = api.build_config(kw)
    client = InprocClient(cfg, Executor.get_class(cfg), True)
    sc = cfg.scheduler_config
    info = {
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
        "batch_queue_size": getattr(client.engine_core, "batch_queue_size", None),
        "cudagraph_capture_sizes_max": max(cfg.compilation_config.cudagraph_capture_sizes or [0]),
        "cudagraph_mode": str(getattr(cfg.compilation_config, "cudagraph_mode", "")),
        "engine_args": {k: v for k, v in kw.items() if k != "model"},
    }
    return api, client.engine_core, info


class Driver:
    """Adds EngineCoreRequests and steps the core by hand, timing every step."""

    def __init__(self, api: Any, core: Any, vocab: int) -> None:
        from bus.protocol import SamplingParams
        from engine_node.backend import SeqRequest

        self.api, self.core, self.vocab = api, core, vocab
        self._Seq, self._P = SeqRequest, SamplingParams
        self.n = 0
        self.tokens: dict[str, list[int]] = {}  # request id -> tokens generated under it
        self.steps: list[dict[str, Any]] = []

    def add(self, prompt: list[int], max_tokens: int, salt: str | None) -> str:
        from engine_node.backends.vllm.requests import build_request, sampling_params

        self.n += 1
        rid = f"r{self.n}"
        seq = self._Seq(
            seq_id=rid,
            prompt=list(prompt),
            params=self._P(temperature=1.0, ignore_eos=True, max_tokens=max_tokens),
            max_new_tokens=max_tokens,
        )
        sp = sampling_params(self.api, seq, max_model_len=10**9, generation_config={}, eos_token_id=None)
        req = build_request(self.api, rid, seq, sp, None, salt)
        r, wave = self.core.preprocess_add_request(req)
        self.core.add_request(r, wave)
        self.tokens[rid] = []
        return rid

    def step(self) -> tuple[float, int, set[str]]:
        """One step_fn: (seconds, new tokens, request ids that got a token)."""
        t0 = time.perf_counter()
        outs, executed = self.core.step_fn()
        self.core.post_step(executed)
        dt = time.perf_counter() - t0
        got: set[str] = set()
        new = 0
        for eco in (outs or {}).values():
            for o in eco.outputs or ():
                if o.new_token_ids and o.request_id in self.tokens:
                    self.tokens[o.request_id].extend(o.new_token_ids)
                    got.add(o.request_id)
                    new += len(o.new_token_ids)
        self.steps.append({"ms": round(dt * 1e3, 3), "new": new, "executed": bool(executed)})
        return dt, new, got

    def first_token_ms(self, t0: float, deadline: float) -> float | None:
        """Step until a step yields a new token: ms since t0 (None: deadline first)."""
        while time.monotonic() < deadline:
            _, new, _ = self.step()
            if new:
                return (time.perf_counter() - t0) * 1e3
        return None

    def busy(self) -> bool:
        return bool(self.core.scheduler.has_requests() or getattr(self.core, "batch_queue", None))

    def abort_all(self) -> None:
        ids = [r for r in self.tokens]
        self.core.abort_requests(ids)
        end = time.monotonic() + 30
        while self.busy() and time.monotonic() < end:
            self.step()
        self.tokens.clear()


def scenario_resume(
    d: Driver, prompts: list[list[int]], k: int, a: argparse.Namespace, tag: str, profile: bool
) -> dict[str, Any]:
    rids = [d.add(p, a.max_tokens, None) for p in prompts]
    end = time.monotonic() + 60
    while min(len(d.tokens[r]) for r in rids) < a.gen_tokens and time.monotonic() < end:
        d.step()
    so_far = {r: list(d.tokens[r]) for r in rids}
    d.abort_all()
    back = [prompts[i] + so_far[r] for i, r in enumerate(rids)]
    first_k, rest = back[:k], back[k:]
    salt = f"resume-{tag}"
    s0 = len(d.steps)
    prof = None
    if profile:
        prof = Prof()
        prof.start()
    t0 = time.perf_counter()
    ids = [d.add(p, a.max_tokens, salt) for p in first_k]
    add_ms = (time.perf_counter() - t0) * 1e3
    end = time.monotonic() + 30
    first_ms = d.first_token_ms(t0, end)
    first_steps = d.steps[s0:]
    prof_txt = prof.stop() if prof is not None else None
    ids += [d.add(p, a.max_tokens, salt) for p in rest]
    while any(not d.tokens[r] for r in ids) and time.monotonic() < end:
        d.step()
    all_ms = (time.perf_counter() - t0) * 1e3
    d.abort_all()
    return {
        "k": k,
        "first_tokens_sent": sum(len(p) for p in first_k),
        "all_tokens_sent": sum(len(p) for p in back),
        "add_ms": round(add_ms, 2),
        "first_ms": None if first_ms is None else round(first_ms, 2),
        "first_steps_ms": [s["ms"] for s in first_steps],
        "all_ms": round(all_ms, 2),
        "profile": prof_txt,
    }


def scenario_cold(d: Driver, prompts: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    s0 = len(d.steps)
    t0 = time.perf_counter()
    ids = [d.add(p, a.max_tokens, None) for p in prompts]
    end = time.monotonic() + 30
    first_ms = d.first_token_ms(t0, end)
    while any(not d.tokens[r] for r in ids) and time.monotonic() < end:
        d.step()
    all_ms = (time.perf_counter() - t0) * 1e3
    steps = [s["ms"] for s in d.steps[s0:]]
    d.abort_all()
    return {
        "k": len(prompts),
        "tokens": sum(map(len, prompts)),
        "first_ms": first_ms and round(first_ms, 2),
        "all_ms": round(all_ms, 2),
        "steps_ms": steps,
    }


class Prof:
    """torch.profiler (CPU + CUDA where there is one) and cProfile over one window."""

    def __init__(self) -> None:
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.cuda = torch.cuda.is_available()
        self.tp = torch.profiler.profile(activities=acts)
        self.cp = cProfile.Profile()

    def start(self) -> None:
        self.tp.__enter__()
        self.cp.enable()

    def stop(self) -> str:
        self.cp.disable()
        self.tp.__exit__(None, None, None)
        out = io.StringIO()
        ka = self.tp.key_averages()
        out.write(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        if self.cuda:
            out.write(ka.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
        st = pstats.Stats(self.cp, stream=out)
        st.sort_stats("cumulative").print_stats(40)
        st.sort_stats("tottime").print_stats(25)
        return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run on vLLM's CPU build (not the GPU figures)",
        **dict(seed=0, gpu_memory_utilization=0.85, max_model_len=2048),
    )
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=300, help="tokens each stream has when the pause comes")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--ramps", default="1,2,4,8,16,64", help="how many of the streams come back first")
    ap.add_argument("--cold", default="1,4,16", help="fresh prompts into an idle engine")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--engine-args", default=None, help="JSON: more EngineArgs fields")
    a = G.parse_args(ap, argv)
    if G.replot(a, lambda doc: None, plot):  # the tables are in the .txt the run wrote
        return 0
    if not a.model:
        ap.error("--model is required (or --plot-from)")
    out_dir = G.out_dir(a.out_dir)
    t0 = time.perf_counter()
    api, core, info = engine(a)
    info["start_s"] = round(time.perf_counter() - t0, 1)
    print(f"engine up in {info['start_s']} s: {info}", flush=True)
    vocab = G.model_vocab(a.model)
    prompts = G.make_prompts(a.streams, a.prompt_min, a.prompt_max, vocab, a.seed)
    d = Driver(api, core, vocab)
    # warm-up: one full resume cycle (first prefills of every shape class)
    scenario_resume(d, prompts, a.streams, a, "warm", False)
    ramps = [int(x) for x in a.ramps.split(",") if x]
    res: dict[str, Any] = {"info": info, "resume": [], "cold": []}
    report: list[str] = []
    for rep in range(a.reps):
        for k in ramps:
            r = scenario_resume(d, prompts, min(k, a.streams), a, f"{rep}-{k}", a.profile and rep == 1)
            r["rep"] = rep
            prof = r.pop("profile")
            if prof:
                report.append(f"===== profile: resume, K={k} (rep {rep}, first_ms {r['first_ms']})\n{prof}")
            res["resume"].append(r)
            print(
                f"resume K={k:3d} rep {rep}: first {r['first_ms']} ms ({r['first_tokens_sent']} tokens, "
                f"steps {r['first_steps_ms']}), all {r['all_ms']} ms ({r['all_tokens_sent']} tokens)",
                flush=True,
            )
        for k in [int(x) for x in a.cold.split(",") if x]:
            fresh = G.make_prompts(k, a.prompt_min, 512, vocab, 1000 + rep * 100 + k)
            c = scenario_cold(d, fresh, a)
            c["rep"] = rep
            res["cold"].append(c)
            print(f"cold K={k:3d} rep {rep}: first {c['first_ms']} ms ({c['tokens']} tokens, steps {c['steps_ms']})")
    table = ["| K (requests in the first step) | prompt tokens | first token ms, median [min-max] | all K' ms |"]
    table.append("|---|---|---|---|")
    for k in ramps:
        rs = [r for r in res["resume"] if r["k"] == min(k, a.streams) and r["first_ms"] is not None]
        if not rs:
            continue
        f = [r["first_ms"] for r in rs]
        table.append(
            f"| {k} | {int(statistics.median(r['first_tokens_sent'] for r in rs))} | "
            f"{statistics.median(f):.1f} [{min(f):.1f}-{max(f):.1f}] | "
            f"{statistics.median(r['all_ms'] for r in rs):.1f} |"
        )
    for k in [int(x) for x in a.cold.split(",") if x]:
        cs = [c for c in res["cold"] if c["k"] == k and c["first_ms"] is not None]
        if cs:
            f = [c["first_ms"] for c in cs]
            table.append(
                f"| cold {k} | {int(statistics.median(c['tokens'] for c in cs))} | "
                f"{statistics.median(f):.1f} [{min(f):.1f}-{max(f):.1f}] | - |"
            )
    text = "\n".join(table)
    print(text, flush=True)
    res["steady_step_ms_median"] = (
        statistics.median(s["ms"] for s in d.steps[-2000:] if s["executed"] and s["new"] >= a.streams // 2)
        if any(s["executed"] and s["new"] >= a.streams // 2 for s in d.steps[-2000:])
        else None
    )
    print(f"steady decode step ({a.streams} streams), median ms: {res['steady_step_ms_median']}", flush=True)
    (out_dir / "gpu_first_step.json").write_text(json.dumps(res, indent=1))
    (out_dir / "gpu_first_step.txt").write_text(text + "\n\n" + "\n".join(report))
    print(f"wrote {out_dir / 'gpu_first_step.json'}", flush=True)
    plot(res, out_dir / "gpu_first_step.png")
    return 0


def plot(res: dict[str, Any], png: Path) -> None:
    """First-token ms per scenario (every rep a dot), prompt tokens of the first step on top."""
    from bench.plots import _plt

    try:
        plt = _plt()
    except Exception as e:
        print(f"no PNG ({e!r})", flush=True)
        return
    groups: dict[str, list[tuple[float, int]]] = {}
    for r in res.get("resume", []):
        if r.get("first_ms") is not None:
            groups.setdefault(f"resume K={r['k']}", []).append((r["first_ms"], r["first_tokens_sent"]))
    for c in res.get("cold", []):
        if c.get("first_ms") is not None:
            groups.setdefault(f"cold K={c['k']}", []).append((c["first_ms"], c["tokens"]))
    if not groups:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups) + 2), 4))
    for i, pts in enumerate(groups.values()):
        ax.plot([i] * len(pts), [p[0] for p in pts], "o", color="C0", alpha=0.7)
        ax.annotate(f"{int(statistics.median(p[1] for p in pts))} tok", (i, max(p[0] for p in pts)), fontsize=7)
    graphs = (res.get("info") or {}).get("cudagraph_capture_sizes_max")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(list(groups), rotation=30, fontsize=8)
    ax.set_ylabel("first new token, ms (in-process core)")
    ax.set_title(f"first step after a resume / into an idle engine (largest CUDA graph: {graphs} tokens)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
