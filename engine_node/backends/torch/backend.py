"""The `torch` backend: a Hugging Face transformers causal LM, on CPU or one GPU.

A small *reference* engine (correctness over speed) behind the Backend protocol
of engine_node/backend.py:

- Continuous batching, exactly: sequences join (add) and leave (finish, abort)
  between steps. Each step runs one forward per runnable sequence, each with its
  own `DynamicCache`; a new sequence's whole prompt is prefilled in one forward
  that also yields its first token. No padding, no batch-shape-dependent
  kernels, so greedy output equals `model.generate(do_sample=False)` and
  logprobs equal the model's own log-softmax (fp32). At most `capacity`
  sequences are stepped per step (oldest first); the rest wait their turn.
- Sampling (per sequence, on CPU in fp32): temperature (< 1e-5: greedy argmax,
  the first maximal index as in HF), then top-k, then top-p, then a draw from
  the sequence's own `torch.Generator` (seeded from SeqRequest.seed; unseeded
  sequences get a seed from the backend's generator). abort() returns each
  sequence's generator state and add() continues from SeqRequest.rng_state,
  so a parked and re-submitted sequence draws exactly what it would have.
- Logprobs are log_softmax of the fp32 logits *before* temperature, top-k and
  top-p: the model's raw distribution, i.e. what a trainer recomputes.
- Issue 10 (engine_node/sampling_features.py, vLLM's definitions and order):
  min_tokens masks the stop ids, then repetition / presence / frequency
  penalties (the last `output_prefix` prompt tokens count as output), then
  greedy, or temperature → min_p → top-k → top-p. logprobs=k adds the top-k of
  the raw log_softmax; prompt_logprobs (SeqRequest.prompt_logprobs) keeps every
  position's logits in the prefill and reports them with the first token.
- Stops: a token in stop_token_ids, or in eos_token_ids unless ignore_eos,
  ends the sequence with "stop" and IS part of the output (as vLLM keeps eos
  ids in output_token_ids); max_new_tokens ends it with "length".
- Weight updates over the `zmq` transport: begin (validate every name, dtype,
  shape) → stage_bucket (unpack the raw frame, clone once) → commit (copy
  everything at once, on the worker thread). Nothing touches the model before
  the commit, and the commit validates before its first copy.
- LoRA without peft (engine_node.lora_local): forward hooks apply the adapter
  of whichever sequence is being stepped.
- sleep(1): drop KV caches; on a GPU also move the weights to a CPU copy (on CPU
  they stay). sleep(2): also discard the weights; wake_up reloads them from the
  checkpoint, so level 2 DISCARDS weight updates (as vLLM's level 2 does) — the
  node owns weight versions and must re-send weights or reset its version.
  Sleeping with sequences held is refused (the node parks them first), and
  add() is refused until every tag is awake again.
- num_running() counts every sequence held (stepping, waiting for a slot, or
  frozen); has_work() only the unfrozen ones.
- return_routed_experts (option, issue 37): serve an HF MoE model's routing
  (Qwen3-MoE, Mixtral, ...): a sequence submitted with routes_from gets, per
  forward, the top-k expert ids of every input position and MoE layer
  (`output_router_logits`), the routes the model really took.
- threads (option): torch's intra-op thread count is process-global and the
  node process hosts one backend, so the backend sets it: by default 1 for a
  small model on CPU (per-op work is too small to split), else untouched.

- Long control ops (commit_weight_update, sleep, wake_up, load_lora,
  unload_lora, and abort_weight_update so it orders behind a commit) run on ONE
  backend-owned worker thread and return a BackendOp at once. Such an op holds
  the model lock: step() waits for it at most _STEP_LOCK_WAIT_S and returns []
  meanwhile (never blocks for the op's duration); add() keeps queueing.
  freeze/thaw/reset_prefix_cache/begin_weight_update are bookkeeping and
  return BackendOp.done(...).
- op_timeout_s (option, 600): the deadline of every long op (the node reports
  BackendTimeout naming `op_timeout_s` when it passes).
- fault_op_delay_s (option, TEST-ONLY fault injection): {"op name": seconds}
  makes that op hold the model that much longer, e.g.
  {"commit_weight_update": 40} for a weight update slower than the head's
  stall timeout. Never set it in production.

Ownership: the engine node's loop thread calls every method. The worker thread
runs only the op functions, under `_model_lock`; the data-path state it reads
(`_seqs`) it copies first, since the loop thread may add to it meanwhile.
Outputs are produced synchronously inside step(), so abort() never has
unreturned tokens and wake_fd() is None.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import threading
from collections.abc import Iterable
from typing import Any

import structlog
import torch

from bus.frames import logprobs_wanted, top_k_of
from engine_node import sampling_features as SF
from engine_node.backend import BackendError, BackendInfo, BackendOp, SeqRequest, StepOutput
from engine_node.backends.torch.sleep import TorchSleepAndLora
from engine_node.backends.torch.weights import TorchWeightUpdates, _dtype_name
from engine_node.lora_local import LoraHooks
from engine_node.tiny_model import hf_quiet

log = structlog.get_logger(__name__)

_GREEDY_EPS = 1e-5  # vLLM's threshold: temperature below it means greedy
_SEED_MASK = (1 << 63) - 1
_OPTIONS = (
    "device",
    "dtype",
    "capacity",
    "max_model_len",
    "seed",
    "threads",
    "op_timeout_s",
    "fault_op_delay_s",
    "return_routed_experts",
)
# How long step() waits for the model while a control op holds it: short, so
# the node's loop keeps reading its sockets.
_STEP_LOCK_WAIT_S = 0.005
# Below this many parameters a CPU forward is a few hundred tiny ops: intra-op
# threads only add synchronisation (measured on the 64-hidden tiny model, 2
# busy cores: 8 ms per forward with 2 threads, 1.3 ms with 1).
_SMALL_MODEL_PARAMS = 20_000_000


# ------------------------------------------------------------------ sampling


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator, min_p: float = 0.0
) -> int:
    """One token id from fp32 CPU `logits` [vocab]: greedy when temperature is
    ~0, else temperature → min_p → top-k → top-p → multinomial draw from `gen`."""
    if temperature < _GREEDY_EPS:
        return int(torch.argmax(logits))
    scaled = SF.apply_min_p(logits / temperature, min_p)
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = (sorted_p.cumsum(0) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


# ------------------------------------------------------------------ sequences


@dataclasses.dataclass
class _Seq:
    req: SeqRequest
    stop_ids: frozenset[int]
    gen: torch.Generator
    # Token ids not yet in `cache`: the whole prompt before prefill, then the
    # last sampled token.
    pending: list[int]
    cache: Any = None  # transformers DynamicCache, created by the first forward
    num_tokens: int = 0  # tokens in the cache
    generated: int = 0
    frozen: bool = False
    output: list[int] = dataclasses.field(default_factory=list)  # sampled this submission
    routes: Any = None  # (first position, int32 [rows, moe_layers, top_k]) of the last forward


def _parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise BackendError(f"unknown dtype {name!r} (e.g. float32, bfloat16, float16)")
    return dt


def _eos_ids(model: Any) -> list[int]:
    """eos ids from the generation config and the model config (either may be
    an int, a list or None)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if v is None:
            continue
        ids.update([int(v)] if isinstance(v, int) else (int(x) for x in v))
    return sorted(ids)


