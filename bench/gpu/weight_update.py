"""Weight updates under load (issue 8 §4): pause + update + resume with 64
streams in flight through rollout-bus, next to the floor of the same bytes.

cuda_ipc phase (one GPU; trainer and engine on GPU 0): the trainer loads the
model (bf16) and, while --streams streams run through a launch.py cluster (1
vLLM engine node), does --updates times, as a trainer would:

    with client.paused("abort"):
        client.update_weights(model.named_parameters(), transport="cuda_ipc")

timing pause, the update alone, resume, the whole block, and resume → the
first token stamped with the new weight version. Floor: a device-to-device
copy of the same bytes (one flat copy, and one copy per tensor).

nccl phase (--nccl, 2 GPUs; trainer GPU 0, engine GPU 1): a raw
torch.distributed NCCL broadcast of the same bytes (whole and in the
transport's buckets) between two processes, then the first update (NCCL group
set-up) and --updates steady-state updates through the client.

Targets (issue 8): pause+update+resume <= 25 ms; resume -> first new token
<= 30 ms; NCCL steady <= 3x raw broadcast; first NCCL update <= 1 s.

Where the time goes: every update prints a TIMING line (pause, each control
round trip the update made — begin / receive / finish —, the trainer's packing
and NCCL send, the engine's commit as its log reports it: worker path
"load_weights+record" (the first update of a layout) or "plan", copy, fallback,
sync; resume; resume -> first token). The NCCL phase sets the group up first
with trainer_bridge.transports.nccl.warm_up_nccl (as SkyRL's init_weight_update_communicator
does; --no-nccl-warm-up leaves it to the first update) and reports that apart.
--resume-ramp-tokens (default 4096; 0 = off): the vllm backend's resume ramp
(the first step after a resume re-prefills at most that many tokens).
--check (after the timed updates): an update with perturbed weights, then one
with the originals, each with weight_check=True (the engine compares every
parameter its plan wrote with vLLM's load_weights, bit for bit), then greedy
outputs must equal those before any update.

    python -m bench.gpu.weight_update --model /tmp/q05 --out-dir $OUT [--nccl]
    python -m bench.gpu.weight_update --cpu      # dry run: torch backend, zmq transport, CPU copy floor
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from bench import harness as H
from bench.gpu import common as G
from bus import protocol as P
from bus.proctree import terminate_tree
from engine_node.timings import CommitTiming, ReceiveTiming, ResumeTiming, Timings, read_timings

NAME = "gpu_weight_update"
TARGETS = {"e2e_ms": 25.0, "first_token_ms": 30.0, "nccl_steady_x_raw": 3.0, "nccl_first_s": 1.0}


# ---------------------------------------------------------------- load


class StreamLoad:
    """`n` streams kept in flight on a thread of their own (its own loop and
    AsyncClient): when one finishes the worker starts the next. Records, per
    weight version, when its first token arrived (perf_counter)."""

    def __init__(self, address: str, n: int, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> None:
        self.address, self.n, self.prompts, self.max_tokens, self.timeout_s = address, n, prompts, max_tokens, timeout_s
        self.first_seen: dict[int, float] = {}
        # weight version -> worker -> when that worker's stream first saw it
        # (every worker always has a stream in flight: all n = every stream resumed)
        self.seen_by: dict[int, dict[int, float]] = {}
        self.tokens = 0
        self.active = 0
        self.finished = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="stream-load", daemon=True)

    def start(self) -> StreamLoad:
        self._thread.start()
        return self

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        from trainer_bridge import AsyncClient

        ac = AsyncClient(self.address, timeout_s=self.timeout_s, control_timeout_s=30)
        params = {"max_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True}

        async def worker(w: int) -> None:
            k = 0
            while not self._stop.is_set():
                p = self.prompts[(w + k * self.n) % len(self.prompts)]
                k += 1
                self.active += 1
                try:
                    got = 0
                    async for ch in ac.stream(p, params):
                        if ch.token_ids:
                            got += len(ch.token_ids)
                            self.tokens += len(ch.token_ids)
                            v = ch.weight_version
                            if v not in self.first_seen:
                                self.first_seen[v] = time.perf_counter()
                            by = self.seen_by.setdefault(v, {})
                            if w not in by:
                                by[w] = time.perf_counter()
                        if self._stop.is_set():
                            break
                    if got == self.max_tokens:
                        self.finished += 1
                    elif not self._stop.is_set():
                        self.errors.append(f"stream ended with {got}/{self.max_tokens} tokens")
                except Exception as e:
                    if not self._stop.is_set():
                        self.errors.append(repr(e)[:300])
                finally:
                    self.active -= 1

        async def stopper() -> None:
            while not self._stop.is_set():
                await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(worker(w)) for w in range(self.n)]
        await stopper()
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ac.close()

    def wait_flowing(self, timeout_s: float) -> None:
        """Until every stream is in flight and tokens come (--ready-timeout-s)."""
        end = time.monotonic() + timeout_s
        t0 = self.tokens
        while time.monotonic() < end:
            if self.active >= self.n and self.tokens > t0 + 4 * self.n:
                return
            time.sleep(0.02)
        raise TimeoutError(
            f"{self.n} streams not flowing after {timeout_s:.0f}s "
            f"(active {self.active}, tokens {self.tokens}, errors {self.errors[:2]})"
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------- trainer side


def load_trainer_model(model: str, cpu: bool, device: str) -> tuple[Any, list[tuple[str, Any]], int]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if cpu else torch.bfloat16
    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to("cpu" if cpu else device)
    named = list(m.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    return m, named, nbytes


def copy_floor(named: list[tuple[str, Any]], nbytes: int, reps: int = 10) -> dict[str, Any]:
    """The same bytes copied on the device: one flat buffer, and tensor by tensor."""
    import torch

    dev = named[0][1].device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dsts = [torch.empty_like(t) for _, t in named]

    def timed(fn: Any) -> float:
        fn()
        sync()
        vals = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            vals.append(time.perf_counter() - t0)
        return H.median(vals)

    with torch.no_grad():
        flat = timed(lambda: dst.copy_(src))
        per = timed(lambda: [d.copy_(t) for d, (_, t) in zip(dsts, named, strict=True)])
    return {
        "bytes": nbytes,
        "device": str(dev),
        "flat_copy_ms": flat * 1e3,
        "per_tensor_copy_ms": per * 1e3,
        "flat_GBps": nbytes / flat / 1e9 if flat else None,
    }


# ---------------------------------------------------------------- where the time goes

CONTROL_LOG: list[tuple[float, str, float]] = []  # (start perf_counter, op type, seconds)
SENDER_LOG: list[dict[str, Any]] = []  # the trainer-side sender's timing, one per update


def instrument() -> None:
    """Time every control round trip the client makes (by op type) and the
    trainer-side senders (bench process only)."""
    from trainer_bridge.client import AsyncClient
    from trainer_bridge.transports.cuda_ipc import CudaIpcSender
    from trainer_bridge.transports.gpu import LAST_PUSH
    from trainer_bridge.transports.nccl import NcclSender

    if getattr(AsyncClient._control_sent, "_bench_timed", False):
        return
    orig = AsyncClient._control_sent

    # control() sends through _control_sent(): every op is timed once, from its
    # send to its reply (pipelined ops overlap); a one-trip update is "OneTrip".
    def _control_sent(self: Any, op: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        reply = orig(self, op, *args, **kw)
        kind = "OneTrip" if getattr(op, "commit", False) is True else type(op).__name__

        async def timed() -> Any:
            try:
                return await reply
            finally:
                CONTROL_LOG.append((t0, kind, time.perf_counter() - t0))

        return timed()

    _control_sent._bench_timed = True  # type: ignore[attr-defined]
    AsyncClient._control_sent = _control_sent  # type: ignore[method-assign]
    health = AsyncClient.health_view

    async def health_view(self: Any, *a: Any, **kw: Any) -> Any:  # the engines read before an update ("Health")
        t0 = time.perf_counter()
        try:
            return await health(self, *a, **kw)
        finally:
            CONTROL_LOG.append((t0, "Health", time.perf_counter() - t0))

    AsyncClient.health_view = health_view  # type: ignore[method-assign]
    share = CudaIpcSender.share

    def timed_share(self: Any, *a: Any, **kw: Any) -> Any:
        r = share(self, *a, **kw)
        SENDER_LOG.append({"pack_s": round(self.last_pack_seconds, 4)})
        return r

    CudaIpcSender.share = timed_share  # type: ignore[method-assign]
    send = NcclSender.send

    def timed_send(self: Any, *a: Any, **kw: Any) -> Any:
        r = send(self, *a, **kw)
        # the trainer's own work before the op left (casts, NaN check, plan, layout id), then the send's
        SENDER_LOG.append({**{f"push_{k}": v for k, v in LAST_PUSH.items()}, **self.last_send_timing})
        return r

    NcclSender.send = timed_send  # type: ignore[method-assign]


class EngineTimings:
    """The engine's timing records (engine_node/timings.py) newer than the last
    read, through the Stats control op: the commit and receive of each update,
    where each resume's first output came from. One engine (the first)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.seen = {"commits": 0, "receives": 0, "resumes": 0}

    def read(self) -> Timings:
        res = self.client.control(P.Stats(), strict=False, timeout_s=30)
        t = read_timings(next(iter(res.values())).detail) if res else Timings()
        new = Timings(
            commits=[c for c in t.commits if c.n > self.seen["commits"]],
            receives=[r for r in t.receives if r.n > self.seen["receives"]],
            resumes=[r for r in t.resumes if r.n > self.seen["resumes"]],
        )
        for kind in self.seen:
            self.seen[kind] = max([self.seen[kind], *(x.n for x in getattr(t, kind))])
        return new

    def skip(self) -> None:
        """Start after what the engine has now (earlier updates are not this run's)."""
        self.read()


