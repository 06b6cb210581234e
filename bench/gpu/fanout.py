"""Weights into many engines at once (issue 33 §3), two phases:

nccl (--nccl): ONE trainer (GPU 0) -> N engines (GPUs 1..N, N = GPUs - 1 or
--engines), one NCCL group of 1 + N ranks. First a raw torch.distributed
NCCL broadcast of the same bytes from rank 0 to the same N receivers (each
seeing only its own GPU, as an engine does), whole and in the transport's
buckets, in the same run; then a launch.py cluster of N vLLM engines under
--streams streams, warm_up_nccl (the group, reported apart), and --updates + 1
pause + update + resume blocks (bench/gpu/weight_update.py's StreamLoad and
timed_updates). Reported: steady update / raw bucketed broadcast, the first
update, streams lost (0), per-token versions (every chunk of the audit
streams carries a committed version and a stream's versions never go back),
and every engine on the new version after each update (or none).

colocated (--colocated): N engines on GPUs 0..N-1 and N trainer ranks, rank r
a process on GPU r holding the FULL model (SkyRL's colocate_all after its
FSDP gather). One update: the coordinator opens `weight_update(senders=N,
transport="cuda_ipc")`, rank r sends to the engine on its own GPU only
(`weight_sender(uid, r, engines=[e_r])`; the others get its empty part), the
coordinator commits once. Measured against the one-GPU figure of the same run
(senders=1, targets=[e0], rank 0 alone), reps interleaved. Each rank's
send start/end (wall clock) is recorded: the ranks' sends overlap (nothing
is serialised through the head, which only carries begin / parts' acks /
commit; the bytes never leave a GPU).

Targets (issue 33): nccl steady <= 1.5x the raw broadcast; first <= 1 s;
colocated N engines <= 1.2x one engine.

    python -m bench.gpu.fanout --model /tmp/q7b --out-dir $OUT --nccl --colocated   # 4 GPUs
    python -m bench.gpu.fanout --cpu --nccl --colocated    # dry run: 3 torch engines over gloo, 2 over zmq
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import weight_update as W
from bus.proctree import terminate_tree

NAME = "gpu_fanout"
TARGETS = {"nccl_steady_x_raw": 1.5, "nccl_first_s": 1.0, "colocated_x_one": 1.2}


# ---------------------------------------------------------------- version audit


class VersionAudit:
    """`n` streams beside the load whose every chunk's weight version is kept,
    per stream, in arrival order (its own thread and AsyncClient)."""

    def __init__(self, address: str, n: int, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> None:
        self.address, self.n, self.prompts, self.max_tokens, self.timeout_s = address, n, prompts, max_tokens, timeout_s
        self.seqs: list[list[int]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> VersionAudit:
        self._t.start()
        return self

    async def _run(self) -> None:
        from trainer_bridge import AsyncClient

        ac = AsyncClient(self.address, timeout_s=self.timeout_s, control_timeout_s=30)
        params = {"max_tokens": self.max_tokens, "temperature": 1.0, "ignore_eos": True}

        async def one(w: int) -> None:
            k = 0
            while not self._stop.is_set():
                seq: list[int] = []
                self.seqs.append(seq)
                try:
                    async for ch in ac.stream(self.prompts[(w + k) % len(self.prompts)], params):
                        seq += [ch.weight_version] * len(ch.token_ids or ())
                except Exception as e:
                    if not self._stop.is_set():
                        self.errors.append(repr(e)[:300])
                if len(seq) != self.max_tokens and not self._stop.is_set():
                    self.errors.append(f"audit stream ended with {len(seq)}/{self.max_tokens} tokens")
                k += 1

        tasks = [asyncio.create_task(one(w)) for w in range(self.n)]
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await ac.close()

    def stop(self, committed: set[int]) -> dict[str, Any]:
        self._stop.set()
        self._t.join(10)
        seen = {v for s in self.seqs for v in s}
        back = sum(1 for s in self.seqs if any(b < a for a, b in zip(s, s[1:], strict=False)))
        return {
            "streams": len(self.seqs),
            "tokens": sum(len(s) for s in self.seqs),
            "versions_seen": sorted(seen),
            "unknown_versions": sorted(seen - committed),
            "streams_going_back": back,
            "errors": len(self.errors),
            "error_sample": self.errors[:3],
            "exact": not (seen - committed) and back == 0,
        }


def gpu_mask(i: int) -> str:
    """CUDA_VISIBLE_DEVICES for a process on the job's i-th GPU: through an
    inherited mask (ids or UUIDs), as launch.py maps --gpus."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    return mask.split(",")[i].strip() if mask else str(i)


