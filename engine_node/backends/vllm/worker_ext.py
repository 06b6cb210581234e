"""Methods injected into every vLLM worker process (``worker_extension_cls``).

The vLLM backend starts its engine with
``worker_extension_cls="engine_node.backends.vllm.worker_ext.RolloutBusWorkerExtension"``;
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
  rollout_bus_recv_packed(uid, args, metas, sizes)
                                           vllm_nccl: as recv_nccl, but the group is the trainer's
                                           own vLLM NCCL weight-transfer group (joined as vLLM's
                                           receiver joins it) and the chunks arrive by vLLM's
                                           packed consumer (SkyRL's broadcast strategy)
  rollout_bus_commit(uid, shm, opts)       write the parameters from what was received, or (zmq)
                                           load_weights from the backend's shared-memory file `shm`
  rollout_bus_abort(uid)                   drop what is staged
Every worker receives the full (unsharded) tensors: vLLM's ``load_weights``
shards them for its TP rank itself.

Writing the parameters (`_rb_apply`): the first update of a layout runs vLLM's
`load_weights` (the truth) and records, alongside, the copy plan it amounts to
(vllm/weight_plan: which slice of which incoming tensor lands in which slice of
which parameter), then verifies the plan against what load_weights wrote, bit for
bit. Later updates replay the plan as device copies (a `copy_` per tensor of
16 MiB or more, one torch._foreach_copy_ for the rest), and only the names the
plan cannot express go through load_weights. A repeated update of the same layout
into buckets the worker keeps (zero-copy maps, nccl staging) reuses the validated
layout and the plan's cut source views (vllm/worker_reuse). Quantized models
never use a plan. `_rb_post_load` runs after every write (the hook for a
post-load step such as fp8 re-quantization; a no-op here). opts["plan"]=False
(or ROLLOUT_BUS_WEIGHT_PLAN=0 in the workers' environment) turns plans off.

Also: the engine's processes must not outlive the engine node (see
`engine_node.child_watch.arm`, run when this module is imported in a worker).

Nothing here imports vllm at module level, so the module imports on machines
without vLLM (the CPU tests import it).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
import warnings
from typing import Any

import torch

from bus.tensors import unpack_bucket
from engine_node.backends.vllm.worker_apply import _fresh_state, _on, _sync
from engine_node.backends.vllm.worker_ipc import IpcReceive
from engine_node.backends.vllm.worker_packed import PackedReceive
from engine_node.child_watch import NODE_PID_ENV as NODE_PID_ENV
from engine_node.child_watch import arm as arm_node_watch

# The engine's processes die with the node: this import is the first thing
# every worker runs of ours (TP=1: inside the EngineCore process, whose parent
# is the node; TP>1: a worker under the EngineCore, which it kills when the
# node goes). engine_node/child_watch.py has the mechanism and its hazards.
PARENT_DEATH = arm_node_watch()


class RolloutBusWorkerExtension(IpcReceive, PackedReceive):
    """Mixed into vLLM's Worker: `self` has model_runner, device, rank, local_rank.
    The update's state and apply: vllm/worker_apply; cuda_ipc: vllm/worker_ipc;
    nccl: vllm/worker_nccl; vllm_nccl: vllm/worker_packed (over nccl's staging);
    here: info, sleep buffers, commit (zmq included)."""

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
        self._rb().update(plans={}, kept=None)  # the plan stays valid, but be safe: learn it again
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
            # must see all shards of a fused layer in one call (vllm/fp8).
            loaded = max(0, self._rb_load(gen))
        finally:
            gen.close()  # drop the last bucket's views before the map closes
            if mm is not None:
                # BufferError: a view still alive somewhere: the map goes with it
                with contextlib.suppress(BufferError):
                    mm.close()
        return loaded