def commit_record(c: CommitTiming) -> dict[str, Any]:
    """The flat dict the JSON and the tables keep: the worker's report (s), backend_s."""
    w = msgspec.to_builtins(c.worker) if c.worker is not None else {}
    return {"transport": c.transport, "node_s": c.seconds, "backend_s": c.backend_seconds, **w}


def receive_record(r: ReceiveTiming) -> dict[str, Any]:
    keys = ("seconds", "setup_seconds", "alloc_s", "broadcast_s", "reused")
    return {k: getattr(r, k) for k in keys if getattr(r, k) is not None}


def resume_record(r: ResumeTiming) -> dict[str, Any]:
    """ms after the engine got the Resume; core_*: the vLLM backend's trace."""
    out: dict[str, Any] = {"admitted_ms": r.admitted_ms, "first_output_ms": r.first_output_ms, "running": r.running}
    for k, v in (msgspec.to_builtins(r.backend) if r.backend is not None else {}).items():
        out[f"core_{k}"] = v
    return out


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def timing_line(tag: str, rec: dict[str, Any]) -> str:
    c = rec.get("control_ms") or {}
    snd = rec.get("sender") or {}
    eng = rec.get("engine_commit") or {}
    rcv = rec.get("engine_receive") or {}
    parts = [
        f"path {rec.get('path')}",
        f"pause {rec.get('pause_ms') or 0:.1f}",
        "control " + " ".join(f"{k} {v:.1f}" for k, v in c.items()),
        "trainer " + " ".join(f"{k} {_ms(v)}" for k, v in snd.items()),
    ]
    if rcv:
        parts.append(
            "engine receive "
            + " ".join(f"{k} {_ms(rcv.get(k))}" for k in ("seconds", "setup_seconds", "alloc_s", "broadcast_s"))
        )
    if eng:
        keys = [
            *("backend_s", "seconds", "open_s", "apply_s", "copy_s", "fallback_s"),
            *("record_s", "load_s", "verify_s", "post_sync_s", "check_s"),
        ]
        parts.append(
            f"engine commit [{eng.get('path')}] "
            + " ".join(f"{k} {_ms(eng.get(k))}" for k in keys if eng.get(k) is not None)
            + (f" fallback_names {eng['fallback']}" if eng.get("fallback") is not None else "")
        )
    parts.append(f"resume {rec.get('resume_ms') or 0:.1f}")
    res = rec.get("engine_resume") or {}
    if res:
        parts.append(
            "engine after Resume "
            + " ".join(f"{k.removesuffix('_ms')} {v}" for k, v in res.items() if k.endswith("_ms"))
            + f" (running {res.get('running')}"
            + "".join(
                f", {k.removeprefix('core_')} {res[k]}"
                for k in ("core_live", "core_sent", "core_sent_tokens", "core_batches_before")
                if k in res
            )
            + ")"
        )
    parts.append(f"first token {rec.get('first_token_ms') or 0:.1f}, every stream {rec.get('all_streams_ms') or 0:.1f}")
    return f"TIMING {tag} update {rec.get('i')} (ms): " + " | ".join(parts)