# ---------------------------------------------------------------- raw broadcast to N receivers


def raw_fanout(nbytes: int, receivers: int, spec: dict[str, Any]) -> dict[str, Any]:
    """1 + `receivers` processes, rank 0 on GPU 0, rank i seeing only GPU i (as
    an engine does): the same bytes broadcast whole and in buckets (NCCL; gloo
    with --cpu); the slowest rank's median of --raw-reps."""
    from bus.tensors import DEFAULT_BUCKET_BYTES

    port, world, procs = H.free_port(), receivers + 1, []
    try:
        for rank in range(world):
            env = None if spec["cpu"] else {"CUDA_VISIBLE_DEVICES": gpu_mask(rank)}
            argv = [sys.executable, "-m", "bench.gpu.fanout", "--raw-rank", str(rank), "--raw-world", str(world)]
            argv += ["--raw-port", str(port), "--raw-bytes", str(nbytes), "--raw-bucket", str(DEFAULT_BUCKET_BYTES)]
            argv += ["--raw-reps", str(spec["raw_reps"])] + (["--cpu"] if spec["cpu"] else [])
            procs.append(
                subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(G.REPO_ROOT),
                    start_new_session=True, env=G.child_env(env),
                )
            )  # fmt: skip
        outs = [p.communicate(timeout=spec["raw_timeout_s"])[0] for p in procs]
    finally:
        for p in procs:
            terminate_tree(p, 2.0)
    res = [json.loads(line[4:]) for o in outs for line in o.splitlines() if line.startswith("RAW ")]
    if len(res) != world:
        raise RuntimeError("raw broadcast failed (--raw-timeout-s):\n" + "\n".join(o[-1200:] for o in outs))
    return {
        "bytes": nbytes,
        "receivers": receivers,
        "bucket_bytes": DEFAULT_BUCKET_BYTES,
        "whole_ms": max(r["whole_ms"] for r in res),
        "bucketed_ms": max(r["bucketed_ms"] for r in res),
        "per_rank": res,
    }


