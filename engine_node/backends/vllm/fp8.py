"""bf16 weights from the trainer into a quantized (fp8) vLLM model, in place.

An engine started with ``quantization="fp8"`` on a bf16 checkpoint quantizes
online: vLLM 0.24 creates each linear layer's ``weight`` in checkpoint format
(bf16, [out, in]) on the meta device, materializes it when the checkpoint's
shards arrive, and ``process_weights_after_loading`` turns it into kernel
format (fp8 ``weight`` transposed to [in, out], a per-tensor fp32
``weight_scale``). After start the model holds only kernel tensors: a plain
``model.load_weights(bf16 tensors)`` would copy bf16 values into fp8 storage of
the wrong shape (or fail), and no scale would be recomputed.

vLLM 0.24 ships the machinery to undo that, in
``vllm.model_executor.model_loader.reload`` (its own ``reload_weights`` and
``start/update/finish_weight_update`` use it):

- at model construction, ``record_metadata_for_reloading`` captured every
  layer's checkpoint-format tensors as meta tensors (shape, dtype, class and
  attributes: the ``weight_loader``);
- ``initialize_layerwise_reload(model)`` keeps each layer's kernel tensors
  aside, puts the checkpoint-format tensors back (on meta) and wraps their
  weight loaders so that loads are buffered per layer;
- when every element of a layer has arrived, the layer is materialized, the
  buffered loads are replayed, ``process_weights_after_loading`` re-quantizes
  (fresh dynamic per-tensor scales), and the result is copied INTO the old
  kernel tensors' storage (CUDA graphs keep pointing at valid memory);
- ``finalize_layerwise_reload(model, model_config)`` processes what is left
  (attention last) and puts back the kernel tensors of layers nothing was
  loaded into.

This is what FlashRL patched into older vLLMs (record the original parameters'
shapes and loaders at init, re-create them on load, re-run post-load
processing); here it is vLLM's own path, and this module only orchestrates it
and guards its hazards:

- A fused layer (qkv_proj, gate_up_proj) is quantized with ONE scale over all
  its shards, so all of them must arrive inside one initialize/finalize: a
  layer with only some shards would be processed with uninitialized memory in
  the others. ``incomplete_groups`` refuses such an update before anything is
  touched (when the caller hands a list); for streamed input the partial-layer
  guard puts that layer's old kernel tensors back and the load fails naming it.
- Everything of one update goes through ONE call (the zmq path's buckets are
  chained): initialize/finalize per bucket would split fused layers.
- If ``load_weights`` raises half-way, the layers still pending are dropped and
  finalize runs anyway, so no layer is left on the meta device (layers
  already re-quantized keep their new weights: the commit fails and says so).
- dtype: an online-quantized layer takes floating checkpoint tensors (bf16,
  fp16, fp32); fp8 bytes sent to it would be cast as numbers. A model started
  from an fp8-serialized checkpoint takes that checkpoint's format only.

Nothing here imports vLLM at module level (the CPU tests import it and pass a
fake `ReloadApi`).
"""

from __future__ import annotations

import time
import types
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import structlog
import torch

from bus.errors import BadRequest

log = structlog.get_logger("rollout_bus.vllm_fp8")

# Llama-family default, used when the model class does not say (vLLM's model
# classes carry `packed_modules_mapping`).
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, n))


class QuantizedLoadError(BadRequest):
    """A weight update a quantized engine cannot take (field: the tensor or layer)."""


class ReloadApi(Protocol):
    """vLLM's layerwise reload, as this module uses it (a fake in the CPU tests)."""

    def initialize(self, model: torch.nn.Module) -> None: ...

    def finalize(self, model: torch.nn.Module, model_config: Any) -> None: ...

    def progress(self, layer: torch.nn.Module) -> tuple[int, int] | None:
        """(elements loaded, elements expected) while the layer waits for more; None otherwise."""
        ...

    def forget(self, layer: torch.nn.Module) -> None:
        """Drop what was buffered for the layer: finalize then puts its old kernel tensors back."""
        ...


