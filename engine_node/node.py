"""The engine node: one process per engine.

Threads and ownership:
- the loop thread owns the backend and the data ROUTER, the weight ROUTER,
  the control SUB and the events DEALER (register, acks);
- the heartbeat thread owns a second events DEALER and only reads the
  `_snapshot` tuple the loop publishes (an atomic attribute swap), so a loop
  stuck in a long step keeps heartbeating but its step counter stalls — which
  is how the head tells a hung engine from a dead one.

Request lifecycle (all client-visible behaviour lives here, not in backends):
admission → (submission gate while paused) → backend → per-step Chunks →
exactly one final Chunk per sample, or one Error per request.
"""

from __future__ import annotations

import collections
import enum
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import structlog
import zmq

from bus import protocol as P
from bus.codec import Codec, Outbox, request_id_of
from bus.errors import BadRequest, ErrorCode, ProtocolError, RolloutBusError
from bus.sockets import CONTROL_HWM, CurveKeys, bound_address, make_socket
from bus.tensors import unpack_bucket
from bus.validate import check_generate, prompt_from_frames
from engine_node.backend import Backend, BackendError, SeqRequest, StepOutput, load_backend
from engine_node.config import EngineNodeConfig
from engine_node.requests import NodeRequest, Sample, SampleState, new_request

log = structlog.get_logger("engine_node")

ALL = "*"
SLEEP_SCOPE = "__sleep__"  # the gate scope sleep() closes
_DEFERRED = object()  # an op handler's "ack later" (pause(wait))
_MAX_BATCH_RECV = 256  # messages read per socket per loop turn (fairness)
_CLIENT_FINISH = frozenset({"stop", "length"})  # "cancelled" comes from the node itself
_MAX_RESUBMITS = 64  # a sample the backend keeps aborting on its own ends in an Error


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: no new requests, running ones may finish
    STOPPED = "stopped"


