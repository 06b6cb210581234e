"""What the head believes, and from whom: the join token, the identity an
engine's events connection must have, the CURVE key of its data socket, and
the fields of a Register. Pure checks: each raises the typed error naming the
field, or returns.

Hazards this module owns: without --curve, anyone who reaches the events
socket could speak for an engine (a forged ack of a commit, a heartbeat with
another weight version). A second connection cannot take a live identity
(ROUTER without handover), so the identity "engine_id/incarnation/NONCE" is the
credential, and its NONCE, secret to the engine process, keeps it from being
re-used once that process is dead.
"""

from __future__ import annotations

from typing import Any

import structlog
import zmq

from bus import auth, roles
from bus import protocol as P
from bus.auth import Gatekeeper, KeyDir, peer_key, read_token, token_matches
from bus.errors import BadRequest, Unauthorized
from bus.sockets import CurveKeys, check_endpoint
from router_node.registry import EngineEntry

log = structlog.get_logger("router_node")


def check_join_token(token: str | None, given: str, frames: list[Any], *, what: str) -> None:
    """Raise Unauthorized unless the message carries the cluster's join
    token or came over a CURVE-authenticated connection (ZAP vouched for
    its key: the allow-list is the credential there)."""
    if token is None:
        return
    if frames and peer_key(frames[0]) is not None:
        return
    if given and token_matches(token, given):
        return
    why = "a wrong join token" if given else "no join token"
    raise Unauthorized(
        f"{what} with {why}: this cluster needs its join token (the 0600 file launch.py made: engines "
        "--token-file or $ROLLOUT_BUS_TOKEN_FILE, clients Client(..., token_file=...) or the file launch.py "
        "publishes for its address; docs/security.md)",
        field="token",
    )


def ident_ok(ident: bytes, engine_id: str, incarnation: str) -> bool:
    """The events-socket identity an engine node connects with
    (engine_node/node.py): "engine_id/incarnation/NONCE", NONCE 32+ hex chars."""
    prefix = f"{engine_id}/{incarnation}/".encode()
    nonce = ident[len(prefix) :]
    return ident.startswith(prefix) and len(nonce) >= 32 and all(c in b"0123456789abcdef" for c in nonce)


def check_register(reg: P.Register, ident: bytes, old: EngineEntry | None, vocab: int) -> None:
    """The fields of a Register the head must believe before it connects
    (the join token is checked first, by the caller)."""
    check_endpoint(reg.data_address, field="data_address")
    if reg.weight_address:
        check_endpoint(reg.weight_address, field="weight_address")
    if not reg.engine_id or len(reg.engine_id) > 128:
        raise BadRequest("engine_id must be 1-128 characters", field="engine_id")
    if not ident_ok(ident, reg.engine_id, reg.incarnation):
        # Heartbeats and acks are only believed from that connection.
        raise BadRequest(
            "the events connection's identity must be 'engine_id/incarnation/NONCE' (NONCE: 32+ hex "
            "characters, secret to the engine) of the Register",
            field="incarnation",
        )
    if old is not None and old.reg.incarnation == reg.incarnation and old.ident != ident:
        raise BadRequest(
            f"incarnation {reg.incarnation} of {reg.engine_id!r} is registered from another connection",
            field="incarnation",
        )
    if reg.vocab_size and vocab and reg.vocab_size != vocab:
        raise BadRequest(
            f"vocab_size {reg.vocab_size} != the cluster's {vocab} (the first registered engine's, or "
            "the head's --vocab-size): every engine of a cluster must serve the same vocabulary",
            field="vocab_size",
        )


def engine_curve(curve: Any, gate: Gatekeeper | None, reg: P.Register) -> Any:
    """Keys to connect to the engine's data socket: its own CURVE key, which
    must be an allowed engine credential (else the head would hand requests
    to a server nobody vouched for). None: no CURVE there."""
    if curve is None or gate is None or not reg.data_address.startswith("tcp://"):
        return None
    if not gate.allows(auth.ENGINES, reg.curve_key.encode()):
        raise BadRequest(
            "curve_key is not an engine credential of this cluster (engines/*.key of the head's curve_dir)",
            field="curve_key",
        )
    return curve.connecting_to(reg.curve_key.encode())


def engine_of(
    engines: dict[str, EngineEntry], counters: dict[str, int], ident: bytes, engine_id: str, what: str
) -> EngineEntry | None:
    """The registered engine `engine_id` if this message came over ITS events
    connections (the loop's, and the heartbeat thread's ".../hb"); else None
    (counted, and logged at a bounded rate)."""
    e = engines.get(engine_id)
    if e is None:
        return None
    own = e.ident
    if ident != own and ident != own + b"/hb":
        counters["spoofed_events"] += 1
        if counters["spoofed_events"] <= 10 or counters["spoofed_events"] % 1000 == 0:
            log.warning("engine_event_from_another_connection", engine_id=engine_id, what=what)
        return None
    return e


def head_security(ctx: zmq.Context, cfg: Any) -> tuple[Gatekeeper | None, CurveKeys | None, str | None]:
    """(the ZAP handler of the head's context, its CURVE keys, the join token).
    Who each head socket admits at the handshake (bus/roles.py): CURVE keys on
    TCP with --curve-dir, else PLAIN with the token's role secrets (frontend:
    clients; events and control: engines). Started before any socket binds."""
    token = read_token(cfg.token_file) if cfg.token_file else None
    keys = KeyDir(cfg.curve_dir) if cfg.curve_dir else None
    if keys is None and token is None:
        return None, None, None
    plain = {}
    if token is not None:
        plain = {
            auth.CLIENTS: {roles.CLIENT: roles.role_secret(token, roles.CLIENT)},
            auth.ENGINES: {roles.ENGINE: roles.role_secret(token, roles.ENGINE)},
        }
    gate = Gatekeeper(ctx, keys, (auth.CLIENTS, auth.ENGINES), plain).start()
    return gate, keys.head() if keys is not None else None, token
