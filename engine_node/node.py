"""The engine node: one process per engine — the thin socket shell around the
request core (engine_node/core.py) and the weight transaction
(engine_node/weight_update.py). The cores return typed actions
(engine_node/actions.py); this shell executes them through `_actions`, a table
keyed by the action's type.

Threads and ownership:
- the loop thread owns the backend's data path, the core, the data ROUTER (here),
  the weight ROUTER (engine_node/weight_socket.py), the control SUB and the
  events DEALER (engine_node/head_link.py: register, acks) and the read end of
  the control runner's wake pipe;
- the heartbeat thread (engine_node/heartbeat.py) owns a second events DEALER
  and only reads the snapshot the loop publishes, so a loop stuck in a long
  step keeps heartbeating but its step counter stalls — which is how the head
  tells a hung engine from a dead one;
- backend control ops complete on whatever thread the backend uses; their
  done-callback only writes a byte to the wake pipe (os.write is thread-safe).

Control: commands run in arrival order (engine_node/control.py). A
state-changing command whose BackendOp is still running makes the node *busy*:
later state-changing commands queue behind it, while the loop keeps reading
sockets, stepping, heartbeating (with `busy` = the op's name, so the head never
calls it stalled) and answering the read-only ops (Ping, Stats, IsPaused) at
once. The ack goes out when the op's future completes, or a BackendTimeout
naming the knob when `time.monotonic()` passes the op's deadline first.
"""

from __future__ import annotations

import enum
import gc
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import protocol as P
from bus import roles
from bus.auth import KeyFileError, read_token
from bus.codec import Codec
from bus.endpoint import Endpoint, open_socket
from bus.errors import BadRequest, ErrorCode
from bus.profiler import start_from_env
from bus.runtime import become_child_process, cannot_start
from bus.sockets import bound_address
from bus.validate import check_generate, check_request_budget, prompt_from_frames
from engine_node.actions import OpOutcome, Pending, SendAck, SendChunks, SendError
from engine_node.backend import Backend, load_backend
from engine_node.config import EngineNodeConfig, parse_args
from engine_node.control import ControlRunner
from engine_node.core import RequestCore
from engine_node.head_link import HeadLink, NodeFatal
from engine_node.heartbeat import Heartbeats, HeartbeatSource
from engine_node.node_setup import (
    SEEDED_BACKENDS,
    advertised,
    events_identity,
    new_incarnation,
    open_data_socket,
    security,
)
from engine_node.peer_keys import Handler, keyed
from engine_node.seeding import backend_seed, derive_seed
from engine_node.timings import TimingLog
from engine_node.weight_socket import WeightSocket
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
# The loop's clock: turn timing (loop_stats), deadlines, ticks (monotonic).
_clock = time.monotonic
_zmq_poll = zmq.zmq_poll


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: no new requests, running ones may finish
    STOPPED = "stopped"


_DRAINING, _STOPPED = Lifecycle.DRAINING, Lifecycle.STOPPED  # read once per turn: no enum attribute lookup


