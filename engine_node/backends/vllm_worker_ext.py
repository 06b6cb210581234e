"""Methods injected into every vLLM worker process (``worker_extension_cls``).

The vLLM backend starts its engine with
``worker_extension_cls="engine_node.backends.vllm_worker_ext.RolloutBusWorkerExtension"``;
vLLM adds this class to the bases of its GPU worker, so the methods below run
on *every* worker (every TP/PP rank), called by the engine core's
``collective_rpc`` utility.

A weight update is a transaction on each worker; nothing touches the model
before commit:
  rollout_bus_begin(uid, metas, sizes)     metas: [[name, dtype, shape, bucket, offset, nbytes], …]
  rollout_bus_apply_ipc(uid, metas, sizes, handles, opts)
                                           cuda_ipc, the whole update in ONE call (the backend's
                                           commit): begin, map every bucket of the trainer and
                                           validate it (nothing written yet: a bad handle leaves
                                           the model as it was), write the parameters, drop the
                                           maps. The trainer keeps its buckets until the ack.
  rollout_bus_recv_ipc(uid, handles)       (older two-call form: map + validate at receive)
  rollout_bus_recv_nccl(uid, args, metas, sizes)
                                           nccl: begin (when metas are given), join the trainer's
                                           group once (kept for later updates), receive every bucket
                                           into this worker's staging buffers (kept while the
                                           layout is the same)
  rollout_bus_nccl_join(args)              join the group ahead of the first update
  rollout_bus_commit(uid, shm, opts)       write the parameters from what was received, or (zmq)
                                           load_weights from the backend's shared-memory file `shm`
  rollout_bus_abort(uid)                   drop what is staged
Every worker receives the full (unsharded) tensors: vLLM's ``load_weights``
shards them for its TP rank itself.

Writing the parameters (`_rb_apply`): the first update of a layout runs vLLM's
`load_weights` (the truth) and records, alongside, the copy plan it amounts to
(vllm_weight_plan: which slice of which incoming tensor lands in which slice of
which parameter), then verifies the plan against what load_weights wrote, bit for
bit. Later updates replay the plan as device copies (torch._foreach_copy_), and
only the names the plan cannot express go through load_weights. Quantized models
never use a plan. `_rb_post_load` runs after every write (the hook for a
post-load step such as fp8 re-quantization; a no-op here). opts["plan"]=False
(or ROLLOUT_BUS_WEIGHT_PLAN=0 in the workers' environment) turns plans off.

Also: the engine's processes must not outlive the engine node (see
`engine_node.child_watch.arm`, run when this module is imported in a worker).

Nothing here imports vllm at module level, so the module imports on machines
without vLLM (the CPU tests import it).
"""

from __future__ import annotations

import mmap
import os
import pickle
import time
import warnings
import weakref
from typing import Any

import torch

from bus.tensors import unpack_bucket
from engine_node.backends import vllm_fp8
from engine_node.backends import vllm_weight_plan as WP
from engine_node.child_watch import NODE_PID_ENV as NODE_PID_ENV
from engine_node.child_watch import arm as arm_node_watch

# The engine's processes die with the node: this import is the first thing
# every worker runs of ours (TP=1: inside the EngineCore process, whose parent
# is the node; TP>1: a worker under the EngineCore, which it kills when the
# node goes). engine_node/child_watch.py has the mechanism and its hazards.
PARENT_DEATH = arm_node_watch()


def local_device_for_uuid(uuid: str | None, default: int) -> int:
    if not uuid:
        return default
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"the CUDA IPC handle's GPU {uuid} is not visible to this worker")


def open_ipc_handle(handle: bytes, default_device: int) -> torch.Tensor:
    """Rebuild a tensor from a pickled (rebuild_fn, args, uuid) of
    torch.multiprocessing.reductions.reduce_tensor (see trainer_bridge.transports.cuda_ipc)."""
    fn, args, uuid = pickle.loads(handle)
    args = list(args)
    # args[6] is the storage's device index in the sender's numbering: map the
    # physical GPU (uuid) to this process's numbering.
    args[6] = local_device_for_uuid(uuid, default_device)
    return fn(*args)


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
    import contextlib

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


