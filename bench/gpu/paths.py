"""The paths gpu_throughput compares, one phase function each (run in a child
process by ``bench.gpu.common.run_phase``; one engine on the GPU at a time):

- ``llm``:      vLLM ``LLM.generate`` with token prompts (the ceiling);
- ``asyncllm``: vLLM ``AsyncLLM`` in-process, every request at once;
- ``http``:     ``python -m vllm.entrypoints.openai.api_server`` + an aiohttp
                client, every request at once (/v1/completions, token-id prompt,
                ``return_token_ids``, ``ignore_eos``), SSE for time to first token;
- ``rb``:       rollout-bus through ``launch.py`` (head + 1 engine node):
                ``Client.generate`` of the whole batch, then one ``AsyncClient``
                stream per request.

Every phase: start the engine (timed), warm up on other prompts, measure the
same request set, then (when spec["ttft"]) time to first token of
``ttft.n`` concurrent requests on other prompts, ``ttft.rounds`` times. The
prefix cache is reset between measurements that reuse prompts. A phase returns
{"engine_start_s", "sched", "modes": {mode: stats}, "ttft": stats}.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G

# ---------------------------------------------------------------- shared


def prompt_sets(spec: dict[str, Any]) -> dict[str, list[list[int]]]:
    """The measured set, and separate warm-up and TTFT prompts (other seeds, so
    neither is a prefix-cache hit for the other)."""
    p = spec["prompts"]
    vocab = G.model_vocab(spec["model"])
    t = spec.get("ttft") or {"n": 0, "rounds": 0}
    return {
        "main": G.make_prompts(p["n"], p["min_len"], p["max_len"], vocab, p["seed"]),
        "warm": G.make_prompts(spec["warmup"]["n"], p["min_len"], p["max_len"], vocab, p["seed"] + 1),
        "ttft": G.make_prompts(t["n"] * t["rounds"], p["min_len"], p["max_len"], vocab, p["seed"] + 2),
    }


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM engine options, the same for every path: gpu_memory_utilization,
    max_model_len, plus the scheduler overrides of an "LLM's values" run."""
    return {k: v for k, v in spec["engine"].items() if v is not None}


def sched_of(vllm_config: Any) -> dict[str, Any]:
    sc = vllm_config.scheduler_config
    out = {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens}
    try:
        out["cudagraph_capture_sizes_max"] = max(vllm_config.compilation_config.cudagraph_capture_sizes or [0])
    except Exception:
        pass
    return out


def throughput(tokens: int, wall_s: float, errors: int, n: int, err_sample: list[str], expected: int) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "expected_tokens": expected,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests": n,
        "errors": errors,
        "error_sample": err_sample[:3],
    }


