"""Throughput and time to first token on one GPU: rollout-bus vs vLLM's own
paths, the SAME requests for every path, one engine on the GPU at a time.

Paths (each a phase in its own process, the previous one's tree killed and the
GPU idle before the next starts; bench/gpu/paths.py):
  LLM.generate (the ceiling) · AsyncLLM in-process · vLLM OpenAI server +
  aiohttp (what RL stacks run today) · rollout-bus (launch.py, 1 vLLM engine
  node): Client.generate batch and one AsyncClient stream per request.
Default request set (issue 8): 512 prompts of 64-512 random token ids (seed 0),
256 new tokens each, temperature 1.0, ignore_eos. Time to first token: 16
concurrent requests, max_tokens 64, --ttft-rounds rounds on other prompts.

Engine options are the same for every path (--gpu-memory-utilization,
--max-model-len, everything else vLLM's default). vLLM picks max_num_seqs /
max_num_batched_tokens by usage context (LLM: 1024/16384 on an H100/H200; the
OpenAI server 1024/8192; a bare AsyncLLM 128/2048-like): each path runs with its
own defaults (recorded), then, budget permitting, once more with LLM's values
("LLM's values" rows; skipped where they equal the defaults).

    python -m bench.gpu.throughput --model /tmp/q05 --out-dir $OUT --budget-s 500
    python -m bench.gpu.throughput --cpu            # dry run: rollout-bus on the torch backend, vLLM paths skipped
    python -m bench.gpu.throughput --plot-from gpu_throughput.json   # the PNG later, on CPU

Writes gpu_throughput.json (after every phase) and gpu_throughput.png; prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu.paths import PHASES

PATH_NAMES = {
    "llm": "vLLM LLM.generate",
    "asyncllm": "vLLM AsyncLLM in-process",
    "http": "vLLM OpenAI server + aiohttp",
    "rb": "rollout-bus (launch.py, 1 engine)",
}
VLLM_PATHS = ("llm", "asyncllm", "http")
SCHED_KEYS = ("max_num_seqs", "max_num_batched_tokens")
NAME = "gpu_throughput"
VARIANTS = {"pinned": {"cpu_affinity": "auto"}}  # rollout-bus backend options (engine_node/cpu_placement.py)

CPU_DEFAULTS = dict(
    prompts=16,
    min_len=8,
    max_len=32,
    max_tokens=16,
    ttft_n=4,
    ttft_max_tokens=8,
    ttft_rounds=2,
    warmup_n=4,
    warmup_max_tokens=4,
    budget_s=240.0,
    ready_timeout_s=120.0,
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="CPU dry run: rollout-bus on the torch backend + tiny model, small set; vLLM paths skipped",
        **dict(seed=0, gpu_memory_utilization=0.85, max_model_len=2048, budget_s=500.0, phase_limit_s=200.0),
        **dict(min_phase_s=60.0, ready_timeout_s=180.0, request_timeout_s=300.0, gpu_idle_timeout_s=30.0),
    )
    ap.add_argument("--paths", default="llm,asyncllm,http,rb", help="comma list of " + ",".join(PHASES))
    ap.add_argument(
        "--no-llm-values",
        dest="llm_values",
        action="store_false",
        help="do not re-run the peers with LLM's max_num_seqs / max_num_batched_tokens",
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="measure each mode this many times (prefix cache reset before each); median"
    )
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--ttft-n", type=int, default=16, help="concurrent requests of the TTFT phase (0: none)")
    ap.add_argument("--ttft-max-tokens", type=int, default=64)
    ap.add_argument("--ttft-rounds", type=int, default=4)
    # The warm-up is a pass as wide as the measured set (other prompts): the first full-size pass of
    # an engine was 25 % slower than the next on an H100 (JIT-compiled kernels, allocator growth).
    ap.add_argument("--warmup-n", type=int, default=512)
    ap.add_argument("--warmup-max-tokens", type=int, default=32)
    return G.parse_args(ap, argv, CPU_DEFAULTS)


def base_spec(a: argparse.Namespace, model: str, log_dir: Path) -> dict[str, Any]:
    return {
        "model": model,
        "cpu": a.cpu,
        "engine": {}
        if a.cpu
        else {"gpu_memory_utilization": a.gpu_memory_utilization, "max_model_len": a.max_model_len},
        "prompts": {"n": a.prompts, "min_len": a.min_len, "max_len": a.max_len, "seed": a.seed},
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "reps": 1 if a.cpu else max(1, a.reps),  # the CPU dry run checks the plumbing, not the figures
        "warmup": {"n": a.warmup_n, "max_tokens": a.warmup_max_tokens},
        "ttft": {"n": a.ttft_n, "max_tokens": a.ttft_max_tokens, "rounds": a.ttft_rounds} if a.ttft_n > 0 else None,
        "ready_timeout_s": a.ready_timeout_s,
        "request_timeout_s": a.request_timeout_s,
        "log_dir": str(log_dir),
    }


def skip_reason(path: str, a: argparse.Namespace, env: dict[str, Any]) -> str | None:
    if path in VLLM_PATHS:
        if a.cpu:
            return "--cpu dry run: vLLM paths need vLLM and a GPU"
        if not env.get("vllm"):
            return f"vLLM not importable here ({env.get('vllm_error', 'no module vllm')})"
    if not a.cpu and not env.get("gpus"):
        return "no CUDA GPU visible (use --cpu for the dry run)"
    return None


def run(a: argparse.Namespace) -> dict[str, Any]:
    budget = G.Budget(a.budget_s)
    od = G.out_dir(a.out_dir)
    log_dir = G.log_dir_of(a, od, NAME)
    env = G.probe_env()
    model = G.model_of(a)
    spec0 = base_spec(a, model, log_dir)
    doc = G.result_doc(NAME, a, env, spec={k: v for k, v in spec0.items() if k != "log_dir"}, runs=[])
    path = od / f"{NAME}.json"
    print(f"{NAME}: model {model}, env {json.dumps(env)}, budget {a.budget_s:.0f}s", flush=True)
    paths = [p for p in a.paths.split(",") if p]
    # PATH@VARIANT: the path again with a variant's engine options (rb@pinned: cpu_affinity auto)
    plan: list[tuple[str, str, dict[str, Any]]] = [
        (p.split("@")[0], p.split("@")[1], dict(VARIANTS[p.split("@")[1]])) if "@" in p else (p, "defaults", {})
        for p in paths
    ]
    paths = [p.split("@")[0] for p in paths]
    i = 0
    while i < len(plan):
        p, label, overrides = plan[i]
        i += 1
        entry: dict[str, Any] = {"path": p, "name": PATH_NAMES.get(p, p), "config": label, "overrides": overrides}
        reason = skip_reason(p, a, env) if p in PHASES else f"unknown path {p!r}"
        if reason is None and overrides and _same_as_defaults(doc["runs"], p, overrides):
            reason = "its defaults already are LLM's values"
        left = budget.left()
        if reason is None and left < a.min_phase_s:
            reason = f"budget: {left:.0f}s left < --min-phase-s {a.min_phase_s:.0f}"
        if reason:
            entry["skipped"] = reason
            print(f"[{p} {label}] skipped: {reason}", flush=True)
        else:
            spec = {**spec0, "engine": {**spec0["engine"], **overrides}}
            limit = min(a.phase_limit_s, left - 5)
            entry.update(
                G.run_phase(f"{p}-{label.replace(' ', '_').replace(chr(39), '')}", PHASES[p], spec, limit, log_dir)
            )
            if not a.cpu:
                entry["gpu_idle"] = G.wait_gpu_idle(a.gpu_idle_timeout_s)
        doc["runs"].append(entry)
        if p == "llm" and label == "defaults" and a.llm_values:
            plan += llm_value_runs(entry, paths)
        doc["elapsed_s"] = budget.elapsed()
        G.write_doc(path, doc)
    for e in doc["runs"]:
        if e["config"] == "LLM's values" and not e.get("skipped") and e.get("ok"):
            same = {k: (e.get("sched") or {}).get(k) for k in SCHED_KEYS}
            e["applied"] = same == {k: e["overrides"].get(k) for k in SCHED_KEYS}
    G.write_doc(path, doc)
    print(f"wrote {path}", flush=True)
    return doc


def _same_as_defaults(runs: list[dict[str, Any]], path: str, overrides: dict[str, Any]) -> bool:
    for r in runs:
        if r["path"] == path and r["config"] == "defaults":
            sched = r.get("sched") or {}
            return all(sched.get(k) == v for k, v in overrides.items())
    return False


def llm_value_runs(llm_entry: dict[str, Any], paths: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """The peers again with LLM's scheduler values (rollout-bus first: the issue's question)."""
    sched = llm_entry.get("sched") or {}
    if not all(isinstance(sched.get(k), int) for k in SCHED_KEYS):
        return []
    ov = {k: sched[k] for k in SCHED_KEYS}
    return [(p, "LLM's values", ov) for p in ("rb", "http", "asyncllm") if p in paths]


# ---------------------------------------------------------------- report


def rows_of(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    runs = doc["runs"]
    llm_tps = _tps(runs, "llm", "defaults")
    http_tps = {lab: _tps(runs, "http", lab) for lab in ("defaults", "LLM's values")}
    ttft_ref = next(
        (r.get("ttft") for r in runs if r["path"] == "asyncllm" and r["config"] == "defaults" and r.get("ttft")), None
    )
    tput, ttft = [], []
    for r in runs:
        sched = r.get("sched") or {}
        cfg = r["config"] + (
            f" ({sched.get('max_num_seqs') or '?'}/{sched.get('max_num_batched_tokens') or '?'})"
            if sched.get("max_num_seqs") or sched.get("max_num_batched_tokens")
            else ""
        )
        status = _one_line(
            ("skipped: " + r["skipped"])
            if r.get("skipped")
            else ("FAILED: " + str(r.get("error"))[:120] if not r.get("ok") else "")
        )
        modes = r.get("modes") or {}
        if not modes:
            tput.append(
                {
                    "path": r["name"],
                    "engine cfg (seqs/batched tok)": cfg,
                    "mode": "-",
                    "tokens/s": "-",
                    "x LLM.generate": "-",
                    "x HTTP": "-",
                    "start s": _f(r.get("engine_start_s"), 0),
                    "err": "-",
                    "note": status,
                }
            )
        for mode, m in modes.items():
            tps = m.get("tokens_per_s")
            href = http_tps.get(r["config"]) or http_tps["defaults"]
            note = (
                status
                or (
                    ""
                    if m.get("tokens") == m.get("expected_tokens")
                    else f"{m.get('tokens')}/{m.get('expected_tokens')} tokens"
                )
                or m.get("error", "")
            )
            if m.get("error"):
                note = _one_line("FAILED: " + m["error"][:120])
            tput.append(
                {
                    "path": r["name"],
                    "engine cfg (seqs/batched tok)": cfg,
                    "mode": mode,
                    "tokens/s": _f(tps, 0),
                    "x LLM.generate": _ratio(tps, llm_tps),
                    "x HTTP": _ratio(tps, href),
                    "start s": _f(r.get("engine_start_s"), 0),
                    "err": str(m.get("errors", "-")),
                    "note": note,
                }
            )
        t = r.get("ttft")
        if t:
            ttft.append(
                {
                    "path": r["name"],
                    "engine cfg": r["config"],
                    "n": str(t["n"]),
                    "TTFT p50 ms": _f(t.get("p50_ms"), 1),
                    "TTFT p99 ms": _f(t.get("p99_ms"), 1),
                    "p50 - AsyncLLM ms": _delta(t.get("p50_ms"), ttft_ref, "p50_ms"),
                    "p99 - AsyncLLM ms": _delta(t.get("p99_ms"), ttft_ref, "p99_ms"),
                    "err": str(t.get("errors", 0)),
                }
            )
    return tput, ttft


def _one_line(s: str) -> str:
    return " | ".join(x.strip() for x in s.splitlines() if x.strip())


def _tps(runs: list[dict[str, Any]], path: str, label: str) -> float | None:
    for r in runs:
        if r["path"] == path and r["config"] == label and r.get("modes"):
            return next(iter(r["modes"].values())).get("tokens_per_s")
    return None


def _f(v: Any, nd: int) -> str:
    return "-" if v is None else (f"{v:,.0f}" if nd == 0 else f"{v:.{nd}f}")


def _ratio(v: float | None, ref: float | None) -> str:
    return "-" if not v or not ref else f"{v / ref:.2f}"


def _delta(v: float | None, ref: dict[str, Any] | None, key: str) -> str:
    if v is None or not ref or ref.get(key) is None:
        return "-"
    return f"{v - ref[key]:+.1f}"


def report(doc: dict[str, Any]) -> str:
    tput, ttft = rows_of(doc)
    s = doc.get("spec", {})
    p = s.get("prompts", {})
    env = doc.get("env", {})
    title = (
        f"Throughput, one GPU ({env.get('gpu_name') or 'CPU'}; vllm {env.get('vllm_version', '-')}): "
        f"{p.get('n')} prompts of {p.get('min_len')}-{p.get('max_len')} random ids, {s.get('max_tokens')} new "
        f"tokens each, temperature {s.get('temperature')}, ignore_eos; model {s.get('model')}\n"
        "(x HTTP: against the HTTP row of the same engine config, its defaults when that one did not run)"
    )
    text = H.print_table(tput, title=title)
    t = s.get("ttft") or {}
    text += "\n\n" + H.print_table(
        ttft,
        title=f"Time to first token: {t.get('n')} concurrent, max_tokens "
        f"{t.get('max_tokens')}, {t.get('rounds')} rounds pooled",
    )
    diag = [
        f"[diag] {r.get('name')} [{r.get('config')}] {mode}: "
        + json.dumps({k: m[k] for k in ("cpu", "colocation", "engine", "timeline_ms") if m.get(k)})
        for r in doc.get("runs", [])
        for mode, m in (r.get("modes") or {}).items()
        if isinstance(m, dict) and any(m.get(k) for k in ("cpu", "colocation", "engine", "timeline_ms"))
    ]
    if diag:
        text += "\n\nWhere the time went (busy fraction of one core per role; engine-core steps; stream timeline ms)\n"
        text += "\n".join(diag)
        print("\n".join(diag), flush=True)
    return text


def plot(doc: dict[str, Any], png: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no PNG ({e!r}); later, on CPU: python -m bench.gpu.throughput --plot-from JSON", flush=True)
        return None
    bars = [
        (f"{r['name']}\n{mode} [{r['config']}]", m["tokens_per_s"])
        for r in doc["runs"]
        for mode, m in (r.get("modes") or {}).items()
        if m.get("tokens_per_s")
    ]
    tt = [(f"{r['name']} [{r['config']}]", r["ttft"]) for r in doc["runs"] if (r.get("ttft") or {}).get("p50_ms")]
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.55 * max(len(bars), len(tt), 4) + 1.5))
    ax = axes[0]
    ax.barh(range(len(bars)), [b[1] for b in bars], color=[f"C{i % 10}" for i in range(len(bars))])
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s")
    ax.set_title("throughput (same requests)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax = axes[1]
    ys = range(len(tt))
    ax.barh([y - 0.2 for y in ys], [t[1]["p50_ms"] for t in tt], height=0.4, label="p50")
    ax.barh([y + 0.2 for y in ys], [t[1]["p99_ms"] or 0 for t in tt], height=0.4, label="p99")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([t[0] for t in tt], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("time to first token", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    env = doc.get("env", {})
    fig.suptitle(
        f"rollout-bus vs vLLM paths, {env.get('gpu_name') or 'CPU'} ({doc.get('machine', {}).get('time_utc', '')})",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}", flush=True)
    return png


def main(argv: list[str] | None = None) -> int:
    H.setup_logging()
    a = parse(argv)
    if G.replot(a, report, plot):
        return 0
    t0 = time.monotonic()
    with H.Procs():  # SIGTERM → SystemExit, so a killed run still unwinds its phases
        doc = run(a)
    try:
        plot(doc, G.out_dir(a.out_dir) / f"{NAME}.png")
    except Exception as e:
        print(f"PNG failed: {e!r}", flush=True)
    print(f"\n{NAME} finished in {time.monotonic() - t0:.0f}s\n", flush=True)
    report(doc)
    ok = any(r.get("ok") for r in doc["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
