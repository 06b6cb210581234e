"""End to end on the torch backend: tokens/s through the runtime vs the same
model driven in-process, same prompts.

- in-process: this process builds the torch backend object itself
  (``engine_node.backend.load_backend("torch", model)``, same options as the
  engine node) and drives it directly: keep C sequences added, ``step()``
  until all P prompts are done. No sockets, no serialization: the ceiling.
- runtime via router: head + 1 engine node (torch backend, same model and
  options), ``trainer_bridge.AsyncClient`` with C tasks, each ``generate``-ing
  prompts from the same list.
- runtime direct: the same client straight to the engine's data socket.
- runtime via router, 2 engines (extra row, not a ratio): what the second core
  buys on this 2-core machine.

Greedy decoding (temperature 0, ignore_eos): the runtime's tokens are checked
equal to the in-process tokens for every prompt. Setups are interleaved per
repetition; ratios runtime / in-process are per repetition.

Run: ``python -m bench.e2e_torch`` (``--quick``: fewer prompts/reps).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from bench import harness as H
from bench import rb_side as RB


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(length)] for _ in range(n)]


def in_process(
    backend: Any, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[H.RunResult, list[list[int]]]:
    from bus.protocol import SamplingParams
    from engine_node.backend import SeqRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs: list[list[int]] = [[] for _ in prompts]
    started: dict[str, tuple[int, float]] = {}
    lat: list[float] = []
    nxt = 0
    t0 = time.perf_counter()

    def add_one() -> None:
        nonlocal nxt
        i = nxt
        nxt += 1
        sid = f"p{i}-{t0}"
        started[sid] = (i, time.perf_counter())
        backend.add(SeqRequest(sid, list(prompts[i]), params, max_tokens))

    while nxt < len(prompts) and len(started) < concurrency:
        add_one()
    while started:
        for o in backend.step():
            i, ts = started[o.seq_id]
            outs[i].extend(o.token_ids)
            if o.finish_reason is not None:
                del started[o.seq_id]
                lat.append(time.perf_counter() - ts)
                if nxt < len(prompts):
                    add_one()
    wall = time.perf_counter() - t0
    return H.RunResult(lat, wall, tokens=sum(len(o) for o in outs)), outs


async def runtime(
    client: Any, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[H.RunResult, list[list[int]]]:
    from bus.protocol import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs: list[list[int]] = [[] for _ in prompts]
    lat: list[float] = []
    errors = 0
    nxt = 0

    async def worker() -> None:
        nonlocal nxt, errors
        while nxt < len(prompts):
            i = nxt
            nxt += 1
            t = time.perf_counter()
            try:
                r = await client.generate(prompts[i], params, timeout_s=120)
                outs[i] = r.token_ids
                lat.append(time.perf_counter() - t)
            except Exception:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    wall = time.perf_counter() - t0
    return H.RunResult(lat, wall, errors=errors, tokens=sum(len(o) for o in outs)), outs


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine_node.backend import load_backend
    from engine_node.tiny_model import ensure_tiny_model

    deadline = H.Deadline(args.max_seconds, "e2e_torch")
    model = args.model or ensure_tiny_model()
    options = {"capacity": args.capacity}
    backend = load_backend("torch", model, **options)
    info = backend.info()
    prompts = make_prompts(args.prompts, args.prompt_len, info.vocab_size)
    res: dict[str, Any] = {"model": model, "backend_options": options, "vocab_size": info.vocab_size}
    mismatches = 0
    with H.Procs() as procs:
        cl1 = RB.start_cluster(procs, 1, backend="torch", model=model, backend_options=options, tag="e2e1")
        cl2 = (
            RB.start_cluster(procs, 2, backend="torch", model=model, backend_options=options, tag="e2e2")
            if args.two
            else None
        )
        via_router = RB.make_client(cl1.frontend)
        direct = RB.make_client(next(iter(cl1.engines.values())))
        via_router2 = RB.make_client(cl2.frontend) if cl2 else None
        try:
            await RB.wait_healthy(via_router, 1, deadline.cap(180), procs)
            if via_router2:
                await RB.wait_healthy(via_router2, 2, deadline.cap(180), procs)
            _, ref = in_process(backend, prompts[: min(4, len(prompts))], args.max_tokens, args.concurrency[0])
            for c in args.concurrency:
                reference: dict[str, list[list[int]]] = {}

                async def inproc(c: int = c, reference: dict[str, list[list[int]]] = reference) -> H.RunResult:
                    r, outs = in_process(backend, prompts, args.max_tokens, c)
                    reference["outs"] = outs
                    return r

                def rt(client: Any, c: int = c, reference: dict[str, list[list[int]]] = reference) -> Any:
                    async def go() -> H.RunResult:
                        nonlocal mismatches
                        r, outs = await runtime(client, prompts, args.max_tokens, c)
                        if "outs" in reference:
                            mismatches += sum(1 for a, b in zip(outs, reference["outs"], strict=True) if a != b)
                        return r

                    return go

                setups = {
                    "in-process backend": inproc,
                    "runtime via router": rt(via_router),
                    "runtime direct": rt(direct),
                }
                if via_router2:
                    setups["runtime via router, 2 engines"] = rt(via_router2)
                runs = await H.interleaved(setups, reps=args.reps, warmup=1, deadline=deadline)
                base = [r.tokens / r.wall_s for r in runs["in-process backend"]]
                res[f"c={c}"] = {
                    "concurrency": c,
                    "setups": {
                        k: {"summary": H.summarize_reps(v), "runs": [x.summary() for x in v]} for k, v in runs.items()
                    },
                    "tokens_per_s_vs_in_process": {
                        k: H.paired_ratios([x.tokens / x.wall_s for x in v], base)
                        for k, v in runs.items()
                        if k != "in-process backend"
                    },
                }
                print(f"  done c={c} ({deadline.remaining():.0f}s left)", flush=True)
        finally:
            await via_router.close()
            await direct.close()
            if via_router2:
                await via_router2.close()
            backend.close()
    res["greedy_token_mismatches"] = mismatches
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the tiny model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-two", dest="two", action="store_false", help="skip the 2-engine row")
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.reps, args.max_tokens = 16, 2, 16
        args.max_seconds = min(args.max_seconds, 120)

    async def go() -> int:
        t0 = time.monotonic()
        res = await run(args)
        rows = []
        for key, r in res.items():
            if not key.startswith("c="):
                continue
            for name, s in r["setups"].items():
                sm = s["summary"]
                rat = r["tokens_per_s_vs_in_process"].get(name)
                rows.append(
                    {
                        "concurrency": str(r["concurrency"]),
                        "setup": name,
                        "tokens/s": H.fmt_spread(sm["tokens_per_s"], 0),
                        "x in-process": H.fmt_spread(rat) if rat else "1",
                        "req p50 ms": H.fmt(sm["p50_ms"]["median"]),
                        "err": str(sm["errors"]),
                    }
                )
        title = (
            f"E2E torch backend (tiny model): {args.prompts} prompts x {args.prompt_len} tokens, "
            f"max_tokens={args.max_tokens} greedy ({args.reps} reps, median [min-max])"
        )
        H.print_table(rows, title=title)
        print(f"greedy outputs runtime vs in-process: {res['greedy_token_mismatches']} mismatching prompt(s)")
        H.write_json("e2e_torch", {"config": vars(args), "elapsed_s": time.monotonic() - t0, "results": res})
        cs = [k for k in res if k.startswith("c=")]
        names = list(res[cs[0]]["setups"])
        series = {n: [res[c]["setups"][n]["summary"]["tokens_per_s"]["median"] for c in cs] for n in names}
        errs = {
            n: (
                [res[c]["setups"][n]["summary"]["tokens_per_s"]["min"] for c in cs],
                [res[c]["setups"][n]["summary"]["tokens_per_s"]["max"] for c in cs],
            )
            for n in names
        }
        H.plot_bar_panels(
            "e2e_torch",
            [
                {
                    "title": "generated tokens/s",
                    "ylabel": "tokens/s",
                    "groups": [f"concurrency {c[2:]}" for c in cs],
                    "series": series,
                    "errs": errs,
                }
            ],
            suptitle=title,
        )
        return 0

    H.run_main(go)


if __name__ == "__main__":
    main()
