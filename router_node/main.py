"""`python -m router_node`: the head process's entry point: configuration,
process hygiene (bus/runtime.py), the router, its /metrics exporter, signals
and the ready file launch.py waits for.

This module sits above router.py and metrics.py (both import nothing of it),
so neither needs the other at import time.
"""

from __future__ import annotations

import json
import os
import signal

import structlog
import zmq

from bus.auth import KeyFileError
from bus.profiler import start_from_env
from bus.runtime import become_child_process, cannot_start
from router_node.config import parse_args
from router_node.metrics import serve_metrics
from router_node.router import Router

log = structlog.get_logger("router_node")


def run_router_node(argv: list[str] | None = None) -> int:
    """Entry point: `python -m router_node …`."""
    cfg = parse_args(argv)
    become_child_process("rollout-bus router_node")
    start_from_env("head")  # benchmarks only: ROLLOUT_BUS_PROFILE_DIR
    try:
        router = Router(cfg)
    except KeyFileError as e:  # an unreadable or group-readable token / key file: say which
        log.error("head_refused_to_start", field=e.field, error=str(e))
        return 2
    except zmq.ZMQError as e:  # a port that is taken: one line, and no restart (it would be taken again)
        return cannot_start(log, "head_cannot_start", e)
    if cfg.metrics_port >= 0:
        try:
            port = serve_metrics(router, cfg.metrics_port, cfg.metrics_host)
        except OSError as e:
            return cannot_start(log, "head_cannot_start", OSError(f"--metrics-port {cfg.metrics_port}: {e}"))
        router.addresses["metrics"] = f"http://{cfg.metrics_host}:{port}/metrics"
    signal.signal(signal.SIGTERM, router.request_stop)
    signal.signal(signal.SIGINT, router.request_stop)
    ready = getattr(cfg, "ready_file", None)
    if ready:
        tmp = ready + ".tmp"
        with open(tmp, "w") as f:
            json.dump(router.addresses, f)
        os.replace(tmp, ready)
    return router.run()
