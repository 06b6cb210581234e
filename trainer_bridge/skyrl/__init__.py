"""SkyRL on rollout-bus: `from trainer_bridge.skyrl import RolloutBusEngine` (importable without skyrl).

- engine.py: RolloutBusEngine, SkyRL's InferenceEngineInterface over the AsyncClient (its docstring maps
  every SkyRL call to what rollout-bus does).
- weights.py: SkyRL's weight-sync strategy on rollout-bus transports (get_transfer_strategy_cls).
- broadcast.py: SkyRL's own broadcast sync (weight_sync_backend="nccl") over vllm_nccl.
- chunks.py: SkyRL's CUDA IPC chunks and named tensors as (name, tensor) pairs.
- openai.py, tinker.py: OpenAI-shaped and Tinker-shaped requests and replies, without I/O.
- models.py: which model a call's `model=` names, without I/O.

Modules here import each other by their full path (trainer_bridge.skyrl.engine), never through this
package: it imports engine.py, so a submodule importing the package would be an import cycle.
"""

from trainer_bridge.skyrl.engine import TRANSPORT_OF_INIT_INFO, InferenceEngineBase, RolloutBusEngine

__all__ = ["TRANSPORT_OF_INIT_INFO", "InferenceEngineBase", "RolloutBusEngine"]