def raw_rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    backend = "gloo" if a.cpu else "nccl"
    dev = "cpu" if a.cpu else "cuda"
    if not a.cpu:
        torch.cuda.set_device(0)  # each rank sees its own GPU only
    url = f"tcp://{H.LOOPBACK}:{a.raw_port}"
    dist.init_process_group(backend, init_method=url, rank=a.raw_rank, world_size=a.raw_world)
    buf = torch.empty(a.raw_bytes, dtype=torch.uint8, device=dev)
    chunks = [buf[i : i + a.raw_bucket] for i in range(0, a.raw_bytes, a.raw_bucket)]
    sync = (lambda: None) if a.cpu else torch.cuda.synchronize

    def timed(fn: Any) -> float:
        vals = []
        for k in range(a.raw_reps + 2):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if k >= 2:  # two warm-ups
                vals.append(time.perf_counter() - t0)
        return H.median(vals) * 1e3

    whole = timed(lambda: dist.broadcast(buf, src=0))
    bucketed = timed(lambda: [dist.broadcast(c, src=0) for c in chunks])
    out = {"rank": a.raw_rank, "whole_ms": whole, "bucketed_ms": bucketed, "buckets": len(chunks)}
    print("RAW " + json.dumps(out), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- nccl: one trainer -> N engines


def phase_nccl(spec: dict[str, Any]) -> dict[str, Any]:
    from trainer_bridge import Client
    from trainer_bridge.transports.nccl import warm_up_nccl

    cpu, n = spec["cpu"], spec["nccl_engines"]
    out: dict[str, Any] = {"transport": "nccl", "engines_n": n}
    nbytes = W._model_bytes(spec["model"]) if not cpu else 4 << 20
    out["raw_broadcast"] = raw_fanout(nbytes, n, spec)
    spec["_partial"].update(out)
    if cpu:  # the nccl path over gloo (tests/nccl_backend.py), as weight_update --cpu --nccl
        from tests.nccl_backend import gloo_connect
        from trainer_bridge.transports.nccl import NcclSender

        NcclSender.connect = gloo_connect  # type: ignore[method-assign,assignment]
    with _cluster(spec, n, "tests.nccl_backend:factory", ",".join(str(i) for i in range(1, n + 1))) as cl:
        out["engine_start_s"], out["engines"] = cl.wait_ready()
        _, named, out["bytes"] = W.load_trainer_model(spec["model"], cpu, "cuda:0")
        client = Client(cl.address, timeout_s=spec["request_timeout_s"], control_timeout_s=spec["control_timeout_s"])
        opts: dict[str, Any] = {"device": "cpu" if cpu else "cuda:0"}
        t0 = time.perf_counter()
        out["nccl_init"] = client._call(warm_up_nccl(client._aclient, opts), spec["control_timeout_s"])
        out["nccl_init"]["bench_s"] = round(time.perf_counter() - t0, 4)
        v0 = client.health()["weight_version"]
        prompts = W._prompts(spec)
        load = W.StreamLoad(cl.address, spec["streams"], prompts, spec["stream_max_tokens"], spec["request_timeout_s"])
        audit = VersionAudit(cl.address, spec["audit_streams"], prompts, 64, spec["request_timeout_s"]).start()
        load.start()
        W.instrument()
        try:
            load.wait_flowing(spec["ready_timeout_s"])
            ups = W.timed_updates(
                client, named, load, "nccl", spec["updates"] + 1, spec["gap_s"], spec["first_token_timeout_s"],
                opts, tag="fanout-nccl", pause_mode=spec["pause"],
            )  # fmt: skip
            out["updates"] = [{k: v for k, v in u.items() if k != "engine_result"} for u in ups]
        finally:
            load.stop()
        committed = {v0} | {u["weight_version"] for u in ups if "weight_version" in u}
        out["audit"] = audit.stop(committed)
        out["all_or_none"] = _all_or_none(client, ups)
        client.close()
        out["summary"] = W.summarize(ups, skip_first=True)
        out["load"] = {"tokens": load.tokens, "finished": load.finished, "lost": len(load.errors)}
        out["load"]["error_sample"] = load.errors[:3]
    return out


def _all_or_none(client: Any, ups: list[dict[str, Any]]) -> dict[str, Any]:
    """After the updates: every engine on the last committed version (the
    head's health; an engine that missed a commit would be stale)."""
    h = client.health()
    vs = {e: v["weight_version"] for e, v in h["engines"].items()}
    last = max((u["weight_version"] for u in ups if "weight_version" in u), default=None)
    return {"engine_versions": vs, "last_committed": last, "stale": h["stale"], "ok": set(vs.values()) == {last}}


def _cluster(spec: dict[str, Any], n: int, cpu_backend: str, gpus: str) -> G.RbCluster:
    cpu = spec["cpu"]
    eng: dict[str, Any] = {}
    if not cpu:
        eng = {"gpu_memory_utilization": spec["gpu_memory_utilization"], "max_model_len": spec["max_model_len"]}
    return G.RbCluster(
        spec["model"], cpu_backend if cpu else "vllm", engines=n, gpus=None if cpu else gpus,
        ready_timeout_s=spec["ready_timeout_s"], log_dir=Path(spec["log_dir"]), **eng,
    )  # fmt: skip


# ---------------------------------------------------------------- colocated: N ranks -> N engines


class Rank:
    """One trainer rank process on its own GPU (`--rank-of ADDRESS`): loads the
    full model once, then sends it for every GO line it reads."""

    def __init__(self, spec: dict[str, Any], address: str, r: int) -> None:
        env = None if spec["cpu"] else {"CUDA_VISIBLE_DEVICES": gpu_mask(r)}
        argv = [sys.executable, "-m", "bench.gpu.fanout", "--rank-of", address, "--model", spec["model"]]
        argv += ["--cpu"] if spec["cpu"] else []
        self.p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=str(G.REPO_ROOT), start_new_session=True, env=G.child_env(env),
        )  # fmt: skip
        self.log: list[str] = []

    def line(self, word: str, timeout_s: float) -> str:
        end = time.monotonic() + timeout_s
        assert self.p.stdout is not None
        while time.monotonic() < end:
            got = self.p.stdout.readline()
            if not got and self.p.poll() is not None:
                break
            self.log.append(got)
            if got.startswith(word):
                return got[len(word) :].strip()
        raise RuntimeError(f"rank never printed {word} (rc={self.p.poll()}):\n" + "".join(self.log[-30:]))

    def go(self, uid: str, secret: str, rank: int, engine: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(f"GO {uid} {secret} {rank} {engine}\n")  # stdin: the secret stays off argv
        self.p.stdin.flush()


def rank_main(a: argparse.Namespace) -> None:
    """A colocated trainer rank: the full model on its GPU; per GO line, its
    part (everything) to its own engine, buffers kept until the commit."""
    from trainer_bridge import Client

    _, named, nbytes = W.load_trainer_model(a.model, a.cpu, "cuda:0")
    transport, device = ("zmq", "cpu") if a.cpu else ("cuda_ipc", "cuda:0")
    with Client(a.rank_of, timeout_s=300, control_timeout_s=120) as c:
        print(f"READY {nbytes}", flush=True)
        for line in sys.stdin:
            _, uid, secret, rank, engine = line.split()
            t0 = time.time()
            with c.weight_sender(uid, int(rank), engines=[engine], device=device, sender_secret=secret) as s:
                st = s.send(named)
                t1 = time.time()
                print("SENT " + json.dumps({**st, "start": t0, "end": t1, "transport": transport}), flush=True)
            print("RELEASED", flush=True)


def _colocated_update(client: Any, ranks: list[Rank], engines: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    transport = "zmq" if spec["cpu"] else "cuda_ipc"
    k = len(engines)
    t0 = time.perf_counter()
    with client.weight_update(senders=k, targets=engines, transport=transport, timeout_s=120) as upd:
        for r, eid in enumerate(engines):
            ranks[r].go(upd.update_id, upd.sender_secret, r, eid)
        sent = [json.loads(ranks[r].line("SENT", 300)) for r in range(k)]
    dt = time.perf_counter() - t0
    for r in range(k):
        ranks[r].line("RELEASED", 60)
    starts, ends = [s["start"] for s in sent], [s["end"] for s in sent]
    versions = {e: r["weight_version"] for e, r in upd.results.items()}
    return {
        "engines": k,
        "update_ms": dt * 1e3,
        "rank_send_ms": [round((s["end"] - s["start"]) * 1e3, 2) for s in sent],
        "sends_overlap": max(starts) < min(ends),  # every rank was sending at one moment
        "versions": versions,
        "one_version": len(set(versions.values())) == 1 and len(versions) == k,
    }


def phase_colocated(spec: dict[str, Any]) -> dict[str, Any]:
    from trainer_bridge import Client

    n = spec["colocated_engines"]
    out: dict[str, Any] = {"transport": "zmq" if spec["cpu"] else "cuda_ipc", "engines_n": n}
    with _cluster(spec, n, "torch", ",".join(str(i) for i in range(n))) as cl:
        out["engine_start_s"], out["engines"] = cl.wait_ready()
        client = Client(cl.address, timeout_s=spec["request_timeout_s"], control_timeout_s=spec["control_timeout_s"])
        eids = sorted(e["engine_id"] for e in client.engines())
        ranks = [Rank(spec, cl.address, r) for r in range(n)]  # after the engines: vLLM's memory profile is done
        try:
            out["rank_model_bytes"] = [int(r.line("READY", spec["ready_timeout_s"])) for r in ranks]
            reps: dict[str, list[dict[str, Any]]] = {"one": [], "all": []}
            for i in range(spec["colocated_reps"] + 1):  # the first of each arm: layouts, maps (reported apart)
                for arm in ("one", "all") if i % 2 == 0 else ("all", "one"):
                    rec = _colocated_update(client, ranks, eids[:1] if arm == "one" else eids, spec)
                    rec["i"] = i
                    reps[arm].append(rec)
                    print(f"COLOCATED {arm} {json.dumps(rec)}", flush=True)
            out["reps"] = reps
            out["summary"] = _colocated_summary(reps)
        finally:
            for r in ranks:
                terminate_tree(r.p, 5.0)
            client.close()
    return out


def _colocated_summary(reps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for arm, recs in reps.items():
        steady = [r["update_ms"] for r in recs[1:]] or [r["update_ms"] for r in recs]
        s[arm] = {
            "median_ms": H.median(steady),
            "min_ms": min(steady),
            "max_ms": max(steady),
            "first_ms": recs[0]["update_ms"],
        }
    s["x_one"] = s["all"]["median_ms"] / s["one"]["median_ms"] if s["one"]["median_ms"] else None
    s["sends_overlap"] = all(r["sends_overlap"] for r in reps["all"])
    s["one_version_each"] = all(r["one_version"] for rs in reps.values() for r in rs)
    return s


# ---------------------------------------------------------------- report


def report(doc: dict[str, Any]) -> None:
    rows: list[dict[str, Any]] = []

    def row(what: str, val: Any, against: str = "", ok: bool | None = None) -> None:
        v = f"{val:.2f}" if isinstance(val, float) else ("-" if val is None else str(val))
        rows.append(
            {"measure": what, "value": v, "against": against, "meets": "-" if ok is None else ("yes" if ok else "NO")}
        )

    nc = doc.get("nccl") or {}
    if nc.get("summary"):
        raw, n = nc.get("raw_broadcast") or {}, nc.get("engines_n")
        upd = (nc["summary"].get("update_ms") or {}).get("median")
        first = (nc["summary"].get("first") or {}).get("update_ms")
        x = upd / raw["whole_ms"] if upd and raw.get("whole_ms") else None
        row(
            f"nccl 1 -> {n}: steady update ms (median)",
            upd,
            f"raw whole {raw.get('whole_ms', 0):.2f}, bucketed {raw.get('bucketed_ms', 0):.2f}",
        )
        row(
            f"nccl 1 -> {n}: steady / raw broadcast",
            x,
            f"<= {TARGETS['nccl_steady_x_raw']}x",
            None if x is None else x <= TARGETS["nccl_steady_x_raw"],
        )
        row(
            f"nccl 1 -> {n}: first update ms",
            first,
            "<= 1000",
            None if first is None else first <= TARGETS["nccl_first_s"] * 1e3,
        )
        row("nccl: group set-up (warm_up_nccl) s", (nc.get("nccl_init") or {}).get("seconds"))
        ld, au = nc.get("load") or {}, nc.get("audit") or {}
        row("nccl: streams lost", ld.get("lost"), "0", ld.get("lost") == 0)
        row("nccl: per-token versions exact", au.get("exact"), f"{au.get('tokens')} audited tokens", au.get("exact"))
        aon = nc.get("all_or_none") or {}
        row("nccl: every engine on the new version", aon.get("ok"), str(aon.get("engine_versions")), aon.get("ok"))
    co = (doc.get("colocated") or {}).get("summary")
    if co:
        n, x = doc["colocated"].get("engines_n"), co.get("x_one")
        row(
            f"colocated {n} ranks -> {n} engines: update ms (median)",
            co["all"]["median_ms"],
            f"one GPU {co['one']['median_ms']:.2f}",
        )
        row(
            f"colocated {n} / one GPU",
            x,
            f"<= {TARGETS['colocated_x_one']}x",
            None if x is None else x <= TARGETS["colocated_x_one"],
        )
        row(
            "colocated: every rank's send overlaps the others'",
            co["sends_overlap"],
            "(nothing serialised)",
            co["sends_overlap"],
        )
        row("colocated: one version on every engine, each update", co["one_version_each"], "", co["one_version_each"])
    for k in ("nccl", "colocated"):
        d = doc.get(k) or {}
        if d.get("skipped") or d.get("error"):
            row(k, "-", str(d.get("skipped") or d.get("error"))[:160])
    env = doc.get("env", {})
    H.print_table(
        rows, title=f"Weights into many engines ({env.get('gpu_name') or 'CPU'}, {env.get('gpus', 0)} GPU(s))"
    )


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, vals = [], []
    nc = doc.get("nccl") or {}
    if nc.get("summary"):
        labels += ["raw bcast", "nccl steady"]
        vals += [
            (nc.get("raw_broadcast") or {}).get("bucketed_ms") or 0,
            (nc["summary"].get("update_ms") or {}).get("median") or 0,
        ]
    co = (doc.get("colocated") or {}).get("summary")
    if co:
        labels += ["colocated 1", f"colocated {doc['colocated'].get('engines_n')}"]
        vals += [co["one"]["median_ms"], co["all"]["median_ms"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, vals)
    ax.set_ylabel("ms (median)")
    ax.set_title("weights into many engines")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = G.bench_parser(
        __doc__,
        cpu_help="dry run: torch engines + tiny model; nccl over gloo (3 engines), colocated over zmq (2 engines)",
        **dict(seed=0, gpu_memory_utilization=0.85, max_model_len=2048, budget_s=560.0, phase_limit_s=300.0),
        **dict(min_phase_s=60.0, ready_timeout_s=240.0, request_timeout_s=300.0, control_timeout_s=60.0),
        **dict(first_token_timeout_s=10.0, gpu_idle_timeout_s=30.0),
    )
    ap.add_argument("--nccl", action="store_true", help="the NCCL phase: trainer GPU 0 -> engines GPUs 1..N")
    ap.add_argument("--colocated", action="store_true", help="the colocated phase: N ranks -> N engines, one per GPU")
    ap.add_argument("--engines", type=int, default=None, help="N (default: GPUs - 1 for nccl, GPUs for colocated)")
    ap.add_argument(
        "--colocated-gpu-fraction",
        type=float,
        default=0.5,
        help="vLLM's share of each GPU (the rank holds the model beside it)",
    )
    ap.add_argument("--colocated-reps", type=int, default=5)
    ap.add_argument("--pause", choices=("abort", "keep", "pipe-abort", "pipe-keep"), default="abort")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--audit-streams", type=int, default=8)
    ap.add_argument("--stream-max-tokens", type=int, default=1024)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=256)
    ap.add_argument("--updates", type=int, default=5, help="measured nccl updates (one more first, reported apart)")
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--raw-reps", type=int, default=10)
    ap.add_argument("--raw-timeout-s", type=float, default=180.0)
    for k in ("rank", "world", "port", "bytes", "bucket"):  # internal: one rank of the raw broadcast
        ap.add_argument(f"--raw-{k}", type=int, default=None if k == "rank" else 0, help=argparse.SUPPRESS)
    ap.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # internal: a colocated trainer rank
    cpu = dict(streams=4, audit_streams=2, stream_max_tokens=128, prompt_min=8, prompt_max=32, updates=2,
               gap_s=0.2, raw_reps=2, colocated_reps=1, ready_timeout_s=180.0)  # fmt: skip
    return G.parse_args(ap, argv, cpu)


def main(argv: list[str] | None = None) -> int:
    H.setup_logging()
    a = parse(argv)
    if a.raw_rank is not None:
        raw_rank_main(a)
        return 0
    if a.rank_of:
        rank_main(a)
        return 0
    if G.replot(a, report, plot):
        return 0
    budget, od, env = G.Budget(a.budget_s), G.out_dir(a.out_dir), G.probe_env()
    log_dir = G.log_dir_of(a, od, NAME)
    a.model = G.model_of(a)
    gpus = int(env.get("gpus") or 0)
    spec = {k: getattr(a, k) for k in (
        "model", "cpu", "seed", "streams", "audit_streams", "stream_max_tokens", "prompt_min", "prompt_max",
        "updates", "gap_s", "pause", "gpu_memory_utilization", "max_model_len", "ready_timeout_s",
        "request_timeout_s", "control_timeout_s", "first_token_timeout_s", "raw_reps", "raw_timeout_s",
        "colocated_reps")}  # fmt: skip
    spec["log_dir"] = str(log_dir)
    spec["nccl_engines"] = a.engines or (3 if a.cpu else max(gpus - 1, 0))
    spec["colocated_engines"] = a.engines or (2 if a.cpu else gpus)
    doc = G.result_doc(NAME, a, env, targets=TARGETS)
    path = od / f"{NAME}.json"
    print(f"{NAME}: model {a.model}, env {json.dumps(env)}, budget {a.budget_s:.0f}s", flush=True)
    need = {"nccl": 2, "colocated": 1}
    with H.Procs():
        for key, wanted in (("nccl", a.nccl), ("colocated", a.colocated)):
            reason = None if wanted else f"not asked for (--{key})"
            if reason is None and not a.cpu and gpus < need[key]:
                reason = f"needs {need[key]} GPUs, have {gpus}"
            if reason is None and budget.left() < a.min_phase_s:
                reason = f"budget: {budget.left():.0f}s left < --min-phase-s"
            if reason:
                doc[key] = {"skipped": reason}
                print(f"[{key}] skipped: {reason}", flush=True)
                continue
            s = dict(spec, gpu_memory_utilization=a.colocated_gpu_fraction) if key == "colocated" else spec
            doc[key] = G.run_phase(f"fanout-{key}", f"bench.gpu.fanout:phase_{key}", s,
                                   min(a.phase_limit_s, budget.left() - 5), log_dir)  # fmt: skip
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
    return 0 if any((doc.get(k) or {}).get("ok") for k in ("nccl", "colocated")) else 1


if __name__ == "__main__":
    sys.exit(main())
