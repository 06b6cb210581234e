"""Session spread: 256 open multi-turn sessions over 8 engines (issue 9).

Agents run multi-turn sessions the way an RL rollout does: a turn (one
generate with the session id), then an idle gap (the environment "thinks"),
then the next turn, and the session stays open until the trajectory ends.
Sessions start in a staggered burst, so at any moment some engines are busy
and others idle. Once all 256 are open we read how many sessions each engine
holds (the head's health), for both placements in the same run:

- ``outstanding``: new sessions go to the engine with the fewest outstanding
  requests (what rollout-bus did before; an idle open session weighs nothing);
- ``open_sessions``: fewest open sessions + outstanding requests per capacity.

Engines are the model-less null backend (this measures placement, not
compute). Run: ``python -m bench.session_spread`` (``--quick``: 64 sessions).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from bench import harness as H
from bench import rb_side as RB
from engine_node.backends.null_backend import NULL_BACKEND

PLACEMENTS = ("outstanding", "open_sessions")


async def _agent(client: Any, sid: str, turns: int, rng: random.Random, start_delay: float) -> None:
    await asyncio.sleep(start_delay)
    prompt = [1 + rng.randrange(1000) for _ in range(32)]
    for _ in range(turns):
        r = await client.generate(prompt, {"max_tokens": rng.randrange(4, 32), "ignore_eos": True}, session_id=sid)
        prompt = prompt + list(r.token_ids) + [7, 8, 9]  # observation tokens
        await asyncio.sleep(rng.uniform(0.05, 0.3))  # the environment's step


async def one_placement(args: argparse.Namespace, placement: str, deadline: H.Deadline) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with H.Procs() as procs:
        cl = RB.start_cluster(
            procs, args.engines, backend=NULL_BACKEND, tag="sess",
            router_args=["--session-placement", placement],
        )  # fmt: skip
        client = RB.make_client(cl.frontend)
        try:
            await RB.wait_healthy(client, args.engines, deadline.cap(180), procs)
            t0 = time.monotonic()
            # Staggered starts over `ramp_s`; every session keeps turning until
            # all have started, so at read time all are open.
            agents = [
                _agent(client, f"{placement}-{i}", args.turns, random.Random(rng.random()), rng.uniform(0, args.ramp_s))
                for i in range(args.sessions)
            ]
            await asyncio.wait_for(asyncio.gather(*agents), deadline.cap(300))
            health = await client.health()
            per = {eid: e.get("sessions", 0) for eid, e in health["engines"].items()}
            counts = sorted(per.values())
            mean = statistics.fmean(counts)
            return {
                "placement": placement,
                "sessions": args.sessions,
                "engines": args.engines,
                "per_engine": per,
                "min": counts[0],
                "max": counts[-1],
                "stdev": statistics.pstdev(counts),
                "max_over_mean": counts[-1] / mean if mean else None,
                "seconds": time.monotonic() - t0,
            }
        finally:
            await client.close()


async def main_async(args: argparse.Namespace) -> int:
    deadline = H.Deadline(args.max_seconds)
    rows = []
    for placement in PLACEMENTS:
        try:
            rows.append(await one_placement(args, placement, deadline))
        except Exception as e:
            rows.append({"placement": placement, "error": f"{type(e).__name__}: {e}"})
    H.print_table(
        [{k: v for k, v in r.items() if k != "per_engine"} for r in rows],
        title=f"{args.sessions} open sessions over {args.engines} null engines",
    )
    H.write_json("session_spread", {"args": vars(args), "rows": rows, "machine": H.machine_info()})
    ok = [r for r in rows if "per_engine" in r]
    if ok:
        groups = sorted(ok[0]["per_engine"])
        H.plot_bars(
            "session_spread",
            [g.rsplit("-", 1)[-1] for g in groups],
            {r["placement"]: [r["per_engine"].get(g, 0) for g in groups] for r in ok},
            ylabel="open sessions",
            title=f"{args.sessions} open sessions over {args.engines} engines",
        )
    return 0 if len(ok) == len(rows) else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--ramp-s", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.engines = 64, 4
    H.run_main(lambda: main_async(args))


if __name__ == "__main__":
    main()