class VllmReload:
    """`ReloadApi` on vllm.model_executor.model_loader.reload (vLLM 0.24)."""

    def __init__(self) -> None:
        try:
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError as e:
            raise RuntimeError(
                f"this vLLM has no layerwise weight reload ({e}); weight updates of a quantized "
                "engine need vLLM >= 0.24 (pyproject pins 0.24.0)"
            ) from e
        self._lw = layerwise

    def initialize(self, model: torch.nn.Module) -> None:
        self._lw.initialize_layerwise_reload(model)

    def finalize(self, model: torch.nn.Module, model_config: Any) -> None:
        self._lw.finalize_layerwise_reload(model, model_config)

    def progress(self, layer: torch.nn.Module) -> tuple[int, int] | None:
        info = self._lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            return None
        return int(info.load_numel), int(info.load_numel_total or 0)

    def forget(self, layer: torch.nn.Module) -> None:
        info = self._lw.LAYERWISE_INFO.get(layer)
        if info is not None:
            info.load_numel = 0
            info.loaded_weights = []


# ---------------------------------------------------------------- what the model is
def _weight_quant(qm: Any) -> bool:
    """A quant method that changes a layer's weights (not Unquantized*, not the
    attention layers' KV-cache scales)."""
    name = type(qm).__name__
    return qm is not None and not name.startswith("Unquantized") and "KVCache" not in name


def _guarded(qm: Any) -> bool:
    """Layers loaded whole or not at all: quantized ones and plain linear ones
    (no padding; under the layerwise reload every layer is re-created, so a
    missing shard would be garbage even in an unquantized fused layer)."""
    return _weight_quant(qm) or type(qm).__name__ == "UnquantizedLinearMethod"


_KIND: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def quant_kind(model: torch.nn.Module) -> str | None:
    """ "online" (quantized at load from a float checkpoint: quantization="fp8"
    on a bf16 model), "serialized" (the checkpoint is quantized), or None.
    Cached per model: quant methods are fixed when the model is built."""
    kind = _KIND.get(model)
    if kind is None:
        online = serialized = False
        for m in model.modules():
            qm = getattr(m, "quant_method", None)
            if _weight_quant(qm):
                if getattr(qm, "uses_meta_device", False):
                    online = True
                else:
                    serialized = True
        kind = "serialized" if serialized else "online" if online else ""
        _KIND[model] = kind
    return kind or None


def is_quantized(model: torch.nn.Module) -> bool:
    return quant_kind(model) is not None


def packed_mapping(model: torch.nn.Module) -> dict[str, list[str]]:
    pm = getattr(model, "packed_modules_mapping", None)
    return {str(k): [str(x) for x in v] for k, v in pm.items()} if isinstance(pm, dict) and pm else DEFAULT_PACKED


# ---------------------------------------------------------------- pure checks
def _split(name: str, inverse: dict[str, str]) -> tuple[str, str, str, str] | None:
    """checkpoint name -> (fused module path, fused attr, shard attr, suffix) when
    the tensor is one shard of a fused layer."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    *parent, attr, suffix = parts
    fused = inverse.get(attr)
    if fused is None:
        return None
    return ".".join(parent), fused, attr, suffix


def incomplete_groups(names: Iterable[str], packed: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """Fused layers the update covers only in part: [(fused tensor name,
    missing checkpoint names)], e.g. ("model.layers.0.self_attn.qkv_proj.weight",
    ["model.layers.0.self_attn.v_proj.weight"]). Per suffix: a bias group is
    judged on its own."""
    inverse = {shard: fused for fused, shards in packed.items() for shard in shards if shard != fused}
    groups: dict[tuple[str, str, str], set[str]] = {}
    for n in names:
        s = _split(n, inverse)
        if s is not None:
            parent, fused, attr, suffix = s
            groups.setdefault((parent, fused, suffix), set()).add(attr)
    out = []
    for (parent, fused, suffix), have in sorted(groups.items()):
        missing = [a for a in packed[fused] if a not in have]
        if missing:
            pre = parent + "." if parent else ""
            out.append((f"{pre}{fused}.{suffix}", [f"{pre}{a}.{suffix}" for a in missing]))
    return out


def _target_layer(model: torch.nn.Module, name: str, inverse: dict[str, str]) -> torch.nn.Module | None:
    """The module a checkpoint tensor lands in (fused names mapped), if it exists
    under that path (models that rename checkpoint prefixes: None)."""
    parent, _, attr = name.rpartition(".")[0].rpartition(".")
    path = ".".join(p for p in (parent, inverse.get(attr, attr)) if p)
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def dtype_problem(model: torch.nn.Module, name: str, t: torch.Tensor, kind: str, inverse: dict[str, str]) -> str | None:
    """Why `t` must not be loaded into a quantized layer's weight, else None."""
    if not name.endswith(".weight"):
        return None
    layer = _target_layer(model, name, inverse)
    qm = getattr(layer, "quant_method", None) if layer is not None else None
    if not _weight_quant(qm):
        return None
    floating = t.dtype.is_floating_point and t.dtype not in _FP8_DTYPES
    if kind == "online" and not floating:
        return (
            f"tensor {name!r}: dtype {t.dtype} into an fp8 layer quantized at load; "
            "send checkpoint-format floating weights (bf16/fp16/fp32)"
        )
    if kind == "serialized" and floating:
        return (
            f"tensor {name!r}: {t.dtype} weights into a model started from a quantized checkpoint; "
            "start the engine from the bf16 checkpoint with quantization='fp8' to feed it bf16"
        )
    return None


