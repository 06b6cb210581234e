"""How fast can a weight plan's copies be? (issue 8 §4: the commit's copy from the
receive buffer into vLLM's parameters is ~2-3.5 ms for the 0.99 GB of the qwen05
preset on an H200, against 0.49 ms for one flat copy of the same bytes.)

Torch only, no vLLM: vLLM-shaped fused destinations (qkv, gate_up: row slices of one
parameter) and checkpoint-shaped sources cut from flat 256-byte-aligned uint8 buckets, as
`engine_node/backends/vllm/weight_plan.py` replays them; --preset qwen05 (290 tensors,
0.99 GB) or qwen7b (Qwen2-7B: 339 tensors, 15.23 GB; ~46 GB of GPU memory in all).
Ways, median of --reps (CUDA-synchronized wall time, and the CPU time to launch):
  loop         copy_ per tensor
  foreach      one torch._foreach_copy_ over all of them (the plan before the Replay)
  hybrid_N     copy_ for tensors >= N MiB (--big-mib), foreach for the rest
  plan         the product's write: WeightPlan.replay(...).run() with its default
               BIG_COPY_BYTES, the Replay kept across updates as the worker keeps it
               (engine_node/backends/vllm/worker_reuse.py)
  plan_recut   the same, with the source views cut from the bucket every update
               (sources_from_buckets + replay: what a worker without kept views pays)
  flat         one copy of the whole bucket (the floor)

    python -m bench.gpu.plan_copy [--preset qwen7b]   # on a GPU; --device cpu for a dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine_node.backends.vllm.weight_plan import BIG_COPY_BYTES, WeightPlan, _Copy

QWEN05 = dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=151936, tied=1)
QWEN7B = dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064, tied=0)
PRESETS = {"qwen05": QWEN05, "qwen7b": QWEN7B}


def shapes(p: dict[str, int]) -> tuple[dict[str, tuple[int, ...]], list[tuple[str, str, int, int]]]:
    """vLLM parameters, and the checkpoint tensors as (name, param, row offset, rows)."""
    h, i, hd = p["hidden"], p["inter"], p["head_dim"]
    q, kv = p["heads"] * hd, p["kv_heads"] * hd
    params: dict[str, tuple[int, ...]] = {"embed": (p["vocab"], h), "norm": (h,)}
    ck: list[tuple[str, str, int, int]] = [("embed", "embed", 0, p["vocab"]), ("norm", "norm", 0, h)]
    if not p.get("tied", 1):
        params["lm_head"] = (p["vocab"], h)
        ck.append(("lm_head", "lm_head", 0, p["vocab"]))
    for li in range(p["layers"]):
        L = f"l{li}."
        params.update({L + "qkv": (q + 2 * kv, h), L + "o": (h, q), L + "gate_up": (2 * i, h), L + "down": (h, i)})
        params.update({L + "in_norm": (h,), L + "post_norm": (h,), L + "qkv_bias": (q + 2 * kv,)})
        ck += [(L + "q", L + "qkv", 0, q), (L + "k", L + "qkv", q, kv), (L + "v", L + "qkv", q + kv, kv)]
        ck += [
            (L + "qb", L + "qkv_bias", 0, q),
            (L + "kb", L + "qkv_bias", q, kv),
            (L + "vb", L + "qkv_bias", q + kv, kv),
        ]
        ck += [(L + "o", L + "o", 0, h), (L + "gate", L + "gate_up", 0, i), (L + "up", L + "gate_up", i, i)]
        ck += [
            (L + "down", L + "down", 0, h),
            (L + "in_norm", L + "in_norm", 0, h),
            (L + "post_norm", L + "post_norm", 0, h),
        ]
    return params, ck


def build(
    device: str, dtype: torch.dtype, preset: dict[str, int], **over: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, list[int]]:
    params_s, ck = shapes({**preset, **over})
    params = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in params_s.items()}
    dsts = []
    for _, pn, r0, rows in ck:
        dsts.append(params[pn].narrow(0, r0, rows))
    isz = torch.empty((), dtype=dtype).element_size()
    offs, off = [], 0
    for d in dsts:
        offs.append(off)
        off += (d.numel() * isz + 255) // 256 * 256
    # Random values, not random bytes: bytes would hold NaNs, whose payload a copy may
    # canonicalize (the bitwise check below would then fail for no real reason).
    # (in dtype directly: a float32 draw first would need twice the bucket's memory at 7B)
    typed = torch.randn(off // isz, device=device, dtype=dtype)
    bucket = typed.view(torch.uint8)
    srcs = [typed.as_strided(tuple(d.shape), d.stride(), o // isz) for d, o in zip(dsts, offs, strict=True)]
    flat_dst = torch.empty_like(bucket)
    return dsts, srcs, bucket, flat_dst, offs


def product_plan(dsts: list[torch.Tensor], srcs: list[torch.Tensor], offs: list[int]) -> tuple[WeightPlan, list]:
    """The product's WeightPlan for these copies (as `WeightPlan.record` would
    learn it: tensor k is checkpoint tensor "t{k}" at byte offset offs[k] of
    bucket 0), and its metas for sources_from_buckets."""
    plan = WeightPlan("bench")
    metas = []
    for k, (d, s, o) in enumerate(zip(dsts, srcs, offs, strict=True)):
        name = f"t{k}"
        plan.copies.append(_Copy(name, name, d, 0, tuple(s.shape), tuple(s.stride()), s.dtype))
        metas.append([name, str(s.dtype).removeprefix("torch."), list(s.shape), 0, o, s.numel() * s.element_size()])
    plan.order = list(plan.copies)
    plan._finish()
    return plan, metas


def timed(fn, device: str, reps: int) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    walls, cpus = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        cpus.append((t1 - t0) * 1e3)
        walls.append((t2 - t0) * 1e3)
    return {"ms": round(statistics.median(walls), 3), "launch_ms": round(statistics.median(cpus), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--big-mib", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen05")
    ap.add_argument("--layers", type=int, default=None, help="fewer for a CPU dry run")
    ap.add_argument("--vocab", type=int, default=None, help="smaller for a CPU dry run")
    a = ap.parse_args()
    over = {k: v for k, v in (("layers", a.layers), ("vocab", a.vocab)) if v is not None}
    dsts, srcs, bucket, flat_dst, offs = build(a.device, torch.bfloat16, PRESETS[a.preset], **over)
    plan, metas = product_plan(dsts, srcs, offs)
    kept = plan.replay(plan.sources_from_buckets("bench", metas, {0: bucket}))

    def plan_kept() -> None:
        kept.run()

    def plan_recut() -> None:
        plan.replay(plan.sources_from_buckets("bench", metas, {0: bucket})).run()

    def loop() -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s)

    def foreach() -> None:
        torch._foreach_copy_(dsts, srcs)

    def hybrid_of(mib: float):  # copy_ for tensors >= mib MiB, one foreach for the rest
        bi = [k for k, d in enumerate(dsts) if d.numel() * d.element_size() >= mib * 2**20]
        si = [k for k, d in enumerate(dsts) if d.numel() * d.element_size() < mib * 2**20]
        bd, bs = [dsts[k] for k in bi], [srcs[k] for k in bi]
        sd, ss = [dsts[k] for k in si], [srcs[k] for k in si]

        def hybrid() -> None:
            for d, s in zip(bd, bs, strict=True):
                d.copy_(s)
            if sd:
                torch._foreach_copy_(sd, ss)

        return hybrid

    def flat() -> None:
        flat_dst.copy_(bucket)

    with torch.no_grad():
        ways = [("loop", loop), ("foreach", foreach), ("flat", flat)]
        ways += [(f"hybrid_{m:g}MiB", hybrid_of(m)) for m in a.big_mib]
        ways += [("plan", plan_kept), ("plan_recut", plan_recut)]
        res = {n: timed(f, a.device, a.reps) for n, f in ways}
        for d in dsts:
            d.zero_()
        kept.run()
        ok = all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(dsts, srcs, strict=True))
    out = {
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
        "preset": a.preset,
        "big_copy_bytes": BIG_COPY_BYTES,
        "plan_big_copies": len(kept.big),
        "tensors": len(dsts),
        "bytes": int(sum(d.numel() * d.element_size() for d in dsts)),
        "copies_equal_sources": ok,
        **res,
    }
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
