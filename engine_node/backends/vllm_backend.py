"""The `vllm` backend: vLLM 0.24.0's v1 engine (``AsyncLLM``) behind the backend protocol.

Threads: the engine node's loop thread calls the sync methods below; the
backend owns one more thread running an asyncio loop on which ``AsyncLLM``
lives (its output handler, one task per sequence). Sync methods submit
coroutines with ``asyncio.run_coroutine_threadsafe(...).result(timeout)``;
every wait has a deadline, and its error names the option that sets it.

Each added sequence runs one task: ``AsyncLLM.add_request`` (token prompt,
``SamplingParams(n=1, output_kind=DELTA, detokenize=False)``) then reads its
delta outputs into a thread-safe queue and makes ``wake_fd()`` readable;
``step()`` drains that queue (waiting up to ``step_wait_s`` when it is empty
but sequences run).

- freeze/thaw: ``freeze_granularity = "all"``: ``pause_generation(mode="keep",
  clear_cache=False)`` / ``resume_generation()``.
- abort: ``AsyncLLM.abort`` gives each request a final output (finish "abort")
  carrying the tokens not yet read; abort() returns every unread token with
  finish_reason None (the node parks and re-submits).
- sleep/wake_up: vLLM's sleep mode (``enable_sleep_mode=True``).
- weights: applied inside the workers (``vllm_worker_ext``), staged per update
  and loaded with ``model.load_weights`` on finish (all or nothing as far as
  names/shapes go: they are checked against the checkpoint at begin).
  Transports: ``zmq`` (CPU tensors → a file in /dev/shm → every worker),
  ``cuda_ipc`` (handles from ``trainer_bridge.gpu_transports.CudaIpcSender``),
  ``nccl`` (broadcast from ``trainer_bridge.gpu_transports.NcclSender``, rank 0).
- LoRA: ``LoRARequest`` by path; ``tensors=`` are written as a PEFT folder
  first; a reload of a loaded name uses ``load_inplace=True`` with the same id.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from engine_node.backend import BackendError, BackendInfo, SeqRequest, StepOutput

log = logging.getLogger("rollout_bus.vllm_backend")

WORKER_EXT = "engine_node.backends.vllm_worker_ext.RolloutBusWorkerExtension"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prepare_env() -> None:
    """Environment that vLLM's child processes need (set before vllm is imported)."""
    # Engine-core/worker processes must import our worker extension.
    pp = os.environ.get("PYTHONPATH", "")
    if _REPO_ROOT not in pp.split(os.pathsep):
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


@dataclass
class _Seq:
    seq: SeqRequest
    task: asyncio.Task | None = None
    registered: bool = False
    abort_pending: bool = False


@dataclass
class _Update:
    transport: str
    metas: list[list[Any]]
    bucket_sizes: list[int]
    args: dict[str, Any]
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    staged: list[tuple[str, Any]] = field(default_factory=list)  # zmq: CPU tensors
    received: bool = False


class _KvStats:
    """A vLLM stat logger that keeps the latest scheduler stats in `sink` (cheap)."""

    def __init__(self, sink: dict[str, Any]) -> None:
        self.sink = sink

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        if scheduler_stats is not None:
            self.sink.update({
                "kv_usage": float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0),
                "engine_running": int(getattr(scheduler_stats, "num_running_reqs", 0) or 0),
                "engine_waiting": int(getattr(scheduler_stats, "num_waiting_reqs", 0) or 0),
            })

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


