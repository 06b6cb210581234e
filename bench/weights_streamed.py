"""Streamed weight updates vs today's materialized list, over zmq on CPU
(issue 11, item 1): seconds and peak extra trainer memory for a ~--gb update.

A head and --engines torch engine nodes (real processes) serve a synthetic
Llama (engine_node.tiny_model scaled up: its parameters total about --gb GB),
so every name, dtype and shape the trainer sends is one the engines accept.
The trainer runs in a FRESH PROCESS PER MODE AND REPETITION, so its memory is
its own; it produces each tensor on demand from a generator (filled, so its
pages are resident, with a value that differs from the engines' weights):

- ``streamed``: the generator goes straight to ``client.update_weights``:
  buckets are packed as tensors arrive (trainer_bridge.weights.WeightSender);
- ``list``: the generator is materialized into a list first and sent
  through today's code (planned: the begin carries the metas);
- ``old``: the list, sent the way trainer_bridge/weights.py did before the
  streamed updates (main before the wtxn merge:
  git show 99dec0e^1:trainer_bridge/weights.py): plan_buckets
  over the whole list, then per bucket pack_bucket → send → wait for every
  engine's ack → the next bucket (no overlap). It speaks today's protocol
  (begin/commit through the head), only the data path is the old one. This
  is "today" in the issue's sense: what a trainer had before streaming.
  (It never packed every bucket up front: one at a time, two alive while
  the next is packed, `buf` being rebound only after pack_bucket returns.)

Measured in the trainer process, from just before the first tensor is
produced to the commit's return:
- seconds (producing the tensors included, for every mode) and GB/s;
- peak extra memory: the kernel's peak RSS (VmHWM, reset through
  /proc/self/clear_refs just before) minus the RSS before; cross-checked by a
  thread sampling RSS at --sample-hz (the larger of the two is reported).

Allocator note: the trainer's tensors come from glibc malloc; after a freed
mmapped chunk its dynamic mmap threshold rises (up to 32 MiB), so later
tensors of a few MiB come from the heap, which keeps some of them resident
after they are freed. That is part of what a trainer gets and is measured as
is (``streamed``); ``streamed_mmap`` is the same with MALLOC_MMAP_THRESHOLD_=65536
in the trainer's environment (every tensor its own mmap, unmapped when freed):
the sender's own bound.

Modes rotate their order in every repetition; the tables show the median
[min-max] across --reps, ratios are medians of per-repetition ratios.

    python -m bench.weights_streamed                 # --gb 1 --reps 3 --bucket-mb 64,256
    python -m bench.weights_streamed --gb 0.02 --reps 1 --bucket-mb 4   # the CI dry run (~30 s)

Writes bench/results/weights_streamed.{txt,json,png} (the table, every run, the
figure; --out-dir moves the first two).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import harness as H
from bench import rb_side as RB

MODES = ("streamed", "streamed_mmap", "list", "old")
# streamed_mmap: the trainer process runs with this (glibc: every allocation of
# 64 KiB or more is its own mmap, given back on free): the sender's own bound.
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
NAME = "weights_streamed"
GB = 1e9


# ---------------------------------------------------------------- the model


def model_params(gb: float) -> dict[str, Any]:
    """A tiny_model configuration whose parameters total about `gb` GB (fp32).
    Large: hidden 1024 / MLP 4096, ~63 MB a layer (tensors of 2-16 MB); small
    (< 0.25 GB, the dry run): hidden 256 / MLP 1024, ~4 MB a layer."""
    if gb <= 0:
        raise ValueError(f"--gb must be > 0, got {gb}")
    hidden, inter = (1024, 4096) if gb >= 0.25 else (256, 1024)
    heads, kv_heads, vocab = 8, 4, 512
    kv = hidden // heads * kv_heads
    per_layer = 4 * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden)
    layers = max(1, round((gb * GB - 4 * 2 * vocab * hidden) / per_layer))
    return dict(hidden=hidden, inter=inter, heads=heads, kv_heads=kv_heads, vocab=vocab, layers=layers, max_pos=256)


def param_shapes(model_dir: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, from the config on the meta device
    (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    return [(n, tuple(p.shape)) for n, p in m.named_parameters()]


# ---------------------------------------------------------------- trainer side (child process)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """A thread reading this process's RSS every 1/hz s; keeps the peak."""

    def __init__(self, hz: float) -> None:
        self.period = 1.0 / hz
        self.peak = 0
        self.n = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.t0 = self.t1 = 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            r = _rss_bytes()
            self.peak = max(self.peak, r)
            self.n += 1
            time.sleep(self.period)

    def __enter__(self) -> RssSampler:
        self.t0 = time.perf_counter()
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(5)
        self.t1 = time.perf_counter()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def hz(self) -> float:
        return self.n / max(1e-9, self.t1 - self.t0)


