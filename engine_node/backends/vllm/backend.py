"""The `vllm` backend: vLLM 0.24.0's engine core, batch in, batch out.

How it is put together (one concept per module):
- vllm/startup: the environment, EngineArgs fields, graph sizes, the core
  client and CPU placement, used once by VllmBackend.__init__.
- VllmBackend (here) is the coordinator: its state, start-up, info and close;
  its methods come from mixins over vllm/ops.VllmOps (control plumbing: `_op`,
  `_sweep`): vllm/data_path (add/step/abort, the resume ramp, freeze/thaw),
  vllm/sleep (sleep/wake_up, caches, LoRA), vllm/weight_ops (weight updates).
- vllm/engine_core.CoreLink: vLLM's SyncMPClient (engine core in its own
  process) with a wake pipe on its output queue and utility calls that return
  futures instead of blocking.
- vllm/requests: SeqRequest -> EngineCoreRequest (InputProcessor's defaults,
  no tokenizer pass); EngineCoreOutputs -> StepOutputs (no detokenizer).
- vllm/weights: the weight-update record, validation, zmq shared-memory staging.
- vllm/lora: adapter ids and PEFT folders.
- vllm/worker_ext: what runs inside every worker (weights, parent death).

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
import tempfile
import time
from collections.abc import Callable
from typing import Any

import structlog

from engine_node.backend import BackendError, BackendInfo, BackendOp
from engine_node.backends.vllm import weight_reuse as R
from engine_node.backends.vllm import weights as W
from engine_node.backends.vllm.data_path import VllmDataPath
from engine_node.backends.vllm.engine_core import CoreLink, _settle, load_vllm_api
from engine_node.backends.vllm.lora import LoraTable
from engine_node.backends.vllm.requests import OutputBuffer
from engine_node.backends.vllm.sleep import VllmSleepAndLora
from engine_node.backends.vllm.startup import (
    engine_kwargs,
    make_core_client,
    place_cpus,
    prepare_env,
    ramp_budget,
    with_graph_sizes,
)
from engine_node.backends.vllm.weight_ops import VllmWeightOps

log = structlog.get_logger("rollout_bus.vllm_backend")


class VllmBackend(VllmDataPath, VllmSleepAndLora, VllmWeightOps):
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
        # On: vLLM's scheduler sends SchedulerStats (kv_cache_usage, running /
        # waiting, prefix-cache hits) only with log_stats, so off leaves the
        # heartbeat's kv_usage and the head's gauge at 0.0 (issue 36). Its cost
        # in vLLM 0.24: one small SchedulerStats per step and a few timestamped
        # events per request (QUEUED, SCHEDULED), no extra sync; `vllm serve`
        # runs with it on by default.
        log_stats: bool = True,
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
        return_routed_experts: bool = False,
        _api: Any = None,  # vLLM's classes (tests pass a fake)
        **passthrough: Any,  # any other EngineArgs field: max_num_seqs, max_num_batched_tokens, …
    ) -> None:
        prepare_env()
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
        # (vllm/worker_ext._rb_apply); False: load_weights every time.
        self.weight_plan = bool(weight_plan)
        # Resume ramp (off at 0): vllm/data_path.py says why and how.
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
        # issue 37 (R3): vLLM's scheduler returns each request's routed experts
        self.return_routed_experts = bool(return_routed_experts)
        if self.return_routed_experts:
            passthrough.setdefault("enable_return_routed_experts", True)

        engine_kw = engine_kwargs(
            model, tp=tp, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            enforce_eager=enforce_eager, enable_lora=enable_lora, max_lora_rank=max_lora_rank, max_loras=max_loras,
            enable_sleep_mode=enable_sleep_mode, dtype=dtype, seed=seed, attention_backend=attention_backend,
            passthrough=passthrough,
        )  # fmt: skip
        self._init_loop_state()
        self._start_engine(engine_kw, extra_graph_tokens, resume_ramp_tokens, log_stats, cpu_affinity)

    def _init_loop_state(self) -> None:
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
        self._buffers_held = False  # vllm/worker_ext holds level-2 buffers (see wake_up)
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
        # What repeats in an RL loop's updates (vllm/weight_ops): the last
        # validated tensor list, and the zero-copy IPC layout the workers keep.
        self._valid: R.Validated | None = None
        self._ipc_kept: R.KeptIpc | None = None
        self._ipc_seq = 0
        self._closed = False

    def _start_engine(
        self, engine_kw: dict[str, Any], extra_graph_tokens: int, resume_ramp_tokens: int | str, log_stats: bool,
        cpu_affinity: str,
    ) -> None:  # fmt: skip
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
        self.resume_ramp_tokens = ramp_budget(resume_ramp_tokens, cfg)  # before the engine starts
        mc = cfg.model_config
        self._max_model_len = int(mc.max_model_len)
        self._gen_cfg = dict(mc.try_get_generation_config() or {})
        self._eos = self._api.tokenizer_eos(cfg) if not getattr(mc, "skip_tokenizer_init", False) else None
        client = make_core_client(self._api, cfg, bool(log_stats))
        self._link = CoreLink(client, self._api.UTILITY)
        self.cpu_placement: dict[str, Any] = place_cpus(cpu_affinity)
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
            routed_experts=moe_shape(mc) if self.return_routed_experts else None,
        )

    def info(self) -> BackendInfo:
        return self._info

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


def moe_shape(mc: Any) -> tuple[int, int, int]:
    """(layers, top_k, num_experts) of vLLM's routed-experts rows: its capturer
    keeps one slot per hidden layer (vllm/model_executor/layers/fused_moe/
    routed_experts_capturer.py), the config names differ per model family."""
    hf = getattr(mc, "hf_text_config", None) or mc.hf_config
    top_k = getattr(hf, "num_experts_per_tok", None) or getattr(hf, "top_k_experts", None)
    experts = next(
        (getattr(hf, k) for k in ("num_experts", "n_routed_experts", "num_local_experts") if getattr(hf, k, None)), None
    )
    if not top_k or not experts:
        raise BackendError(
            "return_routed_experts: the model's config names no num_experts_per_tok / num_experts (not a MoE model)",
            field="return_routed_experts",
        )
    return int(hf.num_hidden_layers), int(top_k), int(experts)


def make_backend(model: str, **options: Any) -> VllmBackend:
    return VllmBackend(model, **options)
