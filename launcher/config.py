"""The launcher's command line: its flags, and what they resolve to.

`parse_args` is the main command's parser (`launch.py --help` shows USAGE);
the helpers turn flags into what the children get: the backend (`auto`
resolved), the backend options JSON, each engine's GPU group, and the address
other nodes reach this one by. The `keys` subcommand has its own parser
(launcher/keys.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import socket
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from bus.addresses import address_problem
from bus.errors import BadRequest
from engine_node.backend import BACKENDS
from router_node.config import RouterConfig
from router_node.policies import SESSION_PLACEMENTS

log = structlog.get_logger("launch")

USAGE = """One command that launches rollout-bus: a head and engine nodes.

    python launch.py                       # local default: head + 2 engines
    python launch.py --demo                # … and run a short client session
    python launch.py --head --engines 0    # multi-node: the head on this node
    python launch.py --join tcp://HEAD:5555 --engines 4   # engines on another node
    python launch.py keys init | list | add-client NAME [--public FILE] | remove-client NAME
                                           # the CURVE key folder of --curve (docs/security.md)

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

DEFAULT_KEY_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rollout-bus", "curve")


def pick_backend(name: str) -> str:
    if name != "auto":
        return name
    if importlib.util.find_spec("vllm") is not None:
        try:
            import torch  # heavy: only when vLLM is there to pick

            if torch.cuda.is_available():
                return "vllm"
        except Exception as e:  # a broken CUDA/torch install: the torch backend still serves
            log.warning("cuda_probe_failed", error=repr(e), fallback="torch")
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


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """USAGE as written, and every flag's default in its help line (a flag
    whose default is None says in its help what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        "launch.py", usage="%(prog)s [options]  (--help lists them)", description=USAGE, formatter_class=_HelpFormatter
    )
    _add_topology_args(ap)  # --help lists the groups in this order
    _add_engine_args(ap)
    _add_security_args(ap)
    _add_lifecycle_args(ap)
    _add_head_args(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.port and a.port + 2 > 65535:  # the head binds port, port+1, port+2
        ap.error(f"argument --port: {a.port} leaves no room for the events and control ports (port+1, port+2)")
    return a


# ------------------------------------------------------------ argument types: refused before any process starts


def _int_in(lo: int, hi: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(
                f"{v} is out of range ({lo}-{hi})" if hi is not None else f"{v} must be >= {lo}"
            )
        return v

    parse.__name__ = "int"
    return parse


def _float_min(lo: float, *, strict: bool = False) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if v < lo or (strict and v == lo) or v != v:
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if strict else '>='} {lo}")
        return v

    parse.__name__ = "float"
    return parse


BACKEND_CHOICES = ("auto", *sorted(BACKENDS))
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def backend_arg(name: str) -> str:
    """--backend: a registered backend, auto, or module:factory whose module exists."""
    if name in BACKEND_CHOICES:
        return name
    if ":" not in name:
        choices = ", ".join(map(repr, BACKEND_CHOICES))
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {choices}, or module:factory)")
    if not _FACTORY.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{name!r} is not module:factory (e.g. my_pkg.backend:make_backend)")
    module = name.split(":", 1)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there
        found = False
    if not found:
        raise argparse.ArgumentTypeError(f"{name!r}: no module {module!r} on this Python's path")
    return name


def json_object_arg(text: str) -> str:
    """--backend-options: a JSON object (kept as text; engine_backend_options parses it)."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"a JSON object {{...}} expected, got {text!r}")
    return text