def produce(shapes: list[tuple[str, tuple[int, ...]]], value: float) -> Iterator[tuple[str, Any]]:
    """Each tensor created on demand (a trainer gathering shards one by one);
    filled, so its pages are resident."""
    import torch

    for name, shape in shapes:
        yield name, torch.empty(shape, dtype=torch.float32).fill_(value)


async def push_old(client: Any, named: list[tuple[str, Any]], bucket_bytes: int, timeout_s: float) -> dict[str, Any]:
    """Before streaming (99dec0e^1:trainer_bridge/weights.py, `_send_buckets_zmq`):
    the whole list planned by plan_buckets, then per bucket pack_bucket → send
    to every engine → every ack → the next. Today's begin/commit through the
    head; today's sender only for its sockets' ack handling."""
    import zmq
    import zmq.asyncio

    from bus import protocol as P
    from bus.codec import Codec
    from bus.endpoint import open_socket
    from bus.tensors import pack_bucket, plan_buckets
    from trainer_bridge.weights import WeightUpdate

    named = [(n, t.detach()) for n, t in named]
    metas, sizes, tensors = plan_buckets(named, bucket_bytes)
    upd = WeightUpdate(client, timeout_s=timeout_s, bucket_bytes=bucket_bytes)
    async with upd.opened(plan=named):
        snd = upd.sender(0)
        ctx = zmq.asyncio.Context()
        codec = Codec()
        # Loopback TCP without CURVE: the join token's client credential (bus/roles.py).
        plain = client._plain
        socks = {e.engine_id: open_socket(ctx, zmq.DEALER, connect=e.weight_address, plain=plain) for e in upd.engines}
        try:
            for b in range(len(sizes)):
                buf = pack_bucket(b, metas, sizes, tensors)
                snd._ship(socks, codec, (b, [], buf))
                await snd._acks(socks, codec, b, [m for m in metas if m.bucket == b])
            end = codec.encode(P.WeightSenderEnd(upd.update_id, 0, len(sizes), sender_secret=snd.secret))
            for s in socks.values():
                s.send_multipart(end)
            await snd._acks(socks, codec, -1, [])
        finally:
            for s in socks.values():
                s.close(linger=0)
            ctx.term()
    return upd.results


