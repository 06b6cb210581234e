"""Losing one engine of N under load (issue 33 §5; bench/gpu/scale_out.py
--kill-one): a rollout-bus cluster of N engines (launch.py, its supervisor
restarting what dies) under the GRPO load of scale_out, streamed by a closed
loop of --kill-concurrency AsyncClient streams; at --kill-at-s one engine
node gets SIGKILL. Measured: every request's tokens and finish (0 lost, 0
truncated: failover re-submits prompt + tokens so far), tokens/s in 100 ms
bins (the time series), how long after the kill the rolling 0.5 s rate is
back at >= 3/4 of the rate before it, when the supervisor's restart is
healthy at the head, and that the restarted engine serves (it is asked
directly, by id, through a batch placed after the restart).

With no weight update committed (version 0) the restarted engine joins
healthy; after an update it joins STALE and serves once `sync_stale` brings
it to the cluster's version (tests/test_faults.py covers that path)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.gpu import common as G
from bench.gpu import prefix_placement as PP
from bench.gpu import scale_arms as A

BIN_S = 0.1
RECOVER_FRACTION = 0.75


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kill-one", action="store_true", help="§5: kill -9 one engine of the largest N under load")
    ap.add_argument("--kill-at-s", type=float, default=6.0, help="--kill-one: seconds into the load")
    ap.add_argument("--kill-duration-s", type=float, default=16.0, help="--kill-one: seconds of load to start")
    ap.add_argument("--kill-concurrency", type=int, default=512, help="--kill-one: streams in flight")


def run_kill(spec0: dict[str, Any], n: int, budget: Any, a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    spec = {**spec0, "engines": n, "kill_at_s": a.kill_at_s, "kill_duration_s": a.kill_duration_s,
            "kill_concurrency": a.kill_concurrency}  # fmt: skip
    limit = max(60.0, min(a.phase_limit_s, budget.left() - 10))
    return G.run_phase(f"scale_kill_n{n}", "bench.gpu.scale_kill:phase_kill", spec, limit, log_dir)


def phase_kill(spec: dict[str, Any]) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        cl = A.rb_cluster(spec, "least_loaded", stack)
        return asyncio.run(kill_under_load(cl.address, spec))


class Load:
    """A closed loop of streams over the GRPO set; every request checked."""

    def __init__(self, ac: Any, spec: dict[str, Any]) -> None:
        self.ac = ac
        vocab = G.model_vocab(spec["model"])
        self.prompts = [p for _, p in PP.workload(spec, vocab, salt=7, arm=0)]
        self.params = {"max_tokens": spec["grpo_max_tokens"], "temperature": spec["temperature"], "ignore_eos": True}
        self.timeout_s = spec["request_timeout_s"]
        self.stamps: list[tuple[float, int]] = []  # (monotonic, tokens) per chunk
        self.done = 0
        self.bad: list[str] = []
        self.sent = 0

    async def one(self, prompt: list[int]) -> None:
        got, fin = 0, None
        try:
            async for ch in self.ac.stream(prompt, self.params, timeout_s=self.timeout_s):
                if ch.token_ids:
                    self.stamps.append((time.monotonic(), len(ch.token_ids)))
                got += len(ch.token_ids)
                fin = ch.finish_reason or fin
        except Exception as e:  # a lost request: counted, the loop goes on
            self.bad.append(f"error after {got} tokens: {type(e).__name__}: {e}"[:300])
            return
        if got != self.params["max_tokens"] or fin != "length":
            self.bad.append(f"truncated or over: {got}/{self.params['max_tokens']} tokens, finish={fin}")
        else:
            self.done += 1

    async def run(self, concurrency: int, until: float) -> None:
        async def worker(k: int) -> None:
            i = k
            while time.monotonic() < until:
                self.sent += 1
                await self.one(self.prompts[i % len(self.prompts)])
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))


def series(stamps: list[tuple[float, int]], t0: float, t_end: float) -> list[float]:
    """tokens/s in BIN_S bins from t0 to t_end."""
    bins = [0.0] * max(1, int((t_end - t0) / BIN_S) + 1)
    for t, n in stamps:
        k = int((t - t0) / BIN_S)
        if 0 <= k < len(bins):
            bins[k] += n / BIN_S
    return bins


def recovery(bins: list[float], kill_bin: int) -> dict[str, Any]:
    """The rate before the kill (median of the 3 s before), the lowest rolling
    0.5 s rate after, and the first time after the kill it is back at >= 3/4."""
    pre = statistics.median(bins[max(0, kill_bin - int(3 / BIN_S)) : kill_bin] or [0.0])
    w = int(0.5 / BIN_S)
    roll = [sum(bins[i : i + w]) / w for i in range(kill_bin, max(kill_bin, len(bins) - w))]
    back = next((i for i, v in enumerate(roll) if v >= RECOVER_FRACTION * pre and i > 0), None)
    return {"before_tokens_per_s": pre, "lowest_rolling_tokens_per_s": min(roll, default=None),
            "back_to_3_4_after_s": None if back is None else round(back * BIN_S, 2)}  # fmt: skip


async def _victim(ac: Any) -> dict[str, Any]:
    es = sorted(await ac.engines(), key=lambda e: e["engine_id"])
    return es[-1]


async def _restarted(ac: Any, victim: dict[str, Any], deadline_s: float) -> float:
    t0 = time.monotonic()
    seen: Any = "no answer from the head"
    while time.monotonic() - t0 < deadline_s:
        with contextlib.suppress(Exception):  # the head answers between restarts; polled until the deadline
            for e in await ac.engines():
                if e["engine_id"] == victim["engine_id"]:
                    seen = e
                if e["engine_id"] == victim["engine_id"] and e["incarnation"] != victim["incarnation"] and e["healthy"]:
                    return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise TimeoutError(
        f"{victim['engine_id']} not restarted and healthy within ready_timeout_s={deadline_s:.0f}; "
        f"the head's last view of it: {seen}"
    )


async def _serves(ac: Any, engine_id: str, params: dict[str, Any], prompts: list[list[int]]) -> int:
    """Requests the restarted engine served out of a batch sent after its restart."""
    res = await ac.generate(prompts, {**params, "max_tokens": 4})
    return sum(1 for r in res if r.engine_id == engine_id)


async def kill_under_load(address: str, spec: dict[str, Any]) -> dict[str, Any]:
    from trainer_bridge import AsyncClient

    ac = AsyncClient(address, timeout_s=spec["request_timeout_s"], control_timeout_s=60)
    try:
        load = Load(ac, spec)
        victim = await _victim(ac)
        t0 = time.monotonic()
        run = asyncio.ensure_future(load.run(spec["kill_concurrency"], t0 + spec["kill_duration_s"]))
        await asyncio.sleep(spec["kill_at_s"])
        t_kill = time.monotonic()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        restart_s = await _restarted(ac, victim, spec["ready_timeout_s"])
        await run
        t_end = time.monotonic()
        bins = series(load.stamps, t0, t_end)
        served = await _serves(ac, victim["engine_id"], load.params, load.prompts[: 8 * spec["engines"]])
        return {
            "engines": spec["engines"], "victim": victim["engine_id"], "killed_at_s": round(t_kill - t0, 2),
            "requests_sent": load.sent, "requests_complete": load.done, "requests_lost_or_truncated": len(load.bad),
            "bad_sample": load.bad[:5], "restart_healthy_after_s": round(restart_s, 2),
            "restarted_engine_served": served, "bin_s": BIN_S, "tokens_per_s_series": [round(b, 1) for b in bins],
            **recovery(bins, int((t_kill - t0) / BIN_S)),
        }  # fmt: skip
    finally:
        await ac.close()


def report(k: dict[str, Any]) -> None:
    if "error" in k and "requests_sent" not in k:
        print(f"kill-one: {k['error'][:400]}", flush=True)
        return
    H.print_table(
        [{"N": str(k.get("engines")), "victim": str(k.get("victim")), "sent": str(k.get("requests_sent")),
          "lost/truncated": str(k.get("requests_lost_or_truncated")),
          "tokens/s before": H.fmt(k.get("before_tokens_per_s"), 0),
          "lowest 0.5 s": H.fmt(k.get("lowest_rolling_tokens_per_s"), 0),
          "back to 3/4 after s": str(k.get("back_to_3_4_after_s")),
          "restart healthy s": str(k.get("restart_healthy_after_s")),
          "restarted served": str(k.get("restarted_engine_served"))}],
        title="Kill -9 one engine under the GRPO load (targets: 0 lost, back to 3/4 within 2 s, restarted serves)",
    )  # fmt: skip
