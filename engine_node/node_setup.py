"""What the engine node opens and tells at start-up: its security (who each
socket admits, bus/roles.py: CURVE keys or PLAIN role secrets, checked by this
context's Gatekeeper), its data socket, the address peers are told, and its
incarnation id and events identity. Run once per process, before the loop
(engine_node/node.py).
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
import uuid

import zmq

from bus import auth, roles
from bus.auth import Gatekeeper, KeyDir, read_token
from bus.endpoint import open_socket
from bus.roles import Plain
from bus.sockets import CurveKeys
from engine_node.config import EngineNodeConfig

SEEDED_BACKENDS = ("torch", "vllm")  # backends whose `seed` option run_engine_node derives


@dataclasses.dataclass(frozen=True)
class Security:
    """Who this node admits and how it proves itself (bus/roles.py).

    `gate`: this context's one ZAP handler (always: the data socket admits the
    head alone, even in a cluster without a token). `curve`: the engine
    credential (None: no --curve-dir). `as_engine`: our PLAIN credential at
    the head's events and control sockets (None: no token, NULL). `weights`:
    how the weight socket admits senders (None: no token, NULL).
    `data_domain`: the data socket's ZAP domain (the head; --direct-clients:
    the head and clients)."""

    gate: Gatekeeper
    curve: CurveKeys | None
    as_engine: Plain | None
    weights: Plain | None
    data_domain: str


def events_identity(engine_id: str, incarnation: str) -> bytes:
    """The events connection's identity: "engine_id/incarnation/NONCE". NONCE
    is secret to this process: the head's proof of who acks (router_node/trust.py)
    and the key of the head's data-socket secret (roles.head_data_secret)."""
    return f"{engine_id}/{incarnation}/{secrets.token_hex(16)}".encode()


def security(ctx: zmq.Context, cfg: EngineNodeConfig, identity: bytes) -> Security:
    """Started before any socket binds (a handshake is answered by the ZAP
    handler of the socket's context)."""
    token = read_token(cfg.token_file) if cfg.token_file else None
    keys = KeyDir(cfg.curve_dir) if cfg.curve_dir else None
    data_domain = auth.PEERS if cfg.direct_clients else roles.DATA
    if cfg.direct_clients and token is None:
        raise ValueError(
            "--direct-clients needs the cluster's join token (--token-file): clients prove themselves with it"
        )
    plain = {data_domain: {roles.HEAD: roles.head_data_secret(identity)}}
    if token is not None:
        plain[roles.WEIGHTS] = {roles.CLIENT: roles.role_secret(token, roles.CLIENT)}
        if cfg.direct_clients:
            plain[data_domain][roles.CLIENT] = roles.role_secret(token, roles.CLIENT)
    gate = Gatekeeper(ctx, keys, (data_domain, roles.WEIGHTS), plain).start()
    return Security(
        gate=gate,
        curve=keys.engine() if keys is not None else None,
        as_engine=roles.as_role(token, roles.ENGINE),
        weights=roles.serving(token),
        data_domain=data_domain,
    )


def open_data_socket(ctx: zmq.Context, address: str, sec: Security) -> zmq.Socket:
    sock = open_socket(ctx, zmq.ROUTER, bind=address, curve=sec.curve, zap_domain=sec.data_domain, plain=roles.SERVER)
    # The head connects here with a fixed identity (RegisterReply.data_peer:
    # acks follow the chunks on this connection). When the head replaces its
    # connection (this engine re-registered, or the head restarted) the old
    # one may still be open on our side: without handover the new one, with
    # the same identity, is refused and every send to the head queues on a
    # dead pipe (a generate after an engine restart hung, test_auth).
    # Hazard: handover gives a pipe to whoever presents its identity, so this
    # socket admits the head alone at the handshake (sec.data_domain; with
    # --direct-clients also token holders, who cannot know the head's random
    # identity): never enable it on a socket open to unauthenticated peers.
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
