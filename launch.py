"""One command that launches rollout-bus: a head and engine nodes.

    python launch.py                       # local default: head + 2 engines
    python launch.py --demo                # … and run a short client session
    python launch.py --head --engines 0    # multi-node: the head on this node
    python launch.py --join tcp://HEAD:5555 --engines 4   # engines on another node
    python launch.py keys init | list | add-client NAME [--public FILE] | remove-client NAME
                                           # the CURVE key folder of --curve (README, Security)

Backend: `auto` picks vLLM when it is installed and a GPU is visible, else the
torch backend on a tiny random-weight model built into a cache dir (no hub).

The launcher supervises its children with psutil: a crashed engine or head
is restarted (bounded by --max-restarts each; the head on the same ports, so
live engines re-register with it and clients reconnect on their own), a head
past its restarts stops everything, and
Ctrl-C / SIGTERM sends SIGTERM to the whole tree, waits --grace-s, then
SIGKILLs what is left. Children also die with the launcher (PDEATHSIG), so
no process outlives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil
import structlog

from router_node.policies import SESSION_PLACEMENTS

log = structlog.get_logger("launch")
HERE = os.path.dirname(os.path.abspath(__file__))


class State(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"


@dataclasses.dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=HERE)
        self.started_at = time.monotonic()


class Supervisor:
    def __init__(self, max_restarts: int, grace_s: float) -> None:
        self.children: dict[str, Child] = {}
        self.max_restarts = max_restarts
        self.grace_s = grace_s
        self.state = State.RUNNING
        self.exit_code = 0

    def request_stop(self, *_: Any) -> None:
        """Signal handler: only flips the state; `watch` does the work."""
        self.state = State.STOPPING

    def add(self, child: Child) -> Child:
        self.children[child.name] = child
        child.start()
        return child

    def check(self) -> None:
        """Restart crashed children (bounded, --max-restarts each). The head
        restarts with the same argv, so on the same ports: live engines see
        its Rejoin and register again within a second or two (their weight
        versions with them), clients reconnect by themselves. A head past its
        restarts is fatal."""
        for c in self.children.values():
            rc = c.proc.poll() if c.proc else None
            if rc is None or self.state is State.STOPPING:
                continue
            if c.restarts >= self.max_restarts:
                if c.name == "head":
                    log.error("head_died", rc=rc, restarts=c.restarts, max_restarts=self.max_restarts)
                    self.exit_code = 1
                    self.state = State.STOPPING
                    return
                log.error("engine_gave_up", engine=c.name, rc=rc, max_restarts=self.max_restarts)
                c.proc = None
                continue
            c.restarts += 1
            log.warning(
                "head_restart" if c.name == "head" else "engine_restart", child=c.name, rc=rc, restart=c.restarts
            )
            c.start()

    def alive(self) -> list[psutil.Process]:
        procs: list[psutil.Process] = []
        for c in self.children.values():
            if c.proc is None:
                continue
            try:
                p = psutil.Process(c.proc.pid)
                procs.append(p)
                procs.extend(p.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return procs

    def shutdown(self) -> None:
        """SIGTERM the whole tree, wait grace_s, SIGKILL the rest (bus.proctree)."""
        from bus.proctree import terminate_tree

        killed = terminate_tree([c.proc for c in self.children.values() if c.proc is not None], self.grace_s)
        if killed:
            log.warning("killed_after_grace", pids=killed, grace_s=self.grace_s)


def pick_backend(name: str) -> str:
    if name != "auto":
        return name
    if importlib.util.find_spec("vllm") is not None:
        try:
            import torch

            if torch.cuda.is_available():
                return "vllm"
        except Exception:
            pass
    return "torch"


def advertise_host(a: argparse.Namespace) -> str:
    """How other nodes reach this one: --advertise-host, else the bind host
    unless it is a wildcard, else the host name."""
    if a.advertise_host:
        return a.advertise_host
    return a.host if a.host not in ("0.0.0.0", "*") else socket.gethostname()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser("launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engines", type=int, default=None, help="engine nodes on this machine (default: 2, or GPUs // tp with vLLM)"
    )
    ap.add_argument("--backend", default="auto", help="auto | torch | vllm | null | module:factory of an out-of-tree backend")
    ap.add_argument("--model", default=None, help="model folder (default: a tiny random model built into the cache)")
    ap.add_argument(
        "--host", default="127.0.0.1", help="address this node binds (0.0.0.0 for multi-node: loopback only by default)"
    )
    ap.add_argument(
        "--port", type=int, default=5555, help="frontend port; events = port+1, control = port+2; 0: any free"
    )
    ap.add_argument(
        "--advertise-host", default=None, help="how other nodes reach this one (default: hostname for multi-node)"
    )
    ap.add_argument(
        "--policy",
        default="least_loaded",
        choices=["least_loaded", "random", "prefix"],
        help="placement of requests without a session; prefix: the engine most likely to hold the prompt's prefix",
    )
    ap.add_argument(
        "--session-placement",
        default="open_sessions",
        choices=sorted(SESSION_PLACEMENTS),
        help="which engine a new multi-turn session goes to (the head's --session-placement)",
    )
    ap.add_argument(
        "--head", action="store_true", help="multi-node: run the head here (engines here: --engines, default 0)"
    )
    ap.add_argument(
        "--join", default=None, metavar="tcp://HEAD:PORT", help="multi-node: run engines here for that head"
    )
    ap.add_argument(
        "--engine-id-prefix", default=None, help="engine ids are PREFIX0, PREFIX1… (default: host name when joining)"
    )
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpus", default=None, help="comma-separated GPU ids for vLLM engines (default: all visible)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--backend-options", default="{}", help="extra JSON options for the backend factory")
    ap.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    ap.add_argument(
        "--curve",
        action="store_true",
        help="security on: CURVE on every TCP socket, engines and clients checked against allow-lists (--curve-dir)",
    )
    ap.add_argument(
        "--curve-dir",
        default=None,
        help=f"key folder (default {DEFAULT_KEY_DIR}): made by the head when missing (`launch.py keys`); "
        "copy it, without head.key_secret, to joining nodes",
    )
    ap.add_argument(
        "--client-key", default=None, help="the launcher's own client key (readiness, demo): a name in clients/"
    )
    ap.add_argument(
        "--token-file",
        default=None,
        help="the cluster's join token (0600). Head: use this file instead of making a new token in the run "
        "folder. --join: the head's token (default $ROLLOUT_BUS_TOKEN_FILE, else the file the head's launcher "
        "published for that address on this host; copy it to other nodes)",
    )
    ap.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics of the head (-1: off)")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="cluster seed (default 0): every engine's stream for unseeded sampling is derived from it, the "
        "engine id and the engine's incarnation, so no two engines (nor two lives of one) draw the same samples; "
        "seeded requests (params seed) are the same on every engine",
    )
    ap.add_argument(
        "--lease-s",
        type=float,
        default=None,
        help="the head's --lease-s: a client silent this long loses its pause, sleep and weight update (default 10)",
    )
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM → SIGKILL grace on shutdown")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    ap.add_argument("--demo", action="store_true", help="run a short client session once the cluster is ready")
    ap.add_argument(
        "--once", action="store_true", help="exit after readiness (and the demo) instead of serving until Ctrl-C"
    )
    ap.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="every process's log level, the head's and engines' too (default: $ROLLOUT_BUS_LOG_LEVEL, else "
        "WARNING: a quiet start, the table first); INFO shows the event log (JSON lines when not on a terminal)",
    )
    ap.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS|local",
        help="place the head and engines as Ray actors on a Ray cluster (auto: the running one, local: start one "
        "here; needs the ray extra). Binds each node's IP unless --host is given (local: --host)",
    )
    return ap.parse_args(argv)


def engine_backend_options(a: argparse.Namespace, backend: str) -> dict[str, Any]:
    opts = json.loads(a.backend_options)
    if backend == "vllm":
        opts.setdefault("tp", a.tp)
        opts.setdefault("gpu_memory_utilization", a.gpu_memory_utilization)
    if a.max_model_len:
        opts.setdefault("max_model_len", a.max_model_len)
    return opts


def gpu_groups(a: argparse.Namespace, backend: str, n_engines: int | None) -> list[str | None]:
    if backend != "vllm":
        return [None] * (2 if n_engines is None else n_engines)
    if a.gpus:
        gpus = a.gpus.split(",")
    else:
        import torch

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    n = len(gpus) // a.tp if n_engines is None else n_engines
    if n * a.tp > len(gpus):
        raise SystemExit(f"{n} engine(s) × tp={a.tp} needs {n * a.tp} GPUs, have {gpus}")
    return [",".join(gpus[i * a.tp : (i + 1) * a.tp]) for i in range(n)]


DEFAULT_KEY_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rollout-bus", "curve")


def keys_main(argv: list[str]) -> int:
    """`launch.py keys …`: make and list the key folder of --curve (bus/auth.py)."""
    from bus.auth import KeyDir, KeyFileError, write_keypair

    ap = argparse.ArgumentParser("launch.py keys", description="The CURVE key folder of a secured cluster.")
    ap.add_argument("--curve-dir", default=DEFAULT_KEY_DIR, help=f"the key folder (default {DEFAULT_KEY_DIR})")
    # --curve-dir before or after the command (`keys init --curve-dir X`, as
    # KeyFileError suggests): SUPPRESS keeps the main parser's value when absent.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--curve-dir", default=argparse.SUPPRESS, help="the key folder")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser(
        "init", parents=[common], help="make the head's keys, the engine credential and the default client key"
    )
    sub.add_parser("list", parents=[common], help="every key in the folder: role, name, public key, secret here?")
    add = sub.add_parser(
        "add-client", parents=[common], help="allow a client (trainer): make its keypair, or import --public FILE"
    )
    add.add_argument("name")
    add.add_argument("--public", default=None, help="a public key file the trainer made (then no secret is made)")
    rm = sub.add_parser("remove-client", parents=[common], help="take a client off the allow-list")
    rm.add_argument("name")
    kp = sub.add_parser(
        "keypair", parents=[common], help="on a trainer's machine: make its own keypair (NAME.key to send to the head)"
    )
    kp.add_argument("name")
    kp.add_argument("--out", default=".", help="folder for NAME.key and NAME.key_secret (0600)")
    a = ap.parse_args(argv)
    keys = KeyDir(a.curve_dir)
    try:
        if a.cmd == "init":
            keys.init()
            print(f"key folder: {keys.root}")
        elif a.cmd == "add-client":
            path = keys.add_client(a.name, a.public)
            if a.public:
                print(f"client {a.name!r} allowed: {path}")
            else:
                print(f"client {a.name!r} allowed; give its secret to that trainer: {path}")
                print(f"  Client(address, curve_dir=<folder holding head.key>, client_key={path!r})")
        elif a.cmd == "keypair":
            pub, sec = write_keypair(a.out, a.name)
            print(f"keep {sec} here (Client(..., client_key={sec!r}));")
            print(f"send {pub} to the head's operator: launch.py keys add-client {a.name} --public {a.name}.key")
            return 0
        elif a.cmd == "remove-client":
            for p in keys.remove_client(a.name):
                print(f"removed {p}")
        if a.cmd in ("init", "list"):
            rows = [("role", "name", "public key (z85)", "secret here", "file")]
            rows += [(k.role, k.name, k.public, "yes" if k.has_secret else "no", k.path) for k in keys.listing()]
            widths = [max(len(r[i]) for r in rows) for i in range(5)]
            for r in rows:
                print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    except KeyFileError as e:
        print(f"launch.py keys {a.cmd}: {e}", file=sys.stderr)
        return 2
    if a.cmd.endswith("-client"):
        print("a running head (and engines sharing this folder) re-read the allow-lists within 2 s", flush=True)
    return 0


class JoinToken:
    """The cluster's join token (bus/auth.py), kept apart from the supervisor.

    Head: a new random token in a 0600 file of the run folder (or --token-file),
    given to the head and the local engines as --token-file; once the head
    serves, a copy is published where clients on this host look for it
    (bus.auth.token_path_for(frontend)), so `Client(address)` finds it, and
    removed when the launcher exits. --join: the head's token, read from
    --token-file / $ROLLOUT_BUS_TOKEN_FILE / the published file."""

    def __init__(self, a: argparse.Namespace, run_dir: str) -> None:
        from bus.auth import KeyFileError, find_token, new_token, read_token, write_token

        self.published: str | None = None
        self._token = ""
        try:
            if a.join:
                found = find_token(a.join, a.token_file)
                self.path = found[1] if found else None
                if found is None and not a.curve:
                    log.warning(
                        "join_without_token",
                        hint="no --token-file, no $ROLLOUT_BUS_TOKEN_FILE and no token published for "
                        f"{a.join} on this host: a head that requires its join token refuses these engines",
                    )
            elif a.token_file:
                self._token = read_token(a.token_file)
                self.path = a.token_file
            else:
                self._token = new_token()
                self.path = write_token(os.path.join(run_dir, "cluster.token"), self._token)
        except KeyFileError as e:
            raise SystemExit(f"launch.py: {e}") from None

    def argv(self) -> list[str]:
        return ["--token-file", self.path] if self.path else []

    def publish(self, front: str) -> None:
        """Head: the copy clients on this host find by address; one line says where."""
        import atexit

        from bus.auth import token_path_for, write_token

        path = token_path_for(front)
        if not self._token or path is None:
            return
        self.published = write_token(path, self._token)
        atexit.register(self.unpublish)
        print(
            f"join token: {self.path} (published for {front} at {self.published}: clients on this host find it; "
            f"engines on other nodes: launch.py --join {front} --token-file <a copy>)",
            flush=True,
        )

    def unpublish(self) -> None:
        from bus.auth import read_token

        path, self.published = self.published, None
        try:
            if path and read_token(path) == self._token:  # not a newer launcher's
                os.remove(path)
        except (OSError, Exception):
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    a = parse_args(argv)
    from bus.runtime import configure_logging, set_title

    # One level for every process: children read ROLLOUT_BUS_LOG_LEVEL (bus.runtime).
    a.log_level = a.log_level or os.environ.get("ROLLOUT_BUS_LOG_LEVEL", "WARNING").upper()
    os.environ["ROLLOUT_BUS_LOG_LEVEL"] = a.log_level
    configure_logging(a.log_level)
    set_title("rollout-bus launch")
    if a.ray:
        return run_on_ray(a)
    sup = Supervisor(a.max_restarts, a.grace_s)
    signal.signal(signal.SIGINT, sup.request_stop)
    signal.signal(signal.SIGTERM, sup.request_stop)
    remove_stale_run_dirs()
    run_dir = tempfile.mkdtemp(prefix="rbus-")
    mark_run_dir(run_dir)
    try:
        return _run(a, sup, run_dir)
    finally:
        sup.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        log.info("launch_stopped", leftover=len(sup.alive()))


_RUN_OWNER = "launcher.pid"  # in a run folder: "<pid> <create time>" of the launcher that made it


def mark_run_dir(run_dir: str) -> None:
    """Record which launcher owns `run_dir`, so a later launch can tell that a
    folder left by a kill -9 belongs to a dead process (remove_stale_run_dirs)."""
    me = psutil.Process()
    with open(os.path.join(run_dir, _RUN_OWNER), "w") as f:
        f.write(f"{me.pid} {me.create_time()}")


def remove_stale_run_dirs(tmp: str | None = None) -> list[str]:
    """Remove the /tmp/rbus-* run folders of launchers that are gone (killed
    with -9: their `finally` never ran). Only folders of this user that carry
    a launcher.pid whose process is dead (or whose pid was reused: another
    create time) are touched. Returns the folders removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp):
        d = os.path.join(tmp, name)
        if not name.startswith("rbus-") or not os.path.isdir(d) or os.path.islink(d):
            continue
        try:
            if os.stat(d).st_uid != os.getuid():
                continue
            with open(os.path.join(d, _RUN_OWNER)) as f:
                pid_s, created_s = f.read().split()
            pid, created = int(pid_s), float(created_s)
        except (OSError, ValueError):
            continue  # not a launcher's run folder (or not ours): leave it
        try:
            alive = abs(psutil.Process(pid).create_time() - created) < 1e-3
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            alive = False
        except psutil.Error:
            alive = True  # cannot tell: keep it
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
            log.info("stale_run_dir_removed", path=d, pid=pid)
    return removed


