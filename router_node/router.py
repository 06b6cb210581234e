"""The head process: the thin shell around the registry, forwarding
(router_node/forwarding.py) and cluster control (router_node/control.py).

One thread owns every socket: the frontend ROUTER (clients), the events
ROUTER (engines' register/heartbeat/ack), the control PUB, and one DEALER per
engine data socket — each served by a bus.endpoint.Endpoint (decode → handler
table → typed Error reply). This module keeps the loop, registration, health
ticks and queries.
"""

from __future__ import annotations

import enum
import gc
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import auth
from bus import protocol as P
from bus.auth import Gatekeeper, KeyDir, KeyFileError, peer_key, read_token, token_matches
from bus.codec import Codec
from bus.control_bus import ControlBus
from bus.endpoint import Endpoint, open_socket
from bus.errors import BadRequest, ErrorCode, Unauthorized, truncate
from bus.sockets import CONTROL_HWM, bound_address, check_endpoint
from router_node import leases as L
from router_node import views
from router_node.config import RouterConfig
from router_node.control import ClusterControl
from router_node.forwarding import Forwarder
from router_node.leases import Leases
from router_node.policies import POLICIES, SESSION_PLACEMENTS, Sessions, pick_least_loaded_exact
from router_node.prefix import PrefixPlacement
from router_node.registry import Admission, EngineEntry, EngineState, LoopClock, admit_register, credit_stall

log = structlog.get_logger("router_node")