def timed_updates(
    client: Any,
    named: list[tuple[str, Any]],
    load: StreamLoad,
    transport: str,
    n: int,
    gap_s: float,
    first_token_timeout_s: float,
    options: dict[str, Any],
    tag: str = "",
    pause_mode: str = "abort",
) -> list[dict[str, Any]]:
    """n pause+update+resume blocks under load; one dict of timings each (the
    engine's own from its Stats). pause_mode "keep" leaves the streams in the
    engine with their KV cache; "pipe-abort" / "pipe-keep": one
    `update_weights(pause=...)` (pause, update and resume pipelined; resume ->
    first token counts from when the Resume was sent). `path`: how the update
    ran ("one_trip" | "two_trip", the engine's WeightsCommitted.detail)."""
    out = []
    engine = EngineTimings(client)
    engine.skip()
    for i in range(n):
        time.sleep(gap_s)  # streams back at full speed
        rec: dict[str, Any] = {"i": i, "streams_in_flight": load.active}
        c0, s0 = len(CONTROL_LOG), len(SENDER_LOG)
        try:
            t0 = time.perf_counter()
            if pause_mode.startswith("pipe-"):
                r = client.update_weights(named, transport=transport, pause=pause_mode.removeprefix("pipe-"), **options)
                t1 = t3 = time.perf_counter()
                sent = [t for t, kind, _ in CONTROL_LOG[c0:] if kind == "Resume"]
                t2 = sent[-1] if sent else t0  # when the Resume left (right behind the update)
            else:
                with client.paused(pause_mode):
                    t1 = time.perf_counter()
                    r = client.update_weights(named, transport=transport, **options)
                    t2 = time.perf_counter()
                t3 = time.perf_counter()
            res = dict(next(iter(r.values())))  # a typed result, read as the dict it was
            v = res["weight_version"]  # the version the streams will carry (KeyError: recorded as the error)
            rec.update(
                pause_ms=(t1 - t0) * 1e3 if t1 != t3 else None,
                update_ms=(t2 - t1) * 1e3 if t1 != t3 else None,
                resume_ms=(t3 - t2) * 1e3 if t1 != t3 else None,
                e2e_ms=(t3 - t0) * 1e3,
                weight_version=v,
                engine_result=res,
                path=res.get("path"),  # the result's detail, flattened by dict()
                one_trip_prepare_ms=(res.get("prepare_s") or 0) * 1e3 or None,
            )
            end = time.monotonic() + first_token_timeout_s
            while v not in load.first_seen and time.monotonic() < end:
                time.sleep(0.0005)
            # resume is sent when the `with` block exits (t2): resume -> first token of the new version
            rec["first_token_ms"] = (load.first_seen[v] - t2) * 1e3 if v in load.first_seen else None
            while len(load.seen_by.get(v, ())) < load.n and time.monotonic() < end:
                time.sleep(0.0005)
            by = load.seen_by.get(v, {})
            # every stream of the load has a token of the new version (the whole burst re-prefilled)
            rec["all_streams_ms"] = (max(by.values()) - t2) * 1e3 if len(by) == load.n else None
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        ctl: dict[str, float] = {}
        for _, kind, dt in CONTROL_LOG[c0:]:
            k = kind.removesuffix("WeightUpdate").removesuffix("Weights") or kind
            ctl[k] = ctl.get(k, 0.0) + dt * 1e3
        rec["control_ms"] = {k: round(v, 2) for k, v in ctl.items()}
        if rec.get("update_ms") is not None:
            # the client's own time inside update_weights outside every round
            # trip it made (casts, NaN check, plan, thread hops, the broadcast's tail)
            inside = sum(dt for t, _, dt in CONTROL_LOG[c0:] if t1 <= t <= t2) * 1e3
            rec["outside_control_ms"] = round(rec["update_ms"] - inside, 3)
        rec["sender"] = SENDER_LOG[s0] if len(SENDER_LOG) > s0 else {}
        try:
            t = engine.read()  # after the control timings above: this Stats op is not one of them
        except Exception as e:
            rec["engine_timings_error"] = f"{type(e).__name__}: {e}"[:300]
            t = Timings()
        if t.commits:
            rec["engine_commit"] = commit_record(t.commits[-1])
        if t.receives:
            rec["engine_receive"] = receive_record(t.receives[-1])
        if t.resumes:
            rec["engine_resume"] = resume_record(t.resumes[-1])  # ms after the engine got the Resume
        out.append(rec)
        print(timing_line(tag, rec), flush=True)
        print(
            f"  update {i}: "
            + json.dumps(
                {
                    k: (round(v, 2) if isinstance(v, float) else v)
                    for k, v in rec.items()
                    if k
                    not in ("engine_result", "engine_commit", "engine_receive", "engine_resume", "control_ms", "sender")
                }
            ),
            flush=True,
        )
    return out


