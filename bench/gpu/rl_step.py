"""One RL step's inference-side work on one GPU (issue 21 §2, §3), per phase,
next to vLLM's own path, at the 0.5B preset and a 7B-class model.

Phase `rb` (a launch.py cluster, 1 vLLM engine node on GPU 0; the trainer —
this phase's process — holds the model in bf16 on the same GPU):
  * in-flight updates, one block per --configs entry MODE:COPY:WHERE:
        with client.paused(MODE):                 # abort | keep
            client.update_weights(params, transport="cuda_ipc", zero_copy=COPY == "zero_copy")
    with --streams streams in flight, consumed WHERE: `other` (a process of
    their own: the trainer only sends weights) or `trainer` (this process, on a
    thread: the single-script trainer that also consumes its rollouts). Times:
    pause, update, resume, the whole block (e2e), resume -> first token of the
    new version, resume -> every stream has one (all_streams); medians of
    --steps after a first step reported apart. Floor: one flat device copy of
    the same bytes, measured in the same process.
  * colocated steps (SkyRL's colocate_all order), no streams in flight:
        sleep(level) -> the trainer allocates 80 % of the memory the sleep freed
        and frees it -> wake_up(["weights"]) -> update (cuda_ipc) ->
        wake_up(["kv_cache"]) -> a generate pass (--gen-prompts x --gen-tokens)
    (--wake whole: one wake_up() after the update instead: the old order).
Phase `vllm` (its own process: vLLM's LLM with enable_sleep_mode): the same
colocated phases through vLLM's own sleep / wake_up(tags) / generate. vLLM
0.24's native weight-transfer API (LLM.update_weights with its `ipc` backend)
imports ray at module level, which the GPU machine does not have: its update
is not measured (said in the JSON).

Targets (7B-class on an H200): e2e <= 2x the flat copy; wake weights + KV
<= 1 s and not slower than vLLM's; WHERE=trainer within 20 % of WHERE=other;
keep: all_streams <= 2 decode steps; abort: all_streams <= 200 ms.

COPY: packed | zero_copy | zero_copy_unchecked (check_finite=False: no NaN/inf pass).
MODE: abort | keep (`with client.paused(MODE)`, three round trips awaited in
turn) | pipe-abort | pipe-keep (`client.update_weights(..., pause=MODE)`: pause,
update and resume sent back to back, awaited once). Each update reports its
`path`: "one_trip" once the engine holds the zero-copy layout (one control op:
receive + validate + prepare + commit), else "two_trip"; `breakdown` has the
per-op round trips (control.Pause / control.OneTrip / control.Resume) and the
engine's commit timings.

    python -m bench.gpu.rl_step --model /tmp/q7b --out-dir $OUT
    python -m bench.gpu.rl_step --cpu          # dry run: torch backend, zmq transport
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import trainer_timing
from bench.gpu import weight_update as W

NAME = "gpu_rl_step"
TARGETS = {"e2e_x_floor": 2.0, "wake_s": 1.0, "trainer_vs_other": 1.2, "abort_all_streams_ms": 200.0}
DEFAULT_BACKEND_OPTIONS: dict[str, Any] = {"resume_ramp_tokens": "auto"}  # --backend-options overrides
DEFAULT_CONFIGS = (
    "abort:packed:other,abort:zero_copy:other,keep:zero_copy:other,abort:zero_copy:trainer,keep:zero_copy:trainer,"
    "pipe-abort:zero_copy:other,pipe-keep:zero_copy:other,pipe-abort:zero_copy_unchecked:other"
)


# ---------------------------------------------------------------- streams in another process


class RemoteStreamLoad:
    """W.StreamLoad in a process of its own (`--stream-load-child`): it prints
    when each stream first saw each weight version (perf_counter, which is
    CLOCK_MONOTONIC on Linux: comparable across processes), read here into
    the same first_seen / seen_by a StreamLoad keeps."""

    def __init__(self, address: str, n: int, spec: dict[str, Any]) -> None:
        self.n = n
        self.first_seen: dict[int, float] = {}
        self.seen_by: dict[int, dict[int, float]] = {}
        self.active = self.tokens = self.finished = 0
        self.errors: list[str] = []
        self._argv = [
            sys.executable,
            "-m",
            "bench.gpu.rl_step",
            "--stream-load-child",
            json.dumps({"address": address, "n": n, "spec": {k: spec[k] for k in _LOAD_KEYS}}),
        ]
        self.proc: subprocess.Popen | None = None
        self._reader = threading.Thread(target=self._read, name="remote-load", daemon=True)

    def start(self) -> RemoteStreamLoad:
        self.proc = subprocess.Popen(
            self._argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            cwd=str(G.REPO_ROOT),
            env=G.child_env(),
            text=True,
        )
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "SEEN":
                v, w, t = int(parts[1]), int(parts[2]), float(parts[3])
                self.seen_by.setdefault(v, {})[w] = t
                if v not in self.first_seen or t < self.first_seen[v]:
                    self.first_seen[v] = t
            elif parts[0] == "STAT":
                self.active, self.tokens, self.finished = int(parts[1]), int(parts[2]), int(parts[3])
            elif parts[0] == "ERR":
                self.errors.append(line[4:].strip()[:300])

    def wait_flowing(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        t0 = self.tokens
        while time.monotonic() < end:
            if self.active >= self.n and self.tokens > t0 + 4 * self.n:
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise TimeoutError(f"{self.n} remote streams not flowing (active {self.active}, errors {self.errors[:2]})")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            self.proc.wait(15)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(5)


_LOAD_KEYS = ("prompt_min", "prompt_max", "seed", "model", "stream_max_tokens", "request_timeout_s", "streams")


def stream_load_child(arg: str) -> int:
    """The other process's side: run the streams, report first sightings."""
    cfg = json.loads(arg)
    spec = cfg["spec"]
    load = W.StreamLoad(
        cfg["address"], cfg["n"], W._prompts(spec), spec["stream_max_tokens"], spec["request_timeout_s"]
    ).start()
    stop = threading.Event()

    def wait_stop() -> None:  # the parent writes a line (or closes stdin) to stop us
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_stop, daemon=True).start()
    sent: set[tuple[int, int]] = set()
    n_err = 0
    last_stat = 0.0
    while not stop.is_set():
        try:
            snap = [(v, dict(by)) for v, by in list(load.seen_by.items())]
        except RuntimeError:  # changed size while copied: next turn
            continue
        out = []
        for v, by in snap:
            for w, t in by.items():
                if (v, w) not in sent:
                    sent.add((v, w))
                    out.append(f"SEEN {v} {w} {t!r}")
        now = time.monotonic()
        if now - last_stat > 0.05:
            out.append(f"STAT {load.active} {load.tokens} {load.finished}")
            last_stat = now
        for e in load.errors[n_err:]:
            out.append("ERR " + e.replace("\n", " "))
        n_err = len(load.errors)
        if out:
            print("\n".join(out), flush=True)
        time.sleep(0.001)
    load.stop()
    return 0


