"""Engines joining the head: a Register is checked (router_node/trust.py),
admitted (router_node/registry.py `admit_register`), connected to (one DEALER
per engine data socket, served by an Endpoint the router polls) and handed to
cluster control's join; a heartbeat from an engine the head does not know
asks it to register again (Rejoin).

Hazards this module owns:
- nothing of a Register is believed before its credential: a stranger cannot
  take even a dead engine's id;
- an engine that registers again under its id (a restarted process) has what
  it ran evacuated and its old entry forgotten before the new one exists;
- the cluster's vocabulary is the first registered engine's (or the head's
  --vocab-size), and every later engine must match it.

Ownership: the router loop thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import protocol as P
from bus import roles
from bus.auth import Gatekeeper
from bus.codec import Codec
from bus.endpoint import open_monitored
from bus.errors import BadRequest, ErrorCode, Unauthorized, truncate
from bus.ratelog import RateLimitedLog
from bus.roles import Plain
from router_node.config import RouterConfig
from router_node.data_links import WATCHED_EVENTS
from router_node.registry import Admission, EngineEntry, admit_register
from router_node.trust import check_join_token, check_register, engine_curve

log = structlog.get_logger("router_node")

Send = Callable[[bytes, Any], Any]  # (events peer, message)


class Registrar:
    def __init__(
        self,
        cfg: RouterConfig,
        ctx: zmq.Context,
        codec: Codec,
        engines: dict[str, EngineEntry],
        counters: dict[str, int],
        *,
        data_identity: bytes,
        token: str | None,
        gate: Gatekeeper | None,
        curve: Any,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.codec = codec
        self.engines = engines  # the registry (owned by the router)
        self.counters = counters
        self.data_identity = data_identity  # the head's identity on every engine's data socket
        self.token = token
        self.gate = gate
        self.curve = curve
        self.vocab = cfg.vocab_size  # the cluster's vocabulary (0: the first registered engine's)
        self._rejoin_asked: dict[bytes, float] = {}
        self.refusals = RateLimitedLog(log)  # refused Registers: one log line per interval per kind

    def check(self, reg: P.Register, ident: bytes, frames: list[Any], send: Send) -> tuple[Any] | None:
        """Check a Register: its refusal is sent here (returns None), else the
        keys to connect to its data socket (None: no CURVE there) in a tuple."""
        if reg.protocol_version != P.PROTOCOL_VERSION:
            err = f"protocol version {reg.protocol_version} != head's {P.PROTOCOL_VERSION}: upgrade the older side"
            self.refusals.refused(
                "register_refused", "error", kind="register_refused.protocol", engine_id=reg.engine_id[:128], error=err
            )
            self.counters["register_refused"] += 1
            send(ident, P.RegisterReply(ok=False, error=err, code=ErrorCode.PROTOCOL.value))
            return None
        try:
            check_join_token(self.token, reg.token, frames, what="Register")
            check_register(reg, ident, self.engines.get(reg.engine_id), self.vocab)
            return (engine_curve(self.curve, self.gate, reg),)
        except (BadRequest, Unauthorized) as err:
            event = "register_refused_token" if isinstance(err, Unauthorized) else "register_refused"
            self.counters[event] += 1
            self.refusals.refused(
                event, engine_id=reg.engine_id[:128], pid=reg.pid, field=err.field, error=truncate(err.message, 200)
            )
            send(ident, P.RegisterReply(ok=False, error=str(err), code=err.code.value, field=err.field))
            return None

    def admit(self, reg: P.Register, ident: bytes, send: Send) -> bool:
        """False when the Register was answered here: a repeat of the live
        registration, or its id is taken by a live engine."""
        old = self.engines.get(reg.engine_id)
        deadline = self.cfg.missed_heartbeats * self.cfg.heartbeat_interval_s
        admission, why = admit_register(old, reg, time.monotonic(), deadline_s=deadline)
        if admission is Admission.REPEAT:
            send(ident, self.accepted())
            return False
        if admission is Admission.TAKEN:
            log.warning(
                "register_refused_id_taken", engine_id=reg.engine_id, incarnation=reg.incarnation, pid=reg.pid,
                host=reg.host, data=reg.data_address, error=why,
            )  # fmt: skip
            send(ident, P.RegisterReply(ok=False, error=why, retry=True))
            return False
        return True

    def accepted(self) -> P.RegisterReply:
        return P.RegisterReply(
            ok=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s, data_peer=self.data_identity.decode()
        )

    def connect(self, reg: P.Register, ident: bytes, data_curve: Any) -> EngineEntry:
        """A new entry (not yet in the registry) with its DEALER to the engine's data socket."""
        now = time.monotonic()
        # The engine's data socket admits the head alone: CURVE (head.key) or
        # PLAIN with the secret only this engine's events connection lets us derive.
        head = Plain(roles.HEAD, roles.head_data_secret(ident))
        sock, monitor = open_monitored(
            self.ctx, zmq.DEALER, connect=reg.data_address, events=WATCHED_EVENTS, curve=data_curve,
            identity=self.data_identity, plain=head,
        )  # fmt: skip
        e = EngineEntry(reg=reg, sock=sock, registered_at=now, last_seen=now, steps_changed_at=now, ident=ident)
        e.link_monitor = monitor
        if not self.vocab and reg.vocab_size > 0:
            self.vocab = reg.vocab_size  # the cluster's vocabulary from now on
        e.loras = set(reg.loras)
        e.weight_version = reg.weight_version
        return e

    def ask_rejoin(self, ident: bytes, engine_id: str, send: Send) -> None:
        """A heartbeat from an engine this head does not know: this head was
        restarted (or forgot it). Ask it to register again, at most once a
        second per connection; it re-registers with its weight version, LoRAs
        and (heartbeats) paused / sleeping state, and joins like a new engine."""
        now = time.monotonic()
        if now - self._rejoin_asked.get(ident, -1e9) < 1.0:
            return
        if len(self._rejoin_asked) > 4096:
            self._rejoin_asked.clear()
        self._rejoin_asked[ident] = now
        loop_ident = ident[: -len(b"/hb")] if ident.endswith(b"/hb") else ident
        log.info("engine_asked_to_rejoin", engine_id=engine_id[:128])
        send(loop_ident, P.Rejoin(reason="the head does not know this engine (it restarted)"))