# ---------------------------------------------------------------- the load
def _checked(
    model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], kind: str, inverse: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in named:
        why = dtype_problem(model, name, t, kind, inverse)
        if why is not None:
            raise QuantizedLoadError(why, field=name)
        yield name, t


def _model_device(model: torch.nn.Module) -> torch.device:
    for t in model.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _fallback_config(model: torch.nn.Module) -> Any:
    """finalize reads model_config.dtype only (attention layers' post-load step)."""
    for m in model.modules():
        dt = getattr(m, "orig_dtype", None)
        if isinstance(dt, torch.dtype):
            return types.SimpleNamespace(dtype=dt)
    return types.SimpleNamespace(dtype=torch.get_default_dtype())


def _pending(model: torch.nn.Module, api: ReloadApi) -> list[tuple[str, torch.nn.Module, int, int]]:
    out = []
    for name, m in model.named_modules():
        p = api.progress(m)
        if p is not None and p[0] > 0:
            out.append((name, m, p[0], p[1]))
    return out


def load_into_quantized(
    model: torch.nn.Module,
    named: Iterable[tuple[str, torch.Tensor]],
    model_config: Any = None,
    *,
    api: ReloadApi | None = None,
) -> int:
    """Load checkpoint-format tensors (bf16 from the trainer) into a quantized
    vLLM model and re-quantize what they touch. `named` is the WHOLE update
    (a list: checked before anything is touched; any iterable: streamed, e.g.
    bucket after bucket). Returns the number of parameters loaded. Raises
    QuantizedLoadError (field = tensor or layer) for an update it cannot take.

    Runs in a vLLM worker with the model's device current (the reload
    materializes layers on the device recorded at model construction)."""
    kind = quant_kind(model) or "online"
    packed = packed_mapping(model)
    inverse = {shard: fused for fused, shards in packed.items() for shard in shards if shard != fused}
    if isinstance(named, Sequence):
        bad = incomplete_groups((n for n, _ in named), packed)
        if bad:
            layer, missing = bad[0]
            raise QuantizedLoadError(
                f"{layer}: the update has some shards of this fused layer but not {missing} "
                f"({len(bad)} such layer(s)); a quantized engine re-quantizes a fused layer from all its "
                "shards at once: send every shard of it",
                field=layer,
            )
        for n, t in named:  # before anything is touched
            why = dtype_problem(model, n, t, kind, inverse)
            if why is not None:
                raise QuantizedLoadError(why, field=n)
    api = api if api is not None else VllmReload()
    cfg = model_config if model_config is not None else _fallback_config(model)
    dev = _model_device(model)
    t0 = time.perf_counter()
    with torch.no_grad(), torch.device(dev):
        api.initialize(model)
        try:
            loaded = model.load_weights(_checked(model, named, kind, inverse))
        except BaseException:
            # Layers still waiting for shards hold nothing but meta tensors:
            # drop their buffered loads so finalize puts the kernel tensors back.
            for _, m, _, _ in _pending(model, api):
                api.forget(m)
            api.finalize(model, cfg)
            raise
        # A linear layer still waiting after the whole update is missing shards
        # (their memory would be processed uninitialized): keep its old weights.
        # Other layers may legitimately stop short (a padded vocabulary), and
        # finalize processes those.
        partial = [(n, m, a, b) for n, m, a, b in _pending(model, api) if _guarded(getattr(m, "quant_method", None))]
        for _, m, _, _ in partial:
            api.forget(m)
        api.finalize(model, cfg)
    if partial:
        n, _, a, b = partial[0]
        raise QuantizedLoadError(
            f"{n}: the update loaded {a} of its {b} elements ({len(partial)} such layer(s), kept at "
            "their previous weights); a quantized layer is re-quantized from all its shards at once",
            field=n,
        )
    count = len(loaded) if loaded is not None else -1
    log.debug("quantized_reload", kind=kind, params=count, seconds=round(time.perf_counter() - t0, 4))
    return count