# Control ops that only read: open to any client that reaches the frontend.
# Every other op changes cluster state and needs the join token (or a CURVE key).
READ_ONLY_OPS: frozenset[type] = frozenset({P.Ping, P.IsPaused, P.Stats})
# Frontend peers whose CURVE key is remembered for revocation (a peer dropped
# from this table still has every later frame refused; only its open requests
# would wait for their own deadline instead of ending at the revocation).
_MAX_TRACKED_CLIENT_KEYS = 65536


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Router:
    def __init__(self, cfg: RouterConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.codec = Codec()
        self.lifecycle = Lifecycle.STARTING
        # Security on (curve_dir): CURVE on every TCP socket and one ZAP
        # authenticator for this context, bound before any socket accepts.
        self.gate: Gatekeeper | None = None
        self._curve = None
        if cfg.curve_dir:
            keys = KeyDir(cfg.curve_dir)
            self._curve = keys.head()
            self.gate = Gatekeeper(self.ctx, keys, (auth.CLIENTS, auth.ENGINES)).start()
        # The join token: engines present it in Register, clients in control
        # ops that change state (peers CURVE authenticated need none).
        self.token: str | None = read_token(cfg.token_file) if cfg.token_file else None
        if self.token is None and self.gate is None:
            log.warning(
                "head_open_to_anyone",
                hint="no --token-file and no --curve-dir: any process that reaches the events socket may register "
                "engines and any client may pause or update the cluster (launch.py always makes a token)",
            )
        self._vocab = cfg.vocab_size  # the cluster's vocabulary (0: the first registered engine's)
        # CURVE key of each frontend peer (routing id -> z85), so removing a key
        # from the allow-list cuts what that peer has open (_revoke_removed_keys).
        self._client_keys: dict[bytes, str] = {}
        if cfg.session_placement not in SESSION_PLACEMENTS:
            raise ValueError(
                f"--session-placement must be one of {sorted(SESSION_PLACEMENTS)}, got {cfg.session_placement!r}"
            )
        if cfg.policy not in POLICIES and cfg.policy != "prefix":
            raise ValueError(f"--policy must be one of {sorted([*POLICIES, 'prefix'])}, got {cfg.policy!r}")
        # --policy prefix: requests without a session follow their prompt's prefix
        self.prefix = PrefixPlacement.from_config(cfg) if cfg.policy == "prefix" else None
        self.engines: dict[str, EngineEntry] = {}
        self.sessions = Sessions(cfg.session_ttl_s)
        self.counters = {
            "requests": 0,
            "errors": 0,
            "failovers": 0,
            "engine_dead": 0,
            "no_healthy_engine": 0,
            "spoofed_events": 0,  # heartbeats / acks whose connection is not the engine's own
            "poison_requests": 0,  # ended after cfg.max_engine_deaths engines died under them
            "limit_exceeded": 0,  # requests refused by a per-client cap
            "client_over_hwm": 0,  # clients whose requests were cancelled: they did not read (client_hwm)
            "register_refused_token": 0,  # Registers without the cluster's join token
            "register_refused": 0,  # Registers refused for another reason (vocab_size, identity, fields)
            "unauthorized": 0,  # client control ops without the token, frames of a revoked CURVE key
            "clients_revoked": 0,  # frontend peers cut because their CURVE key left the allow-list
            "leases_expired": 0,  # pauses / sleeps / updates released because their client vanished
            "head_stalls": 0,  # the head's own loop was away longer than a heartbeat interval
        }
        # This head's identity on every engine's data socket (RegisterReply.data_peer):
        # engines send their acks there, behind the chunks they produced first.
        self.incarnation = uuid.uuid4().hex[:12]
        self._data_identity = f"head/{self.incarnation}".encode()
        self.leases = Leases(cfg.lease_s)
        # A head that was itself stopped must not blame its peers for its own
        # stall: time away from the loop longer than one heartbeat interval is
        # credited to every engine and lease (registry.LoopClock).
        self.clock = LoopClock(threshold_s=max(cfg.heartbeat_interval_s, 0.25))
        self._rejoin_asked: dict[bytes, float] = {}
        self.forwarding = Forwarder(
            cfg,
            self.codec,
            self.engines,
            self.sessions,
            pick=POLICIES.get(cfg.policy, pick_least_loaded_exact),
            place_session=SESSION_PLACEMENTS[cfg.session_placement],
            counters=self.counters,
            prefix=self.prefix,
        )
        fw = self.forwarding

        self.pub = open_socket(
            self.ctx, zmq.PUB, bind=cfg.control, hwm=CONTROL_HWM, curve=self._curve, zap_domain=auth.ENGINES
        )
        self.bus = ControlBus(self.pub, self.codec)
        self.control = ClusterControl(
            cfg, self.bus, self.engines, reply=self._reply, forget=self._forget, reevaluate=self._evaluate_engines
        )
        self.front = Endpoint(
            open_socket(
                self.ctx, zmq.ROUTER, bind=cfg.frontend, hwm=cfg.client_hwm, curve=self._curve, zap_domain=auth.CLIENTS
            ),
            self.codec,
            {
                t: self._keyed(h)
                for t, h in {
                    P.Generate: self._changes(fw.on_generate),
                    P.Cancel: self._changes(fw.on_cancel),
                    P.Control: self._changes(self._on_control),
                    P.Query: self._on_query,
                    P.EndSession: self._changes(self._on_end_session),
                    P.ClientPing: self._on_client_ping,
                }.items()
            },
            name="frontend",
            routed=True,
            before_error=self._before_error,
            on_peer_gone=self._client_gone,
            on_peer_full=self._client_over_hwm,
        )
        fw.front = self.front
        self.events = Endpoint(
            open_socket(
                self.ctx, zmq.ROUTER, bind=cfg.events, hwm=CONTROL_HWM, curve=self._curve, zap_domain=auth.ENGINES
            ),
            self.codec,
            {P.Register: self._on_register, P.Heartbeat: self._on_heartbeat, P.Ack: self._on_ack},
            name="events",
            routed=True,
            error_reply=None,
        )
        self.frontend = self.front.sock
        self.addresses = {
            "frontend": bound_address(self.front.sock),
            "events": bound_address(self.events.sock),
            "control": bound_address(self.pub),
        }
        self.poller = zmq.Poller()
        self._endpoints: dict[zmq.Socket, Endpoint] = {self.front.sock: self.front, self.events.sock: self.events}
        for sock in self._endpoints:
            self.poller.register(sock, zmq.POLLIN)
        # Query.what -> its answer (bus/views.py: P.QUERY_BODIES names the body of each)
        self._queries: dict[str, Callable[[], P.QueryBody]] = {
            "health": self.health,
            "weight_updates": self.control.cluster.open_updates,
            "weight_update_decisions": self.control.cluster.decisions,
            "engines": lambda: views.engines_view(self.engines, self.control.intended, self.sessions),
            "stats": lambda: views.stats_view(self.counters, len(self.forwarding.flights), self.sessions, self.prefix),
        }
        assert set(self._queries) == set(P.QUERY_BODIES), "every query has its typed body (bus/views.py)"
        self._last_tick = 0.0
        # Cached query answers (issue 22): a flood of health queries is served
        # from one snapshot, rebuilt when it is cfg.query_cache_s old or when
        # anything else happened since (`_gen`: bumped by every tick, engine
        # event and non-query client message), so an answer is never older
        # than what the caller already saw change.
        self._query_cache: dict[str, tuple[float, int, P.QueryBody]] = {}
        self._gen = 0
        self._spin_s = max(0, cfg.busy_poll_us) / 1e6  # --busy-poll-us

    # ------------------------------------------------------------ lifecycle

    def request_stop(self, *_: Any) -> None:
        """Signal handler: only flips the lifecycle."""
        self.lifecycle = Lifecycle.STOPPING

    def run(self) -> int:
        self.lifecycle = Lifecycle.SERVING
        # What start-up made (modules, config, sockets) lives as long as the
        # process: out of the collector's generations, a full collection no
        # longer walks it (gc traversal was ~5% of a message's instructions).
        gc.freeze()
        log.info("router_serving", **self.addresses, policy=self.cfg.policy)
        try:
            while self.lifecycle is Lifecycle.SERVING:
                self._turn()
        finally:
            self._shutdown()
        return 0

    def _turn(self) -> None:
        spin = self._spin_s if self.forwarding.flights else 0.0
        events = self.poller.poll(0 if spin else 50)
        if not events and spin:
            end = time.perf_counter() + spin
            while not events and time.perf_counter() < end:
                events = self.poller.poll(0)
            if not events:
                events = self.poller.poll(50)
        self._own_lag(time.monotonic())  # before any heartbeat is read or judged
        for sock, _ in events:
            ep = self._endpoints.get(sock)
            if ep is not None:
                if ep is not self.front:
                    self._gen += 1
                ep.drain()
        now = time.monotonic()
        self._own_lag(now)
        if now - self._last_tick >= 0.05:
            self._last_tick = now
            self._tick(now)

    def _own_lag(self, now: float) -> None:
        away = self.clock.observe(now)
        if away:
            self.counters["head_stalls"] += 1
            credit_stall(self.engines.values(), away)
            self.leases.credit(away)
            log.warning("head_stalled", seconds=round(away, 3), note="credited to every engine and lease")

    def _shutdown(self) -> None:
        # Every accepted request gets its one error: nobody waits on a dead head.
        self.forwarding.fail_all(ErrorCode.ENGINE_DEAD, "the head (router) is shutting down")
        for ep in self._endpoints.values():
            ep.close()
        self.pub.close(linger=0)
        if self.gate is not None:
            self.gate.stop()
        if self._own_ctx:
            self.ctx.term()
        self.lifecycle = Lifecycle.STOPPED
        log.info("router_stopped")

    # ------------------------------------------------------------ health

    def _tick(self, now: float) -> None:
        self._gen += 1
        self.bus.tick(now)  # expiries first: health below already knows about them
        self.control.tick(now)  # a weight update open past weight_txn_timeout_s ends
        for expired in self.leases.tick(now):
            self._lease_expired(expired)
        self._evaluate_engines(now)
        self.sessions.expire(now)
        if self.gate is not None and self.gate.refresh(now):  # a key added or removed: re-read the allow-lists
            self._revoke_removed_keys()

    def _evaluate_engines(self, now: float) -> None:
        deadline = self.cfg.missed_heartbeats * self.cfg.heartbeat_interval_s
        cluster_version = self.control.cluster.version
        for e in list(self.engines.values()):
            self._evaluate_engine(e, now, deadline, cluster_version)

    def _evaluate_engine(self, e: EngineEntry, now: float, deadline: float, cluster_version: int) -> None:
        intended = self.control.intended
        converging = None
        if e.state is not EngineState.JOINING:  # the join steps bring it there first
            # A silent engine is not listening: it is judged, not corrected.
            fix = intended.evaluate(e.engine_id, now, send=e.state is not EngineState.SILENT)
            converging = intended.converging(e.engine_id)
            if fix is not None:
                self.control.correct(e, fix)
        state, reason = e.evaluate(
            now,
            deadline_s=deadline,
            stall_timeout_s=self.cfg.stall_timeout_s,
            cluster_version=cluster_version,
            converging=converging,
        )
        if state is not e.state:
            self._set_state(e, state, reason, now)
        e.reason = reason
        if e.state is EngineState.SILENT and e.silent_since and now - e.silent_since > self.cfg.forget_after_s:
            self._forget(e)

    def _recheck(self, engine_id: str) -> None:
        """What the head knows of one engine changed (heartbeat, ack): its
        health follows at once, never a tick later (health must not show a
        state it has not judged)."""
        e = self.engines.get(engine_id)
        if e is not None:
            deadline = self.cfg.missed_heartbeats * self.cfg.heartbeat_interval_s
            self._evaluate_engine(e, time.monotonic(), deadline, self.control.cluster.version)

    def _set_state(self, e: EngineEntry, state: EngineState, reason: str, now: float) -> None:
        old = e.state
        e.state = state
        log.info("engine_state", engine_id=e.engine_id, old=old.value, new=state.value, reason=reason)
        if state is EngineState.SILENT:
            e.silent_since = now
            self.bus.engine_gone(e.engine_id)
        elif state is EngineState.HEALTHY:
            e.silent_since = None
        if state in (EngineState.SILENT, EngineState.STALLED):
            self.forwarding.evacuate(e, reason)
            if self.prefix is not None:
                self.prefix.forget(e.engine_id)  # its cache may be gone: its prefixes move

    def _forget(self, e: EngineEntry) -> None:
        # Idempotent: a re-registration forgets the old entry, and evacuating it
        # may already have forgotten it (its join's ping completes as missing).
        if self.engines.get(e.engine_id) is e:
            self.engines.pop(e.engine_id)
            self.control.intended.remove(e.engine_id)
            if self.prefix is not None:
                self.prefix.forget(e.engine_id)
        ep = self._endpoints.pop(e.sock, None)
        if ep is not None:
            self.poller.unregister(e.sock)
            ep.close()
        log.info("engine_forgotten", engine_id=e.engine_id)

    def health(self) -> P.HealthView:
        return views.health_view(self.engines, self.control.intended, self.sessions, self.control.cluster, self._vocab)

    # ------------------------------------------------------------ events

    def _on_register(self, ident: bytes, reg: P.Register, _b: list[Any]) -> None:
        if reg.protocol_version != P.PROTOCOL_VERSION:
            err = f"protocol version {reg.protocol_version} != head's {P.PROTOCOL_VERSION}: upgrade the older side"
            log.error("register_refused", engine_id=reg.engine_id[:128], error=err)
            self.counters["register_refused"] += 1
            self.events.send(ident, P.RegisterReply(ok=False, error=err, code=ErrorCode.PROTOCOL.value))
            return
        old = self.engines.get(reg.engine_id)
        try:
            # First the credential: without it nothing of the Register is believed
            # (a stranger cannot take even a dead engine's id).
            self._check_join_token(reg.token, self.events.frames, what="Register")
            check_endpoint(reg.data_address, field="data_address")
            if reg.weight_address:
                check_endpoint(reg.weight_address, field="weight_address")
            if not reg.engine_id or len(reg.engine_id) > 128:
                raise BadRequest("engine_id must be 1-128 characters", field="engine_id")
            if not _ident_ok(ident, reg.engine_id, reg.incarnation):
                # The node connects with identity "engine_id/incarnation/NONCE";
                # heartbeats and acks are only believed from that connection.
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
            if reg.vocab_size and self._vocab and reg.vocab_size != self._vocab:
                raise BadRequest(
                    f"vocab_size {reg.vocab_size} != the cluster's {self._vocab} (the first registered engine's, or "
                    "the head's --vocab-size): every engine of a cluster must serve the same vocabulary",
                    field="vocab_size",
                )
            data_curve = self._engine_curve(reg)
        except (BadRequest, Unauthorized) as err:
            if isinstance(err, Unauthorized):
                self.counters["register_refused_token"] += 1
                event = "register_refused_token"
            else:
                self.counters["register_refused"] += 1
                event = "register_refused"
            log.warning(event, engine_id=reg.engine_id[:128], pid=reg.pid, field=err.field, error=err.message)
            reply = P.RegisterReply(ok=False, error=str(err), code=err.code.value, field=err.field)
            self.events.send(ident, reply)
            return
        now = time.monotonic()
        accepted = P.RegisterReply(
            ok=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s, data_peer=self._data_identity.decode()
        )
        old = self.engines.get(reg.engine_id)
        deadline = self.cfg.missed_heartbeats * self.cfg.heartbeat_interval_s
        admission, why = admit_register(old, reg, now, deadline_s=deadline)
        if admission is Admission.REPEAT:
            self.events.send(ident, accepted)
            return
        if admission is Admission.TAKEN:
            log.warning(
                "register_refused_id_taken", engine_id=reg.engine_id, incarnation=reg.incarnation, pid=reg.pid,
                host=reg.host, data=reg.data_address, error=why,
            )  # fmt: skip
            self.events.send(ident, P.RegisterReply(ok=False, error=why, retry=True))
            return
        if old is not None:  # restarted process under the same id: what it ran is gone
            self.forwarding.evacuate(old, f"engine {reg.engine_id} restarted")
            self.bus.engine_gone(reg.engine_id)
            self._forget(old)
        sock = open_socket(
            self.ctx, zmq.DEALER, connect=reg.data_address, curve=data_curve, identity=self._data_identity
        )
        e = EngineEntry(reg=reg, sock=sock, registered_at=now, last_seen=now, steps_changed_at=now, ident=ident)
        if not self._vocab and reg.vocab_size > 0:
            self._vocab = reg.vocab_size  # the cluster's vocabulary from now on
        e.loras = set(reg.loras)
        e.weight_version = reg.weight_version
        self.engines[reg.engine_id] = e
        handlers = self.forwarding.engine_handlers(e, lambda: ep)
        # Acks come over the data connection too (behind the chunks produced before them).
        handlers[P.Ack] = lambda _peer, ack, buffers: self._on_data_ack(e, ack, buffers)
        ep = Endpoint(
            sock,
            self.codec,
            handlers,
            name=f"engine {reg.engine_id}",
            routed=False,
            error_reply=None,
        )
        self._endpoints[sock] = ep
        self.poller.register(sock, zmq.POLLIN)
        self.events.send(ident, accepted)
        log.info("engine_registered", engine_id=reg.engine_id, data=reg.data_address, backend=reg.backend)
        self.control.join(e)

    def _engine_curve(self, reg: P.Register) -> Any:
        """Keys to connect to the engine's data socket: its own CURVE key, which
        must be an allowed engine credential (else the head would hand requests
        to a server nobody vouched for)."""
        if self._curve is None or self.gate is None or not reg.data_address.startswith("tcp://"):
            return None
        if not self.gate.allows(auth.ENGINES, reg.curve_key.encode()):
            raise BadRequest(
                "curve_key is not an engine credential of this cluster (engines/*.key of the head's curve_dir)",
                field="curve_key",
            )
        return self._curve.connecting_to(reg.curve_key.encode())

    def _engine_of(self, ident: bytes, engine_id: str, what: str) -> EngineEntry | None:
        """The registered engine `engine_id` if this message came over ITS events
        connections (the loop's, and the heartbeat thread's ".../hb"). Hazard:
        without --curve anyone who reaches the events socket
        could otherwise speak for an engine (a forged ack of a commit, a heartbeat
        with another weight version); a second connection cannot take a live
        identity (ROUTER without handover), so the identity is the credential,
        and its NONCE part, secret to the engine process, keeps it from being
        re-used once that process is dead."""
        e = self.engines.get(engine_id)
        if e is None:
            return None
        own = e.ident
        if ident != own and ident != own + b"/hb":
            self.counters["spoofed_events"] += 1
            if self.counters["spoofed_events"] <= 10 or self.counters["spoofed_events"] % 1000 == 0:
                log.warning("engine_event_from_another_connection", engine_id=engine_id, what=what)
            return None
        return e

    def _on_heartbeat(self, ident: bytes, hb: P.Heartbeat, _b: list[Any]) -> None:
        if hb.engine_id not in self.engines:
            self._ask_rejoin(ident, hb.engine_id)
            return
        e = self._engine_of(ident, hb.engine_id, "heartbeat")
        if e is not None and e.reg.incarnation == hb.incarnation:
            e.on_heartbeat(hb, time.monotonic())
            self.control.intended.heartbeat(hb.engine_id, hb)
            self._recheck(hb.engine_id)

    def _ask_rejoin(self, ident: bytes, engine_id: str) -> None:
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
        self.events.send(loop_ident, P.Rejoin(reason="the head does not know this engine (it restarted)"))

    def _on_data_ack(self, e: EngineEntry, ack: P.Ack, buffers: list[Any]) -> None:
        """An ack over the engine's data connection (the head's own, so it is
        the engine's): every chunk it produced before the ack is relayed first."""
        if ack.engine_id != e.engine_id or self.engines.get(e.engine_id) is not e:
            return
        self.control.on_ack(b"", ack, buffers)
        self._recheck(ack.engine_id)

    def _on_ack(self, peer: bytes, ack: P.Ack, buffers: list[Any]) -> None:
        if self._engine_of(peer, ack.engine_id, "ack") is None:
            return  # a forged ack, or one of an engine the head does not know (any more)
        self.control.on_ack(peer, ack, buffers)
        self._recheck(ack.engine_id)

    # ------------------------------------------------------------ trust

    def _check_join_token(self, given: str, frames: list[Any], *, what: str) -> None:
        """Raise Unauthorized unless the message carries the cluster's join
        token or came over a CURVE-authenticated connection (ZAP vouched for
        its key: the allow-list is the credential there)."""
        if self.token is None:
            return
        if frames and peer_key(frames[0]) is not None:
            return
        if given and token_matches(self.token, given):
            return
        why = "a wrong join token" if given else "no join token"
        raise Unauthorized(
            f"{what} with {why}: this cluster needs its join token (the 0600 file launch.py made: engines "
            "--token-file or $ROLLOUT_BUS_TOKEN_FILE, clients Client(..., token_file=...) or the file launch.py "
            "publishes for its address; README, Security)",
            field="token",
        )

    def _on_control(self, client: bytes, msg: P.Control, buffers: list[Any]) -> None:
        if type(msg.op) not in READ_ONLY_OPS:
            try:
                self._check_join_token(msg.token, self.front.frames, what=f"control op {P.OP_NAMES[type(msg.op)]}")
            except Unauthorized as e:
                self.counters["unauthorized"] += 1
                log.warning("control_refused_token", op=P.OP_NAMES[type(msg.op)], request_id=msg.request_id[:128])
                e.request_id = msg.request_id
                raise
        self.control.on_control(client, msg, buffers)  # raises on a refused op: nothing held
        now = time.monotonic()
        self.leases.seen(client, now)
        hook = _LEASE_HOOKS.get(type(msg.op))
        if hook is not None:
            hook(self, client, msg, now)

    def _keyed(self, handler: Any) -> Any:
        """A frontend handler that first checks the peer's CURVE key is still
        allowed (removing a key must cut connections already open, not only new
        handshakes). No-op without --curve."""
        gate = self.gate
        if gate is None:
            return handler

        def run(client: bytes, msg: Any, buffers: list[Any]) -> None:
            key = peer_key(self.front.frames[0]) if self.front.frames else None
            if key is not None:
                if not gate.allows(auth.CLIENTS, key.encode()):
                    self.counters["unauthorized"] += 1
                    raise Unauthorized(
                        f"client key {key} was removed from the head's clients allow-list",
                        request_id=getattr(msg, "request_id", None),
                        field="client_key",
                    )
                if client not in self._client_keys:
                    if len(self._client_keys) >= _MAX_TRACKED_CLIENT_KEYS:  # bounded: the oldest goes
                        self._client_keys.pop(next(iter(self._client_keys)))
                    self._client_keys[client] = key
            handler(client, msg, buffers)

        return run

    def _client_gone(self, client: bytes) -> None:
        self._client_keys.pop(client, None)
        self.forwarding.client_gone(client)

    def _revoke_removed_keys(self) -> None:
        """The allow-lists changed: every frontend peer whose key left them has
        its requests ended (typed Unauthorized, engines told to cancel) and its
        further frames refused (_keyed). ZeroMQ cannot close one peer of a
        ROUTER, so the cut is by refusal."""
        assert self.gate is not None
        for client, key in list(self._client_keys.items()):
            if self.gate.allows(auth.CLIENTS, key.encode()):
                continue
            del self._client_keys[client]
            self.counters["clients_revoked"] += 1
            flights = [f for f in self.forwarding.flights.values() if f.client == client]
            log.warning("client_key_revoked", key=key, requests_ended=len(flights))
            for fl in flights:
                self.forwarding.fail_flight(
                    fl,
                    ErrorCode.UNAUTHORIZED,
                    f"client key {key} was removed from the head's clients allow-list",
                    "client_key",
                )

    # ------------------------------------------------------------ frontend queries

    def _on_end_session(self, client: bytes, msg: P.EndSession, _: list[Any]) -> None:
        ended = self.sessions.end(msg.session_id)
        self._reply(client, P.QueryReply(request_id=msg.request_id, body=P.SessionEnded(ended=ended)))

    def _on_query(self, client: bytes, msg: P.Query, _: list[Any]) -> None:
        fn = self._queries.get(msg.what)
        if fn is None:
            raise BadRequest(
                f"unknown query {truncate(repr(msg.what), 64)} (one of {sorted(self._queries)})",
                request_id=msg.request_id,
                field="what",
            )
        now = time.monotonic()
        hit = self._query_cache.get(msg.what)
        if hit is None or hit[1] != self._gen or now - hit[0] >= self.cfg.query_cache_s:
            hit = self._query_cache[msg.what] = (now, self._gen, fn())
        self._reply(client, P.QueryReply(request_id=msg.request_id, body=hit[2]))

    def _changes(self, handler: Any) -> Any:
        """`handler`, marking the cached query answers out of date."""

        def run(peer: bytes, msg: Any, buffers: list[Any]) -> None:
            self._gen += 1
            handler(peer, msg, buffers)

        return run

    def _client_over_hwm(self, client: bytes) -> None:
        """The frontend queue to `client` is full (cfg.client_hwm messages it
        has not read): the head stops buffering for it and cancels its
        requests; it learns by its own timeout (nothing more can reach it)."""
        self.counters["client_over_hwm"] += 1
        log.warning("client_over_hwm", client=client.hex()[:64], client_hwm=self.cfg.client_hwm)
        self.forwarding.client_gone(client)

    def _reply(self, client: bytes, msg: Any) -> None:
        # Chunks relayed before this reply leave first (a pause's reply never
        # overtakes the chunks produced before the pause).
        self.forwarding.flush()
        self.front.send(client, msg)

    # ------------------------------------------------------------ leases

    def _on_client_ping(self, client: bytes, _msg: P.ClientPing, _b: list[Any]) -> None:
        self.leases.seen(client, time.monotonic())
        self.front.send(client, P.HeadPong(lease_s=self.cfg.lease_s, incarnation=self.incarnation))

    def _lease_expired(self, x: L.Expired) -> None:
        kind, name = x.resource
        self.counters["leases_expired"] += 1
        log.warning(
            "lease_expired", client=x.client.hex(), resource=kind, name=name, silent_s=round(x.silent_s, 2),
            lease_s=self.cfg.lease_s,
        )  # fmt: skip
        if kind == "pause":
            self.control.release(P.Resume(lora=None if name == "*" else name))
        elif kind == "sleep":
            self.control.release(P.WakeUp())
        elif kind == "txn":
            # the one-update-at-a-time holder (router_node/control.py) ends with it
            self.control.abort_held_by(x.client, f"its client vanished (no ping for lease_s={self.cfg.lease_s})")

    def _before_error(self) -> None:
        self.forwarding.flush()  # chunks already produced go out before the error
        self.counters["errors"] += 1


def run_router_node(argv: list[str] | None = None) -> int:
    """Entry point: `python -m router_node …`."""
    from bus.runtime import become_child_process
    from router_node.config import parse_args

    cfg = parse_args(argv)
    become_child_process("rollout-bus router_node")
    from bus.profiler import start_from_env

    start_from_env("head")  # benchmarks only: ROLLOUT_BUS_PROFILE_DIR
    try:
        router = Router(cfg)
    except KeyFileError as e:  # an unreadable or group-readable token / key file: say which
        log.error("head_refused_to_start", field=e.field, error=str(e))
        return 2
    if cfg.metrics_port >= 0:
        from router_node.metrics import serve_metrics

        router.addresses["metrics"] = (
            f"http://{cfg.metrics_host}:{serve_metrics(router, cfg.metrics_port, cfg.metrics_host)}/metrics"
        )
    signal.signal(signal.SIGTERM, router.request_stop)
    signal.signal(signal.SIGINT, router.request_stop)
    ready = getattr(cfg, "ready_file", None)
    if ready:
        tmp = ready + ".tmp"
        with open(tmp, "w") as f:
            json.dump(router.addresses, f)
        os.replace(tmp, ready)
    return router.run()


def _ident_ok(ident: bytes, engine_id: str, incarnation: str) -> bool:
    """The events-socket identity an engine node connects with
    (engine_node/node.py): "engine_id/incarnation/NONCE", NONCE 32+ hex chars."""
    prefix = f"{engine_id}/{incarnation}/".encode()
    nonce = ident[len(prefix) :]
    return ident.startswith(prefix) and len(nonce) >= 32 and all(c in b"0123456789abcdef" for c in nonce)


def _hold_pause(router: Router, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:  # a cluster-wide pause (the intended state's) is held
        assert isinstance(msg.op, P.Pause)
        router.leases.acquired(client, L.pause(msg.op.lora), now)


def _drop_pause(router: Router, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.Resume)
    if msg.op.lora is None:
        router.leases.released_kind("pause")  # a resume of every scope, by anyone
    else:
        router.leases.released(L.pause(msg.op.lora))


def _hold_sleep(router: Router, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:
        router.leases.acquired(client, L.SLEEP, now)


def _drop_sleep(router: Router, client: bytes, msg: P.Control, now: float) -> None:
    # Tags wake one by one (SkyRL: weights, then kv_cache): the sleep is let go
    # of once the cluster intends nothing asleep, whatever the split.
    if not router.control.intended.cluster.asleep:
        router.leases.released(L.SLEEP)


def _hold_txn(router: Router, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.BeginWeightUpdate)
    router.leases.acquired(client, L.txn(msg.op.update_id), now)


def _drop_txn(router: Router, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, (P.FinishWeightUpdate, P.AbortWeightUpdate))
    router.leases.released(L.txn(msg.op.update_id))


# What a client's control op takes or lets go of (router_node/leases.py).
_LEASE_HOOKS: dict[type, Any] = {
    P.Pause: _hold_pause,
    P.Resume: _drop_pause,
    P.Sleep: _hold_sleep,
    P.WakeUp: _drop_sleep,
    P.BeginWeightUpdate: _hold_txn,
    P.FinishWeightUpdate: _drop_txn,
    P.AbortWeightUpdate: _drop_txn,
}