# ---------------------------------------------------------------- colocated steps


def _alloc_freed(freed_bytes: int, device: str) -> float:
    """The trainer takes 80 % of what the engine's sleep freed, then frees it
    (a stand-in for the training step's memory). Returns seconds."""
    import torch

    t0 = time.perf_counter()
    if freed_bytes > 0 and device.startswith("cuda"):
        blk = torch.empty(int(freed_bytes * 0.8), dtype=torch.uint8, device=device)
        blk.fill_(1)
        torch.cuda.synchronize(device)
        del blk
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def _gen_pass(gen: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    n = gen(prompts, tokens)
    dt = time.perf_counter() - t0
    return {"gen_ms": dt * 1e3, "gen_tokens": n, "gen_tokens_per_s": n / dt if dt else None}


def colocated_rb(client: Any, named: list[tuple[str, Any]], spec: dict[str, Any]) -> list[dict[str, Any]]:
    prompts = W._prompts(spec)[: spec["gen_prompts"]]
    params = {"max_tokens": spec["gen_tokens"], "temperature": 1.0, "ignore_eos": True}

    def gen(ps: list[list[int]], _t: int) -> int:
        return sum(len(r.token_ids) for r in client.generate(ps, params))

    opts = {} if spec["cpu"] else {"device": "cuda:0", "zero_copy": spec["colocated_zero_copy"]}
    transport = "zmq" if spec["cpu"] else "cuda_ipc"
    out = []
    for i in range(spec["steps"] + 1):
        rec: dict[str, Any] = {"i": i}
        try:
            t0 = time.perf_counter()
            s = client.sleep(spec["sleep_level"])
            t1 = time.perf_counter()
            freed = sum(int((r.get("gpu_freed_bytes") if isinstance(r, dict) else 0) or 0) for r in _vals(s))
            rec["trainer_alloc_ms"] = _alloc_freed(freed, "cpu" if spec["cpu"] else "cuda:0") * 1e3
            t2 = time.perf_counter()
            if spec["wake"] == "split":
                client.wake_up(tags=["weights"])
                t3 = time.perf_counter()
                r = client.update_weights(named, transport=transport, **opts)
                t4 = time.perf_counter()
                client.wake_up(tags=["kv_cache"])
                t5 = time.perf_counter()
                rec.update(wake_weights_ms=(t3 - t2) * 1e3, update_ms=(t4 - t3) * 1e3, wake_kv_ms=(t5 - t4) * 1e3)
            else:
                client.wake_up()
                t3 = time.perf_counter()
                r = client.update_weights(named, transport=transport, **opts)
                t5 = time.perf_counter()
                rec.update(wake_ms=(t3 - t2) * 1e3, update_ms=(t5 - t3) * 1e3)
            rec.update(sleep_ms=(t1 - t0) * 1e3, freed_bytes=freed, weight_version=_version(r))
            rec.update(_gen_pass(gen, prompts, spec["gen_tokens"]))
            rec["step_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        print("COLOCATED rb " + json.dumps({k: _r(v) for k, v in rec.items()}), flush=True)
        out.append(rec)
    return out


def _vals(res: Any) -> list[Any]:
    vals = list(res.values()) if hasattr(res, "values") else []
    return [dict(v) if not isinstance(v, dict) and hasattr(v, "__struct_fields__") else v for v in vals] or [{}]


def _version(r: Any) -> Any:
    try:
        return dict(next(iter(r.values())))["weight_version"]
    except Exception:
        return None


def _r(v: Any) -> Any:
    return round(v, 2) if isinstance(v, float) else v


# ---------------------------------------------------------------- phases


def phase_rb(spec: dict[str, Any]) -> dict[str, Any]:
    from trainer_bridge import Client

    cpu = spec["cpu"]
    out: dict[str, Any] = {"inflight": {}}
    eng: dict[str, Any] = {}
    if not cpu:
        eng = {"gpu_memory_utilization": spec["gpu_memory_utilization"], "max_model_len": spec["max_model_len"]}
        # The resume ramp on "auto", as the earlier 7B runs set it explicitly:
        # without it resume -> first token read 80-124 ms instead of ~20-30.
        eng["backend_options"] = {**DEFAULT_BACKEND_OPTIONS, **(spec.get("backend_options") or {})}
    with G.RbCluster(
        spec["model"],
        "torch" if cpu else "vllm",
        engines=1,
        gpus=None if cpu else "0",
        ready_timeout_s=spec["ready_timeout_s"],
        log_dir=Path(spec["log_dir"]),
        **eng,
    ) as cl:
        out["engine_start_s"], out["engines"] = cl.wait_ready()
        spec["_partial"].update(out)
        _, named, nbytes = W.load_trainer_model(spec["model"], cpu, "cuda:0")
        out["bytes"], out["params"] = nbytes, sum(t.numel() for _, t in named)
        out["floor"] = W.copy_floor(named, nbytes)
        spec["_partial"].update(out)
        client = Client(cl.address, timeout_s=spec["request_timeout_s"], control_timeout_s=spec["control_timeout_s"])
        W.instrument()
        trainer_timing.instrument()  # trainer.prep_s / share_s / layout_s / op_s of the zero-copy path
        transport = "zmq" if cpu else "cuda_ipc"
        try:
            for cfg in spec["configs"]:
                mode, copy, where = cfg.split(":")
                # zero_copy_unchecked: the same without the trainer's NaN/inf pass (check_finite=False)
                opts = {} if cpu else {"device": "cuda:0", "zero_copy": copy.startswith("zero_copy")}
                if copy.endswith("_unchecked"):
                    opts["check_finite"] = False
                load: Any = (
                    RemoteStreamLoad(cl.address, spec["streams"], spec)
                    if where == "other"
                    else W.StreamLoad(
                        cl.address,
                        spec["streams"],
                        W._prompts(spec),
                        spec["stream_max_tokens"],
                        spec["request_timeout_s"],
                    )
                ).start()
                res: dict[str, Any] = {}
                try:
                    load.wait_flowing(spec["ready_timeout_s"])
                    t0, k0 = time.perf_counter(), load.tokens
                    time.sleep(1.0)
                    # decode step estimate: every stream gets one token per step
                    rate = (load.tokens - k0) / (time.perf_counter() - t0)
                    res["decode_step_ms"] = spec["streams"] / rate * 1e3 if rate > 0 else None
                    ups = W.timed_updates(
                        client,
                        named,
                        load,
                        transport,
                        spec["steps"] + 1,
                        spec["gap_s"],
                        spec["first_token_timeout_s"],
                        opts,
                        tag=cfg,
                        pause_mode=mode,
                    )
                    res.update(updates=ups, summary=W.summarize(ups, skip_first=True), breakdown=W.breakdown(ups[1:]))
                except Exception as e:
                    res["error"] = f"{type(e).__name__}: {e}"[:500]
                finally:
                    load.stop()
                res["load"] = {"tokens": load.tokens, "finished": load.finished, "errors": load.errors[:3]}
                out["inflight"][cfg] = res
                spec["_partial"].update(out)
                G.checkpoint(spec)
            if spec["colocated"]:
                out["colocated"] = colocated_rb(client, named, spec)
        finally:
            client.close()
    return out


def phase_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        spec["model"],
        enable_sleep_mode=True,
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        max_model_len=spec["max_model_len"],
        seed=spec["seed"],
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in W._prompts(spec)[: spec["gen_prompts"]]]

    def gen(_ps: Any, tokens: int) -> int:
        sp = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False))

    gen(None, 4)
    out: dict[str, Any] = {
        "update": "not measured: vLLM 0.24's ipc weight-transfer engine imports ray, absent on the GPU machine"
    }
    steps = []
    for i in range(spec["steps"] + 1):
        rec: dict[str, Any] = {"i": i}
        try:
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            llm.sleep(level=spec["sleep_level"])
            t1 = time.perf_counter()
            freed = max(0, torch.cuda.mem_get_info()[0] - free0)
            rec["trainer_alloc_ms"] = _alloc_freed(freed, "cuda:0") * 1e3
            t2 = time.perf_counter()
            if spec["wake"] == "split":
                llm.wake_up(tags=["weights"])
                t3 = time.perf_counter()
                llm.wake_up(tags=["kv_cache"])
                t5 = time.perf_counter()
                rec.update(wake_weights_ms=(t3 - t2) * 1e3, wake_kv_ms=(t5 - t3) * 1e3)
            else:
                llm.wake_up()
                t5 = time.perf_counter()
                rec["wake_ms"] = (t5 - t2) * 1e3
            rec.update(sleep_ms=(t1 - t0) * 1e3, freed_bytes=freed)
            rec.update(_gen_pass(gen, [], spec["gen_tokens"]))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        print("COLOCATED vllm " + json.dumps({k: _r(v) for k, v in rec.items()}), flush=True)
        steps.append(rec)
    out["colocated"] = steps
    return out


