"""CPU-side overhead of the one-trip zero-copy cuda_ipc update per stage, for a
7B-shaped layout (Qwen2-7B: 339 checkpoint tensors), before and after the
per-layout caches of issue 21 §2 (engine_node/backends/vllm/weight_reuse.py,
trainer_bridge/transports/one_trip.py `layout_id`).

No GPU, no vLLM: each stage runs the code the update runs (the digest, the
backend's validation, the worker's checks) on the layout's metas and
pickled-handle-sized bytes; the node -> engine core -> worker hop is the
msgpack encode and decode of the utility call's arguments (vLLM's own
encoder is msgspec msgpack too). "before" is the path of every update on main
a05ad8d, "after" the steady state here (same objects handed again, the
workers holding the layout under a token).

    python -m bench.one_trip_cpu [--reps 200] [--layers 28]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bus.protocol import TensorMeta
from engine_node.backends.vllm import weight_reuse as R
from engine_node.backends.vllm import weights as W
from engine_node.backends.vllm.worker_reuse import Layout
from trainer_bridge.transports import one_trip

HANDLE_BYTES = 330  # a pickled reduce_tensor tuple + the GPU's uuid


def qwen7b(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    h, kv, inter, vocab = 3584, 512, 18944, 152064
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for li in range(layers):
        p = f"model.layers.{li}."
        out += [
            *((p + f"self_attn.{x}_proj.weight", (d, h)) for x, d in (("q", h), ("k", kv), ("v", kv))),
            *((p + f"self_attn.{x}_proj.bias", (d,)) for x, d in (("q", h), ("k", kv), ("v", kv))),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def timed(fn: Callable[[], Any], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def stages(layers: int) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    shapes = qwen7b(layers)
    metas = [TensorMeta(n, "bfloat16", list(s), i, 0, math.prod(s) * 2) for i, (n, s) in enumerate(shapes)]
    sizes = [m.nbytes for m in metas]
    handles = [os.urandom(HANDLE_BYTES) for _ in metas]
    ckpt = {n: list(s) for n, s in shapes}
    lists = [W.meta_list(m) for m in metas]
    opts = {"plan": True, "check": False, "keep_maps": True}
    full = ("rollout_bus_apply_ipc", None, ("u1", lists, sizes, handles, {**opts, "kept_token": "u0.1"}), None)
    kept = ("rollout_bus_apply_kept", None, ("u1", "u0.1", opts), None)
    full_wire, kept_wire = msgspec.msgpack.encode(full), msgspec.msgpack.encode(kept)
    valid = R.Validated(list(metas), list(sizes), ckpt, lists)
    held = R.KeptIpc("u0.1", lists, sizes, handles)
    layout = Layout.of(lists, sizes)

    def digest_before() -> str:
        one_trip._LAST_LAYOUT[:] = [(), (), (), ""]
        return one_trip.layout_id(metas, sizes, handles)

    def validate_before() -> Any:
        ml = [W.meta_list(t) for t in metas]
        return W.validate(ml, sizes, ckpt, False, "q7b")

    def validate_after() -> Any:
        return valid.serves(metas, sizes, ckpt) and list(valid.metas)

    def worker_before() -> Any:
        # what the worker got: freshly decoded lists and bytes, compared by value
        _, _, (uid, m, s, h, _o), _ = msgspec.msgpack.decode(full_wire)
        st_metas = [list(x) for x in m]
        return h == list(handles) and layout.same(st_metas, [int(x) for x in s])

    def worker_after() -> Any:
        _, _, (uid, token, _o), _ = msgspec.msgpack.decode(kept_wire)
        return token == held.token and held.handles == handles and layout.same(held.metas, held.sizes)

    return [
        ("trainer: layout digest (layout_id)", digest_before, lambda: one_trip.layout_id(metas, sizes, handles)),
        ("engine node: backend begin (meta lists + validate)", validate_before, validate_after),
        (
            "engine node: commit call args (kept-layout check + encode)",
            lambda: msgspec.msgpack.encode(full),
            lambda: held.serves(lists, sizes, handles) and msgspec.msgpack.encode(kept),
        ),
        (
            "engine core: utility args decode",
            lambda: msgspec.msgpack.decode(full_wire),
            lambda: msgspec.msgpack.decode(kept_wire),
        ),
        ("worker: begin copy + handle/layout compares", worker_before, worker_after),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=28)
    a = ap.parse_args(argv)
    rows = stages(a.layers)
    print(f"one-trip CPU overhead per stage, {len(qwen7b(a.layers))} tensors, median of 3 x {a.reps} reps (ms)")
    print("| stage | before | after |\n|---|---|---|")
    tb = ta = 0.0
    for name, before, after in rows:
        b = sorted(timed(before, a.reps) for _ in range(3))[1]
        f = sorted(timed(after, a.reps) for _ in range(3))[1]
        tb, ta = tb + b, ta + f
        print(f"| {name} | {b:.3f} | {f:.3f} |")
    print(f"| total | {tb:.3f} | {ta:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
