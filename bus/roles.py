"""Who may speak on which socket: every socket authenticates its peer at the
handshake, by role (docs/security.md).

    socket                    roles it admits          --curve (TCP)         otherwise (TCP and IPC)
    head frontend             clients                  clients/*.key         PLAIN client / role secret
    head events + control     engines                  engines/*.key         PLAIN engine / role secret
    engine data socket        the head alone           head.key              PLAIN head / head_data_secret
    engine weight socket      weight senders           clients/*.key         PLAIN client / role secret

A role secret is derived from the cluster's join token (`role_secret`), so
the token itself never travels and a sniffed client secret is not an engine's.
Without a token (a head started by hand, open to anyone) the head's sockets
take NULL. The engine's data socket is never open: the head proves itself
there with `head_data_secret`, keyed by the engine's events identity, whose
NONCE is secret to the engine process and known to the head only from the
Register's connection. A client, a token holder included, cannot derive it:
nothing a client sees lets it act as the head, and ROUTER_HANDOVER on that
socket only ever hands the head's pipe to the head.

`--direct-clients` (an engine option; benchmarks and tests connect straight to
one engine) also admits the client role on the data socket.

Ownership: pure functions and frozen values; `Plain.apply` runs on the thread
that owns the socket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import zmq

CLIENT = "client"
ENGINE = "engine"
HEAD = "head"

# ZAP domains of the engine's sockets (the head's are bus.auth.CLIENTS / ENGINES).
DATA = "data"  # the engine data socket: the head (and clients with --direct-clients: bus.auth.PEERS)
WEIGHTS = "weights"  # the engine weight socket: weight senders (clients)


def role_secret(token: str, role: str) -> str:
    """The PLAIN password of `role` in the cluster of `token` (hex)."""
    return hmac.new(token.encode(), f"rollout-bus/role/{role}".encode(), hashlib.sha256).hexdigest()


def head_data_secret(events_identity: bytes) -> str:
    """The head's PLAIN password on the data socket of the engine whose events
    connection has this identity ("engine_id/incarnation/NONCE")."""
    return hmac.new(events_identity, b"rollout-bus/head-data", hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class Plain:
    """ZMQ PLAIN on one socket: a connecting side presents (username,
    password); a binding side (`server`) has its peers checked by the ZAP
    handler of its context for `zap_domain` (bus.auth.Gatekeeper)."""

    username: str = ""
    password: str = ""
    server: bool = False

    def apply(self, s: zmq.Socket, zap_domain: str | None) -> None:
        if self.server:
            if not zap_domain:
                raise ValueError("a PLAIN server socket needs a ZAP domain (who it admits)")
            s.zap_domain = zap_domain.encode()
            s.plain_server = True
        else:
            s.plain_username = self.username.encode()
            s.plain_password = self.password.encode()


SERVER = Plain(server=True)


def as_role(token: str | None, role: str) -> Plain | None:
    """The credential of `role` in the cluster of `token` (None: no token, NULL)."""
    return Plain(role, role_secret(token, role)) if token else None


def serving(token: str | None) -> Plain | None:
    """A binding socket admitting token holders: PLAIN server, or NULL without a token."""
    return SERVER if token else None
