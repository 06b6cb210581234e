"""The head process: the thin shell around the registry, forwarding
(router_node/forwarding.py over router_node/forwarding_core.py), cluster
control (router_node/control.py) and registration (router_node/registration.py,
checks in router_node/trust.py). The entry point is router_node/main.py.

One thread owns every socket: the frontend ROUTER (clients), the events
ROUTER (engines' register/heartbeat/ack), the control PUB, and one DEALER per
engine data socket — each served by a bus.endpoint.Endpoint (decode → handler
table → typed Error reply). This module keeps the loop, the sockets' handler
tables, health ticks, leases and queries.
"""

from __future__ import annotations

import enum
import gc
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import auth, roles
from bus import protocol as P
from bus.auth import peer_key
from bus.codec import Codec
from bus.control_bus import ControlBus
from bus.endpoint import Endpoint, open_socket
from bus.errors import BadRequest, ErrorCode, Unauthorized, truncate
from bus.ratelog import RateLimitedLog
from bus.sockets import CONTROL_HWM, bound_address
from router_node import leases as L
from router_node import views
from router_node.config import RouterConfig
from router_node.control import ClusterControl
from router_node.counters import new_counters
from router_node.data_links import DataLinkWatch
from router_node.forwarding import Forwarder
from router_node.lease_hooks import LEASE_HOOKS, lease_release, resume_held
from router_node.leases import Leases
from router_node.policies import POLICIES, SESSION_PLACEMENTS, Sessions, check_policies, pick_least_loaded_exact
from router_node.prefix import PrefixPlacement
from router_node.registration import Registrar
from router_node.registry import EngineEntry, EngineState, LoopClock, credit_stall
from router_node.trust import check_join_token, engine_of, head_security

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
        self._secure(cfg)
        # CURVE key of each frontend peer (routing id -> z85), so removing a key
        # from the allow-list cuts what that peer has open (_revoke_removed_keys).
        self._client_keys: dict[bytes, str] = {}
        check_policies(cfg.policy, cfg.session_placement)
        # --policy prefix: requests without a session follow their prompt's prefix
        self.prefix = PrefixPlacement.from_config(cfg) if cfg.policy == "prefix" else None
        self.engines: dict[str, EngineEntry] = {}
        self.sessions = Sessions(cfg.session_ttl_s)
        self.counters = new_counters()
        self.refusals = RateLimitedLog(log)  # refusals of peers: one log line per interval per kind
        self.incarnation = uuid.uuid4().hex[:12]  # public: every HeadPong carries it
        self.registrar = Registrar(
            cfg,
            self.ctx,
            self.codec,
            self.engines,
            self.counters,
            # This head's identity on every engine's data socket (RegisterReply.data_peer):
            # engines send their acks there, behind the chunks they produced first.
            # Random, never the public incarnation (the data socket admits the head
            # alone anyway: bus/roles.py).
            data_identity=f"head/{secrets.token_hex(16)}".encode(),
            token=self.token,
            gate=self.gate,
            curve=self._curve,
        )
        self.leases = Leases(cfg.lease_s)
        # A head that was itself stopped must not blame its peers for its own
        # stall: time away from the loop longer than one heartbeat interval is
        # credited to every engine and lease (registry.LoopClock).
        self.clock = LoopClock(threshold_s=max(cfg.heartbeat_interval_s, 0.25))
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
        self.forwarding.on_unreachable = lambda e: self._recheck(e.engine_id)
        self.pub = open_socket(
            self.ctx, zmq.PUB, bind=cfg.control, hwm=CONTROL_HWM, curve=self._curve, zap_domain=auth.ENGINES,
            plain=self._plain,
        )  # fmt: skip
        self.bus = ControlBus(self.pub, self.codec)
        self.control = ClusterControl(
            cfg,
            self.bus,
            self.engines,
            reply=self._reply,
            forget=self._forget,
            reevaluate=self._evaluate_engines,
            incarnation=self.incarnation,
        )
        self._open_endpoints(cfg)
        self._queries = self._query_table()
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

    def _secure(self, cfg: RouterConfig) -> None:
        # Every socket authenticates its peer at the handshake (router_node/trust.py
        # head_security); the token also rides in Register and state-changing ops.
        self.gate, self._curve, self.token = head_security(self.ctx, cfg)
        self._plain = roles.serving(self.token)  # None: no token, these sockets take NULL
        if self.token is None and self.gate is None:
            log.warning(
                "head_open_to_anyone",
                hint="no --token-file and no --curve-dir: any process that reaches the events socket may register "
                "engines and any client may pause or update the cluster (launch.py always makes a token)",
            )

    def _open_endpoints(self, cfg: RouterConfig) -> None:
        fw = self.forwarding
        self.front = Endpoint(
            open_socket(
                self.ctx,
                zmq.ROUTER,
                bind=cfg.frontend,
                hwm=cfg.client_hwm,
                curve=self._curve,
                zap_domain=auth.CLIENTS,
                plain=self._plain,
            ),  # fmt: skip
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
            counters=self.counters,
        )
        fw.front = self.front
        self.events = Endpoint(
            open_socket(
                self.ctx,
                zmq.ROUTER,
                bind=cfg.events,
                hwm=CONTROL_HWM,
                curve=self._curve,
                zap_domain=auth.ENGINES,
                plain=self._plain,
            ),  # fmt: skip
            self.codec,
            {P.Register: self._on_register, P.Heartbeat: self._on_heartbeat, P.Ack: self._on_ack},
            name="events",
            routed=True,
            error_reply=None,
            counters=self.counters,
        )
        self.frontend = self.front.sock
        self.addresses = {
            "frontend": bound_address(self.front.sock),
            "events": bound_address(self.events.sock),
            "control": bound_address(self.pub),
        }
        self.poller = zmq.Poller()
        self._endpoints: dict[zmq.Socket, Endpoint | DataLinkWatch] = {
            self.front.sock: self.front,
            self.events.sock: self.events,
        }
        self._watches: dict[zmq.Socket, DataLinkWatch] = {}  # engine DEALER -> its monitor (data_links.py)
        for sock in self._endpoints:
            self.poller.register(sock, zmq.POLLIN)

    def _query_table(self) -> dict[str, Callable[[], P.QueryBody]]:
        """Query.what -> its answer (bus/views.py: P.QUERY_BODIES names the body of each)."""
        return {
            "health": self.health,
            "weight_updates": self.control.cluster.open_updates,
            "weight_update_decisions": self.control.cluster.decisions,
            "engines": lambda: views.engines_view(self.engines, self.control.intended, self.sessions),
            "stats": lambda: views.stats_view(
                {**self.counters, "handshakes_refused": self.gate.refused_total() if self.gate else 0},
                len(self.forwarding.flights),
                self.sessions,
                self.prefix,
            ),
        }

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
        observe = self.clock.observe  # twice per turn (per message): one call when nothing stalled
        away = observe(time.monotonic())
        if away:
            self._stalled(away)  # before any heartbeat is read or judged
        for sock, _ in events:
            ep = self._endpoints.get(sock)
            if ep is not None:
                if ep is not self.front:
                    self._gen += 1
                ep.drain()
        now = time.monotonic()
        away = observe(now)
        if away:
            self._stalled(away)
        if now - self._last_tick >= 0.05:
            self._last_tick = now
            self._tick(now)

    def _stalled(self, away: float) -> None:
        """The head's own loop was away `away` s past the threshold (LoopClock)."""
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
        for rl in (self.refusals, self.registrar.refusals, self.front.refusals, self.events.refusals):
            rl.flush()
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
            if converging is None and self.control.cluster.settling(now):
                converging = (
                    f"converging: the restarted head adopts the highest weight version engines bring "
                    f"(adopt_window_s={self.cfg.adopt_window_s}); nothing is routed before"
                )
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
            self.forwarding.forget_engine(e.engine_id)
            if self.prefix is not None:
                self.prefix.forget(e.engine_id)
        watch = self._watches.pop(e.sock, None)
        if watch is not None:  # before its socket closes: the monitor is that socket's
            self._endpoints.pop(watch.sock, None)
            self.poller.unregister(watch.sock)
            watch.close()
        ep = self._endpoints.pop(e.sock, None)
        if ep is not None:
            self.poller.unregister(e.sock)
            ep.close()
        log.info("engine_forgotten", engine_id=e.engine_id)

    def health(self) -> P.HealthView:
        return views.health_view(
            self.engines, self.control.intended, self.sessions, self.control.cluster, self.registrar.vocab
        )

    # ------------------------------------------------------------ events

    def _on_register(self, ident: bytes, reg: P.Register, _b: list[Any]) -> None:
        send = self.events.send
        checked = self.registrar.check(reg, ident, self.events.frames, send)
        if checked is None or not self.registrar.admit(reg, ident, send):
            return
        old = self.engines.get(reg.engine_id)
        if old is not None:  # restarted process under the same id: what it ran is gone
            self.forwarding.evacuate(old, f"engine {reg.engine_id} restarted")
            self.bus.engine_gone(reg.engine_id)
            self._forget(old)
        e = self.registrar.connect(reg, ident, checked[0])
        self.engines[reg.engine_id] = e
        handlers = self.forwarding.engine_handlers(e, lambda: ep)
        # Acks come over the data connection too (behind the chunks produced before them).
        handlers[P.Ack] = lambda _peer, ack, buffers: self._on_data_ack(e, ack, buffers)
        ep = Endpoint(
            e.sock,
            self.codec,
            handlers,
            name=f"engine {reg.engine_id}",
            routed=False,
            error_reply=None,
            after_drain=self.forwarding.after_drain,  # what the drain gathered for clients leaves
        )
        self._endpoints[e.sock] = ep
        self.poller.register(e.sock, zmq.POLLIN)
        watch = DataLinkWatch(e, dropped=self.forwarding.link_dropped, refused=self.forwarding.link_refused)
        self._endpoints[watch.sock] = self._watches[e.sock] = watch
        self.poller.register(watch.sock, zmq.POLLIN)
        send(ident, self.registrar.accepted())
        log.info("engine_registered", engine_id=reg.engine_id, data=reg.data_address, backend=reg.backend)
        self.control.join(e)

    def _on_heartbeat(self, ident: bytes, hb: P.Heartbeat, _b: list[Any]) -> None:
        if hb.engine_id not in self.engines:
            self.registrar.ask_rejoin(ident, hb.engine_id, self.events.send)
            return
        e = engine_of(self.engines, self.counters, ident, hb.engine_id, "heartbeat")
        if e is not None and e.reg.incarnation == hb.incarnation:
            e.on_heartbeat(hb, time.monotonic())
            self.control.intended.heartbeat(hb.engine_id, hb)
            self._recheck(hb.engine_id)

    def _on_data_ack(self, e: EngineEntry, ack: P.Ack, buffers: list[Any]) -> None:
        """An ack over the engine's data connection (the head's own, so it is
        the engine's): every chunk it produced before the ack is relayed first."""
        if ack.engine_id != e.engine_id or self.engines.get(e.engine_id) is not e:
            return
        self.control.on_ack(b"", ack, buffers)
        self._recheck(ack.engine_id)

    def _on_ack(self, peer: bytes, ack: P.Ack, buffers: list[Any]) -> None:
        if engine_of(self.engines, self.counters, peer, ack.engine_id, "ack") is None:
            return  # a forged ack, or one of an engine the head does not know (any more)
        self.control.on_ack(peer, ack, buffers)
        self._recheck(ack.engine_id)

    # ------------------------------------------------------------ trust

    def _on_control(self, client: bytes, msg: P.Control, buffers: list[Any]) -> None:
        if type(msg.op) not in READ_ONLY_OPS:
            try:
                what = f"control op {P.OP_NAMES[type(msg.op)]}"
                check_join_token(self.token, msg.token, self.front.frames, what=what)
            except Unauthorized as e:
                self.counters["unauthorized"] += 1
                self.refusals.refused(
                    "control_refused_token", op=P.OP_NAMES[type(msg.op)], request_id=msg.request_id[:128]
                )
                e.request_id = msg.request_id
                raise
        now = time.monotonic()
        held = resume_held(self.leases, self.control.intended, client, msg)
        if held is not None:  # another client still holds the pause: only this one's hold ends
            for op in held:
                self.control.release(op)
            self.leases.seen(client, now)
            self._reply(client, P.ControlReply(request_id=msg.request_id))
            return
        self.control.on_control(client, msg, buffers)  # raises on a refused op: nothing held
        self.leases.seen(client, now)
        hook = LEASE_HOOKS.get(type(msg.op))
        if hook is not None:
            hook(self.leases, self.control.intended, client, msg, now)

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
            ended = sum(1 for f in self.forwarding.flights.values() if f.client == client)
            log.warning("client_key_revoked", key=key, requests_ended=ended)
            why = f"client key {key} was removed from the head's clients allow-list"
            self.forwarding.fail_client(client, ErrorCode.UNAUTHORIZED, why, "client_key")

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
        pong = P.HeadPong(self.cfg.lease_s, self.incarnation, self.cfg.max_inflight_per_client)
        self.front.send(client, pong)

    def _lease_expired(self, x: L.Expired) -> None:
        kind, name = x.resource
        self.counters["leases_expired"] += 1
        log.warning(
            "lease_expired", client=x.client.hex(), resource=kind, name=name, silent_s=round(x.silent_s, 2),
            lease_s=self.cfg.lease_s,
        )  # fmt: skip
        op = lease_release(x)
        if op is not None:
            self.control.release(op)
        elif kind == "txn":
            # the one-update-at-a-time holder (router_node/control.py) ends with it
            self.control.abort_held_by(x.client, f"its client vanished (no ping for lease_s={self.cfg.lease_s})")

    def _before_error(self) -> None:
        self.forwarding.flush()  # chunks already produced go out before the error
        self.counters["errors"] += 1
