"""The nccl sender's broadcast (trainer_bridge/transports/nccl_broadcast.py)
and delivery (NcclLink.deliver) on CPU: a recording communicator stands in
for NCCL, the store is the sender's real TCPStore, engine workers' check-ins
come from threads. What a GPU adds (streams, events) runs on the device
(bench/gpu/weight_update.py --nccl)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from bus import protocol as P
from bus.errors import ControlError
from bus.tensors import pack_bucket, plan_buckets
from trainer_bridge.transports import nccl
from trainer_bridge.transports.nccl_broadcast import (
    NotCheckedIn,
    check_in_key,
    forget_token,
    go_key,
    verdict_key,
    wait_check_in,
)

pytestmark = pytest.mark.timeout(60)


class Recorder:
    rank = 0

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        assert src == 0
        self.sent.append(t.clone())

    def destroy(self) -> None:
        pass


@pytest.fixture
def sender():
    s = nccl.NcclSender(3, device="cpu", timeout_s=5.0)  # the trainer + two engine workers
    s.comm = Recorder()
    yield s
    s.close()


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = [("embed", torch.randn(64, 16, generator=g))]  # 4 KiB: a bucket of its own, sent from its storage
    out += [(f"l{i}.w", torch.randn(7, 5, generator=g)) for i in range(9)]  # packed, several buckets
    out += [("odd", torch.randn(3, generator=g)), ("head", torch.randn(64, 16, generator=g))]
    return out


def _workers(s: nccl.NcclSender, token: str, n: int) -> list[threading.Thread]:
    def one() -> None:
        s.store.add(check_in_key(token), 1)

    th = [threading.Thread(target=one) for _ in range(n)]
    for t in th:
        t.start()
    return th


def test_every_bucket_goes_out_as_the_zmq_layout_packs_it(sender) -> None:
    named = _named()
    metas, sizes, tensors = plan_buckets(named, 600)
    _workers(sender, "t1", 2)
    r = sender.send(metas, sizes, tensors, "t1")
    want = [pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))]
    got = sender.comm.sent
    assert len(got) == len(sizes) > 4, "more buckets than the two pack buffers"
    assert [a.numel() for a in got] == sizes
    for m in metas:  # every tensor's bytes (alignment gaps are unspecified, as in pack_bucket)
        a, b = got[m.bucket], want[m.bucket]
        assert torch.equal(a[m.offset : m.offset + m.nbytes], b[m.offset : m.offset + m.nbytes]), m.name
    assert sender.last_send_info == {"buckets": len(sizes), "direct_buckets": 2}
    assert bytes(sender.store.get(go_key("t1"))) == b"1"
    assert r["bytes"] == sum(sizes) and {"check_in_s", "pack_launch_s", "verdict_s", "send_s"} <= set(r)
    # once every engine acked the op, its keys leave the store (nccl.NcclLink.deliver)
    forget_token(sender.store, "t1")
    assert not sender.store.check([check_in_key("t1")]) and not sender.store.check([go_key("t1")])
    forget_token(sender.store, "t1")  # twice, or keys never set: nothing to do
    # the NaN/inf check beside the broadcast: its verdict goes to the workers through the store
    _workers(sender, "t4", 2)
    sender.send(metas, sizes, tensors, "t4", None, lambda: lambda: "l3.w")
    assert sender.last_verdict == "l3.w" and bytes(sender.store.get(verdict_key("t4"))) == b"l3.w"
    _workers(sender, "t5", 2)
    sender.send(metas, sizes, tensors, "t5", None, lambda: lambda: None)
    assert sender.last_verdict is None and bytes(sender.store.get(verdict_key("t5"))) == b"ok"


def test_the_trainer_waits_for_every_worker_and_tells_them_to_stop_when_the_op_failed(sender) -> None:
    stop = threading.Event()
    _workers(sender, "t2", 1)  # one of two workers checked in; the op failed elsewhere
    threading.Timer(0.05, stop.set).start()
    with pytest.raises(NotCheckedIn):
        sender.send(*plan_buckets(_named(), 600), "t2", stop)
    assert sender.comm.sent == [], "nothing broadcast"
    assert bytes(sender.store.get(go_key("t2"))) == b"0", "the worker that checked in is told not to wait"
    for t in _workers(sender, "t3", 1):
        t.join()
    with pytest.raises(TimeoutError, match=r"1 of 2 engine worker.* nccl_timeout_s=0.05"):
        wait_check_in(sender.store, "t3", 2, None, 0.05)
    assert bytes(sender.store.get(go_key("t3"))) == b"0"


def _engines() -> list[P.EngineView]:
    return [P.EngineView(f"e{i}", healthy=True, dtype="float32", tp=1) for i in range(2)]


def test_deliver_broadcasts_nothing_when_the_op_fails_before_the_receive(monkeypatch, sender) -> None:
    monkeypatch.setattr(nccl, "nccl_sender", lambda engines, options, tensors, rank=None: (("k",), sender))
    nccl._NCCL_SENDERS[("k",)] = sender
    link = nccl.NcclLink(_engines(), {}, part=False, rank=None, tensors=[])
    _, args = link.part(*plan_buckets(_named(), 600))
    assert args.check_in

    async def refused() -> Any:
        sender.store.add(check_in_key(args.check_in), 1)  # e0's worker got in; e1 refused
        await asyncio.sleep(0.02)
        raise ControlError("begin failed on e1: unknown tensor", errors={"e1": "unknown tensor"})

    t0 = time.monotonic()
    with pytest.raises(ControlError, match="unknown tensor"):
        asyncio.run(link.deliver(refused(), 5.0))
    assert time.monotonic() - t0 < 2.0
    assert sender.comm.sent == [] and nccl._NCCL_SENDERS.get(("k",)) is sender, "the group is kept"
    assert bytes(sender.store.get(go_key(args.check_in))) == b"0"
    nccl._NCCL_SENDERS.clear()


def test_a_gpu_transport_without_cuda_is_a_typed_error_naming_the_transport():
    """CPU tensors, no device named, no CUDA in the process: Unsupported, not torch's assertion."""
    from bus.errors import Unsupported
    from trainer_bridge.transports.packing import device_of

    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    with pytest.raises(Unsupported) as e:
        device_of([torch.zeros(2)], None)
    assert e.value.field == "transport" and "transport='zmq'" in str(e.value)
