"""LoRA adapters for the vllm backend: name -> vLLM id, and PEFT folders
written from a trainer's tensors (vLLM loads adapters from folders only).

A reload of a loaded name keeps its id and is sent with load_inplace=True, so
requests naming the adapter keep working. Folders we wrote are removed when
replaced, unloaded, or on close.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from typing import Any


@dataclasses.dataclass
class Adapter:
    lora_id: int
    path: str
    wrote: str | None = None  # a folder we made (removed with the adapter)


def write_peft(root: str, model: str, name: str, tensors: list[tuple[str, Any]], config: dict[str, Any] | None) -> str:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    cfg = dict(config or {})
    if "r" not in cfg:
        cfg["r"] = next((int(t.shape[0]) for n, t in tensors if "lora_A" in n), 8)
    if "target_modules" not in cfg:
        cfg["target_modules"] = sorted({n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in tensors if ".lora_" in n})
    full = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "bias": "none",
        "lora_dropout": 0.0,
        "base_model_name_or_path": model,
        "lora_alpha": cfg.get("r", 8),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        **cfg,
    }
    d = os.path.join(root, f"lora_{name}_{uuid.uuid4().hex[:8]}")
    os.makedirs(d)
    sd = {}
    for n, t in tensors:
        key = n if n.startswith("base_model.model.") else "base_model.model." + n
        sd[key] = t.detach().to("cpu").contiguous().clone()
    save_file(sd, os.path.join(d, "adapter_model.safetensors"))
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump(full, f)
    return d


class LoraTable:
    def __init__(self) -> None:
        self.adapters: dict[str, Adapter] = {}
        self._next_id = 1

    def next_id(self, name: str) -> tuple[int, bool]:
        """(id, in place) for loading `name`."""
        a = self.adapters.get(name)
        return (a.lora_id, True) if a is not None else (self._next_id, False)

    def loaded(self, name: str, lora_id: int, path: str, wrote: str | None) -> None:
        old = self.adapters.get(name)
        if old is None:
            self._next_id = max(self._next_id, lora_id + 1)
        elif old.wrote and old.wrote != wrote:
            shutil.rmtree(old.wrote, ignore_errors=True)
        self.adapters[name] = Adapter(lora_id, path, wrote)

    def removed(self, name: str) -> None:
        a = self.adapters.pop(name, None)
        if a is not None and a.wrote:
            shutil.rmtree(a.wrote, ignore_errors=True)

    def names(self) -> list[str]:
        return sorted(self.adapters)
