"""Property tests of the request core (engine_node/core.py and the modules it
puts together: request_flow, pausing, sleeping, chunks) with a scripted
backend: thousands of random interleavings of generate / cancel / pause
(abort | keep | wait, LoRA or all) / resume / weight update / sleep / wake /
backend-side abort and error finishes / abort leftovers / clock advances past
deadlines. No sockets, no threads, no clocks.

Invariants:
- every accepted request ends with exactly one final chunk per sample or
  exactly one Error, nothing after either (one nuance, kept from the node as
  it was: a multi-sample request failing after some samples finished gets its
  Error after those samples' finals — never after the last one);
- no token lost, duplicated or reordered across park and re-submit (every
  token is a known function of (request, sample, position): see
  tests/scripted_backend.py);
- max_tokens is never exceeded;
- no step emits tokens for a sample whose scope is paused in keep/abort mode
  (or while any sleep tag is asleep: wakes split by tags, in any order, end
  sleep only once every tag is awake);
- a weight update while the weights tag sleeps is refused before anything
  changes (old weights and version kept); once the weights woke it commits,
  also while the KV cache still sleeps;
- weight versions on a sample's chunks never go backwards;
- staleness bound (max_staleness = k): after every weight update, no live
  sample of such a request holds a token (core state, and what a stream
  consumer kept after discarding at each `restarts` increase) older than
  version - k; a restarted sample regenerates the same tokens (same seed)
  and its final chunk reports the restart count; a sample's seed never changes;
- the core's output is typed actions (engine_node/actions.py), executed in
  order: SendChunks / SendError / SendAck only; a SendAck answers only a
  command its handler DEFERRED (pause(wait)), exactly once, with a result or a
  typed failure (timeout naming `timeout_s`), never both; and the chunks a
  drained scope produced come before its pause(wait)'s ack — no token of that
  scope is stepped out after it until a resume.

Cost: the "ci" profile (default) is derandomized and bounded (~20 s). For a
long hunt: ROLLOUT_BUS_HYPOTHESIS_PROFILE=long (or set
ROLLOUT_BUS_HYPOTHESIS_EXAMPLES).
"""

from __future__ import annotations