def _run(a: argparse.Namespace, sup: Supervisor, run_dir: str) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = HERE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    multi_node = a.head or a.join is not None
    curve_dir = None
    if a.curve:
        from bus.auth import KeyDir

        keys = KeyDir(a.curve_dir or DEFAULT_KEY_DIR)
        curve_dir = keys.root
        if not keys.exists():
            if a.join:
                raise SystemExit(f"--curve: no keys in {curve_dir}; copy the head's key folder here")
            from bus.auth import KeyFileError

            try:
                keys.init()
            except KeyFileError as e:  # a read-only folder: say which, not a traceback
                raise SystemExit(f"launch.py --curve: {e}") from None
            log.info("curve_keys_made", curve_dir=curve_dir)
    token = JoinToken(a, run_dir)
    backend = pick_backend(a.backend)
    model = a.model
    if backend == "torch" and not model:
        from engine_node.tiny_model import ensure_tiny_model

        model = ensure_tiny_model()
    elif ":" in backend or backend == "null":  # out-of-tree, or no model at all
        model = model or ("null" if backend == "null" else "")
    elif not model:
        raise SystemExit(f"--model is required with the {backend} backend")

    # ---- the head
    if a.join:
        head_host, head_port = a.join.removeprefix("tcp://").rsplit(":", 1)
        front = a.join
        events, control = f"tcp://{head_host}:{int(head_port) + 1}", f"tcp://{head_host}:{int(head_port) + 2}"
    else:
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
        sup.add(Child("head", head_argv, env))
        deadline = time.monotonic() + 30
        while not os.path.exists(ready_file):
            sup.check()
            if sup.state is State.STOPPING or time.monotonic() > deadline:
                log.error("head_not_ready", timeout_s=30)
                return 1
            time.sleep(0.05)
        if a.host == "0.0.0.0":  # engines and trainers reach the head by a name
            adv = advertise_host(a)
            events, control = events.replace("0.0.0.0", adv), control.replace("0.0.0.0", adv)
            front = front.replace("0.0.0.0", adv)
        token.publish(front)

    # ---- the engines
    n_engines = a.engines if a.engines is not None else (0 if a.head else None)
    groups = gpu_groups(a, backend, n_engines)
    prefix = a.engine_id_prefix or (f"{socket.gethostname()}-e" if a.join else "e")
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
            "--head-events", events, "--head-control", control,
            "--data-address", data, "--weight-address", weights,
            "--backend", backend, "--model", model, "--backend-options", opts,
            "--heartbeat-interval-s", str(a.heartbeat_interval_s), "--seed", str(a.seed),
        ]  # fmt: skip
        if multi_node:
            eargv += ["--advertise-host", advertise_host(a)]
        if curve_dir:
            eargv += ["--curve-dir", curve_dir]
        eargv += token.argv()
        eenv = dict(env)
        if gpus is not None:
            eenv["CUDA_VISIBLE_DEVICES"] = gpus
        sup.add(Child(eid, eargv, eenv))

    # ---- readiness
    from trainer_bridge import Client

    client = Client(
        front,
        timeout_s=120,
        control_timeout_s=30,
        curve_dir=curve_dir,
        client_key=a.client_key,
        token_file=token.path or "",
    )
    try:
        want = len(groups)  # the engines this launcher started (0 for a bare head)
        deadline = time.monotonic() + a.ready_timeout_s
        while sup.state is State.RUNNING:
            sup.check()
            try:
                h = client.health(timeout_s=5)
            except Exception:
                h = None
            mine = [e for e in (h or {}).get("engines", {}).values() if e["engine_id"].startswith(prefix)]
            if h and sum(e["healthy"] for e in mine) >= want:
                break
            if time.monotonic() > deadline:
                log.error("cluster_not_ready", ready_timeout_s=a.ready_timeout_s, health=h)
                return 1
            time.sleep(0.2)
        if sup.state is not State.RUNNING:
            return sup.exit_code
        print_table(client.engines(), front, backend, curve_dir=curve_dir, client_key=a.client_key)
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


