"""What the engine node opens and tells at start-up: its security (CURVE keys
and the Gatekeeper of ZAP domain "peers"), its data socket, the address peers
are told, and its incarnation id. Run once per process, before the loop
(engine_node/node.py).
"""

from __future__ import annotations

import socket
import uuid

import zmq

from bus import auth
from bus.auth import Gatekeeper, KeyDir
from bus.endpoint import open_socket
from bus.sockets import CurveKeys
from engine_node.config import EngineNodeConfig

SEEDED_BACKENDS = ("torch", "vllm")  # backends whose `seed` option run_engine_node derives


def security(ctx: zmq.Context, cfg: EngineNodeConfig) -> tuple[Gatekeeper | None, CurveKeys | None]:
    """Security on (curve_dir): this node holds the cluster's engine
    credential; its data and weight sockets take only the head and allowed
    clients (ZAP domain "peers", checked by this context's Gatekeeper, started
    before the sockets bind)."""
    if not cfg.curve_dir:
        return None, None
    keys = KeyDir(cfg.curve_dir)
    return Gatekeeper(ctx, keys, (auth.PEERS,)).start(), keys.engine()


def open_data_socket(ctx: zmq.Context, address: str, curve: CurveKeys | None) -> zmq.Socket:
    sock = open_socket(ctx, zmq.ROUTER, bind=address, curve=curve, zap_domain=auth.PEERS)
    # The head connects here with a fixed identity (RegisterReply.data_peer:
    # acks follow the chunks on this connection). When the head replaces its
    # connection (this engine re-registered, or the head restarted) the old
    # one may still be open on our side: without handover the new one, with
    # the same identity, is refused and every send to the head queues on a
    # dead pipe (a generate after an engine restart hung, test_auth).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return sock


def advertised(endpoint: str, advertise_host: str | None) -> str:
    """The address peers are told: `advertise_host` when set, this host's name
    for a wildcard bind."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    if advertise_host:
        return f"tcp://{advertise_host}:{port}"
    if host in ("0.0.0.0", "*", "[::]"):
        return f"tcp://{socket.gethostname()}:{port}"
    return endpoint


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]