# ------------------------------------------------------------------ backend


class TorchBackend(TorchSleepAndLora, TorchWeightUpdates):
    freeze_granularity = "seq"

    def __init__(
        self,
        model: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        capacity: int = 64,
        max_model_len: int = 4096,
        seed: int = 0,
        threads: int | None = None,
        op_timeout_s: float = 600.0,
        fault_op_delay_s: dict[str, float] | None = None,
        return_routed_experts: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if capacity < 1:
            raise BackendError(f"capacity must be >= 1, got {capacity}")
        self.path = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise BackendError(f"device {device!r} requested but CUDA is not available")
        self.dtype = _parse_dtype(dtype)
        with hf_quiet():
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        # transformers 5.x renamed forward's `past_key_values` to `cache` (the old
        # name warns, and warnings are errors under pytest): pass what it takes.
        fwd = inspect.signature(type(self.model).forward).parameters
        self._cache_arg = "cache" if "cache" in fwd else "past_key_values"
        self._routes_shape = _moe_shape(self.model, self.device) if return_routed_experts else None
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.eos_token_ids = _eos_ids(self.model)
        # A rope model runs past max_position_embeddings but its output there is
        # meaningless; clamp like vLLM's derived max_model_len.
        max_pos = getattr(cfg, "max_position_embeddings", None) or max_model_len
        self.max_model_len = int(min(max_model_len, max_pos))
        self.capacity = int(capacity)
        self._rng = torch.Generator().manual_seed(seed & _SEED_MASK)
        # Every name a weight update may address: state_dict keys, which include
        # tied aliases (lm_head.weight ↔ model.embed_tokens.weight) that
        # named_parameters() deduplicates. Specs are kept apart from the tensors
        # because sleep(2) empties the tensors.
        self._targets: dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self._specs = {n: (_dtype_name(t.dtype), tuple(t.shape)) for n, t in self._targets.items()}
        self._num_params = sum(p.numel() for p in self.model.parameters())
        self._set_threads(threads)
        self._seqs: dict[str, _Seq] = {}  # insertion order = admission order
        self._lora = LoraHooks(self.model)
        self._announced: dict[str, tuple[str, tuple[int, ...]]] | None = None  # open weight update
        self._staged: dict[str, torch.Tensor] = {}
        self._sleeping: set[str] = set()  # tags put to sleep and not woken yet
        self._weights_where = "device"  # "device" | "host" (offloaded) | "discarded"
        self._closed = False
        self._steps = 0
        self._prefills = 0  # sequences whose prompt went through the model (stats: keep-mode evidence)
        self._op_timeout_s = float(op_timeout_s)
        self._fault_delay = {str(k): float(v) for k, v in (fault_op_delay_s or {}).items()}
        self._model_lock = threading.Lock()
        self._closing = threading.Event()
        # ONE worker for every long op: ops run in submission order.
        self._ops = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch-backend-op")
        self._announced_metas: list[Any] = []
        self._update_id: str | None = None  # the update `_announced` / `_staged` belong to
        log.debug("torch backend ready", model=model, device=str(self.device), dtype=dtype)

    def _set_threads(self, threads: int | None) -> None:
        """torch's intra-op thread count is process-global: the engine node
        process hosts one backend, so the backend owns it. None = auto: 1 for a
        small model on CPU, else torch's default."""
        if threads is None and self.device.type == "cpu" and self._num_params < _SMALL_MODEL_PARAMS:
            threads = 1
        if threads is not None:
            if threads < 1:
                raise BackendError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)

    def info(self) -> BackendInfo:
        return BackendInfo(
            backend="torch",
            model=self.path,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            capacity=self.capacity,
            max_model_len=self.max_model_len,
            tp=1,
            dtype=_dtype_name(self.dtype),
            routed_experts=self._routes_shape,
        )

    def add(self, seq: SeqRequest) -> None:
        self._check_open()
        if self._sleeping:
            raise BackendError(f"backend is sleeping ({sorted(self._sleeping)}); wake_up first")
        self._validate(seq)
        seed = seq.seed if seq.seed is not None else int(torch.randint(0, _SEED_MASK, (1,), generator=self._rng))
        stop = set(seq.params.stop_token_ids or ())
        if not seq.params.ignore_eos:
            stop.update(self.eos_token_ids)
        gen = torch.Generator().manual_seed(seed & _SEED_MASK)
        if seq.rng_state is not None:
            # A re-submitted (parked) sample: continue its stream where the abort
            # left it, so it draws exactly what it would have drawn unparked.
            try:
                gen.set_state(torch.as_tensor(bytearray(seq.rng_state), dtype=torch.uint8))
            except (RuntimeError, TypeError, ValueError) as e:
                raise BackendError(f"rng_state of seq {seq.seq_id!r} is not a torch CPU generator state: {e}") from None
        self._seqs[seq.seq_id] = _Seq(req=seq, stop_ids=frozenset(stop), gen=gen, pending=list(seq.prompt))

    def _validate(self, seq: SeqRequest) -> None:
        p = seq.params
        if seq.seq_id in self._seqs:
            raise BackendError(f"seq_id {seq.seq_id!r} is already running")
        if not seq.prompt:
            raise BackendError("prompt_token_ids is empty", field="prompt_token_ids")
        if seq.max_new_tokens < 1:
            raise BackendError(f"max_tokens must be >= 1, got {seq.max_new_tokens}", field="params.max_tokens")
        bad = next((t for t in seq.prompt if not 0 <= int(t) < self.vocab_size), None)
        if bad is not None:
            raise BackendError(
                f"prompt_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})",
                field="prompt_token_ids",
            )
        if len(seq.prompt) + seq.max_new_tokens > self.max_model_len:
            raise BackendError(
                f"max_tokens: prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.max_new_tokens}) "
                f"exceeds max_model_len {self.max_model_len}",
                field="params.max_tokens",
            )
        if p.temperature < 0:
            raise BackendError(f"temperature must be >= 0, got {p.temperature}", field="params.temperature")
        if not 0.0 < p.top_p <= 1.0:
            raise BackendError(f"top_p must be in (0, 1], got {p.top_p}", field="params.top_p")
        if p.top_k < -1:
            raise BackendError(f"top_k must be -1, 0 (disabled) or > 0, got {p.top_k}", field="params.top_k")
        if seq.lora is not None and seq.lora not in self._lora.adapters:
            raise BackendError(f"lora {seq.lora!r} is not loaded (loaded: {sorted(self._lora.adapters)})", field="lora")

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        # step() returns every token it makes, so there is never anything
        # unreturned: each output only carries the sequence's generator state
        # (bytes), which the node hands back when it re-submits the sample.
        out = []
        for sid in seq_ids:
            s = self._seqs.pop(sid, None)
            if s is not None:
                out.append(StepOutput(sid, [], None, None, rng_state=bytes(s.gen.get_state().numpy().tobytes())))
        return out

    def step(self) -> list[StepOutput]:
        self._check_open()
        runnable = [s for s in self._seqs.values() if not s.frozen][: self.capacity]
        if not runnable:
            return []
        if not self._model_lock.acquire(timeout=_STEP_LOCK_WAIT_S):
            return []  # a control op holds the model: no output this turn
        try:
            return self._step_locked(runnable)
        finally:
            self._model_lock.release()

    def _step_locked(self, runnable: list[_Seq]) -> list[StepOutput]:
        if self._sleeping:
            raise BackendError(f"backend is sleeping ({sorted(self._sleeping)}); wake_up first")
        outs = [self._advance(s) for s in runnable]
        for o in outs:
            if o.finish_reason is not None:
                del self._seqs[o.seq_id]
        self._steps += 1
        return outs

    def _advance(self, s: _Seq) -> StepOutput:
        """One forward of `s` (its prefill the first time), one sampled token
        (the issue-10 processing: engine_node/sampling_features.py)."""
        req = s.req
        p = req.params
        plp = None
        if s.cache is None:
            self._prefills += 1  # a prefill: a re-submitted (parked) sequence counts again
        if s.cache is None and req.prompt_logprobs is not None:
            full = self._forward(s, all_logits=True)
            plp = SF.prompt_logprobs(full, req.prompt, req.prompt_logprobs)
            raw = full[-1]
        else:
            raw = self._forward(s)
        logits = raw
        if p.min_tokens:
            logits = SF.apply_min_tokens(logits, s.generated, p.min_tokens, s.stop_ids)
        if SF.has_penalties(p):
            cut = len(req.prompt) - req.output_prefix
            logits = SF.apply_penalties(
                logits,
                req.prompt[:cut],
                req.prompt[cut:] + s.output,
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
            )
        tok = sample_token(logits, p.temperature, p.top_k, p.top_p, s.gen, p.min_p)
        out = StepOutput(req.seq_id, [tok], None, None, prompt_logprobs=plp)
        if s.routes is not None:
            out.routes_start, out.routed_experts = s.routes
        if logprobs_wanted(p.logprobs):
            logp = torch.log_softmax(raw, dim=-1)
            out.logprobs = [float(logp[tok])]
            k = top_k_of(p.logprobs)
            if k:
                out.top_ids, out.top_logprobs = SF.top_logprobs(logp, k)
        s.generated += 1
        s.output.append(tok)
        s.pending = [tok]
        if tok in s.stop_ids:
            out.finish_reason = "stop"
        elif s.generated >= req.max_new_tokens:
            out.finish_reason = "length"
        return out

    def _forward(self, s: _Seq, all_logits: bool = False) -> torch.Tensor:
        """Feed `s.pending` through the model on top of its cache; return the
        fp32 CPU logits of the last position (of every position: all_logits).
        The cache is created here and grows in place (a forward that raises
        midway leaves it unusable)."""
        from transformers import DynamicCache

        if s.cache is None:
            s.cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([s.pending], dtype=torch.long, device=self.device)
        extra = {self._cache_arg: s.cache}
        shape = self._routes_shape if s.req.routes_from is not None else None
        if shape is not None:
            extra["output_router_logits"] = True
        with torch.inference_mode(), self._lora.active(s.req.lora):
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1, **extra)
        if shape is not None:
            s.routes = (s.num_tokens, _top_experts(out.router_logits, shape[1]))
        s.num_tokens += len(s.pending)
        if all_logits:
            return out.logits[0].to(device="cpu", dtype=torch.float32)
        return out.logits[0, -1].to(device="cpu", dtype=torch.float32)

    def has_work(self) -> bool:
        return any(not s.frozen for s in self._seqs.values())

    def num_running(self) -> int:
        """Every sequence held: stepping, waiting for a slot, or frozen."""
        return len(self._seqs)

    def freeze(self, seq_ids: Iterable[str]) -> BackendOp:
        for sid in seq_ids:
            if sid in self._seqs:
                self._seqs[sid].frozen = True
        return BackendOp.done("freeze")

    def thaw(self, seq_ids: Iterable[str]) -> BackendOp:
        for sid in seq_ids:
            if sid in self._seqs:
                self._seqs[sid].frozen = False
        return BackendOp.done("thaw")

    # ------------------------------------------------------------ misc

    def stats(self) -> dict[str, Any]:
        kv_tokens = sum(s.num_tokens for s in self._seqs.values())
        return {
            "kv_usage": min(1.0, kv_tokens / (self.capacity * self.max_model_len)),
            "kv_tokens": kv_tokens,
            "kv_bytes": self._kv_bytes(),
            "running": sum(1 for s in self._seqs.values() if not s.frozen),
            "frozen": sum(1 for s in self._seqs.values() if s.frozen),
            "steps": self._steps,
            "prefills": self._prefills,
            "device": str(self.device),
            "dtype": _dtype_name(self.dtype),
            "params": self._num_params,
            "threads": torch.get_num_threads(),
            "weights": self._weights_where,
            "sleeping": sorted(self._sleeping),
            "loras": self.loras(),
        }

    def wake_fd(self) -> int | None:
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._ops.shutdown(wait=False, cancel_futures=True)
        # A running op holds the model: give it a moment, then tear down anyway
        # (the process is exiting; the op's result is dropped).
        got = self._model_lock.acquire(timeout=2.0)
        if got:
            self._model_lock.release()
        self._seqs.clear()
        self._staged.clear()
        self._announced = None
        self._lora.clear()
        self._targets.clear()
        del self.model
        self._release_device_memory()


