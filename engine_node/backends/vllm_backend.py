"""The `vllm` backend: vLLM 0.24.0's engine core, batch in, batch out.

How it is put together (one concept per module):
- vllm_engine_core.CoreLink: vLLM's SyncMPClient (engine core in its own
  process) with a wake pipe on its output queue and utility calls that return
  futures instead of blocking.
- vllm_requests: SeqRequest -> EngineCoreRequest (InputProcessor's defaults,
  no tokenizer pass); EngineCoreOutputs -> StepOutputs (no detokenizer).
- vllm_weights: the weight-update record, validation, zmq shared-memory staging.
- vllm_lora: adapter ids and PEFT folders.
- vllm_worker_ext: what runs inside every worker (weights, parent death).

Threads: every method runs on the node's loop thread, and that thread alone
sends on the engine core's input socket. vLLM's output thread reads batches and
resolves utility futures; control ops complete on it (their done-callbacks only
set flags and settle futures). Outputs: the output thread queues a batch and
writes the wake pipe (wake_fd); step() drains what is queued and never waits:
the node blocks in its poll on the wake fd and its sockets (up to step_wait_s)
while output_ready() is False. No per-sequence task, queue or future.

Control calls send their utility message(s) at once and return a BackendOp
whose deadline names the option that sets it (rpc_timeout_s, weight_timeout_s,
lora_timeout_s, sleep_timeout_s). Several messages of one op are sent back to
back: the engine core runs them in order (e.g. load weights, then reset the
prefix cache), so no op waits on another to send its next step. Hazard: that
order holds only for utilities that finish synchronously in the core; `sleep`
and `pause_scheduler` may defer their answer until the core is idle, so what
must run after them is queued by their callback and sent by the loop thread
(`_later`, run from step/has_work/stats; the wake fd fires to get there).

Request ids: seq_id + "#" + a counter, so a re-submitted seq id never receives
late output of its aborted predecessor.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from engine_node.backend import BackendError, BackendInfo, BackendOp, BackendTimeout, SeqRequest, StepOutput
from engine_node.backends import vllm_weights as W
from engine_node.backends.vllm_engine_core import CoreLink, _settle, load_vllm_api
from engine_node.backends.vllm_lora import LoraTable, write_peft
from engine_node.backends.vllm_requests import OutputBuffer, build_request, prefix_salt, sampling_params
from engine_node.child_watch import export_node_pid

log = structlog.get_logger("rollout_bus.vllm_backend")

WORKER_EXT = "engine_node.backends.vllm_worker_ext.RolloutBusWorkerExtension"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prepare_env() -> None:
    """Environment vLLM's child processes need (set before they are spawned)."""
    pp = os.environ.get("PYTHONPATH", "")
    if _REPO_ROOT not in pp.split(os.pathsep):  # the workers import our extension
        os.environ["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + pp if pp else "")
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    # The node process has zmq threads of its own: never fork it.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # NVLink multicast off (it can take a shared host's GPUs down).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    # The engine's processes die with this one: vllm_worker_ext arms the watch
    # in every worker (engine_node/child_watch.py). Call on the spawning thread.
    export_node_pid()


class VllmBackend:
    freeze_granularity = "all"
    # Unseeded sequences stay unseeded (seed=None): vLLM samples them from the
    # worker's global generator, which `seed` (derived per engine and incarnation
    # by the node) seeds — different on every engine and every restart. A
    # per-request seed would put every request on vLLM's per-request generator
    # path (one exponential_ per seeded request per step). seed_every_request=True
    # opts in (then unseeded samples, too, keep one seed across a park).
    seeds_unseeded = False

    def __init__(
        self,
        model: str,
        *,
        tp: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int = 4096,
        enforce_eager: bool = False,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        max_loras: int = 4,
        enable_sleep_mode: bool = True,
        dtype: str = "auto",
        seed: int = 0,
        attention_backend: str | None = None,
        log_stats: bool = False,
        rpc_timeout_s: float = 120.0,
        weight_timeout_s: float = 600.0,
        lora_timeout_s: float = 120.0,
        sleep_timeout_s: float = 300.0,
        start_timeout_s: float = 900.0,
        shutdown_timeout_s: float = 30.0,
        step_wait_s: float = 0.005,
        seed_every_request: bool = False,
        cpu_affinity: str = "off",
        weight_plan: bool = True,
        resume_ramp_tokens: int | str = 0,
        resume_ramp_wait_s: float = 0.2,
        extra_graph_tokens: int = 0,
        _api: Any = None,  # vLLM's classes (tests pass a fake)
        **passthrough: Any,  # any other EngineArgs field: max_num_seqs, max_num_batched_tokens, …
    ) -> None:
        _prepare_env()
        # vLLM's own wait for its engine core to come up (read when vLLM's
        # core_client is first imported, so set before load_vllm_api).
        os.environ.setdefault("VLLM_ENGINE_READY_TIMEOUT_S", str(int(start_timeout_s)))
        self.model = model
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.weight_timeout_s = float(weight_timeout_s)
        self.lora_timeout_s = float(lora_timeout_s)
        self.sleep_timeout_s = float(sleep_timeout_s)
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self.step_wait_s = float(step_wait_s)
        self.enable_lora = bool(enable_lora)
        self.seeds_unseeded = bool(seed_every_request)
        # Workers write updates through a copy plan learned from load_weights
        # (vllm_worker_ext._rb_apply); False: load_weights every time.
        self.weight_plan = bool(weight_plan)
        # Resume ramp (off at 0). A resume after pause(abort) re-submits every
        # parked stream at once (prompt + tokens so far: tens of thousands of
        # tokens for 64 streams); vLLM's scheduler packs a full
        # max_num_batched_tokens prefill into its first step, and no stream sees
        # a token before that whole step ends. What a first step costs is set by
        # CUDA graphs, not by its size: a step of at most the largest capture size
        # (512 tokens for LLM's defaults) replays a graph, 9-15 ms for a 0.5B
        # model on an H200; one token over it runs the compiled model piece by
        # piece from Python, 25-50 ms of CPU for ~4 ms of GPU work, about the
        # same for 1,000 tokens as for 7,000 (bench/gpu/first_step.py, RESULTS
        # run 30). With resume_ramp_tokens=N (or "auto": that capture size),
        # when sequences arrive at an engine with none live, they are held until
        # the node's next step(); then the SHORTEST go to the core, up to N
        # prompt tokens (at least one sequence), and the rest only when the
        # core's first output of those arrives (or after resume_ramp_wait_s, a
        # safety net: a 50 ms net fired before a 40 ms first step was read and
        # released the whole burst, RESULTS run 29). So the first streams resume
        # one graph step after the resume; the rest one step later than they
        # would have. Cold batches (a generate of many prompts to an idle
        # engine) ramp the same way.
        self.resume_ramp_wait_s = float(resume_ramp_wait_s)
        self._ramp_state: str | None = None  # None | "collect" (until the next step) | "hold" (first sent)
        self._ramp_deadline = 0.0
        self._deferred: dict[str, Any] = {}  # request id -> EngineCoreRequest held back by the ramp
        # Output trace (armed by the node at a Resume, read at its first output):
        # where the wait for the first token goes, in the core's own clock.
        self._trace: dict[str, Any] | None = None
        if cpu_affinity not in ("off", "auto"):
            raise BackendError(f"cpu_affinity must be 'auto' or 'off', got {cpu_affinity!r}", field="cpu_affinity")
        self._api = _api if _api is not None else load_vllm_api()

        engine_kw: dict[str, Any] = dict(
            model=model,
            tensor_parallel_size=int(tp),
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            dtype=dtype,
            seed=seed,
            worker_extension_cls=WORKER_EXT,
        )
        if enable_lora:
            engine_kw.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras)
        if attention_backend:
            engine_kw["attention_backend"] = attention_backend
        engine_kw.update(passthrough)

        # Loop-thread state.
        self._seq_of: dict[str, str] = {}  # request id -> seq id (live in the engine)
        self._rid_of: dict[str, str] = {}  # seq id -> request id
        self._n = 0
        self._aborted = 0
        self._out = OutputBuffer()
        self._frozen: set[str] = set()
        self._paused = False  # the scheduler is paused (keep) by us
        self._sleep_level = 0  # the last sleep's level while any tag is asleep
        # Sleep tags asleep, as vLLM's executor counts them. Changed on the loop
        # thread when the op is sent (control ops run one at a time), rolled
        # back by the op's `after` when it fails.
        self._sleeping: set[str] = set()
        # After a level-2 sleep, woken weights are mapped memory with undefined
        # contents (vLLM does not reload them). They become defined by a weight
        # update that writes every checkpoint tensor, else by vLLM's
        # reload_weights, sent with the wake_up that ends sleep: lazily, so the
        # colocated order (wake weights -> full update -> wake KV) never pays a
        # checkpoint reload from disk.
        self._weights_stale = False
        self._buffers_held = False  # vllm_worker_ext holds level-2 buffers (see wake_up)
        self._ops: list[tuple[BackendOp, float]] = []  # pending ops and their timeouts
        # Continuations queued by op callbacks (vLLM's output thread) that must
        # send on the input socket: run by _sweep on the loop thread.
        self._later: collections.deque[Callable[[], None]] = collections.deque()
        self._update: W.WeightUpdate | None = None
        self._loras = LoraTable()
        # Prefix-cache salt, bumped whenever the weights change (commit, wake
        # from a level-2 sleep). vLLM hashes the salt into a request's first
        # block, so blocks cached under older weights can never be hit again:
        # no reset_prefix_cache walk over every KV block (tens of ms on a big
        # cache) on the update's critical path. Bumped when the change is SENT:
        # the core runs inputs in order, so every request added after it runs
        # on the new weights and must not share blocks cached before it.
        self._weights_epoch = 0
        self._ckpt_shapes: dict[str, list[int]] | None = None
        self._closed = False

        t0 = time.perf_counter()
        cfg = self._api.build_config(engine_kw)
        if extra_graph_tokens:
            # Piecewise CUDA graphs for mixed steps above LLM's largest size
            # (512 by default). A step with no graph runs the compiled model
            # piece by piece from Python: on an H200 host a resume's first step
            # of 862 tokens took 13 ms median (up to 40) without one, 7.6 with
            # one; a cold 4-request batch (1,100 tokens) 21 vs 7 ms (RESULTS
            # run 32). Costs start-up time and graph memory, so it is opt-in:
            # the defaults stay LLM's.
            engine_kw = with_graph_sizes(engine_kw, cfg, extra_graph_tokens)
            cfg = self._api.build_config(engine_kw)
        self.vllm_config = cfg
        self.resume_ramp_tokens = _ramp_budget(resume_ramp_tokens, cfg)  # before the engine starts
        mc = cfg.model_config
        self._max_model_len = int(mc.max_model_len)
        self._gen_cfg = dict(mc.try_get_generation_config() or {})
        self._eos = self._api.tokenizer_eos(cfg) if not getattr(mc, "skip_tokenizer_init", False) else None
        try:
            client = self._api.make_client(cfg, bool(log_stats))
        except TimeoutError:
            raise BackendTimeout(
                "vLLM engine start", float(os.environ["VLLM_ENGINE_READY_TIMEOUT_S"]), "start_timeout_s"
            ) from None
        except Exception as e:
            raise BackendError(f"the vLLM engine failed to start: {type(e).__name__}: {e}") from e
        self._link = CoreLink(client, self._api.UTILITY)
        # "auto": the engine core (and TP workers) get a physical core each,
        # this node stays off them (engine_node/cpu_placement.py says why).
        self.cpu_placement: dict[str, Any] = {"cpu_affinity": "off"}
        if cpu_affinity not in ("off", "", None):
            from engine_node import cpu_placement

            try:
                self.cpu_placement = cpu_placement.apply(str(cpu_affinity))
            except Exception as e:  # placement is an optimisation: never fatal
                log.warning("cpu_affinity_failed", error=repr(e))
                self.cpu_placement = {"cpu_affinity": "failed", "error": repr(e)[:200]}
        self._tmp = tempfile.mkdtemp(prefix="rollout_bus_vllm_")  # PEFT folders we write
        self._max_model_len = int(cfg.model_config.max_model_len)  # the core may have fitted it
        self.start_seconds = time.perf_counter() - t0
        self._info = self._make_info()
        log.info(
            "vllm_backend_ready",
            seconds=round(self.start_seconds, 1),
            capacity=self._info.capacity,
            max_num_batched_tokens=getattr(cfg.scheduler_config, "max_num_batched_tokens", None),
        )

    def _make_info(self) -> BackendInfo:
        cfg = self.vllm_config
        mc = cfg.model_config
        eos: list[int] = []
        for src in (self._eos, getattr(mc.hf_config, "eos_token_id", None), self._gen_cfg.get("eos_token_id")):
            for e in src if isinstance(src, (list, tuple)) else [src]:
                if isinstance(e, int) and e not in eos:
                    eos.append(e)
        pc = cfg.parallel_config
        return BackendInfo(
            backend="vllm",
            model=self.model,
            vocab_size=int(mc.get_vocab_size()),
            eos_token_ids=eos,
            capacity=int(cfg.scheduler_config.max_num_seqs),
            max_model_len=self._max_model_len,
            tp=int(pc.tensor_parallel_size),
            pp=int(pc.pipeline_parallel_size),
            dtype=str(getattr(mc, "dtype", "")).removeprefix("torch."),
        )

    def info(self) -> BackendInfo:
        return self._info

    # ================================================================ data path
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
        try:
            self._collect(0.0)  # what is queued now belongs to the caller, not to a later step()
        except BackendError:
            pass  # a dead core: abort still drops the ids; step() reports the death
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

    # ================================================================ control plumbing
    def _op(
        self,
        what: str,
        knob: str,
        calls: list[tuple[str, tuple]],
        result: Callable[[list[Any]], dict] | None = None,
        after: Callable[[bool], None] | None = None,
    ) -> BackendOp:
        """Send `calls` (utility name, args) back to back; one BackendOp for all.
        `result(results)` makes the op's dict; `after(ok)` runs once when all are
        done (on vLLM's output thread: flags and file cleanup only, no sends)."""
        timeout = float(getattr(self, knob))
        op = BackendOp.pending(what, timeout, knob)
        if self._link.dead:
            return BackendOp.failed(what, BackendError(f"{what}: the vLLM engine core is dead"))
        futs = [self._link.utility(name, *args) for name, args in calls]
        lock = threading.Lock()
        left = [len(futs)]

        def done(_f: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            err = next((f.exception() for f in futs if f.exception() is not None), None)
            res: dict[str, Any] = {}
            if err is None and result is not None:
                try:
                    res = result([f.result() for f in futs])
                except Exception as e:
                    err = e
            if after is not None:
                try:
                    after(err is None)
                except Exception:
                    log.exception("vllm_op_cleanup_failed", op=what)
            _settle(op.future, res, None if err is None else _backend_error(what, err))

        for f in futs:
            f.add_done_callback(done)
        self._ops.append((op, timeout))
        return op

    def _sweep(self) -> None:
        """Run queued continuations; fail ops past their deadline (naming the
        knob); forget finished ones. Called from step/has_work/stats."""
        if self._link.dead:
            self._link.check_alive()
        while self._later:
            fn = self._later.popleft()
            if not self._link.dead:
                fn()
        if not self._ops:
            return
        now = time.monotonic()
        keep = []
        for op, timeout in self._ops:
            if op.future.done():
                continue
            if now > op.deadline:
                _settle(op.future, None, BackendTimeout(op.what, timeout, op.knob))
                continue
            keep.append((op, timeout))
        self._ops = keep

    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> tuple[str, tuple]:
        """A collective_rpc utility call: `method` on every worker."""
        return ("collective_rpc", (method, timeout, args, None))

    # ================================================================ freeze / sleep
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

    def sleep(self, level: int) -> BackendOp:
        if self._rid_of:
            return BackendOp.failed(
                "sleep",
                BackendError(f"sleep with {len(self._rid_of)} live sequence(s): pause(mode='abort') them first"),
            )
        level = int(level)
        t0 = time.perf_counter()
        op = BackendOp.pending(f"sleep({level})", self.sleep_timeout_s, "sleep_timeout_s")
        rewake: list[Any] = []
        if self._sleeping:
            # Half awake: vLLM's executor ignores a sleep while any tag sleeps
            # (the awake ones would stay resident). Wake the rest, then sleep.
            rewake.append(self._link.utility("wake_up", sorted(self._sleeping)))
            if self._buffers_held:  # the weights are back: so are their buffers
                rewake.append(self._link.utility("collective_rpc", "rollout_bus_restore_sleep_buffers", None, (), None))
                self._buffers_held = False
        # Kept zero-copy IPC maps pin the trainer's memory: a colocated trainer
        # takes the GPU while the engine sleeps, so they go first.
        self._link.utility("collective_rpc", "rollout_bus_drop_maps", None, (), None)
        before = self._link.utility("collective_rpc", "rollout_bus_info", None, (), None)
        slept = self._link.utility("sleep", level, "abort")
        self._ops.append((op, self.sleep_timeout_s))

        # The core's sleep may answer late (it waits for its pause to complete),
        # and a call sent behind it could run first: the "after" measurement is
        # sent only once sleep answered, from the loop thread (see _sweep).
        def measure() -> None:
            try:
                for f in rewake:
                    f.result(0)
                free0 = sum(int(r["gpu_free"]) for r in before.result(0))
                slept.result(0)
            except Exception as e:
                _settle(op.future, None, _backend_error(op.what, e))
                return
            self._sleep_level = level
            self._sleeping = {"weights", "kv_cache"}
            after = self._link.utility("collective_rpc", "rollout_bus_info", None, (), None)

            def done(f: Any) -> None:
                freed = None if f.exception() else sum(int(r["gpu_free"]) for r in f.result()) - free0
                res = {
                    "backend_seconds": round(time.perf_counter() - t0, 4),
                    "gpu_freed_bytes": freed,
                    # the core's cue: a new weight state (and version) once they wake
                    "weights": "discarded" if level >= 2 else "offloaded",
                }
                _settle(op.future, res, None)

            after.add_done_callback(done)

        def queue_measure(_f: Any) -> None:  # output thread: no sends here
            if before.done() and slept.done() and all(f.done() for f in rewake):
                self._later.append(measure)
                self._link.kick()

        before.add_done_callback(queue_measure)
        slept.add_done_callback(queue_measure)
        for f in rewake:
            f.add_done_callback(queue_measure)
        return op

    def wake_up(self, tags: list[str] | None) -> BackendOp:
        """Wake the named tags (None: all) that are asleep; the rest are a no-op
        (vLLM's executor would skip the WHOLE call for one tag already awake).
        vLLM's core resumes its scheduler once no tag sleeps; a keep-pause of
        ours survives that."""
        t0 = time.perf_counter()
        wanted = {"weights", "kv_cache"} if tags is None else set(tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            return BackendOp.failed("wake_up", BackendError(f"unknown wake_up tags {sorted(unknown)}", field="tags"))
        to_wake = wanted & self._sleeping
        if not to_wake:
            return BackendOp.done("wake_up", {"woken": [], "sleeping": sorted(self._sleeping)})
        before = (set(self._sleeping), self._weights_stale, self._sleep_level, self._weights_epoch, self._buffers_held)
        self._sleeping -= to_wake
        full = not self._sleeping
        if self._sleep_level >= 2 and "weights" in to_wake:
            self._weights_stale = True  # mapped again, contents undefined (see __init__)
            self._weights_epoch += 1  # a new weight state: a new cache salt
        calls: list[tuple[str, tuple]] = []
        if self._sleep_level >= 2 and "weights" in self._sleeping:
            # KV first after level 2: vLLM would restore the saved buffers into
            # the still-sleeping weights pool (vllm_worker_ext holds them).
            calls.append(self._rpc("rollout_bus_hold_sleep_buffers", timeout=self.sleep_timeout_s))
            self._buffers_held = True
        calls.append(("wake_up", (sorted(to_wake),)))
        if self._buffers_held and "weights" in to_wake:
            calls.append(self._rpc("rollout_bus_restore_sleep_buffers", timeout=self.sleep_timeout_s))
            self._buffers_held = False
        reload = full and self._weights_stale
        if reload:
            # About to serve on weights no update has written: the checkpoint's.
            calls.append(self._rpc("rollout_bus_reload_checkpoint", timeout=self.sleep_timeout_s))
            self._weights_stale = False
        if full and self._paused:
            # The core resumes its scheduler once fully awake: keep our freeze.
            calls.append(("pause_scheduler", ("keep", False)))
        if full:
            self._sleep_level = 0
        left = sorted(self._sleeping)

        def after(ok: bool) -> None:  # output thread: flags only
            if not ok:
                (self._sleeping, self._weights_stale, self._sleep_level, self._weights_epoch, self._buffers_held) = (
                    before
                )

        return self._op(
            "wake_up",
            "sleep_timeout_s",
            calls,
            lambda rs: {
                "backend_seconds": round(time.perf_counter() - t0, 4),
                "woken": sorted(to_wake),
                "sleeping": left,
                "reloaded_from_checkpoint": reload,
            },
            after,
        )

    def reset_prefix_cache(self) -> BackendOp:
        return self._op(
            "reset_prefix_cache",
            "rpc_timeout_s",
            [("reset_prefix_cache", (False, False))],
            lambda rs: {"reset": bool(rs[0])},
        )

    def collective_rpc(self, method: str, *args: Any) -> BackendOp:
        """Any worker-extension method on every worker (results: one per worker)."""
        return self._op(
            f"collective_rpc({method})",
            "rpc_timeout_s",
            [self._rpc(method, *args, timeout=self.rpc_timeout_s)],
            lambda rs: {"results": rs[0]},
        )

    # ================================================================ weights
    def begin_weight_update(
        self, update_id: str, transport: str, tensors: list[Any], args: dict[str, Any]
    ) -> BackendOp:
        if transport not in W.TRANSPORTS:
            return BackendOp.failed(
                "begin_weight_update",
                BackendError(
                    f"vllm backend: unknown transport {transport!r} ({', '.join(W.TRANSPORTS)})", field="transport"
                ),
            )
        if self._update is not None:  # a new begin replaces an unfinished update
            self.abort_weight_update()
        metas = [W.meta_list(t) for t in tensors]
        sizes = [int(s) for s in (args.get("bucket_sizes") or W.derive_sizes(metas))]
        if self._ckpt_shapes is None:
            self._ckpt_shapes = W.checkpoint_shapes(self.model)
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        bad = W.validate(metas, sizes, self._ckpt_shapes, tied, self.model)
        if bad is not None:
            return BackendOp.failed("begin_weight_update", BackendError(bad[1], field=bad[0]))
        up = W.WeightUpdate(update_id, transport, metas, sizes, dict(args))
        if transport == "zmq":
            try:
                up.stage = W.ShmStage(sizes, up.uid)
            except OSError as e:
                return BackendOp.failed("begin_weight_update", BackendError(f"zmq staging: shared memory: {e}"))
            self._update = up
            return BackendOp.done("begin_weight_update", {"bytes": sum(sizes), "staging": up.stage.path})
        self._update = up
        # cuda_ipc / nccl: nothing to tell the workers yet. The metas travel with
        # the call that needs them (nccl: the receive; cuda_ipc: the commit), so
        # an update costs one worker round trip (cuda_ipc) or two (nccl).
        return BackendOp.done("begin_weight_update", {"tensors": len(metas), "bytes": sum(sizes)})

    def _require(self, transport: str | None = None) -> W.WeightUpdate:
        up = self._update
        if up is None:
            raise BackendError("no weight update in progress (begin_weight_update first)")
        if transport is not None and up.transport != transport:
            raise BackendError(f"weight update uses transport {up.transport!r}, not {transport!r}", field="transport")
        return up

    def stage_bucket(self, bucket: int, data: memoryview) -> None:
        up = self._require(transport="zmq")
        assert up.stage is not None
        try:
            up.stage.write(int(bucket), data, up.metas)
        except ValueError as e:
            raise BackendError(f"weight bucket {bucket}: {e}") from None

    def receive_weights(self, handles: list[Any]) -> BackendOp:
        try:
            up = self._require()
        except BackendError as e:
            return BackendOp.failed("receive_weights", e)
        t0 = time.perf_counter()
        nbytes = int(sum(up.sizes))

        def result(rs: list[Any]) -> dict[str, Any]:
            dt = time.perf_counter() - t0
            up.received = True
            r: dict[str, Any] = {
                "bytes": nbytes,
                "backend_seconds": round(dt, 4),
                "GBps": round(nbytes / dt / 1e9, 3) if dt > 0 else None,
                "worker_seconds": [round(x["seconds"], 4) for x in rs[0]],
            }
            if up.transport == "nccl":
                w = rs[0][0]
                # the node keeps it as a ReceiveTiming (engine_node/timings.py, read through Stats)
                r["nccl"] = {k: w.get(k) for k in ("reused", "setup_seconds", "alloc_s", "broadcast_s")}
            return r

        if up.transport == "cuda_ipc":
            if len(handles) != len(up.sizes):
                return BackendOp.failed(
                    "receive_weights",
                    BackendError(f"cuda_ipc: {len(handles)} handle(s) for {len(up.sizes)} bucket(s)", field="handles"),
                )
            # Kept, not opened: the commit maps, validates and writes in one worker
            # call (a bad handle fails the commit before any parameter is written).
            # The trainer keeps its buckets until the commit (or abort) is acked.
            up.handles = list(handles)
            up.received = True
            return BackendOp.done("receive_weights", {"bytes": nbytes, "deferred": True})
        if up.transport == "nccl":
            a = {**up.args, "timeout_s": float(up.args.get("timeout_s", self.weight_timeout_s))}
            call = self._rpc("rollout_bus_recv_nccl", up.uid, a, up.metas, up.sizes, timeout=self.weight_timeout_s)
            up.workers_know = True
        else:
            return BackendOp.failed(
                "receive_weights",
                BackendError(
                    "receive_weights is for the GPU transports (cuda_ipc, nccl); zmq stages buckets", field="transport"
                ),
            )
        return self._op("receive_weights", "weight_timeout_s", [call], result)

    def receive_part(
        self, sender: int, tensors: list[Any], sizes: list[int], handles: list[Any], transport_args: dict[str, Any]
    ) -> BackendOp:
        """One sender's part of a multi-sender GPU update (engine_node/weight_update.py
        `_receive_part`): its metas are validated and appended to the update
        (bucket numbers shifted past the parts before it). cuda_ipc: its handles
        are kept for the commit's one worker call, so the sender keeps its
        buckets until the commit (or abort) is acked. nccl: the workers receive
        the part now over the SENDER's own group (one communicator per sender
        rank, kept for later updates)."""
        what = f"receive_part(sender {sender})"
        try:
            up = self._require()
        except BackendError as e:
            return BackendOp.failed(what, e)
        metas = [W.meta_list(t) for t in tensors]
        sizes = [int(x) for x in sizes]
        if self._ckpt_shapes is None:
            self._ckpt_shapes = W.checkpoint_shapes(self.model)
        tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
        bad = W.validate(metas, sizes, self._ckpt_shapes, tied, self.model)
        if bad is not None:
            return BackendOp.failed(what, BackendError(f"sender {sender}: {bad[1]}", field=bad[0]))
        seen = {m[0] for m in up.metas}
        dup = next((m[0] for m in metas if m[0] in seen), None)
        if dup is not None:
            return BackendOp.failed(what, BackendError(f"sender {sender}: {dup} was sent by another sender", field=dup))
        first = len(up.sizes)
        for m in metas:
            m[3] = int(m[3]) + first
        up.metas += metas
        up.sizes += sizes
        if up.transport == "cuda_ipc":
            if len(handles) != len(sizes):
                return BackendOp.failed(
                    what,
                    BackendError(f"cuda_ipc: {len(handles)} handle(s) for {len(sizes)} bucket(s)", field="handles"),
                )
            up.handles += list(handles)
            up.received = True
            return BackendOp.done(what, {"bytes": sum(sizes), "deferred": True})
        a = {**transport_args, "timeout_s": float(transport_args.get("timeout_s", self.weight_timeout_s))}
        call = self._rpc("rollout_bus_recv_nccl_part", up.uid, a, metas, sizes, first, timeout=self.weight_timeout_s)
        up.workers_know = True
        t0 = time.perf_counter()

        def result(rs: list[Any]) -> dict[str, Any]:
            up.received = True
            w = rs[0][0]
            return {"bytes": sum(sizes), "backend_seconds": round(time.perf_counter() - t0, 4), **w}

        return self._op(what, "weight_timeout_s", [call], result)

    def commit_weight_update(self) -> BackendOp:
        try:
            up = self._require()
        except BackendError as e:
            return BackendOp.failed("commit_weight_update", e)
        shm = None
        if up.transport == "zmq":
            assert up.stage is not None
            missing = up.stage.missing()
            if missing:
                return BackendOp.failed(
                    "commit_weight_update", BackendError(f"zmq: bucket(s) {missing[:8]} never staged")
                )
            # The workers never saw a begin for zmq: begin + commit go together.
            shm = up.stage.spec()
        elif not up.received:
            return BackendOp.failed("commit_weight_update", BackendError("commit before receive_weights"))
        self._update = None
        t0 = time.perf_counter()
        # transport_args["weight_check"] (the trainer's update_weights(weight_check=True)):
        # the workers also run load_weights and compare every parameter with the plan's.
        opts = {
            "plan": self.weight_plan,
            "check": bool(up.args.get("weight_check")),
            # the trainer's zero-copy cuda_ipc: its handles repeat, keep the maps
            "keep_maps": bool(up.args.get("keep_maps")),
        }
        calls = []
        if self._weights_stale and not (self._ckpt_shapes and set(self._ckpt_shapes) <= {m[0] for m in up.metas}):
            # After a level-2 sleep, an update of SOME tensors: the rest must be
            # the checkpoint's before it is written (a reload after it, at the
            # wake that ends sleep, would overwrite what it wrote).
            calls.append(self._rpc("rollout_bus_reload_checkpoint", timeout=self.weight_timeout_s))
            self._weights_stale = False
        if up.transport == "zmq":
            calls.append(self._rpc("rollout_bus_begin", up.uid, up.metas, up.sizes, timeout=self.weight_timeout_s))
            calls.append(self._rpc("rollout_bus_commit", up.uid, shm, timeout=self.weight_timeout_s))
        elif up.transport == "cuda_ipc":  # the whole update in one worker call
            calls.append(
                self._rpc(
                    "rollout_bus_apply_ipc", up.uid, up.metas, up.sizes, up.handles, opts, timeout=self.weight_timeout_s
                )
            )
        else:
            calls.append(self._rpc("rollout_bus_commit", up.uid, None, opts, timeout=self.weight_timeout_s))
        # The prefix cache is invalidated by a new salt, not a reset (see __init__).
        self._weights_epoch += 1
        if self._weights_stale and self._ckpt_shapes and set(self._ckpt_shapes) <= {m[0] for m in up.metas}:
            self._weights_stale = False  # every checkpoint tensor written: no reload needed

        def result(rs: list[Any]) -> dict[str, Any]:
            dt = time.perf_counter() - t0
            w = rs[-1][0] if rs[-1] else {}
            timing = {k: w[k] for k in _WORKER_TIMING if k in w}  # the node's CommitTiming.worker
            return {
                "backend_seconds": round(dt, 4),
                "bytes": int(sum(up.sizes)),
                "worker_seconds": [round(x["seconds"], 4) for x in rs[-1]],
                "worker": timing,
                "prefix_cache_reset": True,
                "prefix_cache_salt": f"w{self._weights_epoch}",
            }

        return self._op("commit_weight_update", "weight_timeout_s", calls, result, lambda ok: up.close())

    def abort_weight_update(self) -> BackendOp:
        up, self._update = self._update, None
        if up is None:
            return BackendOp.done("abort_weight_update", {"had_update": False})
        if not up.workers_know:  # zmq / cuda_ipc before the commit: the workers never saw it
            up.close()
            return BackendOp.done("abort_weight_update", {"had_update": True})
        return self._op(
            "abort_weight_update",
            "rpc_timeout_s",
            [self._rpc("rollout_bus_abort", up.uid)],
            lambda rs: {"had_update": True},
        )

    # ================================================================ LoRA
    def _lora_request(self, name: str | None) -> Any:
        if name is None:
            return None
        a = self._loras.adapters.get(name)
        if a is None:
            raise BackendError(f"LoRA adapter {name!r} is not loaded (loaded: {self._loras.names()})", field="lora")
        return self._api.LoRARequest(lora_name=name, lora_int_id=a.lora_id, lora_path=a.path)

    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: list[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> BackendOp:
        if not self.enable_lora:
            return BackendOp.failed(
                "load_lora", BackendError("this vllm engine was started without LoRA (backend option enable_lora=True)")
            )
        if (path is None) == (tensors is None):
            return BackendOp.failed("load_lora", BackendError("load_lora needs exactly one of path or tensors"))
        wrote = None
        if tensors is not None:
            # Hazard: a blocking file write on the loop thread; adapters are MBs.
            path = wrote = write_peft(self._tmp, self.model, name, tensors, config)
        lid, inplace = self._loras.next_id(name)
        req = self._api.LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path, load_inplace=inplace)
        table = self._loras

        def result(rs: list[Any]) -> dict[str, Any]:
            if not rs[0] and not inplace:
                raise BackendError(f"vLLM refused LoRA adapter {name!r} from {path}", field="lora")
            table.loaded(name, lid, str(path), wrote)  # output thread: dict updates only
            return {"lora_id": lid, "in_place": inplace}

        def after(ok: bool) -> None:
            if not ok and wrote:
                shutil.rmtree(wrote, ignore_errors=True)

        return self._op(f"load_lora({name})", "lora_timeout_s", [("add_lora", (req,))], result, after)

    def unload_lora(self, name: str) -> BackendOp:
        a = self._loras.adapters.get(name)
        if a is None:
            return BackendOp.failed("unload_lora", BackendError(f"LoRA adapter {name!r} is not loaded", field="lora"))
        self._loras.removed(name)
        return self._op(
            f"unload_lora({name})",
            "lora_timeout_s",
            [("remove_lora", (a.lora_id,))],
            lambda rs: {"removed": bool(rs[0])},
        )

    def loras(self) -> list[str]:
        return self._loras.names()

    # ================================================================ close
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._update is not None:
            self._update.close()
            self._update = None
        try:
            self._link.close(self.shutdown_timeout_s)  # stops the engine core and its workers
        except Exception:
            log.exception("vllm_shutdown_failed")
        for op, _ in self._ops:
            _settle(op.future, None, BackendError(f"{op.what}: the vllm backend was closed"))
        self._ops = []
        shutil.rmtree(self._tmp, ignore_errors=True)


# What the worker's commit reports about where its time went (returned; engine_node/timings.py).
_WORKER_TIMING = (
    "path",
    "maps_kept",
    "seconds",
    "open_s",
    "apply_s",
    "copy_s",
    "fallback",
    "fallback_s",
    "record_s",
    "load_s",
    "verify_s",
    "verify_mismatch",
    "post_sync_s",
    "copied",
    "plan",
    "why",
    "check_params",
    "check_mismatch",
    "check_s",
)


def _backend_error(what: str, err: BaseException) -> BackendError:
    if isinstance(err, BackendError):
        return err
    return BackendError(f"{what} failed in the vLLM engine: {err}")


# Sizes added between LLM's largest capture size and extra_graph_tokens: a step
# pads up to the next one, so the ladder bounds the padding (<= 25 %) while
# keeping the number of graphs (start-up time) small.
_GRAPH_LADDER = (640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 16384)


def with_graph_sizes(engine_kw: dict[str, Any], cfg: Any, tokens: Any) -> dict[str, Any]:
    """engine_kw whose compilation_config also captures graphs up to `tokens`
    (capped at max_num_batched_tokens: no step is larger)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise BackendError(f"extra_graph_tokens must be a token count >= 0, got {tokens!r}", field="extra_graph_tokens")
    cc = getattr(cfg, "compilation_config", None)
    sizes = sorted(int(x) for x in (getattr(cc, "cudagraph_capture_sizes", None) or ()))
    if not sizes or getattr(cfg.model_config, "enforce_eager", False):
        raise BackendError(
            "extra_graph_tokens needs CUDA graphs, and this engine has none (enforce_eager?)",
            field="extra_graph_tokens",
        )
    top = min(tokens, int(cfg.scheduler_config.max_num_batched_tokens))
    if top <= sizes[-1]:
        return engine_kw
    extra = [s for s in _GRAPH_LADDER if sizes[-1] < s < top] + [top]
    given = engine_kw.get("compilation_config") or {}
    if not isinstance(given, dict):
        raise BackendError(
            "extra_graph_tokens needs compilation_config as a dict of fields, if given", field="compilation_config"
        )
    return {**engine_kw, "compilation_config": {**given, "cudagraph_capture_sizes": sizes + extra}}


def _ramp_budget(value: int | str, cfg: Any) -> int:
    """resume_ramp_tokens as a token count: "auto" is the engine's largest
    CUDA-graph capture size (0, off, for an engine without graphs)."""
    if value == "auto":
        cc = getattr(cfg, "compilation_config", None)
        sizes = list(getattr(cc, "cudagraph_capture_sizes", None) or ())
        mode = str(getattr(cc, "cudagraph_mode", "")).upper()
        if not sizes or mode.endswith("NONE") or getattr(cfg.model_config, "enforce_eager", False):
            return 0
        return int(getattr(cc, "max_cudagraph_capture_size", None) or max(sizes))
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0 or isinstance(value, bool):
        raise BackendError(
            f"resume_ramp_tokens must be a token count >= 0 or 'auto', got {value!r}", field="resume_ramp_tokens"
        )
    return n


def make_backend(model: str, **options: Any) -> VllmBackend:
    return VllmBackend(model, **options)