# ---------------------------------------------------------------- report


def _med(steps: list[dict[str, Any]], k: str) -> float | None:
    vals = [s[k] for s in steps[1:] if s.get(k) is not None and "error" not in s]
    return H.median(vals) if vals else None


def summarize_doc(doc: dict[str, Any]) -> dict[str, Any]:
    rb = doc.get("rb") or {}
    floor = (rb.get("floor") or {}).get("flat_copy_ms")
    s: dict[str, Any] = {"floor_flat_ms": floor, "inflight": {}, "colocated": {}}
    for cfg, r in (rb.get("inflight") or {}).items():
        sm = r.get("summary") or {}

        def m(k: str, sm: dict[str, Any] = sm) -> float | None:
            return (sm.get(k) or {}).get("median")

        s["inflight"][cfg] = {
            "e2e_ms": m("e2e_ms"),
            "update_ms": m("update_ms"),
            "e2e_x_floor": m("e2e_ms") / floor if m("e2e_ms") and floor else None,
            "paths": sm.get("paths"),
            "one_trip_prepare_ms": m("one_trip_prepare_ms"),
            "breakdown": r.get("breakdown"),
            "first_token_ms": m("first_token_ms"),
            "all_streams_ms": m("all_streams_ms"),
            "decode_step_ms": r.get("decode_step_ms"),
            "errors": sm.get("errors"),
            "error": r.get("error"),
        }
    for path in ("rb", "vllm"):
        steps = (doc.get(path) or {}).get("colocated") or []
        if steps:
            s["colocated"][path] = {
                k: _med(steps, k)
                for k in (
                    "sleep_ms",
                    "trainer_alloc_ms",
                    "wake_weights_ms",
                    "update_ms",
                    "wake_kv_ms",
                    "wake_ms",
                    "gen_ms",
                )
            }
            s["colocated"][path]["errors"] = sum(1 for x in steps if "error" in x)
    return s