def _add_topology_args(ap: argparse.ArgumentParser) -> None:
    """Where the head and engines run, and how requests are placed on them."""
    ap.add_argument(
        "--engines",
        type=_int_in(0),
        default=None,
        help="engine nodes on this machine (None: 2, or GPUs // tp with vLLM; 0 with --head)",
    )
    ap.add_argument(
        "--backend",
        type=backend_arg,
        default="auto",
        metavar="{" + ",".join(BACKEND_CHOICES) + "} | module:factory",
        help="the engines' backend (auto: vllm with a GPU, else torch); module:factory: an out-of-tree backend",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="model folder or hub id (None: a tiny random model built into $ROLLOUT_BUS_CACHE, "
        "default ~/.cache/rollout-bus)",
    )
    ap.add_argument(
        "--host",
        default="127.0.0.1",
        help="address this node binds (0.0.0.0 for multi-node; loopback keeps the cluster on this machine)",
    )
    ap.add_argument(
        "--port",
        type=_int_in(0, 65535),
        default=5555,
        help="frontend port; events = port+1, control = port+2; 0: any free",
    )
    ap.add_argument(
        "--advertise-host",
        default=None,
        help="how other nodes reach this one (None: --host, or the host name when --host is a wildcard)",
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
        "--head", action="store_true", help="multi-node: run the head here (engines here: --engines, 0 unless given)"
    )
    ap.add_argument(
        "--join",
        default=None,
        metavar="tcp://HEAD:PORT",
        help="multi-node: run engines here for that head (None: run a head here)",
    )
    ap.add_argument(
        "--engine-id-prefix",
        default=None,
        help="engine ids are PREFIX0, PREFIX1… (None: e, or HOSTNAME-e when joining)",
    )


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    """What each engine node runs: its backend's options and GPUs."""
    ap.add_argument("--tp", type=_int_in(1), default=1, help="tensor-parallel GPUs per vLLM engine")
    ap.add_argument(
        "--gpus",
        default=None,
        help="GPUs for the engines, comma-separated: indices into the visible ones (an inherited "
        "CUDA_VISIBLE_DEVICES is honoured: with 4,5,6,7 set, --gpus 0,1 is GPUs 4,5) or GPU-<uuid> names "
        "(default with vLLM: all visible)",
    )
    ap.add_argument(
        "--gpu-memory-utilization", type=_float_min(0.0, strict=True), default=0.85, help="vLLM's, per engine"
    )
    ap.add_argument(
        "--max-model-len", type=_int_in(1), default=None, help="the backend's context length (None: the model's)"
    )
    ap.add_argument(
        "--backend-options", type=json_object_arg, default="{}", help="extra options for the backend (a JSON object)"
    )
    ap.add_argument(
        "--heartbeat-interval-s",
        type=_float_min(0.0, strict=True),
        default=0.5,
        help="engines' heartbeat period; the head marks an engine unhealthy after 3 missed",
    )


def _add_security_args(ap: argparse.ArgumentParser) -> None:
    """CURVE keys and the join token."""
    ap.add_argument(
        "--curve",
        action="store_true",
        help="security on: CURVE on every TCP socket, engines and clients checked against allow-lists (--curve-dir)",
    )
    ap.add_argument(
        "--curve-dir",
        default=None,
        help=f"key folder (None: {DEFAULT_KEY_DIR}): made by the head when missing (`launch.py keys`); "
        "copy it, without head.key_secret, to joining nodes",
    )
    ap.add_argument(
        "--client-key",
        default=None,
        help="the launcher's own client key (readiness, demo): a name in clients/ (None: default)",
    )
    ap.add_argument(
        "--token-file",
        default=None,
        help="the cluster's join token (0600). Head: use this file instead of making a new token in the run "
        "folder. --join: the head's token (None: $ROLLOUT_BUS_TOKEN_FILE, else the file the head's launcher "
        "published for that address on this host; copy it to other nodes)",
    )