import os
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import protocol as P
from bus.codec import split_chunks
from bus.errors import BadRequest
from engine_node.actions import DEFERRED, Pending, SendAck, SendChunks, SendError
from engine_node.core import RequestCore
from engine_node.gates import ALL, SLEEP_SCOPE
from engine_node.request_flow import Refused
from engine_node.weight_update import WeightUpdates
from tests.scripted_backend import EOS, ScriptedBackend, expected_token

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("ROLLOUT_BUS_HYPOTHESIS_EXAMPLES", "1500")),
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("ROLLOUT_BUS_HYPOTHESIS_EXAMPLES", "20000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
PROFILE = os.environ.get("ROLLOUT_BUS_HYPOTHESIS_PROFILE", "ci")

CLIENTS = (b"router", b"direct")
LORAS = (None, "a", "b")


class Harness:
    """Drives a RequestCore the way engine_node/node.py does, and checks every
    message it sends."""

    def __init__(self, granularity: str, capacity: int) -> None:
        self.backend = ScriptedBackend(granularity=granularity, capacity=capacity)
        self.core = RequestCore(self.backend, self.backend.info(), "e0")
        self.updates = WeightUpdates(self.backend, self.core, "e0", "inproc://w")
        self.now = 0.0
        self.core.set_time(self.now, self.now)
        self.seq = 0
        self.next_rid = 0
        # (client, rid) -> record
        self.reqs: dict[tuple[bytes, str], dict[str, Any]] = {}
        self.pauses: dict[str, str] = {}  # what the test believes is paused (scope -> mode)
        self.sleeping = False  # any tag asleep
        self.asleep: set[str] = set()
        self.acks: dict[int, tuple] = {}
        self.updates_seqs: set[int] = set()  # seq numbers spent on update ids, not commands
        self.deferred: dict[int, P.Pause] = {}  # seq -> the pause(wait) the core acks later
        self.drained: set[str] = set()  # scopes whose pause(wait) was acked drained, until a resume
        self.execute = {SendChunks: self.on_chunks, SendError: self.on_error_action, SendAck: self.on_ack}

    # ------------------------------------------------------------ plumbing

    def control(self, handler: Any, op: Any) -> Any:
        self.seq += 1
        seq = self.seq
        try:
            res = handler(op, seq)
        except Exception as e:  # refused: the shell acks an error
            self.acks[seq] = (False, str(e))
            return None
        if isinstance(res, Pending):
            assert res.op.future.done(), "scripted ops finish at once"
            try:
                res = res.then(res.op.future.result())
            except Exception as e:
                if res.on_error:
                    res.on_error(e)
                self.acks[seq] = (False, str(e))
                return None
        if res is DEFERRED:
            assert isinstance(op, P.Pause) and op.mode == "wait", f"only pause(wait) defers, not {op}"
            self.deferred[seq] = op
        else:
            self.acks[seq] = (True, res)
        self.collect(during_step=False)
        return res

    def collect(self, *, during_step: bool) -> None:
        """Execute the core's actions in order, as the node's table does."""
        self.during_step = during_step
        for a in self.core.take_actions():
            handler = self.execute.get(type(a))
            assert handler is not None, f"untyped action {a!r}"
            handler(a)

    def on_chunks(self, a: SendChunks) -> None:
        for ch, bufs in split_chunks(a.msg, a.buffers):
            self.on_chunk(a.peer, ch, bufs, self.during_step)

    def on_error_action(self, a: SendError) -> None:
        self.on_error(a.peer, a.error)

    def on_ack(self, a: SendAck) -> None:
        op = self.deferred.pop(a.seq, None)
        assert op is not None, f"SendAck for command {a.seq}, which no handler deferred (or acked twice)"
        assert a.seq not in self.acks, f"command {a.seq} acked twice"
        assert (a.result is None) != (a.failure is None), "an ack has a result or a failure, never both"
        if a.failure is not None:
            assert a.failure.code == "timeout" and f"timeout_s={op.timeout_s}" in a.failure.message, a.failure
            self.acks[a.seq] = (False, a.failure.message)
            return
        assert isinstance(a.result, P.PauseResult) and a.result.mode == "wait"
        if not a.result.resumed_before_drained:
            self.drained.add(a.result.scope)
        self.acks[a.seq] = (True, a.result)

    def on_error(self, peer: bytes, err: P.Error) -> None:
        r = self.reqs.get((peer, err.request_id))
        assert r is not None, f"Error for unknown request {err.request_id}"
        assert r["accepted"], "Error for a refused request"
        assert not r["errors"], f"second Error for {err.request_id}"
        # A multi-sample request that fails (deadline, backend error) after some
        # of its samples finished gets its Error after those finals (as the
        # node always did): never after the last final, never a final after it.
        assert len(r["finals"]) < r["msg"].num_samples, f"Error after every final of {err.request_id}"
        r["errors"].append(err)

    def on_chunk(self, peer: bytes, ch: P.Chunk, bufs: list[Any], during_step: bool) -> None:
        r = self.reqs.get((peer, ch.request_id))
        assert r is not None, f"chunk for unknown request {ch.request_id}"
        assert not r["errors"], f"chunk after the Error of {ch.request_id}"
        idx = ch.sample_index
        assert idx in r["tokens"], f"chunk for unknown sample {idx}"
        assert idx not in r["finals"], f"chunk after the final of sample {idx} of {ch.request_id}"
        toks = list(array("i", bytes(bufs[0]))) if bufs else []
        msg: P.Generate = r["msg"]
        assert ch.restarts >= r["restarts"][idx], "restart count went backwards"
        if ch.restarts > r["restarts"][idx]:
            assert msg.max_staleness is not None, "a restart without max_staleness"
            r["restarts"][idx] = ch.restarts
            r["tokens"][idx].clear()  # what a consumer does: discard the earlier attempt
            r["versions"][idx].clear()
        if toks and during_step:
            assert not self.sleeping, "tokens emitted while sleeping"
            for scope in (ALL, msg.lora):
                if scope is not None and self.pauses.get(scope) in ("keep", "abort"):
                    raise AssertionError(
                        f"tokens emitted for {ch.request_id} while {scope!r} is paused ({self.pauses[scope]})"
                    )
                assert scope not in self.drained, f"tokens for {ch.request_id} after {scope!r} was acked drained"
        if msg.stream:
            assert not ch.version_changes
            if toks:
                assert ch.weight_version >= r["version"][idx], "weight version went backwards"
                r["version"][idx] = ch.weight_version
                r["versions"][idx].extend([ch.weight_version] * len(toks))
        r["tokens"][idx].extend(toks)
        got = r["tokens"][idx]
        exp = r["expected"][idx]
        assert got == exp[: len(got)], f"{ch.request_id}/{idx}: got {got}, expected a prefix of {exp}"
        assert len(got) + msg.resume_len <= msg.params.max_tokens, "max_tokens exceeded"
        if ch.finish_reason is not None:
            r["finals"][idx] = ch.finish_reason
            assert ch.engine_id == "e0" and ch.num_prompt_tokens == r["base_len"]
            if ch.finish_reason in ("stop", "length"):
                assert got == exp, f"{ch.request_id}/{idx} finished {ch.finish_reason} with {got}, expected {exp}"
                assert ch.finish_reason == r["reason"][idx]
        else:
            assert ch.engine_id == "" and ch.num_prompt_tokens == 0

    # ------------------------------------------------------------ events

    def generate(
        self,
        n: int,
        stream: bool,
        lora_i: int,
        resume: int,
        max_tokens: int,
        timeout: int,
        client_i: int,
        max_staleness: int | None = None,
    ) -> None:
        self.next_rid += 1
        rid = f"r{self.next_rid}"
        rseed = 10_000 * self.next_rid
        lora = LORAS[lora_i % len(LORAS)]
        client = CLIENTS[client_i % len(CLIENTS)]
        if n > 1:
            resume = 0
        offset = 3 if resume else 0
        base = [5 + self.next_rid % 50, 7, 9][: 1 + self.next_rid % 3]
        max_tokens = max(max_tokens, resume + 1)
        prefix = [expected_token(rseed, offset, i) for i in range(resume)]
        msg = P.Generate(
            request_id=rid,
            params=P.SamplingParams(max_tokens=max_tokens, seed=rseed, temperature=1.0),
            num_samples=n,
            lora=lora,
            stream=stream,
            timeout_s=float(timeout) if timeout else None,
            resume_len=resume,
            sample_offset=offset,
            max_staleness=max_staleness,
        )
        self.backend.base_len[rseed] = len(base)
        expected, reason = {}, {}
        for k in range(n):
            idx = offset + k
            seq, why = [], "length"
            for i in range(resume, max_tokens):
                t = expected_token(rseed, idx, i)
                seq.append(t)
                if t == EOS:
                    why = "stop"
                    break
            expected[idx], reason[idx] = seq, why
        rec = {
            "msg": msg,
            "base_len": len(base),
            "expected": expected,
            "reason": reason,
            "tokens": {i: [] for i in expected},
            "versions": {i: [] for i in expected},  # per kept token (streams)
            "restarts": {i: 0 for i in expected},
            "version": {i: 0 for i in expected},
            "finals": {},
            "errors": [],
            "accepted": False,
            "cancelled": False,
        }
        self.reqs[(client, rid)] = rec
        # The one refusal this harness can provoke: a LoRA that is not loaded
        # (ids are unique, prompts and max_tokens fit max_model_len, the core
        # accepts until shut down). Only the core's typed admission error for
        # it counts as a refusal; any other exception, or a refusal of
        # anything else, is a crash the property must report.
        refusal = "lora" if lora is not None and lora not in self.backend.loras() else None
        try:
            self.core.generate(client, msg, base + prefix)
        except (BadRequest, Refused) as e:
            assert refusal is not None and e.field == refusal, f"admission refused {rid} unexpectedly: {e!r}"
            assert e.request_id == rid, e
            assert not any(k[1] == rid for k in self.core.requests), "a refused request left state behind"
            return
        assert refusal is None, f"{rid} admitted naming LoRA {lora!r}, which is not loaded"
        rec["accepted"] = True

    def cancel(self, pick: int) -> None:
        live = [
            k
            for k, r in self.reqs.items()
            if r["accepted"] and not r["errors"] and len(r["finals"]) < r["msg"].num_samples
        ]
        if live:
            k = live[pick % len(live)]
            self.reqs[k]["cancelled"] = True
            self.core.cancel(*k)
            self.collect(during_step=False)

    def pause(self, mode: str, lora_i: int) -> None:
        lora = LORAS[lora_i % len(LORAS)]
        res = self.control(self.core.pause, P.Pause(mode=mode, lora=lora, timeout_s=5.0))
        self.pauses[lora or ALL] = mode
        del res

    def resume(self, lora_i: int) -> None:
        lora = LORAS[lora_i % len(LORAS)]
        self.control(self.core.resume, P.Resume(lora=lora))
        if lora is None:
            self.pauses.clear()
            self.drained.clear()
        else:
            self.pauses.pop(lora, None)
            self.drained.discard(lora)

    def sleep(self, level: int) -> None:
        self.control(self.core.sleep, P.Sleep(level=level))
        self.sleeping = True
        self.asleep = {"weights", "kv_cache"}

    def wake(self, tags: list[str] | None = None) -> None:
        before = self.core.weight_version
        restarts_before = self._core_restarts()
        res = self.control(self.core.wake_up, P.WakeUp(tags=tags))
        assert isinstance(res, P.WakeUpResult), res
        self.asleep -= {"weights", "kv_cache"} if tags is None else set(tags)
        self.sleeping = bool(self.asleep)
        assert self.core.gate.asleep == self.asleep, (self.core.gate.asleep, self.asleep)
        assert (SLEEP_SCOPE in self.core.gate.pauses) == self.sleeping, "the sleep gate follows the tags"
        assert (self.core.gate.sleep_level > 0) == self.sleeping
        assert self.core.weight_version >= before
        self._after_weights_changed(restarts_before)

    def update(self, jump: int | None = None) -> None:
        """A weight update; `jump`: the finish names version + jump (a stale
        engine catching up), else the engine increments."""
        self.seq += 1
        uid = f"u{self.seq}"
        self.updates_seqs.add(self.seq)
        before = self.core.weight_version
        restarts_before = self._core_restarts()
        meta = P.TensorMeta("w", "float32", [1], 0, 0, 4)
        if "weights" in self.asleep:
            n = len(self.acks)
            assert self.control(self.updates.begin, P.BeginWeightUpdate(uid, "zmq", [meta], [4])) is None
            assert len(self.acks) == n + 1 and "asleep" in self.acks[self.seq][1], "refused, naming why"
            assert self.core.weight_version == before and self.updates.current is None
            return
        self.control(self.updates.begin, P.BeginWeightUpdate(uid, "zmq", [meta], [4]))
        self.updates.on_bucket(uid, 0, memoryview(b"\0\0\0\0"))
        self.control(self.updates.prepare, P.PrepareWeights(uid))
        version = None if jump is None else before + jump
        self.control(self.updates.commit, P.FinishWeightUpdate(uid, version=version))
        assert self.core.weight_version == before + (jump or 1)
        assert self.updates.current is None
        self._after_weights_changed(restarts_before)

    def _core_restarts(self) -> dict[int, int]:
        return {id(s): s.restarts for req in self.core.requests.values() for s in req.samples}

    def _after_weights_changed(self, restarts_before: dict[int, int]) -> None:
        """The staleness bound held, and the scripted backend is told which
        samples come back from their prompt."""
        v = self.core.weight_version
        for (peer, rid), req in self.core.requests.items():
            k = req.msg.max_staleness
            for s in req.samples:
                if s.restarts != restarts_before.get(id(s), s.restarts):
                    assert k is not None
                    self.backend.restarted(req.msg.params.seed, s.index, req.msg.resume_len)
                if k is None or s.state.value == "done":
                    continue
                if s.first_version is not None:
                    assert s.first_version >= v - k, f"{rid}/{s.index}: token of version {s.first_version} kept at {v}"
                if len(s.tokens) > req.msg.resume_len:
                    assert s.first_version is not None
                rec = self.reqs[(peer, rid)]
                if req.msg.stream and rec["versions"][s.index]:
                    assert min(rec["versions"][s.index]) >= v - k, f"{rid}/{s.index}: consumer kept a stale token"

    def step(self, per_seq: int) -> None:
        if self.core.admit_dirty:
            self.core.admit()
        self.backend.produce(per_seq)
        self.core.on_step(self.backend.step())
        self.collect(during_step=True)

    def turn(self, per_seq: int, dt: int) -> None:
        """One loop turn of the node: step, then the clock tick, then one flush
        of everything both produced (so a pause(wait) drained by this step is
        acked in the same action list as the step's chunks)."""
        if self.core.admit_dirty:
            self.core.admit()
        self.backend.produce(per_seq)
        self.core.on_step(self.backend.step())
        self.now += dt
        self.core.tick(self.now, self.now)
        self.collect(during_step=True)

    def produce(self, per_seq: int) -> None:
        """The engine ran but nothing was handed over yet: an abort now has leftovers."""
        self.backend.produce(per_seq)

    def fault(self, kind: str, pick: int) -> None:
        ids = list(self.backend.seqs)
        if ids:
            self.backend.inject(ids[pick % len(ids)], kind)

    def advance(self, dt: int) -> None:
        self.now += dt
        self.core.tick(self.now, self.now)
        self.collect(during_step=False)

    # ------------------------------------------------------------ the end

    def quiesce(self) -> None:
        """Open every gate and run until nothing is left."""
        if self.sleeping:
            self.wake()
        self.resume(0)
        for _ in range(2000):
            if not self.core.requests:
                break
            self.step(3)
        assert not self.core.requests, f"requests never finished: {list(self.core.requests)}"
        assert not self.core.seqs and not self.backend.seqs
        self.advance(0)
        for key, r in self.reqs.items():
            if not r["accepted"]:
                assert not r["finals"] and not r["errors"]
                continue
            n = r["msg"].num_samples
            if r["errors"]:
                assert len(r["errors"]) == 1 and len(r["finals"]) < n, key
            else:
                assert set(r["finals"]) == set(r["expected"]), f"{key}: finals {r['finals']} for {n} samples"
            for idx, why in r["finals"].items():
                if why == "cancelled":
                    assert r["cancelled"], f"{key}/{idx} cancelled without a cancel"
        # every control command got exactly one ack: the deferred ones too, once
        # the gate opened (quiesce resumed every scope: moot waits are answered)
        assert not self.deferred, f"deferred commands never acked: {sorted(self.deferred)}"
        assert set(self.acks) == set(range(1, self.seq + 1)) - self.updates_seqs, "a command without an ack"


EVENTS = st.one_of(
    st.tuples(
        st.just("generate"),
        st.integers(1, 3),
        st.booleans(),
        st.integers(0, 2),
        st.sampled_from([0, 0, 2]),
        st.integers(1, 12),
        st.sampled_from([0, 0, 0, 3, 8]),
        st.integers(0, 1),
        st.sampled_from([None, None, 0, 1]),
    ),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("turn"), st.integers(1, 3), st.sampled_from([0, 0, 1])),
    st.tuples(st.just("produce"), st.integers(1, 3)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("pause"), st.sampled_from(["abort", "keep", "wait"]), st.integers(0, 2)),
    st.tuples(st.just("resume"), st.integers(0, 2)),
    st.tuples(st.just("update"), st.sampled_from([None, None, 2])),
    st.tuples(st.just("sleep"), st.integers(1, 2)),
    st.tuples(st.just("wake")),
    st.tuples(
        st.just("wake"),
        st.sampled_from([["weights"], ["kv_cache"], ["weights", "kv_cache"], ["kv_cache", "weights"], []]),
    ),
    st.tuples(st.just("fault"), st.sampled_from(["abort", "abort", "error"]), st.integers(0, 50)),
    st.tuples(st.just("advance"), st.sampled_from([1, 2, 5])),
)


