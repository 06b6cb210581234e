"""Router (head) configuration: flags of `python -m router_node`."""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass
class RouterConfig:
    frontend: str = "tcp://127.0.0.1:5555"  # clients (trainer_bridge) connect here
    events: str = "tcp://127.0.0.1:5556"  # engines: register, heartbeats, acks
    control: str = "tcp://127.0.0.1:5557"  # engines subscribe: commands
    policy: str = "least_loaded"  # random | least_loaded
    heartbeat_interval_s: float = 0.5
    missed_heartbeats: int = 3  # this many intervals without one: unhealthy
    stall_timeout_s: float = 30.0  # steps frozen while having work: unhealthy
    session_ttl_s: float = 600.0
    # New sessions go to the engine with the fewest open sessions + outstanding
    # requests ("open_sessions"), or by outstanding requests alone
    # ("outstanding": the pre-0.2 behaviour, kept for side-by-side benchmarks).
    session_placement: str = "open_sessions"
    failover: bool = True  # re-submit prompt + tokens so far to another engine
    max_failovers: int = 2  # per request
    max_prompt_tokens: int = 32768
    forget_after_s: float = 60.0  # drop a dead engine from the registry
    join_timeout_s: float = 30.0  # an engine that never acks the join ping is dropped
    # deadline of one corrective op (pause/resume/sleep/wake_up) sent to an
    # engine that missed a control op; it is re-checked and retried after it
    converge_timeout_s: float = 30.0
    # A client not heard from (pings, every ~0.5 s from trainer_bridge) for this
    # long loses what it holds: its pauses are resumed, its sleep woken, its
    # weight update aborted (router_node/leases.py).
    lease_s: float = 10.0
    seed: int = 0
    curve_dir: str | None = None
    metrics_port: int = -1  # Prometheus /metrics: -1 off, 0 any free port
    metrics_host: str = "127.0.0.1"


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    ap = argparse.ArgumentParser("router_node", description="The rollout-bus head: router + control fan-out.")
    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if isinstance(default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name == "curve_dir":
            ap.add_argument(flag, default=None)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--ready-file", default=None, help="write the bound addresses (JSON) here once serving")
    a = ap.parse_args(argv)
    cfg = RouterConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(RouterConfig)})
    cfg.ready_file = a.ready_file  # type: ignore[attr-defined]
    return cfg