class VllmBackend:
    freeze_granularity = "all"

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
        start_timeout_s: float = 900.0,
        rpc_timeout_s: float = 120.0,
        abort_timeout_s: float = 10.0,
        weight_timeout_s: float = 600.0,
        step_wait_s: float = 0.005,
        **passthrough: Any,
    ) -> None:
        _prepare_env()
        self.model = model
        self.tp = int(tp)
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.abort_timeout_s = float(abort_timeout_s)
        self.weight_timeout_s = float(weight_timeout_s)
        self.step_wait_s = float(step_wait_s)
        self.enable_lora = bool(enable_lora)

        # Output queue shared with the loop thread.
        self._cond = threading.Condition()
        self._out: collections.deque[tuple[str, list[int], list[float] | None, str | None]] = collections.deque()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._signaled = False

        self._live: set[str] = set()  # node-thread view: added, not yet finished/aborted
        self._seqs: dict[str, _Seq] = {}  # loop-thread state
        self._frozen = False  # the engine is paused (keep) for the sequences in _frozen_ids
        self._frozen_ids: set[str] = set()
        self._kv_stats: dict[str, Any] = {}
        self._sleep_level = 0
        self._update: _Update | None = None
        self._nccl_key: str | None = None
        self._loras: dict[str, tuple[int, str]] = {}  # name -> (lora_int_id, path)
        self._lora_dirs: dict[str, str] = {}  # name -> temp folder we wrote
        self._next_lora_id = 1
        self._tmp = tempfile.mkdtemp(prefix="rollout_bus_vllm_")
        self._ckpt_shapes: dict[str, list[int]] | None = None
        self._closed = False

        engine_kw: dict[str, Any] = dict(
            model=model,
            tensor_parallel_size=self.tp,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            dtype=dtype,
            seed=seed,
            worker_extension_cls=WORKER_EXT,
            disable_log_stats=True,
            enable_log_requests=False,
        )
        if enable_lora:
            engine_kw.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras)
        if attention_backend:
            engine_kw["attention_backend"] = attention_backend
        engine_kw.update(passthrough)
        self._engine_kw = engine_kw

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="vllm-backend-loop", daemon=True)
        self._thread.start()
        t0 = time.perf_counter()
        try:
            self.engine = self._call(self._create(), start_timeout_s, "start_timeout_s", "engine start")
        except BaseException:
            self._stop_loop()
            raise
        self.start_seconds = time.perf_counter() - t0
        self._info = self._make_info()
        log.info("vllm backend ready in %.1fs: %s", self.start_seconds, self._info)

    # ------------------------------------------------------------ loop plumbing
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def _call(self, coro: Any, timeout: float, knob: str, what: str) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout=timeout)
        except (concurrent.futures.TimeoutError, TimeoutError):
            fut.cancel()
            raise BackendError(f"vllm backend: {what} did not finish within {timeout}s "
                               f"(raise the backend option {knob})") from None

    async def _create(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self._engine_kw)
        # Constructed inside the running loop so its output handler starts here.
        sink = self._kv_stats
        return AsyncLLM.from_engine_args(args, stat_loggers=[lambda cfg, idx=0: _KvStats(sink)])

    async def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return await self.engine.collective_rpc(method, timeout=timeout, args=tuple(args))

    def rpc(self, method: str, *args: Any, timeout: float | None = None, knob: str = "rpc_timeout_s") -> list[Any]:
        """Run a worker-extension method on every worker; one result per worker."""
        t = self.rpc_timeout_s if timeout is None else timeout
        return self._call(self._rpc(method, *args, timeout=t), t + 5, knob, f"worker call {method}")

    def _make_info(self) -> BackendInfo:
        mc = self.engine.model_config
        vc = self.engine.vllm_config
        eos: list[int] = []
        for src in (getattr(mc.hf_config, "eos_token_id", None),
                    (mc.try_get_generation_config() or {}).get("eos_token_id") if hasattr(mc, "try_get_generation_config") else None):
            for e in (src if isinstance(src, (list, tuple)) else [src]):
                if isinstance(e, int) and e not in eos:
                    eos.append(e)
        tok = getattr(self.engine, "tokenizer", None)
        e = getattr(tok, "eos_token_id", None) if tok is not None else None
        if isinstance(e, int) and e not in eos:
            eos.append(e)
        return BackendInfo(
            backend="vllm",
            model=self.model,
            vocab_size=int(mc.get_vocab_size()),
            eos_token_ids=eos,
            capacity=int(vc.scheduler_config.max_num_seqs),
            max_model_len=int(mc.max_model_len),
            tp=int(vc.parallel_config.tensor_parallel_size),
            pp=int(vc.parallel_config.pipeline_parallel_size),
        )

    def info(self) -> BackendInfo:
        return self._info

    # ------------------------------------------------------------ outputs
    def _push(self, seq_id: str, toks: list[int], lps: list[float] | None, finish: str | None) -> None:
        with self._cond:
            self._out.append((seq_id, toks, lps, finish))
            self._cond.notify_all()
            if not self._signaled:
                self._signaled = True
                try:
                    os.write(self._wfd, b"\x01")
                except BlockingIOError:
                    pass

    def _take(self, only: set[str] | None = None) -> list[tuple[str, list[int], list[float] | None, str | None]]:
        """Pop queued outputs (all, or those of `only`). Caller holds no lock."""
        with self._cond:
            if only is None:
                items = list(self._out)
                self._out.clear()
            else:
                items = [o for o in self._out if o[0] in only]
                rest = [o for o in self._out if o[0] not in only]
                self._out.clear()
                self._out.extend(rest)
            if not self._out and self._signaled:
                self._signaled = False
                try:
                    while os.read(self._rfd, 4096):
                        pass
                except BlockingIOError:
                    pass
        return items

    @staticmethod
    def _merge(items: list[tuple[str, list[int], list[float] | None, str | None]]) -> dict[str, StepOutput]:
        merged: dict[str, StepOutput] = {}
        for sid, toks, lps, fin in items:
            o = merged.get(sid)
            if o is None:
                o = merged[sid] = StepOutput(seq_id=sid, token_ids=[], logprobs=[] if lps is not None else None)
            o.token_ids.extend(toks)
            if lps is not None:
                if o.logprobs is None:
                    o.logprobs = []
                o.logprobs.extend(lps)
            if fin is not None:
                o.finish_reason = fin
        return merged

    # ------------------------------------------------------------ requests
    def _sampling_params(self, seq: SeqRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = seq.params
        max_new = int(seq.max_new_tokens)
        room = self._info.max_model_len - len(seq.prompt)
        if room < 1:
            raise BackendError(f"prompt of {len(seq.prompt)} tokens leaves no room in max_model_len={self._info.max_model_len}")
        return SamplingParams(
            n=1,
            max_tokens=min(max_new, room),
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            top_k=max(0, int(p.top_k)),  # vLLM 0.24: 0 disables (-1 also accepted)
            seed=seq.seed,
            stop_token_ids=list(p.stop_token_ids),
            ignore_eos=bool(p.ignore_eos),
            logprobs=0 if p.logprobs else None,  # 0: the sampled token's logprob only
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )

    def _lora_request(self, name: str | None) -> Any:
        if name is None:
            return None
        if name not in self._loras:
            raise BackendError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._loras)})")
        from vllm.lora.request import LoRARequest

        lid, path = self._loras[name]
        return LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path)

    def add(self, seq: SeqRequest) -> None:
        if seq.seq_id in self._live:
            raise BackendError(f"sequence {seq.seq_id!r} is already running")
        sp = self._sampling_params(seq)
        lr = self._lora_request(seq.lora)
        self._live.add(seq.seq_id)
        self._loop.call_soon_threadsafe(self._start_seq, seq, sp, lr)

    def _start_seq(self, seq: SeqRequest, sp: Any, lr: Any) -> None:
        st = _Seq(seq)
        self._seqs[seq.seq_id] = st
        st.task = self._loop.create_task(self._run_seq(st, sp, lr))

    async def _run_seq(self, st: _Seq, sp: Any, lr: Any) -> None:
        from vllm.inputs import TokensPrompt

        sid = st.seq.seq_id
        want_lp = sp.logprobs is not None
        q = None
        finished = False
        try:
            if st.abort_pending:
                self._push(sid, [], None, "abort")
                finished = True
                return
            q = await self.engine.add_request(sid, TokensPrompt(prompt_token_ids=list(st.seq.prompt)), sp,
                                              lora_request=lr)
            st.registered = True
            if st.abort_pending:
                await self.engine.abort(sid)
            while not finished:
                out = q.get_nowait() or await q.get()
                finished = out.finished
                c = out.outputs[0] if out.outputs else None
                toks = list(c.token_ids) if c is not None else []
                lps = None
                if want_lp and c is not None:
                    lps = []
                    src = c.logprobs or []
                    for i, t in enumerate(toks):
                        try:
                            lps.append(float(src[i][t].logprob))
                        except (IndexError, KeyError, TypeError):
                            lps.append(float("nan"))
                fin = (c.finish_reason if c is not None else None) if finished else None
                if finished and fin is None:
                    fin = "abort"
                self._push(sid, toks, lps, fin)
        except asyncio.CancelledError:
            if q is not None and not finished:
                try:
                    await self.engine.abort(sid)
                except Exception:  # noqa: BLE001
                    pass
            if not finished:
                self._push(sid, [], None, "abort")
            raise
        except Exception as e:  # noqa: BLE001
            log.exception("vllm sequence %s failed", sid)
            self._push(sid, [], None, "error")
            self._errors = getattr(self, "_errors", [])
            self._errors.append(f"{sid}: {type(e).__name__}: {e}")
        finally:
            if q is not None:
                q.close()
            self._seqs.pop(sid, None)

    def step(self) -> list[StepOutput]:
        items = self._take()
        if not items and self.has_work():
            with self._cond:
                if not self._out:
                    self._cond.wait(self.step_wait_s)
            items = self._take()
        merged = self._merge(items)
        outs = []
        for sid, o in merged.items():
            if sid not in self._live:
                continue  # already returned by abort()
            if o.finish_reason is not None:
                self._live.discard(sid)
                if o.finish_reason not in ("stop", "length"):
                    log.warning("vllm ended sequence %s with %r", sid, o.finish_reason)
            outs.append(o)
        return outs

    def has_work(self) -> bool:
        # Unread output counts too: wake_fd stays readable until step() drains it.
        return (bool(self._live) and not self._frozen) or bool(self._out)

    def num_running(self) -> int:
        return len(self._live)

    def abort(self, seq_ids: Iterable[str]) -> list[StepOutput]:
        ids = [s for s in seq_ids if s in self._live]
        if not ids:
            return []
        self._call(self._abort_many(ids), self.abort_timeout_s + 5, "abort_timeout_s", "abort")
        merged = self._merge(self._take(set(ids)))
        outs = []
        for sid in ids:
            self._live.discard(sid)
            self._frozen_ids.discard(sid)
            o = merged.get(sid)
            if o is not None and o.token_ids:
                o.finish_reason = None  # the node parks it; a natural finish it sees from the tokens
                outs.append(o)
        self._maybe_unfreeze()
        return outs

    async def _abort_many(self, ids: list[str]) -> None:
        tasks = []
        registered = []
        for sid in ids:
            st = self._seqs.get(sid)
            if st is None:
                continue
            st.abort_pending = True
            if st.registered:
                registered.append(sid)
            if st.task is not None and not st.task.done():
                tasks.append(st.task)
        if registered:
            await self.engine.abort(registered)
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=self.abort_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2.0)

    # ------------------------------------------------------------ pause (keep)
    def freeze(self, seq_ids: Iterable[str]) -> None:
        """Granularity "all": the whole engine pauses (vLLM pause_generation(mode="keep"));
        it resumes when every frozen sequence is thawed or aborted."""
        ids = {s for s in seq_ids if s in self._live}
        if not ids:
            return
        self._frozen_ids |= ids
        if not self._frozen:
            t0 = time.perf_counter()
            self._call(self.engine.pause_generation(mode="keep", clear_cache=False), self.rpc_timeout_s,
                       "rpc_timeout_s", "pause_generation(keep)")
            self.last_freeze_seconds = time.perf_counter() - t0
            self._frozen = True

    def thaw(self, seq_ids: Iterable[str]) -> None:
        self._frozen_ids -= set(seq_ids)
        self._maybe_unfreeze()

    def _maybe_unfreeze(self) -> None:
        if self._frozen and not self._frozen_ids and self._sleep_level == 0:
            self._call(self.engine.resume_generation(), self.rpc_timeout_s, "rpc_timeout_s", "resume_generation")
            self._frozen = False

    # ------------------------------------------------------------ memory
    def _gpu_free(self) -> int:
        try:
            return sum(int(r["gpu_free"]) for r in self.rpc("rollout_bus_info"))
        except Exception:  # noqa: BLE001
            return -1

    def sleep(self, level: int) -> dict[str, Any]:
        if self._live:
            raise BackendError(f"sleep with {len(self._live)} live sequence(s): pause(mode='abort') them first")
        free0 = self._gpu_free()
        t0 = time.perf_counter()
        self._call(self.engine.sleep(level=int(level), mode="abort"), self.rpc_timeout_s, "rpc_timeout_s", "sleep")
        dt = time.perf_counter() - t0
        free1 = self._gpu_free()
        self._sleep_level = int(level)
        return {"backend_seconds": round(dt, 4), "gpu_freed_bytes": free1 - free0 if free0 >= 0 and free1 >= 0 else None}

    def wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        self._call(self.engine.wake_up(tags), self.rpc_timeout_s, "rpc_timeout_s", "wake_up")
        dt = time.perf_counter() - t0
        if tags is None or {"weights", "kv_cache"} <= set(tags):
            self._sleep_level = 0
        if self._frozen:  # vLLM resumes its scheduler when fully awake: keep the freeze
            self._call(self.engine.pause_generation(mode="keep", clear_cache=False), self.rpc_timeout_s,
                       "rpc_timeout_s", "pause_generation(keep)")
        return {"backend_seconds": round(dt, 4)}

    def reset_prefix_cache(self) -> None:
        self._call(self.engine.reset_prefix_cache(), self.rpc_timeout_s, "rpc_timeout_s", "reset_prefix_cache")

    # ------------------------------------------------------------ weights
    def _checkpoint_shapes(self) -> dict[str, list[int]]:
        """Tensor names/shapes of the model's checkpoint (safetensors headers); {} if unknown."""
        if self._ckpt_shapes is not None:
            return self._ckpt_shapes
        shapes: dict[str, list[int]] = {}
        path = self.model
        if not os.path.isdir(path):
            try:
                from huggingface_hub import snapshot_download

                path = snapshot_download(self.model, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
            except Exception:  # noqa: BLE001
                path = ""
        try:
            from safetensors import safe_open

            for fn in sorted(os.listdir(path)) if path else []:
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(path, fn), framework="pt") as f:
                        for k in f.keys():
                            shapes[k] = list(f.get_slice(k).get_shape())
        except Exception:  # noqa: BLE001
            shapes = {}
        self._ckpt_shapes = shapes
        return shapes

    def _validate(self, metas: list[list[Any]]) -> None:
        from engine_node.backends.vllm_worker_ext import torch_dtype

        shapes = self._checkpoint_shapes()
        tied = bool(getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False))
        for name, dtype, shape, _b, _o, nbytes in metas:
            try:
                dt = torch_dtype(dtype)
            except ValueError:
                raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}") from None
            import math

            import torch

            if nbytes != math.prod(shape) * torch.empty((), dtype=dt).element_size():
                raise ValueError(f"tensor {name!r}: nbytes {nbytes} does not match shape {shape} × {dtype}")
            if not shapes:
                continue
            if name not in shapes:
                if tied and name == "lm_head.weight":
                    continue
                raise ValueError(f"tensor {name!r} is not a weight of {self.model}")
            if list(shape) != shapes[name]:
                raise ValueError(f"tensor {name!r}: shape {list(shape)} != the model's {shapes[name]}")

    def begin_weight_update(self, transport: str, tensors: list[Any], args: dict[str, Any]) -> None:
        if transport not in ("zmq", "cuda_ipc", "nccl"):
            raise BackendError(f"vllm backend: unknown transport {transport!r} (zmq, cuda_ipc, nccl)")
        if self._update is not None:
            self.abort_weight_update()
        metas = []
        for t in tensors:
            if isinstance(t, dict):
                metas.append([t["name"], t["dtype"], list(t["shape"]), int(t["bucket"]), int(t["offset"]), int(t["nbytes"])])
            else:
                metas.append([t.name, t.dtype, list(t.shape), int(t.bucket), int(t.offset), int(t.nbytes)])
        self._validate(metas)
        # The backend protocol does not pass bucket_sizes: use transport_args' when given, else
        # derive them as bus.tensors.plan_buckets makes them (end of the last tensor, 256-aligned).
        sizes = list(args.get("bucket_sizes") or [])
        if not sizes:
            from bus.tensors import _ALIGN

            nb = 1 + max((m[3] for m in metas), default=-1)
            sizes = [0] * nb
            for m in metas:
                sizes[m[3]] = max(sizes[m[3]], (m[4] + m[5] + _ALIGN - 1) // _ALIGN * _ALIGN)
        up = _Update(transport=transport, metas=metas, bucket_sizes=[int(s) for s in sizes], args=dict(args))
        if transport != "zmq":
            self.rpc("rollout_bus_begin", up.uid, metas)
        self._update = up

    def stage_weights(self, named: list[tuple[str, Any]]) -> None:
        up = self._require_update("zmq")
        # The node's tensors are views of zmq frames: copy what we keep.
        up.staged.extend((n, t.clone()) for n, t in named)

    def _require_update(self, transport: str | None = None) -> _Update:
        if self._update is None:
            raise BackendError("no weight update in progress (begin_weight_update first)")
        if transport is not None and self._update.transport != transport:
            raise BackendError(f"weight update uses transport {self._update.transport!r}, not {transport!r}")
        return self._update

    def _ensure_nccl(self, a: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's NCCL group (trainer = rank 0, hosts a TCPStore at host:port).
        Ranks: transport_args' rank_offset, else reserved from the store's counter."""
        key = str(a.get("group_id") or f"{a['host']}:{a['port']}")
        if self._nccl_key == key:
            return {"reused": True}
        offset = a.get("rank_offset")
        if offset is None:
            from datetime import timedelta

            from torch.distributed import TCPStore

            store = TCPStore(a["host"], int(a["port"]), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=self.weight_timeout_s), use_libuv=False)
            offset = int(store.add(f"rollout_bus/{key}/next_rank", self.tp)) - self.tp + 1
            del store
        t = float(a.get("timeout_s", self.weight_timeout_s))
        res = self.rpc("rollout_bus_nccl_init", key, a["host"], int(a["port"]), int(a["world_size"]), int(offset), t,
                       timeout=t, knob="weight_timeout_s")
        self._nccl_key = key
        return {"reused": False, "ranks": [r["rank"] for r in res]}

    def receive_weights(self, update_id: str, handles: list[Any]) -> dict[str, Any]:
        up = self._require_update()
        t0 = time.perf_counter()
        extra: dict[str, Any] = {}
        if up.transport == "cuda_ipc":
            if len(handles) != len(up.bucket_sizes):
                raise BackendError(f"cuda_ipc: {len(handles)} handle(s) for {len(up.bucket_sizes)} bucket(s)")
            res = self.rpc("rollout_bus_recv_ipc", up.uid, list(handles), timeout=self.weight_timeout_s,
                           knob="weight_timeout_s")
        elif up.transport == "nccl":
            extra["nccl"] = self._ensure_nccl(up.args)
            res = self.rpc("rollout_bus_recv_nccl", up.uid, up.bucket_sizes, timeout=self.weight_timeout_s,
                           knob="weight_timeout_s")
        else:
            raise BackendError("receive_weights is for the GPU transports (cuda_ipc, nccl); zmq stages buckets")
        up.received = True
        dt = time.perf_counter() - t0
        nbytes = int(sum(up.bucket_sizes))
        return {"bytes": nbytes, "backend_seconds": round(dt, 4), "GBps": round(nbytes / dt / 1e9, 3) if dt > 0 else None,
                "worker_seconds": [round(r["seconds"], 4) for r in res], **extra}

    def finish_weight_update(self) -> None:
        up = self._require_update()
        path = None
        try:
            if up.transport == "zmq":
                import torch

                shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else self._tmp
                path = os.path.join(shm, f"rollout_bus_{os.getpid()}_{up.uid}.pt")
                torch.save([(n, t) for n, t in up.staged], path)
                self.rpc("rollout_bus_begin", up.uid, up.metas)
                self.rpc("rollout_bus_finish", up.uid, path, timeout=self.weight_timeout_s, knob="weight_timeout_s")
            else:
                if not up.received:
                    raise BackendError("finish before receive_weights")
                self.rpc("rollout_bus_finish", up.uid, None, timeout=self.weight_timeout_s, knob="weight_timeout_s")
        finally:
            self._update = None
            if path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.reset_prefix_cache()

    def abort_weight_update(self) -> None:
        up, self._update = self._update, None
        if up is not None and up.transport != "zmq":
            try:
                self.rpc("rollout_bus_abort", up.uid)
            except Exception:  # noqa: BLE001
                log.exception("rollout_bus_abort failed")

    # ------------------------------------------------------------ LoRA
    def _write_peft(self, name: str, tensors: list[tuple[str, Any]], config: dict[str, Any] | None) -> str:
        import torch
        from safetensors.torch import save_file

        cfg = dict(config or {})
        if "r" not in cfg:
            for n, t in tensors:
                if "lora_A" in n:
                    cfg["r"] = int(t.shape[0])
                    break
        if "target_modules" not in cfg:
            mods = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in tensors if ".lora_" in n})
            cfg["target_modules"] = mods
        full = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0,
            "base_model_name_or_path": self.model, "lora_alpha": cfg.get("r", 8), "fan_in_fan_out": False,
            "modules_to_save": None, "use_rslora": False, "use_dora": False,
        }
        full.update(cfg)
        d = os.path.join(self._tmp, f"lora_{name}_{uuid.uuid4().hex[:8]}")
        os.makedirs(d)
        sd = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors}
        for k in list(sd):
            if not k.startswith("base_model.model."):
                sd["base_model.model." + k] = sd.pop(k)
        save_file(sd, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump(full, f)
        del torch
        return d

    def load_lora(self, name: str, *, path: str | None = None, tensors: list[tuple[str, Any]] | None = None,
                  config: dict[str, Any] | None = None) -> None:
        if not self.enable_lora:
            raise BackendError("this vllm engine was started without LoRA (backend option enable_lora=True)")
        if (path is None) == (tensors is None):
            raise BackendError("load_lora needs exactly one of path or tensors")
        from vllm.lora.request import LoRARequest

        wrote = None
        if tensors is not None:
            path = wrote = self._write_peft(name, tensors, config)
        inplace = name in self._loras
        lid = self._loras[name][0] if inplace else self._next_lora_id
        req = LoRARequest(lora_name=name, lora_int_id=lid, lora_path=path, load_inplace=inplace)
        ok = self._call(self.engine.add_lora(req), self.rpc_timeout_s, "rpc_timeout_s", f"add_lora({name})")
        if not ok and not inplace:
            raise BackendError(f"vLLM refused LoRA adapter {name!r} from {path}")
        if not inplace:
            self._next_lora_id += 1
        self._loras[name] = (lid, path)
        old = self._lora_dirs.pop(name, None)
        if old and old != wrote:
            shutil.rmtree(old, ignore_errors=True)
        if wrote:
            self._lora_dirs[name] = wrote

    def unload_lora(self, name: str) -> None:
        if name not in self._loras:
            raise BackendError(f"LoRA adapter {name!r} is not loaded")
        lid, _ = self._loras.pop(name)
        self._call(self.engine.remove_lora(lid), self.rpc_timeout_s, "rpc_timeout_s", f"remove_lora({name})")
        d = self._lora_dirs.pop(name, None)
        if d:
            shutil.rmtree(d, ignore_errors=True)

    def loras(self) -> list[str]:
        return sorted(self._loras)

    # ------------------------------------------------------------ misc
    def stats(self) -> dict[str, Any]:
        s = {"kv_usage": 0.0, **self._kv_stats}
        s["sleep_level"] = self._sleep_level
        s["frozen"] = self._frozen
        return s

    def wake_fd(self) -> int | None:
        return self._rfd

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def _shutdown() -> None:
            for st in list(self._seqs.values()):
                if st.task is not None:
                    st.task.cancel()
            await asyncio.sleep(0)
            self.engine.shutdown()
            for _ in range(3):  # let the cancellations it scheduled run before the loop stops
                await asyncio.sleep(0)

        try:
            if hasattr(self, "engine"):
                self._call(_shutdown(), 60, "close", "engine shutdown")
        except Exception:  # noqa: BLE001
            log.exception("vllm engine shutdown failed")
        finally:
            self._stop_loop()
            for fd in (self._rfd, self._wfd):
                try:
                    os.close(fd)
                except OSError:
                    pass
            shutil.rmtree(self._tmp, ignore_errors=True)


def make_backend(model: str, **options: Any) -> VllmBackend:
    return VllmBackend(model, **options)