class EngineNode:
    def __init__(self, cfg: EngineNodeConfig, backend: Backend, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.info = backend.info()
        self.engine_id = cfg.engine_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.lifecycle = Lifecycle.STARTING
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.codec = Codec()
        self.log = log.bind(engine_id=self.engine_id)

        curve = CurveKeys.load(cfg.curve_dir) if cfg.curve_dir else None
        tcp = lambda a: a.startswith("tcp://")  # noqa: E731
        self.data = make_socket(
            self.ctx, zmq.ROUTER, bind=cfg.data_address, curve=curve if tcp(cfg.data_address) else None, curve_server=True
        )
        self.weights = make_socket(
            self.ctx,
            zmq.ROUTER,
            bind=cfg.weight_address,
            curve=curve if tcp(cfg.weight_address) else None,
            curve_server=True,
        )
        self.sub = make_socket(
            self.ctx,
            zmq.SUB,
            connect=cfg.head_control,
            hwm=CONTROL_HWM,
            subscribe=[b"*\x00", self.engine_id.encode() + b"\x00"],
            curve=curve if tcp(cfg.head_control) else None,
        )
        self.events = make_socket(
            self.ctx,
            zmq.DEALER,
            connect=cfg.head_events,
            hwm=CONTROL_HWM,
            identity=f"{self.engine_id}/{self.incarnation}".encode(),
            curve=curve if tcp(cfg.head_events) else None,
        )
        self.data_address = self._advertised(bound_address(self.data))
        self.weight_address = self._advertised(bound_address(self.weights))
        self.poller = zmq.Poller()
        for s in (self.data, self.weights, self.sub, self.events):
            self.poller.register(s, zmq.POLLIN)
        self._wake_fd = backend.wake_fd()
        if self._wake_fd is not None:
            self.poller.register(self._wake_fd, zmq.POLLIN)

        # -- request state (loop thread only)
        self.requests: dict[tuple[bytes, str], NodeRequest] = {}
        self.seqs: dict[str, tuple[NodeRequest, Sample]] = {}
        self.pending: collections.deque[tuple[NodeRequest, Sample]] = collections.deque()
        # Chunks of this loop turn, one message per peer at the turn's end
        # (a ChunkBatch when a step produced several for the same peer).
        self.outbox = Outbox()
        self._admit_dirty = False
        self.pauses: dict[str, str] = {}  # scope ("*", LoRA name, SLEEP_SCOPE) -> mode
        self.weight_version = 0
        self.steps = 0
        self.tokens_out = 0
        self.sleep_level = 0
        self.config_epoch = 0
        self._weights_discarded = False
        self._seq_counter = 0

        # -- control state
        self._acks: collections.OrderedDict[int, P.Ack | None] = collections.OrderedDict()
        self._waits: list[tuple[int, str, float, dict[str, Any]]] = []  # (seq, scope, deadline, result)
        self._update: _WeightUpdate | None = None
        self._registered = False
        self._op_handlers: dict[type, Callable[[Any], Any]] = {
            P.Ping: self._op_ping,
            P.Pause: self._op_pause,
            P.Resume: self._op_resume,
            P.IsPaused: self._op_is_paused,
            P.Sleep: self._op_sleep,
            P.WakeUp: self._op_wake_up,
            P.ResetPrefixCache: self._op_reset_prefix_cache,
            P.BeginWeightUpdate: self._op_begin_weights,
            P.ReceiveWeights: self._op_receive_weights,
            P.FinishWeightUpdate: self._op_finish_weights,
            P.AbortWeightUpdate: self._op_abort_weights,
            P.LoadLora: self._op_load_lora,
            P.UnloadLora: self._op_unload_lora,
            P.Stats: self._op_stats,
        }
        self._data_handlers: dict[type, Callable[[bytes, Any, list[Any]], None]] = {
            P.Generate: self._on_generate,
            P.Cancel: self._on_cancel,
        }
        self._snapshot: P.Heartbeat = self._make_heartbeat()
        self._snapshot_at = 0.0
        self._hb_stop = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)

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
        now = time.monotonic()
        busy = self.backend.has_work()
        timeout_ms = 0 if busy else 50
        for sock, _ in self.poller.poll(timeout_ms):
            if sock is self.data:
                self._drain(self.data, self._on_data)
            elif sock is self.sub:
                self._drain(self.sub, self._on_command)
            elif sock is self.events:
                self._drain(self.events, self._on_event)
            elif sock is self.weights:
                self._drain(self.weights, self._on_weight_frames)
            # the backend's wake fd needs no read here: step() drains it
        if self._admit_dirty:
            self._admit()
        if self.backend.has_work():
            try:
                outs = self.backend.step()
            except Exception as e:  # the backend broke: fail what runs, keep serving
                self.log.exception("step_failed")
                for req in {id(r): r for r, _ in self.seqs.values()}.values():
                    self._fail(req, ErrorCode.INTERNAL, f"backend step failed on {self.engine_id}: {type(e).__name__}: {e}")
                return
            self._emit(outs)
            self.steps += 1
        if now - self._snapshot_at > 0.05:
            self._tick(now)
        if self.outbox.by_peer:
            self._flush()

    def _flush(self) -> None:
        for peer, msg, buffers in self.outbox.messages():
            self._send(self.data, peer, msg, buffers)

    def _tick(self, now: float) -> None:
        self._snapshot = self._make_heartbeat()
        self._snapshot_at = now
        if not self._registered:
            if now > self._register_deadline:
                raise _Fatal(f"the head never answered Register within register_timeout_s={self.cfg.register_timeout_s}")
            if now - self._register_sent_at > 1.0:
                self._send_register()
                self._register_sent_at = now
        self._check_deadlines(now)
        self._check_waits(now)
        if self.lifecycle is Lifecycle.DRAINING:
            if not self.requests:
                self.lifecycle = Lifecycle.STOPPED
            elif now > self._drain_deadline:
                for req in list(self.requests.values()):
                    self._fail(req, ErrorCode.ENGINE_DEAD, f"engine {self.engine_id} shut down before the request finished (drain_timeout_s={self.cfg.drain_timeout_s})")
                self.lifecycle = Lifecycle.STOPPED

    def _drain(self, sock: zmq.Socket, handler: Callable[[list[Any]], None]) -> None:
        for _ in range(_MAX_BATCH_RECV):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handler(frames)

    def _shutdown(self) -> None:
        self._hb_stop.set()
        if self._hb_thread.is_alive():
            self._hb_thread.join(timeout=2)
        for s in (self.data, self.weights, self.sub, self.events):
            s.close(linger=0)
        try:
            self.backend.close()
        finally:
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
            weight_version=self.weight_version,
            loras=self.backend.loras(),
            host=self.cfg.advertise_host,
            dtype=getattr(self.info, "dtype", ""),
        )
        self.events.send_multipart(self.codec.encode(reg))

    def _on_event(self, frames: list[Any]) -> None:
        try:
            msg, _ = self.codec.decode(frames)
        except RolloutBusError as e:
            self.log.warning("bad_event", error=str(e))
            return
        if isinstance(msg, P.RegisterReply):
            if not msg.ok:
                raise _Fatal(f"the head refused registration: {msg.error}")
            if not self._registered:
                self.log.info("engine_registered")
            self._registered = True

    def _make_heartbeat(self) -> P.Heartbeat:
        held = parked = waiting = 0
        for req, s in self.pending:
            if s.state is SampleState.DONE:
                continue
            if self._gated(req.lora):
                if s.submissions:
                    parked += 1
                else:
                    held += 1
            else:
                waiting += 1
        try:
            kv = float(self.backend.stats().get("kv_usage", 0.0))
        except Exception:  # stats are best effort; never kill the loop for them
            kv = 0.0
        return P.Heartbeat(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            running=sum(1 for _, s in self.seqs.values() if s.state is SampleState.RUNNING),
            waiting=waiting,
            held=held,
            parked=parked,
            kv_usage=kv,
            weight_version=self.weight_version,
            paused=sorted(self.pauses),
            steps=self.steps,
            loras=self.backend.loras(),
            sleeping=self.sleep_level,
            tokens_out=self.tokens_out,
            config_epoch=self.config_epoch,
        )

    def _heartbeat_loop(self) -> None:
        # Own socket: sockets are not thread-safe, and this one must keep
        # beating while the loop is inside a long step.
        curve = CurveKeys.load(self.cfg.curve_dir) if self.cfg.curve_dir else None
        sock = make_socket(
            self.ctx,
            zmq.DEALER,
            connect=self.cfg.head_events,
            hwm=16,
            curve=curve if self.cfg.head_events.startswith("tcp://") else None,
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

    def _on_data(self, frames: list[Any]) -> None:
        client = frames[0].bytes
        body = frames[1:]
        try:
            msg, buffers = self.codec.decode(body)
            handler = self._data_handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not a data-plane request", field="kind")
            handler(client, msg, buffers)
        except RolloutBusError as e:
            rid = e.request_id or (request_id_of([f.bytes for f in body[:2]]) if len(body) >= 2 else "")
            self._send_error(client, rid, e.code.value, e.message, e.field)
        except Exception as e:  # a bug of ours: answer it, keep serving
            self.log.exception("data_handler_crashed")
            rid = request_id_of([f.bytes for f in body[:2]]) if len(body) >= 2 else ""
            self._send_error(client, rid, ErrorCode.INTERNAL.value, f"{type(e).__name__}: {e}", None)

    def _on_generate(self, client: bytes, msg: P.Generate, buffers: list[Any]) -> None:
        rid = msg.request_id
        if self.lifecycle is not Lifecycle.SERVING:
            raise _Refused(ErrorCode.ENGINE_DEAD, f"engine {self.engine_id} is shutting down", rid)
        prompt = prompt_from_frames(msg, [b.buffer for b in buffers], max_prompt_tokens=self.cfg.max_prompt_tokens)
        check_generate(msg, prompt, vocab_size=self.info.vocab_size)
        if (client, rid) in self.requests:
            raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid, field="request_id")
        base_len = len(prompt) - msg.resume_len
        if base_len + msg.params.max_tokens > self.info.max_model_len:
            raise BadRequest(
                f"prompt ({base_len}) + max_tokens ({msg.params.max_tokens}) exceeds max_model_len={self.info.max_model_len}",
                request_id=rid,
                field="params.max_tokens",
            )
        if msg.lora is not None and msg.lora not in self.backend.loras():
            raise BadRequest(f"LoRA adapter {msg.lora!r} is not loaded on {self.engine_id}", request_id=rid, field="lora")
        req = new_request(client, msg, prompt.tolist(), time.monotonic())
        self.requests[req.key] = req
        for s in req.samples:
            self.pending.append((req, s))
        self._admit_dirty = True

    def _on_cancel(self, client: bytes, msg: P.Cancel, _: list[Any]) -> None:
        req = self.requests.get((client, msg.request_id))
        if req is None:
            return  # already finished: the final chunk is on its way
        self._abort_samples(req, emit=True)
        for s in req.samples:
            if s.state is not SampleState.DONE:
                self._finish_sample(req, s, "cancelled")

    def _gated(self, lora: str | None) -> bool:
        p = self.pauses
        return bool(p) and (ALL in p or SLEEP_SCOPE in p or (lora is not None and lora in p))

    def _admit(self) -> None:
        """Move pending samples into the backend while there is room and the
        gate is open for them. Gated ones stay pending (held or parked)."""
        self._admit_dirty = False
        room = self.info.capacity - self.backend.num_running()
        if room <= 0 or not self.pending:
            return
        keep: collections.deque[tuple[NodeRequest, Sample]] = collections.deque()
        while self.pending:
            req, s = self.pending.popleft()
            if s.state is SampleState.DONE:
                continue
            if room <= 0 or self._gated(req.lora):
                keep.append((req, s))
                continue
            self._submit(req, s)
            room -= 1
        self.pending = keep

    def _submit(self, req: NodeRequest, s: Sample) -> None:
        self._seq_counter += 1
        seq_id = f"{self._seq_counter}"
        p = req.msg.params
        seed = None if p.seed is None else p.seed + s.index + 7919 * s.submissions
        seq = SeqRequest(
            seq_id=seq_id,
            prompt=req.base_prompt + s.tokens,
            params=p,
            max_new_tokens=p.max_tokens - len(s.tokens),
            seed=seed,
            lora=req.lora,
        )
        try:
            self.backend.add(seq)
        except BackendError as e:
            self._fail(req, ErrorCode.BAD_REQUEST, str(e), field=_field_of(e))
            return
        s.seq_id = seq_id
        s.state = SampleState.RUNNING
        s.submissions += 1
        self.seqs[seq_id] = (req, s)
        self._work_appeared()

    def _work_appeared(self) -> None:
        """The heartbeat must show work before the loop enters a step that may
        hang: a stale `running=0` would hide the stall from the head."""
        if self._snapshot.running == 0:
            self._snapshot = self._make_heartbeat()

    def _emit(self, outs: list[StepOutput]) -> None:
        for out in outs:
            entry = self.seqs.get(out.seq_id)
            if entry is None:
                continue  # aborted meanwhile
            req, s = entry
            if out.token_ids:
                if req.msg.stream is False and (not s.version_marks or s.version_marks[-1][1] != self.weight_version):
                    s.version_marks.append([len(s.tokens) - s.sent, self.weight_version])
                s.tokens.extend(out.token_ids)
                if out.logprobs is not None:
                    s.logprobs.extend(out.logprobs)
                self.tokens_out += len(out.token_ids)
            if out.finish_reason in _CLIENT_FINISH:
                del self.seqs[out.seq_id]
                self._finish_sample(req, s, out.finish_reason)
                self._admit_dirty = True
            elif out.finish_reason is not None:
                self._backend_ended(req, s, out)
            elif req.msg.stream and len(s.tokens) > s.sent:
                self._send_chunk(req, s, None)

    def _backend_ended(self, req: NodeRequest, s: Sample, out: StepOutput) -> None:
        """The backend ended a sequence on its own with a reason no client
        should see ("abort": e.g. preempted; "error"). Abort: re-submit prompt
        + tokens so far (bounded); anything else: one Error for the request."""
        del self.seqs[out.seq_id]
        s.seq_id = None
        s.state = SampleState.PENDING
        natural = self._natural_finish(req, s)
        if natural is not None:
            self._finish_sample(req, s, natural)
        elif out.finish_reason == "abort" and s.submissions < _MAX_RESUBMITS:
            self.pending.append((req, s))
            self._admit_dirty = True
        else:
            self._fail(req, ErrorCode.INTERNAL, f"backend on {self.engine_id} ended sample {s.index} with {out.finish_reason!r}")

    def _send_chunk(self, req: NodeRequest, s: Sample, finish: str | None) -> None:
        new = s.tokens[s.sent :]
        buffers = [np.asarray(new, dtype="<i4").tobytes()]
        if req.msg.params.logprobs:
            buffers.append(np.asarray(s.logprobs[s.sent :], dtype="<f4").tobytes())
        marks = s.version_marks
        version = marks[0][1] if (marks and not req.msg.stream) else self.weight_version
        chunk = P.Chunk(
            request_id=req.msg.request_id,
            sample_index=s.index,
            weight_version=version,
            finish_reason=finish,
            version_changes=marks[1:] if (not req.msg.stream and len(marks) > 1) else [],
            emitted_at=time.time(),
            num_prompt_tokens=len(req.base_prompt) if finish else 0,
            engine_id=self.engine_id if finish else "",
        )
        s.sent = len(s.tokens)
        self.outbox.add(req.client, chunk, buffers)

    def _finish_sample(self, req: NodeRequest, s: Sample, reason: str) -> None:
        if s.seq_id is not None:
            self.seqs.pop(s.seq_id, None)
        s.state = SampleState.DONE
        self._send_chunk(req, s, reason)
        req.open_samples -= 1
        if req.open_samples == 0:
            self.requests.pop(req.key, None)

    def _fail(self, req: NodeRequest, code: ErrorCode, message: str, field: str | None = None) -> None:
        """End a request with one Error (after aborting what runs of it)."""
        self._abort_samples(req, emit=False)
        for s in req.samples:
            s.state = SampleState.DONE
        req.open_samples = 0
        self.requests.pop(req.key, None)
        self._send_error(req.client, req.msg.request_id, code.value, message, field)

    def _abort_samples(self, req: NodeRequest, *, emit: bool) -> None:
        ids = [s.seq_id for s in req.samples if s.state in (SampleState.RUNNING, SampleState.FROZEN) and s.seq_id]
        if ids:
            outs = self.backend.abort(ids)
            if emit:
                self._emit([o for o in outs if o.finish_reason is None])
            for sid in ids:
                self.seqs.pop(sid, None)
        for s in req.samples:
            if s.state in (SampleState.RUNNING, SampleState.FROZEN):
                s.state = SampleState.PENDING
        self._admit_dirty = True

    def _send_error(self, client: bytes, rid: str, code: str, message: str, field: str | None) -> None:
        self._flush()  # chunks produced before the error go out before it
        structlog.get_logger("engine_node").info(
            "request_error", engine_id=self.engine_id, request_id=rid, code=code, field=field, error=message
        )
        self._send(self.data, client, P.Error(request_id=rid, code=code, message=message, field=field))

    def _send(self, sock: zmq.Socket, peer: bytes, msg: Any, buffers: list[Any] = ()) -> None:  # type: ignore[assignment]
        try:
            sock.send_multipart([peer, *self.codec.encode(msg, buffers)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            # The peer is gone (ROUTER_MANDATORY): cancel what it had in flight.
            for req in [r for r in self.requests.values() if r.client == peer]:
                self._abort_samples(req, emit=False)
                self.requests.pop(req.key, None)
                for s in req.samples:
                    s.state = SampleState.DONE

    def _check_deadlines(self, now: float) -> None:
        for req in [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]:
            where = "held by a pause" if self._gated(req.lora) else "running"
            self._fail(
                req,
                ErrorCode.TIMEOUT,
                f"request exceeded its timeout_s={req.msg.timeout_s} ({where} on {self.engine_id})",
                field="timeout_s",
            )

    # ------------------------------------------------------------ control plane

    def _on_command(self, frames: list[Any]) -> None:
        try:
            cmd, _ = self.codec.decode([f.bytes for f in frames[1:]])
        except RolloutBusError as e:
            self.log.warning("bad_command", error=str(e))
            return
        if not isinstance(cmd, P.Command) or (cmd.targets is not None and self.engine_id not in cmd.targets):
            return
        if cmd.seq in self._acks:  # republished: answer from the cache, never re-run
            cached = self._acks[cmd.seq]
            if cached is not None:
                self.events.send_multipart(self.codec.encode(cached))
            return
        self._acks[cmd.seq] = None  # in progress: a republication is ignored
        self._current_seq = cmd.seq
        while len(self._acks) > 4096:
            self._acks.popitem(last=False)
        op_name = P.OP_NAMES[type(cmd.op)]
        try:
            result = self._op_handlers[type(cmd.op)](cmd.op)
        except (BackendError, ValueError, RolloutBusError) as e:
            self.log.warning("op_failed", op=op_name, error=str(e))
            self._ack(cmd.seq, ok=False, error=str(e), code=getattr(getattr(e, "code", None), "value", "bad_request"))
            return
        except Exception as e:  # a bug: report it, keep serving
            self.log.exception("op_crashed", op=op_name)
            self._ack(cmd.seq, ok=False, error=f"{type(e).__name__}: {e}", code=ErrorCode.INTERNAL.value)
            return
        if result is _DEFERRED:
            return
        self._ack(cmd.seq, ok=True, result=result or {})

    def _ack(self, seq: int, *, ok: bool, result: dict | None = None, error: str | None = None, code: str | None = None) -> None:
        ack = P.Ack(seq=seq, engine_id=self.engine_id, ok=ok, result=result or {}, error=error, code=code)
        self._acks[seq] = ack
        self.events.send_multipart(self.codec.encode(ack))

    def _op_ping(self, op: P.Ping) -> dict:
        return {"weight_version": self.weight_version, "incarnation": self.incarnation}

    def _scoped(self, scope: str | None) -> list[tuple[NodeRequest, Sample]]:
        """In-backend samples a pause of `scope` (None: all) applies to."""
        return [(r, s) for r, s in self.seqs.values() if scope is None or r.lora == scope]

    def _park(self, entries: list[tuple[NodeRequest, Sample]]) -> int:
        """Abort in the backend, keep tokens so far, queue for re-submission."""
        if not entries:
            return 0
        outs = self.backend.abort([s.seq_id for _, s in entries if s.seq_id])
        self._emit([o for o in outs if o.finish_reason is None])
        parked = 0
        for req, s in entries:
            if s.state is SampleState.DONE:
                continue
            self.seqs.pop(s.seq_id or "", None)
            reason = self._natural_finish(req, s)
            if reason is not None:  # it had in fact just finished
                self._finish_sample(req, s, reason)
                continue
            s.state = SampleState.PENDING
            s.seq_id = None
            self.pending.append((req, s))
            parked += 1
        return parked

    def _natural_finish(self, req: NodeRequest, s: Sample) -> str | None:
        p = req.msg.params
        if len(s.tokens) >= p.max_tokens:
            return "length"
        if s.tokens and len(s.tokens) > req.msg.resume_len:
            last = s.tokens[-1]
            if last in p.stop_token_ids or (not p.ignore_eos and last in self.info.eos_token_ids):
                return "stop"
        return None

    def _op_pause(self, op: P.Pause) -> Any:
        if op.mode not in ("abort", "keep", "wait"):
            raise BadRequest(f"unknown pause mode {op.mode!r} (abort, keep, wait)", field="mode")
        scope = op.lora or ALL
        self.pauses[scope] = op.mode  # the gate closes in this very loop turn
        entries = self._scoped(op.lora)
        held = sum(1 for r, s in self.pending if op.lora is None or r.lora == op.lora)
        result: dict[str, Any] = {"mode": op.mode, "scope": scope, "held": held, "parked": 0, "frozen": 0}
        if op.mode == "abort":
            result["parked"] = self._park(entries)
        elif op.mode == "keep":
            live = [(r, s) for r, s in entries if s.state is SampleState.RUNNING]
            if op.lora is None or self.backend.freeze_granularity == "seq":
                self.backend.freeze([s.seq_id for _, s in live])
                for _, s in live:
                    s.state = SampleState.FROZEN
                result["frozen"] = len(live)
            else:  # the backend can only freeze everything: park this adapter's
                result["parked"] = self._park(live)
        else:  # wait: ack when this scope's running samples are done
            result["draining"] = len(entries)
            return self._defer_wait(scope, op.timeout_s, result)
        return result

    def _defer_wait(self, scope: str, timeout_s: float, result: dict[str, Any]) -> Any:
        seq = self._current_seq
        self._waits.append((seq, scope, time.monotonic() + timeout_s, result))
        self._check_waits(time.monotonic())
        return _DEFERRED

    def _check_waits(self, now: float) -> None:
        if not self._waits:
            return
        left = []
        for seq, scope, deadline, result in self._waits:
            busy = self._scoped(None if scope == ALL else scope)
            if not busy:
                self._ack(seq, ok=True, result=result)
            elif now > deadline:
                self._ack(
                    seq,
                    ok=False,
                    error=f"pause(mode='wait') still had {len(busy)} running sequence(s) after timeout_s; the gate stays closed",
                    code=ErrorCode.TIMEOUT.value,
                )
            else:
                left.append((seq, scope, deadline, result))
        self._waits = left

    def _op_resume(self, op: P.Resume) -> dict:
        if op.lora is None:
            scopes = [k for k in self.pauses if k != SLEEP_SCOPE]
        else:
            scopes = [op.lora] if op.lora in self.pauses else []
        for k in scopes:
            del self.pauses[k]
        return {"resumed": self._release(), "scopes": scopes, "still_paused": sorted(self.pauses)}

    def _release(self) -> int:
        """After the gate opened for some scopes: thaw frozen samples and let
        held/parked ones be admitted."""
        thaw = [s.seq_id for r, s in self.seqs.values() if s.state is SampleState.FROZEN and not self._gated(r.lora)]
        if thaw:
            self.backend.thaw(thaw)
            for sid in thaw:
                self.seqs[sid][1].state = SampleState.RUNNING
            self._work_appeared()
        waiting = sum(1 for r, _ in self.pending if not self._gated(r.lora))
        self._admit_dirty = True
        # wait-mode pauses whose scope was resumed are moot
        self._waits = [w for w in self._waits if w[1] in self.pauses]
        return len(thaw) + waiting

    def _op_is_paused(self, op: P.IsPaused) -> dict:
        paused = self._gated(op.lora) if op.lora else bool(self.pauses)
        return {"paused": paused, "scopes": sorted(self.pauses)}

    def _op_sleep(self, op: P.Sleep) -> dict:
        if op.level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {op.level}", field="level")
        self.pauses[SLEEP_SCOPE] = "abort"
        parked = self._park(self._scoped(None))
        t0 = time.perf_counter()
        res = dict(self.backend.sleep(op.level) or {})
        self.sleep_level = op.level
        self._weights_discarded = res.get("weights") == "discarded"
        res.update(parked=parked, seconds=round(time.perf_counter() - t0, 4), level=op.level)
        return res

    def _op_wake_up(self, op: P.WakeUp) -> dict:
        t0 = time.perf_counter()
        res = dict(self.backend.wake_up(op.tags) or {})
        if self._weights_discarded and (op.tags is None or "weights" in op.tags):
            # Level 2 dropped the weights; the checkpoint came back. That is a
            # different weight state from any pushed version: tokens from now
            # on carry a new version, never the old one.
            self._weights_discarded = False
            self.weight_version += 1
            self.config_epoch += 1
            res["weights_reloaded_from_checkpoint"] = True
            res.update(self._config_result())
        if op.tags is None or {"weights", "kv_cache"} <= set(op.tags):
            self.sleep_level = 0
            self.pauses.pop(SLEEP_SCOPE, None)
            res["resumed"] = self._release()
        res["seconds"] = round(time.perf_counter() - t0, 4)
        return res

    def _op_reset_prefix_cache(self, op: P.ResetPrefixCache) -> dict:
        self.backend.reset_prefix_cache()
        return {}

    def _op_begin_weights(self, op: P.BeginWeightUpdate) -> dict:
        if self._update is not None:
            self._abort_update("superseded by update " + op.update_id)
        if op.target == "model":
            args = dict(op.transport_args)
            args.setdefault("bucket_sizes", list(op.bucket_sizes))
            self.backend.begin_weight_update(op.transport, list(op.tensors), args)
        elif not op.target.startswith("lora:"):
            raise BadRequest(f"unknown weight target {op.target!r} (model, lora:NAME)", field="target")
        elif op.transport != "zmq":
            raise BadRequest("LoRA tensors travel over the zmq transport", field="transport")
        self._update = _WeightUpdate(op)
        return {"buckets": len(op.bucket_sizes), "weight_address": self.weight_address}

    def _on_weight_frames(self, frames: list[Any]) -> None:
        peer = frames[0].bytes
        try:
            msg, buffers = self.codec.decode(frames[1:])
            if not isinstance(msg, P.WeightBucket):
                raise ProtocolError("only WeightBucket goes to the weight socket", field="kind")
        except RolloutBusError as e:
            self._send(self.weights, peer, P.WeightBucketAck(update_id="", bucket=-1, ok=False, error=str(e)))
            return
        ack = P.WeightBucketAck(update_id=msg.update_id, bucket=msg.bucket)
        try:
            up = self._update
            if up is None or up.begin.update_id != msg.update_id:
                raise BackendError(f"no weight update {msg.update_id!r} in progress on {self.engine_id}")
            if not 0 <= msg.bucket < len(up.begin.bucket_sizes) or not buffers:
                raise BackendError(f"bucket {msg.bucket} is not part of update {msg.update_id}")
            buf = buffers[0].buffer
            if len(buf) != up.begin.bucket_sizes[msg.bucket]:
                raise BackendError(f"bucket {msg.bucket} has {len(buf)} bytes, expected {up.begin.bucket_sizes[msg.bucket]}")
            named = unpack_bucket(msg.bucket, list(up.begin.tensors), buf)
            if up.begin.target == "model":
                self.backend.stage_weights(named)
            else:
                up.lora_tensors.extend((n, t.clone()) for n, t in named)
            up.received.add(msg.bucket)
            up.bytes += len(buf)
        except (BackendError, ValueError) as e:
            ack = P.WeightBucketAck(update_id=msg.update_id, bucket=msg.bucket, ok=False, error=f"{self.engine_id}: {e}")
            self._abort_update(str(e))
        self._send(self.weights, peer, ack)

    def _op_receive_weights(self, op: P.ReceiveWeights) -> dict:
        up = self._require_update(op.update_id)
        t0 = time.perf_counter()
        try:
            res = dict(self.backend.receive_weights(op.update_id, list(op.handles)) or {})
        except Exception:
            self._abort_update("receive failed")
            raise
        up.received.update(range(len(up.begin.bucket_sizes)))
        res["seconds"] = round(time.perf_counter() - t0, 4)
        return res

    def _op_finish_weights(self, op: P.FinishWeightUpdate) -> dict:
        up = self._require_update(op.update_id)
        missing = sorted(set(range(len(up.begin.bucket_sizes))) - up.received)
        if missing:
            self._abort_update("incomplete")
            raise BackendError(f"update {op.update_id} finished with bucket(s) {missing} never received")
        t0 = time.perf_counter()
        try:
            if up.begin.target == "model":
                self.backend.finish_weight_update()
                self.weight_version += 1
            else:
                name = up.begin.target.split(":", 1)[1]
                self.backend.load_lora(name, tensors=up.lora_tensors, config=dict(up.begin.transport_args.get("lora_config", {})))
        except Exception:
            self._abort_update("finish failed")
            raise
        self._update = None
        self.config_epoch += 1
        return {**self._config_result(), "bytes": up.bytes, "seconds": round(time.perf_counter() - t0, 4)}

    def _config_result(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "loras": self.backend.loras(), "epoch": self.config_epoch}

    def _op_abort_weights(self, op: P.AbortWeightUpdate) -> dict:
        if self._update is not None and self._update.begin.update_id == op.update_id:
            self._abort_update("aborted by the trainer")
        return {"weight_version": self.weight_version}

    def _require_update(self, update_id: str) -> "_WeightUpdate":
        if self._update is None or self._update.begin.update_id != update_id:
            raise BackendError(f"no weight update {update_id!r} in progress on {self.engine_id}")
        return self._update

    def _abort_update(self, why: str) -> None:
        up, self._update = self._update, None
        if up is not None and up.begin.target == "model":
            self.backend.abort_weight_update()
        self.log.info("weight_update_aborted", reason=why)

    def _op_load_lora(self, op: P.LoadLora) -> dict:
        if op.path is None:
            raise BadRequest("load_lora needs a path (tensors travel as a staged update)", field="path")
        self.backend.load_lora(op.name, path=op.path, config=dict(op.config) or None)
        self.config_epoch += 1
        return self._config_result()

    def _op_unload_lora(self, op: P.UnloadLora) -> dict:
        self.backend.unload_lora(op.name)
        self.config_epoch += 1
        return self._config_result()

    def _op_stats(self, op: P.Stats) -> dict:
        hb = self._make_heartbeat()
        out = {f: getattr(hb, f) for f in hb.__struct_fields__}
        out.update(self.backend.stats())
        return out


class _WeightUpdate:
    __slots__ = ("begin", "received", "bytes", "lora_tensors")

    def __init__(self, begin: P.BeginWeightUpdate) -> None:
        self.begin = begin
        self.received: set[int] = set()
        self.bytes = 0
        self.lora_tensors: list[tuple[str, Any]] = []


class _Fatal(Exception):
    """The node cannot go on (registration refused, head never answered)."""


class _Refused(RolloutBusError):
    def __init__(self, code: ErrorCode, message: str, rid: str) -> None:
        super().__init__(message, request_id=rid)
        self.code = code


def _field_of(e: Exception) -> str | None:
    text = str(e)
    for f in ("prompt_token_ids", "max_tokens", "lora"):
        if f in text:
            return "params.max_tokens" if f == "max_tokens" else f
    return None


def run_engine_node(argv: list[str] | None = None) -> int:
    """Entry point: `python -m engine_node …`."""
    from bus.runtime import become_child_process
    from engine_node.config import parse_args

    cfg = parse_args(argv)
    become_child_process(f"rollout-bus engine_node {cfg.engine_id}")
    log.info("engine_starting", engine_id=cfg.engine_id, backend=cfg.backend, model=cfg.model)
    backend = load_backend(cfg.backend, cfg.model, **cfg.backend_options)
    node = EngineNode(cfg, backend)
    signal.signal(signal.SIGTERM, node.request_stop)
    signal.signal(signal.SIGINT, node.request_stop)
    return node.run()
