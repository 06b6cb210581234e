"""The head process: engine registry, health, routing, forwarding, control fan-out.

One thread owns every socket: the frontend ROUTER (clients), the events
ROUTER (engines' register/heartbeat/ack), the control PUB, and one DEALER per
engine data socket. The router sees every token it forwards, so when an engine
dies mid-request it re-submits prompt + tokens so far elsewhere (failover):
the client's stream goes on, nothing is lost or repeated.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import json
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog
import zmq

from bus import protocol as P
from bus.codec import Codec, Outbox, request_id_of, split_chunks
from bus.control_bus import ControlBus, PendingCommand
from bus.errors import BadRequest, ErrorCode, ProtocolError, RolloutBusError
from bus.logprob_frames import logprobs_wanted, prompt_frame_count, top_k_of
from bus.sockets import CONTROL_HWM, CurveKeys, bound_address, check_endpoint, make_socket
from bus.validate import check_generate, prompt_from_frames
from router_node.config import RouterConfig
from router_node.policies import POLICIES, SESSION_PLACEMENTS, Sessions
from router_node.registry import EngineEntry, EngineState

log = structlog.get_logger("router_node")


class Lifecycle(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclasses.dataclass(eq=False, slots=True)
class SampleTrack:
    tokens: bytearray = dataclasses.field(default_factory=bytearray)  # int32
    logprobs: bytearray = dataclasses.field(default_factory=bytearray)  # float32
    marks: list[list[int]] = dataclasses.field(default_factory=list)  # [offset, version]
    done: bool = False
    top_ids: bytearray = dataclasses.field(default_factory=bytearray)  # int32, k per token (issue 10)
    top_logprobs: bytearray = dataclasses.field(default_factory=bytearray)  # float32


@dataclasses.dataclass(eq=False, slots=True)
class Flight:
    """A client's request while the router has it."""

    client: bytes
    msg: P.Generate
    prompt: bytes  # int32 token ids as received
    samples: dict[int, SampleTrack]
    parts: set[str] = dataclasses.field(default_factory=set)
    failovers: int = 0
    open: int = 0
    started: float = 0.0


@dataclasses.dataclass(eq=False, slots=True)
class Part:
    """One Generate the router sent to one engine on behalf of a Flight."""

    rid: str
    flight: Flight
    engine_id: str
    open: int  # samples of it not finished
    indices: list[int]  # the flight's sample indexes it carries


