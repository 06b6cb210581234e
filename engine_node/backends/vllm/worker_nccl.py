"""nccl inside every vLLM worker: join the trainer's group once per group id
(kept for later updates), receive every bucket by broadcast into staging kept
while the layout is the same; multi-sender updates arrive one part per
sender's group."""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from bus.tensors import unpack_bucket
from engine_node.backends.vllm.worker_apply import WorkerApply, _fresh_state, _on, _sync

log = structlog.get_logger("rollout_bus.vllm_worker")


def received(st: dict[str, Any], marks: tuple[float, float, float, float], setup: dict[str, Any]) -> dict[str, Any]:
    """A broadcast receive's result: bytes staged and where its time went
    (marks: start, group set up, staging allocated, broadcast done)."""
    t0, t1, t2, t3 = marks
    return {
        "bytes": int(sum(st["sizes"])),
        "seconds": time.perf_counter() - t0,
        "setup_seconds": round(t1 - t0, 4),
        "alloc_s": round(t2 - t1, 4),
        "broadcast_s": round(t3 - t2, 4),
        **setup,
    }


class NcclReceive(WorkerApply):
    def rollout_bus_recv_nccl(
        self, uid: str, args: dict[str, Any], metas: list[Any] | None = None, sizes: list[int] | None = None
    ) -> dict[str, Any]:
        if metas is not None:  # begin folded into the receive (one call instead of two)
            self.rollout_bus_begin(uid, metas, list(sizes or []))
        st = self._rb_check(uid)
        try:
            return self._rb_recv_nccl(st, args)
        except BaseException:
            # Hazard (all-or-nothing): a receive that failed midway leaves some
            # staging buckets new and some old. The update is dropped here, so
            # a commit queued behind this receive (or sent by mistake) finds
            # no update and writes nothing: the old weights stay.
            st.update(_fresh_state())
            raise

    def _rb_recv_nccl(self, st: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
        dev = self._rb_device()
        t0 = time.perf_counter()
        self._rb_check_in(args)  # before the join: the trainer waits for it, not for NCCL
        setup = self._rb_nccl(args)
        t1 = time.perf_counter()
        comm = st["nccl"]
        staging = self._rb_staging(st, dev)
        t2 = time.perf_counter()
        with _on(dev):
            for i, buf in enumerate(staging):
                comm.broadcast(buf, src=0)
                st["buckets"][i] = buf
            _sync(dev)
        self._rb_verdict(args)
        t3 = time.perf_counter()
        # The staging outlives the update: the plan's views cut from it are kept
        # for the next update of this layout (vllm/worker_reuse), until nccl_close.
        st["keep_views"] = True
        self._rb_validate(st)
        return received(st, (t0, t1, t2, t3), setup)

    def _rb_check_in(self, a: dict[str, Any]) -> None:
        """Tell the trainer this worker is in the receive (NcclArgs.check_in)
        and wait for its go: it broadcasts only once every worker did, so an
        op refused before the receive (by the head, a node or a backend)
        leaves neither side blocked inside NCCL."""
        token = a.get("check_in")
        if not token:
            return
        store = self._rb_store(a)
        store.add(f"rollout_bus/in/{token}", 1)
        # Waits (up to the store's timeout_s) for the trainer's word: every
        # worker of every engine checked in, or the op failed elsewhere.
        if _store_get(store, f"rollout_bus/go/{token}", a, "the trainer's go") != b"1":
            raise RuntimeError(
                "nccl: the trainer will not broadcast this update (the op failed on another engine "
                "or at the head before every worker entered its receive); nothing was written"
            )

    def _rb_verdict(self, a: dict[str, Any]) -> None:
        """NcclArgs.verdict: the trainer's NaN/inf check ran beside the
        broadcast; its answer is in the store. Anything but b"ok" refuses the
        update here, before the vote (the receive fails: nothing written)."""
        token = a.get("check_in")
        if not (a.get("verdict") and token):
            return
        got = _store_get(self._rb_store(a), f"rollout_bus/ok/{token}", a, "the trainer's NaN/inf verdict")
        if got != b"ok":
            name = got.decode(errors="replace")
            raise ValueError(
                f"tensor {name!r} has NaN or inf values (the trainer's check beside the broadcast): "
                "nothing written (update_weights(check_finite=False) skips this check)"
            )

    def _rb_store(self, a: dict[str, Any]) -> Any:
        """A client of the trainer's TCPStore, one per group (kept: the
        check-in of every update and the group's set-up use it)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        stores: dict[str, Any] = self._rb().setdefault("stores", {})
        key = str(a.get("group_id") or f"{a['host']}:{a['port']}")
        store = stores.get(key)
        if store is None:
            store = stores[key] = TCPStore(
                a["host"],
                int(a["port"]),
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=float(a.get("timeout_s", 300.0))),
                use_libuv=False,
            )
        return store

    def _rb_staging(self, st: dict[str, Any], dev: torch.device) -> list[torch.Tensor]:
        """One flat uint8 buffer per bucket of the begun update. Kept across
        updates while the layout is the same: no allocation on the steady
        path. Hazard: its memory stays taken between updates (the bytes of one
        update); nccl_close drops it."""
        key = tuple(int(n) for n in st["sizes"])
        staging = st["staging"]
        if staging is None or staging[0] != key or any(b.device != dev for b in staging[1]):
            staging = st["staging"] = (key, [torch.empty(n, dtype=torch.uint8, device=dev) for n in key])
        return staging[1]

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
        self._rb_check_in(args)
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

    def _rb_nccl(self, a: dict[str, Any], make: Any = None) -> dict[str, Any]:
        """Join the trainer's NCCL group once per group id (trainer = rank 0,
        hosting a TCPStore at host:port); later updates reuse it. Ranks: the
        bridge's rank_offset + this worker's rank, else reserved from a counter
        in the store (each worker takes one). `make(a)`: (communicator, rank)
        of a group joined another way (vllm/worker_packed: as vLLM's receiver)."""
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
        comm, rank = (make or self._rb_nccl_make)(a)
        st["nccl"], st["nccl_key"] = comm, key
        st["comms"][key] = comm
        return {"rank": rank, "reused": False}

    def _rb_nccl_make(self, a: dict[str, Any]) -> tuple[Any, int]:
        """rollout-bus's own group: the trainer's TCPStore waits for no worker."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        store = self._rb_store(a)
        if a.get("rank_offset") is not None:
            rank = int(a["rank_offset"]) + int(getattr(self, "rank", 0))
        else:
            key = str(a.get("group_id") or f"{a['host']}:{a['port']}")
            rank = int(store.add(f"rollout_bus/{key}/next_rank", 1))  # 1, 2, …: the trainer is 0
        pg = StatelessProcessGroup(rank=rank, world_size=int(a["world_size"]), store=store)
        return PyNcclCommunicator(pg, device=self._rb_device()), rank

    def rollout_bus_nccl_close(self) -> None:
        st = self._rb()
        comms = st.get("comms") or {}
        st["comms"], st["nccl"], st["nccl_key"], st["staging"] = {}, None, None, None
        st["stores"] = {}
        st["kept"] = None  # (views of the staging)
        for comm in comms.values():
            try:
                comm.destroy()
            except Exception as e:  # a broken group is dropped all the same
                log.warning("nccl_destroy_failed", error=repr(e))


def _store_get(store: Any, key: str, a: dict[str, Any], what: str) -> bytes:
    """The trainer's word under `key`, waited for up to the store's timeout;
    past it a TimeoutError naming the knob (torch's own says only the key)."""
    try:
        return bytes(store.get(key))
    except RuntimeError as e:  # torch.distributed.DistStoreError: the wait timed out, or the trainer is gone
        raise TimeoutError(
            f"nccl: no {what} within nccl_timeout_s={a.get('timeout_s')} (the trainer's send never came, "
            f"or its store is gone): {e}; nothing was written"
        ) from e