class RolloutBusWorkerExtension:
    """Mixed into vLLM's Worker: `self` has model_runner, device, rank, local_rank."""

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

    def _rb_open_ipc(self, st: dict[str, Any], handles: list[Any], keep_maps: bool = False) -> int:
        """Map every bucket of the trainer (validated: a lie fails naming the
        tensor). Same GPU: views of the trainer's buffers, alive until the
        commit's ack. Returns how many buckets had to be copied (another GPU).

        keep_maps (the trainer's zero-copy mode, trainer_bridge.transports.cuda_ipc):
        the handles name the trainer's own parameters, which stay where they are
        from one update to the next, so the same handle bytes come again. Maps
        are kept across updates in st["maps"] (handle bytes -> flat uint8 view)
        and opening them — cudaIpcOpenMemHandle, ~0.1 ms each, hundreds at 7B —
        is paid once. Hazard: a kept map pins the trainer's memory (torch's IPC
        ref counter keeps a freed block in limbo), so only this update's maps
        survive it, and sleep drops them all (rollout_bus_drop_maps)."""
        dev = self._rb_device()
        if len(handles) != len(st["sizes"]):
            raise ValueError(f"cuda_ipc: {len(handles)} handle(s) for {len(st['sizes'])} bucket(s)")
        my_uuid = str(torch.cuda.get_device_properties(dev).uuid) if dev.type == "cuda" else ""
        copied = 0
        old_maps: dict[bytes, torch.Tensor] = st.get("maps") or {}
        maps: dict[bytes, torch.Tensor] = {}
        for i, h in enumerate(handles):
            if isinstance(h, dict):  # one handle per GPU (uuid -> bytes): take ours, else any
                h = h.get(my_uuid) or next(iter(h.values()))
            key = bytes(h)
            if keep_maps:
                src = old_maps.get(key)
                if src is None:
                    src = open_ipc_handle(key, dev.index if dev.index is not None else 0).view(torch.uint8).reshape(-1)
                maps[key] = src
                if src.device == dev:
                    st["buckets"][i] = src
                    continue
            else:
                src = open_ipc_handle(key, dev.index if dev.index is not None else 0).view(torch.uint8).reshape(-1)
            if src.device != dev:
                # The trainer's buffer lives on another GPU (a TP>1 engine fed from
                # one trainer GPU). load_weights would copy strided shards straight
                # out of peer IPC memory, which CUDA refuses (invalid argument)
                # without peer access: one contiguous copy into our GPU first.
                local = torch.empty(src.numel(), dtype=torch.uint8, device=dev)
                local.copy_(src)
                _sync(dev)
                src = local
                copied += 1
            st["buckets"][i] = src
        # Only this update's maps survive it (a handle that did not come again
        # may name memory the trainer has freed); without keep_maps none do.
        st["maps"] = maps
        if not keep_maps:
            st["srcs"] = None  # cached views would pin the old maps
        self._rb_validate(st)  # now: a lie fails the update before anything is written
        return copied

    # -- RPC methods
    def rollout_bus_info(self) -> dict[str, Any]:
        dev = self._rb_device()
        free, total = torch.cuda.mem_get_info(dev)
        return {
            "rank": int(getattr(self, "rank", 0)),
            "device": dev.index,
            "parent_death": PARENT_DEATH,
            "uuid": str(torch.cuda.get_device_properties(dev).uuid),
            "gpu_free": int(free),
            "gpu_total": int(total),
        }

    def rollout_bus_hold_sleep_buffers(self) -> int:
        """A level-2 sleep saved the model's buffers (rotary caches, ...) and
        vLLM's worker copies them back at the NEXT wake_up, whatever its tags:
        a wake of kv_cache alone would write them into the weights pool, still
        unmapped. Called before such a wake: hold them until the weights wake."""
        saved = getattr(self, "_sleep_saved_buffers", None) or {}
        self._rb_held_buffers = {**getattr(self, "_rb_held_buffers", {}), **saved}
        self._sleep_saved_buffers: dict[str, Any] = {}
        return len(saved)

    def rollout_bus_reload_checkpoint(self) -> int:
        """Write the checkpoint's weights back (after a level-2 sleep no update
        rewrote). Through the model's own load_weights over vLLM's loader
        iterator, not vLLM's `reload_weights`: its layerwise reload loses a
        tied embedding (KeyError 'embed_tokens.weight' in Llama's loader, seen
        on an H200 with vLLM 0.24, run 38 of tests/gpu/RESULTS.md)."""
        from vllm.model_executor.model_loader import get_model_loader

        model = self._rb_model()
        worker: Any = self  # vLLM's Worker: load_config and model_config are its attributes
        loader = get_model_loader(worker.load_config)
        with _on(self._rb_device()), torch.no_grad():
            n = self._rb_load(loader.get_all_weights(worker.model_config, model))
        self._rb().update(plans={}, srcs=None)  # the plan stays valid, but be safe: learn it again
        return n

    def rollout_bus_restore_sleep_buffers(self) -> int:
        """After the weights woke: put back what rollout_bus_hold_sleep_buffers held."""
        held = getattr(self, "_rb_held_buffers", None) or {}
        if held:
            for name, buf in self._rb_model().named_buffers():
                if name in held:
                    buf.data.copy_(held[name].data)
        self._rb_held_buffers = {}
        return len(held)

    def rollout_bus_begin(self, uid: str, metas: list[Any], sizes: list[int]) -> int:
        st = self._rb()
        st.update(_fresh_state())
        st.update(uid=uid, metas=[list(m) for m in metas], sizes=[int(s) for s in sizes])
        return len(metas)

    def rollout_bus_recv_ipc(self, uid: str, handles: list[Any]) -> dict[str, Any]:
        st = self._rb_check(uid)
        t0 = time.perf_counter()
        copied = self._rb_open_ipc(st, handles)
        return {"bytes": int(sum(st["sizes"])), "seconds": time.perf_counter() - t0, "copied": copied}

    def rollout_bus_apply_ipc(
        self, uid: str, metas: list[Any], sizes: list[int], handles: list[Any], opts: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """cuda_ipc in one call: begin + map + validate + write + unmap."""
        t0 = time.perf_counter()
        self.rollout_bus_begin(uid, metas, sizes)
        st = self._rb()
        dev = self._rb_device()
        keep = bool((opts or {}).get("keep_maps"))
        try:
            with _on(dev):
                copied = self._rb_open_ipc(st, handles, keep_maps=keep)
                t1 = time.perf_counter()
                r = self._rb_apply(st, opts)
        except BaseException:
            st["maps"] = {}  # a failed update keeps nothing of the trainer's
            raise
        finally:
            # drop the views: the trainer may free its buffers after the ack
            # (kept maps stay in st["maps"]; _fresh_state does not name them)
            st.update(_fresh_state())
        return {
            **r,
            "open_s": round(t1 - t0, 4),
            "copied": copied,
            "maps_kept": len(st.get("maps") or {}),
            "seconds": time.perf_counter() - t0,
        }

    def rollout_bus_drop_maps(self) -> int:
        """Forget every kept IPC map (keep_maps): before a sleep, so that the
        trainer's freed memory is really free for it while the engine sleeps."""
        st = self._rb()
        n = len(st.get("maps") or {})
        st["maps"] = {}
        st["srcs"] = None
        return n

    def rollout_bus_recv_nccl(
        self, uid: str, args: dict[str, Any], metas: list[Any] | None = None, sizes: list[int] | None = None
    ) -> dict[str, Any]:
        if metas is not None:  # begin folded into the receive (one call instead of two)
            self.rollout_bus_begin(uid, metas, list(sizes or []))
        st = self._rb_check(uid)
        dev = self._rb_device()
        t0 = time.perf_counter()
        setup = self._rb_nccl(args)
        t1 = time.perf_counter()
        comm = st["nccl"]
        # Staging kept across updates while the layout is the same: no allocation
        # on the steady path. Hazard: its memory stays taken between updates
        # (the bytes of one update); nccl_close drops it.
        key = tuple(int(n) for n in st["sizes"])
        staging = st["staging"]
        if staging is None or staging[0] != key or any(b.device != dev for b in staging[1]):
            staging = st["staging"] = (key, [torch.empty(n, dtype=torch.uint8, device=dev) for n in key])
        t2 = time.perf_counter()
        with _on(dev):
            for i, buf in enumerate(staging[1]):
                comm.broadcast(buf, src=0)
                st["buckets"][i] = buf
            _sync(dev)
        t3 = time.perf_counter()
        self._rb_validate(st)
        return {
            "bytes": int(sum(st["sizes"])),
            "seconds": time.perf_counter() - t0,
            "setup_seconds": round(t1 - t0, 4),
            "alloc_s": round(t2 - t1, 4),
            "broadcast_s": round(t3 - t2, 4),
            **setup,
        }

    def rollout_bus_recv_nccl_part(
        self, uid: str, args: dict[str, Any], metas: list[Any], sizes: list[int], first: int
    ) -> dict[str, Any]:
        """One sender's part of a multi-sender update, over that sender's own
        group: buckets first.. (metas already numbered globally). The first
        part of an update begins it here."""
        st = self._rb()
        if st["uid"] != uid:
            self.rollout_bus_begin(uid, [], [])
        if len(st["sizes"]) != first:
            raise RuntimeError(f"part of update {uid} starts at bucket {first}, {len(st['sizes'])} are in")
        st["metas"] += [list(m) for m in metas]
        st["sizes"] += [int(x) for x in sizes]
        dev = self._rb_device()
        t0 = time.perf_counter()
        setup = self._rb_nccl(args)
        comm = st["nccl"]
        t1 = time.perf_counter()
        with _on(dev):
            for j, n in enumerate(sizes):
                buf = torch.empty(int(n), dtype=torch.uint8, device=dev)
                comm.broadcast(buf, src=0)
                st["buckets"][first + j] = buf
            _sync(dev)
        t2 = time.perf_counter()
        for j in range(len(sizes)):  # a lie fails this part, naming the tensor
            st["named"][first + j] = unpack_bucket(first + j, st["metas"], st["buckets"][first + j])
        st["layout"] = None  # complete only with every part: the commit validates the whole layout
        return {
            "seconds": time.perf_counter() - t0,
            "setup_seconds": round(t1 - t0, 4),
            "broadcast_s": round(t2 - t1, 4),
            **setup,
        }

    def rollout_bus_nccl_join(self, args: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's group now (ahead of the first update)."""
        t0 = time.perf_counter()
        r = self._rb_nccl(args)
        return {**r, "seconds": round(time.perf_counter() - t0, 4)}

    def _rb_nccl(self, a: dict[str, Any]) -> dict[str, Any]:
        """Join the trainer's NCCL group once per group id (trainer = rank 0,
        hosting a TCPStore at host:port); later updates reuse it. Ranks: the
        bridge's rank_offset + this worker's rank, else reserved from a counter
        in the store (each worker takes one)."""
        from datetime import timedelta

        from torch.distributed import TCPStore
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        st = self._rb()
        key = str(a.get("group_id") or f"{a['host']}:{a['port']}")
        if st["nccl"] is not None and st["nccl_key"] == key:
            return {"rank": st["nccl"].rank, "reused": True}
        # One communicator per group id (several sender ranks each own one);
        # a key seen before is made current again.
        comms: dict[str, Any] = st.setdefault("comms", {})
        if key in comms:
            st["nccl"], st["nccl_key"] = comms[key], key
            return {"rank": comms[key].rank, "reused": True}
        if not a.get("sender_group"):
            self.rollout_bus_nccl_close()  # one trainer group: a new one replaces it (the old may be broken)
        timeout = float(a.get("timeout_s", 300.0))
        store = TCPStore(
            a["host"],
            int(a["port"]),
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            use_libuv=False,
        )
        if a.get("rank_offset") is not None:
            rank = int(a["rank_offset"]) + int(getattr(self, "rank", 0))
        else:
            rank = int(store.add(f"rollout_bus/{key}/next_rank", 1))  # 1, 2, …: the trainer is 0
        pg = StatelessProcessGroup(rank=rank, world_size=int(a["world_size"]), store=store)
        st["nccl"], st["nccl_key"] = PyNcclCommunicator(pg, device=self._rb_device()), key
        comms[key] = st["nccl"]
        return {"rank": rank, "reused": False}

    def rollout_bus_nccl_close(self) -> None:
        st = self._rb()
        comms = st.get("comms") or {}
        st["comms"], st["nccl"], st["nccl_key"], st["staging"] = {}, None, None, None
        for comm in comms.values():
            try:
                comm.destroy()
            except Exception:
                pass

    def rollout_bus_commit(
        self, uid: str, shm: dict[str, Any] | None = None, opts: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        st = self._rb_check(uid)
        dev = self._rb_device()
        t0 = time.perf_counter()
        r: dict[str, Any] = {}
        try:
            with _on(dev):
                if shm is not None:
                    n = self._rb_commit_shm(st, shm, dev)
                else:
                    r = self._rb_apply(st, opts)
                    n = r.get("params_loaded", r.get("copies", -1))
                _sync(dev)
        finally:
            st.update(_fresh_state())  # drop the views: the trainer may free its buffers after the ack
        return {**r, "params_loaded": n, "seconds": time.perf_counter() - t0}

    def _rb_commit_shm(self, st: dict[str, Any], shm: dict[str, Any], dev: torch.device) -> int:
        """zmq transport: the backend wrote every bucket, once, into one shared
        memory file. Map it, copy each bucket to the GPU (one H2D copy), load
        from views of that copy. The map is closed before returning."""
        offsets = [int(o) for o in shm["offsets"]]
        fd = os.open(shm["path"], os.O_RDONLY)
        try:
            total = os.fstat(fd).st_size
            mm = mmap.mmap(fd, total, prot=mmap.PROT_READ) if total else None
        finally:
            os.close(fd)

        def tensors() -> Any:
            # One bucket on the GPU at a time; the loader pulls the next when done.
            for i, size in enumerate(st["sizes"]):
                with warnings.catch_warnings():  # read-only map: we only read it
                    warnings.simplefilter("ignore", UserWarning)
                    host = (
                        torch.frombuffer(mm, dtype=torch.uint8, count=int(size), offset=offsets[i])
                        if size
                        else torch.empty(0, dtype=torch.uint8)
                    )
                gpu = host.to(dev)
                del host
                yield from unpack_bucket(i, st["metas"], gpu)
                del gpu

        gen = tensors()
        try:
            # One load over every bucket (not one per bucket): a quantized model
            # must see all shards of a fused layer in one call (vllm_fp8).
            loaded = max(0, self._rb_load(gen))
        finally:
            gen.close()  # drop the last bucket's views before the map closes
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view still alive somewhere: the map goes with it
                    pass
        return loaded

    def rollout_bus_abort(self, uid: str | None = None) -> None:
        self._rb().update(_fresh_state())
