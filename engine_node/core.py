"""The request core of an engine node: the request lifecycle without I/O.

No sockets, no threads, no clock reads. The shell (engine_node/node.py) feeds
it events and carries out what it produces:

events in                                   actions out
  generate(client, msg, prompt)               sends: (peer, Chunk|ChunkBatch|Error, buffers)
  cancel(client, request_id)                    — chunks coalesced per peer per turn
  on_step(outputs) / step_failed(exc)           — an Error flushes that turn's chunks first
  peer_gone(peer)                             acks: deferred control acks (pause wait)
  set_time(now, wall) / tick(now, wall)       control results: P.*Result | Pending(BackendOp, then)
  control ops: pause / resume / is_paused /   backend data-path calls (add, abort, num_running)
    sleep / wake_up / reset_prefix_cache        are made on the injected backend port, which
  weights_changed() / config_changed()          is synchronous and short by protocol

Ownership: one thread (the node's loop) calls everything here. The backend port
is called only for the data path (add/abort/num_running) and to *start* control
ops, whose BackendOp the shell waits on; the core never waits.

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
- keep-mode pause on a backend that can only freeze everything ("all") parks
  the LoRA subset instead;
- chunk timestamps and deadlines use the times given by the last clock event;
- sleep by tags (SLEEP_TAGS): sleep() closes the SLEEP_SCOPE gate and puts every
  tag to sleep; wake_up(tags) wakes some, in any order and split, and the gate
  opens only once none sleeps (any wake_up opens a gate a failed sleep left
  closed). weight_update.py refuses model updates while "weights" sleeps.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from bus import frames as F
from bus import protocol as P
from bus.codec import Outbox
from bus.errors import BadRequest, ErrorCode, RolloutBusError
from bus.frames import chunk_versions, note_version, pack_logprobs, pack_tokens
from engine_node.backend import BackendError, BackendInfo, BackendOp, SeqRequest, StepOutput
from engine_node.detokenize import load_tokenizer, make_matcher
from engine_node.requests import NodeRequest, Sample, SampleState, new_request, transition
from engine_node.seeding import SeedStream, request_seed

ALL = "*"
SLEEP_SCOPE = "__sleep__"  # the gate scope sleep() closes
# What sleep() puts to sleep and wake_up(tags) wakes, one by one (vLLM's tags).
SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache")


def wake_tags(tags: list[str] | None) -> frozenset[str]:
    """The tags a wake_up names (None: all); unknown ones are a BadRequest
    naming `tags` (the head runs the same check: router_node/intended_state.py)."""
    if tags is None:
        return frozenset(SLEEP_TAGS)
    unknown = sorted(set(tags) - set(SLEEP_TAGS))
    if unknown:
        raise BadRequest(f"unknown wake_up tags {unknown}; choose from {list(SLEEP_TAGS)}", field="tags")
    return frozenset(tags)


_CLIENT_FINISH = frozenset({"stop", "length"})  # "cancelled" comes from the node itself
_MAX_RESUBMITS = 64  # a sample the backend keeps aborting on its own ends in an Error
DEFERRED = object()  # a control result: "the core acks it later" (pause(wait))

_RUNNING = SampleState.RUNNING
_FROZEN = SampleState.FROZEN
_PENDING = SampleState.PENDING
_DONE = SampleState.DONE


class Refused(RolloutBusError):
    """A Generate the core will not take (engine draining)."""

    def __init__(self, code: ErrorCode, message: str, rid: str) -> None:
        super().__init__(message, request_id=rid)
        self.code = code


@dataclasses.dataclass(eq=False)
class Pending:
    """A control op in progress: the shell acks with `then(op result)` when the
    op's future completes, or reports the error (calling `on_error` first, so the
    owner can roll its state back)."""

    op: BackendOp
    then: Callable[[dict[str, Any]], Any]  # the backend's dict -> the op's P.*Result
    on_error: Callable[[BaseException], object] | None = None


class RequestCore:
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
        # -- request state
        self.requests: dict[tuple[bytes, str], NodeRequest] = {}
        self.seqs: dict[str, tuple[NodeRequest, Sample]] = {}  # backend seq id -> sample
        self.pending: collections.deque[tuple[NodeRequest, Sample]] = collections.deque()
        self.admit_dirty = False
        self.pauses: dict[str, str] = {}  # scope ("*", LoRA name, SLEEP_SCOPE) -> mode
        self.weight_version = 0
        self.config_epoch = 0
        self.sleep_level = 0  # the level of the last sleep while any tag is asleep, else 0
        # Tags asleep (SLEEP_TAGS); the SLEEP_SCOPE gate stays closed until none is.
        self.asleep: set[str] = set()
        self.steps = 0
        self.tokens_out = 0
        self._weights_discarded = False
        self._seq_counter = 0
        # -- time (from the last clock event)
        self.now = 0.0
        self.wall = 0.0
        # -- actions out
        self.outbox = Outbox()
        self.sends: list[tuple[bytes, Any, list[Any]]] = []
        self.acks: list[tuple[int, bool, Any, str | None, str | None]] = []  # seq, ok, P.*Result, error, code
        self._waits: list[tuple[int, str, float, float, P.PauseResult]] = []  # seq, scope, deadline, timeout_s, result
        self.work_appeared: Callable[[], None] = lambda: None  # shell hook (stall visibility)
        # Stop strings: the engine model's tokenizer, loaded on the first request that sets `stop`.
        self.tokenizer_of: Callable[[], Any] = lambda: load_tokenizer(info.model)

    # ================================================================ events

    def set_time(self, now: float, wall: float) -> None:
        self.now = now
        self.wall = wall

    def tick(self, now: float, wall: float) -> None:
        """Clock event: request deadlines and wait-mode pause deadlines."""
        self.set_time(now, wall)
        self._check_deadlines(now)
        self._check_waits(now)

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
        if msg.lora is not None and msg.lora not in self.backend.loras():
            raise BadRequest(
                f"LoRA adapter {msg.lora!r} is not loaded on {self.engine_id}", request_id=rid, field="lora"
            )
        req = new_request(client, msg, prompt, self.now)
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

    def on_step(self, outs: list[StepOutput]) -> None:
        """One backend step's outputs (hot path: O(1) per output). Only a step
        that produced something counts: the head's stall detector reads this
        counter, and an empty step (a backend waiting for output, or for a
        control op that holds the model) is not progress."""
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

    def take_sends(self) -> list[tuple[bytes, Any, list[Any]]]:
        """Everything to send this turn, in order; chunks coalesced per peer."""
        if self.outbox.by_peer:
            self.sends.extend(self.outbox.messages())
        out, self.sends = self.sends, []
        return out

    def take_acks(self) -> list[tuple[int, bool, Any, str | None, str | None]]:
        out, self.acks = self.acks, []
        return out

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
            "paused": sorted(self.pauses),
            "steps": self.steps,
            "sleeping": self.sleep_level,
            "asleep": sorted(self.asleep),
            "tokens_out": self.tokens_out,
            "config_epoch": self.config_epoch,
        }

    # ================================================================ the gate

    def gated(self, lora: str | None) -> bool:
        p = self.pauses
        return bool(p) and (ALL in p or SLEEP_SCOPE in p or (lora is not None and lora in p))

    def _scoped(self, scope: str | None) -> list[tuple[NodeRequest, Sample]]:
        """In-backend samples a pause of `scope` (None: all) applies to."""
        return [(r, s) for r, s in self.seqs.values() if scope is None or r.lora == scope]

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
            prompt=req.base_prompt + s.tokens,
            params=p,
            max_new_tokens=p.max_tokens - done,
            seed=s.seed,
            lora=req.lora,
            output_prefix=done,
            prompt_logprobs=p.prompt_logprobs if s.prompt_logprobs is None else None,
            rng_state=s.rng_state,
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
                s.prompt_logprobs = _base_prompt_logprobs(out.prompt_logprobs, len(req.base_prompt))
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
            if finish is None:
                # Frozen: a backend whose freeze is not instant may still hand
                # over tokens; they wait in s.tokens until the thaw.
                if req.msg.stream and len(s.tokens) > s.sent and s.state is _RUNNING:
                    self._send_chunk(req, s, None)
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
        # Stop before length, as the backends decide it: a last token that is
        # both the max_tokens-th and a stop token finished with "stop".
        p = req.msg.params
        if s.tokens and len(s.tokens) > req.msg.resume_len:
            last = s.tokens[-1]
            if last in p.stop_token_ids or (not p.ignore_eos and last in self.eos):
                return "stop"
        if len(s.tokens) >= p.max_tokens:
            return "length"
        return None

    def _send_chunk(self, req: NodeRequest, s: Sample, finish: str | None) -> None:
        sent = s.sent
        p = req.msg.params
        buffers = [pack_tokens(s.tokens[sent:])]
        top_k = prompt_k = -1
        if F.logprobs_wanted(p.logprobs):
            buffers.append(pack_logprobs(s.logprobs[sent:]))
            top_k = F.top_k_of(p.logprobs)
            if top_k > 0:
                buffers.append(pack_tokens(s.top_ids[sent * top_k : len(s.tokens) * top_k]))
                buffers.append(pack_logprobs(s.top_logprobs[sent * top_k : len(s.tokens) * top_k]))
        text = None
        if finish is not None:
            pl = s.prompt_logprobs
            if p.prompt_logprobs is not None and pl is not None:
                prompt_k = pl.k
                buffers += F.encode_prompt(pl.k, pl.logprobs, pl.top_ids, pl.top_logprobs)
            if s.matcher is not None:
                last = s.tokens[-1] if len(s.tokens) > req.msg.resume_len else None
                stop_id = last is not None and (last in p.stop_token_ids or (not p.ignore_eos and last in self.eos))
                text = s.matcher.final_text(finish == "stop" and stop_id)
        changes: list[list[int]]
        if req.msg.stream:
            version, changes = self.weight_version, []
        else:
            version, changes = chunk_versions(s.version_marks, self.weight_version)
        chunk = P.Chunk(
            request_id=req.msg.request_id,
            sample_index=s.index,
            weight_version=version,
            finish_reason=finish,
            version_changes=changes,
            emitted_at=self.wall,
            num_prompt_tokens=len(req.base_prompt) if finish else 0,
            engine_id=self.engine_id if finish else "",
            top_logprobs=max(0, top_k),
            prompt_logprobs=prompt_k,
            stop_reason=s.stop_reason if finish else None,
            text=text,
            restarts=s.restarts,
        )
        s.sent = len(s.tokens)
        self.outbox.add(req.client, chunk, buffers)

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
        if self.outbox.by_peer:
            self.sends.extend(self.outbox.messages())
        self.sends.append((client, P.Error(request_id=rid, code=code, message=message, field=field), []))

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

    def _park(self, entries: list[tuple[NodeRequest, Sample]]) -> int:
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

    # ================================================================ control

    def pause(self, op: P.Pause, seq: int) -> Any:
        if op.mode not in _PAUSE_MODES:
            raise BadRequest(f"unknown pause mode {op.mode!r} (abort, keep, wait)", field="mode")
        scope = op.lora or ALL
        self.pauses[scope] = op.mode  # the gate closes at once
        entries = self._scoped(op.lora)
        held = sum(1 for r, s in self.pending if s.state is _PENDING and (op.lora is None or r.lora == op.lora))
        result = P.PauseResult(mode=op.mode, scope=scope, held=held)
        return _PAUSE_MODES[op.mode](self, op, seq, entries, result)

    def _pause_abort(self, op: P.Pause, seq: int, entries: list, result: P.PauseResult) -> Any:
        result.parked = self._park(entries)
        return result

    def _pause_keep(self, op: P.Pause, seq: int, entries: list, result: P.PauseResult) -> Any:
        live = [(r, s) for r, s in entries if s.state is _RUNNING]
        if op.lora is not None and self.backend.freeze_granularity != "seq":
            # The backend can only freeze everything: park this adapter's samples.
            result.parked = self._park(live)
            return result
        for _, s in live:
            transition(s, _FROZEN)
        result.frozen = len(live)
        return Pending(self.backend.freeze([s.seq_id for _, s in live]), lambda _r: result)

    def _pause_wait(self, op: P.Pause, seq: int, entries: list, result: P.PauseResult) -> Any:
        result.draining = len(entries)
        self._waits.append((seq, op.lora or ALL, self.now + op.timeout_s, op.timeout_s, result))
        self._check_waits(self.now)
        return DEFERRED

    def _check_waits(self, now: float) -> None:
        if not self._waits:
            return
        left = []
        for w in self._waits:
            seq, scope, deadline, timeout_s, result = w
            busy = self._scoped(None if scope == ALL else scope)
            if not busy:
                self.acks.append((seq, True, result, None, None))
            elif now > deadline:
                self.acks.append(
                    (
                        seq,
                        False,
                        None,
                        f"pause(mode='wait') still had {len(busy)} running sequence(s) after timeout_s={timeout_s}; the gate stays closed",
                        ErrorCode.TIMEOUT.value,
                    )
                )
            else:
                left.append(w)
        self._waits = left

    def resume(self, op: P.Resume, seq: int) -> Any:
        if op.lora is None:
            scopes = [k for k in self.pauses if k != SLEEP_SCOPE]
        else:
            scopes = [op.lora] if op.lora in self.pauses else []
        for k in scopes:
            del self.pauses[k]
        thaw_op, n = self._release()
        result = P.ResumeResult(resumed=n, scopes=scopes, still_paused=sorted(self.pauses))
        if thaw_op is None:
            return result
        return Pending(thaw_op, lambda _r: result)

    def _release(self) -> tuple[BackendOp | None, int]:
        """After the gate opened for some scopes: thaw frozen samples and let
        held/parked ones be admitted."""
        thaw = [s for r, s in self.seqs.values() if s.state is _FROZEN and not self.gated(r.lora)]
        op = None
        if thaw:
            for s in thaw:
                transition(s, _RUNNING)
            op = self.backend.thaw([s.seq_id for s in thaw])
            self.work_appeared()
        waiting = sum(1 for r, s in self.pending if s.state is _PENDING and not self.gated(r.lora))
        self.admit_dirty = True
        # Wait-mode pauses whose scope was resumed are moot: answer them now.
        moot = [w for w in self._waits if w[1] not in self.pauses]
        if moot:
            self._waits = [w for w in self._waits if w[1] in self.pauses]
            for seq, _scope, _d, _t, result in moot:
                self.acks.append((seq, True, msgspec.structs.replace(result, resumed_before_drained=True), None, None))
        return op, len(thaw) + waiting

    def is_paused(self, op: P.IsPaused, seq: int = 0) -> P.IsPausedResult:
        paused = self.gated(op.lora) if op.lora else bool(self.pauses)
        return P.IsPausedResult(paused=paused, scopes=sorted(self.pauses))

    def sleep(self, op: P.Sleep, seq: int) -> Any:
        """Every tag goes to sleep (a sleep of a half-awake engine too): the gate
        closes at once and stays closed until wake_up(s) woke every tag."""
        if op.level not in (1, 2):
            raise BadRequest(f"sleep level must be 1 or 2, got {op.level}", field="level")
        self.pauses[SLEEP_SCOPE] = "abort"
        parked = self._park(self._scoped(None))
        t0 = self.now

        def then(res: dict[str, Any]) -> P.SleepResult:
            self.sleep_level = op.level
            self.asleep = set(SLEEP_TAGS)
            self._weights_discarded = res.get("weights") == "discarded"
            return P.SleepResult(level=op.level, parked=parked, seconds=round(self.now - t0, 4), detail=dict(res))

        return Pending(self.backend.sleep(op.level), then)

    def wake_up(self, op: P.WakeUp, seq: int) -> Any:
        """Wake the named tags (None: all), in any order and split; a tag already
        awake is a no-op. The engine serves again once no tag is asleep."""
        wanted = wake_tags(op.tags)
        t0 = self.now

        def then(res: dict[str, Any]) -> P.WakeUpResult:
            reloaded = False
            self.asleep -= wanted
            if self._weights_discarded and not self.asleep:
                # Level 2 dropped the weights and no update wrote them before the
                # engine serves again: the checkpoint's are back, a weight state
                # different from any pushed version, so tokens from now on carry
                # a new version. Not at wake_up(['weights']) itself: SkyRL's
                # order pushes the new weights before waking the KV cache, and
                # that update's version is the one to serve (a bump here would
                # put the engine above a trainer that numbers its versions).
                self._weights_discarded = False
                self.weight_version += 1
                self.config_epoch += 1
                reloaded = True
                res = {**res, "restarted": self._enforce_staleness()}
            resumed = 0
            if not self.asleep:
                # Also after a failed sleep (gate closed, nothing asleep): any
                # wake_up opens the gate.
                self.sleep_level = 0
                self.pauses.pop(SLEEP_SCOPE, None)
                # thaw cannot be needed here: sleep parked everything
                _op, resumed = self._release()
            return P.WakeUpResult(
                weight_version=self.weight_version,
                loras=self.backend.loras(),
                epoch=self.config_epoch,
                resumed=resumed,
                seconds=round(self.now - t0, 4),
                weights_reloaded_from_checkpoint=reloaded,
                detail={**res, "woken": sorted(wanted), "asleep": sorted(self.asleep)},
            )

        return Pending(self.backend.wake_up(None if op.tags is None else sorted(wanted)), then)

    def weights_asleep(self) -> bool:
        """A weight update must not write into weights that sleep offloaded or
        discarded (vLLM unmaps that memory): wake_up(['weights']) first."""
        return "weights" in self.asleep

    def reset_prefix_cache(self, op: P.ResetPrefixCache, seq: int) -> Any:
        return Pending(self.backend.reset_prefix_cache(), lambda r: P.ResetPrefixCacheResult(detail=dict(r)))

    # -- weights / LoRA bookkeeping (the transactions live in weight_update.py)

    def weights_changed(self, version: int | None = None) -> int:
        """A model weight update committed: tokens from now on carry the new
        version — `version` when the update named one (the cluster's: a stale
        engine jumps to it), else the current one + 1. Returns how many samples
        the staleness bound restarted."""
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        self.config_epoch += 1
        self._weights_discarded = False  # what a level-2 sleep dropped is written now
        return self._enforce_staleness()

    def _enforce_staleness(self) -> int:
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


def _base_prompt_logprobs(pl: Any, base_len: int) -> Any:
    """A submission's prompt logprobs cut to the client's prompt (a re-submitted
    prompt ends with output tokens)."""
    k = pl.k
    return dataclasses.replace(
        pl,
        logprobs=list(pl.logprobs[:base_len]),
        top_ids=list(pl.top_ids[: base_len * k]),
        top_logprobs=list(pl.top_logprobs[: base_len * k]),
    )


_PAUSE_MODES: dict[str, Callable[..., Any]] = {
    "abort": RequestCore._pause_abort,
    "keep": RequestCore._pause_keep,
    "wait": RequestCore._pause_wait,
}