async def _trainer(a: argparse.Namespace) -> dict[str, Any]:
    import gc

    # Imported before the baseline, so no import lands in the measured window.
    import torch
    import zmq.asyncio  # noqa: F401

    import bus.tensors  # noqa: F401
    from trainer_bridge import AsyncClient
    from trainer_bridge.weights import WeightUpdate  # noqa: F401

    torch.set_num_threads(1)
    shapes = param_shapes(a.model)
    client = AsyncClient(a.frontend, timeout_s=a.timeout_s, control_timeout_s=a.timeout_s)
    try:
        await RB.wait_healthy(client, a.engines, a.timeout_s)
        before = (await client.health())["weight_version"]
        bucket_bytes = int(a.bucket_mb * 2**20)
        value = 0.5 + 0.01 * a.rep  # a constant, unlike the engines' random init
        gc.collect()
        hwm_ok = _reset_hwm()
        rss0 = _rss_bytes()
        t_list = None
        with RssSampler(a.sample_hz) as sampler:
            t0 = time.perf_counter()
            if a.mode in ("streamed", "streamed_mmap"):
                res = await client.update_weights(produce(shapes, value), bucket_bytes=bucket_bytes)
            else:
                named = list(produce(shapes, value))
                t_list = time.perf_counter() - t0
                if a.mode == "list":
                    res = await client.update_weights(named, bucket_bytes=bucket_bytes)
                else:
                    res = await push_old(client, named, bucket_bytes, a.timeout_s)
                del named
            seconds = time.perf_counter() - t0
        hwm = _vm_hwm_bytes() if hwm_ok else None
        after = (await client.health())["weight_version"]
    finally:
        await client.close()
    nbytes = sum(4 * _numel(s) for _, s in shapes)
    peak_sampled = sampler.peak - rss0
    peak_hwm = None if hwm is None else hwm - rss0
    return {
        "mode": a.mode,
        "rep": a.rep,
        "bucket_mb": a.bucket_mb,
        "bytes": nbytes,
        "tensors": len(shapes),
        "seconds": seconds,
        "list_s": t_list,
        "gb_per_s": nbytes / GB / seconds,
        "rss_before_mib": rss0 / 2**20,
        "peak_extra_mib": max(peak_sampled, peak_hwm or 0) / 2**20,
        "peak_extra_hwm_mib": None if peak_hwm is None else peak_hwm / 2**20,
        "peak_extra_sampled_mib": peak_sampled / 2**20,
        "sampled_hz": sampler.hz,
        "committed": sorted(res),
        "version": [before, after],
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------- the run (parent)


def run_trainer(procs: H.Procs, a: argparse.Namespace, fe: str, model: str, mode: str, rep: int, bmb: float) -> dict:
    """One trainer process (its whole tree killed on overrun); its result JSON."""
    out = procs.log_dir / f"trainer_{mode}_{bmb:g}_{rep}.json"
    out.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "bench.weights_streamed", "--trainer", mode, "--frontend", fe, "--model", model,
        "--rep", str(rep), "--bucket-mb", f"{bmb:g}", "--engines", str(a.engines), "--sample-hz", str(a.sample_hz),
        "--timeout-s", str(a.timeout_s), "--result", str(out),
    ]  # fmt: skip
    name = f"trainer_{mode}_{rep}"
    p = procs.start(name, argv, env=MMAP_ENV if mode == "streamed_mmap" else None)
    try:
        p.wait(a.trainer_timeout_s)
    except Exception:
        procs.stop(p)
        raise H.DeadlineExceeded(
            f"trainer ({mode}, rep {rep}) not done within --trainer-timeout-s={a.trainer_timeout_s}"
        ) from None
    procs.procs = [(n, q) for n, q in procs.procs if q is not p]
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"trainer ({mode}, rep {rep}) exited with {p.returncode}:\n{procs.log_tail(name, 30)}")
    r = json.loads(out.read_text())
    if len(r["committed"]) != a.engines or r["version"][1] <= r["version"][0]:
        raise RuntimeError(f"trainer ({mode}, rep {rep}): update not committed everywhere: {r}")
    return r


def summarize(runs: list[dict], modes: list[str], bucket_mbs: list[float]) -> list[dict[str, Any]]:
    rows = []
    for bmb in bucket_mbs:
        by = {
            m: sorted((r for r in runs if r["mode"] == m and r["bucket_mb"] == bmb), key=lambda r: r["rep"])
            for m in modes
        }
        ref = "old" if "old" in modes else modes[-1]
        for m in modes:
            rs = by[m]
            if not rs:
                continue
            secs = [r["seconds"] for r in rs]
            mem = [r["peak_extra_mib"] for r in rs]
            row: dict[str, Any] = {
                "bucket MiB": bmb,
                "mode": m,
                "seconds": H.fmt_spread(H.spread(secs)),
                "GB/s": H.median([r["gb_per_s"] for r in rs]),
                "peak extra MiB": H.fmt_spread(H.spread(mem), 0),
                "extra/bucket": H.median(mem) / bmb,
                "sampler Hz": H.median([r["sampled_hz"] for r in rs]),
                "_seconds": H.median(secs),
                "_mem": H.median(mem),
                "_mem_lo": min(mem),
                "_mem_hi": max(mem),
                "_s_lo": min(secs),
                "_s_hi": max(secs),
            }
            # Paired by repetition (same rep ran both modes back to back).
            pairs = list(zip(by[ref], rs, strict=False))
            row[f"mem vs {ref}"] = H.median([r["peak_extra_mib"] / o["peak_extra_mib"] for o, r in pairs])
            row[f"time vs {ref}"] = H.median([r["seconds"] / o["seconds"] for o, r in pairs])
            rows.append(row)
    return rows


