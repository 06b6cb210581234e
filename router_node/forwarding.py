"""Request forwarding of the head: the in-flight ledger, dispatch, failover
and chunk aggregation.

A client's Generate is a `Flight`; each Generate the router sends to an engine
on its behalf is a `Part`. The router sees every token it forwards (one
`SampleTrack` per sample), so when an engine dies mid-request it re-submits
prompt + tokens so far elsewhere: the client's stream goes on, nothing is lost
or repeated. A non-streamed request is answered with one aggregated chunk per
sample, whose version marks say which weights made which tokens.

Hazards this module owns:
- exactly one final per sample or one Error per flight: a flight leaves
  `flights` exactly once (finished, failed, or its client gone);
- an engine leg keeps the client's request id only while no other leg uses it
  there (fast path: its chunks go out untouched), else it gets a fresh `~id`;
- chunks produced before an error reach the client before it (flush-then-error).

Ownership: the router loop thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog
import zmq

from bus import protocol as P
from bus.codec import Codec, Outbox, split_chunks
from bus.endpoint import Endpoint, send_multipart
from bus.errors import EXCEPTION_OF, BadRequest, ErrorCode, LimitExceeded, RolloutBusError
from bus.frames import (
    chunk_payload,
    chunk_versions,
    logprobs_wanted,
    note_version,
    prompt_frame_count,
    shift_marks,
    token_bytes,
    token_count,
    top_k_of,
)
from bus.validate import check_generate, prompt_from_frames
from router_node.config import RouterConfig
from router_node.policies import Sessions
from router_node.prefix import PrefixPlacement
from router_node.registry import EngineEntry, EngineState

log = structlog.get_logger("router_node")


@dataclasses.dataclass(eq=False, slots=True)
class SampleTrack:
    tokens: bytearray = dataclasses.field(default_factory=bytearray)  # the token frame layout (bus.frames)
    logprobs: bytearray = dataclasses.field(default_factory=bytearray)
    marks: list[list[int]] = dataclasses.field(default_factory=list)  # [offset, version]
    done: bool = False
    top_ids: bytearray = dataclasses.field(default_factory=bytearray)  # k per token (bus.frames)
    top_logprobs: bytearray = dataclasses.field(default_factory=bytearray)
    restarts: int = 0  # staleness restarts over every leg (what the client sees)
    leg_restarts: int = 0  # the current leg's own count (Chunk.restarts from its engine)


@dataclasses.dataclass(eq=False, slots=True)
class Flight:
    """A client's request while the router has it."""

    client: bytes
    msg: P.Generate
    prompt: bytes  # the prompt frame as received
    samples: dict[int, SampleTrack]
    parts: set[str] = dataclasses.field(default_factory=set)
    failovers: int = 0
    open: int = 0
    started: float = 0.0
    # Engines that died or hung with this request in flight: at
    # cfg.max_engine_deaths it is ended, never sent to another (a poison request).
    deaths: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False, slots=True)
class Part:
    """One Generate the router sent to one engine on behalf of a Flight."""

    rid: str
    flight: Flight
    engine_id: str
    open: int  # samples of it not finished
    indices: list[int]  # the flight's sample indexes it carries
    prefix: int = 0  # tokens of the sample's track it was sent with (a restart keeps them)


Pick = Callable[[Sequence[EngineEntry], random.Random], EngineEntry]  # policies.POLICIES
PlaceSession = Callable[[Sequence[EngineEntry], Sessions, random.Random], EngineEntry]  # policies.SESSION_PLACEMENTS