def breakdown(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of every timed part over the steady updates (ms)."""
    parts: dict[str, list[float]] = {}

    def add(k: str, v: Any, scale: float = 1.0) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            parts.setdefault(k, []).append(float(v) * scale)

    for u in updates:
        if "error" in u:
            continue
        for k, v in (u.get("control_ms") or {}).items():
            add("control." + k, v)
        add("outside_control_ms", u.get("outside_control_ms"))
        for k, v in (u.get("sender") or {}).items():
            add("trainer." + k, v, 1e3)
        for k, v in (u.get("engine_receive") or {}).items():
            add("engine_receive." + k, v, 1e3)
        for k, v in (u.get("engine_resume") or {}).items():
            add("engine_resume." + k, v)
        for k, v in (u.get("engine_commit") or {}).items():
            if k != "fallback":
                add("engine_commit." + k, v, 1e3)
    return {k: round(H.median(v), 3) for k, v in sorted(parts.items())}


def _greedy(client: Any, spec: dict[str, Any]) -> list[dict[str, Any]]:
    prompts = _prompts(spec)[:8]
    res = client.generate(prompts, {"max_tokens": 32, "temperature": 0.0, "logprobs": 0})
    return [{"tokens": list(r.token_ids), "logprobs": list(r.logprobs or [])} for r in res]


def weight_check(
    client: Any,
    named: list[tuple[str, Any]],
    transport: str,
    opts: dict[str, Any],
    greedy0: list[dict[str, Any]] | None,
    spec: dict[str, Any],
) -> dict[str, Any]:
    """Fast path == load_weights, on the device: a perturbed update, then the
    originals back, each with weight_check=True (the engine reports every
    parameter whose plan-written bits differ from load_weights'); then the
    greedy outputs must equal those taken before any update."""
    import torch

    out: dict[str, Any] = {}
    end = time.monotonic() + 10.0  # the cancelled load's requests leave the engine first
    while time.monotonic() < end and int(client.stats().get("in_flight", 0)):
        time.sleep(0.05)
    engine = EngineTimings(client)
    engine.skip()
    g = torch.Generator(device=named[0][1].device).manual_seed(1234)
    with torch.no_grad():
        noisy = [(n, t + 0.01 * torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)) for n, t in named]
    for tag, ws in (("perturbed", noisy), ("original", named)):
        client.update_weights(ws, transport=transport, weight_check=True, **opts)
        commits = engine.read().commits
        c = commit_record(commits[-1]) if commits else {}
        out[tag] = {k: c.get(k) for k in ("path", "check_params", "check_mismatch", "check_s")}
        if tag == "perturbed" and greedy0 is not None:
            out["perturbed_changes_output"] = _greedy(client, spec) != greedy0
    del noisy
    if greedy0 is not None:
        g2 = _greedy(client, spec)
        out["greedy_tokens_equal"] = [x["tokens"] for x in g2] == [x["tokens"] for x in greedy0]
        out["greedy_logprobs_equal"] = g2 == greedy0
    seen = [out[t] for t in ("perturbed", "original") if out[t].get("path") is not None]
    if not seen:
        out["engine_check"] = "no worker commit report in the engine's timings (not the vllm backend?)"
    out["ok"] = all(c.get("path") == "plan" and c.get("check_mismatch") == [] for c in seen) and (
        out.get("greedy_tokens_equal", True) is True
    )
    return out


def summarize(updates: list[dict[str, Any]], skip_first: bool) -> dict[str, Any]:
    ok = [u for u in updates if "error" not in u]
    steady = ok[1:] if skip_first and len(ok) > 1 else ok
    s: dict[str, Any] = {"n": len(steady), "errors": len(updates) - len(ok)}
    keys = ("pause_ms", "update_ms", "resume_ms", "e2e_ms", "first_token_ms", "all_streams_ms", "one_trip_prepare_ms")
    for k in keys:
        vals = [u[k] for u in steady if u.get(k) is not None]
        s[k] = {"median": H.median(vals), "min": min(vals), "max": max(vals)} if vals else None
    # which path the steady updates took (one_trip once the engines hold the zero-copy layout)
    s["paths"] = {p: sum(1 for u in steady if u.get("path") == p) for p in {u.get("path") for u in steady}}
    if ok:
        s["first"] = {
            k: ok[0].get(k) for k in ("pause_ms", "update_ms", "resume_ms", "e2e_ms", "first_token_ms", "path")
        }
    return s


# ---------------------------------------------------------------- phases


def _prompts(spec: dict[str, Any]) -> list[list[int]]:
    return G.make_prompts(
        max(2 * spec["streams"], 8), spec["prompt_min"], spec["prompt_max"], G.model_vocab(spec["model"]), spec["seed"]
    )


def _run_under_load(
    spec: dict[str, Any], gpus: str | None, trainer_device: str, transport: str, out: dict[str, Any], floor: bool
) -> None:
    from trainer_bridge import Client

    cpu = spec["cpu"]
    eng = (
        {}
        if cpu
        else {"gpu_memory_utilization": spec["gpu_memory_utilization"], "max_model_len": spec["max_model_len"]}
    )
    if not cpu:
        # log_stats: vLLM then records each request's queued / scheduled times, which
        # the engine's resume trace reports (where resume -> first token goes).
        eng["backend_options"] = {"log_stats": bool(spec.get("log_stats", True))}
        if spec.get("resume_ramp_tokens"):
            r = spec["resume_ramp_tokens"]
            eng["backend_options"]["resume_ramp_tokens"] = r if r == "auto" else int(r)
        eng["backend_options"].update(spec.get("backend_options") or {})
    with G.RbCluster(
        spec["model"],
        ("tests.nccl_backend:factory" if transport == "nccl" else "torch") if cpu else "vllm",
        engines=1,
        gpus=None if cpu else gpus,
        ready_timeout_s=spec["ready_timeout_s"],
        log_dir=Path(spec["log_dir"]),
        **eng,
    ) as cl:
        out["engine_start_s"], out["engines"] = cl.wait_ready()
        spec["_partial"].update(out)
        _, named, nbytes = load_trainer_model(spec["model"], cpu, trainer_device)
        out["bytes"] = nbytes
        out["params"] = sum(t.numel() for _, t in named)
        if floor:
            out["floor"] = copy_floor(named, nbytes)
            spec["_partial"].update(out)
        client = Client(cl.address, timeout_s=spec["request_timeout_s"], control_timeout_s=spec["control_timeout_s"])
        # The reference greedy outputs come from the IDLE engine, as the check's do
        # (after the load stopped): vLLM is not batch-invariant, so greedy tokens
        # taken next to 64 streams may differ from the same request served alone.
        greedy0 = _greedy(client, spec) if spec.get("check") else None
        # Taken twice: if the idle engine does not repeat itself, a check that
        # differs after perturbed -> original says nothing about the weights.
        repeat = None if greedy0 is None else _greedy(client, spec) == greedy0
        load = StreamLoad(
            cl.address, spec["streams"], _prompts(spec), spec["stream_max_tokens"], spec["request_timeout_s"]
        ).start()
        instrument()
        try:
            opts: dict[str, Any] = {"device": trainer_device} if transport != "zmq" else {}
            if transport == "cuda_ipc" and spec.get("zero_copy"):
                opts["zero_copy"] = True
            if not spec.get("one_trip", True):
                opts["one_trip"] = False
            if transport == "nccl" and spec.get("nccl_warm_up", True):
                # as SkyRL's init_weight_update_communicator does: the group is set up
                # before the first update (reported apart from it)
                from trainer_bridge.transports.nccl import warm_up_nccl

                t0 = time.perf_counter()
                out["nccl_init"] = client._call(warm_up_nccl(client._aclient, opts), spec["control_timeout_s"])
                out["nccl_init"]["bench_s"] = round(time.perf_counter() - t0, 4)
                print("TIMING nccl init (warm_up_nccl): " + json.dumps(out["nccl_init"]), flush=True)
            load.wait_flowing(spec["ready_timeout_s"])
            out["updates"] = timed_updates(
                client,
                named,
                load,
                transport,
                spec["updates"] + 1,
                spec["gap_s"],
                spec["first_token_timeout_s"],
                opts,
                tag=transport,
                pause_mode=spec.get("pause", "abort"),
            )
            out["summary"] = summarize(out["updates"], skip_first=True)
            out["breakdown"] = breakdown(out["updates"][1:])
        finally:
            load.stop()
        try:
            if spec.get("check"):
                out["check"] = weight_check(client, named, transport, opts, greedy0, spec)
                out["check"]["greedy_idle_repeat_equal"] = repeat
                print("CHECK " + json.dumps(out["check"]), flush=True)
        finally:
            client.close()
        out["load"] = {
            "streams": spec["streams"],
            "stream_max_tokens": spec["stream_max_tokens"],
            "tokens": load.tokens,
            "streams_finished": load.finished,
            "stream_errors": len(load.errors),
            "stream_error_sample": load.errors[:3],
        }


def phase_ipc(spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"transport": spec["ipc_transport"]}
    _run_under_load(spec, "0", "cuda:0", spec["ipc_transport"], out, floor=True)
    return out


def phase_nccl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch  # noqa: F401

    out: dict[str, Any] = {"transport": "nccl"}
    from transformers import AutoConfig  # noqa: F401 - fail early if missing

    if spec["cpu"]:
        # Dry run: the nccl path over GLOO (tests/nccl_backend.py: the engine's
        # receive protocol on the torch backend; the trainer's group made the
        # same way): every control op, the one-trip and the breakdown run as
        # on the GPU machine; no raw broadcast (it needs two GPUs).
        from tests.nccl_backend import gloo_connect
        from trainer_bridge.transports.nccl import NcclSender

        NcclSender.connect = gloo_connect  # type: ignore[method-assign,assignment]
        out["raw_broadcast"] = {"skipped": "--cpu dry run"}
        _run_under_load(spec, None, "cpu", "nccl", out, floor=False)
        return out

    nbytes = _model_bytes(spec["model"])
    out["raw_broadcast"] = raw_broadcast(nbytes, spec)
    spec["_partial"].update(out)
    try:
        out["raw_broadcast_engine_like"] = raw_broadcast(nbytes, spec, engine_like=True)
    except Exception as e:
        out["raw_broadcast_engine_like"] = {"error": repr(e)[:500]}
    spec["_partial"].update(out)
    _run_under_load(spec, "1", "cuda:0", "nccl", out, floor=False)
    return out


def _model_bytes(model: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * 2  # bf16 on the wire
    return total


# ---------------------------------------------------------------- raw NCCL broadcast


def raw_broadcast(nbytes: int, spec: dict[str, Any], engine_like: bool = False) -> dict[str, Any]:
    """Two processes (GPU 0 -> GPU 1), torch.distributed NCCL: the same bytes
    broadcast whole and in the transport's buckets; medians of --raw-reps.
    engine_like: the receiver sees only GPU 1 (CUDA_VISIBLE_DEVICES=1), as
    launch.py's engine does, which can change the transport NCCL picks."""
    from bus.tensors import DEFAULT_BUCKET_BYTES

    port = H.free_port()
    procs = []
    outs = []
    try:
        for rank in (0, 1):
            restrict = engine_like and rank == 1
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.gpu.weight_update",
                        "--raw-rank",
                        str(rank),
                        "--raw-port",
                        str(port),
                        "--raw-bytes",
                        str(nbytes),
                        "--raw-bucket",
                        str(DEFAULT_BUCKET_BYTES),
                        "--raw-reps",
                        str(spec["raw_reps"]),
                        "--raw-device",
                        "0" if restrict else str(rank),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=str(G.REPO_ROOT),
                    start_new_session=True,
                    env=G.child_env({"CUDA_VISIBLE_DEVICES": "1"} if restrict else None),
                )
            )
        for p in procs:
            o, _ = p.communicate(timeout=spec["raw_timeout_s"])
            outs.append(o)
    finally:
        for p in procs:
            terminate_tree(p, 2.0)
    res = [json.loads(line[4:]) for o in outs for line in o.splitlines() if line.startswith("RAW ")]
    if len(res) != 2:
        raise RuntimeError("raw broadcast failed (--raw-timeout-s):\n" + "\n".join(o[-1500:] for o in outs))
    # the slower rank's median: the bytes are there only when both are done
    return {
        "bytes": nbytes,
        "bucket_bytes": DEFAULT_BUCKET_BYTES,
        "receiver_sees_only_gpu1": engine_like,
        "whole_ms": max(r["whole_ms"] for r in res),
        "bucketed_ms": max(r["bucketed_ms"] for r in res),
        "per_rank": res,
    }


