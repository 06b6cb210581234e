"""cuda_ipc inside every vLLM worker: map the trainer's buckets by CUDA IPC
handle (validated before anything is written), write, drop the maps; the
trainer's zero-copy mode keeps its maps across updates (keep_maps), and the
whole layout (metas, sizes, handles) under a token, so that the next update
with the same layout names only the token (rollout_bus_apply_kept;
engine_node/backends/vllm/weight_reuse.py is the backend's side)."""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch

from engine_node.backends.vllm.worker_apply import WorkerApply, _fresh_state, _on, _sync
from engine_node.backends.vllm.worker_reuse import Kept


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


class IpcReceive(WorkerApply):
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
        survive it, and sleep drops them all (rollout_bus_drop_maps). The same
        handles as the kept last update's (one list compare) are its very
        buckets: no per-handle lookup (vllm/worker_reuse)."""
        dev = self._rb_device()
        if len(handles) != len(st["sizes"]):
            raise ValueError(f"cuda_ipc: {len(handles)} handle(s) for {len(st['sizes'])} bucket(s)")
        kept: Kept | None = st.get("kept")
        if keep_maps and kept is not None and kept.handles is not None and kept.handles == handles:
            st["buckets"] = dict(enumerate(kept.buckets))
            st.update(keep_views=True, handles=kept.handles)
            self._rb_validate(st)
            return 0
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
        if keep_maps and not copied:
            st.update(keep_views=True, handles=list(handles))
        else:
            st["kept"] = None  # its views would pin maps that are no longer kept
        self._rb_validate(st)  # now: a lie fails the update before anything is written
        return copied

    def rollout_bus_recv_ipc(self, uid: str, handles: list[Any]) -> dict[str, Any]:
        st = self._rb_check(uid)
        t0 = time.perf_counter()
        copied = self._rb_open_ipc(st, handles)
        return {"bytes": int(sum(st["sizes"])), "seconds": time.perf_counter() - t0, "copied": copied}

    def rollout_bus_apply_ipc(
        self, uid: str, metas: list[Any], sizes: list[int], handles: list[Any], opts: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """cuda_ipc in one call: begin + map + validate + write + unmap.
        opts["kept_token"] (with keep_maps): keep this layout under that token
        for rollout_bus_apply_kept."""
        t0 = time.perf_counter()
        self.rollout_bus_begin(uid, metas, sizes)
        st = self._rb()
        st["ipc_kept"] = None  # replaced below only if this update keeps its maps
        return self._rb_apply_ipc(st, handles, opts or {}, t0, (st["metas"], st["sizes"], list(handles)))

    def rollout_bus_apply_kept(self, uid: str, token: str, opts: dict[str, Any] | None = None) -> dict[str, Any]:
        """The same update as the kept one (same metas, sizes and handles, i.e.
        the trainer's same parameters), named by its token: the node sends no
        metas and no handles (vllm/weight_reuse.KeptIpc). A token this worker
        does not hold (its maps were dropped: sleep, a failed update) is
        refused before anything is written."""
        t0 = time.perf_counter()
        st = self._rb()
        held = st.get("ipc_kept")
        if held is None or held[0] != token:
            raise RuntimeError(
                f"worker {getattr(self, 'rank', '?')}: cuda_ipc layout {token!r} is not kept here "
                f"(holds {held[0] if held else None!r}); send the update with its handles (field layout)"
            )
        _, metas, sizes, handles = held
        st.update(_fresh_state())
        st.update(uid=uid, metas=metas, sizes=sizes)
        return self._rb_apply_ipc(st, handles, {**(opts or {}), "keep_maps": True, "kept_token": token}, t0, None)

    def _rb_apply_ipc(
        self, st: dict[str, Any], handles: list[Any], opts: dict[str, Any], t0: float, keeps: tuple[Any, ...] | None
    ) -> dict[str, Any]:
        """Map (or reuse the kept maps), validate, write, drop the views.
        `keeps`: (metas, sizes, handles) to keep under opts["kept_token"] when
        the maps are kept (None: they are the kept ones already)."""
        dev = self._rb_device()
        keep = bool(opts.get("keep_maps"))
        token = opts.get("kept_token") if keep else None
        try:
            with _on(dev):
                copied = self._rb_open_ipc(st, handles, keep_maps=keep)
                t1 = time.perf_counter()
                r = self._rb_apply(st, opts)
        except BaseException:
            # a failed update keeps nothing of the trainer's
            st["maps"], st["kept"], st["ipc_kept"] = {}, None, None
            raise
        finally:
            # drop the views: the trainer may free its buffers after the ack
            # (kept maps stay in st["maps"]; _fresh_state does not name them)
            st.update(_fresh_state())
        if token and not copied and keeps is not None:
            st["ipc_kept"] = (token, *keeps)
        elif not token or copied:
            st["ipc_kept"] = None
        held = st.get("ipc_kept")
        return {
            **r,
            "open_s": round(t1 - t0, 4),
            "copied": copied,
            "maps_kept": len(st.get("maps") or {}),
            "kept_token": held[0] if held else None,
            "seconds": time.perf_counter() - t0,
        }

    def rollout_bus_drop_maps(self) -> int:
        """Forget every kept IPC map (keep_maps): before a sleep, so that the
        trainer's freed memory is really free for it while the engine sleeps."""
        st = self._rb()
        n = len(st.get("maps") or {})
        st["maps"], st["kept"], st["ipc_kept"] = {}, None, None  # the kept views pin the maps too
        return n
