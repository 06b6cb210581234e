"""The data path of the `vllm` backend: sequences in, StepOutputs out.

add() builds an EngineCoreRequest (vllm/requests) and sends it, or holds it
back for the resume ramp; step() sweeps control continuations, releases the
ramp and drains what vLLM's output thread queued, never waiting; abort() drops
ids and hands back their partial output.

The resume ramp (off at 0). A resume after pause(abort) re-submits every parked
stream at once (prompt + tokens so far: tens of thousands of tokens for 64
streams); vLLM's scheduler packs a full max_num_batched_tokens prefill into its
first step, and no stream sees a token before that whole step ends. What a first
step costs is set by CUDA graphs, not by its size: a step of at most the largest
capture size (512 tokens for LLM's defaults) replays a graph, 9-15 ms for a 0.5B
model on an H200; one token over it runs the compiled model piece by piece from
Python, 25-50 ms of CPU for ~4 ms of GPU work, about the same for 1,000 tokens
as for 7,000 (bench/gpu/first_step.py, RESULTS run 30). With
resume_ramp_tokens=N (or "auto": that capture size), when sequences arrive at an
engine with none live, they are held until the node's next step(); then the
SHORTEST go to the core, up to N prompt tokens (at least one sequence), and the
rest only when the core's first output of those arrives (or after
resume_ramp_wait_s, a safety net: a 50 ms net fired before a 40 ms first step
was read and released the whole burst, RESULTS run 29). So the first streams
resume one graph step after the resume; the rest one step later than they would
have. Cold batches (a generate of many prompts to an idle engine) ramp the same
way.

The output trace (trace_outputs / take_output_trace) says where the wait for
the first token after a Resume went, in the core's own clock.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any

from engine_node.backend import BackendError, BackendOp, SeqRequest, StepOutput
from engine_node.backends.vllm.ops import VllmOps
from engine_node.backends.vllm.requests import build_request, prefix_salt, sampling_params


class VllmDataPath(VllmOps):
    def add(self, seq: SeqRequest) -> None:
        if seq.seq_id in self._rid_of:
            raise BackendError(f"sequence {seq.seq_id!r} is already running", field="seq_id")
        sp = sampling_params(
            self._api, seq, max_model_len=self._max_model_len, generation_config=self._gen_cfg, eos_token_id=self._eos
        )
        lr = self._lora_request(seq.lora)
        self._n += 1
        rid = f"{seq.seq_id}#{self._n}"
        salt = prefix_salt(self._weights_epoch, seq.params.cache_salt)
        req = build_request(self._api, rid, seq, sp, lr, salt)
        if self.resume_ramp_tokens > 0 and not self._rid_of and self._ramp_state is None:
            self._ramp_state = "collect"  # the engine was empty: a burst may follow; step() picks
            self._ramp_deadline = time.monotonic() + self.resume_ramp_wait_s
        if self._ramp_state is not None:
            self._deferred[rid] = req  # sent by _ramp_pick or _ramp_flush
        else:
            self._send(req)
        self._out.expect(rid, seq)
        self._seq_of[rid] = seq.seq_id
        self._rid_of[seq.seq_id] = rid

    def _send(self, req: Any) -> None:
        self._link.add(req)
        if self._trace is not None and "built" not in self._trace:
            self._trace["sent"] += 1
            self._trace["sent_tokens"] += len(req.prompt_token_ids or ())

    def _ramp_pick(self) -> None:
        """The burst is complete (this turn's adds are in): send its shortest
        sequences, up to resume_ramp_tokens prompt tokens and at least one; hold
        the rest until their first output (_collect) or the safety net."""
        if self._ramp_state != "collect":
            return
        self._ramp_state = "hold"
        budget, sent = self.resume_ramp_tokens, 0
        for rid, req in sorted(self._deferred.items(), key=lambda kv: len(kv[1].prompt_token_ids or ())):
            n = len(req.prompt_token_ids or ())
            if sent and sent + n > budget:
                break  # ascending: no later one fits either
            del self._deferred[rid]
            self._send(req)
            sent += n

    def _ramp_flush(self, force: bool = False) -> None:
        """End the ramp: send what it held back (loop thread)."""
        if self._ramp_state is None:
            return
        if not force and self._ramp_state == "hold" and self._deferred and time.monotonic() < self._ramp_deadline:
            return
        self._ramp_state = None
        held, self._deferred = self._deferred, {}
        for req in held.values():
            self._send(req)
        if held and self._trace is not None and "built" not in self._trace:
            self._trace.setdefault("ramp_released", time.monotonic())

    def _ramp_output(self, batches: list[Any]) -> bool:
        """A batch carries output of a request the ramp sent. Hazard: right
        after a pause(abort) the core still drains outputs of the aborted
        requests (and stats-only batches); releasing the held ones on those
        would send the whole burst into the first step, the full-budget
        re-prefill the ramp exists to avoid."""
        live = self._seq_of
        return any(
            o.request_id in live and o.request_id not in self._deferred for b in batches for o in b.outputs or ()
        )

    def trace_outputs(self) -> None:
        """Arm the output trace (the node does at a Resume; see take_output_trace)."""
        self._trace = {"armed": time.monotonic(), "batches_before": 0, "sent": 0, "sent_tokens": 0}

    def take_output_trace(self) -> dict[str, Any] | None:
        """Where the first live output after the arming came from, in ms after it
        (time.monotonic: one clock for every process on the host). built_ms: the core
        built the batch; drained_ms: this thread took it; queued_ms / scheduled_ms:
        the core queued / first scheduled that output's request (only with
        log_stats=True: vLLM records request events then); batches_before: batches
        with no live output that came first (late output of aborted requests);
        sent / sent_tokens: requests and prompt tokens sent to the core by then (the
        resume ramp holds the rest back); live: live outputs in that batch."""
        tr, self._trace = self._trace, None
        if tr is None or "built" not in tr:
            return None
        t0 = tr.pop("armed")
        out = {k: v for k, v in tr.items() if not isinstance(v, float)}
        out.update({f"{k}_ms": round((v - t0) * 1e3, 2) for k, v in tr.items() if isinstance(v, float)})
        return out

    def _trace_batches(self, batches: list[Any]) -> None:
        tr = self._trace
        assert tr is not None
        live = self._seq_of
        for b in batches:
            outs = [o for o in (b.outputs or ()) if o.request_id in live]
            if not outs:
                tr["batches_before"] += 1
                continue
            tr.update(built=float(b.timestamp), drained=time.monotonic(), live=len(outs))
            for ev in getattr(outs[0], "events", None) or ():
                name = getattr(ev.type, "name", str(ev.type)).lower()
                tr.setdefault(name, float(ev.timestamp))  # queued, scheduled (first only)
            return

    def _collect(self, wait_s: float) -> None:
        batches = self._link.drain(wait_s)
        if batches and self._trace is not None and "built" not in self._trace:
            self._trace_batches(batches)
        if batches and self._ramp_state == "hold" and self._ramp_output(batches):
            self._ramp_flush(force=True)  # the first step's output is here: the rest may go
        for batch in batches:
            for rid in self._out.add_batch(batch, self._seq_of):
                sid = self._seq_of.pop(rid)
                self._rid_of.pop(sid, None)
                self._frozen.discard(sid)

    def step(self) -> list[StepOutput]:
        self._sweep()
        self._ramp_pick()
        self._ramp_flush()
        if self._link.dead:
            self._link.check_alive()
            raise BackendError("the vLLM engine core died; the engine node must restart")
        # Never blocks: the node waits for output in its poll (wake fd next to
        # the sockets, up to step_wait_s) when output_ready() says none is queued.
        self._collect(0.0)
        return self._out.take()

    def output_ready(self) -> bool:
        """Output (or a continuation, or a ramp to release) is waiting: the
        node must not block in poll before the next step()."""
        return bool(self._out.items) or self._link.has_output() or bool(self._later) or self._ramp_state == "collect"

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        # A dead core raises here: abort still drops the ids; step() reports the death.
        with contextlib.suppress(BackendError):
            self._collect(0.0)  # what is queued now belongs to the caller, not to a later step()
        left: list[StepOutput] = []
        rids: list[str] = []
        for sid in seq_ids:
            rid = self._rid_of.pop(sid, None)
            self._frozen.discard(sid)
            if rid is None:
                continue
            self._seq_of.pop(rid, None)  # late outputs of rid are dropped from now on
            self._out.forget(rid)
            if self._deferred.pop(rid, None) is not None:
                continue  # held back by the ramp: the core never saw it
            rids.append(rid)
            so = self._out.pop(rid)
            if so is not None and so.token_ids:
                so.finish_reason = None
                left.append(so)
        self._aborted += len(rids)
        self._link.abort(rids)
        return left

    def has_work(self) -> bool:
        self._sweep()
        return (
            bool(self._out.items) or self._link.has_output() or len(self._rid_of) > len(self._frozen) or self._link.dead
        )

    def num_running(self) -> int:
        return len(self._rid_of)

    def stats(self) -> dict[str, Any]:
        self._sweep()
        return {
            "kv_usage": 0.0,
            **self._out.kv_stats,
            **self._out.counters,
            "cpu_placement": self.cpu_placement,
            "sleep_level": self._sleep_level,
            "sleeping": sorted(self._sleeping),
            "weights_stale": self._weights_stale,
            # requests added to / aborted in vLLM: a keep-mode pause changes neither
            # (a parked sequence is aborted and added again, i.e. re-prefilled)
            "requests_added": self._n,
            "requests_aborted": self._aborted,
            "frozen": self._paused,
            "engine_dead": self._link.dead,
            "pending_ops": len(self._ops),
        }

    def wake_fd(self) -> int | None:
        return self._link.fileno()

    def _lora_request(self, name: str | None) -> Any:
        if name is None:
            return None
        a = self._loras.adapters.get(name)
        if a is None:
            raise BackendError(f"LoRA adapter {name!r} is not loaded (loaded: {self._loras.names()})", field="lora")
        return self._api.LoRARequest(lora_name=name, lora_int_id=a.lora_id, lora_path=a.path)

    def freeze(self, seq_ids: Iterable[str]) -> BackendOp:
        self._ramp_flush(force=True)  # a pause(keep) keeps them in the core
        ids = {s for s in seq_ids if s in self._rid_of}
        self._frozen |= ids
        if self._paused:
            return BackendOp.done("freeze", {"already_paused": True})
        self._paused = True
        # keep: stop scheduling, keep requests and KV; resolves once the core's
        # output queue is empty (every token produced so far is on its way to us).
        return self._op("pause_scheduler(keep)", "rpc_timeout_s", [("pause_scheduler", ("keep", False))])

    def thaw(self, seq_ids: Iterable[str]) -> BackendOp:
        self._frozen -= set(seq_ids)
        self._frozen &= set(self._rid_of)
        if self._frozen or not self._paused:
            return BackendOp.done("thaw", {"still_frozen": len(self._frozen)})
        self._paused = False
        if self._sleep_level:
            return BackendOp.done("thaw", {"asleep": True})  # wake_up resumes the scheduler
        return self._op("resume_scheduler", "rpc_timeout_s", [("resume_scheduler", ())])