class Router:
    def __init__(self, cfg: RouterConfig, ctx: zmq.Context | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.codec = Codec()
        self.lifecycle = Lifecycle.STARTING
        curve = CurveKeys.load(cfg.curve_dir) if cfg.curve_dir else None
        self._curve = curve

        def server(kind: int, addr: str, **kw: Any) -> zmq.Socket:
            tcp = addr.startswith("tcp://")
            return make_socket(self.ctx, kind, bind=addr, curve=curve if tcp else None, curve_server=True, **kw)

        self.frontend = server(zmq.ROUTER, cfg.frontend)
        self.events = server(zmq.ROUTER, cfg.events, hwm=CONTROL_HWM)
        self.pub = server(zmq.PUB, cfg.control, hwm=CONTROL_HWM)
        self.addresses = {
            "frontend": bound_address(self.frontend),
            "events": bound_address(self.events),
            "control": bound_address(self.pub),
        }
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.events, zmq.POLLIN)
        self.bus = ControlBus(self.pub, self.codec)
        self.engines: dict[str, EngineEntry] = {}
        self._by_sock: dict[zmq.Socket, EngineEntry] = {}
        self.flights: dict[tuple[bytes, str], Flight] = {}
        self.parts: dict[str, Part] = {}
        self.outbox = Outbox()  # chunks for clients, flushed per engine message
        self.sessions = Sessions(cfg.session_ttl_s)
        if cfg.session_placement not in SESSION_PLACEMENTS:
            raise ValueError(
                f"--session-placement must be one of {sorted(SESSION_PLACEMENTS)}, got {cfg.session_placement!r}"
            )
        self.place_session = SESSION_PLACEMENTS[cfg.session_placement]
        self.rng = random.Random(cfg.seed)
        self.pick = POLICIES[cfg.policy]
        self._rid = itertools.count(1)
        self.counters = {"requests": 0, "errors": 0, "failovers": 0, "engine_dead": 0, "no_healthy_engine": 0}
        self._front_handlers: dict[type, Callable[[bytes, Any, list[Any]], None]] = {
            P.Generate: self._on_generate,
            P.Cancel: self._on_cancel,
            P.Control: self._on_control,
            P.Query: self._on_query,
            P.EndSession: self._on_end_session,
        }
        self._event_handlers: dict[type, Callable[[bytes, Any], None]] = {
            P.Register: self._on_register,
            P.Heartbeat: self._on_heartbeat,
            P.Ack: self._on_ack,
        }
        self._queries: dict[str, Callable[[], dict[str, Any]]] = {
            "health": self.health,
            "engines": lambda: {"engines": [e.describe(time.monotonic()) for e in self.engines.values()]},
            "stats": lambda: {
                "counters": dict(self.counters),
                "in_flight": len(self.flights),
                "sessions": self.sessions.count(),
            },
        }
        self._last_tick = 0.0
        # Cluster-wide pauses in force (scope -> Pause op): an engine that joins
        # or restarts meanwhile is paused the same way before it gets traffic.
        self.cluster_pauses: dict[str, P.Pause] = {}

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
        for sock, _ in self.poller.poll(50):
            if sock is self.frontend:
                self._drain(sock, self._on_frontend)
            elif sock is self.events:
                self._drain(sock, self._on_event)
            else:
                entry = self._by_sock.get(sock)
                if entry is not None:
                    self._drain(sock, functools.partial(self._on_engine, entry))
        now = time.monotonic()
        if now - self._last_tick >= 0.05:
            self._last_tick = now
            self._tick(now)

    def _drain(self, sock: zmq.Socket, handler: Callable[[list[Any]], None]) -> None:
        for _ in range(512):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # a frame our handlers did not foresee: the head outlives it
                log.exception("frame_handler_crashed", frames=len(frames))

    def _shutdown(self) -> None:
        # Every accepted request gets its one error: nobody waits on a dead head.
        for fl in list(self.flights.values()):
            self._fail_flight(fl, ErrorCode.ENGINE_DEAD, "the head (router) is shutting down")
        for e in self.engines.values():
            e.sock.close(linger=0)
        for s in (self.frontend, self.events, self.pub):
            s.close(linger=0)
        if self._own_ctx:
            self.ctx.term()
        self.lifecycle = Lifecycle.STOPPED
        log.info("router_stopped")

    # ------------------------------------------------------------ health

    def _tick(self, now: float) -> None:
        deadline = self.cfg.missed_heartbeats * self.cfg.heartbeat_interval_s
        for e in list(self.engines.values()):
            state, reason = e.evaluate(now, deadline_s=deadline, stall_timeout_s=self.cfg.stall_timeout_s)
            if state is not e.state:
                self._set_state(e, state, reason, now)
            e.reason = reason
            if e.state is EngineState.SILENT and e.silent_since and now - e.silent_since > self.cfg.forget_after_s:
                self._forget(e)
        self.bus.tick(now)
        self.sessions.expire(now)

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
            self._evacuate(e, reason)

    def _forget(self, e: EngineEntry) -> None:
        self.engines.pop(e.engine_id, None)
        self._by_sock.pop(e.sock, None)
        self.poller.unregister(e.sock)
        e.sock.close(linger=0)
        log.info("engine_forgotten", engine_id=e.engine_id)

    def health(self) -> dict[str, Any]:
        now = time.monotonic()
        engines = {eid: {**e.describe(now), "sessions": self.sessions.count(eid)} for eid, e in self.engines.items()}
        return {"healthy": any(e.healthy for e in self.engines.values()), "engines": engines}

    # ------------------------------------------------------------ events

    def _on_event(self, frames: list[Any]) -> None:
        ident = frames[0].bytes
        try:
            msg, _ = self.codec.decode([f.bytes for f in frames[1:]])
        except RolloutBusError as e:
            log.warning("bad_event", error=str(e))
            return
        handler = self._event_handlers.get(type(msg))
        if handler is not None:
            handler(ident, msg)

    def _on_register(self, ident: bytes, reg: P.Register) -> None:
        if reg.protocol_version != P.PROTOCOL_VERSION:
            err = f"protocol version {reg.protocol_version} != head's {P.PROTOCOL_VERSION}: upgrade the older side"
            log.error("register_refused", engine_id=reg.engine_id, error=err)
            self._send(self.events, ident, P.RegisterReply(ok=False, error=err))
            return
        try:
            check_endpoint(reg.data_address, field="data_address")
            if reg.weight_address:
                check_endpoint(reg.weight_address, field="weight_address")
            if not reg.engine_id or len(reg.engine_id) > 128:
                raise BadRequest("engine_id must be 1-128 characters", field="engine_id")
        except BadRequest as err:
            log.warning("register_refused", engine_id=reg.engine_id[:128], error=str(err))
            self._send(self.events, ident, P.RegisterReply(ok=False, error=str(err)))
            return
        now = time.monotonic()
        old = self.engines.get(reg.engine_id)
        if old is not None and old.reg.incarnation == reg.incarnation:
            self._send(self.events, ident, P.RegisterReply(ok=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s))
            return
        if old is not None:  # restarted process under the same id: what it ran is gone
            self._evacuate(old, f"engine {reg.engine_id} restarted")
            self.bus.engine_gone(reg.engine_id)
            self._forget(old)
        tcp = reg.data_address.startswith("tcp://")
        sock = make_socket(self.ctx, zmq.DEALER, connect=reg.data_address, curve=self._curve if tcp else None)
        e = EngineEntry(reg=reg, sock=sock, registered_at=now, last_seen=now, steps_changed_at=now)
        e.loras = set(reg.loras)
        e.weight_version = reg.weight_version
        self.engines[reg.engine_id] = e
        self._by_sock[sock] = e
        self.poller.register(sock, zmq.POLLIN)
        self._send(self.events, ident, P.RegisterReply(ok=True, heartbeat_interval_s=self.cfg.heartbeat_interval_s))
        log.info("engine_registered", engine_id=reg.engine_id, data=reg.data_address, backend=reg.backend)

        # Join: ack a ping (so PUB/SUB is connected), then apply every
        # cluster-wide pause in force, one acked command at a time; only then
        # is the engine healthy and routable.
        steps: list[Any] = [P.Ping(), *self.cluster_pauses.values()]

        def next_step(pc: PendingCommand | None, e: EngineEntry = e) -> None:
            if self.engines.get(e.engine_id) is not e:
                return
            if pc is not None and e.engine_id not in pc.acks:
                log.warning("engine_never_joined", engine_id=e.engine_id, join_timeout_s=self.cfg.join_timeout_s)
                self._forget(e)
                return
            if steps:
                self.bus.publish(steps.pop(0), [e.engine_id], self.cfg.join_timeout_s, next_step)
                return
            e.state = EngineState.HEALTHY
            e.reason = "ok"
            e.last_seen = e.steps_changed_at = time.monotonic()
            log.info("engine_joined", engine_id=e.engine_id, paused=sorted(self.cluster_pauses))

        next_step(None)

    def _on_heartbeat(self, _: bytes, hb: P.Heartbeat) -> None:
        e = self.engines.get(hb.engine_id)
        if e is not None and e.reg.incarnation == hb.incarnation:
            e.on_heartbeat(hb, time.monotonic())

    def _on_ack(self, _: bytes, ack: P.Ack) -> None:
        e = self.engines.get(ack.engine_id)
        r = ack.result
        if e is not None and ack.ok and "epoch" in r:
            try:
                epoch, version, loras = int(r["epoch"]), int(r["weight_version"]), [str(x) for x in r["loras"]]
            except (KeyError, TypeError, ValueError) as err:
                # Ack.result is still a free dict (typed results are the protocol
                # issue's work): a malformed one is dropped, never a crash.
                log.warning("bad_ack_result", engine_id=ack.engine_id, seq=ack.seq, error=repr(err))
                return
            e.apply_config(epoch, version, loras)
        self.bus.on_ack(ack)

    # ------------------------------------------------------------ frontend

    def _on_frontend(self, frames: list[Any]) -> None:
        client = frames[0].bytes
        body = frames[1:]
        try:
            msg, buffers = self.codec.decode(body)
            handler = self._front_handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not a request", field="kind")
            handler(client, msg, buffers)
        except RolloutBusError as e:
            rid = e.request_id or (request_id_of([f.bytes for f in body[:2]]) if len(body) >= 2 else "")
            self._reply_error(client, rid, e.code, e.message, e.field)
        except Exception as e:  # our bug: answer it and keep serving
            log.exception("frontend_handler_crashed")
            rid = request_id_of([f.bytes for f in body[:2]]) if len(body) >= 2 else ""
            self._reply_error(client, rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", None)

    def _on_generate(self, client: bytes, msg: P.Generate, buffers: list[Any]) -> None:
        self.counters["requests"] += 1
        rid = msg.request_id
        prompt = prompt_from_frames(msg, [b.buffer for b in buffers], max_prompt_tokens=self.cfg.max_prompt_tokens)
        vocab = min((e.reg.vocab_size for e in self.engines.values() if e.healthy and e.reg.vocab_size), default=0)
        check_generate(msg, prompt, vocab_size=vocab)
        if (client, rid) in self.flights:
            raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid, field="request_id")
        fl = Flight(
            client=client,
            msg=msg,
            prompt=bytes(buffers[0].buffer),
            samples={msg.sample_offset + i: SampleTrack() for i in range(msg.num_samples)},
            open=msg.num_samples,
            started=time.monotonic(),
        )
        engine = self._place(msg, exclude=None)
        self.flights[(client, rid)] = fl
        self._dispatch(fl, engine, list(fl.samples))

    def _place(self, msg: P.Generate, exclude: str | None) -> EngineEntry:
        """Choose an engine (raises NoHealthyEngine / BadRequest at once, never waits)."""
        cands = [e for e in self.engines.values() if e.healthy and e.engine_id != exclude]
        if not cands:
            self.counters["no_healthy_engine"] += 1
            raise _err(ErrorCode.NO_HEALTHY_ENGINE, "no healthy engine to serve the request", msg.request_id)
        if msg.lora is not None:
            cands = [e for e in cands if msg.lora in e.loras]
            if not cands:
                raise BadRequest(
                    f"LoRA adapter {msg.lora!r} is loaded on no healthy engine", request_id=msg.request_id, field="lora"
                )
        now = time.monotonic()
        if msg.session_id:
            eid = self.sessions.engine_for(msg.session_id, now)
            e = self.engines.get(eid) if eid else None
            if e is None or e not in cands:
                e = self.place_session(cands, self.sessions, self.rng)  # new or re-placed session
            self.sessions.bind(msg.session_id, e.engine_id, now)
            return e
        return self.pick(cands, self.rng)

    def _dispatch(self, fl: Flight, e: EngineEntry, indices: list[int]) -> None:
        """Send (part of) a flight to engine `e`: the whole request, or — after
        a failover — each unfinished sample alone, with its tokens so far."""
        msg = fl.msg
        whole = len(indices) == msg.num_samples and all(not fl.samples[i].tokens for i in indices)
        groups = [indices] if whole else [[i] for i in indices]
        for group in groups:
            # Fast path: the engine leg keeps the client's request id when no
            # other flight uses it there, so its chunks go out as they came.
            rid = msg.request_id if whole and msg.request_id not in self.parts else self._fresh_rid()
            if whole:
                fwd = msgspec.structs.replace(msg, request_id=rid, stream=True)
                prompt = fl.prompt
            else:
                tr = fl.samples[group[0]]
                done_n = len(tr.tokens) // 4
                left = msg.timeout_s - (time.monotonic() - fl.started) if msg.timeout_s else None
                fwd = msgspec.structs.replace(
                    msg,
                    request_id=rid,
                    stream=True,
                    num_samples=1,
                    sample_offset=group[0],
                    resume_len=done_n,
                    timeout_s=max(left, 1e-3) if left is not None else None,
                )
                prompt = fl.prompt + bytes(tr.tokens)
            part = Part(rid=rid, flight=fl, engine_id=e.engine_id, open=len(group), indices=group)
            self.parts[rid] = part
            fl.parts.add(rid)
            e.outstanding += len(group)
            e.sock.send_multipart(self.codec.encode(fwd, [prompt]))

    def _fresh_rid(self) -> str:
        rid = f"~{next(self._rid):x}"
        while rid in self.parts:
            rid = f"~{next(self._rid):x}"
        return rid

    def _on_cancel(self, client: bytes, msg: P.Cancel, _: list[Any]) -> None:
        fl = self.flights.get((client, msg.request_id))
        if fl is None:
            return
        for rid in list(fl.parts):
            part = self.parts.get(rid)
            e = self.engines.get(part.engine_id) if part else None
            if e is not None:
                e.sock.send_multipart(self.codec.encode(P.Cancel(request_id=rid)))

    def _on_end_session(self, client: bytes, msg: P.EndSession, _: list[Any]) -> None:
        ended = self.sessions.end(msg.session_id)
        self._send(self.frontend, client, P.QueryReply(request_id=msg.request_id, body={"ended": ended}))

    def _on_query(self, client: bytes, msg: P.Query, _: list[Any]) -> None:
        fn = self._queries.get(msg.what)
        if fn is None:
            raise BadRequest(
                f"unknown query {msg.what!r} (one of {sorted(self._queries)})", request_id=msg.request_id, field="what"
            )
        self._send(self.frontend, client, P.QueryReply(request_id=msg.request_id, body=fn()))

    def _on_control(self, client: bytes, msg: P.Control, _: list[Any]) -> None:
        if msg.targets is None:
            targets = [eid for eid, e in self.engines.items() if e.state is not EngineState.JOINING]
        else:
            unknown = [t for t in msg.targets if t not in self.engines]
            if unknown:
                raise BadRequest(f"unknown engine(s) {unknown}", request_id=msg.request_id, field="targets")
            targets = list(msg.targets)
        silent = [t for t in targets if self.engines[t].state is EngineState.SILENT]
        if msg.targets is None:
            self._track_cluster_pause(msg.op)

        def done(pc: PendingCommand) -> None:
            results = {eid: dict(a.result) for eid, a in pc.acks.items() if a.ok}
            errors = {eid: a.error or "failed" for eid, a in pc.acks.items() if not a.ok}
            reply = P.ControlReply(request_id=msg.request_id, results=results, errors=errors, missing=pc.missing)
            self._send(self.frontend, client, reply)

        # Silent (presumed dead) targets are reported missing, never waited on.
        self.bus.publish(msg.op, targets, msg.timeout_s, done, gone=silent)

    def _track_cluster_pause(self, op: Any) -> None:
        if isinstance(op, P.Pause):
            self.cluster_pauses[op.lora or "*"] = op
        elif isinstance(op, P.Resume):
            if op.lora is None:
                self.cluster_pauses.clear()
            else:
                self.cluster_pauses.pop(op.lora, None)

    # ------------------------------------------------------------ engine replies

    def _on_engine(self, e: EngineEntry, frames: list[Any]) -> None:
        try:
            msg, buffers = self.codec.decode(frames)
        except RolloutBusError as err:
            log.warning("bad_engine_frame", engine_id=e.engine_id, error=str(err))
            return
        if isinstance(msg, P.Error):
            part = self.parts.get(msg.request_id)
            if part is not None and part.engine_id == e.engine_id:
                code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
                self._fail_flight(part.flight, code, msg.message, msg.field)
            return
        if not isinstance(msg, (P.Chunk, P.ChunkBatch)):
            return
        single = isinstance(msg, P.Chunk)
        for ch, bufs in split_chunks(msg, buffers):
            part = self.parts.get(ch.request_id)
            if part is not None and part.engine_id == e.engine_id:  # else: failed over or ended
                self._on_chunk(e, part, ch, bufs, frames if single else None)
        self._flush()

    def _flush(self) -> None:
        for client, out, bufs in self.outbox.messages():
            self._send(self.frontend, client, out, bufs)

    def _on_chunk(self, e: EngineEntry, part: Part, ch: P.Chunk, buffers: list[Any], frames: list[Any] | None) -> None:
        fl = part.flight
        tr = fl.samples.get(ch.sample_index)
        if tr is None or tr.done:
            return
        npf = prompt_frame_count(ch)  # the final chunk's prompt logprobs frames come last
        head = buffers[: len(buffers) - npf]
        toks = head[0].bytes if head else b""
        lps = head[1].bytes if len(head) > 1 else b""
        if toks and (not tr.marks or tr.marks[-1][1] != ch.weight_version):
            tr.marks.append([len(tr.tokens) // 4, ch.weight_version])
        tr.tokens += toks
        tr.logprobs += lps
        if ch.top_logprobs and len(head) >= 4:
            tr.top_ids += head[2].bytes
            tr.top_logprobs += head[3].bytes
        final = ch.finish_reason is not None
        if fl.msg.stream:
            if frames is not None and part.rid == fl.msg.request_id and len(part.indices) == len(fl.samples):
                self._send_raw(fl.client, frames)  # a lone chunk: the engine's frames, untouched
            else:
                out = ch if part.rid == fl.msg.request_id else msgspec.structs.replace(ch, request_id=fl.msg.request_id)
                if final and len(part.indices) != len(fl.samples):
                    out.num_prompt_tokens = len(fl.prompt) // 4 - fl.msg.resume_len
                self.outbox.add(fl.client, out, buffers)
        if not final:
            return
        tr.done = True
        if not fl.msg.stream:
            skip = fl.msg.resume_len  # the client already has those tokens
            marks = [[max(0, o - skip), v] for o, v in tr.marks]
            out = P.Chunk(
                request_id=fl.msg.request_id,
                sample_index=ch.sample_index,
                weight_version=marks[0][1] if marks else ch.weight_version,
                finish_reason=ch.finish_reason,
                version_changes=marks[1:],
                emitted_at=ch.emitted_at,
                num_prompt_tokens=len(fl.prompt) // 4 - skip,
                engine_id=ch.engine_id,
                top_logprobs=ch.top_logprobs,
                prompt_logprobs=ch.prompt_logprobs,
                stop_reason=ch.stop_reason,
                text=ch.text,
            )
            bufs = [bytes(tr.tokens[4 * skip :])]
            if logprobs_wanted(fl.msg.params.logprobs):
                bufs.append(bytes(tr.logprobs[4 * skip :]))
                k = top_k_of(fl.msg.params.logprobs)
                if k:
                    bufs += [bytes(tr.top_ids[4 * k * skip :]), bytes(tr.top_logprobs[4 * k * skip :])]
            if npf:
                bufs += [b.bytes for b in buffers[len(buffers) - npf :]]
            self.outbox.add(fl.client, out, bufs)
        part.open -= 1
        e.outstanding -= 1
        if part.open == 0:
            self.parts.pop(part.rid, None)
            fl.parts.discard(part.rid)
        fl.open -= 1
        if fl.open == 0:
            self.flights.pop((fl.client, fl.msg.request_id), None)

    def _evacuate(self, e: EngineEntry, reason: str) -> None:
        """Engine `e` is gone or hung: re-submit its requests elsewhere, or end
        them with EngineDead when failover is off, exhausted or impossible."""
        mine = [p for p in self.parts.values() if p.engine_id == e.engine_id]
        for part in mine:
            self.parts.pop(part.rid, None)
            fl = part.flight
            fl.parts.discard(part.rid)
            e.outstanding -= part.open
            try:
                e.sock.send_multipart(self.codec.encode(P.Cancel(request_id=part.rid)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if (fl.client, fl.msg.request_id) not in self.flights:
                continue
            left = [i for i in part.indices if not fl.samples[i].done]
            if self.cfg.failover and fl.failovers < self.cfg.max_failovers:
                try:
                    target = self._place(fl.msg, exclude=e.engine_id)
                except RolloutBusError:
                    target = None
                if target is not None:
                    fl.failovers += 1
                    self.counters["failovers"] += 1
                    log.info(
                        "failover",
                        request_id=fl.msg.request_id,
                        engine_id=e.engine_id,
                        to=target.engine_id,
                        samples=len(left),
                    )
                    self._dispatch(fl, target, left)
                    continue
            self.counters["engine_dead"] += 1
            self._fail_flight(
                fl, ErrorCode.ENGINE_DEAD, f"engine {e.engine_id} died with the request in flight: {reason}"
            )
        e.outstanding = max(0, e.outstanding)

    def _fail_flight(self, fl: Flight, code: ErrorCode, message: str, field: str | None = None) -> None:
        if self.flights.pop((fl.client, fl.msg.request_id), None) is None:
            return
        for rid in list(fl.parts):
            part = self.parts.pop(rid, None)
            if part is None:
                continue
            e = self.engines.get(part.engine_id)
            if e is not None:
                e.outstanding -= part.open
                if e.state is not EngineState.SILENT:
                    e.sock.send_multipart(self.codec.encode(P.Cancel(request_id=rid)))
        fl.parts.clear()
        self._reply_error(fl.client, fl.msg.request_id, code, message, field)

    # ------------------------------------------------------------ sending

    def _reply_error(self, client: bytes, rid: str, code: ErrorCode, message: str, field: str | None) -> None:
        self._flush()  # chunks already produced go out before the error
        self.counters["errors"] += 1
        log.info("request_error", request_id=rid, code=code.value, field=field, error=message)
        self._send(self.frontend, client, P.Error(request_id=rid, code=code.value, message=message, field=field))

    def _send_raw(self, client: bytes, frames: list[Any]) -> None:
        self._send(self.frontend, client, None, frames=[client, *frames])

    def _send(
        self, sock: zmq.Socket, peer: bytes, msg: Any, buffers: Sequence[Any] = (), frames: list[Any] | None = None
    ) -> None:
        try:
            sock.send_multipart(frames if frames is not None else [peer, *self.codec.encode(msg, buffers)])
        except zmq.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            if sock is self.frontend:  # the client left: stop its work
                for fl in [f for f in self.flights.values() if f.client == peer]:
                    self.flights.pop((fl.client, fl.msg.request_id), None)
                    for rid in list(fl.parts):
                        part = self.parts.pop(rid, None)
                        e = self.engines.get(part.engine_id) if part else None
                        if e is not None and part is not None:
                            e.outstanding -= part.open
                            e.sock.send_multipart(self.codec.encode(P.Cancel(request_id=rid)))


def _err(code: ErrorCode, message: str, rid: str) -> RolloutBusError:
    from bus.errors import EXCEPTION_OF

    return EXCEPTION_OF[code.value](message, request_id=rid)


def run_router_node(argv: list[str] | None = None) -> int:
    """Entry point: `python -m router_node …`."""
    from bus.runtime import become_child_process
    from router_node.config import parse_args

    cfg = parse_args(argv)
    become_child_process("rollout-bus router_node")
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
