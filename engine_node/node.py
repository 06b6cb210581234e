"""The engine node: one process per engine — the thin socket shell around the
request core (engine_node/core.py) and the weight transaction
(engine_node/weight_update.py).

Threads and ownership:
- the loop thread owns the backend's data path, the core, the data ROUTER, the
  weight ROUTER, the control SUB, the events DEALER (register, acks) and the
  read end of the wake pipe;
- the heartbeat thread owns a second events DEALER and only reads the
  `_snapshot` Heartbeat the loop publishes (an atomic attribute swap), so a loop
  stuck in a long step keeps heartbeating but its step counter stalls — which
  is how the head tells a hung engine from a dead one;
- backend control ops complete on whatever thread the backend uses; their
  done-callback only writes a byte to the wake pipe (os.write is thread-safe).

Control: commands run in arrival order. A state-changing command whose
BackendOp is still running makes the node *busy*: later state-changing commands
queue behind it, while the loop keeps reading sockets, stepping, heartbeating
(with `busy` = the op's name, so the head never calls it stalled) and answering
the read-only ops (Ping, Stats, IsPaused) at once. The ack goes out when the
op's future completes, or a BackendTimeout naming the knob when
`time.monotonic()` passes the op's deadline first.
"""

from __future__ import annotations

import enum
import gc
import os
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import auth
from bus import protocol as P
from bus.auth import Gatekeeper, KeyDir, read_token
from bus.codec import Codec
from bus.endpoint import Endpoint, open_socket, readable
from bus.errors import BadRequest, ErrorCode, Unauthorized
from bus.sockets import CONTROL_HWM, bound_address
from bus.validate import check_generate, prompt_from_frames
from engine_node.backend import Backend, BackendError, load_backend
from engine_node.config import EngineNodeConfig
from engine_node.control import ControlRunner, ack_error_of
from engine_node.core import Pending, RequestCore
from engine_node.seeding import backend_seed, derive_seed
from engine_node.timings import TimingLog
from engine_node.weight_update import WeightUpdates

log = structlog.get_logger("engine_node")

_MAX_BATCH_RECV = 256  # messages read per socket per loop turn (fairness)
_TICK_S = 0.05  # heartbeat snapshot, deadlines, op deadlines
# While the backend has output ready every turn (a fast step), the turn checks
# only the data socket (ZMQ_EVENTS, no syscall) and polls every socket and fd
# at most this often: a zmq_poll over six items per chunk was the largest
# single cost of the engine's chunk path (bench/profile_hop.py). Control,
# weights, events and the op wake pipe wait at most this long while busy.
_FULL_POLL_S = 0.001


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: no new requests, running ones may finish
    STOPPED = "stopped"