def report(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    print(f"\n## {NAME}: {doc['config'].get('model')} (floor: flat copy {G.fmt_ms(s['floor_flat_ms'])} ms)\n")
    print(
        "| in-flight update (mode:copy:streams) | pause+update+resume ms | x floor | update ms | resume->1st token ms | resume->every stream ms | decode step ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for cfg, r in s["inflight"].items():
        x = f"{r['e2e_x_floor']:.2f}" if r.get("e2e_x_floor") else "-"
        err = f" ({r['error']})" if r.get("error") else ""
        paths = ",".join(f"{p}x{n}" for p, n in (r.get("paths") or {}).items())
        print(
            f"| {cfg} [{paths}]{err} | {G.fmt_ms(r['e2e_ms'])} | {x} | {G.fmt_ms(r['update_ms'])} | {G.fmt_ms(r['first_token_ms'])} "
            f"| {G.fmt_ms(r['all_streams_ms'])} | {G.fmt_ms(r['decode_step_ms'])} |"
        )
    if s["colocated"]:
        keys = ("sleep_ms", "trainer_alloc_ms", "wake_weights_ms", "update_ms", "wake_kv_ms", "wake_ms", "gen_ms")
        print("\n| colocated step (medians, ms) | " + " | ".join(k.removesuffix("_ms") for k in keys) + " | errors |")
        print("|---|" + "---|" * (len(keys) + 1))
        for path, r in s["colocated"].items():
            print(f"| {path} | " + " | ".join(G.fmt_ms(r.get(k)) for k in keys) + f" | {r['errors']} |")


def plot(doc: dict[str, Any], png: Path) -> None:
    from bench.plots import _plt

    plt = _plt()
    s = doc["summary"]
    ncol = 2 if s["colocated"] else 1
    fig, axes = plt.subplots(1, ncol, figsize=(6.5 * ncol, 4.5), squeeze=False)
    axes = axes[0]
    cfgs = list(s["inflight"])
    ax = axes[0]
    for j, k in enumerate(("e2e_ms", "first_token_ms", "all_streams_ms")):
        ax.bar([i + j * 0.27 for i in range(len(cfgs))], [s["inflight"][c].get(k) or 0 for c in cfgs], 0.27, label=k)
    if s.get("floor_flat_ms"):
        ax.axhline(2 * s["floor_flat_ms"], color="k", ls="--", lw=1, label="2x flat copy")
    ax.set_xticks([i + 0.27 for i in range(len(cfgs))], [c.replace(":", "\n") for c in cfgs], fontsize=7)
    ax.set_ylabel("ms (median)")
    ax.set_yscale("log")
    ax.set_title("in-flight update")
    ax.legend(fontsize=7)
    if not s["colocated"]:
        fig.suptitle(f"{NAME}: {Path(str(doc['config'].get('model'))).name}")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
        return
    ax = axes[1]
    keys = ("sleep_ms", "wake_weights_ms", "update_ms", "wake_kv_ms", "wake_ms")
    paths = list(s["colocated"])
    for j, p in enumerate(paths):
        ax.bar([i + j * 0.4 for i in range(len(keys))], [s["colocated"][p].get(k) or 0 for k in keys], 0.4, label=p)
    ax.set_xticks([i + 0.2 for i in range(len(keys))], [k.removesuffix("_ms") for k in keys], fontsize=8)
    ax.set_title("colocated step phases")
    ax.set_ylabel("ms (median)")
    ax.legend(fontsize=7)
    fig.suptitle(f"{NAME}: {Path(str(doc['config'].get('model'))).name}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run: torch backend, zmq transport, no vLLM phase",
        **dict(seed=0, gpu_memory_utilization=0.5, max_model_len=2048, budget_s=560.0, phase_limit_s=400.0),
        **dict(ready_timeout_s=240.0, request_timeout_s=300.0, control_timeout_s=120.0, first_token_timeout_s=10.0),
    )
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="MODE:COPY:WHERE,... ('' = none)")
    ap.add_argument("--no-colocated", dest="colocated", action="store_false")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vLLM's own path")
    ap.add_argument("--wake", choices=("split", "whole"), default="split")
    ap.add_argument("--sleep-level", type=int, default=1)
    ap.add_argument("--colocated-zero-copy", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-max-tokens", type=int, default=1024)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--gen-prompts", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per config (one more first, apart)")
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--backend-options", type=json.loads, default={}, help="JSON over DEFAULT_BACKEND_OPTIONS")
    ap.add_argument("--stream-load-child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.stream_load_child:
        return stream_load_child(a.stream_load_child)
    H.setup_logging()
    if G.replot(a, report, plot):
        return 0
    budget = G.Budget(a.budget_s)
    od = G.out_dir(a.out_dir)
    log_dir = G.log_dir_of(a, od, NAME)
    env = G.probe_env()
    a.model = G.model_of(a)
    spec = {k: v for k, v in vars(a).items() if k not in ("plot_from", "out_dir", "log_dir", "stream_load_child")}
    spec.update(configs=[c for c in a.configs.split(",") if c], log_dir=str(log_dir))
    doc = G.result_doc(NAME, a, env, targets=TARGETS)
    path = od / f"{NAME}.json"
    print(f"{NAME}: model {a.model}, env {json.dumps(env)}, budget {a.budget_s:.0f}s", flush=True)
    with H.Procs():
        doc["rb"] = G.run_phase(
            "rl-rb", "bench.gpu.rl_step:phase_rb", spec, min(a.phase_limit_s, budget.left() - 5), log_dir
        )
        G.write_doc(path, doc)
        if a.cpu or not a.vllm or not env.get("vllm"):
            doc["vllm"] = {
                "skipped": "--cpu dry run" if a.cpu else ("--no-vllm" if not a.vllm else "vLLM not importable")
            }
        elif budget.left() < 60:
            doc["vllm"] = {"skipped": f"budget: {budget.left():.0f}s left"}
        else:
            G.wait_gpu_idle(30)
            doc["vllm"] = G.run_phase("rl-vllm", "bench.gpu.rl_step:phase_vllm", spec, budget.left() - 5, log_dir)
    doc["summary"] = summarize_doc(doc)
    doc["elapsed_s"] = budget.elapsed()
    G.write_doc(path, doc)
    print(f"wrote {path}", flush=True)
    report(doc)
    try:
        plot(doc, od / f"{NAME}.png")
    except Exception as e:
        print(f"PNG failed: {e!r}", flush=True)
    return 0 if (doc["rb"] or {}).get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