def median_of(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode measured `reps` times (prefix cache reset between them): the
    rep with the median tokens/s, plus every rep's figure."""
    ok = [r for r in reps if r.get("tokens_per_s")]
    if not ok:
        return reps[-1] if reps else {"error": "no rep ran"}
    ok.sort(key=lambda r: r["tokens_per_s"])
    mid = dict(ok[len(ok) // 2])
    mid["reps_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in reps if r.get("tokens_per_s")]
    mid["errors"] = sum(int(r.get("errors", 0)) for r in reps)
    return mid


async def gather_all(n: int, one: Callable[[int], Awaitable[int]], timeout_s: float) -> dict[str, Any]:
    """Run one(i) for i < n all at once; one returns the tokens it got."""
    errs: list[str] = []

    async def guarded(i: int) -> int:
        try:
            return await asyncio.wait_for(one(i), timeout_s)
        except Exception as e:
            errs.append(repr(e)[:300])
            return -1

    t0 = time.perf_counter()
    got = await asyncio.gather(*(guarded(i) for i in range(n)))
    wall = time.perf_counter() - t0
    return {"tokens": sum(g for g in got if g > 0), "wall_s": wall, "errors": len(errs), "error_sample": errs}


async def ttft_rounds(
    spec: dict[str, Any], prompts: list[list[int]], first_token: Callable[[list[int]], Awaitable[float]]
) -> dict[str, Any]:
    """spec.ttft.rounds rounds of spec.ttft.n concurrent requests; first_token(p)
    returns send → first token seconds (and drains the request)."""
    t = spec["ttft"]
    vals: list[float] = []
    errs: list[str] = []
    for r in range(t["rounds"]):
        batch = prompts[r * t["n"] : (r + 1) * t["n"]]

        async def one(p: list[int]) -> None:
            try:
                vals.append(await asyncio.wait_for(first_token(p), spec["request_timeout_s"]))
            except Exception as e:
                errs.append(repr(e)[:300])

        await asyncio.gather(*(one(p) for p in batch))
    return {
        "n": len(vals),
        "concurrency": t["n"],
        "max_tokens": t["max_tokens"],
        "rounds": t["rounds"],
        "p50_ms": H.percentile(vals, 50) * 1e3 if vals else None,
        "p99_ms": H.percentile(vals, 99) * 1e3 if vals else None,
        "errors": len(errs),
        "error_sample": errs[:3],
    }


def _got(first: float | None) -> float:
    if first is None:
        raise RuntimeError("the request ended without a token")
    return first


def _expected(spec: dict[str, Any]) -> int:
    return spec["prompts"]["n"] * spec["max_tokens"]


# ---------------------------------------------------------------- LLM.generate


def phase_llm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    ps = prompt_sets(spec)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **engine_kwargs(spec))
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0}
    try:
        out["sched"] = sched_of(llm.llm_engine.vllm_config)
    except Exception as e:
        out["sched"] = {"error": repr(e)[:200]}
    spec["_partial"].update(out)
    sp = SamplingParams(
        temperature=spec["temperature"], max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False
    )
    warm = SamplingParams(
        temperature=spec["temperature"], max_tokens=spec["warmup"]["max_tokens"], ignore_eos=True, detokenize=False
    )
    llm.generate([{"prompt_token_ids": p} for p in ps["warm"]], warm, use_tqdm=False)
    reps = []
    probe = G.CpuProbe()
    for _ in range(spec.get("reps", 1)):
        llm.reset_prefix_cache()
        with probe.measure() as m:
            t0 = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": p} for p in ps["main"]], sp, use_tqdm=False)
            wall = time.perf_counter() - t0
        toks = sum(len(r.outputs[0].token_ids) for r in res)
        reps.append({**throughput(toks, wall, 0, len(res), [], _expected(spec)), **m})
    out["modes"] = {"LLM.generate": median_of(reps)}
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    return out


# ---------------------------------------------------------------- AsyncLLM


def phase_asyncllm(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_asyncllm(spec))


async def _asyncllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    ps = prompt_sets(spec)
    t0 = time.perf_counter()
    # AsyncLLM's own defaults (usage context ENGINE_CONTEXT), as a library user gets them
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=spec["model"], **engine_kwargs(spec)))
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0}
    try:
        out["sched"] = sched_of(engine.vllm_config)
    except Exception as e:
        out["sched"] = {"error": repr(e)[:200]}
    spec["_partial"].update(out)
    ids = iter(range(1 << 30))

    def params(max_tokens: int, kind: Any) -> Any:
        return SamplingParams(
            temperature=spec["temperature"], max_tokens=max_tokens, ignore_eos=True, detokenize=False, output_kind=kind
        )

    async def final(p: list[int], sp: Any) -> int:
        last = None
        async for o in engine.generate({"prompt_token_ids": p}, sp, request_id=f"r{next(ids)}"):
            last = o
        return len(last.outputs[0].token_ids) if last else 0

    try:
        warm = params(spec["warmup"]["max_tokens"], RequestOutputKind.FINAL_ONLY)
        await gather_all(len(ps["warm"]), lambda i: final(ps["warm"][i], warm), spec["request_timeout_s"])
        sp = params(spec["max_tokens"], RequestOutputKind.FINAL_ONLY)
        reps = []
        for _ in range(spec.get("reps", 1)):
            await engine.reset_prefix_cache()
            r = await gather_all(len(ps["main"]), lambda i: final(ps["main"][i], sp), spec["request_timeout_s"])
            reps.append(
                throughput(r["tokens"], r["wall_s"], r["errors"], len(ps["main"]), r["error_sample"], _expected(spec))
            )
        out["modes"] = {f"{len(ps['main'])} concurrent": median_of(reps)}
        spec["_partial"].update(out)
        if spec.get("ttft"):
            sp_d = params(spec["ttft"]["max_tokens"], RequestOutputKind.DELTA)

            async def first_token(p: list[int]) -> float:
                t = time.perf_counter()
                first = None
                async for o in engine.generate({"prompt_token_ids": p}, sp_d, request_id=f"t{next(ids)}"):
                    if first is None and o.outputs and o.outputs[0].token_ids:
                        first = time.perf_counter() - t
                return _got(first)

            out["ttft"] = await ttft_rounds(spec, ps["ttft"], first_token)
    finally:
        engine.shutdown()
    return out