class EngineNode:
    def __init__(
        self, cfg: EngineNodeConfig, backend: Backend, ctx: zmq.Context | None = None, *, incarnation: str | None = None
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.info = backend.info()
        self.engine_id = cfg.engine_id
        self.incarnation = incarnation or new_incarnation()
        self.sample_seed = derive_seed(cfg.seed, cfg.engine_id, self.incarnation)
        self.lifecycle = Lifecycle.STARTING
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.codec = Codec()
        self.log = log.bind(engine_id=self.engine_id)

        # Security on (curve_dir): this node holds the cluster's engine
        # credential; its data and weight sockets take only the head and
        # allowed clients (ZAP domain "peers", checked by this context's
        # Gatekeeper, started before the sockets bind).
        self.gate: Gatekeeper | None = None
        curve = self._curve = None
        if cfg.curve_dir:
            keys = KeyDir(cfg.curve_dir)
            curve = self._curve = keys.engine()
            self.gate = Gatekeeper(self.ctx, keys, (auth.PEERS,)).start()
        self.data = open_socket(self.ctx, zmq.ROUTER, bind=cfg.data_address, curve=curve, zap_domain=auth.PEERS)
        # The head connects here with a fixed identity (RegisterReply.data_peer:
        # acks follow the chunks on this connection). When the head replaces its
        # connection (this engine re-registered, or the head restarted) the old
        # one may still be open on our side: without handover the new one, with
        # the same identity, is refused and every send to the head queues on a
        # dead pipe (a generate after an engine restart hung, test_auth).
        self.data.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.weights = open_socket(self.ctx, zmq.ROUTER, bind=cfg.weight_address, curve=curve, zap_domain=auth.PEERS)
        self.sub = open_socket(
            self.ctx,
            zmq.SUB,
            connect=cfg.head_control,
            hwm=CONTROL_HWM,
            subscribe=[b"*\x00", self.engine_id.encode() + b"\x00"],
            curve=curve,
        )
        # The join token (run_engine_node already refused a bad file, naming
        # it) and this process's events identity. Hazard: the
        # identity is the head's proof that heartbeats and acks are ours
        # (router_node/router.py _engine_of); its random part is never
        # published, so nobody can reconnect under it once we are dead.
        self._token = read_token(cfg.token_file) if cfg.token_file else ""
        self._ident = f"{self.engine_id}/{self.incarnation}/{secrets.token_hex(16)}".encode()
        self.events = open_socket(
            self.ctx,
            zmq.DEALER,
            connect=cfg.head_events,
            hwm=CONTROL_HWM,
            identity=self._ident,
            curve=curve,
        )
        self.data_address = self._advertised(bound_address(self.data))
        self.weight_address = self._advertised(bound_address(self.weights))
        self.poller = zmq.Poller()
        for s in (self.data, self.weights, self.sub, self.events):
            self.poller.register(s, zmq.POLLIN)
        # Security on: the head's ZAP handler refusing our engine credential is
        # final (libzmq does not retry): its monitor event ends the node with
        # a clear error instead of a silent wait for register_timeout_s.
        self._events_monitor: zmq.Socket | None = None
        if curve is not None and cfg.head_events.startswith("tcp://"):
            self._events_monitor = self.events.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self.poller.register(self._events_monitor, zmq.POLLIN)
        self.timings = TimingLog()  # weight receive/commit, resume -> first output (Stats)
        # Where the loop thread's time goes (cumulative seconds; Stats detail "loop").
        self.loop_stats: dict[str, float] = {"turns": 0, "poll_s": 0.0, "read_s": 0.0, "step_s": 0.0, "flush_s": 0.0}
        self._backend_fd = backend.wake_fd()
        # Backends with a wake fd may say whether output is queued now; while
        # none is, the turn blocks in poll (sockets + wake fd) for up to this.
        self._output_ready = getattr(backend, "output_ready", None) if self._backend_fd is not None else None
        self._step_wait_ms = max(1, int(round(1000 * float(getattr(backend, "step_wait_s", 0.005)))))
        if self._backend_fd is not None:
            self.poller.register(self._backend_fd, zmq.POLLIN)

        # -- the core and the weight transaction (loop thread only)
        self.core = RequestCore(backend, self.info, self.engine_id, self.sample_seed)
        self.core.work_appeared = self._work_appeared
        self.updates = WeightUpdates(
            backend, self.core, self.engine_id, self.weight_address, prepare_ttl_s=cfg.prepare_ttl_s
        )
        self.updates.timings = self.timings
        self.updates.log_aborted = lambda uid, why: self.log.info("weight_update_aborted", update_id=uid, reason=why)

        self._registered = False
        self._refused: str | None = None  # the last retryable refusal (id held by a live engine)
        # The head's identity on our data socket (RegisterReply.data_peer): acks
        # go there, behind every chunk produced before them (b"": events socket).
        self._head_peer = b""
        handlers: dict[type, Callable[[Any, int], Any]] = {
            P.Ping: self._op_ping,
            P.Pause: self.core.pause,
            P.Resume: self._op_resume,
            P.IsPaused: self.core.is_paused,
            P.Sleep: self.core.sleep,
            P.WakeUp: self.core.wake_up,
            P.ResetPrefixCache: self.core.reset_prefix_cache,
            P.BeginWeightUpdate: self.updates.begin,
            P.ReceiveWeights: self.updates.receive,
            P.PrepareWeights: self.updates.prepare,
            P.FinishWeightUpdate: self.updates.commit,
            P.AbortWeightUpdate: self.updates.abort,
            P.LoadLora: self._op_load_lora,
            P.UnloadLora: self._op_unload_lora,
            P.Stats: self._op_stats,
        }
        # Control: commands in order, long ops without blocking; its wake pipe
        # (op done-callbacks write to it from any thread) is in the poller.
        self.control = ControlRunner(
            self.engine_id,
            handlers,
            self._send_ack,
            on_busy_change=self._refresh_heartbeat,
            before_complete=lambda: self.core.set_time(time.monotonic(), time.time()),
            log=self.log,
        )
        self.poller.register(self.control.wake_fd, zmq.POLLIN)
        self._fatal: str | None = None  # set by a handler; the loop raises _Fatal
        # One Endpoint per socket: decode → handler table → typed reply. Gone
        # peers are per socket: a client that left the data socket drops its
        # requests; a weight sender that left only loses its bucket acks.
        self.data_ep = Endpoint(
            self.data,
            self.codec,
            {
                P.Generate: self._keyed(self._on_generate),
                P.Cancel: self._keyed(self._on_cancel),
                P.ClientPing: self._on_client_ping,
            },
            name="data",
            routed=True,
            before_error=self._flush,
            on_peer_gone=self.core.peer_gone,
            max_batch=_MAX_BATCH_RECV,
        )
        self.weights_ep = Endpoint(
            self.weights,
            self.codec,
            {P.WeightBucket: self._keyed(self._on_weight_bucket), P.WeightSenderEnd: self._keyed(self._on_sender_end)},
            name="weights",
            routed=True,
            error_reply=lambda rid, code, message, field: P.WeightBucketAck(
                update_id="", bucket=-1, ok=False, error=message
            ),
            max_batch=_MAX_BATCH_RECV,
        )
        self.sub_ep = Endpoint(
            self.sub, self.codec, {P.Command: self._on_command}, name="control", routed=True, error_reply=None
        )
        self.events_ep = Endpoint(
            self.events,
            self.codec,
            {P.RegisterReply: self._on_register_reply, P.Rejoin: self._on_rejoin},
            name="events",
            routed=False,
            error_reply=None,
        )
        self._endpoints = {ep.sock: ep for ep in (self.data_ep, self.weights_ep, self.sub_ep, self.events_ep)}
        self._data_ready = [(self.data, zmq.POLLIN)]  # the busy turn's poll result when only data is checked
        self._full_poll_at = 0.0  # perf_counter of the last poll over every socket and fd
        self._snapshot: P.Heartbeat = self._make_heartbeat()
        self._snapshot_at = 0.0
        self._hb_stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

    def _keyed(self, handler: Callable[[bytes, Any, list[Any]], None]) -> Callable[[bytes, Any, list[Any]], None]:
        """Security on: a data / weight frame whose CURVE key was taken off the
        allow-list since its handshake is refused (typed Unauthorized), so a
        removed key's open connection stops being served at the next re-read."""
        gate = self.gate
        if gate is None:
            return handler

        def run(peer: bytes, msg: Any, buffers: list[Any]) -> None:
            ep = self.weights_ep if isinstance(msg, (P.WeightBucket, P.WeightSenderEnd)) else self.data_ep
            key = auth.peer_key(ep.frames[0]) if ep.frames else None
            if key is not None and not gate.allows(auth.PEERS, key.encode()):
                raise Unauthorized(
                    f"key {key} was removed from this engine's allow-list",
                    request_id=getattr(msg, "request_id", None),
                    field="client_key",
                )
            handler(peer, msg, buffers)

        return run

    # ------------------------------------------------------------ lifecycle

    def _advertised(self, endpoint: str) -> str:
        if not endpoint.startswith("tcp://"):
            return endpoint
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        if self.cfg.advertise_host:
            return f"tcp://{self.cfg.advertise_host}:{port}"
        if host in ("0.0.0.0", "*", "[::]"):
            return f"tcp://{socket.gethostname()}:{port}"
        return endpoint

    def request_stop(self, *_: Any) -> None:
        """Signal handler: only flips the lifecycle; the loop drains."""
        if self.lifecycle in (Lifecycle.STARTING, Lifecycle.SERVING):
            self.lifecycle = Lifecycle.DRAINING
            self._drain_deadline = time.monotonic() + self.cfg.drain_timeout_s

    def run(self) -> int:
        self.lifecycle = Lifecycle.SERVING
        gc.freeze()  # start-up's objects (the backend's included) leave the collector's walks (router.py)
        self._send_register()
        self._register_sent_at = time.monotonic()
        self._register_deadline = self._register_sent_at + self.cfg.register_timeout_s
        self._hb_thread.start()
        self.log.info("engine_serving", data=self.data_address, backend=self.info.backend, model=self.info.model)
        rc = 0
        try:
            while self.lifecycle is not Lifecycle.STOPPED:
                self._turn()
        except _Fatal as e:
            self.log.error("engine_fatal", error=str(e))
            rc = 2
        finally:
            self._shutdown()
        return rc

    def _turn(self) -> None:
        core = self.core
        ls = self.loop_stats
        t0 = time.perf_counter()
        busy = self.backend.has_work()
        wait_ms = self._poll_ms(busy)
        events: Any
        if wait_ms == 0 and t0 - self._full_poll_at < _FULL_POLL_S:
            events = self._data_ready if readable(self.data) else ()
        else:
            events = self.poller.poll(wait_ms)
            self._full_poll_at = time.perf_counter()
        t1 = time.perf_counter()
        ls["turns"] += 1
        ls["poll_s"] += t1 - t0
        for sock, _ in events:
            ep = self._endpoints.get(sock)
            if ep is not None:
                ep.drain()
                if self._fatal is not None:
                    raise _Fatal(self._fatal)
            elif sock == self.control.wake_fd:
                self.control.on_wake()
                self._flush()
            elif sock is self._events_monitor:
                self._on_events_monitor()
            # the backend's wake fd needs no read here: step() drains it
        now = time.monotonic()
        core.set_time(now, time.time())
        if self.lifecycle is Lifecycle.DRAINING:
            core.accepting = False
        if core.admit_dirty:
            core.admit()
            if self.timings.resume.armed:
                self.timings.resume.admitted(time.perf_counter())
        t2 = time.perf_counter()
        ls["read_s"] += t2 - t1
        if self.backend.has_work():
            try:
                outs = self.backend.step()
            except Exception as e:  # the backend broke: fail what runs, keep serving
                self.log.exception("step_failed")
                core.step_failed(e)
            else:
                # Chunks carry emitted_at = when their tokens came out of the
                # backend, i.e. after the step, not when this turn began.
                core.set_time(time.monotonic(), time.time())
                core.on_step(outs)
                if outs and self.timings.resume.armed:
                    self._resume_first_output()
        t3 = time.perf_counter()
        ls["step_s"] += t3 - t2
        # The clock is read again AFTER the step: with `now` from before it, a
        # turn whose step was long skipped the tick, and the heartbeat showed
        # that step's progress only after the next one (the head's stall clock
        # saw an engine with 1 s steps stuck for 2 s).
        now = time.monotonic()
        if now - self._snapshot_at > _TICK_S:
            self._tick(now)
        self._flush()
        ls["flush_s"] += time.perf_counter() - t3

    def _poll_ms(self, busy: bool) -> int:
        """How long this turn may wait for sockets. A backend that produces on
        another thread (wake fd) and has nothing queued yet is waited for HERE,
        next to the sockets, so a Generate that arrives while the engine steps
        is read and submitted at once (a wait inside step() would hold it back
        for up to step_wait_s: a whole engine step later for a burst's tail)."""
        if not busy:  # backend.has_work()
            return 50
        ready = self._output_ready
        if ready is None or ready():
            return 0
        return self._step_wait_ms

    def _flush(self) -> None:
        core = self.core
        if core.acks:
            for seq, ok, result, error, code in core.take_acks():
                self.control.ack(seq, ok=ok, result=result, error=error, code=code)
        if self.updates.acks:  # prepares that waited for their senders
            acks, self.updates.acks = self.updates.acks, []
            for seq, ok, result, exc in acks:
                if ok:
                    self.control.ack(seq, ok=True, result=result)
                else:
                    code, message, field = ack_error_of(exc or RuntimeError("prepare failed"))
                    self.control.ack(seq, ok=False, error=message, code=code, field=field)
        if core.sends or core.outbox.by_peer:
            for peer, msg, buffers in core.take_sends():
                self._send_data(peer, msg, buffers)

    def _tick(self, now: float) -> None:
        self.core.tick(now, time.time())
        self.updates.tick(now)
        self.control.check_deadline(now)
        if self.gate is not None:
            self.gate.refresh(now)  # a client key added or removed: re-read the allow-list
        self._snapshot = self._make_heartbeat()
        self._snapshot_at = now
        if not self._registered:
            if now > self._register_deadline:
                if self._refused:
                    raise _Fatal(
                        f"the head refused registration for register_timeout_s={self.cfg.register_timeout_s}: "
                        f"{self._refused}"
                    )
                raise _Fatal(
                    f"the head never answered Register within register_timeout_s={self.cfg.register_timeout_s}"
                )
            if now - self._register_sent_at > 1.0:
                self._send_register()
                self._register_sent_at = now
        if self.lifecycle is Lifecycle.DRAINING:
            if not self.core.requests:
                self.lifecycle = Lifecycle.STOPPED
            elif now > self._drain_deadline:
                self.core.fail_all(
                    ErrorCode.ENGINE_DEAD,
                    f"engine {self.engine_id} shut down before the request finished (drain_timeout_s={self.cfg.drain_timeout_s})",
                )
                self._flush()
                self.lifecycle = Lifecycle.STOPPED

    def _shutdown(self) -> None:
        self._hb_stop.set()
        if self._hb_thread.is_alive():
            self._hb_thread.join(timeout=2)
        if self._events_monitor is not None:
            self.events.disable_monitor()
            self._events_monitor.close(linger=0)
        for ep in self._endpoints.values():
            ep.close()
        try:
            self.backend.close()
        finally:
            self.control.close()
            if self.gate is not None:
                self.gate.stop()
            if self._own_ctx:
                self.ctx.term()
        self.log.info("engine_stopped")

    # ------------------------------------------------------------ events / heartbeat

    def _send_register(self) -> None:
        reg = P.Register(
            engine_id=self.engine_id,
            data_address=self.data_address,
            weight_address=self.weight_address,
            backend=self.info.backend,
            model=self.info.model,
            protocol_version=P.PROTOCOL_VERSION,
            incarnation=self.incarnation,
            tp=self.info.tp,
            pp=self.info.pp,
            dp=self.info.dp,
            capacity=self.info.capacity,
            vocab_size=self.info.vocab_size,
            pid=os.getpid(),
            weight_version=self.core.weight_version,
            loras=self.backend.loras(),
            host=self.cfg.advertise_host,
            dtype=getattr(self.info, "dtype", ""),
            curve_key=self._curve.public.decode("ascii") if self._curve is not None else "",
            token=self._token,
            max_model_len=int(getattr(self.info, "max_model_len", 0) or 0),
        )
        try:
            # NOBLOCK: a DEALER without a connected head (refused handshake,
            # head down) would block the loop; the next tick sends again.
            self.events.send_multipart(self.codec.encode(reg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _on_events_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert self._events_monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._events_monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise _Fatal(
                    f"the head at {self.cfg.head_events} refused this engine's CURVE key (ZAP status {event['value']}): "
                    f"the engines/*.key_secret in curve_dir={self.cfg.curve_dir} is not an engine credential of this "
                    "cluster (copy the head's key folder)"
                )

    def _on_register_reply(self, _peer: bytes, msg: P.RegisterReply, _b: list[Any]) -> None:
        if not msg.ok and msg.retry and not self._registered:
            # Our id is held by a live engine (our previous life, not yet seen
            # dead, or a twin): keep re-registering until register_timeout_s.
            if self._refused != msg.error:
                self.log.warning("register_refused_retrying", error=msg.error)
            self._refused = msg.error
            return
        if not msg.ok:
            self._fatal = f"the head refused registration: {msg.error}"
            return
        if not self._registered:
            self.log.info("engine_registered")
        self._registered = True
        self._head_peer = msg.data_peer.encode()

    def _on_rejoin(self, _peer: bytes, msg: P.Rejoin, _b: list[Any]) -> None:
        """The head does not know us (it restarted on the same addresses):
        register again at once, with our weight version and LoRAs (heartbeats
        carry paused / sleeping / running). Requests the old head forwarded
        end when their chunks find its data connection gone (core.peer_gone)."""
        if not self._registered and now_s() - self._register_sent_at < 0.5:
            return  # a Register is on its way already
        self.log.warning("engine_rejoining", reason=msg.reason[:200])
        self._registered = False
        self._refused = None
        self._head_peer = b""
        self._send_register()
        self._register_sent_at = now_s()
        self._register_deadline = self._register_sent_at + self.cfg.register_timeout_s

    def _send_ack(self, ack: P.Ack) -> None:
        """Acks go to the head over the data connection when it told us its
        identity there: the chunks produced before the ack are sent first, on
        the same connection, so the head relays them before it can act on the
        ack (a pause's reply never overtakes them). Else: the events socket."""
        peer = self._head_peer
        if peer:
            for p, m, bufs in self.core.take_sends():
                self._send_data(p, m, bufs)
            if self.data_ep.send(peer, ack):
                return
        self.events.send_multipart(self.codec.encode(ack))

    def _on_client_ping(self, peer: bytes, _msg: P.ClientPing, _b: list[Any]) -> None:
        # A client connected straight to this engine pings it as it would a head.
        self.data_ep.send(peer, P.HeadPong())

    def _make_heartbeat(self) -> P.Heartbeat:
        try:
            kv = float(self.backend.stats().get("kv_usage", 0.0))
        except Exception:  # stats are best effort; never kill the loop for them
            kv = 0.0
        return P.Heartbeat(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            kv_usage=kv,
            loras=self.backend.loras(),
            busy=self.control.busy_name,
            acked_seq=self.control.acked_seq,
            **self.core.counters(),
        )

    def _refresh_heartbeat(self) -> None:
        self._snapshot = self._make_heartbeat()

    def _work_appeared(self) -> None:
        """The heartbeat must show work before the loop enters a step that may
        hang: a stale `running=0` would hide the stall from the head."""
        if self._snapshot.running == 0:
            self._snapshot = self._make_heartbeat()

    def _heartbeat_loop(self) -> None:
        # Own socket: sockets are not thread-safe, and this one must keep
        # beating while the loop is inside a long step.
        # Its identity is the head's proof that these heartbeats are ours
        # (router_node/router.py _engine_of): the events identity + "/hb".
        sock = open_socket(
            self.ctx,
            zmq.DEALER,
            connect=self.cfg.head_events,
            hwm=16,
            curve=self._curve,
            identity=self._ident + b"/hb",
        )
        codec = Codec()
        try:
            while not self._hb_stop.wait(self.cfg.heartbeat_interval_s):
                try:
                    sock.send_multipart(codec.encode(self._snapshot), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # head gone or slow: a lost heartbeat is what it is
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------ data plane

    def _on_generate(self, client: bytes, msg: P.Generate, buffers: list[Any]) -> None:
        prompt = prompt_from_frames(msg, [b.buffer for b in buffers], max_prompt_tokens=self.cfg.max_prompt_tokens)
        check_generate(msg, prompt, vocab_size=self.info.vocab_size)
        self.core.accepting = self.lifecycle is Lifecycle.SERVING
        self.core.generate(client, msg, prompt.tolist())

    def _on_cancel(self, client: bytes, msg: P.Cancel, _: list[Any]) -> None:
        self.core.cancel(client, msg.request_id)

    def _send_data(self, peer: bytes, msg: Any, buffers: list[Any]) -> None:
        if isinstance(msg, P.Error):
            self.log.info("request_error", request_id=msg.request_id, code=msg.code, field=msg.field, error=msg.message)
        self.data_ep.send(peer, msg, buffers)  # a gone peer: core.peer_gone

    # ------------------------------------------------------------ weight socket

    def _on_weight_bucket(self, peer: bytes, msg: P.WeightBucket, buffers: list[Any]) -> None:
        ack = P.WeightBucketAck(update_id=msg.update_id, bucket=msg.bucket)
        try:
            if not buffers:
                raise BackendError(f"bucket {msg.bucket} of update {msg.update_id} has no data frame")
            # The frame itself is passed too: a streamed update keeps it
            # (zero-copy) until the prepare stages it.
            self.updates.on_bucket(
                msg.update_id, msg.bucket, buffers[0].buffer, sender=msg.sender, metas=msg.metas, frame=buffers[0]
            )
        except Exception as e:  # refused (BackendError/ValueError) or a bug: answer it, keep serving
            ack = self._weight_refused(msg.update_id, msg.bucket, e)
        self.weights_ep.send(peer, ack)  # a sender that left: nothing to undo here
        self._flush()  # a prepare that waited for this bucket

    def _on_sender_end(self, peer: bytes, msg: P.WeightSenderEnd, _b: list[Any]) -> None:
        ack = P.WeightBucketAck(update_id=msg.update_id, bucket=-1)
        try:
            self.updates.on_sender_end(msg.update_id, msg.sender, msg.buckets)
        except Exception as e:
            ack = self._weight_refused(msg.update_id, -1, e)
        self.weights_ep.send(peer, ack)
        self._flush()  # a prepare that waited for this sender

    def _weight_refused(self, update_id: str, bucket: int, e: Exception) -> P.WeightBucketAck:
        if not isinstance(e, (BackendError, ValueError)):
            self.log.exception("weight_bucket_crashed", update_id=update_id, bucket=bucket)
        self.updates.abort_current(update_id, str(e))
        return P.WeightBucketAck(update_id=update_id, bucket=bucket, ok=False, error=f"{self.engine_id}: {e}")

    # ------------------------------------------------------------ control plane

    def _on_command(self, _topic: bytes, cmd: P.Command, _b: list[Any]) -> None:
        if cmd.targets is not None and self.engine_id not in cmd.targets:
            return
        self.control.on_command(cmd)
        self._flush()

    # -- ops that belong to the shell

    def _op_ping(self, op: P.Ping, seq: int) -> P.PingResult:
        return P.PingResult(weight_version=self.core.weight_version, incarnation=self.incarnation)

    def _op_load_lora(self, op: P.LoadLora, seq: int) -> Any:
        if op.path is None:
            raise BadRequest("load_lora needs a path (tensors travel as a staged update)", field="path")
        bop = self.backend.load_lora(op.name, path=op.path, config=dict(op.config) or None)
        return Pending(bop, self._lora_changed)

    def _op_unload_lora(self, op: P.UnloadLora, seq: int) -> Any:
        return Pending(self.backend.unload_lora(op.name), self._lora_changed)

    def _lora_changed(self, _res: dict[str, Any]) -> P.LoraResult:
        self.core.config_changed()
        return self.core.config_result()

    def _op_resume(self, op: P.Resume, seq: int) -> Any:
        # Where a resume's first output comes from (a ResumeTiming in Stats).
        # Only when requests were parked or held by the pause: after an idle
        # resume the "first output" is a later request's, and its delay
        # (seconds of nobody asking) read like a stall (issue 23).
        c = self.core.counters()
        if not (c.get("parked", 0) or c.get("held", 0) or c.get("running", 0)):
            self.timings.resume.disarm()
            return self.core.resume(op, seq)
        self.timings.resume.arm(time.perf_counter())
        arm = getattr(self.backend, "trace_outputs", None)  # optional: the vllm backend's core-side trace
        if arm is not None:
            arm()
        return self.core.resume(op, seq)

    def _resume_first_output(self) -> None:
        take = getattr(self.backend, "take_output_trace", None)
        self.timings.resumed(time.perf_counter(), self.backend.num_running(), take() if take is not None else None)

    def _op_stats(self, op: P.Stats, seq: int) -> P.StatsResult:
        hb = self._make_heartbeat()
        return P.StatsResult(
            heartbeat={f: getattr(hb, f) for f in hb.__struct_fields__},
            detail={**self.backend.stats(), "loop": dict(self.loop_stats), "timings": self.timings.to_builtins()},
        )


def now_s() -> float:
    return time.monotonic()


SEEDED_BACKENDS = ("torch", "vllm")  # backends whose `seed` option run_engine_node derives


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


class _Fatal(Exception):
    """The node cannot go on (registration refused, head never answered)."""


def run_engine_node(argv: list[str] | None = None) -> int:
    """Entry point: `python -m engine_node …`."""
    from bus.runtime import become_child_process
    from engine_node.config import parse_args

    cfg = parse_args(argv)
    become_child_process(f"rollout-bus engine_node {cfg.engine_id}")
    if cfg.token_file:  # before the (slow) backend: a bad token file ends the node at once
        from bus.auth import KeyFileError

        try:
            read_token(cfg.token_file)
        except KeyFileError as e:
            log.error("engine_token_refused", engine_id=cfg.engine_id, error=str(e))
            return 2
    incarnation = new_incarnation()
    options = dict(cfg.backend_options)
    if cfg.backend in SEEDED_BACKENDS and "seed" not in options:
        # The engine-level generator differs per engine and per restart too.
        options["seed"] = backend_seed(cfg.backend, derive_seed(cfg.seed, cfg.engine_id, incarnation))
    log.info("engine_starting", engine_id=cfg.engine_id, backend=cfg.backend, model=cfg.model, incarnation=incarnation)
    backend = load_backend(cfg.backend, cfg.model, **options)
    from bus.profiler import start_from_env

    start_from_env(f"engine-{cfg.engine_id}")  # benchmarks only: ROLLOUT_BUS_PROFILE_DIR
    node = EngineNode(cfg, backend, incarnation=incarnation)
    signal.signal(signal.SIGTERM, node.request_stop)
    signal.signal(signal.SIGINT, node.request_stop)
    return node.run()
