"""The vllm_nccl receive inside the vLLM backend on CPU: the real backend ops
(engine_node/backends/vllm/transports.py), the real worker extension
(vllm/worker_packed.py over vllm/worker_nccl's group cache and staging, the
commit of vllm/worker_apply) in the FAKE vLLM engine of
tests/test_vllm_backend_cpu.py. Only the collective is fake: a FAKE
communicator that hands out the trainer's packed bytes, and a FAKE of vLLM's
packed consumer (same cut, one reused buffer per slot, overwritten after each
callback as vLLM's reuse would) — the NCCL run is tests/gpu/test_skyrl_gpu.py."""

from __future__ import annotations

import pytest
import torch

from bus import protocol as P
from bus.transport import Transport, VllmNcclArgs
from engine_node.backend import BackendError
from engine_node.backends.vllm import worker_packed as WP
from engine_node.transports.vllm_nccl import engine_args
from tests import test_vllm_backend_cpu as T
from tests.test_vllm_backend_cpu import be_slow, model_dir, wait  # noqa: F401 (fixtures)
from trainer_bridge.transports.vllm_nccl import packed_plan


class FakeGroupComm:
    """FAKE PyNcclCommunicator: broadcast() fills the buffer with the next
    bytes of what the trainer broadcast (a short or long buffer takes what
    NCCL would: the next n bytes)."""

    def __init__(self) -> None:
        self.rank = 2
        self.stream = torch.empty(0, dtype=torch.uint8)
        self.sizes: list[int] = []

    def send(self, chunks: list[torch.Tensor]) -> None:
        self.stream = torch.cat([self.stream, *chunks])

    def broadcast(self, buf: torch.Tensor, src: int = 0) -> None:
        assert src == 0 and buf.dtype == torch.uint8
        n = buf.numel()
        buf.copy_(self.stream[:n])
        self.stream = self.stream[n:]
        self.sizes.append(n)

    def destroy(self) -> None:
        pass


def fake_packed_consumer(iterator, group, src, post_unpack_func, buffer_size_bytes, num_buffers):
    """FAKE of vLLM's packed_nccl_broadcast_consumer on CPU: the same cut (a
    chunk closes after the tensor that goes past buffer_size_bytes), each
    chunk received into a slot buffer that is overwritten right after its
    callback (vLLM reuses it for a later chunk)."""
    slot = 0
    chunk: list[tuple[str, list[int], torch.dtype]] = []

    def flush() -> None:
        nonlocal slot
        sizes = [int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for _, s, d in chunk]
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
        group.broadcast(buf, src=src)
        views = [(n, part.view(d).view(*s)) for (n, s, d), part in zip(chunk, buf.split(sizes), strict=True)]
        post_unpack_func(views)
        buf.fill_(0xAB)  # the reuse: a view kept past the callback would see this
        slot = (slot + 1) % num_buffers
        chunk.clear()

    total = 0
    for name, (shape, dtype) in iterator:
        chunk.append((name, shape, dtype))
        total += int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if total > buffer_size_bytes:
            flush()
            total = 0
    if chunk:
        flush()


def _packed(named: list[tuple[str, torch.Tensor]], metas: list[P.TensorMeta], n: int) -> list[torch.Tensor]:
    """The trainer's chunks as vLLM's producer broadcasts them (tensors back to back)."""
    by = dict(named)
    return [torch.cat([by[m.name].reshape(-1).view(torch.uint8) for m in metas if m.bucket == i]) for i in range(n)]


@pytest.fixture
def rig(be_slow, monkeypatch):  # noqa: F811 (the imported fixture)
    comm = FakeGroupComm()
    joins: list[dict] = []

    def fake_make(self, a):
        joins.append(dict(a))
        return comm, int(a["rank_offset"]) + self._rb_worker_rank()

    monkeypatch.setattr(T.FAKE.worker.__class__, "_rb_vllm_make", fake_make)
    monkeypatch.setattr(WP, "packed_consumer", lambda: fake_packed_consumer)
    return be_slow, comm, joins


