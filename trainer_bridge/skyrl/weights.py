"""SkyRL's weight-sync strategy on rollout-bus transports.

OPTIONAL. SkyRL's policy workers send weights through a `WeightTransferStrategy`
chosen by `skyrl.backends.skyrl_train.weight_sync.get_transfer_strategy_cls`, and
both of SkyRL's own work with `RolloutBusEngine` as they are: its CUDA IPC
strategy (colocated, weight_sync_backend="nccl": start_weight_update /
update_weights_ipc / finish_weight_update) and its broadcast strategy (not
colocated: the engines join SkyRL's vLLM NCCL group, trainer_bridge/skyrl/broadcast.py).
SkyRL 0.3.0 has none for a trainer without CUDA: for that (or to use
rollout-bus's own transports instead), this one hands the chunks to
`RolloutBusEngine.update_named_weights` (one all-or-nothing update, version + 1
on every engine), over the transport SkyRL's config implies: colocated + nccl →
`cuda_ipc`, nccl → rollout-bus's `nccl`, anything else → `zmq`.

In the worker processes, replace `skyrl.backends.skyrl_train.weight_sync.get_transfer_strategy_cls`
with this module's `get_transfer_strategy_cls`. Every rank iterates the chunks (SkyRL's extractor
all-gathers inside the iterator); rank 0 keeps and sends them, so rank 0 holds
one full copy of the weights during the update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from bus.errors import Unsupported


@dataclasses.dataclass
class RolloutBusInitInfo:
    override_existing_receiver: bool = True
    transport: str = "zmq"


def _transport(ie_cfg: Any, colocate_all: bool) -> str:
    if getattr(ie_cfg, "weight_sync_backend", None) != "nccl":
        return "zmq"
    return "cuda_ipc" if colocate_all else "nccl"


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except ImportError:
        return 0


class WeightSender:
    """SkyRL's `WeightTransferSender` shape: `send_chunks`, `teardown`."""

    def __init__(self, init_info: RolloutBusInitInfo, inference_client: Any) -> None:
        self.init_info = init_info
        self.engine = inference_client  # a trainer_bridge.skyrl.RolloutBusEngine

    async def send_chunks(
        self, chunks: Iterable[Any], weight_metadata: dict[str, list] | None = None
    ) -> dict[str, Any] | None:
        keep = _rank() == 0
        named: list[tuple[str, Any]] = []
        for chunk in chunks:  # every rank: the iterator all-gathers
            if keep:
                named.extend(zip(chunk.names, chunk.tensors, strict=True))
        if not keep:
            return None
        await self.engine.init_weight_update_communicator(self.init_info)
        return await self.engine.update_named_weights(named)

    def teardown(self) -> None:
        pass


class RolloutBusTransferStrategy:
    """SkyRL's `WeightTransferStrategy` shape (factory methods on the class)."""

    colocated = False

    @classmethod
    def create_init_info(cls, ie_cfg: Any, inference_world_size: int | None = None) -> RolloutBusInitInfo:
        return RolloutBusInitInfo(transport=_transport(ie_cfg, cls.colocated))

    @staticmethod
    def get_vllm_transfer_engine() -> type:
        raise Unsupported(
            "rollout-bus engines receive weights themselves; there is no vLLM transfer engine to name", field="strategy"
        )

    @staticmethod
    def create_sender(init_info: RolloutBusInitInfo, inference_client: Any) -> WeightSender:
        return WeightSender(init_info, inference_client)


class ColocatedRolloutBusTransferStrategy(RolloutBusTransferStrategy):
    colocated = True


def get_transfer_strategy_cls(weight_sync_backend: str, colocate_all: bool) -> type:
    """Stands in for SkyRL's function of the same name (same arguments)."""
    return ColocatedRolloutBusTransferStrategy if colocate_all else RolloutBusTransferStrategy
