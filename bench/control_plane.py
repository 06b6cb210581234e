"""Control-plane timings over N torch engines (1, 2, 4 on CPU):

- pause(abort) → every engine quiescent (the call returns only then),
- resume → first new token on the resumed streams (median and worst stream),
- a weight update of a ~50M-parameter model over the zmq transport (GB/s,
  per engine and aggregated over engines).

How it is driven: the real launcher pieces (router_node + engine_node
processes, torch backend), one AsyncClient; 4 streaming requests per engine
are running (ignore_eos, long max_tokens) when pause is called. Each figure is
the median of `--reps` repetitions, with min/max.

    python -m bench.control_plane            # N = 1, 2, 4; ~50M-param model
    python -m bench.control_plane --quick    # N = 1, 2; tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from bench import harness as H
from bench import rb_side as RB

BIG: dict[str, Any] = dict(
    hidden=512, layers=14, heads=8, kv_heads=8, inter=1376, vocab=8192, max_pos=2048
)  # ~52M params


async def _one_rep(client: Any, n_streams: int, vocab: int) -> dict[str, float]:
    first_after: dict[int, float] = {}
    resumed_at = [0.0]
    got = [0] * n_streams
    rids = [f"cp-{time.monotonic_ns()}-{i}" for i in range(n_streams)]

    async def stream(i: int) -> None:
        prompt = [(7 * i + j) % (vocab - 4) + 4 for j in range(8)]
        async for ch in client.stream(
            prompt, {"max_tokens": 1500, "temperature": 1.0, "ignore_eos": True}, request_id=rids[i]
        ):
            got[i] += len(ch.token_ids)
            if resumed_at[0] and i not in first_after and ch.token_ids:
                first_after[i] = time.perf_counter() - resumed_at[0]

    tasks = [asyncio.create_task(stream(i)) for i in range(n_streams)]
    deadline = time.monotonic() + 120
    while min(got) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("streams did not start within 120 s")
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    res = await client.pause("abort")
    quiescent = time.perf_counter() - t0
    parked = sum(r["parked"] for r in res.values())
    await asyncio.sleep(0.3)
    resumed_at[0] = time.perf_counter()
    await client.resume()
    while len(first_after) < n_streams:
        if time.monotonic() > deadline:
            raise TimeoutError("resumed streams produced no token within 120 s")
        await asyncio.sleep(0.002)
    for rid in rids:
        await client.cancel(rid)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    vals = sorted(first_after.values())
    return {
        "pause_quiescent_s": quiescent,
        "resume_first_token_s": H.median(vals),
        "resume_last_first_token_s": vals[-1],
        "parked": parked,
    }


async def _bench_n(n: int, model: str, reps: int, named: list, nbytes: int) -> dict[str, Any]:
    with H.Procs() as procs:
        import os

        threads = max(1, (os.cpu_count() or 1) // n)  # as launch.py does: split the cores
        cl = RB.start_cluster(
            procs, n, backend="torch", model=model, tag=f"cp{n}", backend_options={"threads": threads}
        )
        client = RB.make_client(cl.frontend)
        try:
            await RB.wait_healthy(client, n, 300, procs)
            vocab = min(e["vocab_size"] for e in await client.engines())
            await client.generate([5, 6, 7], {"max_tokens": 4})  # warm-up
            await _one_rep(client, 4 * n, vocab)  # warm-up rep
            pauses = [await _one_rep(client, 4 * n, vocab) for _ in range(reps)]
            updates = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                await client.update_weights(named, bucket_bytes=64 << 20)
                updates.append(time.perf_counter() - t0)
            updates = updates[1:]  # first one warms the sockets and allocators
        finally:
            await client.close()
    q = [p["pause_quiescent_s"] for p in pauses]
    f = [p["resume_first_token_s"] for p in pauses]
    w = [p["resume_last_first_token_s"] for p in pauses]
    return {
        "engines": n,
        "streams": 4 * n,
        "parked_per_pause": H.median([p["parked"] for p in pauses]),
        "pause→quiescent ms": 1e3 * H.median(q),
        "pause spread ms": f"{1e3 * min(q):.1f}–{1e3 * max(q):.1f}",
        "resume→1st token ms": 1e3 * H.median(f),
        "resume→last stream ms": 1e3 * H.median(w),
        "update s": H.median(updates),
        "update spread s": f"{min(updates):.3f}–{max(updates):.3f}",
        "GB/s per engine": nbytes / H.median(updates) / 1e9,
        "GB/s aggregate": n * nbytes / H.median(updates) / 1e9,
        "_raw": {"pauses": pauses, "updates_s": updates},
    }


def main(argv: list[str] | None = None) -> int:
    H.setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engines", default=None, help="comma list, default 1,2,4 (quick: 1,2)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--max-seconds", type=float, default=1800, help="skip engine counts not started by then")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM

    from engine_node.tiny_model import ensure_tiny_model, hf_quiet

    counts = [int(x) for x in (a.engines or ("1,2" if a.quick else "1,2,4")).split(",")]
    reps = a.reps or (3 if a.quick else 5)
    model = ensure_tiny_model() if a.quick else ensure_tiny_model(**BIG)
    with hf_quiet():
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    named = [(k, v.detach().clone()) for k, v in m.named_parameters()]
    params = sum(t.numel() for _, t in named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    rows = []
    for n in counts:
        if time.monotonic() - t_start > 0.6 * a.max_seconds:
            print(f"skipping {n} engine(s): over 60% of --max-seconds={a.max_seconds}", flush=True)
            continue
        rows.append(asyncio.run(_bench_n(n, model, reps, named, nbytes)))
    cols = [c for c in rows[0] if not c.startswith("_")]
    title = (
        f"control plane: torch backend, {params / 1e6:.1f}M params ({nbytes / 1e6:.0f} MB fp32), medians of {reps} reps"
    )
    H.print_table(rows, cols, title=title)
    H.write_json(
        "control_plane", {"title": title, "params": params, "bytes": nbytes, "rows": rows, "machine": H.machine_info()}
    )
    H.plot_bars(
        "control_plane",
        [f"{r['engines']} engine(s)" for r in rows],
        {
            "pause→quiescent ms": [r["pause→quiescent ms"] for r in rows],
            "resume→1st token ms": [r["resume→1st token ms"] for r in rows],
            "weight update ms": [1e3 * r["update s"] for r in rows],
        },
        ylabel="milliseconds (median)",
        title=title,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