def client_line(front: str, curve_dir: str | None = None, client_key: str | None = None) -> str:
    """The exact line a trainer writes to reach this cluster (CURVE keys included)."""
    if not curve_dir:
        return f"trainer_bridge.Client({front!r})"
    key = f", client_key={client_key!r}" if client_key else ""  # default: the key folder's "default" client
    return f"trainer_bridge.Client({front!r}, curve_dir={curve_dir!r}{key})"


def print_table(
    engines: list[dict[str, Any]],
    front: str,
    backend: str,
    *,
    curve_dir: str | None = None,
    client_key: str | None = None,
) -> None:
    rows = [("engine", "address", "backend", "model", "state")]
    for e in sorted(engines, key=lambda e: e["engine_id"]):
        model = e["model"] if len(e["model"]) <= 48 else "…" + e["model"][-47:]
        rows.append((e["engine_id"], e["data_address"], e["backend"], model, e["state"]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
    print(line(rows[0]), flush=False)
    print("  ".join("-" * w for w in widths))
    for r in rows[1:]:
        print(line(r))
    print(f"\ntrainer connects to: {front}   ({client_line(front, curve_dir, client_key)})", flush=True)


def run_demo(client: Any) -> None:
    import random

    rng = random.Random(0)
    vocab = min(e["vocab_size"] for e in client.engines())
    before = {e["engine_id"]: e["tokens_out"] for e in client.health()["engines"].values()}
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(4, 16))] for _ in range(32)]
    t0 = time.perf_counter()
    results = client.generate(prompts, {"max_tokens": 16, "temperature": 0.8, "seed": 1})
    dt = time.perf_counter() - t0
    ntok = sum(len(r.token_ids) for r in results)
    print(f"\ndemo: {len(prompts)} requests, {ntok} tokens in {dt:.2f}s = {ntok / dt:.0f} tokens/s")
    chunks = list(client.stream(prompts[0], {"max_tokens": 8, "temperature": 0}))
    print(f"demo: streamed {len(chunks)} chunks: {[c.token_ids[0] for c in chunks if c.token_ids]}")
    s = client.sample(prompts[1], 4, {"max_tokens": 8, "temperature": 1.0, "seed": 7})
    print(f"demo: sample(num_samples=4) stop reasons {[q.stop_reason for q in s.sequences]}")
    paused = client.pause("abort")
    client.resume()
    print(f"demo: pause(abort)/resume on {sorted(paused)}")
    time.sleep(1.2)  # one heartbeat brings the token counters
    after = {e["engine_id"]: e["tokens_out"] for e in client.health()["engines"].values()}
    spread = {k: after[k] - before.get(k, 0) for k in sorted(after)}
    print(f"demo: tokens per engine {spread}", flush=True)


