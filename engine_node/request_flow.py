"""The per-request state machine of an engine node: admission, submission,
the backend's step outputs, park / re-submit, staleness restarts, deadlines and
exactly-one-final. No sockets, no threads, no clock reads.

Events in: generate / cancel / peer_gone / on_step / step_failed / admit /
set_time / fail_all / weights_changed. Actions out (engine_node/actions.py):
SendChunks (coalesced per peer per turn), SendError, SendAck — taken by the
shell with `take_actions()`, in order. The control ops that open and close the
submission gate (engine_node/gates.py) are engine_node/pausing.py and
engine_node/sleeping.py; engine_node/core.py puts them together.

Ownership: one thread (the node's loop) calls everything here. The backend port
is called only for the data path (add / abort / num_running / freeze / thaw)
and to *start* control ops, whose BackendOp the shell waits on; nothing here
waits.

Hazards this module owns:
- exactly one final chunk per sample, or one Error per request, never both:
  every sample state change goes through requests.transition(), DONE is terminal;
- a parked sample keeps every token it streamed; re-submission sends prompt +
  tokens so far with the remaining max_tokens, the SAME seed (fixed at its
  first submission: request seed + index, or one drawn from the node's seed
  stream, engine_node/seeding.py) and the backend's generator state at the
  park when the backend gives one (torch: exact continuation); bounded by
  _MAX_RESUBMITS;
- staleness bound (Generate.max_staleness = k): when the weights change, a
  sample whose oldest generated token is older than version - k is dropped
  (tokens, logprobs, generator state) and re-queued from its prompt; its next
  chunk carries restarts + 1 (streamed at once, empty, so a consumer discards
  what it had), and every later chunk carries the count;
- chunks produced before an Error or an ack go out before it (`_flush_chunks`);
  while `actions` is empty the outbox holds everything to do, so the shell may
  send the outbox itself (`outbox.flush`, the per-chunk turn) instead of take_actions;
- chunk timestamps and deadlines use the times given by the last clock event.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import msgspec

from bus import protocol as P
from bus.codec import Outbox
from bus.errors import BadRequest, ErrorCode, RolloutBusError
from bus.frames import note_version
from engine_node import routes
from engine_node.actions import Action, SendAck, SendChunks, SendError
from engine_node.backend import BackendError, BackendInfo, BackendOp, SeqRequest, StepOutput
from engine_node.chunks import base_prompt_logprobs, natural_finish, sample_chunk
from engine_node.detokenize import load_tokenizer, make_matcher
from engine_node.gates import Gate
from engine_node.requests import NodeRequest, Sample, SampleState, new_request, transition
from engine_node.seeding import SeedStream, request_seed

_CLIENT_FINISH = frozenset({"stop", "length"})  # "cancelled" comes from the node itself
_MAX_RESUBMITS = 64  # a sample the backend keeps aborting on its own ends in an Error

_RUNNING = SampleState.RUNNING
_FROZEN = SampleState.FROZEN
_PENDING = SampleState.PENDING
_DONE = SampleState.DONE

Entry = tuple[NodeRequest, Sample]


class Refused(RolloutBusError):
    """A Generate the core will not take (engine draining)."""

    def __init__(self, code: ErrorCode, message: str, rid: str) -> None:
        super().__init__(message, request_id=rid)
        self.code = code


class RequestFlow:
    def __init__(self, backend: Any, info: BackendInfo, engine_id: str, sample_seed: int = 0) -> None:
        self.backend = backend
        # Seeds of unseeded samples (derived from cluster seed, engine id and
        # incarnation by the shell: engine_node/seeding.py).
        self.seeds = SeedStream(sample_seed)
        # A backend may prefer unseeded sequences left unseeded (vLLM: its engine
        # generator, seeded per engine and incarnation, is the fast path).
        self.seed_unseeded = bool(getattr(backend, "seeds_unseeded", True))
        self.info = info
        self.engine_id = engine_id
        self.eos = frozenset(info.eos_token_ids)
        self.accepting = True  # the shell clears it when the node drains
        self.gate = Gate()
        # -- request state
        self.requests: dict[tuple[bytes, str], NodeRequest] = {}
        self.seqs: dict[str, Entry] = {}  # backend seq id -> sample
        self.pending: collections.deque[Entry] = collections.deque()
        self.admit_dirty = False
        self.weight_version = 0
        self.config_epoch = 0
        self.steps = 0
        self.tokens_out = 0
        self._seq_counter = 0
        # -- time (from the last clock event)
        self.now = 0.0
        self.wall = 0.0
        # -- actions out: chunks wait in the outbox (coalesced per peer) until
        # an Error or an ack, or the shell's take_actions, flushes them in order.
        self.outbox = Outbox()
        self.actions: list[Action] = []
        self.work_appeared: Callable[[], None] = lambda: None  # shell hook (stall visibility)
        # Stop strings: the engine model's tokenizer, loaded on the first request that sets `stop`.
        self.tokenizer_of: Callable[[], Any] = lambda: load_tokenizer(info.model)

    # ================================================================ events

    def set_time(self, now: float, wall: float) -> None:
        self.now = now
        self.wall = wall

    def generate(self, client: bytes, msg: P.Generate, prompt: list[int]) -> NodeRequest:
        """Admission checks that need engine state; raises a RolloutBusError the
        shell answers (the frame-level checks ran before)."""
        rid = msg.request_id
        if not self.accepting:
            raise Refused(ErrorCode.ENGINE_DEAD, f"engine {self.engine_id} is shutting down", rid)
        if (client, rid) in self.requests:
            raise BadRequest(f"request id {rid!r} is already in flight", request_id=rid, field="request_id")
        base_len = len(prompt) - msg.resume_len
        if base_len >= self.info.max_model_len:  # the prompt alone leaves no room: it is the field at fault
            raise BadRequest(
                f"prompt has {base_len} tokens, max_model_len={self.info.max_model_len} "
                "(the prompt must leave room for at least one new token)",
                request_id=rid,
                field="prompt_token_ids",
            )
        if base_len + msg.params.max_tokens > self.info.max_model_len:
            raise BadRequest(
                f"prompt ({base_len}) + max_tokens ({msg.params.max_tokens}) exceeds max_model_len={self.info.max_model_len}",
                request_id=rid,
                field="params.max_tokens",
            )
        routes.check(msg.params, self.info.routed_experts, self.engine_id, rid)
        if msg.lora is not None and msg.lora not in self.backend.loras():
            raise BadRequest(
                f"LoRA adapter {msg.lora!r} is not loaded on {self.engine_id}", request_id=rid, field="lora"
            )
        req = new_request(client, msg, prompt, self.now)
        for s in req.samples:
            routes.start(req, s)
        if msg.params.stop:
            # Detokenizer state from prompt + tokens so far (a failover resubmission
            # carries them); refused here, before the request exists, if no tokenizer.
            for s in req.samples:
                s.matcher = make_matcher(self.tokenizer_of, req.base_prompt, msg.params, s.tokens, rid)
        self.requests[req.key] = req
        self.pending.extend((req, s) for s in req.samples)
        self.admit_dirty = True
        return req

    def cancel(self, client: bytes, request_id: str) -> None:
        req = self.requests.get((client, request_id))
        if req is None:
            return  # already finished: the final chunk is on its way
        self._abort_samples(req, emit=True)
        for s in req.samples:
            if s.state is not _DONE:
                self._finish_sample(req, s, "cancelled")

    def peer_gone(self, peer: bytes) -> None:
        """The peer's socket is gone: drop what it had in flight, silently."""
        for req in [r for r in self.requests.values() if r.client == peer]:
            self._abort_samples(req, emit=False)
            self.requests.pop(req.key, None)
            for s in req.samples:
                if s.state is not _DONE:
                    transition(s, _DONE)
        self.outbox.by_peer.pop(peer, None)

    def on_step(self, outs: list[StepOutput], now: float | None = None, wall: float = 0.0) -> None:
        """One backend step's outputs (hot path: O(1) per output), at the
        clock `now` / `wall` when given (set_time folded in: one call less per
        chunk). Only a step that produced something counts: the head's stall
        detector reads this counter, and an empty step (a backend waiting for
        output, or for a control op that holds the model) is not progress."""
        if now is not None:
            self.now = now
            self.wall = wall
        if outs:
            self._emit(outs)
            self.steps += 1

    def step_failed(self, e: BaseException) -> None:
        """The backend's step raised: fail what runs, keep serving."""
        msg = f"backend step failed on {self.engine_id}: {type(e).__name__}: {e}"
        for req in {id(r): r for r, _ in self.seqs.values()}.values():
            self._fail(req, ErrorCode.INTERNAL, msg)

    def admit(self) -> None:
        """Move pending samples into the backend while there is room and the
        gate is open for them. Gated ones stay pending (held or parked)."""
        self.admit_dirty = False
        if not self.pending:
            return
        room = self.info.capacity - self.backend.num_running()
        if room <= 0:
            return
        keep: collections.deque[tuple[NodeRequest, Sample]] = collections.deque()
        pending = self.pending
        while pending:
            req, s = pending.popleft()
            if s.state is not _PENDING:
                continue
            if room <= 0 or self.gated(req.lora):
                keep.append((req, s))
                continue
            if self._submit(req, s):
                room -= 1
        self.pending = keep

    def fail_all(self, code: ErrorCode, message: str) -> None:
        for req in list(self.requests.values()):
            self._fail(req, code, message)

    # ================================================================ actions out

    def take_actions(self) -> list[Action]:
        """Everything to do this turn, in order; chunks coalesced per peer."""
        self._flush_chunks()
        out, self.actions = self.actions, []
        return out

    def ack(self, a: SendAck) -> None:
        """A late control ack (pause(wait)): behind every chunk produced before it."""
        self._flush_chunks()
        self.actions.append(a)

    def _flush_chunks(self) -> None:
        if self.outbox.by_peer:
            self.actions += [SendChunks(peer, msg, bufs) for peer, msg, bufs in self.outbox.messages()]

    def counters(self) -> dict[str, Any]:
        """Heartbeat fields (called every ~50 ms, not per step)."""
        held = parked = waiting = 0
        for req, s in self.pending:
            if s.state is not _PENDING:
                continue
            if self.gated(req.lora):
                if s.submissions:
                    parked += 1
                else:
                    held += 1
            else:
                waiting += 1
        running = sum(1 for _, s in self.seqs.values() if s.state is _RUNNING)
        return {
            "running": running,
            "waiting": waiting,
            "held": held,
            "parked": parked,
            "weight_version": self.weight_version,
            "paused": sorted(self.gate.pauses),
            "steps": self.steps,
            "sleeping": self.gate.sleep_level,
            "asleep": sorted(self.gate.asleep),
            "tokens_out": self.tokens_out,
            "config_epoch": self.config_epoch,
        }

    # ================================================================ the gate

    def gated(self, lora: str | None) -> bool:
        return self.gate.gated(lora)

    def scoped(self, scope: str | None) -> list[Entry]:
        """In-backend samples a pause of `scope` (None: all) applies to."""
        return [(r, s) for r, s in self.seqs.values() if scope is None or r.lora == scope]

    def release(self) -> tuple[BackendOp | None, int]:
        """After the gate opened for some scopes: thaw frozen samples and let
        held / parked ones be admitted. Returns the thaw op and how many go on."""
        thaw = [s for r, s in self.seqs.values() if s.state is _FROZEN and not self.gated(r.lora)]
        op = None
        if thaw:
            for s in thaw:
                transition(s, _RUNNING)
            op = self.backend.thaw([s.seq_id for s in thaw])
            self.work_appeared()
        waiting = sum(1 for r, s in self.pending if s.state is _PENDING and not self.gated(r.lora))
        self.admit_dirty = True
        return op, len(thaw) + waiting

    # ================================================================ internals

    def _submit(self, req: NodeRequest, s: Sample) -> bool:
        self._seq_counter += 1
        seq_id = str(self._seq_counter)
        p = req.msg.params
        if s.seed is None and (p.seed is not None or self.seed_unseeded):
            # fixed once: a parked / restarted sample keeps its seed
            s.seed = self.seeds.next() if p.seed is None else request_seed(p.seed, s.index)
        done = len(s.tokens)
        if p.min_tokens and done:
            # min_tokens counts the whole output: a re-submission needs only the rest.
            p = msgspec.structs.replace(p, min_tokens=max(0, p.min_tokens - done))
        seq = SeqRequest(
            seq_id=seq_id,
            prompt=req.base_prompt + s.tokens.tolist(),
            params=p,
            max_new_tokens=p.max_tokens - done,
            seed=s.seed,
            lora=req.lora,
            output_prefix=done,
            prompt_logprobs=p.prompt_logprobs if s.prompt_logprobs is None else None,
            rng_state=s.rng_state,
            routes_from=s.routes_pos if s.routes_pos >= 0 else None,
        )
        try:
            self.backend.add(seq)
        except BackendError as e:  # refused (backend_refused), or its deadline passed
            self._fail(req, e.code, e.message, field=e.field)
            return False
        s.seq_id = seq_id
        transition(s, _RUNNING)
        s.submissions += 1
        self.seqs[seq_id] = (req, s)
        self.work_appeared()
        return True

    def _emit(self, outs: list[StepOutput]) -> None:
        seqs = self.seqs
        version = self.weight_version
        for out in outs:
            entry = seqs.get(out.seq_id)
            if entry is None:
                continue  # aborted meanwhile
            req, s = entry
            toks = out.token_ids
            finish = out.finish_reason
            if out.prompt_logprobs is not None and s.prompt_logprobs is None:
                s.prompt_logprobs = base_prompt_logprobs(out.prompt_logprobs, len(req.base_prompt))
            if toks:
                room = req.msg.params.max_tokens - len(s.tokens)
                if len(toks) >= room:
                    # max_tokens is the node's promise: a backend that hands over
                    # more (or reaches it without finishing) is cut off here.
                    toks = toks[:room]
                    if finish is None:
                        self.backend.abort([out.seq_id])
                        finish = "abort"  # -> _backend_ended: natural finish
                if s.matcher is not None:
                    for i, t in enumerate(toks):
                        hit = s.matcher.feed(t)
                        if hit is not None:
                            # The token that completed the stop string is the last one.
                            toks = toks[: i + 1]
                            if finish is None:
                                self.backend.abort([out.seq_id])
                            s.stop_reason = hit
                            finish = "stop"
                            break
                if not req.msg.stream:
                    note_version(s.version_marks, len(s.tokens) - s.sent, version)
                if s.first_version is None:
                    s.first_version = version
                s.tokens.extend(toks)
                if out.logprobs is not None:
                    s.logprobs.extend(out.logprobs[: len(toks)])
                if out.top_ids is not None and out.top_logprobs is not None:
                    k = len(out.top_ids) // max(1, len(out.token_ids))
                    s.top_ids.extend(out.top_ids[: k * len(toks)])
                    s.top_logprobs.extend(out.top_logprobs[: k * len(toks)])
                self.tokens_out += len(toks)
            if out.routed_experts is not None:
                bad = routes.take(req, s, out.routed_experts, out.routes_start, self.info.routed_experts)
                if bad is not None:
                    self._fail(req, ErrorCode.INTERNAL, f"backend on {self.engine_id}: {bad}", field=routes.FIELD)
                    continue
            if finish is None:
                # Frozen: a backend whose freeze is not instant may still hand
                # over tokens; they wait in s.tokens until the thaw.
                if req.msg.stream and len(s.tokens) > s.sent and s.state is _RUNNING:
                    # _send_chunk inlined: the hot path, once per streamed chunk
                    chunk, buffers = sample_chunk(req, s, None, version, self.wall, self.engine_id, self.eos)
                    if s.routes_rows:
                        self._attach_routes(s, chunk, buffers)
                    self.outbox.add(req.client, chunk, buffers)
            elif finish in _CLIENT_FINISH:
                del seqs[out.seq_id]
                s.seq_id = None
                self._finish_sample(req, s, finish)
                self.admit_dirty = True
            else:
                self._backend_ended(req, s, out.seq_id, finish)

    def _backend_ended(self, req: NodeRequest, s: Sample, seq_id: str, reason: str) -> None:
        """The backend ended a sequence on its own with a reason no client
        should see ("abort": e.g. preempted; "error"). Abort: re-submit prompt
        + tokens so far (bounded); anything else: one Error for the request."""
        del self.seqs[seq_id]
        s.seq_id = None
        transition(s, _PENDING)
        natural = self._natural_finish(req, s)
        if natural is not None:
            self._finish_sample(req, s, natural)
        elif reason == "abort" and s.submissions < _MAX_RESUBMITS:
            self.pending.append((req, s))
            self.admit_dirty = True
        else:
            self._fail(req, ErrorCode.INTERNAL, f"backend on {self.engine_id} ended sample {s.index} with {reason!r}")

    def _natural_finish(self, req: NodeRequest, s: Sample) -> str | None:
        return natural_finish(req, s, self.eos)

    def _send_chunk(self, req: NodeRequest, s: Sample, finish: str | None) -> None:
        chunk, buffers = sample_chunk(req, s, finish, self.weight_version, self.wall, self.engine_id, self.eos)
        if s.routes_rows:
            self._attach_routes(s, chunk, buffers)
        self.outbox.add(req.client, chunk, buffers)

    def _attach_routes(self, s: Sample, chunk: P.Chunk, buffers: list[Any]) -> None:
        """The sample's waiting routed-expert rows ride as the chunk's last frame."""
        assert self.info.routed_experts is not None  # rows are only taken with a shape
        got = routes.frame(s, self.info.routed_experts)
        if got is not None:
            chunk.routed_experts, frame = got
            buffers.append(frame)

    def _finish_sample(self, req: NodeRequest, s: Sample, reason: str) -> None:
        if s.seq_id is not None:
            self.seqs.pop(s.seq_id, None)
            s.seq_id = None
        transition(s, _DONE)
        self._send_chunk(req, s, reason)
        req.open_samples -= 1
        if req.open_samples == 0:
            self.requests.pop(req.key, None)

    def _fail(self, req: NodeRequest, code: ErrorCode, message: str, field: str | None = None) -> None:
        """End a request with one Error (after aborting what runs of it)."""
        if self.requests.get(req.key) is not req:
            return  # already ended: never a second final
        self._abort_samples(req, emit=False)
        for s in req.samples:
            if s.state is not _DONE:
                transition(s, _DONE)
        req.open_samples = 0
        self.requests.pop(req.key, None)
        self.send_error(req.client, req.msg.request_id, code.value, message, field)

    def send_error(self, client: bytes, rid: str, code: str, message: str, field: str | None) -> None:
        # Chunks produced before the error go out before it.
        self._flush_chunks()
        self.actions.append(SendError(client, P.Error(request_id=rid, code=code, message=message, field=field)))

    def _abort_samples(self, req: NodeRequest, *, emit: bool) -> None:
        live = [s for s in req.samples if s.state is _RUNNING or s.state is _FROZEN]
        if not live:
            return
        outs = self.backend.abort([s.seq_id for s in live if s.seq_id])
        if emit and outs:
            self._emit([o for o in outs if o.finish_reason is None])
        for s in live:
            if s.seq_id is not None:
                self.seqs.pop(s.seq_id, None)
                s.seq_id = None
            if s.state is not _DONE:
                transition(s, _PENDING)
        self.admit_dirty = True

    def park(self, entries: list[Entry]) -> int:
        """Abort in the backend, keep tokens so far, queue for re-submission."""
        if not entries:
            return 0
        outs = self.backend.abort([s.seq_id for _, s in entries if s.seq_id])
        if outs:
            for o in outs:  # the generator state to continue from on re-submission
                if o.rng_state is not None and o.seq_id in self.seqs:
                    self.seqs[o.seq_id][1].rng_state = o.rng_state
            # Leftovers were produced before the pause: stream them, so nothing is lost.
            self._emit([o for o in outs if o.finish_reason is None])
        parked = 0
        for req, s in entries:
            if s.state is _DONE:
                continue
            if s.seq_id is not None:
                self.seqs.pop(s.seq_id, None)
                s.seq_id = None
            transition(s, _PENDING)
            reason = self._natural_finish(req, s)
            if reason is not None:  # it had in fact just finished
                self._finish_sample(req, s, reason)
                continue
            self.pending.append((req, s))
            parked += 1
        return parked

    def _check_deadlines(self, now: float) -> None:
        late = [r for r in self.requests.values() if r.deadline is not None and now > r.deadline]
        for req in late:
            where = "held by a pause" if self.gated(req.lora) else "running"
            self._fail(
                req,
                ErrorCode.TIMEOUT,
                f"request exceeded its timeout_s={req.msg.timeout_s} ({where} on {self.engine_id})",
                field="timeout_s",
            )

    # ================================================================ weights and staleness

    def weights_changed(self, version: int | None = None) -> int:
        """A model weight update committed: tokens from now on carry the new
        version — `version` when the update named one (the cluster's: a stale
        engine jumps to it), else the current one + 1. Returns how many samples
        the staleness bound restarted."""
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self.config_epoch += 1
        self.gate.weights_discarded = False  # what a level-2 sleep dropped is written now
        return self.enforce_staleness()

    def enforce_staleness(self) -> int:
        """Restart every live sample whose request bounds staleness and whose
        oldest generated token is now more than max_staleness versions old."""
        v = self.weight_version
        victims = [
            (req, s)
            for req in self.requests.values()
            if req.msg.max_staleness is not None
            for s in req.samples
            if s.state is not _DONE and s.first_version is not None and s.first_version < v - req.msg.max_staleness
        ]
        for req, s in victims:
            self._restart(req, s)
        return len(victims)

    def _restart(self, req: NodeRequest, s: Sample) -> None:
        """Drop what the sample generated here and queue it again from its
        prompt (+ the request's own resume prefix); same seed, fresh generator."""
        if s.seq_id is not None:
            self.backend.abort([s.seq_id])  # leftovers come from the old weights: dropped
            self.seqs.pop(s.seq_id, None)
            s.seq_id = None
        if s.state is not _PENDING:
            transition(s, _PENDING)
            self.pending.append((req, s))
        # else: parked or queued, already in self.pending
        keep = req.msg.resume_len
        if s.tokens and s.top_ids:
            k = len(s.top_ids) // len(s.tokens)
            del s.top_ids[keep * k :]
            del s.top_logprobs[keep * k :]
        del s.tokens[keep:]
        del s.logprobs[keep:]
        s.sent = min(s.sent, keep)
        s.version_marks.clear()
        s.first_version = None
        s.rng_state = None
        s.stop_reason = None
        s.prompt_logprobs = None  # recomputed on the new weights with the new attempt
        routes.restart(s)
        if s.matcher is not None:  # the detokenizer restarts from prompt + what is kept
            s.matcher = make_matcher(self.tokenizer_of, req.base_prompt, req.msg.params, s.tokens, req.msg.request_id)
        s.restarts += 1
        self.admit_dirty = True
        if req.msg.stream:
            self._send_chunk(req, s, None)  # empty: "discard this sample's tokens so far"

    def config_changed(self) -> None:
        """LoRA set changed."""
        self.config_epoch += 1

    def config_result(self) -> P.LoraResult:
        return P.LoraResult(weight_version=self.weight_version, loras=self.backend.loras(), epoch=self.config_epoch)
