"""Engine node configuration (flags of `python -m engine_node`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from bus.validate import DEFAULT_MAX_REQUEST_TOKENS


@dataclasses.dataclass
class EngineNodeConfig:
    engine_id: str
    head_events: str  # the head's events ROUTER (register, heartbeats, acks)
    head_control: str  # the head's control PUB
    data_address: str  # bind: requests from the router / direct clients
    weight_address: str  # bind: zmq weight buckets
    backend: str = "torch"
    model: str = ""
    backend_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    heartbeat_interval_s: float = 0.5
    max_prompt_tokens: int = 32768
    # n x (prompt + max_tokens) of one request (issue 34): the node keeps every
    # sample's tokens for park / re-submission. 0: no budget.
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    drain_timeout_s: float = 5.0  # SIGTERM: how long running requests may finish
    register_timeout_s: float = 120.0  # give up when the head never answers
    advertise_host: str = ""  # how other nodes reach tcp://*:port binds
    curve_dir: str | None = None
    # The cluster seed (launch.py --seed): this node's sampling stream is
    # derived from it, the engine id and the incarnation (engine_node/seeding.py).
    seed: int = 0
    # A prepared weight update with no commit/abort decision for this long is
    # discarded (old weights and version kept); also the idle limit of an
    # update that stopped receiving.
    prepare_ttl_s: float = 60.0
    # The cluster's join token file (launch.py makes it; 0600). "" / None: none
    # (a head that requires one refuses this engine, field "token").
    token_file: str | None = None
    # The data socket admits the head alone; this also admits clients holding
    # the join token (benchmarks and tests that connect straight to one engine).
    direct_clients: bool = False


def parse_args(argv: list[str] | None = None) -> EngineNodeConfig:
    ap = argparse.ArgumentParser("engine_node", description="One rollout-bus engine node.")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--head-events", required=True)
    ap.add_argument("--head-control", required=True)
    ap.add_argument("--data-address", required=True)
    ap.add_argument("--weight-address", required=True)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--model", default="")
    ap.add_argument("--backend-options", default="{}", help="JSON object passed to the backend factory")
    ap.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    ap.add_argument("--max-prompt-tokens", type=int, default=32768)
    ap.add_argument(
        "--max-request-tokens",
        type=int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help="n x (prompt + max_tokens) one request may ask for (0: no budget)",
    )
    ap.add_argument("--drain-timeout-s", type=float, default=5.0)
    ap.add_argument("--register-timeout-s", type=float, default=120.0)
    ap.add_argument(
        "--advertise-host",
        default=os.environ.get("ROLLOUT_BUS_HOST", ""),
        help="host name the head should use for this node's TCP sockets (default: as bound; host name for 0.0.0.0)",
    )
    ap.add_argument("--curve-dir", default=None)
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="cluster seed: unseeded sampling streams derive from it, the engine id and the incarnation",
    )
    ap.add_argument(
        "--prepare-ttl-s",
        type=float,
        default=60.0,
        help="discard a prepared weight update that gets no commit/abort decision within this many seconds",
    )
    ap.add_argument(
        "--token-file",
        default=os.environ.get("ROLLOUT_BUS_TOKEN_FILE") or None,
        help="the cluster's join token (a 0600 file made by launch.py; default $ROLLOUT_BUS_TOKEN_FILE)",
    )
    ap.add_argument(
        "--direct-clients",
        action="store_true",
        help="also admit clients (join token or client key) on the data socket, besides the head (benchmarks, tests)",
    )
    a = ap.parse_args(argv)
    return EngineNodeConfig(
        engine_id=a.engine_id,
        head_events=a.head_events,
        head_control=a.head_control,
        data_address=a.data_address,
        weight_address=a.weight_address,
        backend=a.backend,
        model=a.model,
        backend_options=json.loads(a.backend_options),
        heartbeat_interval_s=a.heartbeat_interval_s,
        max_prompt_tokens=a.max_prompt_tokens,
        max_request_tokens=a.max_request_tokens,
        drain_timeout_s=a.drain_timeout_s,
        register_timeout_s=a.register_timeout_s,
        advertise_host=a.advertise_host,
        curve_dir=a.curve_dir,
        seed=a.seed,
        prepare_ttl_s=a.prepare_ttl_s,
        token_file=a.token_file,
        direct_clients=a.direct_clients,
    )