def run_on_ray(a: argparse.Namespace) -> int:
    """--ray: the head and engines as Ray actors (trainer_bridge/ray_cluster.py).
    Ray places, restarts (engine actors, up to --max-restarts) and tears down;
    ZeroMQ carries requests and control as with any launch."""
    try:
        import ray
    except ImportError:
        print(
            'launch.py --ray needs the ray extra, which is not installed: pip install -e ".[ray]" (ray==2.60.0)',
            file=sys.stderr,
        )
        return 2

    from trainer_bridge.ray_cluster import RayCluster

    local = a.ray == "local"
    host = a.host if local or a.host != "127.0.0.1" else None  # None: each node's IP
    if local:  # rollout-bus moves nothing through Ray's object store: keep it small
        loopback = "127.0.0.1" if a.host == "127.0.0.1" else None  # no traffic off this machine
        ray.init(include_dashboard=False, object_store_memory=128 * 1024 * 1024, _node_ip_address=loopback)
    else:
        ray.init(address=a.ray)
    stop: list[int] = []
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        backend = a.backend if a.backend != "auto" else ("vllm" if gpus else "torch")
        n = a.engines if a.engines is not None else (gpus // a.tp if backend == "vllm" else 2)
        if a.curve:  # bus.auth's per-engine keys are not placed onto Ray nodes yet
            raise SystemExit(
                "--ray with --curve is not supported yet: place the key folder yourself and use RayCluster"
            )
        curve_dir = None
        with RayCluster.start(
            n, tp=a.tp, backend=backend, model=a.model, host=host, port=a.port,
            backend_options=engine_backend_options(a, backend), heartbeat_interval_s=a.heartbeat_interval_s,
            seed=a.seed, policy=a.policy, curve_dir=curve_dir, max_restarts=a.max_restarts,
            ready_timeout_s=a.ready_timeout_s,
            engine_id_prefix=a.engine_id_prefix or "e",
        ) as rc:  # fmt: skip
            client = rc.client(timeout_s=120, control_timeout_s=30)
            print_table(client.engines(), rc.frontend, backend)
            print(f"on Ray ({a.ray}): {n} engine actor(s), Ray restarts each up to {a.max_restarts} times", flush=True)
            if a.demo:
                run_demo(client)
            if a.once:
                return 0
            print("serving; Ctrl-C to stop", flush=True)
            while not stop:  # Ray restarts engines; a dead head stops everything, as in _run
                if "head" in rc.dead(timeout_s=1.0):
                    log.error("head_died")
                    return 1
                time.sleep(1.0)
            return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
