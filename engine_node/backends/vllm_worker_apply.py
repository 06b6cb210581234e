"""Writing a staged weight update into the model, inside every vLLM worker
(vllm_worker_ext.py's docstring: the transaction, plans vs load_weights).

`WorkerApply` is the base of the worker extension's mixins: the per-worker
update state (`_rb`), begin/abort, validation and `_rb_apply` (a recorded copy
plan, or the model's own load_weights). LoRA wrappers are unwrapped while
loading, so load_weights sees the checkpoint's names.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any

import torch

from bus.tensors import unpack_bucket
from engine_node.backends import vllm_fp8
from engine_node.backends import vllm_weight_plan as WP

_LORA_SWAPS: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[torch.nn.Module, str, torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


_PLANNABLE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str | None]] = weakref.WeakKeyDictionary()


def _plannable(model: torch.nn.Module) -> str | None:
    """WP.plannable, once per model (its quantization does not change)."""
    got = _PLANNABLE.get(model)
    if got is None:
        # a quantized model is vllm_fp8's (its loader re-quantizes inside _rb_load)
        why = "quantized model (vllm_fp8)" if vllm_fp8.is_quantized(model) else WP.plannable(model)
        got = _PLANNABLE[model] = (why,)
    return got[0]


class _LoraUnwrapped:
    """While active, every LoRA wrapper module (vLLM's `…WithLoRA`, which keeps the
    original layer as `.base_layer`) is replaced in its parent by that base layer,
    so `model.load_weights` sees the checkpoint's parameter names. The base layer's
    parameters are the ones the wrapper uses: loading in place updates both."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.swaps: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []

    def __enter__(self) -> _LoraUnwrapped:
        # The wrappers are made once, at engine start: find them once per model
        # (a walk over every module is ~1 ms on a 0.5B model, every update).
        known = _LORA_SWAPS.get(self.model)
        if known is not None:
            if all(parent._modules.get(attr) is mod for parent, attr, mod in known):
                self.swaps = list(known)
                for parent, attr, mod in self.swaps:
                    parent._modules[attr] = mod.base_layer
                return self
            if all(parent._modules.get(attr) is mod.base_layer for parent, attr, mod in known):
                return self  # nested inside another _LoraUnwrapped: already unwrapped, nothing to undo
        for name, mod in list(self.model.named_modules()):
            # _modules, not getattr: a missing attribute on a Module raises inside
            # nn.Module.__getattr__ (~5 us per module, on every weight update)
            base = mod._modules.get("base_layer")
            if name and isinstance(base, torch.nn.Module):
                parent_name, _, attr = name.rpartition(".")
                parent = self.model.get_submodule(parent_name) if parent_name else self.model
                if parent._modules.get(attr) is mod:
                    self.swaps.append((parent, attr, mod))
        _LORA_SWAPS[self.model] = list(self.swaps)
        for parent, attr, mod in self.swaps:
            parent._modules[attr] = mod.base_layer
        return self

    def __exit__(self, *exc: Any) -> None:
        for parent, attr, mod in reversed(self.swaps):
            parent._modules[attr] = mod
        self.swaps = []


def _on(dev: torch.device) -> Any:
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def _fresh_state() -> dict[str, Any]:
    return {"uid": None, "metas": [], "sizes": [], "buckets": {}, "named": {}, "layout": None}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _layout_key(metas: list[list[Any]], sizes: list[int]) -> tuple[Any, ...]:
    """The whole bucket layout (names, dtypes, shapes, places, bucket sizes)."""
    return (tuple(int(x) for x in sizes), tuple((str(m[0]), str(m[1]), tuple(m[2]), *m[3:6]) for m in metas))


def _plan_key(metas: list[list[Any]]) -> tuple[Any, ...]:
    """What a plan depends on: names, dtypes, shapes (not the bucket layout:
    a plan's sources are relative to each named tensor)."""
    return tuple((str(m[0]), str(m[1]), tuple(int(d) for d in m[2])) for m in metas)