class Forwarder:
    def __init__(
        self,
        cfg: RouterConfig,
        codec: Codec,
        engines: dict[str, EngineEntry],
        sessions: Sessions,
        *,
        pick: Pick,
        place_session: PlaceSession,
        counters: dict[str, int],
        prefix: PrefixPlacement | None = None,
    ) -> None:
        self.cfg = cfg
        self.codec = codec
        self.engines = engines  # the registry (owned by the router)
        self.sessions = sessions
        self.pick = pick
        self.place_session = place_session
        self.prefix = prefix  # --policy prefix: requests without a session follow their prompt
        self.rng = random.Random(cfg.seed)
        self.counters = counters
        self.flights: dict[tuple[bytes, str], Flight] = {}
        self.inflight_of: dict[bytes, int] = {}  # client -> its flights (cfg.max_inflight_per_client)
        self.parts: dict[str, Part] = {}
        self.outbox = Outbox()  # chunks for clients, flushed per engine message
        self._rid = itertools.count(1)
        self.front: Endpoint  # set by the router once its frontend endpoint exists

    # ------------------------------------------------------------ client requests

    def on_generate(self, client: bytes, msg: P.Generate, buffers: list[Any]) -> None:
        self.counters["requests"] += 1
        rid = msg.request_id
        prompt = prompt_from_frames(msg, [b.buffer for b in buffers], max_prompt_tokens=self.cfg.max_prompt_tokens)
        vocab = min((e.reg.vocab_size for e in self.engines.values() if e.healthy and e.reg.vocab_size), default=0)
        check_generate(msg, prompt, vocab_size=vocab)
        if (client, rid) in self.flights:
            raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid, field="request_id")
        self._check_caps(client, msg)
        fl = Flight(
            client=client,
            msg=msg,
            prompt=bytes(buffers[0].buffer),
            samples={msg.sample_offset + i: SampleTrack() for i in range(msg.num_samples)},
            open=msg.num_samples,
            started=time.monotonic(),
        )
        engine = self.place(msg, exclude=None, client=client, prompt=fl.prompt)
        self.flights[(client, rid)] = fl
        self.inflight_of[client] = self.inflight_of.get(client, 0) + 1
        try:
            self.dispatch(fl, engine, list(fl.samples))
        except RolloutBusError:  # e.g. EncodeFailed: the endpoint answers it; nothing of it stays here
            for prid in list(fl.parts):
                part = self.parts.pop(prid, None)
                if part is not None:
                    engine.outstanding -= part.open
            self._drop_flight(fl)
            raise

    def _check_caps(self, client: bytes, msg: P.Generate) -> None:
        """Per-client bounds (issue 22): a client cannot hold the head's memory
        with unbounded requests or sessions. The error names the knob."""
        cfg = self.cfg
        if self.inflight_of.get(client, 0) >= cfg.max_inflight_per_client:
            self.counters["limit_exceeded"] = self.counters.get("limit_exceeded", 0) + 1
            raise LimitExceeded(
                f"this client already has {cfg.max_inflight_per_client} requests in flight "
                "(the head's --max-inflight-per-client)",
                request_id=msg.request_id,
                field="max_inflight_per_client",
            )
        sid = msg.session_id
        if sid and not self.sessions.knows(sid) and self.sessions.owned(client) >= cfg.max_sessions_per_client:
            self.counters["limit_exceeded"] = self.counters.get("limit_exceeded", 0) + 1
            raise LimitExceeded(
                f"this client already has {cfg.max_sessions_per_client} open sessions "
                "(the head's --max-sessions-per-client; end_session() frees one)",
                request_id=msg.request_id,
                field="max_sessions_per_client",
            )

    def _drop_flight(self, fl: Flight) -> bool:
        """Remove `fl` from the ledger (False: it was already gone)."""
        if self.flights.pop((fl.client, fl.msg.request_id), None) is None:
            return False
        n = self.inflight_of.get(fl.client, 0) - 1
        if n > 0:
            self.inflight_of[fl.client] = n
        else:
            self.inflight_of.pop(fl.client, None)
        return True

    def on_cancel(self, client: bytes, msg: P.Cancel, _: list[Any]) -> None:
        fl = self.flights.get((client, msg.request_id))
        if fl is None:
            return
        for rid in list(fl.parts):
            part = self.parts.get(rid)
            e = self.engines.get(part.engine_id) if part else None
            if e is not None:
                self._to_engine(e, P.Cancel(request_id=rid))

    def client_gone(self, client: bytes) -> None:
        """The frontend could not reach `client` (ROUTER_MANDATORY): stop its work."""
        for fl in [f for f in self.flights.values() if f.client == client]:
            self._drop_flight(fl)
            for rid in list(fl.parts):
                part = self.parts.pop(rid, None)
                e = self.engines.get(part.engine_id) if part else None
                if e is not None and part is not None:
                    e.outstanding -= part.open
                    self._to_engine(e, P.Cancel(request_id=rid))

    # ------------------------------------------------------------ placement and dispatch

    def place(self, msg: P.Generate, exclude: str | None, client: bytes = b"", prompt: bytes = b"") -> EngineEntry:
        """Choose an engine (raises NoHealthyEngine / BadRequest at once, never waits)."""
        cands = [e for e in self.engines.values() if e.healthy and e.engine_id != exclude]
        if not cands:
            self.counters["no_healthy_engine"] += 1
            raise EXCEPTION_OF[ErrorCode.NO_HEALTHY_ENGINE.value](
                "no healthy engine to serve the request", request_id=msg.request_id
            )
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
            self.sessions.bind(msg.session_id, e.engine_id, now, owner=client)
            return e
        if self.prefix is not None:
            return self.prefix.pick(cands, prompt, self.rng)
        return self.pick(cands, self.rng)

    def dispatch(self, fl: Flight, e: EngineEntry, indices: list[int]) -> None:
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
                left = msg.timeout_s - (time.monotonic() - fl.started) if msg.timeout_s else None
                fwd = msgspec.structs.replace(
                    msg,
                    request_id=rid,
                    stream=True,
                    num_samples=1,
                    sample_offset=group[0],
                    resume_len=token_count(tr.tokens),
                    timeout_s=max(left, 1e-3) if left is not None else None,
                )
                prompt = fl.prompt + bytes(tr.tokens)
            part = Part(
                rid=rid,
                flight=fl,
                engine_id=e.engine_id,
                open=len(group),
                indices=group,
                prefix=0 if whole else token_count(fl.samples[group[0]].tokens),
            )
            for i in group:
                fl.samples[i].leg_restarts = 0
            self.parts[rid] = part
            fl.parts.add(rid)
            e.outstanding += len(group)
            self._to_engine(e, fwd, [prompt])

    def _fresh_rid(self) -> str:
        rid = f"~{next(self._rid):x}"
        while rid in self.parts:
            rid = f"~{next(self._rid):x}"
        return rid

    def _to_engine(self, e: EngineEntry, msg: Any, buffers: Sequence[Any] = (), flags: int = 0) -> None:
        send_multipart(e.sock, self.codec.encode(msg, buffers), flags)

    # ------------------------------------------------------------ engine replies

    def engine_handlers(self, e: EngineEntry, endpoint: Callable[[], Endpoint]) -> dict[type, Any]:
        """The handler table of engine `e`'s data socket (`endpoint()`: its Endpoint)."""

        def on_error(_peer: bytes, msg: P.Error, _b: list[Any]) -> None:
            part = self.parts.get(msg.request_id)
            if part is not None and part.engine_id == e.engine_id:
                code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
                self.fail_flight(part.flight, code, msg.message, msg.field)

        def on_chunks(_peer: bytes, msg: Any, buffers: list[Any]) -> None:
            lone = endpoint().frames if isinstance(msg, P.Chunk) else None
            for ch, bufs in split_chunks(msg, buffers):
                part = self.parts.get(ch.request_id)
                if part is not None and part.engine_id == e.engine_id:  # else: failed over or ended
                    self._on_chunk(e, part, ch, bufs, lone)
            self.flush()

        return {P.Error: on_error, P.Chunk: on_chunks, P.ChunkBatch: on_chunks}

    def flush(self) -> None:
        for client, out, bufs in self.outbox.messages():
            self.front.send(client, out, bufs)

    def _on_chunk(self, e: EngineEntry, part: Part, ch: P.Chunk, buffers: list[Any], frames: list[Any] | None) -> None:
        fl = part.flight
        tr = fl.samples.get(ch.sample_index)
        if tr is None or tr.done:
            return
        npf = prompt_frame_count(ch)  # the final chunk's prompt logprobs frames come last
        head = buffers[: len(buffers) - npf]
        toks, lps = chunk_payload(head)
        if ch.restarts > tr.leg_restarts:
            # The staleness bound restarted the sample on its engine: what this
            # leg produced before is dropped; the client is told by `restarts`.
            keep = part.prefix
            if tr.tokens and tr.top_ids:
                k = len(tr.top_ids) // len(tr.tokens)
                del tr.top_ids[token_bytes(k * keep) :]
                del tr.top_logprobs[token_bytes(k * keep) :]
            del tr.tokens[token_bytes(keep) :]
            del tr.logprobs[token_bytes(keep) :]
            tr.marks = [m for m in tr.marks if m[0] < keep]
            tr.restarts += ch.restarts - tr.leg_restarts
            tr.leg_restarts = ch.restarts
        if ch.restarts != tr.restarts:
            ch = msgspec.structs.replace(ch, restarts=tr.restarts)
            frames = None  # the engine's frames carry the leg's count, not the flight's
        if toks:
            note_version(tr.marks, token_count(tr.tokens), ch.weight_version)
        tr.tokens += toks
        if lps is not None:
            tr.logprobs += lps
        if ch.top_logprobs and len(head) >= 4:
            tr.top_ids += head[2]
            tr.top_logprobs += head[3]
        final = ch.finish_reason is not None
        if fl.msg.stream:
            if frames is not None and part.rid == fl.msg.request_id and len(part.indices) == len(fl.samples):
                self.front.send_frames([fl.client, *frames])  # a lone chunk: the engine's frames, untouched
            else:
                out = ch if part.rid == fl.msg.request_id else msgspec.structs.replace(ch, request_id=fl.msg.request_id)
                if final and len(part.indices) != len(fl.samples):
                    out.num_prompt_tokens = token_count(fl.prompt) - fl.msg.resume_len
                self.outbox.add(fl.client, out, buffers)
        if not final:
            return
        tr.done = True
        if not fl.msg.stream:
            self.outbox.add(fl.client, *self._aggregate(fl, tr, ch, buffers[len(buffers) - npf :] if npf else []))
        part.open -= 1
        e.outstanding -= 1
        if part.open == 0:
            self.parts.pop(part.rid, None)
            fl.parts.discard(part.rid)
        fl.open -= 1
        if fl.open == 0:
            self._drop_flight(fl)

    def _aggregate(
        self, fl: Flight, tr: SampleTrack, last: P.Chunk, prompt_frames: list[Any]
    ) -> tuple[P.Chunk, list[bytes]]:
        """The one chunk of a finished sample of a non-streamed request."""
        skip = fl.msg.resume_len  # the client already has those tokens
        version, changes = chunk_versions(shift_marks(tr.marks, skip), last.weight_version)
        out = P.Chunk(
            request_id=fl.msg.request_id,
            sample_index=last.sample_index,
            weight_version=version,
            finish_reason=last.finish_reason,
            version_changes=changes,
            emitted_at=last.emitted_at,
            num_prompt_tokens=token_count(fl.prompt) - skip,
            engine_id=last.engine_id,
            restarts=tr.restarts,
            top_logprobs=last.top_logprobs,
            prompt_logprobs=last.prompt_logprobs,
            stop_reason=last.stop_reason,
            text=last.text,
        )
        bufs = [bytes(tr.tokens[token_bytes(skip) :])]
        if logprobs_wanted(fl.msg.params.logprobs):
            bufs.append(bytes(tr.logprobs[token_bytes(skip) :]))
            k = top_k_of(fl.msg.params.logprobs)
            if k:
                bufs += [bytes(tr.top_ids[token_bytes(k * skip) :]), bytes(tr.top_logprobs[token_bytes(k * skip) :])]
        bufs += [bytes(b) for b in prompt_frames]
        return out, bufs

    # ------------------------------------------------------------ failover and failure

    def evacuate(self, e: EngineEntry, reason: str) -> None:
        """Engine `e` is gone or hung: re-submit its requests elsewhere, or end
        them with EngineDead when failover is off, exhausted or impossible."""
        mine = [p for p in self.parts.values() if p.engine_id == e.engine_id]
        for part in mine:
            self.parts.pop(part.rid, None)
            fl = part.flight
            fl.parts.discard(part.rid)
            e.outstanding -= part.open
            try:
                self._to_engine(e, P.Cancel(request_id=part.rid), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            if (fl.client, fl.msg.request_id) not in self.flights:
                continue
            if e.engine_id not in fl.deaths:
                fl.deaths.append(e.engine_id)
            if len(fl.deaths) >= self.cfg.max_engine_deaths:
                # Poison: whatever in this request kills or wedges engines, no
                # further engine receives it (at most max_engine_deaths go down).
                self.counters["poison_requests"] = self.counters.get("poison_requests", 0) + 1
                self.counters["engine_dead"] += 1
                log.warning("poison_request", request_id=fl.msg.request_id, engines=fl.deaths, reason=reason)
                self.fail_flight(
                    fl,
                    ErrorCode.ENGINE_DEAD,
                    f"request {fl.msg.request_id} was in flight on {len(fl.deaths)} engines that died or hung "
                    f"({', '.join(fl.deaths)}; last: {reason}): not sent to another (the head's --max-engine-deaths)",
                )
                continue
            left = [i for i in part.indices if not fl.samples[i].done]
            if self.cfg.failover and fl.failovers < self.cfg.max_failovers:
                try:
                    target: EngineEntry | None = self.place(
                        fl.msg, exclude=e.engine_id, client=fl.client, prompt=fl.prompt
                    )
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
                    try:
                        self.dispatch(fl, target, left)
                    except RolloutBusError as err:  # e.g. EncodeFailed: this flight ends, the head goes on
                        self.fail_flight(fl, err.code, err.message, err.field)
                    continue
            self.counters["engine_dead"] += 1
            self.fail_flight(
                fl, ErrorCode.ENGINE_DEAD, f"engine {e.engine_id} died with the request in flight: {reason}"
            )
        e.outstanding = max(0, e.outstanding)

    def fail_flight(self, fl: Flight, code: ErrorCode, message: str, field: str | None = None) -> None:
        if not self._drop_flight(fl):
            return
        for rid in list(fl.parts):
            part = self.parts.pop(rid, None)
            if part is None:
                continue
            e = self.engines.get(part.engine_id)
            if e is not None:
                e.outstanding -= part.open
                if e.state is not EngineState.SILENT:
                    self._to_engine(e, P.Cancel(request_id=rid))
        fl.parts.clear()
        self.front.fail(fl.client, fl.msg.request_id, code, message, field)

    def fail_all(self, code: ErrorCode, message: str) -> None:
        for fl in list(self.flights.values()):
            self.fail_flight(fl, code, message)
