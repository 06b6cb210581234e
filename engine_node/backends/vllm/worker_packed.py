"""vllm_nccl inside every vLLM worker: join the trainer's vLLM NCCL
weight-transfer group as vLLM's own receiver does, and receive its packed
broadcast with vLLM's packed consumer into the nccl transport's staging
buffers (vllm/worker_nccl). Nothing live changes here: the commit
(rollout_bus_commit) writes the parameters, an abort drops the staging.

Hazards:
- vLLM's consumer hands each chunk's tensors as VIEWS of a buffer it reuses
  for the chunk after next: `PackedSink` copies them out inside the callback,
  on the consumer's stream, which the consumer synchronizes before reusing the
  buffer.
- The trainer's TCPStore (vLLM's StatelessProcessGroup.create at rank 0)
  waits until every rank's client has counted itself in: a worker must join
  with StatelessProcessGroup.create too (rollout-bus's own nccl join, whose
  store waits for no one, would leave the trainer waiting).
- A chunk whose names differ from the begin's plan means the two sides cut
  the chunks differently (another vLLM version's packing): the receive fails
  naming the tensor, and the group is out of step (the next begin joins anew
  only with a new group id).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine_node.backends.vllm.worker_apply import _on, _sync
from engine_node.backends.vllm.worker_nccl import NcclReceive, received

DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM 0.24's DEFAULT_PACKED_BUFFER_SIZE_BYTES
DEFAULT_NUM_BUFFERS = 2


def packed_consumer() -> Callable[..., None]:
    """vLLM's `packed_nccl_broadcast_consumer` (the receiving half of
    NCCLWeightTransferEngine.receive_weights with packed=True)."""
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    return packed_nccl_broadcast_consumer


class PackedSink:
    """The consumer's `post_unpack_func`: chunk k's tensors land in staging
    bucket k at their planned offsets (metas: [name, dtype, shape, bucket,
    offset, nbytes], the begin's plan of vLLM's chunks)."""

    def __init__(self, metas: list[list[Any]], staging: list[torch.Tensor]) -> None:
        self.staging = staging
        self.buckets: list[list[list[Any]]] = [[] for _ in staging]
        for m in metas:
            self.buckets[int(m[3])].append(m)
        self.metas = metas
        self.chunks = 0

    def infos(self) -> Iterator[tuple[str, tuple[list[int], torch.dtype]]]:
        """What the consumer iterates: (name, (shape, dtype)) in the plan's order."""
        for m in self.metas:
            yield str(m[0]), ([int(d) for d in m[2]], getattr(torch, str(m[1])))

    def __call__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        k = self.chunks
        if k >= len(self.buckets):
            raise RuntimeError(f"vllm_nccl: chunk {k} arrived, the plan has {len(self.buckets)}")
        want = self.buckets[k]
        if len(named) != len(want):
            raise RuntimeError(f"vllm_nccl: chunk {k} holds {len(named)} tensors, the plan says {len(want)}")
        buf = self.staging[k]
        for (name, t), m in zip(named, want, strict=True):
            if name != m[0]:
                raise RuntimeError(f"vllm_nccl: chunk {k} holds {name!r} where the plan has {m[0]!r}")
            src = t.reshape(-1).view(torch.uint8)
            off, nbytes = int(m[4]), int(m[5])
            if src.numel() != nbytes:
                raise RuntimeError(f"vllm_nccl: tensor {name!r} has {src.numel()} bytes, the plan says {nbytes}")
            buf[off : off + nbytes].copy_(src)  # out of the consumer's reused buffer
        self.chunks += 1

    def done(self) -> None:
        if self.chunks != len(self.buckets):
            raise RuntimeError(f"vllm_nccl: {self.chunks} chunk(s) arrived, the plan has {len(self.buckets)}")


class PackedReceive(NcclReceive):
    def rollout_bus_recv_packed(
        self, uid: str, args: dict[str, Any], metas: list[Any] | None = None, sizes: list[int] | None = None
    ) -> dict[str, Any]:
        """Begin (metas given), join the group (once per group id), receive
        every chunk into staging, validate. An update with no tensors only
        joins (the trainer's init_weight_update_communicator)."""
        if metas is not None:
            self.rollout_bus_begin(uid, metas, list(sizes or []))
        st = self._rb_check(uid)
        dev = self._rb_device()
        t0 = time.perf_counter()
        setup = self._rb_nccl(args, make=self._rb_vllm_make)
        t1 = time.perf_counter()
        staging = self._rb_staging(st, dev) if st["metas"] else []
        sink = PackedSink(st["metas"], staging)
        t2 = time.perf_counter()
        if st["metas"]:
            with _on(dev):
                packed_consumer()(
                    iterator=sink.infos(),
                    group=st["nccl"],
                    src=0,
                    post_unpack_func=sink,
                    buffer_size_bytes=int(args.get("packed_buffer_size_bytes", DEFAULT_BUFFER_BYTES)),
                    num_buffers=int(args.get("packed_num_buffers", DEFAULT_NUM_BUFFERS)),
                )
                _sync(dev)
        sink.done()
        t3 = time.perf_counter()
        for i, buf in enumerate(staging):
            st["buckets"][i] = buf
        self._rb_validate(st)
        return received(st, (t0, t1, t2, t3), setup)

    def _rb_worker_rank(self) -> int:
        """This worker's rank across the engine's data-parallel groups, as
        vLLM's init_transfer_engine computes it."""
        pc = getattr(self, "parallel_config", None)
        rank = int(getattr(pc, "rank", getattr(self, "rank", 0)) or 0)
        dp = int(getattr(pc, "data_parallel_index", 0) or 0)
        return dp * int(getattr(pc, "world_size", 1) or 1) + rank

    def _rb_vllm_make(self, a: dict[str, Any]) -> tuple[Any, int]:
        """(communicator, rank) as NCCLWeightTransferEngine.init_transfer_engine
        makes them: rank_offset + worker rank, StatelessProcessGroup.create."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if a.get("rank_offset") is None:
            raise RuntimeError("vllm_nccl: no rank_offset for this engine (transport_args.rank_offsets)")
        rank = int(a["rank_offset"]) + self._rb_worker_rank()
        pg = StatelessProcessGroup.create(
            host=str(a["host"]),
            port=int(a["port"]),
            rank=rank,
            world_size=int(a["world_size"]),
            store_timeout=int(float(a.get("timeout_s", 300.0))),
        )
        return PyNcclCommunicator(pg, device=self._rb_device()), rank
