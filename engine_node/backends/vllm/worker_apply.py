"""Writing a staged weight update into the model, inside every vLLM worker
(vllm/worker_ext.py's docstring: the transaction, plans vs load_weights).

`WorkerApply` is the base of the worker extension's mixins: the per-worker
update state (`_rb`), begin/abort, validation and `_rb_apply` (a recorded copy
plan, or the model's own load_weights). LoRA wrappers are unwrapped while
loading, so load_weights sees the checkpoint's names. A repeated update (same
layout, same kept buckets) reuses its validated layout and the plan's cut source
views (vllm/worker_reuse: what is kept, and how long).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any

import torch

from bus.tensors import unpack_bucket
from engine_node.backends.vllm import fp8
from engine_node.backends.vllm import weight_plan as WP
from engine_node.backends.vllm.worker_reuse import Kept, Layout, buckets_list

_LORA_SWAPS: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[torch.nn.Module, str, torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


_PLANNABLE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str | None]] = weakref.WeakKeyDictionary()


def _plannable(model: torch.nn.Module) -> str | None:
    """WP.plannable, once per model (its quantization does not change)."""
    got = _PLANNABLE.get(model)
    if got is None:
        # a quantized model is vllm/fp8's (its loader re-quantizes inside _rb_load)
        why = "quantized model (vllm/fp8.py)" if fp8.is_quantized(model) else WP.plannable(model)
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
    # keep_views: this update's buckets outlive it (kept IPC maps, nccl staging),
    # so views cut from them may be kept for the next update (vllm/worker_reuse)
    # (handles: the kept maps' IPC handles, as received)
    return {
        **{"uid": None, "metas": [], "sizes": [], "buckets": {}, "named": {}, "layout": None},
        **{"keep_views": False, "handles": None},
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class WorkerApply:
    """Mixed into vLLM's Worker (through RolloutBusWorkerExtension): `self` has
    model_runner, device, rank, local_rank."""

    model_runner: Any  # the Worker's (annotation only: no class attribute shadows it)

    # -- helpers (underscored names are not called over RPC)
    def _rb(self) -> dict[str, Any]:
        st = self.__dict__.get("_rollout_bus_state")
        if st is None:
            st = {
                **_fresh_state(),
                **{"nccl": None, "nccl_key": None, "plans": {}, "staging": None, "validated": None, "kept": None},
                "ipc_kept": None,  # vllm/worker_ipc: (token, metas, sizes, handles) of the kept maps
            }
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
            if fp8.is_quantized(model):  # fp8 engine fed bf16: re-quantize (vllm/fp8)
                return fp8.load_into_quantized(model, named, getattr(self, "model_config", None))
            loaded = model.load_weights(named)
        return len(loaded) if loaded is not None else -1

    def _rb_post_load(self, model: torch.nn.Module, names: list[str]) -> None:
        """Runs after every write of new weights (plan or load_weights), before
        the commit answers: the hook for a post-load step a plan-written model
        needs. (fp8 engines never take the plan: vllm/fp8 re-quantizes inside
        _rb_load, so there is nothing to do here for them.)"""

    def _rb_apply(self, st: dict[str, Any], opts: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the update staged in `st` (buckets + metas) into the model (see
        the module doc). Returns what it did and how long each part took."""
        model = self._rb_model()
        dev = self._rb_device()
        t0 = time.perf_counter()
        layout = self._rb_layout(st)
        off = (opts or {}).get("plan") is False or os.environ.get("ROLLOUT_BUS_WEIGHT_PLAN", "1") == "0"
        why = "off" if off else _plannable(model)
        r: dict[str, Any] = {"tensors": len(st["metas"])}
        if why is not None:
            r.update(path="load_weights", params_loaded=self._rb_load(self._rb_named(st)), why=why)
        else:
            with _LoraUnwrapped(model):  # the checkpoint's names, for the plan as for load_weights
                r.update(self._rb_plan_apply(st, model, t0, bool((opts or {}).get("check"))))
        t3 = time.perf_counter()
        self._rb_post_load(model, layout.names)
        _sync(dev)
        r["post_sync_s"] = round(time.perf_counter() - t3, 4)
        r["apply_s"] = round(time.perf_counter() - t0, 4)
        return r

    def _rb_plan_apply(self, st: dict[str, Any], model: torch.nn.Module, t0: float, check: bool) -> dict[str, Any]:
        layout: Layout = st["layout"]
        plan = st["plans"].get(layout.plan_key)
        if plan == "failed":  # recording this layout failed once: load_weights for good
            return {"path": "load_weights", "params_loaded": self._rb_load(self._rb_named(st)), "why": "plan failed"}
        if isinstance(plan, WP.WeightPlan) and not plan.still_valid(model):
            plan = None  # a parameter was re-allocated or swapped: learn again
        if plan is None:
            return self._rb_record(st, model, t0)
        replay, reused = self._rb_replay(st, plan)
        n = replay.run()
        del replay
        t1 = time.perf_counter()
        rest = self._rb_subset(st, plan.fallback) if plan.fallback else []
        if rest:
            self._rb_load(rest)
        r = {
            "path": "plan",
            "copies": n,
            "fallback": len(rest),
            "views_reused": reused,
            "copy_s": round(t1 - t0, 4),
            "fallback_s": round(time.perf_counter() - t1, 4),
        }
        if check:
            r.update(self._rb_check_plan(model, self._rb_named(st)))
        return r

    def _rb_replay(self, st: dict[str, Any], plan: WP.WeightPlan) -> tuple[WP.Replay, bool]:
        """The plan's writes from this update's buckets, and whether they were
        reused: the source views depend on the plan, the layout and the bucket
        tensors, and with kept maps (zero-copy) or nccl's staging all three
        repeat, so the views (339 as_strided at 7B) are cut once, not per update."""
        kept: Kept | None = st.get("kept")
        if kept is not None and kept.serves(st["layout"], plan, st["buckets"]):
            return kept.replay, True
        st["kept"] = None  # its views may pin buffers this update no longer uses
        layout: Layout = st["layout"]
        replay = plan.replay(plan.sources_from_buckets(layout.key, st["metas"], st["buckets"]))
        if st["keep_views"]:
            st["kept"] = Kept(layout, plan, buckets_list(st["buckets"]), replay, st.get("handles"))
        return replay, False

    def _rb_record(self, st: dict[str, Any], model: torch.nn.Module, t0: float) -> dict[str, Any]:
        """The first update of a layout: load_weights (the truth) with the plan
        recorded alongside, then verified against what load_weights wrote."""
        key = st["layout"].plan_key
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
        loaded = self._rb_load(named)  # the truth, this once
        t2 = time.perf_counter()
        bad = plan.verify(dict(named))
        st["plans"] = {key: plan}  # one layout at a time: a new one replaces it
        st["kept"] = None  # (views of the old plan's)
        return {
            "params_loaded": loaded,
            "path": "load_weights+record",
            "record_s": round(t1 - t0, 4),
            "load_s": round(t2 - t1, 4),
            "verify_s": round(time.perf_counter() - t2, 4),
            "verify_mismatch": bad[:8],
            "plan": plan.summary(),
        }

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

    def _rb_layout(self, st: dict[str, Any]) -> Layout:
        """This update's Layout: set by _rb_validate, else the validated one
        when the metas are the same, else made (not validated: zmq, fp8 tests)."""
        layout = st.get("layout")
        if layout is None:
            known: Layout | None = st.get("validated")
            same = known is not None and known.same(st["metas"], st["sizes"])
            layout = st["layout"] = known if same and known is not None else Layout.of(st["metas"], st["sizes"])
        return layout

    def _rb_validate(self, st: dict[str, Any]) -> None:
        """Every bucket against the metas (bus.tensors.unpack_bucket: a lie is a
        ValueError naming the tensor). A layout validated before (found by one
        list compare, vllm/worker_reuse) needs only its bucket lengths checked:
        the same metas give the same answer. The very buckets of the kept last
        update passed that check already."""
        known: Layout | None = st.get("validated")
        if known is not None and known.same(st["metas"], st["sizes"]):
            st["layout"] = known
            kept: Kept | None = st.get("kept")
            if kept is not None and kept.layout is known and kept.same_buckets(st["buckets"]):
                return
            for i, b in st["buckets"].items():
                if b.numel() < st["sizes"][i]:
                    raise ValueError(f"bucket {i}: {b.numel()} bytes, the plan says {st['sizes'][i]}")
            return
        for i, b in st["buckets"].items():
            st["named"][i] = unpack_bucket(i, st["metas"], b)
        st["layout"] = st["validated"] = Layout.of(st["metas"], st["sizes"])

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
