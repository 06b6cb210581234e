"""Router (head) configuration: flags of `python -m router_node`."""

from __future__ import annotations

import argparse
import dataclasses

from bus.validate import DEFAULT_MAX_REQUEST_TOKENS


@dataclasses.dataclass
class RouterConfig:
    frontend: str = "tcp://127.0.0.1:5555"  # clients (trainer_bridge) connect here
    events: str = "tcp://127.0.0.1:5556"  # engines: register, heartbeats, acks
    control: str = "tcp://127.0.0.1:5557"  # engines subscribe: commands
    policy: str = "least_loaded"  # random | least_loaded | prefix (router_node/prefix.py)
    heartbeat_interval_s: float = 0.5
    missed_heartbeats: int = 3  # this many intervals without one: unhealthy
    stall_timeout_s: float = 30.0  # steps frozen while having work: unhealthy
    session_ttl_s: float = 600.0
    # New sessions go to the engine with the fewest open sessions + outstanding
    # requests ("open_sessions"), or by outstanding requests alone
    # ("outstanding": the pre-0.2 behaviour, kept for side-by-side benchmarks).
    session_placement: str = "open_sessions"
    # --policy prefix: block size (tokens) and blocks hashed per prompt, the
    # per-engine table bound (blocks), and the imbalance bound (a prefix hit is
    # refused when the engine has more than ABS more outstanding sequences than
    # the least-loaded one AND more than REL times as many)
    prefix_block_tokens: int = 16
    prefix_max_blocks: int = 256
    prefix_table_blocks: int = 65536
    prefix_imbalance_abs: int = 32
    prefix_imbalance_rel: float = 1.5
    # While requests are in flight, spin on a non-blocking poll for up to this
    # many µs before sleeping in poll: the engine's reply is then read without a
    # thread wake-up (tens of µs on an idle many-core machine). Costs a core
    # while spinning; 0 (default) never spins.
    busy_poll_us: int = 0
    failover: bool = True  # re-submit prompt + tokens so far to another engine
    max_failovers: int = 2  # per request
    # A request that was in flight on this many engines that died or hung is
    # ended (EngineDead naming it) instead of reaching another: one that kills
    # engines (a poison request) takes at most this many with it.
    max_engine_deaths: int = 2
    # Per-client bounds (issue 22: bounded memory per peer). client_hwm:
    # messages queued to one client before the head stops buffering for it
    # and cancels its requests (a client that does not read its socket).
    client_hwm: int = 4096
    max_inflight_per_client: int = 4096  # requests in flight at once
    max_sessions_per_client: int = 65536  # open sessions (session_id) at once
    query_cache_s: float = 0.1  # health/engines/stats answers are rebuilt at most this often
    max_prompt_tokens: int = 32768
    # n x (prompt + max_tokens) of one request (issue 34): the head keeps every
    # sample's tokens so far for failover; a request past it is refused at once
    # (BadRequest, field max_request_tokens). 0: no budget.
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    forget_after_s: float = 60.0  # drop a dead engine from the registry
    join_timeout_s: float = 30.0  # an engine that never acks the join ping is dropped
    # deadline of one corrective op (pause/resume/sleep/wake_up) sent to an
    # engine that missed a control op; it is re-checked and retried after it
    converge_timeout_s: float = 30.0
    # One weight update at a time: one open (begun, no commit / abort) longer
    # than this is aborted so the next trainer can update (leases end it sooner)
    weight_txn_timeout_s: float = 300.0
    # A client not heard from (pings, every ~0.5 s from trainer_bridge) for this
    # long loses what it holds: its pauses are resumed, its sleep woken, its
    # weight update aborted (router_node/leases.py).
    lease_s: float = 10.0
    seed: int = 0
    curve_dir: str | None = None
    metrics_port: int = -1  # Prometheus /metrics: -1 off, 0 any free port
    metrics_host: str = "127.0.0.1"
    # The cluster's join token (a 0600 file, made by launch.py): engines must
    # present it in Register, clients in state-changing control ops (peers
    # CURVE authenticated excepted). None: open to anyone who reaches the
    # sockets (logged as a warning at start).
    token_file: str | None = None
    # The cluster's vocabulary size: an engine registering another is refused
    # (field vocab_size). 0: the first registered engine's.
    vocab_size: int = 0
    # A head that has committed nothing (fresh, or restarted under running
    # engines) adopts the HIGHEST weight version the engines that join within
    # this many seconds of the first join bring; over a version above 0 it
    # routes nothing until the window ends (no rollback is ever served).
    adopt_window_s: float = 3.0


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    d = RouterConfig()
    ap = argparse.ArgumentParser("router_node", description="The rollout-bus head: router + control fan-out.")
    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        if isinstance(default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name in ("curve_dir", "token_file"):
            ap.add_argument(flag, default=None)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--ready-file", default=None, help="write the bound addresses (JSON) here once serving")
    a = ap.parse_args(argv)
    cfg = RouterConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(RouterConfig)})
    cfg.ready_file = a.ready_file  # type: ignore[attr-defined]
    return cfg
