"""The local launch: the head and engine nodes as child processes of this
launcher (launch.py without --ray), from their argv to readiness and serving.

`run_local` owns the order: CURVE keys, the join token, the model, the head
(waited for through its ready file), the engines, readiness (every engine this
launcher started healthy at the head), the table, then serving until the
supervisor stops. The caller owns the supervisor and the run folder (and ends
both); everything here only adds children to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time

import structlog

from bus.auth import KeyDir, KeyFileError
from bus.errors import BadRequest
from bus.runtime import FATAL_FILE_ENV
from engine_node.cpu_placement import GPU_SLOT_ENV
from engine_node.tiny_model import ensure_tiny_model
from launcher.config import (
    DEFAULT_KEY_DIR,
    advertise_host,
    engine_backend_options,
    free_port,
    gpu_groups,
    head_passthrough_argv,
    pick_backend,
    taken_port,
)
from launcher.output import print_table, run_demo
from launcher.supervisor import HERE, Child, State, Supervisor
from launcher.token import JoinToken
from trainer_bridge import Client

log = structlog.get_logger("launch")

HEAD_READY_TIMEOUT_S = 30.0  # the head binds and writes its ready file well within this


@dataclasses.dataclass
class HeadAddresses:
    """The head's three sockets, as engines and trainers reach them."""

    front: str
    events: str
    control: str
    metrics: str | None = None  # the head's /metrics URL (--metrics-port), as it bound it


def run_local(a: argparse.Namespace, sup: Supervisor, run_dir: str) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    curve_dir = ensure_curve_keys(a)
    token = JoinToken(a, run_dir)
    backend = pick_backend(a.backend)
    n_engines = a.engines if a.engines is not None else (0 if a.head else None)
    try:  # before anything starts: a wrong --gpus / mask starts nothing
        groups = gpu_groups(a, backend, n_engines)
    except BadRequest as e:
        print(f"launch.py: {e}", file=sys.stderr, flush=True)
        return 2
    model = resolve_model(a, backend)
    if a.join:
        head = joined_head(a.join)
    else:
        started = start_head(a, sup, run_dir, env, curve_dir, token)
        if started is None:
            return 1
        head = started
        token.publish(head.front)
    prefix = a.engine_id_prefix or (f"{socket.gethostname()}-e" if a.join else "e")
    start_engines(a, sup, run_dir, env, head, groups, prefix, backend, model, curve_dir, token)
    client = Client(
        head.front,
        timeout_s=120,
        control_timeout_s=30,
        curve_dir=curve_dir,
        client_key=a.client_key,
        token_file=token.path or "",
    )
    try:
        if not wait_ready(a, sup, client, prefix, want=len(groups)):  # 0 engines wanted for a bare head
            return 1
        if sup.state is not State.RUNNING:
            return sup.exit_code
        print_table(client.engines(), head.front, backend, curve_dir=curve_dir, client_key=a.client_key)
        if head.metrics:
            print(f"metrics: {head.metrics}", flush=True)
        if (note := token.note()) is not None:
            print(note, flush=True)
        if a.demo:
            run_demo(client)
        if a.once:
            return 0
        print("serving; Ctrl-C to stop", flush=True)
        while sup.state is State.RUNNING:
            sup.check()
            time.sleep(0.2)
        return sup.exit_code
    finally:
        client.close()


def ensure_curve_keys(a: argparse.Namespace) -> str | None:
    """--curve: the key folder, made here when missing (the head's node only)."""
    if not a.curve:
        return None
    keys = KeyDir(a.curve_dir or DEFAULT_KEY_DIR)
    curve_dir = keys.root
    if not keys.exists():
        if a.join:
            raise SystemExit(f"--curve: no keys in {curve_dir}; copy the head's key folder here")
        try:
            keys.init()
        except KeyFileError as e:  # a read-only folder: say which, not a traceback
            raise SystemExit(f"launch.py --curve: {e}") from None
        log.info("curve_keys_made", curve_dir=curve_dir)
    return curve_dir


def resolve_model(a: argparse.Namespace, backend: str) -> str:
    """--model, or the tiny model built into the cache for the torch backend."""
    if backend == "torch" and not a.model:
        return ensure_tiny_model()
    if ":" in backend or backend == "null":  # out-of-tree, or no model at all
        return a.model or ("null" if backend == "null" else "")
    if not a.model:
        raise SystemExit(f"--model is required with the {backend} backend")
    return a.model


def joined_head(join: str) -> HeadAddresses:
    """--join tcp://HEAD:PORT: events and control are the next two ports."""
    head_host, head_port = join.removeprefix("tcp://").rsplit(":", 1)
    return HeadAddresses(join, f"tcp://{head_host}:{int(head_port) + 1}", f"tcp://{head_host}:{int(head_port) + 2}")


