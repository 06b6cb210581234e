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
import json
import os
import signal
import time
import uuid
from typing import Any

import structlog
import zmq

from bus import auth
from bus import protocol as P
from bus.auth import Gatekeeper, KeyDir
from bus.codec import Codec
from bus.control_bus import ControlBus
from bus.endpoint import Endpoint, open_socket
from bus.errors import BadRequest, ErrorCode
from bus.sockets import CONTROL_HWM, bound_address, check_endpoint
from router_node import leases as L
from router_node.config import RouterConfig
from router_node.control import ClusterControl
from router_node.forwarding import Forwarder
from router_node.intended_state import full_wake
from router_node.leases import Leases
from router_node.policies import POLICIES, SESSION_PLACEMENTS, Sessions
from router_node.registry import Admission, EngineEntry, EngineState, LoopClock, admit_register, credit_stall

log = structlog.get_logger("router_node")


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
        if cfg.session_placement not in SESSION_PLACEMENTS:
            raise ValueError(
                f"--session-placement must be one of {sorted(SESSION_PLACEMENTS)}, got {cfg.session_placement!r}"
            )
        self.engines: dict[str, EngineEntry] = {}
        self.sessions = Sessions(cfg.session_ttl_s)
        self.counters = {
            "requests": 0,
            "errors": 0,
            "failovers": 0,
            "engine_dead": 0,
            "no_healthy_engine": 0,
            "spoofed_events": 0,  # heartbeats / acks whose connection is not the engine's own
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
            pick=POLICIES[cfg.policy],
            place_session=SESSION_PLACEMENTS[cfg.session_placement],
            counters=self.counters,
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
            open_socket(self.ctx, zmq.ROUTER, bind=cfg.frontend, curve=self._curve, zap_domain=auth.CLIENTS),
            self.codec,
            {
                P.Generate: fw.on_generate,
                P.Cancel: fw.on_cancel,
                P.Control: self._on_control,
                P.Query: self._on_query,
                P.EndSession: self._on_end_session,
                P.ClientPing: self._on_client_ping,
            },
            name="frontend",
            routed=True,
            before_error=self._before_error,
            on_peer_gone=fw.client_gone,
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
        self._queries: dict[str, Any] = {
            "health": self.health,
            # weight updates begun and not decided yet (a sender rank joins one by id)
            "weight_updates": lambda: self.control.cluster.open_updates(),
            # every tracked update's decision (a cuda_ipc sender waits for its commit round)
            "weight_update_decisions": lambda: self.control.cluster.decisions(),
            "engines": lambda: {"engines": [e.describe(time.monotonic()) for e in self.engines.values()]},
            "stats": lambda: {
                "counters": dict(self.counters),
                "in_flight": len(self.forwarding.flights),
                "sessions": self.sessions.count(),
            },
        }
        self._last_tick = 0.0

    # ------------------------------------------------------------ lifecycle

    def request_stop(self, *_: Any) -> None:
        """Signal handler: only flips the lifecycle."""
        self.lifecycle = Lifecycle.STOPPING

    def run(self) -> int:
        self.lifecycle = Lifecycle.SERVING
        log.info("router_serving", **self.addresses, policy=self.cfg.policy)
        try:
            while self.lifecycle is Lifecycle.SERVING:
                self._turn()
        finally:
            self._shutdown()
        return 0

    def _turn(self) -> None:
        events = self.poller.poll(50)
        self._own_lag(time.monotonic())  # before any heartbeat is read or judged
        for sock, _ in events:
            ep = self._endpoints.get(sock)
            if ep is not None:
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
        self.bus.tick(now)  # expiries first: health below already knows about them
        for expired in self.leases.tick(now):
            self._lease_expired(expired)
        self._evaluate_engines(now)
        self.sessions.expire(now)
        if self.gate is not None:
            self.gate.refresh(now)  # a client key added or removed: re-read the allow-lists

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

    def _forget(self, e: EngineEntry) -> None:
        # Idempotent: a re-registration forgets the old entry, and evacuating it
        # may already have forgotten it (its join's ping completes as missing).
        if self.engines.get(e.engine_id) is e:
            self.engines.pop(e.engine_id)
            self.control.intended.remove(e.engine_id)
        ep = self._endpoints.pop(e.sock, None)
        if ep is not None:
            self.poller.unregister(e.sock)
            ep.close()
        log.info("engine_forgotten", engine_id=e.engine_id)

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        intended = self.control.intended
        engines = {
            eid: {**e.describe(now), **intended.describe(eid), "sessions": self.sessions.count(eid)}
            for eid, e in self.engines.items()
        }
        return {
            "healthy": any(e.healthy for e in self.engines.values()),
            "engines": engines,
            **self.control.cluster.describe(),
            "stale": sorted(eid for eid, e in self.engines.items() if e.state is EngineState.STALE),
            "intended": intended.cluster.describe(),
            "converging": sorted(eid for eid, e in self.engines.items() if e.state is EngineState.CONVERGING),
        }

    # ------------------------------------------------------------ events

    def _on_register(self, ident: bytes, reg: P.Register, _b: list[Any]) -> None:
        if reg.protocol_version != P.PROTOCOL_VERSION:
            err = f"protocol version {reg.protocol_version} != head's {P.PROTOCOL_VERSION}: upgrade the older side"
            log.error("register_refused", engine_id=reg.engine_id, error=err)
            self.events.send(ident, P.RegisterReply(ok=False, error=err))
            return
        try:
            check_endpoint(reg.data_address, field="data_address")
            if reg.weight_address:
                check_endpoint(reg.weight_address, field="weight_address")
            if not reg.engine_id or len(reg.engine_id) > 128:
                raise BadRequest("engine_id must be 1-128 characters", field="engine_id")
            if ident != _engine_ident(reg.engine_id, reg.incarnation):
                # The node connects with identity "engine_id/incarnation"; heartbeats
                # and acks are only believed from that connection (_engine_of).
                raise BadRequest(
                    "the events connection's identity must be 'engine_id/incarnation' of the Register",
                    field="incarnation",
                )
            data_curve = self._engine_curve(reg)
        except BadRequest as err:
            log.warning("register_refused", engine_id=reg.engine_id[:128], error=str(err))
            self.events.send(ident, P.RegisterReply(ok=False, error=str(err)))
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
        e = EngineEntry(reg=reg, sock=sock, registered_at=now, last_seen=now, steps_changed_at=now)
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
        identity (ROUTER without handover), so the identity is the credential."""
        e = self.engines.get(engine_id)
        if e is None:
            return None
        own = _engine_ident(e.reg.engine_id, e.reg.incarnation)
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
        if self._engine_of(peer, ack.engine_id, "ack") is None and ack.engine_id in self.engines:
            return  # a forged ack for a registered engine
        self.control.on_ack(peer, ack, buffers)
        self._recheck(ack.engine_id)

    # ------------------------------------------------------------ frontend queries

    def _on_end_session(self, client: bytes, msg: P.EndSession, _: list[Any]) -> None:
        ended = self.sessions.end(msg.session_id)
        self._reply(client, P.QueryReply(request_id=msg.request_id, body={"ended": ended}))

    def _on_query(self, client: bytes, msg: P.Query, _: list[Any]) -> None:
        fn = self._queries.get(msg.what)
        if fn is None:
            raise BadRequest(
                f"unknown query {msg.what!r} (one of {sorted(self._queries)})", request_id=msg.request_id, field="what"
            )
        self._reply(client, P.QueryReply(request_id=msg.request_id, body=fn()))

    def _reply(self, client: bytes, msg: Any) -> None:
        # Chunks relayed before this reply leave first (a pause's reply never
        # overtakes the chunks produced before the pause).
        self.forwarding.flush()
        self.front.send(client, msg)

    # ------------------------------------------------------------ leases

    def _on_client_ping(self, client: bytes, _msg: P.ClientPing, _b: list[Any]) -> None:
        self.leases.seen(client, time.monotonic())
        self.front.send(client, P.HeadPong(lease_s=self.cfg.lease_s))

    def _on_control(self, client: bytes, msg: P.Control, buffers: list[Any]) -> None:
        self.control.on_control(client, msg, buffers)  # raises on a refused op: nothing held
        now = time.monotonic()
        self.leases.seen(client, now)
        hook = _LEASE_HOOKS.get(type(msg.op))
        if hook is not None:
            hook(self.leases, client, msg, now)

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
            self.control.abort_update(name, f"its client vanished (no ping for lease_s={self.cfg.lease_s})")

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
    router = Router(cfg)
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


def _hold_pause(leases: Leases, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:  # a cluster-wide pause (the intended state's) is held
        assert isinstance(msg.op, P.Pause)
        leases.acquired(client, L.pause(msg.op.lora), now)


def _drop_pause(leases: Leases, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.Resume)
    if msg.op.lora is None:
        leases.released_kind("pause")  # a resume of every scope, by anyone
    else:
        leases.released(L.pause(msg.op.lora))


def _hold_sleep(leases: Leases, client: bytes, msg: P.Control, now: float) -> None:
    if msg.targets is None:
        leases.acquired(client, L.SLEEP, now)


def _drop_sleep(leases: Leases, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.WakeUp)
    if full_wake(msg.op):
        leases.released(L.SLEEP)


def _hold_txn(leases: Leases, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, P.BeginWeightUpdate)
    leases.acquired(client, L.txn(msg.op.update_id), now)


def _drop_txn(leases: Leases, client: bytes, msg: P.Control, now: float) -> None:
    assert isinstance(msg.op, (P.FinishWeightUpdate, P.AbortWeightUpdate))
    leases.released(L.txn(msg.op.update_id))


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


def _engine_ident(engine_id: str, incarnation: str) -> bytes:
    """The events-socket identity an engine node connects with (engine_node/node.py)."""
    return f"{engine_id}/{incarnation}".encode()