# ---------------------------------------------------------------- HTTP server


_SCHED_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_model_len": "--max-model-len",
    "enforce_eager": "--enforce-eager",
}


def server_argv(spec: dict[str, Any], port: int) -> list[str]:
    import sys

    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        spec["model"],
        "--host",
        H.LOOPBACK,
        "--port",
        str(port),
        "--disable-uvicorn-access-log",
    ]
    for k, v in engine_kwargs(spec).items():
        flag = _SCHED_FLAGS.get(k)
        if flag is None:
            raise ValueError(f"no api_server flag known for engine option {k!r} (add it to _SCHED_FLAGS)")
        argv += [flag] if v is True else ([] if v is False else [flag, str(v)])
    return argv


def phase_http(spec: dict[str, Any]) -> dict[str, Any]:
    return asyncio.run(_http(spec))


async def wait_http_ready(
    session: Any, base: str, proc: Any, timeout_s: float, log: Path, what: str = "api_server"
) -> None:
    """Until `base`/health answers 200; the server's exit or `ready_timeout_s` ends the wait with its log's tail."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited rc={proc.returncode} before ready:\n{G._tail(log, 30)}")
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except Exception:  # not listening yet: poll again until the deadline
            pass
        await asyncio.sleep(0.25)
    raise TimeoutError(f"{what} not ready after ready_timeout_s={timeout_s:.0f}s:\n{G._tail(log, 30)}")


async def _http(spec: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    ps = prompt_sets(spec)
    port = H.free_port()
    base = f"http://{H.LOOPBACK}:{port}"
    out: dict[str, Any] = {"server_argv": server_argv(spec, port)[1:]}
    with H.Procs(log_dir=Path(spec["log_dir"])) as procs:
        t0 = time.perf_counter()
        # dev mode: /server_info (the scheduler config it picked) and /reset_prefix_cache
        name = f"api_server-{port}"
        proc = procs.start(name, server_argv(spec, port), env={"VLLM_SERVER_DEV_MODE": "1"})
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=spec["request_timeout_s"])
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            await wait_http_ready(s, base, proc, spec["ready_timeout_s"], procs.log_dir / f"{name}.log")
            out["engine_start_s"] = time.perf_counter() - t0
            out["sched"] = await _server_sched(s, base)
            spec["_partial"].update(out)

            def body(p: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
                return {
                    "model": spec["model"],
                    "prompt": p,
                    "max_tokens": max_tokens,
                    "temperature": spec["temperature"],
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "stream": stream,
                }

            async def complete(p: list[int], max_tokens: int) -> int:
                async with s.post(f"{base}/v1/completions", json=body(p, max_tokens)) as r:
                    data = json.loads(await r.read())
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {str(data)[:200]}")
                c = data["choices"][0]
                return len(c["token_ids"]) if c.get("token_ids") is not None else data["usage"]["completion_tokens"]

            wm = spec["warmup"]["max_tokens"]
            await gather_all(len(ps["warm"]), lambda i: complete(ps["warm"][i], wm), spec["request_timeout_s"])
            reps = []
            for _ in range(spec.get("reps", 1)):
                async with s.post(f"{base}/reset_prefix_cache") as rr:  # dev mode route
                    await rr.read()
                r = await gather_all(
                    len(ps["main"]), lambda i: complete(ps["main"][i], spec["max_tokens"]), spec["request_timeout_s"]
                )
                reps.append(
                    throughput(
                        r["tokens"], r["wall_s"], r["errors"], len(ps["main"]), r["error_sample"], _expected(spec)
                    )
                )
            out["modes"] = {f"{len(ps['main'])} concurrent": median_of(reps)}
            spec["_partial"].update(out)
            if spec.get("ttft"):

                async def first_token(p: list[int]) -> float:
                    t = time.perf_counter()
                    first = None
                    async with s.post(f"{base}/v1/completions", json=body(p, spec["ttft"]["max_tokens"], True)) as resp:
                        if resp.status != 200:
                            raise RuntimeError(f"HTTP {resp.status}")
                        async for line in resp.content:
                            if first is None and line.startswith(b"data: {"):
                                c = json.loads(line[6:])["choices"]
                                if c and (c[0].get("token_ids") or c[0].get("text")):
                                    first = time.perf_counter() - t
                    return _got(first)

                out["ttft"] = await ttft_rounds(spec, ps["ttft"], first_token)
    return out


async def _server_sched(s: Any, base: str) -> dict[str, Any]:
    try:
        async with s.get(f"{base}/server_info", params={"config_format": "json"}) as r:
            cfg = (await r.json())["vllm_config"]
        sc = cfg["scheduler_config"]
        return {"max_num_seqs": sc.get("max_num_seqs"), "max_num_batched_tokens": sc.get("max_num_batched_tokens")}
    except Exception as e:
        return {"error": f"/server_info: {e!r}"[:200]}


# ---------------------------------------------------------------- rollout-bus


def phase_rb(spec: dict[str, Any]) -> dict[str, Any]:
    ps = prompt_sets(spec)
    cpu = spec.get("cpu", False)
    probe = G.CpuProbe()
    eng = engine_kwargs(spec)
    overrides = {k: v for k, v in eng.items() if k not in ("gpu_memory_utilization", "max_model_len")}
    out: dict[str, Any] = {}
    with G.RbCluster(
        spec["model"],
        "torch" if cpu else "vllm",
        engines=1,
        gpu_memory_utilization=eng.get("gpu_memory_utilization"),
        max_model_len=eng.get("max_model_len"),
        backend_options=overrides,
        ready_timeout_s=spec["ready_timeout_s"],
        log_dir=Path(spec["log_dir"]),
    ) as cl:
        out["engine_start_s"], engines = cl.wait_ready()
        out["engines"] = engines
        e0 = engines[0] if engines else {}
        # the engine registers capacity = its scheduler's max_num_seqs; batched tokens only if it says
        out["sched"] = {
            "max_num_seqs": e0.get("max_num_seqs", e0.get("capacity")),
            "max_num_batched_tokens": e0.get("max_num_batched_tokens"),
        }
        out["launch_argv"] = cl.argv[1:]
        spec["_partial"].update(out)
        params = {"max_tokens": spec["max_tokens"], "temperature": spec["temperature"], "ignore_eos": True}
        asyncio.run(_rb_modes(spec, cl.address, ps, params, out, probe))
    return out


async def _engine_stats(ac: Any) -> dict[str, Any]:
    """The first engine's backend counters (vLLM backend: core_batches /
    core_outputs) and the node's loop seconds, through a Stats control op."""
    from bus import protocol as P

    try:
        res = await ac.control(P.Stats(), strict=False, timeout_s=10)
        return dict(next(iter(res.values())).detail or {})
    except Exception as e:
        return {"error": repr(e)[:200]}