class EngineNode:
    def __init__(
        self, cfg: EngineNodeConfig, backend: Backend, ctx: zmq.Context | None = None, *, incarnation: str | None = None
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.info = backend.info()
        self.engine_id = cfg.engine_id
        self.incarnation = incarnation or new_incarnation()
        self.lifecycle = Lifecycle.STARTING
        self._drain_deadline = 0.0
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.codec = Codec()
        self.log = log.bind(engine_id=self.engine_id)
        # Who each socket admits (bus/roles.py); the events identity first: the
        # head's secret on our data socket is derived from it.
        self.identity = events_identity(cfg.engine_id, self.incarnation)
        self.sec = security(self.ctx, cfg, self.identity)
        self.gate, self._curve = self.sec.gate, self.sec.curve
        seed = derive_seed(cfg.seed, cfg.engine_id, self.incarnation)
        self.core = RequestCore(backend, self.info, self.engine_id, seed)
        self.timings = TimingLog()  # weight receive/commit, resume -> first output (Stats)
        self._open_weight_plane()
        source = HeartbeatSource(self.engine_id, self.incarnation, backend, self.core)
        # Control: commands in order, long ops without blocking; its wake pipe
        # (op done-callbacks write to it from any thread) is in the poller.
        self.control = ControlRunner(
            self.engine_id,
            self._control_handlers(),
            self._send_ack,
            on_busy_change=lambda: self.heartbeats.refresh(),
            before_complete=lambda: self.core.set_time(time.monotonic(), time.time()),
            log=self.log,
        )
        source.control = self.control
        self.head = HeadLink(
            self.ctx,
            cfg,
            self.codec,
            identity=self.identity,
            curve=self._curve,
            plain=self.sec.as_engine,
            register_msg=self._register_msg,
            on_command=self._on_command,
            log=self.log,
        )
        self.heartbeats = Heartbeats(
            source.make,
            self.ctx,
            cfg.head_events,
            identity=self.identity,
            curve=self._curve,
            plain=self.sec.as_engine,
            interval_s=cfg.heartbeat_interval_s,
        )
        self.core.work_appeared = self.heartbeats.work_appeared
        self.loop_stats: dict[str, float] = {"turns": 0, "poll_s": 0.0, "read_s": 0.0, "step_s": 0.0, "flush_s": 0.0}
        self._open_data_plane()
        self._wire_loop()

    def _open_weight_plane(self) -> None:
        """The weight ROUTER (bound first: its address is the transaction's and
        the Register's), the transaction, and the socket shell feeding it."""
        cfg, backend = self.cfg, self.backend
        weights = open_socket(
            self.ctx, zmq.ROUTER, bind=cfg.weight_address, curve=self._curve, zap_domain=roles.WEIGHTS,
            plain=self.sec.weights,
        )  # fmt: skip
        self.weight_address = advertised(bound_address(weights), cfg.advertise_host)
        self.updates = WeightUpdates(
            backend,
            self.core,
            self.engine_id,
            self.weight_address,
            prepare_ttl_s=cfg.prepare_ttl_s,
            timings=self.timings,
        )
        self.updates.log_aborted = lambda uid, why: self.log.info("weight_update_aborted", update_id=uid, reason=why)
        self.weights = WeightSocket(
            weights,
            self.codec,
            self.updates,
            engine_id=self.engine_id,
            gate=self.gate,
            after=self._flush,
            max_batch=_MAX_BATCH_RECV,
            log=self.log,
        )

    def _open_data_plane(self) -> None:
        cfg = self.cfg
        self.data = open_data_socket(self.ctx, cfg.data_address, self.sec)
        self.data_address = advertised(bound_address(self.data), cfg.advertise_host)
        # One Endpoint per socket: decode → handler table → typed reply. Gone
        # peers are per socket: a client that left the data socket drops its
        # requests; a weight sender that left only loses its bucket acks.
        data_handlers: dict[type, Handler] = {P.Generate: self._on_generate, P.Cancel: self._on_cancel}
        self.data_ep = Endpoint(
            self.data,
            self.codec,
            {
                **{
                    t: keyed(self.gate, self.sec.data_domain, lambda: self.data_ep.frames, h)
                    for t, h in data_handlers.items()
                },
                P.ClientPing: self._on_client_ping,
            },
            name="data",
            routed=True,
            before_error=self._flush,
            on_peer_gone=self._data_peer_gone,
            max_batch=_MAX_BATCH_RECV,
        )

    def _wire_loop(self) -> None:
        """The loop's tables: actions by type, sockets and fds by poll event."""
        # What the cores ask for, by action type (engine_node/actions.py);
        # SendChunks is sent inline by _run_actions (it runs per chunk).
        self._actions: dict[type, Callable[[Any], None]] = {
            SendError: self._send_error,
            SendAck: self.control.ack,
        }
        self._send_data = self.data_ep.send  # bound once: the per-chunk flush sends through it
        self._endpoints = {ep.sock: ep for ep in (self.data_ep, self.weights.ep, self.head.sub_ep, self.head.events_ep)}
        self._fd_handlers: dict[Any, Callable[[], None]] = {self.control.wake_fd: self._on_control_wake}
        if self.head.monitor is not None:
            self._fd_handlers[self.head.monitor] = self.head.on_monitor
        self.poller = self._make_poller()
        # The busy turn's one-item poll over the data socket, and its result when a message is queued.
        self._data_ready = [(self.data, int(zmq.POLLIN))]
        self._full_poll_at = 0.0  # _clock() of the last poll over every socket and fd
        self._turn_end = _clock()  # when the last turn ended: the next one starts there
        # False until a resume arms the resume clock: the per-chunk step then skips looking at it.
        self._resume_watch = False

    def _make_poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for s in (*self._endpoints, *self._fd_handlers):
            poller.register(s, zmq.POLLIN)
        self._backend_fd = self.backend.wake_fd()
        # Backends with a wake fd may say whether output is queued now; while
        # none is, the turn blocks in poll (sockets + wake fd) for up to this.
        self._output_ready = getattr(self.backend, "output_ready", None) if self._backend_fd is not None else None
        self._step_wait_ms = max(1, int(round(1000 * float(getattr(self.backend, "step_wait_s", 0.005)))))
        if self._backend_fd is not None:
            poller.register(self._backend_fd, zmq.POLLIN)
        return poller

    def _control_handlers(self) -> dict[type, Callable[[Any, int], OpOutcome]]:
        core, updates = self.core, self.updates
        return {
            P.Ping: self._op_ping,
            P.Pause: core.pause,
            P.Resume: self._op_resume,
            P.IsPaused: core.is_paused,
            P.Sleep: core.sleep,
            P.WakeUp: core.wake_up,
            P.ResetPrefixCache: core.reset_prefix_cache,
            P.BeginWeightUpdate: updates.begin,
            P.ReceiveWeights: updates.receive,
            P.PrepareWeights: updates.prepare,
            P.FinishWeightUpdate: updates.commit,
            P.AbortWeightUpdate: updates.abort,
            P.LoadLora: self._op_load_lora,
            P.UnloadLora: self._op_unload_lora,
            P.Stats: self._op_stats,
        }

    # ------------------------------------------------------------ lifecycle

    def request_stop(self, *_: Any) -> None:
        """Signal handler: only flips the lifecycle; the loop drains."""
        if self.lifecycle in (Lifecycle.STARTING, Lifecycle.SERVING):
            self.lifecycle = Lifecycle.DRAINING
            self._drain_deadline = time.monotonic() + self.cfg.drain_timeout_s

    def run(self) -> int:
        self.lifecycle = Lifecycle.SERVING
        gc.freeze()  # start-up's objects (the backend's included) leave the collector's walks (router.py)
        self.head.start()
        self.heartbeats.start()
        self.log.info("engine_serving", data=self.data_address, backend=self.info.backend, model=self.info.model)
        rc = 0
        self._turn_end = _clock()
        try:
            while self.lifecycle is not _STOPPED:
                self._turn()
        except NodeFatal as e:
            self.log.error("engine_fatal", error=str(e))
            rc = 2
        finally:
            self._shutdown()
        return rc

    def _turn(self) -> None:
        # Hot path (once per chunk while busy): three clock reads and no call
        # of this class's own methods. A turn starts when the last one ended
        # (`_turn_end`); the clock after the step is the step's end, the
        # chunks' emitted_at and the tick's `now`. loop_stats: poll_s = the
        # full poll (the busy turn's data-socket check counts with what follows
        # it), read_s = reading and admitting, step_s = the backend's step,
        # flush_s = the core's handling of the outputs, the tick and sending.
        core = self.core
        backend = self.backend
        ls = self.loop_stats
        t0 = self._turn_end
        busy = backend.has_work()
        # How long this turn may wait for sockets. A backend that produces on
        # another thread (wake fd) and has nothing queued yet is waited for
        # HERE, next to the sockets, so a Generate that arrives while the
        # engine steps is read and submitted at once (a wait inside step()
        # would hold it back for up to step_wait_s: a whole engine step later
        # for a burst's tail).
        if not busy:
            wait_ms = 50
        elif self._output_ready is None or self._output_ready():
            wait_ms = 0
        else:
            wait_ms = self._step_wait_ms
        ls["turns"] += 1
        events: Any
        if wait_ms == 0 and t0 - self._full_poll_at < _FULL_POLL_S:
            events = self._data_ready if _zmq_poll(self._data_ready, 0) else ()  # bus.endpoint.readable, inlined
            t1 = t0
        else:
            events = self.poller.poll(wait_ms)
            t1 = self._full_poll_at = _clock()
            ls["poll_s"] += t1 - t0
        if events:  # before the handlers: a Generate's deadline, a control op's start count from now
            core.set_time(_clock(), time.time())
            self._read(events)
        if self.lifecycle is _DRAINING:
            core.accepting = False
        if events or core.admit_dirty:
            t1 = self._admit(t1)
            busy = backend.has_work()
        # `now` is read AFTER the step: with a time from before it, a turn
        # whose step was long skipped the tick, and the heartbeat showed that
        # step's progress only after the next one (the head's stall clock saw
        # an engine with 1 s steps stuck for 2 s).
        if not busy:
            now = _clock()
        else:
            try:
                outs = backend.step()
            except Exception as e:  # the backend broke: fail what runs, keep serving
                self.log.exception("step_failed")
                core.step_failed(e)
                outs = []
                now = _clock()
            else:
                # Chunks carry emitted_at = when their tokens came out of the
                # backend, i.e. after the step, not when this turn began.
                now = _clock()
                ls["step_s"] += now - t1
                core.on_step(outs, now, time.time())
            if outs and self._resume_watch:
                self._resume_output()
        if now - self.heartbeats.snapshot_at > _TICK_S:
            self._tick(now)
        if core.actions or self.updates.actions:
            self._flush()
        elif core.outbox.by_peer:  # the commonest turn, once per chunk: chunks and nothing else (_flush)
            core.outbox.flush(self._send_data)  # a gone peer: core.peer_gone
        end = self._turn_end = _clock()
        ls["flush_s"] += end - now

    def _admit(self, t1: float) -> float:
        """Admit what is pending (a turn that read or freed something); returns the clock after."""
        core = self.core
        if core.admit_dirty:
            core.admit()
            if self.timings.resume.armed:
                self.timings.resume.admitted(time.perf_counter())
        t2 = _clock()
        self.loop_stats["read_s"] += t2 - t1
        return t2

    def _read(self, events: Any) -> None:
        for sock, _ in events:
            ep = self._endpoints.get(sock)
            if ep is not None:
                ep.drain()
                if self.head.fatal is not None:
                    raise NodeFatal(self.head.fatal)
            elif sock in self._fd_handlers:
                self._fd_handlers[sock]()
            # the backend's wake fd needs no read here: step() drains it

    def _resume_output(self) -> None:
        """A step's outputs while the resume clock may be armed: a resume's first output (Stats)."""
        if self.timings.resume.armed:
            take = getattr(self.backend, "take_output_trace", None)
            self.timings.resumed(time.perf_counter(), self.backend.num_running(), take() if take is not None else None)
        self._resume_watch = self.timings.resume.armed

    def _flush(self) -> None:
        """Execute what the cores asked for, in order (actions.py)."""
        core = self.core
        if core.actions:
            self._run_actions(core.take_actions())
        elif core.outbox.by_peer:
            # The outbox's messages are then exactly the actions take_actions
            # would return (each wrapped in a SendChunks): sent as they are.
            core.outbox.flush(self._send_data)  # a gone peer: core.peer_gone
        if self.updates.actions:  # prepares that waited for their senders
            self._run_actions(self.updates.take_actions())

    def _run_actions(self, actions: list[Any]) -> None:
        # Chunks are nearly every action and this runs per chunk: they skip the
        # table's extra call (callgrind: ~5k instructions per chunk otherwise).
        table = self._actions
        send = self.data_ep.send
        for a in actions:
            if type(a) is SendChunks:
                send(a.peer, a.msg, a.buffers)  # a gone peer: core.peer_gone
            else:
                table[type(a)](a)

    def _tick(self, now: float) -> None:
        self.core.tick(now, time.time())
        self.updates.tick(now)
        self.control.check_deadline(now)
        if self.gate is not None:
            self.gate.refresh(now)  # a client key added or removed: re-read the allow-list
        self.heartbeats.refresh(now)
        self.head.check(now)
        if self.lifecycle is not Lifecycle.DRAINING:
            return
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
        self.heartbeats.stop()
        self.head.close()
        self.data_ep.close()
        self.weights.close()
        try:
            self.backend.close()
        finally:
            self.control.close()
            if self.gate is not None:
                self.gate.stop()
            if self._own_ctx:
                self.ctx.term()
        self.log.info("engine_stopped")

    def _register_msg(self, token: str) -> P.Register:
        info = self.info
        return P.Register(
            engine_id=self.engine_id,
            data_address=self.data_address,
            weight_address=self.weight_address,
            backend=info.backend,
            model=info.model,
            protocol_version=P.PROTOCOL_VERSION,
            incarnation=self.incarnation,
            tp=info.tp,
            pp=info.pp,
            dp=info.dp,
            capacity=info.capacity,
            vocab_size=info.vocab_size,
            pid=os.getpid(),
            weight_version=self.core.weight_version,
            loras=self.backend.loras(),
            host=self.cfg.advertise_host,
            dtype=getattr(info, "dtype", ""),
            curve_key=self._curve.public.decode("ascii") if self._curve is not None else "",
            token=token,
            max_model_len=int(getattr(info, "max_model_len", 0) or 0),
        )

    # ------------------------------------------------------------ actions

    def _send_ack(self, ack: P.Ack) -> None:
        """Acks go to the head over the data connection when it told us its
        identity there: the chunks produced before the ack are sent first, on
        the same connection, so the head relays them before it can act on the
        ack (a pause's reply never overtakes them). Else: the events socket."""
        peer = self.head.head_peer
        if peer:
            self._run_actions(self.core.take_actions())
            if self.data_ep.send(peer, ack):
                return
        self.head.send_event(ack)

    def _send_error(self, a: SendError) -> None:
        e = a.error
        self.log.info("request_error", request_id=e.request_id, code=e.code, field=e.field, error=e.message)
        self.data_ep.send(a.peer, e)

    # ------------------------------------------------------------ data plane

    def _on_generate(self, client: bytes, msg: P.Generate, buffers: list[Any]) -> None:
        prompt = prompt_from_frames(msg, [b.buffer for b in buffers], max_prompt_tokens=self.cfg.max_prompt_tokens)
        check_generate(msg, prompt, vocab_size=self.info.vocab_size)
        check_request_budget(msg, len(prompt), self.cfg.max_request_tokens, f"engine {self.engine_id}")
        self.core.accepting = self.lifecycle is Lifecycle.SERVING
        self.core.generate(client, msg, prompt.tolist())

    def _on_cancel(self, client: bytes, msg: P.Cancel, _: list[Any]) -> None:
        self.core.cancel(client, msg.request_id)

    def _data_peer_gone(self, peer: bytes) -> None:
        """A send found `peer`'s data connection gone (ROUTER_MANDATORY). The
        head's: what it had here can reach nobody (the head saw its connection
        drop and moved them: router_node/data_links.py); said, never silent."""
        if peer == self.head.head_peer:
            n = sum(1 for r in self.core.requests.values() if r.client == peer)
            # With nothing in flight (a send before the head's connection is up, at start) it is news, not a warning.
            (self.log.warning if n else self.log.info)("head_data_connection_lost", requests_ended=n)
        self.core.peer_gone(peer)

    def _on_client_ping(self, peer: bytes, _msg: P.ClientPing, _b: list[Any]) -> None:
        # A client connected straight to this engine pings it as it would a head.
        self.data_ep.send(peer, P.HeadPong())

    # ------------------------------------------------------------ control plane

    def _on_command(self, _topic: bytes, cmd: P.Command, _b: list[Any]) -> None:
        if cmd.targets is not None and self.engine_id not in cmd.targets:
            return
        self.control.on_command(cmd)
        self._flush()

    def _on_control_wake(self) -> None:
        self.control.on_wake()
        self._flush()

    # -- ops that belong to the shell

    def _op_ping(self, op: P.Ping, seq: int) -> P.PingResult:
        return P.PingResult(weight_version=self.core.weight_version, incarnation=self.incarnation)

    def _op_load_lora(self, op: P.LoadLora, seq: int) -> OpOutcome:
        if op.path is None:
            raise BadRequest("load_lora needs a path (tensors travel as a staged update)", field="path")
        bop = self.backend.load_lora(op.name, path=op.path, config=dict(op.config) or None)
        return Pending(bop, self._lora_changed)

    def _op_unload_lora(self, op: P.UnloadLora, seq: int) -> OpOutcome:
        return Pending(self.backend.unload_lora(op.name), self._lora_changed)

    def _lora_changed(self, _res: dict[str, Any]) -> P.LoraResult:
        self.core.config_changed()
        return self.core.config_result()

    def _op_resume(self, op: P.Resume, seq: int) -> OpOutcome:
        # Where a resume's first output comes from (a ResumeTiming in Stats).
        # Only when requests were parked or held by the pause: after an idle
        # resume the "first output" is a later request's, and its delay
        # (seconds of nobody asking) read like a stall (issue 23).
        c = self.core.counters()
        if not (c.get("parked", 0) or c.get("held", 0) or c.get("running", 0)):
            self.timings.resume.disarm()
            self._resume_watch = False
            return self.core.resume(op, seq)
        self.timings.resume.arm(time.perf_counter())
        self._resume_watch = True  # the steps look at the resume clock until the next idle resume
        arm = getattr(self.backend, "trace_outputs", None)  # optional: the vllm backend's core-side trace
        if arm is not None:
            arm()
        return self.core.resume(op, seq)

    def _op_stats(self, op: P.Stats, seq: int) -> P.StatsResult:
        return P.StatsResult(
            heartbeat=self.heartbeats.make(),
            detail={**self.backend.stats(), "loop": dict(self.loop_stats), "timings": self.timings.to_builtins()},
        )


def run_engine_node(argv: list[str] | None = None) -> int:
    """Entry point: `python -m engine_node …`."""
    cfg = parse_args(argv)
    become_child_process(f"rollout-bus engine_node {cfg.engine_id}")
    if cfg.token_file:  # before the (slow) backend: a bad token file ends the node at once
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
    try:
        backend = load_backend(cfg.backend, cfg.model, **options)
        start_from_env(f"engine-{cfg.engine_id}")  # benchmarks only: ROLLOUT_BUS_PROFILE_DIR
        node = EngineNode(cfg, backend, incarnation=incarnation)
    except Exception as e:  # a model that does not load, a bad option: one line, and no restart
        return cannot_start(log, "engine_cannot_start", e, engine_id=cfg.engine_id)
    signal.signal(signal.SIGTERM, node.request_stop)
    signal.signal(signal.SIGINT, node.request_stop)
    return node.run()