def raw_rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(a.raw_device)
    dist.init_process_group("nccl", init_method=f"tcp://{H.LOOPBACK}:{a.raw_port}", rank=a.raw_rank, world_size=2)
    buf = torch.empty(a.raw_bytes, dtype=torch.uint8, device="cuda")
    chunks = [buf[i : i + a.raw_bucket] for i in range(0, a.raw_bytes, a.raw_bucket)]

    def timed(fn: Any) -> float:
        vals = []
        for k in range(a.raw_reps + 2):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if k >= 2:  # two warm-ups
                vals.append(time.perf_counter() - t0)
        return H.median(vals) * 1e3

    whole = timed(lambda: dist.broadcast(buf, src=0))
    bucketed = timed(lambda: [dist.broadcast(c, src=0) for c in chunks])
    print(
        "RAW " + json.dumps({"rank": a.raw_rank, "whole_ms": whole, "bucketed_ms": bucketed, "buckets": len(chunks)}),
        flush=True,
    )
    dist.destroy_process_group()


# ---------------------------------------------------------------- report


def report(doc: dict[str, Any]) -> None:
    rows = []
    ipc = doc.get("ipc") or {}
    nccl = doc.get("nccl") or {}

    def m(s: dict[str, Any] | None, k: str) -> float | None:
        return ((s or {}).get(k) or {}).get("median")

    def row(what: str, val: float | None, target: str, ok: bool | None, note: str = "") -> None:
        rows.append(
            {
                "measure": what,
                "value": "-" if val is None else f"{val:.2f}",
                "target": target,
                "meets": "-" if ok is None else ("yes" if ok else "NO"),
                "note": note,
            }
        )

    s: Any = ipc.get("summary")
    tr = ipc.get("transport", "cuda_ipc")
    if ipc.get("skipped") or not ipc.get("ok", False) and not s:
        row(f"{tr} phase", None, "", None, ipc.get("skipped") or f"FAILED: {str(ipc.get('error'))[:150]}")
    else:
        e2e, ft = m(s, "e2e_ms"), m(s, "first_token_ms")
        inflight = [u.get("streams_in_flight") for u in ipc.get("updates", [])]
        row(
            f"pause+{tr} update+resume, ms (median of {s['n']}, {max(inflight or [0])} streams)",
            e2e,
            f"<= {TARGETS['e2e_ms']:.0f}",
            None if e2e is None else e2e <= TARGETS["e2e_ms"],
        )
        row("  pause(abort) ms", m(s, "pause_ms"), "", None)
        row(f"  update alone ms ({(ipc.get('bytes') or 0) / 1e9:.2f} GB)", m(s, "update_ms"), "", None)
        row("  resume ms", m(s, "resume_ms"), "", None)
        ramp = doc.get("config", {}).get("resume_ramp_tokens")
        row(
            f"resume -> first new token ms (resume ramp {ramp or 'off'}"
            + "".join(f", {k} {v}" for k, v in (doc.get("config", {}).get("backend_options") or {}).items())
            + ")",
            ft,
            f"<= {TARGETS['first_token_ms']:.0f}",
            None if ft is None else ft <= TARGETS["first_token_ms"],
        )
        row("resume -> every stream has a new token ms", m(s, "all_streams_ms"), "", None)
        row("first update (excluded above): e2e ms", (s.get("first") or {}).get("e2e_ms"), "", None)
        fl = ipc.get("floor") or {}
        row(f"floor: one flat copy of the same bytes ({fl.get('device')}) ms", fl.get("flat_copy_ms"), "", None)
        row("floor: the same tensors copied one by one ms", fl.get("per_tensor_copy_ms"), "", None)
        _check_rows(row, ipc)
        ld = ipc.get("load") or {}
        row(
            "streams lost/truncated during the updates",
            float(ld.get("stream_errors", 0)),
            "0",
            ld.get("stream_errors", 0) == 0,
            "; ".join(ld.get("stream_error_sample", []))[:150],
        )
    if nccl.get("skipped") or not nccl:
        row("nccl phase", None, "", None, nccl.get("skipped", "not run"))
    elif not nccl.get("summary"):
        row("nccl phase", None, "", None, f"FAILED: {str(nccl.get('error'))[:150]}")
        if (nccl.get("raw_broadcast") or {}).get("whole_ms") is not None:
            row("raw NCCL broadcast, same bytes, ms", nccl["raw_broadcast"]["whole_ms"], "", None)
    else:
        s = nccl["summary"]
        raw = nccl.get("raw_broadcast") or {}
        first = (s.get("first") or {}).get("update_ms")
        steady = m(s, "update_ms")
        init = nccl.get("nccl_init") or {}
        if init:
            row(
                "NCCL group set-up at init (warm_up_nccl, before the first update) s",
                init.get("bench_s", init.get("seconds")),
                "",
                None,
                f"trainer {init.get('trainer')}"[:150],
            )
        row(
            "first NCCL update " + ("(group set up at init) s" if init else "(group set-up) s"),
            None if first is None else first / 1e3,
            f"<= {TARGETS['nccl_first_s']:.0f}",
            None if first is None else first / 1e3 <= TARGETS["nccl_first_s"],
        )
        row(f"steady NCCL update ms (median of {s['n']})", steady, "", None)
        row(
            "raw NCCL broadcast, same bytes, whole / bucketed ms",
            raw.get("whole_ms"),
            "",
            None,
            f"bucketed {raw.get('bucketed_ms', 0):.2f} ms",
        )
        x = steady / raw["whole_ms"] if steady and raw.get("whole_ms") else None
        row(
            "steady / raw broadcast",
            x,
            f"<= {TARGETS['nccl_steady_x_raw']:.0f}x",
            None if x is None else x <= TARGETS["nccl_steady_x_raw"],
        )
        el = nccl.get("raw_broadcast_engine_like") or {}
        row(
            "raw broadcast, receiver sees only GPU 1 (as the engine), whole ms",
            el.get("whole_ms"),
            "",
            None,
            f"bucketed {el['bucketed_ms']:.2f} ms" if el.get("bucketed_ms") else str(el.get("error", ""))[:100],
        )
        _check_rows(row, nccl)
        row("NCCL pause+update+resume ms (median)", m(s, "e2e_ms"), "", None)
        row("NCCL resume -> first new token ms", m(s, "first_token_ms"), "", None)
        row("NCCL resume -> every stream has a new token ms", m(s, "all_streams_ms"), "", None)
    env = doc.get("env", {})
    H.print_table(
        rows,
        title=f"Weight update under load ({env.get('gpu_name') or 'CPU'}, {env.get('gpus', 0)} GPU(s); "
        f"model {doc.get('config', {}).get('model')})",
    )


