"""Request forwarding of the head as a state machine without I/O: placement,
dispatch, failover and chunk aggregation.

Events in (a client's generate / cancel / departure, an engine's chunk or
error, an engine that died or hung, a leg the shell could not send), typed
actions out (router_node/actions.py); the shell (router_node/forwarding.py)
owns the sockets and executes them. The head sees every token it forwards, so
when an engine dies mid-request the flight is re-submitted elsewhere with
prompt + tokens so far: the client's stream goes on, nothing lost or repeated.
A non-streamed request is answered with one aggregated chunk per sample,
whose version marks say which weights made which tokens. Request deadlines are
the engines' (a timeout arrives as their Error; a re-submitted leg carries what
is left of the client's timeout_s).

Hazards this module owns:
- exactly one final per sample or one Error per flight: a flight leaves the
  ledger exactly once (finished, failed, or its client gone), and nothing of
  it is sent to its client after;
- an engine leg keeps the client's request id only while no other leg uses it
  and its engine owes nothing under it (router_node/flights.py), else `~id`;
- chunks produced before an error reach the client before it (the actions'
  order; the shell flushes before an error).

Ownership: the router loop thread.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog

from bus import protocol as P
from bus.errors import EXCEPTION_OF, BadRequest, ErrorCode, LimitExceeded, RolloutBusError
from bus.frames import chunk_payload, prompt_frame_count, split_routes, token_count
from bus.validate import check_generate, check_request_budget, prompt_from_frames
from router_node.actions import Action, FailRequest, RelayToClient, SendToClient, SendToEngine
from router_node.config import RouterConfig
from router_node.flights import Flight, Ledger, Part, SampleTrack, aggregate, record, record_routes, restart_leg
from router_node.policies import Sessions
from router_node.prefix import PrefixPlacement
from router_node.registry import EngineEntry, EngineState

log = structlog.get_logger("router_node")

Pick = Callable[[Sequence[EngineEntry], random.Random], EngineEntry]  # policies.POLICIES
PlaceSession = Callable[[Sequence[EngineEntry], Sessions, random.Random], EngineEntry]  # policies.SESSION_PLACEMENTS


class ForwardingCore:
    def __init__(
        self,
        cfg: RouterConfig,
        engines: dict[str, EngineEntry],
        sessions: Sessions,
        *,
        pick: Pick,
        place_session: PlaceSession,
        counters: dict[str, int],
        prefix: PrefixPlacement | None = None,
    ) -> None:
        self.cfg = cfg
        self.engines = engines  # the registry (owned by the router); read, and `outstanding` kept
        self.sessions = sessions
        self.pick = pick
        self.place_session = place_session
        self.prefix = prefix  # --policy prefix: requests without a session follow their prompt
        self.rng = random.Random(cfg.seed)
        self.counters = counters
        self.ledger = Ledger()
        self.flights = self.ledger.flights
        self.parts = self.ledger.parts

    # ------------------------------------------------------------ client requests

    def generate(self, client: bytes, msg: P.Generate, buffers: list[Any], now: float) -> list[Action]:
        """A client's Generate: refused at once (raises the typed error), or
        accepted and dispatched."""
        self.counters["requests"] += 1
        rid = msg.request_id
        prompt = prompt_from_frames(msg, buffers, max_prompt_tokens=self.cfg.max_prompt_tokens)
        vocab = min((e.reg.vocab_size for e in self.engines.values() if e.healthy and e.reg.vocab_size), default=0)
        check_generate(msg, prompt, vocab_size=vocab)
        check_request_budget(msg, len(prompt), self.cfg.max_request_tokens, "head")
        if (client, rid) in self.flights:
            raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid, field="request_id")
        self._check_caps(client, msg)
        fl = Flight(
            client=client,
            msg=msg,
            prompt=bytes(buffers[0]),
            samples={msg.sample_offset + i: SampleTrack() for i in range(msg.num_samples)},
            open=msg.num_samples,
            started=now,
        )
        engine = self.place(msg, exclude=None, client=client, prompt=fl.prompt, now=now)
        self.ledger.add_flight(fl)
        out: list[Action] = []
        self.dispatch(fl, engine, list(fl.samples), now, out)
        return out

    def _check_caps(self, client: bytes, msg: P.Generate) -> None:
        """Per-client bounds (issue 22): a client cannot hold the head's memory
        with unbounded requests or sessions. The error names the knob."""
        cfg = self.cfg
        if self.ledger.inflight_of.get(client, 0) >= cfg.max_inflight_per_client:
            self.counters["limit_exceeded"] = self.counters.get("limit_exceeded", 0) + 1
            raise LimitExceeded(
                f"this client already has {cfg.max_inflight_per_client} requests in flight "
                f"(field max_inflight_per_client: the head's --max-inflight-per-client {cfg.max_inflight_per_client}; "
                "trainer_bridge's Client paces itself under it)",
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

    def cancel(self, client: bytes, request_id: str) -> list[Action]:
        """The client cancels: every leg is cancelled on its engine; the flight
        ends by the engines' "cancelled" finals (or an error), as any other."""
        fl = self.flights.get((client, request_id))
        if fl is None:
            return []
        out: list[Action] = []
        for rid in list(fl.parts):
            part = self.parts.get(rid)
            if part is not None and part.engine_id in self.engines:
                out.append(SendToEngine(part.engine_id, P.Cancel(request_id=rid)))
        return out

    def client_gone(self, client: bytes) -> list[Action]:
        """The client cannot be reached (gone, or over its HWM): stop its work, silently."""
        out: list[Action] = []
        for fl in [f for f in self.flights.values() if f.client == client]:
            self.ledger.drop_flight(fl)
            self._cancel_legs(fl, out, silent_too=True)
        return out

    # ------------------------------------------------------------ placement and dispatch

    def place(
        self, msg: P.Generate, exclude: str | None, client: bytes = b"", prompt: bytes = b"", now: float = 0.0
    ) -> EngineEntry:
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

    def dispatch(self, fl: Flight, e: EngineEntry, indices: list[int], now: float, out: list[Action]) -> None:
        """Send (part of) a flight to engine `e`: the whole request, or — after
        a failover — each unfinished sample alone, with its tokens so far
        (they count as output: resume_len, after the client's own)."""
        msg = fl.msg
        whole = len(indices) == msg.num_samples and all(not fl.samples[i].tokens for i in indices)
        groups = [indices] if whole else [[i] for i in indices]
        for group in groups:
            rid = self.ledger.leg_id(e.engine_id, msg.request_id, whole)
            if whole:
                fwd = msgspec.structs.replace(msg, request_id=rid, stream=True)
                prompt = fl.prompt
                prefix = 0
            else:
                tr = fl.samples[group[0]]
                prefix = token_count(tr.tokens)
                left = msg.timeout_s - (now - fl.started) if msg.timeout_s else None
                fwd = msgspec.structs.replace(
                    msg,
                    request_id=rid,
                    stream=True,
                    num_samples=1,
                    sample_offset=group[0],
                    resume_len=msg.resume_len + prefix,
                    timeout_s=max(left, 1e-3) if left is not None else None,
                )
                prompt = fl.prompt + bytes(tr.tokens)
            for i in group:
                fl.samples[i].leg_restarts = 0
                fl.samples[i].leg_routes = len(fl.samples[i].routes)
            self.ledger.add_part(
                Part(rid=rid, flight=fl, engine_id=e.engine_id, open=len(group), indices=group, prefix=prefix)
            )
            e.outstanding += len(group)
            out.append(SendToEngine(e.engine_id, fwd, (prompt,)))

    def leg_unsent(self, rid: str, err: RolloutBusError) -> list[Action]:
        """The shell could not send leg `rid` (e.g. EncodeFailed): it never
        reached its engine; its flight ends with that error."""
        part = self.ledger.pop_part(rid)
        if part is None:
            return []
        e = self.engines.get(part.engine_id)
        if e is not None:
            e.outstanding -= part.open
        return self.fail(part.flight, err.code, err.message, err.field)

    # ------------------------------------------------------------ engine replies

    def engine_error(self, engine_id: str, msg: P.Error) -> list[Action]:
        """An engine's Error for one leg (a timeout, a refusal): the flight ends with it."""
        part = self.parts.get(msg.request_id)
        if part is None or part.engine_id != engine_id:
            self.ledger.owed(engine_id, msg.request_id, final=True, error=True)
            return []
        self.ledger.pop_part(part.rid)  # the engine ended this leg: it owes nothing more
        e = self.engines.get(engine_id)
        if e is not None:
            e.outstanding -= part.open
        code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
        return self.fail(part.flight, code, msg.message, msg.field)

    def chunk(self, engine_id: str, ch: P.Chunk, buffers: list[Any], frames: list[Any] | None) -> list[Action]:
        """One chunk of an engine (`frames`: the message as it came, when it was
        this chunk alone; None for one of a batch)."""
        part = self.parts.get(ch.request_id)
        if part is None or part.engine_id != engine_id:  # a leg the head let go of
            self.ledger.owed(engine_id, ch.request_id, final=ch.finish_reason is not None)
            return []
        fl = part.flight
        tr = fl.samples.get(ch.sample_index)
        if tr is None or tr.done or ch.sample_index not in part.indices:
            return []
        own, rframe = buffers, None
        if ch.routed_experts is not None:  # its frame is the very last (bus.frames.split_routes)
            own, rframe = split_routes(ch, buffers)
        npf = prompt_frame_count(ch)  # the final chunk's prompt logprobs frames come last
        head = own[: len(own) - npf]
        toks, lps = chunk_payload(head)
        if ch.restarts > tr.leg_restarts:
            restart_leg(tr, part.prefix, ch.restarts)
        if ch.restarts != tr.restarts:
            ch = msgspec.structs.replace(ch, restarts=tr.restarts)
            frames = None  # the engine's frames carry the leg's count, not the flight's
        record(tr, ch, head, toks, lps)
        if rframe is not None and ch.routed_experts is not None and not fl.msg.stream:
            record_routes(tr, ch.routed_experts, rframe)
        final = ch.finish_reason is not None
        out: list[Action] = []
        if fl.msg.stream:
            out.append(self._relay(fl, part, ch, buffers, frames, final))
        if not final:
            return out
        tr.done = True
        if not fl.msg.stream:
            out.append(SendToClient(fl.client, *aggregate(fl, tr, ch, own[len(own) - npf :] if npf else [])))
        part.open -= 1
        e = self.engines.get(engine_id)
        if e is not None:
            e.outstanding -= 1
        if part.open == 0:
            self.ledger.pop_part(part.rid)
        fl.open -= 1
        if fl.open == 0:
            self.ledger.drop_flight(fl)
        return out

    def _relay(
        self, fl: Flight, part: Part, ch: P.Chunk, buffers: list[Any], frames: list[Any] | None, final: bool
    ) -> Action:
        """A streamed chunk to its client: the engine's frames untouched when
        they say what the client must see, else re-addressed."""
        if frames is not None and part.rid == fl.msg.request_id and len(part.indices) == len(fl.samples):
            return RelayToClient(fl.client, frames, ch, buffers)
        out = ch if part.rid == fl.msg.request_id else msgspec.structs.replace(ch, request_id=fl.msg.request_id)
        if final and len(part.indices) != len(fl.samples):
            if out is ch:
                out = msgspec.structs.replace(ch)
            out.num_prompt_tokens = token_count(fl.prompt) - fl.msg.resume_len
        return SendToClient(fl.client, out, buffers)

    # ------------------------------------------------------------ failover and failure

    def evacuate(self, engine_id: str, reason: str, now: float) -> list[Action]:
        """Engine `engine_id` is gone or hung: re-submit its legs elsewhere, or
        end their flights with EngineDead when failover is off, exhausted or
        impossible."""
        out: list[Action] = []
        e = self.engines.get(engine_id)
        for part in [p for p in self.parts.values() if p.engine_id == engine_id]:
            if self.ledger.pop_part(part.rid) is None:
                continue  # its flight ended with an earlier leg (its cancel is sent)
            self.ledger.retire(part)  # a hung engine may wake up and answer it
            if e is not None:
                e.outstanding -= part.open
            out.append(SendToEngine(engine_id, P.Cancel(request_id=part.rid), nonblock=True))
            fl = part.flight
            if fl.key in self.flights:
                self._fail_over(fl, part, engine_id, reason, now, out)
        return out

    def _fail_over(self, fl: Flight, part: Part, engine_id: str, reason: str, now: float, out: list[Action]) -> None:
        if engine_id not in fl.deaths:
            fl.deaths.append(engine_id)
        if len(fl.deaths) >= self.cfg.max_engine_deaths:
            # Poison: whatever in this request kills or wedges engines, no
            # further engine receives it (at most max_engine_deaths go down).
            self.counters["poison_requests"] = self.counters.get("poison_requests", 0) + 1
            self.counters["engine_dead"] += 1
            log.warning("poison_request", request_id=fl.msg.request_id, engines=fl.deaths, reason=reason)
            out += self.fail(
                fl,
                ErrorCode.ENGINE_DEAD,
                f"request {fl.msg.request_id} was in flight on {len(fl.deaths)} engines that died or hung "
                f"({', '.join(fl.deaths)}; last: {reason}): not sent to another (the head's --max-engine-deaths)",
            )
            return
        left = [i for i in part.indices if not fl.samples[i].done]
        if self.cfg.failover and fl.failovers < self.cfg.max_failovers:
            try:
                target: EngineEntry | None = self.place(
                    fl.msg, exclude=engine_id, client=fl.client, prompt=fl.prompt, now=now
                )
            except RolloutBusError:
                target = None
            if target is not None:
                fl.failovers += 1
                self.counters["failovers"] += 1
                log.info(
                    "failover",
                    request_id=fl.msg.request_id,
                    engine_id=engine_id,
                    to=target.engine_id,
                    samples=len(left),
                )
                self.dispatch(fl, target, left, now, out)
                return
        self.counters["engine_dead"] += 1
        out += self.fail(fl, ErrorCode.ENGINE_DEAD, f"engine {engine_id} died with the request in flight: {reason}")

    def fail(self, fl: Flight, code: ErrorCode, message: str, field: str | None = None) -> list[Action]:
        """End `fl` with one Error (nothing when it already ended); its other
        legs are cancelled on engines that listen."""
        if not self.ledger.drop_flight(fl):
            return []
        out: list[Action] = []
        self._cancel_legs(fl, out, silent_too=False)
        out.append(FailRequest(fl.client, fl.msg.request_id, code, message, field))
        return out

    def _cancel_legs(self, fl: Flight, out: list[Action], *, silent_too: bool) -> None:
        for rid in list(fl.parts):
            part = self.ledger.pop_part(rid)
            if part is None:
                continue
            e = self.engines.get(part.engine_id)
            if e is None:
                continue
            e.outstanding -= part.open
            self.ledger.retire(part)  # a silent engine may come back and finish it
            if silent_too or e.state is not EngineState.SILENT:
                # Never block the loop on a hung engine's full queue.
                hung = e.state is not EngineState.HEALTHY
                out.append(SendToEngine(part.engine_id, P.Cancel(request_id=rid), nonblock=hung))
        fl.parts.clear()

    def fail_client(self, client: bytes, code: ErrorCode, message: str, field: str | None) -> list[Action]:
        """End every request of `client` with one Error each (its key was revoked)."""
        out: list[Action] = []
        for fl in [f for f in self.flights.values() if f.client == client]:
            out += self.fail(fl, code, message, field)
        return out

    def fail_all(self, code: ErrorCode, message: str) -> list[Action]:
        out: list[Action] = []
        for fl in list(self.flights.values()):
            out += self.fail(fl, code, message)
        return out

    def forget_engine(self, engine_id: str) -> None:
        """The engine left the registry: it owes the head nothing any more."""
        self.ledger.forget_engine(engine_id)
