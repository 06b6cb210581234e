"""The launcher's command line: its flags, and what they resolve to.

`parse_args` is the main command's parser (`launch.py --help` shows USAGE);
the helpers turn flags into what the children get: the backend (`auto`
resolved), the backend options JSON, each engine's GPU group, and the address
other nodes reach this one by. The `keys` subcommand has its own parser
(launch_keys.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from bus.errors import BadRequest
from router_node.policies import SESSION_PLACEMENTS

log = structlog.get_logger("launch")

USAGE = """One command that launches rollout-bus: a head and engine nodes.

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser("launch.py", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_topology_args(ap)  # --help lists the groups in this order
    _add_engine_args(ap)
    _add_security_args(ap)
    _add_lifecycle_args(ap)
    return ap.parse_args(argv)


def _add_topology_args(ap: argparse.ArgumentParser) -> None:
    """Where the head and engines run, and how requests are placed on them."""
    ap.add_argument(
        "--engines", type=int, default=None, help="engine nodes on this machine (default: 2, or GPUs // tp with vLLM)"
    )
    ap.add_argument(
        "--backend", default="auto", help="auto | torch | vllm | null | module:factory of an out-of-tree backend"
    )
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


def _add_engine_args(ap: argparse.ArgumentParser) -> None:
    """What each engine node runs: its backend's options and GPUs."""
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--gpus",
        default=None,
        help="GPUs for the engines, comma-separated: indices into the visible ones (an inherited "
        "CUDA_VISIBLE_DEVICES is honoured: with 4,5,6,7 set, --gpus 0,1 is GPUs 4,5) or GPU-<uuid> names "
        "(default with vLLM: all visible)",
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--backend-options", default="{}", help="extra JSON options for the backend factory")
    ap.add_argument("--heartbeat-interval-s", type=float, default=0.5)


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


def _add_lifecycle_args(ap: argparse.ArgumentParser) -> None:
    """Seeds, leases, restarts, readiness, logging and where to run (Ray)."""
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