def _stats_delta(a: dict[str, Any], b: dict[str, Any], wall: float) -> dict[str, Any]:
    """Engine-core steps and outputs per step during a mode; the engine node's
    loop thread: busy fraction and where it went."""
    out: dict[str, Any] = {}
    try:
        steps = b["core_batches"] - a["core_batches"]
        outs = b["core_outputs"] - a["core_outputs"]
        out.update(
            core_steps=steps, steps_per_s=round(steps / wall, 1), outputs_per_step=round(outs / max(steps, 1), 1)
        )
    except Exception:
        pass
    try:
        la, lb = a["loop"], b["loop"]
        d = {k: lb[k] - la[k] for k in lb}
        out["node_loop"] = {
            "turns": int(d["turns"]),
            **{k: round(d[k] / wall, 3) for k in ("poll_s", "read_s", "step_s", "flush_s")},
        }
    except Exception:
        pass
    return out


def _timeline(marks: list[tuple[float, float, float]], t0: float) -> dict[str, Any]:
    """When the streams were sent, got their first and their last token (ms
    after the mode began): p0/p50/p100 of each."""
    if not marks:
        return {}

    def q(vals: list[float]) -> list[float]:
        vals = sorted(vals)
        return [round(1e3 * vals[0], 1), round(1e3 * vals[len(vals) // 2], 1), round(1e3 * vals[-1], 1)]

    return {
        "sent": q([m[0] - t0 for m in marks]),
        "first": q([m[1] - t0 for m in marks]),
        "last": q([m[2] - t0 for m in marks]),
    }


async def _rb_modes(
    spec: dict[str, Any],
    address: str,
    ps: dict[str, list[list[int]]],
    params: dict[str, Any],
    out: dict[str, Any],
    probe: G.CpuProbe,
) -> None:
    """Batch `generate` and 512 AsyncClient streams, their reps INTERLEAVED
    (batch, streams, streams, batch, ...) so a drift of the engine's pace over
    the phase (warm-up effects, clocks) weighs on both modes alike; then TTFT."""
    from trainer_bridge import AsyncClient

    ac = AsyncClient(address, timeout_s=spec["request_timeout_s"], control_timeout_s=60)
    n_main = len(ps["main"])
    streams_mode = f"{n_main} AsyncClient streams"
    try:
        await ac.generate(ps["warm"], {**params, "max_tokens": spec["warmup"]["max_tokens"]})
        marks: list[tuple[float, float, float]] = []  # per stream: sent, first token, last token

        async def stream(p: list[int], prm: dict[str, Any]) -> int:
            n = 0
            t0 = time.perf_counter()
            first = last = t0
            async for ch in ac.stream(p, prm):
                if ch.token_ids:
                    last = time.perf_counter()
                    if not n:
                        first = last
                n += len(ch.token_ids)
            marks.append((t0, first, last))
            return n

        async def batch() -> dict[str, Any]:
            t0 = time.perf_counter()
            res = await asyncio.wait_for(ac.generate(ps["main"], params), spec["request_timeout_s"])
            wall = time.perf_counter() - t0
            assert isinstance(res, list)  # a batch in, a list out
            toks = sum(len(r.token_ids) for r in res)
            return {**throughput(toks, wall, 0, len(res), [], _expected(spec)), "_wall": wall}

        async def streams() -> dict[str, Any]:
            marks.clear()
            t_start = time.perf_counter()
            r = await gather_all(n_main, lambda i: stream(ps["main"][i], params), spec["request_timeout_s"])
            return {
                **throughput(r["tokens"], r["wall_s"], r["errors"], n_main, r["error_sample"], _expected(spec)),
                "_wall": r["wall_s"],
                "timeline_ms": _timeline(marks, t_start),
            }

        prof = None
        if os.environ.get("ROLLOUT_BUS_PROFILE_DIR"):  # the client's stacks during the measured reps
            from bus.profiler import StackSampler

            prof = StackSampler(float(os.environ.get("ROLLOUT_BUS_PROFILE_INTERVAL_S", "0.003"))).start()
        reps: dict[str, list[dict[str, Any]]] = {"generate batch": [], streams_mode: []}
        runs = {"generate batch": batch, streams_mode: streams}
        out["modes"] = {}
        for i in range(spec.get("reps", 1)):
            order = list(runs) if i % 2 == 0 else list(reversed(list(runs)))
            for mode in order:
                try:
                    await ac.reset_prefix_cache()
                except Exception:
                    pass
                try:
                    st0 = await _engine_stats(ac)
                    with probe.measure() as m:
                        r = await runs[mode]()
                    wall = r.pop("_wall")
                    reps[mode].append({**r, **m, "engine": _stats_delta(st0, await _engine_stats(ac), wall)})
                except Exception as e:
                    reps[mode].append({"error": repr(e)[:500]})
        if prof is not None:
            prof.stop()
            d = Path(os.environ["ROLLOUT_BUS_PROFILE_DIR"])
            d.mkdir(parents=True, exist_ok=True)
            (d / f"client-{os.getpid()}.txt").write_text(prof.report())
        for mode, rs in reps.items():
            out["modes"][mode] = median_of(rs)
            out["modes"][mode]["order"] = "interleaved with the other mode, rep by rep"
        spec["_partial"].update(out)
        out["prefix_cache_reset"] = await _areset(ac)
        if spec.get("ttft"):
            tp = {**params, "max_tokens": spec["ttft"]["max_tokens"]}

            async def first_token(p: list[int]) -> float:
                t = time.perf_counter()
                first = None
                async for ch in ac.stream(p, tp):
                    if first is None and ch.token_ids:
                        first = time.perf_counter() - t
                return _got(first)

            out["ttft"] = await ttft_rounds(spec, ps["ttft"], first_token)
    finally:
        await ac.close()


async def _areset(ac: Any) -> Any:
    try:
        await ac.reset_prefix_cache()
        return True
    except Exception as e:
        return f"failed: {e!r}"[:200]


PHASES = {
    "llm": "bench.gpu.paths:phase_llm",
    "asyncllm": "bench.gpu.paths:phase_asyncllm",
    "http": "bench.gpu.paths:phase_http",
    "rb": "bench.gpu.paths:phase_rb",
}