def _check_rows(row: Any, phase: dict[str, Any]) -> None:
    ck = phase.get("check")
    if not ck:
        return
    for t in ("perturbed", "original"):
        c = ck.get(t) or {}
        row(
            f"check ({t} update): params the plan wrote != load_weights'",
            None if c.get("check_mismatch") is None else float(len(c["check_mismatch"])),
            "0",
            None if c.get("check_mismatch") is None else not c["check_mismatch"],
            f"path {c.get('path')}, {c.get('check_params')} params compared; {c.get('check_mismatch')}"[:150],
        )
    row(
        "check: greedy tokens after perturbed -> original == before",
        None,
        "equal",
        ck.get("greedy_tokens_equal"),
        f"logprobs equal {ck.get('greedy_logprobs_equal')}; perturbed changed output {ck.get('perturbed_changes_output')}; "
        f"idle engine repeats itself (no update between) {ck.get('greedy_idle_repeat_equal')}",
    )


def plot(doc: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no PNG ({e!r})", flush=True)
        return
    series = []
    for key in ("ipc", "nccl"):
        ph = doc.get(key) or {}
        for u in ph.get("updates", []):
            if "error" not in u:
                series.append((f"{ph.get('transport')} #{u['i']}", u))
    if not series:
        return
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(series) + 2), 4))
    bottoms = [0.0] * len(series)
    for k, c in (("pause_ms", "C0"), ("update_ms", "C1"), ("resume_ms", "C2")):
        vals = [u.get(k) or 0 for _, u in series]
        ax.bar(range(len(series)), vals, bottom=bottoms, label=k[:-3], color=c)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.plot(range(len(series)), [u.get("first_token_ms") or 0 for _, u in series], "k.", label="resume -> first token")
    ax.plot(range(len(series)), [u.get("all_streams_ms") or 0 for _, u in series], "kx", label="resume -> every stream")
    ax.axhline(TARGETS["e2e_ms"], color="gray", ls="--", lw=0.8)
    ax.set_xticks(range(len(series)))
    ax.set_xticklabels([n for n, _ in series], rotation=60, fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title("pause + update + resume under load (dashed: 25 ms target)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}", flush=True)


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="CPU dry run: torch backend + tiny model, zmq transport, 8 streams; --nccl: the nccl path over gloo",
        **dict(seed=0, gpu_memory_utilization=0.85, max_model_len=2048, budget_s=500.0, phase_limit_s=240.0),
        **dict(min_phase_s=60.0, ready_timeout_s=180.0, request_timeout_s=300.0, control_timeout_s=60.0),
        **dict(first_token_timeout_s=10.0, gpu_idle_timeout_s=30.0),
    )
    ap.add_argument("--nccl", action="store_true", help="also the NCCL phase (2 GPUs: trainer 0, engine 1)")
    ap.add_argument(
        "--zero-copy",
        action="store_true",
        help="cuda_ipc: update_weights(zero_copy=True) (one op per update once the engine holds the layout)",
    )
    ap.add_argument(
        "--pause",
        choices=("abort", "keep", "pipe-abort", "pipe-keep"),
        default="abort",
        help="with client.paused(MODE), or pipe-MODE: update_weights(pause=MODE), pipelined",
    )
    ap.add_argument("--no-ipc", dest="ipc", action="store_false", help="skip the cuda_ipc phase")
    ap.add_argument(
        "--no-one-trip",
        dest="one_trip",
        action="store_false",
        help="update_weights(one_trip=False): every update two round trips (the nccl steady state before the one-trip)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="after the timed updates: fast path == load_weights bit for bit (weight_check) + greedy unchanged",
    )
    ap.add_argument(
        "--backend-options",
        type=json.loads,
        default={},
        help="JSON: more vllm backend options, e.g. '{\"extra_graph_tokens\": 2048}' (graphs for first steps past 512)",
    )
    ap.add_argument(
        "--no-log-stats",
        dest="log_stats",
        action="store_false",
        help="start the engine without vLLM's log_stats (on by default: the resume trace reads its request events)",
    )
    ap.add_argument(
        "--resume-ramp-tokens",
        default="auto",
        help="vllm backend option resume_ramp_tokens: 0 (off), a token count, or auto (the engine's largest CUDA "
        "graph): the first step after a resume re-prefills the shortest parked streams up to that many tokens, the "
        "rest follow once it produced output",
    )
    ap.add_argument(
        "--no-nccl-warm-up",
        dest="nccl_warm_up",
        action="store_false",
        help="leave the NCCL group set-up to the first update (the old behaviour)",
    )
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-max-tokens", type=int, default=1024)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--updates", type=int, default=5, help="measured updates (one more first, reported apart)")
    ap.add_argument("--gap-s", type=float, default=0.5, help="streams run this long between updates")
    ap.add_argument("--raw-reps", type=int, default=10)
    ap.add_argument("--raw-timeout-s", type=float, default=120.0)
    # internal: one rank of the raw broadcast
    ap.add_argument("--raw-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--raw-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--raw-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--raw-bucket", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--raw-device", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu:
        given = " ".join(argv if argv is not None else sys.argv[1:])
        for k, v in dict(
            streams=8,
            stream_max_tokens=256,
            prompt_min=8,
            prompt_max=32,
            updates=3,
            gap_s=0.3,
            budget_s=240.0,
            ready_timeout_s=120.0,
        ).items():
            if "--" + k.replace("_", "-") not in given:
                setattr(a, k, v)
    return a


def main(argv: list[str] | None = None) -> int:
    H.setup_logging()
    a = parse(argv)
    if a.raw_rank is not None:
        raw_rank_main(a)
        return 0
    if G.replot(a, report, plot):
        return 0
    budget = G.Budget(a.budget_s)
    od = G.out_dir(a.out_dir)
    log_dir = G.log_dir_of(a, od, NAME)
    env = G.probe_env()
    a.model = G.model_of(a)
    spec = {
        "model": a.model,
        "cpu": a.cpu,
        "streams": a.streams,
        "stream_max_tokens": a.stream_max_tokens,
        "prompt_min": a.prompt_min,
        "prompt_max": a.prompt_max,
        "seed": a.seed,
        "updates": a.updates,
        "gap_s": a.gap_s,
        "zero_copy": a.zero_copy,
        "pause": a.pause,
        "gpu_memory_utilization": a.gpu_memory_utilization,
        "max_model_len": a.max_model_len,
        "ready_timeout_s": a.ready_timeout_s,
        "request_timeout_s": a.request_timeout_s,
        "control_timeout_s": a.control_timeout_s,
        "first_token_timeout_s": a.first_token_timeout_s,
        "raw_reps": a.raw_reps,
        "raw_timeout_s": a.raw_timeout_s,
        "log_dir": str(log_dir),
        "ipc_transport": "zmq" if a.cpu else "cuda_ipc",
        "check": a.check,
        "resume_ramp_tokens": a.resume_ramp_tokens,
        "log_stats": a.log_stats,
        "backend_options": a.backend_options,
        "nccl_warm_up": a.nccl_warm_up,
        "one_trip": a.one_trip,
    }
    doc = G.result_doc(NAME, a, env, targets=TARGETS)
    path = od / f"{NAME}.json"
    print(f"{NAME}: model {a.model}, env {json.dumps(env)}, budget {a.budget_s:.0f}s", flush=True)
    phases = [
        ("ipc", "bench.gpu.weight_update:phase_ipc", a.ipc, None),
        (
            "nccl",
            "bench.gpu.weight_update:phase_nccl",
            a.nccl,
            None if a.cpu or env.get("gpus", 0) >= 2 else f"needs 2 GPUs, have {env.get('gpus', 0)}",
        ),
    ]
    with H.Procs():  # SIGTERM → SystemExit: phases unwind and kill their trees
        for key, target, wanted, reason in phases:
            if not wanted:
                reason = "not asked for" + (" (--nccl)" if key == "nccl" else " (--no-ipc)")
            if reason is None and not a.cpu and not env.get("vllm"):
                reason = "vLLM not importable"
            if reason is None and budget.left() < a.min_phase_s:
                reason = f"budget: {budget.left():.0f}s left < --min-phase-s"
            if reason:
                doc[key] = {"skipped": reason}
                print(f"[{key}] skipped: {reason}", flush=True)
            else:
                doc[key] = G.run_phase(f"wu-{key}", target, spec, min(a.phase_limit_s, budget.left() - 5), log_dir)
                if doc[key].get("nccl_init"):
                    print(f"[{key}] TIMING nccl init: {json.dumps(doc[key]['nccl_init'])}", flush=True)
                for u in doc[key].get("updates") or []:
                    print(f"[{key}] " + timing_line(key, u), flush=True)
                if doc[key].get("breakdown"):
                    print(f"[{key}] TIMING medians (ms): {json.dumps(doc[key]['breakdown'])}", flush=True)
                if doc[key].get("check"):
                    print(f"[{key}] CHECK {json.dumps(doc[key]['check'])}", flush=True)
                if not a.cpu:
                    doc[key]["gpu_idle"] = G.wait_gpu_idle(a.gpu_idle_timeout_s)
            doc["elapsed_s"] = budget.elapsed()
            G.write_doc(path, doc)
    print(f"wrote {path}", flush=True)
    try:
        plot(doc, od / f"{NAME}.png")
    except Exception as e:
        print(f"PNG failed: {e!r}", flush=True)
    report(doc)
    return 0 if any((doc.get(k) or {}).get("ok") for k in ("ipc", "nccl")) else 1


if __name__ == "__main__":
    sys.exit(main())