class WorkerApply:
    """Mixed into vLLM's Worker (through RolloutBusWorkerExtension): `self` has
    model_runner, device, rank, local_rank."""

    model_runner: Any  # the Worker's (annotation only: no class attribute shadows it)

    # -- helpers (underscored names are not called over RPC)
    def _rb(self) -> dict[str, Any]:
        st = self.__dict__.get("_rollout_bus_state")
        if st is None:
            st = {**_fresh_state(), "nccl": None, "nccl_key": None, "plans": {}, "staging": None, "validated": None}
            self.__dict__["_rollout_bus_state"] = st
        return st

    def _rb_model(self):
        mr = self.model_runner
        return mr.get_model() if hasattr(mr, "get_model") else mr.model

    def _rb_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        if isinstance(dev, torch.device):
            return dev  # cuda:N in vLLM's GPU worker (cpu in the CPU tests)
        return torch.device("cuda", torch.cuda.current_device())

    def _rb_check(self, uid: str) -> dict[str, Any]:
        st = self._rb()
        if st["uid"] != uid:
            raise RuntimeError(
                f"worker {getattr(self, 'rank', '?')}: no weight update {uid!r} begun (current: {st['uid']!r})"
            )
        return st

    def _rb_load(self, named: Any) -> int:
        """Load ONE whole update (an iterable of (name, tensor); a quantized
        model needs every shard of a fused layer inside one call)."""
        model = self._rb_model()
        with _LoraUnwrapped(model):
            if vllm_fp8.is_quantized(model):  # fp8 engine fed bf16: re-quantize (vllm_fp8)
                return vllm_fp8.load_into_quantized(model, named, getattr(self, "model_config", None))
            loaded = model.load_weights(named)
        return len(loaded) if loaded is not None else -1

    def _rb_post_load(self, model: torch.nn.Module, names: list[str]) -> None:
        """Runs after every write of new weights (plan or load_weights), before
        the commit answers: the hook for a post-load step a plan-written model
        needs. (fp8 engines never take the plan: vllm_fp8 re-quantizes inside
        _rb_load, so there is nothing to do here for them.)"""

    def _rb_apply(self, st: dict[str, Any], opts: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the update staged in `st` (buckets + metas) into the model (see
        the module doc). Returns what it did and how long each part took."""
        model = self._rb_model()
        dev = self._rb_device()
        t0 = time.perf_counter()
        if st.get("layout") is None:
            st["layout"] = _layout_key(st["metas"], st["sizes"])
        off = (opts or {}).get("plan") is False or os.environ.get("ROLLOUT_BUS_WEIGHT_PLAN", "1") == "0"
        why = "off" if off else _plannable(model)
        r: dict[str, Any] = {"tensors": len(st["metas"])}
        if why is not None:
            r.update(path="load_weights", params_loaded=self._rb_load(self._rb_named(st)), why=why)
        else:
            with _LoraUnwrapped(model):  # the checkpoint's names, for the plan as for load_weights
                r.update(self._rb_plan_apply(st, model, t0, bool((opts or {}).get("check"))))
        t3 = time.perf_counter()
        self._rb_post_load(model, [str(m[0]) for m in st["metas"]])
        _sync(dev)
        r["post_sync_s"] = round(time.perf_counter() - t3, 4)
        r["apply_s"] = round(time.perf_counter() - t0, 4)
        return r

    def _rb_plan_apply(self, st: dict[str, Any], model: torch.nn.Module, t0: float, check: bool) -> dict[str, Any]:
        r: dict[str, Any] = {}
        key = _plan_key(st["metas"])
        plan = st["plans"].get(key)
        if plan == "failed":  # recording this layout failed once: load_weights for good
            return {"path": "load_weights", "params_loaded": self._rb_load(self._rb_named(st)), "why": "plan failed"}
        if isinstance(plan, WP.WeightPlan) and not plan.still_valid(model):
            plan = None  # a parameter was re-allocated or swapped: learn again
        if plan is None:
            named = self._rb_named(st)
            try:
                plan = WP.WeightPlan.record(key, model, model.load_weights, named)
            except Exception as e:  # nothing was written: recording performs no write
                st["plans"] = {key: "failed"}
                return {
                    "path": "load_weights",
                    "params_loaded": self._rb_load(named),
                    "why": f"plan failed: {type(e).__name__}: {e}"[:300],
                }
            t1 = time.perf_counter()
            r["params_loaded"] = self._rb_load(named)  # the truth, this once
            t2 = time.perf_counter()
            bad = plan.verify(dict(named))
            st["plans"] = {key: plan}  # one layout at a time: a new one replaces it
            r.update(
                path="load_weights+record",
                record_s=round(t1 - t0, 4),
                load_s=round(t2 - t1, 4),
                verify_s=round(time.perf_counter() - t2, 4),
                verify_mismatch=bad[:8],
                plan=plan.summary(),
            )
            return r
        # The source views depend on the plan, the layout and the bucket
        # tensors; with kept maps (zero-copy) all three repeat, so cutting
        # hundreds of views (Python, ~10 us each) is done once, not per update.
        skey = (id(plan), st["layout"], tuple(id(b) for _i, b in sorted(st["buckets"].items())))
        cached = st.get("srcs")
        if cached is not None and cached[0] == skey and st.get("maps"):
            srcs = cached[1]
        else:
            srcs = plan.sources_from_buckets(st["layout"], st["metas"], st["buckets"])
            st["srcs"] = (skey, srcs) if st.get("maps") else None
        n = plan.apply(srcs=srcs)
        del srcs
        t1 = time.perf_counter()
        rest = self._rb_subset(st, plan.fallback) if plan.fallback else []
        if rest:
            self._rb_load(rest)
        r.update(
            path="plan",
            copies=n,
            fallback=len(rest),
            copy_s=round(t1 - t0, 4),
            fallback_s=round(time.perf_counter() - t1, 4),
        )
        if check:
            r.update(self._rb_check_plan(model, self._rb_named(st)))
        return r

    def _rb_subset(self, st: dict[str, Any], names: set[str]) -> list[tuple[str, torch.Tensor]]:
        """Views of just these names (the layout is validated)."""
        metas = [m for m in st["metas"] if m[0] in names]
        return [nt for i, b in sorted(st["buckets"].items()) for nt in unpack_bucket(i, metas, b)]

    def _rb_check_plan(self, model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """opts["check"]: after the plan wrote this update, run load_weights on
        the same tensors and compare EVERY parameter bit for bit with what the
        plan left (costs a copy of the parameters and a load: off by default)."""
        t0 = time.perf_counter()
        snap = {n: p.detach().clone() for n, p in model.named_parameters()}
        self._rb_load(named)
        bad = [n for n, p in model.named_parameters() if not torch.equal(WP.bits(p.detach()), WP.bits(snap[n]))]
        del snap
        return {
            "check_params": len(dict(model.named_parameters())),
            "check_mismatch": bad[:8],
            "check_s": round(time.perf_counter() - t0, 4),
        }

    def _rb_validate(self, st: dict[str, Any]) -> None:
        """Every bucket against the metas (bus.tensors.unpack_bucket: a lie is a
        ValueError naming the tensor). A layout validated before needs only its
        bucket lengths checked: the same metas give the same answer."""
        layout = _layout_key(st["metas"], st["sizes"])
        st["layout"] = layout
        if st.get("validated") == layout:
            for i, b in st["buckets"].items():
                if b.numel() < st["sizes"][i]:
                    raise ValueError(f"bucket {i}: {b.numel()} bytes, the plan says {st['sizes'][i]}")
            return
        for i, b in st["buckets"].items():
            st["named"][i] = unpack_bucket(i, st["metas"], b)
        st["validated"] = layout

    def _rb_named(self, st: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        known = st["named"]
        return [
            nt for i, b in sorted(st["buckets"].items()) for nt in (known.get(i) or unpack_bucket(i, st["metas"], b))
        ]

    # -- RPC methods: the transaction's ends
    def rollout_bus_begin(self, uid: str, metas: list[Any], sizes: list[int]) -> int:
        st = self._rb()
        st.update(_fresh_state())
        st.update(uid=uid, metas=[list(m) for m in metas], sizes=[int(s) for s in sizes])
        return len(metas)

    def rollout_bus_abort(self, uid: str | None = None) -> None:
        self._rb().update(_fresh_state())
