"""The `vllm` backend (vLLM 0.24.0's engine core), one concern per file.

Node side (the engine node's process):
- backend.py: VllmBackend, the class `--backend vllm` loads (engine_node/backend.py's BACKENDS);
  its docstring holds the threads and ordering hazards every mixin below follows.
- startup.py: the environment vLLM's children need, EngineArgs, CUDA-graph sizes, the core client.
- engine_core.py: the node's end of vLLM's engine core (a SyncMPClient read without blocking).
- requests.py: SeqRequest -> EngineCoreRequest, engine-core batches -> StepOutputs.
- ops.py: control plumbing (VllmOps: `_op`, `_sweep`), the base of the mixins:
  data_path.py (add/step/abort, resume ramp, freeze/thaw), sleep.py (sleep/wake, caches, LoRA),
  weight_ops.py (weight updates: begin/receive/commit/abort).
- weights.py: the weight-update record, validation, zmq shared-memory staging.
- weight_reuse.py: what the node reuses from one update to the next (Validated, KeptIpc).
- transports.py: how each weight transport reaches the workers (VLLM_RECEIVERS).
- lora.py: adapter ids and PEFT folders.

Worker side (inside every vLLM worker process):
- worker_ext.py: RolloutBusWorkerExtension. vLLM imports it BY STRING
  (`worker_extension_cls`, startup.WORKER_EXT = "engine_node.backends.vllm.worker_ext.RolloutBusWorkerExtension"):
  moving or renaming it means changing that string (and the GPU tests that name it).
- worker_apply.py: writing a staged update into the model (plans vs load_weights).
- worker_ipc.py (cuda_ipc), worker_nccl.py (nccl), worker_packed.py (vllm_nccl): the receivers.
- worker_reuse.py: what a repeated update reuses inside a worker.
- weight_plan.py: the per-model copy plan learned from `load_weights`.
- fp8.py: bf16 weights into a quantized (fp8) model, in place.

Hazard: this package is `engine_node.backends.vllm`, not vLLM. Imports are absolute (`import vllm` is
vLLM); never put engine_node/backends/ on sys.path.
"""