def _begin(be, uid, metas, sizes, buffer_bytes=48):
    args = VllmNcclArgs(
        host="10.0.0.7",
        port=29511,
        world_size=4,
        rank_offsets={"e0": 1, "e1": 2},
        group_id="vllm:10.0.0.7:29511",
        packed_buffer_size_bytes=buffer_bytes,
        packed_num_buffers=2,
    )
    op = P.BeginWeightUpdate(uid, Transport.VLLM_NCCL, metas, sizes, transport_args=args, prepare=True)
    return wait(be.begin_weight_update(uid, "vllm_nccl", list(op.tensors), engine_args(op, "e1")), be=be)


def test_fake_comm_packed_receive_stages_then_commits_one_update(rig) -> None:
    be, comm, joins = rig
    old = {n: t.clone() for n, t in T.FAKE.worker.weights.items()}
    # the join (init_weight_update_communicator): no tensors, the group only
    _begin(be, "join", [], [])
    r = wait(be.receive_weights([]), be=be)
    assert r["nccl"]["reused"] is False and len(joins) == 1
    assert joins[0]["rank_offset"] == 2 and joins[0]["world_size"] == 4  # e1's offset + worker rank 0
    wait(be.abort_weight_update(), be=be)

    new = [("w.a", torch.arange(16, dtype=torch.float32).reshape(4, 4)), ("w.b", torch.full((8,), 7.0))]
    metas, sizes = packed_plan([n for n, _ in new], ["float32"] * 2, [list(t.shape) for _, t in new], 48)
    assert sizes == [64, 32]  # w.a alone goes past 48 bytes: two chunks
    _begin(be, "u1", metas, sizes)
    comm.send(_packed(new, metas, len(sizes)))
    r = wait(be.receive_weights([]), be=be)
    assert r["nccl"]["reused"] is True and len(joins) == 1, "the joined group is reused"
    assert comm.sizes == [64, 32] and r["bytes"] == 96
    for n, t in old.items():  # staged only: nothing live before the commit
        assert torch.equal(T.FAKE.worker.weights[n], t), n
    wait(be.commit_weight_update(), be=be)
    for n, t in new:  # copied out of the consumer's buffers (overwritten after each callback)
        assert torch.equal(T.FAKE.worker.weights[n], t), n

    # an abort after a full receive keeps the committed weights
    _begin(be, "u2", metas, sizes)
    comm.send(_packed([(n, t + 1) for n, t in new], metas, len(sizes)))
    wait(be.receive_weights([]), be=be)
    wait(be.abort_weight_update(), be=be)
    for n, t in new:
        assert torch.equal(T.FAKE.worker.weights[n], t), n


def test_fake_comm_chunks_cut_differently_fail_the_receive_naming_it(rig) -> None:
    be, comm, _ = rig
    new = [("w.a", torch.ones(4, 4)), ("w.b", torch.ones(8))]
    metas, sizes = packed_plan([n for n, _ in new], ["float32"] * 2, [[4, 4], [8]], 48)
    before = {n: t.clone() for n, t in T.FAKE.worker.weights.items()}
    # the begin's plan cut at 48 bytes; the consumer is told 1000 (another packing): one chunk of two
    _begin(be, "u3", metas, sizes, buffer_bytes=1000)
    comm.send(_packed(new, metas, len(sizes)))
    with pytest.raises(BackendError, match="chunk 0 holds 2 tensors, the plan says 1"):
        wait(be.receive_weights([]), be=be)
    wait(be.abort_weight_update(), be=be)
    for n, t in before.items():
        assert torch.equal(T.FAKE.worker.weights[n], t), n


def test_vllm_nccl_takes_no_sender_parts(rig) -> None:
    be, _, _ = rig
    _begin(be, "u4", [], [])
    with pytest.raises(BackendError, match="one sender") as e:
        wait(be.receive_part(0, [], [], [], {}), be=be)
    assert e.value.field == "transport"
    wait(be.abort_weight_update(), be=be)