@settings(settings.get_profile(PROFILE))
@given(
    granularity=st.sampled_from(["seq", "all"]),
    capacity=st.sampled_from([2, 8]),
    events=st.lists(EVENTS, min_size=20, max_size=80),
)
def test_core_lifecycle_invariants(granularity: str, capacity: int, events: list[tuple]) -> None:
    h = Harness(granularity, capacity)
    for ev in events:
        kind, *args = ev
        getattr(h, kind)(*args)
    h.quiesce()


def test_refused_lora_and_duplicate_ids_leave_no_state() -> None:
    h = Harness("seq", 4)
    h.backend.loras_loaded.discard("b")
    h.generate(1, True, 2, 0, 4, 0, 0)  # lora "b" not loaded: refused
    assert not h.core.requests
    h.generate(2, False, 0, 0, 5, 0, 0)
    h.quiesce()


def test_a_crash_at_admission_fails_the_harness_not_counted_as_a_refusal() -> None:
    """The harness above only counts the core's typed admission errors as
    refusals: an admission that crashes (here injected into the core) fails
    the property instead of passing as "not accepted"."""
    h = Harness("seq", 4)

    def crash(*a: Any) -> None:
        raise RuntimeError("injected crash in admission")

    h.core.generate = crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected crash"):
        h.generate(1, True, 0, 0, 4, 0, 0)
    # ...and a typed refusal where none is possible (the LoRA is loaded) fails too.
    h = Harness("seq", 4)

    def refuse(client: bytes, msg: P.Generate, prompt: list[int]) -> None:
        raise BadRequest("refused for no reason", request_id=msg.request_id, field="lora")

    h.core.generate = refuse  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="refused r1 unexpectedly"):
        h.generate(1, True, 1, 0, 4, 0, 0)