def parse_bucket_mbs(text: str) -> list[float]:
    try:
        out = [float(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--bucket-mb: expected MiB numbers separated by commas, got {text!r}") from None
    if not out or min(out) <= 0:
        raise ValueError(f"--bucket-mb: every bucket size must be > 0 MiB, got {text!r}")
    return out


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    from engine_node.tiny_model import ensure_tiny_model, hf_quiet

    params = model_params(a.gb)
    t = time.perf_counter()
    with hf_quiet():
        model = ensure_tiny_model(**params)
    print(f"model {model} ({params}) ready in {time.perf_counter() - t:.1f}s", flush=True)
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"--modes: unknown {bad}; choose from {list(MODES)}")
    bucket_mbs = parse_bucket_mbs(a.bucket_mb)
    runs: list[dict] = []
    with H.Procs() as procs:
        cl = RB.start_cluster(procs, a.engines, backend="torch", model=model, tag="ws", backend_options={"threads": 1})
        client = RB.make_client(cl.frontend, timeout_s=a.timeout_s)
        try:
            await RB.wait_healthy(client, a.engines, a.timeout_s, procs)
        finally:
            await client.close()
        # Warm-up: one streamed update (the engines' first staging allocations).
        run_trainer(procs, a, cl.frontend, model, "streamed", -1, bucket_mbs[0])
        for rep in range(a.reps):
            for bmb in bucket_mbs:
                order = modes[rep % len(modes) :] + modes[: rep % len(modes)]
                for m in order:
                    r = run_trainer(procs, a, cl.frontend, model, m, rep, bmb)
                    runs.append(r)
                    print(
                        f"rep {rep} bucket {bmb:g} MiB {m:9s} {r['seconds']:.2f}s "
                        f"peak extra {r['peak_extra_mib']:.0f} MiB (hwm {r['peak_extra_hwm_mib']}, "
                        f"sampled {r['peak_extra_sampled_mib']:.0f} at {r['sampled_hz']:.0f} Hz)",
                        flush=True,
                    )
    return {"params": params, "model": model, "runs": runs, "modes": modes, "bucket_mbs": bucket_mbs}


def _plot(rows: list[dict], title: str, note: str, out_name: str) -> None:
    groups = sorted({r["bucket MiB"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))

    def series(key: str) -> dict[str, list]:
        return {
            m: [next((r[key] for r in rows if r["mode"] == m and r["bucket MiB"] == g), None) for g in groups]
            for m in modes
        }

    H.plot_bar_panels(
        out_name,
        [
            {
                "title": "peak extra trainer memory (median, min-max)",
                "ylabel": "MiB",
                "groups": [f"{g:g} MiB buckets" for g in groups],
                "series": series("_mem"),
                "errs": {m: (series("_mem_lo")[m], series("_mem_hi")[m]) for m in modes},
            },
            {
                "title": "seconds: produce + update + commit (median, min-max)",
                "ylabel": "s",
                "groups": [f"{g:g} MiB buckets" for g in groups],
                "series": series("_seconds"),
                "errs": {m: (series("_s_lo")[m], series("_s_hi")[m]) for m in modes},
            },
        ],
        suptitle=title,
        note=note,
    )


def main(argv: list[str] | None = None) -> int:
    H.setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="update size, GB (10^9 bytes) of fp32 parameters")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--bucket-mb", default="64,256", help="bucket size(s) in MiB, comma-separated (the product's default: 256)"
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--sample-hz", type=float, default=500.0, help="RSS sampling rate of the trainer's thread")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="the trainer's control/update deadline")
    ap.add_argument("--trainer-timeout-s", type=float, default=600.0, help="one trainer process, start to exit")
    ap.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/results)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG (always bench/results/weights_streamed.png)")
    # The trainer child (internal).
    ap.add_argument("--trainer", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--frontend", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trainer:
        a.mode = a.trainer
        a.bucket_mb = float(a.bucket_mb)
        r = asyncio.run(_trainer(a))
        Path(a.result).write_text(json.dumps(r))
        return 0
    if a.reps < 1:
        ap.error(f"--reps must be >= 1, got {a.reps}")
    res = asyncio.run(bench(a))
    rows = summarize(res["runs"], res["modes"], res["bucket_mbs"])
    nbytes = res["runs"][0]["bytes"]
    title = (
        f"weight update over zmq on CPU: {nbytes / GB:.2f} GB ({res['runs'][0]['tensors']} fp32 tensors), "
        f"{a.engines} torch engines, {a.reps} reps"
    )
    shown = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    table = H.print_table(shown, title=title)
    doc = {
        "benchmark": NAME,
        "machine": H.machine_info(),
        "title": title,
        "rows": shown,
        "runs": res["runs"],
        "model_params": res["params"],
        "args": {k: v for k, v in vars(a).items() if k not in ("trainer", "frontend", "model", "rep", "result")},
    }
    out = Path(a.out_dir) if a.out_dir else H.RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(H.jsonable(doc), indent=2) + "\n")
    (out / f"{NAME}.txt").write_text(table + "\n")
    print(f"wrote {out / (NAME + '.json')} and .txt", flush=True)
    if not a.no_plot:
        note = "peak extra = peak RSS during the update - RSS before (trainer process, fresh per run); old = the pre-streaming sender"
        _plot(rows, title, note, NAME)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
