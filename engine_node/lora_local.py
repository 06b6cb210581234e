"""LoRA for the torch backend, without peft.

An adapter is {module name: (A [r, in], B [out, r])} plus one `scaling`
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA). It is applied by a
forward hook on each targeted `nn.Linear` that adds `((x @ A.T) @ B.T) * scaling`
(PEFT's own order of operations) to the module's output, for whichever adapter
is *active*. The backend runs each sequence's forward inside `hooks.active(name)`,
so one step can mix sequences of different adapters (and none).

Accepted tensor names are PEFT's: `base_model.model.<module>.lora_A.weight`,
the same without the `base_model.model.` prefix, and with an adapter name
before `.weight` (`…lora_A.default.weight`, as in an unsaved PeftModel).

Ownership: `LoraHooks` belongs to the backend's thread; `active()` flips plain
attributes and is not thread-safe (one forward at a time, like the backend).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from engine_node.backend import BackendError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_PEFT_PREFIX = "base_model.model."
# <module>.lora_A[.<adapter name>].weight
_NAME_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclasses.dataclass
class LoraAdapter:
    name: str
    r: int
    alpha: float
    scaling: float
    # module name -> (A [r, in_features], B [out_features, r]), on the model's device/dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_peft_folder(path: str) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """(tensors, config) of a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors)."""
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "adapter_config.json")
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(cfg_path):
        raise BackendError(f"LoRA folder {path!r} has no adapter_config.json")
    if not os.path.isfile(st_path):
        raise BackendError(f"LoRA folder {path!r} has no adapter_model.safetensors")
    with open(cfg_path) as f:
        config = json.load(f)
    return list(load_file(st_path).items()), config


def _check_config(name: str, config: dict[str, Any]) -> None:
    """Refuse PEFT features this implementation would silently get wrong."""
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise BackendError(f"LoRA {name!r}: peft_type {peft_type!r} is not supported (LORA only)")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise BackendError(f"LoRA {name!r}: {key}=true is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise BackendError(f"LoRA {name!r}: {key} is not supported")
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise BackendError(f"LoRA {name!r}: bias={bias!r} is not supported (only 'none')")


def _targets_match(targets: Any, module: str) -> bool:
    """PEFT semantics: a str is a regex over the full module name; a list
    matches a module whose name ends with one of its entries."""
    if targets is None:
        targets = DEFAULT_TARGETS
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _resolve_module(raw: str, linears: dict[str, nn.Linear]) -> str | None:
    """Map a tensor's module path to one of the model's Linear names."""
    if raw.startswith(_PEFT_PREFIX):
        raw = raw[len(_PEFT_PREFIX) :]
    for cand in (raw, "model." + raw):
        if cand in linears:
            return cand
    return None


def _group_tensors(
    name: str, tensors: list[tuple[str, Any]], linears: dict[str, nn.Linear]
) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {"A": tensor, "B": tensor}} from PEFT-named tensors."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for tname, value in tensors:
        m = _NAME_RE.match(tname)
        if m is None:
            raise BackendError(f"LoRA {name!r}: tensor {tname!r} is not a lora_A/lora_B weight")
        module = _resolve_module(m.group("module"), linears)
        if module is None:
            raise BackendError(f"LoRA {name!r}: tensor {tname!r} names no Linear module of the model")
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        slot = grouped.setdefault(module, {})
        if m.group("ab") in slot:
            raise BackendError(f"LoRA {name!r}: tensor {tname!r} given twice")
        slot[m.group("ab")] = t
    return grouped


def build_adapter(
    name: str,
    tensors: list[tuple[str, Any]],
    config: dict[str, Any] | None,
    model: nn.Module,
) -> LoraAdapter:
    """Validate PEFT-format tensors against `model` and make an adapter on the
    model's device and dtype. Raises BackendError naming the bad tensor."""
    config = dict(config or {})
    _check_config(name, config)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    grouped = _group_tensors(name, tensors, linears)
    if not grouped:
        raise BackendError(f"LoRA {name!r}: no tensors")
    targets = config.get("target_modules")
    ranks = set()
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(grouped.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise BackendError(f"LoRA {name!r}: module {module!r} has no lora_{missing} weight")
        if targets is not None and not _targets_match(targets, module):
            raise BackendError(f"LoRA {name!r}: module {module!r} is not in target_modules {targets!r}")
        lin = linears[module]
        a, b = ab["A"], ab["B"]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or a.shape[1] != lin.in_features:
            raise BackendError(
                f"LoRA {name!r}: {module}.lora_A has shape {list(a.shape)}, expected [r, {lin.in_features}]"
            )
        if b.dim() != 2 or tuple(b.shape) != (lin.out_features, r):
            raise BackendError(
                f"LoRA {name!r}: {module}.lora_B has shape {list(b.shape)}, expected [{lin.out_features}, {r}]"
            )
        ranks.add(r)
        w = lin.weight
        # Copies: the caller's tensors may be views of a receive buffer it reuses.
        weights[module] = (
            a.detach().to(device=w.device, dtype=w.dtype, copy=True),
            b.detach().to(device=w.device, dtype=w.dtype, copy=True),
        )
    if len(ranks) != 1:
        raise BackendError(f"LoRA {name!r}: modules have different ranks {sorted(ranks)}")
    r = ranks.pop()
    if "r" in config and int(config["r"]) != r:
        raise BackendError(f"LoRA {name!r}: config r={config['r']} but the tensors have rank {r}")
    alpha = float(config.get("lora_alpha", 8))  # PEFT's default
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return LoraAdapter(name=name, r=r, alpha=alpha, scaling=scaling, weights=weights)


class LoraHooks:
    """The loaded adapters of one model, and the forward hooks that apply the
    active one. Hooks exist only on modules some loaded adapter targets."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._modules = dict(model.named_modules())
        self.adapters: dict[str, LoraAdapter] = {}
        self._handles: dict[str, Any] = {}
        self._active: LoraAdapter | None = None

    def put(self, adapter: LoraAdapter) -> None:
        """Load, or replace in place (the next forward uses the new weights)."""
        self.adapters[adapter.name] = adapter
        self._sync_hooks()

    def remove(self, name: str) -> None:
        del self.adapters[name]
        self._sync_hooks()

    def clear(self) -> None:
        self.adapters.clear()
        self._sync_hooks()

    @contextmanager
    def active(self, name: str | None) -> Iterator[None]:
        """Apply adapter `name` (None: the base model) to forwards inside."""
        prev = self._active
        self._active = self.adapters[name] if name is not None else None
        try:
            yield
        finally:
            self._active = prev

    def _sync_hooks(self) -> None:
        wanted = {m for ad in self.adapters.values() for m in ad.weights}
        for module in list(self._handles):
            if module not in wanted:
                self._handles.pop(module).remove()
        for module in wanted - set(self._handles):
            self._handles[module] = self._modules[module].register_forward_hook(self._make_hook(module))

    def _make_hook(self, module: str) -> Any:
        def hook(_mod: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            ad = self._active
            if ad is None:
                return None
            ab = ad.weights.get(module)
            if ab is None:
                return None
            a, b = ab
            return output + ((args[0] @ a.T) @ b.T) * ad.scaling

        return hook
