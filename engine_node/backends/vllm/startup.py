"""Starting the `vllm` backend's engine: the environment vLLM's child
processes need, the EngineArgs fields, CUDA-graph sizes, the resume ramp's
budget, the engine core client and CPU placement. Called once, in order, by
VllmBackend.__init__."""

from __future__ import annotations

import os
import sys
from typing import Any

import structlog

from engine_node import cpu_placement
from engine_node.backend import BackendError, BackendTimeout
from engine_node.child_watch import export_node_pid

log = structlog.get_logger("rollout_bus.vllm_backend")

WORKER_EXT = "engine_node.backends.vllm.worker_ext.RolloutBusWorkerExtension"
_REPO_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # above engine_node/backends/vllm/


def prepare_env() -> None:
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
    # The engine's processes die with this one: vllm/worker_ext arms the watch
    # in every worker (engine_node/child_watch.py). Call on the spawning thread.
    export_node_pid()


def engine_kwargs(
    model: str,
    *,
    tp: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    enforce_eager: bool,
    enable_lora: bool,
    max_lora_rank: int,
    max_loras: int,
    enable_sleep_mode: bool,
    dtype: str,
    seed: int,
    attention_backend: str | None,
    passthrough: dict[str, Any],
) -> dict[str, Any]:
    """vLLM's EngineArgs fields for this backend (any passthrough field wins)."""
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
    return engine_kw


def make_core_client(api: Any, cfg: Any, log_stats: bool) -> Any:
    """vLLM's engine core client (the core in its own process), errors as BackendErrors."""
    try:
        return api.make_client(cfg, bool(log_stats))
    except TimeoutError:
        raise BackendTimeout(
            "vLLM engine start", float(os.environ["VLLM_ENGINE_READY_TIMEOUT_S"]), "start_timeout_s"
        ) from None
    except Exception as e:
        raise BackendError(f"the vLLM engine failed to start: {type(e).__name__}: {e}") from e


def place_cpus(cpu_affinity: str) -> dict[str, Any]:
    """ "auto": the engine core (and TP workers) get a physical core each,
    this node stays off them (engine_node/cpu_placement.py says why)."""
    placement: dict[str, Any] = {"cpu_affinity": "off"}
    if cpu_affinity not in ("off", "", None):
        try:
            placement = cpu_placement.apply(str(cpu_affinity))
        except Exception as e:  # placement is an optimisation: never fatal
            log.warning("cpu_affinity_failed", error=repr(e))
            placement = {"cpu_affinity": "failed", "error": repr(e)[:200]}
    return placement


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


def ramp_budget(value: int | str, cfg: Any) -> int:
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