def _add_lifecycle_args(ap: argparse.ArgumentParser) -> None:
    """Seeds, leases, restarts, readiness, logging and where to run (Ray)."""
    ap.add_argument(
        "--metrics-port",
        type=_int_in(-1, 65535),
        default=-1,
        help="Prometheus /metrics of the head on --host (-1: off, 0: any free port; the table prints its URL)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="cluster seed: every engine's stream for unseeded sampling is derived from it, the "
        "engine id and the engine's incarnation, so no two engines (nor two lives of one) draw the same samples; "
        "seeded requests (params seed) are the same on every engine",
    )
    ap.add_argument(
        "--lease-s",
        type=_float_min(0.0, strict=True),
        default=None,
        help="the head's --lease-s: a client silent this long loses its pause, sleep and weight update (None: 10)",
    )
    ap.add_argument(
        "--max-restarts",
        type=_int_in(0),
        default=3,
        help="restarts of each crashed child (head or engine); an engine that cannot start is not restarted",
    )
    ap.add_argument("--grace-s", type=_float_min(0.0), default=10.0, help="SIGTERM → SIGKILL grace on shutdown")
    ap.add_argument(
        "--ready-timeout-s",
        type=_float_min(0.0, strict=True),
        default=300.0,
        help="wait this long for every engine to be healthy before giving up",
    )
    ap.add_argument("--demo", action="store_true", help="run a short client session once the cluster is ready")
    ap.add_argument(
        "--once", action="store_true", help="exit after readiness (and the demo) instead of serving until Ctrl-C"
    )
    ap.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="every process's log level, the head's and engines' too (None: $ROLLOUT_BUS_LOG_LEVEL, else "
        "WARNING: a quiet start, the table first); INFO shows the event log (JSON lines when not on a terminal)",
    )
    ap.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS|local",
        help="place the head and engines as Ray actors on a Ray cluster (auto: the running one, local: start one "
        "here; needs the ray extra). Binds each node's IP unless --host is given (local: --host). None: local processes",
    )


# The head's own tunables that the launcher does not set itself: each is a
# launch.py flag too (README names them bare), passed to the head only when given.
_HEAD_SET_BY_LAUNCHER = {
    "frontend", "events", "control", "policy", "heartbeat_interval_s", "session_placement",
    "lease_s", "seed", "curve_dir", "metrics_port", "metrics_host", "token_file",
}  # fmt: skip
HEAD_PASSTHROUGH = [f for f in dataclasses.fields(RouterConfig) if f.name not in _HEAD_SET_BY_LAUNCHER]


def _add_head_args(ap: argparse.ArgumentParser) -> None:
    """The head's other knobs (`python -m router_node --help`), passed through when given."""
    g = ap.add_argument_group("head options", "passed to the head (python -m router_node) when given")
    defaults = RouterConfig()
    for f in HEAD_PASSTHROUGH:
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind = "BooleanOptionalAction" if isinstance(default, bool) else type(default).__name__
        help_text = f"the head's {flag} (None: the head's default, {default})"
        if isinstance(default, bool):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            g.add_argument(flag, type=_int_in(0) if kind == "int" else _float_min(0.0), default=None, help=help_text)


def head_passthrough_argv(a: argparse.Namespace) -> list[str]:
    """The head flags given on launch.py's command line, as router_node argv."""
    out: list[str] = []
    for f in HEAD_PASSTHROUGH:
        v = getattr(a, f.name)
        if v is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def refusal(a: argparse.Namespace) -> str | None:
    """What is wrong with this launch before any process starts (None: nothing
    seen): checks that need the environment or the file system, after the parser's."""
    level = os.environ.get("ROLLOUT_BUS_LOG_LEVEL")
    if a.log_level is None and level is not None and level.upper() not in LOG_LEVELS:
        return f"ROLLOUT_BUS_LOG_LEVEL={level!r}: choose from {', '.join(LOG_LEVELS)} (or pass --log-level)"
    local = a.model and a.model.startswith(("/", "./", "../", "~")) and not a.ray  # --ray: the nodes' paths
    if local and not os.path.isdir(os.path.expanduser(a.model)):
        return f"--model: no such folder: {a.model}"
    if a.ray and (given := head_passthrough_argv(a)):
        return f"{given[0]}: the head's options are not passed to a head on Ray (--ray) yet"
    if a.join and (problem := address_problem(a.join)) is not None:
        return f"--join: {problem}"
    return None


def taken_port(host: str, port: int) -> int | None:
    """The first of the head's ports (port, port+1, port+2) that something
    on `host` already holds (None: all free). A check, not a reservation: the
    head's own bind error still ends it at once (router_node/main.py)."""
    for p in (port, port + 1, port + 2):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq binds: a TIME_WAIT port is free
            try:
                s.bind((host, p))
            except OSError:
                return p
    return None