def start_head(
    a: argparse.Namespace, sup: Supervisor, run_dir: str, env: dict[str, str], curve_dir: str | None, token: JoinToken
) -> HeadAddresses | None:
    """Start the head and wait for its ready file; None when it never got ready
    (logged) or the launcher is stopping."""
    if a.port and (taken := taken_port(a.host, a.port)) is not None:
        sup.stop_fatal(
            f"port {taken} on {a.host} is taken (the head binds --port {a.port} and the next two); "
            "choose another with --port (0: any free ports)"
        )
        return None
    port = a.port or free_port(a.host)
    ev_port, ctl_port = (port + 1, port + 2) if a.port else (free_port(a.host), free_port(a.host))
    front = f"tcp://{a.host}:{port}"
    events, control = f"tcp://{a.host}:{ev_port}", f"tcp://{a.host}:{ctl_port}"
    ready_file = os.path.join(run_dir, "head.json")
    head_argv = [
        sys.executable, "-m", "router_node",
        "--frontend", front, "--events", events, "--control", control,
        "--policy", a.policy, "--heartbeat-interval-s", str(a.heartbeat_interval_s),
        "--session-placement", a.session_placement,
        "--ready-file", ready_file, "--metrics-port", str(a.metrics_port), "--metrics-host", a.host,
    ]  # fmt: skip
    if curve_dir:
        head_argv += ["--curve-dir", curve_dir]
    if a.lease_s is not None:
        head_argv += ["--lease-s", str(a.lease_s)]
    head_argv += token.argv()
    head_argv += head_passthrough_argv(a)
    sup.add(Child("head", head_argv, dict(env, **{FATAL_FILE_ENV: os.path.join(run_dir, "head.fatal")})))
    deadline = time.monotonic() + HEAD_READY_TIMEOUT_S
    while not os.path.exists(ready_file):
        sup.check()
        if sup.state is State.STOPPING:  # stopped, or the head cannot start (sup.fatal says why)
            return None
        if time.monotonic() > deadline:
            log.error("head_not_ready", timeout_s=HEAD_READY_TIMEOUT_S)
            return None
        time.sleep(0.05)
    if a.host == "0.0.0.0":  # engines and trainers reach the head by a name
        adv = advertise_host(a)
        events, control = events.replace("0.0.0.0", adv), control.replace("0.0.0.0", adv)
        front = front.replace("0.0.0.0", adv)
    with open(ready_file) as f:
        metrics = json.load(f).get("metrics")
    return HeadAddresses(front, events, control, metrics)


def start_engines(
    a: argparse.Namespace,
    sup: Supervisor,
    run_dir: str,
    env: dict[str, str],
    head: HeadAddresses,
    groups: list[str | None],
    prefix: str,
    backend: str,
    model: str,
    curve_dir: str | None,
    token: JoinToken,
) -> None:
    """One engine child per GPU group (None: no GPUs), ids PREFIX0, PREFIX1…"""
    multi_node = a.head or a.join is not None
    opts_d = engine_backend_options(a, backend)
    if backend == "torch" and groups:
        # torch's OpenMP threads spin-wait: engines sharing the cores must
        # split them, or N engines × all cores thrash (seconds per step).
        opts_d.setdefault("threads", max(1, (os.cpu_count() or 1) // len(groups)))
    opts = json.dumps(opts_d)
    for i, gpus in enumerate(groups):
        eid = f"{prefix}{i}"
        if multi_node:  # reachable from other nodes: TCP on --host, any free port
            data, weights = f"tcp://{a.host}:*", f"tcp://{a.host}:*"
        else:
            data, weights = f"ipc://{run_dir}/{eid}.data", f"ipc://{run_dir}/{eid}.weights"
        eargv = [
            sys.executable, "-m", "engine_node", "--engine-id", eid,
            "--head-events", head.events, "--head-control", head.control,
            "--data-address", data, "--weight-address", weights,
            "--backend", backend, "--model", model, "--backend-options", opts,
            "--heartbeat-interval-s", str(a.heartbeat_interval_s), "--seed", str(a.seed),
        ]  # fmt: skip
        if multi_node:
            eargv += ["--advertise-host", advertise_host(a)]
        if curve_dir:
            eargv += ["--curve-dir", curve_dir]
        eargv += token.argv()
        eenv = dict(env, **{FATAL_FILE_ENV: os.path.join(run_dir, f"{eid}.fatal")})
        if gpus is not None:
            eenv["CUDA_VISIBLE_DEVICES"] = gpus
            eenv[GPU_SLOT_ENV] = str(i)  # the CPU-pinning slot; a GPU-<uuid> mask has no number to read
        sup.add(Child(eid, eargv, eenv))


def wait_ready(a: argparse.Namespace, sup: Supervisor, client: Client, prefix: str, want: int) -> bool:
    """Poll the head until `want` engines of this launcher (ids PREFIX…) are
    healthy, or the supervisor stops (True: the caller checks which); False
    past --ready-timeout-s (logged)."""
    deadline = time.monotonic() + a.ready_timeout_s
    while sup.state is State.RUNNING:
        sup.check()
        if gone := sup.gave_up():  # it will not be healthy: no point waiting for the deadline
            sup.stop_fatal(f"engine {gone[0].name} {gone[0].gave_up}")
            return True
        try:
            h = client.health(timeout_s=5)
        except Exception as e:  # not up yet, or restarting: readiness polls again until the deadline
            log.debug("health_not_yet", error=repr(e))
            h = None
        mine = [e for e in (h or {}).get("engines", {}).values() if e["engine_id"].startswith(prefix)]
        if h and sum(e["healthy"] for e in mine) >= want:
            return True
        if time.monotonic() > deadline:
            log.error("cluster_not_ready", ready_timeout_s=a.ready_timeout_s, health=h)
            return False
        time.sleep(0.2)
    return True