def _moe_shape(model: Any, device: torch.device) -> tuple[int, int, int]:
    """(moe_layers, top_k, num_experts) of an HF MoE model, the layer count
    from one probe forward (dense layers between MoE ones report no router)."""
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None)
    experts = next((getattr(cfg, n) for n in _EXPERT_KEYS if getattr(cfg, n, None)), None)
    if not top_k or not experts:
        raise BackendError(
            f"return_routed_experts: {type(model).__name__} is not a MoE model (its config names no "
            f"num_experts_per_tok / {' / '.join(_EXPERT_KEYS)})",
            field="return_routed_experts",
        )
    with torch.inference_mode():
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), output_router_logits=True)
    return len(out.router_logits or ()), int(top_k), int(experts)


_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _top_experts(router_logits: Any, top_k: int) -> Any:
    """Per layer [tokens, experts] router logits -> int32 [tokens, layers, top_k]
    (top-k of the logits = of the softmax the router takes it from)."""
    idx = [torch.topk(lg.float(), top_k, dim=-1).indices for lg in router_logits]
    return torch.stack(idx, dim=1).to(device="cpu", dtype=torch.int32).numpy()


def make_backend(model: str, **options: Any) -> TorchBackend:
    """Factory named in engine_node.backend.BACKENDS. Options: device="cpu",
    dtype="float32", capacity=64, max_model_len=4096, seed=0, threads=None
    (torch intra-op threads; None: 1 for a small model on CPU, else torch's default)."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise BackendError(f"torch backend: unknown option(s) {unknown}; accepted: {list(_OPTIONS)}")
    return TorchBackend(model, **options)