def engine_backend_options(a: argparse.Namespace, backend: str) -> dict[str, Any]:
    opts = json.loads(a.backend_options)
    if backend == "vllm":
        opts.setdefault("tp", a.tp)
        opts.setdefault("gpu_memory_utilization", a.gpu_memory_utilization)
    if a.max_model_len:
        opts.setdefault("max_model_len", a.max_model_len)
    return opts


def visible_gpus(env: Mapping[str, str], device_count: Callable[[], int]) -> tuple[list[str], bool]:
    """(the GPUs this launcher may hand out, whether a mask named them).

    Each entry is what a child's CUDA_VISIBLE_DEVICES takes: the inherited mask's
    own entries (ids, `GPU-<uuid>`, `MIG-…`, passed as they are, so a job given
    GPUs 4-7 hands out 4-7), or with no mask 0..device_count-1. CUDA stops
    reading a mask at its first malformed entry (`-1` hides every GPU): so does this."""
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return [str(i) for i in range(device_count())], False
    out: list[str] = []
    for tok in (t.strip() for t in mask.split(",")):
        if not (tok.isdigit() or tok.startswith(("GPU-", "MIG-"))):
            break
        out.append(tok)
    return out, True


def select_gpus(flag: str | None, visible: list[str], masked: bool) -> list[str]:
    """--gpus through the visible list: an index i is the i-th visible GPU (as
    torch numbers them in this process), a `GPU-…`/`MIG-…` name is taken as it
    is (it must be one the mask shows, when there is a mask)."""
    if not flag:
        return list(visible)
    where = f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}" if masked else f"{len(visible)} GPU(s) visible"
    out: list[str] = []
    for tok in (t.strip() for t in flag.split(",")):
        if tok.isdigit():
            if int(tok) >= len(visible):
                raise BadRequest(f"--gpus {flag}: index {tok} is past the GPUs this job sees ({where})", field="gpus")
            out.append(visible[int(tok)])
        elif tok.startswith(("GPU-", "MIG-")) and (not masked or tok in visible):
            out.append(tok)
        else:
            raise BadRequest(f"--gpus {flag}: {tok!r} is not an index or a visible GPU name ({where})", field="gpus")
    if len(set(out)) != len(out):
        raise BadRequest(f"--gpus {flag} names one GPU twice ({where})", field="gpus")
    return out


def _cuda_device_count() -> int:
    import torch  # heavy: only when no mask says which GPUs there are

    return int(torch.cuda.device_count())


def gpu_groups(
    a: argparse.Namespace,
    backend: str,
    n_engines: int | None,
    env: Mapping[str, str] | None = None,
    device_count: Callable[[], int] = _cuda_device_count,
) -> list[str | None]:
    """Each engine's CUDA_VISIBLE_DEVICES (None: leave the inherited one): vLLM
    engines, or any backend given --gpus, get `tp` GPUs each from the visible
    ones (`visible_gpus`, `select_gpus`). Too few: a BadRequest naming --gpus
    and the mask."""
    if backend != "vllm" and not a.gpus:
        return [None] * (2 if n_engines is None else n_engines)
    visible, masked = visible_gpus(os.environ if env is None else env, device_count)
    gpus = select_gpus(a.gpus, visible, masked)
    n = len(gpus) // a.tp if n_engines is None else n_engines
    if n * a.tp > len(gpus) or (n_engines is None and n == 0):
        seen = f"CUDA_VISIBLE_DEVICES={','.join(visible)!r}" if masked else f"{len(visible)} GPU(s) visible"
        raise BadRequest(
            f"{max(n, 1)} engine(s) × tp={a.tp} needs {max(n, 1) * a.tp} GPU(s); --gpus gives {gpus} ({seen})",
            field="gpus",
        )
    return [",".join(gpus[i * a.tp : (i + 1) * a.tp]) for i in range(n)]
