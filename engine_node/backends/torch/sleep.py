"""Sleep, wake-up, prefix cache and LoRA of the `torch` backend (levels and
what they drop: torch/backend.py's docstring); the heavy parts run as long ops."""

from __future__ import annotations

from typing import Any

import torch

from engine_node.backend import BackendError, BackendOp
from engine_node.backends.torch.ops import TorchOps
from engine_node.lora_local import build_adapter, read_peft_folder
from engine_node.tiny_model import hf_quiet

_TAGS = ("weights", "kv_cache")


class TorchSleepAndLora(TorchOps):
    def sleep(self, level: int) -> BackendOp:
        if level not in (1, 2):
            return BackendOp.failed("sleep", BackendError(f"sleep level must be 1 or 2, got {level}", field="level"))
        return self._long_op("sleep", self._sleep, level)

    def _sleep(self, level: int) -> dict[str, Any]:
        """Release memory. The node parks every sequence first; sleeping with
        sequences held is refused rather than silently dropping them."""
        if self._seqs:
            raise BackendError(f"cannot sleep with {len(self._seqs)} sequences held; abort them first")
        kv = self._kv_bytes()  # 0 here: no sequences, so no caches
        freed, weights = kv, "kept"
        if level == 2 and self._weights_where != "discarded":
            freed += self._weight_bytes()
            self._discard_weights()
            weights = "discarded"
        elif level == 1 and self.device.type != "cpu" and self._weights_where == "device":
            freed += self._weight_bytes()
            self.model.to("cpu")
            self._weights_where, weights = "host", "offloaded"
        elif self._weights_where != "device":
            weights = self._weights_where
        self._sleeping.update(_TAGS)
        self._release_device_memory()
        return {"level": level, "freed_bytes": freed, "kv_bytes": kv, "weights": weights, "device": str(self.device)}

    def _discard_weights(self) -> None:
        # Replace each Parameter's storage, keeping the Parameter objects: tied
        # aliases, LoRA hooks and self._targets keep pointing at them.
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._weights_where = "discarded"

    def wake_up(self, tags: list[str] | None) -> BackendOp:
        wanted = set(_TAGS if tags is None else tags)
        unknown = wanted - set(_TAGS)
        if unknown:
            return BackendOp.failed(
                "wake_up",
                BackendError(f"unknown wake_up tags {sorted(unknown)}; choose from {list(_TAGS)}", field="tags"),
            )
        return self._long_op("wake_up", self._wake_up, wanted)

    def _wake_up(self, wanted: set[str]) -> dict[str, Any]:
        restored = 0
        if "weights" in wanted and self._weights_where != "device":
            restored += self._restore_weights()
        # KV caches are allocated per sequence on demand: nothing to restore.
        self._sleeping -= wanted
        return {"restored_bytes": restored, "woken": sorted(wanted), "sleeping": sorted(self._sleeping)}

    def _restore_weights(self) -> int:
        if self._weights_where == "host":
            self.model.to(self.device)
        else:
            self._reload_checkpoint()
        self._weights_where = "device"
        return self._weight_bytes()

    def _reload_checkpoint(self) -> None:
        """Refill the discarded Parameters from the checkpoint on disk. Loading
        through from_pretrained (not raw safetensors) keeps transformers' own
        key conversions and tied-weight handling."""
        from transformers import AutoModelForCausalLM

        with hf_quiet():
            fresh = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        src = dict(fresh.named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.data = src[name].data.to(self.device)
        del fresh, src
        self._release_device_memory()

    def load_lora(
        self,
        name: str,
        *,
        path: str | None = None,
        tensors: list[tuple[str, Any]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> BackendOp:
        """Load or replace adapter `name`. A replacement is built and checked
        completely before it swaps in; running sequences of `name` use it from
        their next step (their KV so far stays)."""
        if (path is None) == (tensors is None):
            return BackendOp.failed(
                "load_lora", BackendError(f"load_lora {name!r}: give exactly one of path or tensors", field="path")
            )
        return self._long_op("load_lora", self._load_lora, name, path, tensors, config)

    def _load_lora(self, name: str, path: str | None, tensors: Any, config: dict[str, Any] | None) -> dict[str, Any]:
        if path is not None:
            tensors, file_config = read_peft_folder(path)
            config = {**file_config, **(config or {})}
        assert tensors is not None
        self._lora.put(build_adapter(name, tensors, config, self.model))
        return {}

    def unload_lora(self, name: str) -> BackendOp:
        return self._long_op("unload_lora", self._unload_lora, name)

    def _unload_lora(self, name: str) -> dict[str, Any]:
        if name not in self._lora.adapters:
            raise BackendError(f"lora {name!r} is not loaded", field="name")
        users = sum(1 for s in list(self._seqs.values()) if s.req.lora == name)
        if users:
            raise BackendError(f"lora {name!r} is used by {users} running sequences; abort or finish them first")
        self._lora.remove(name)
        return {}

    def loras(self) -> list[str]:
        return sorted(self._lora.adapters)
