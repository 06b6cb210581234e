"""The trainer's NCCL update sequence (trainer_bridge.transports.gpu.GpuSender.push), with a
scripted head and a scripted NCCL group: two round trips, the broadcast runs
while the engines wait inside the begin, and a broken broadcast aborts.

The head and the group are fakes on purpose (the test is about the order of
the trainer's messages); the real thing runs on the device
(tests/gpu/test_vllm_e2e.py::test_e2e_nccl_trainer_gpu0, bench/gpu/weight_update.py)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from bus import protocol as P
from bus.transport import NcclArgs
from trainer_bridge.transports import nccl
from trainer_bridge.weights import push_weights


class ScriptedNcclGroup:
    """Stands in for NcclSender: send() is the broadcast."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.sent = threading.Event()
        self.closed = False
        self.last_verdict: str | None = None  # the in-band NaN/inf check's finding (none here)
        self.begin_seen_before_send: bool | None = None
        self.head: ScriptedHead | None = None

    def args(self, *, weight_check: bool = False, sender_group: bool = False) -> NcclArgs:
        return NcclArgs(host="127.0.0.1", port=1, world_size=2, group_id="g", sender_group=sender_group)

    def send(
        self,
        metas: list[Any],
        sizes: list[int],
        tensors: list[Any],
        check_in: str = "",
        stop: Any = None,
        verdict: Any = None,
    ) -> dict[str, Any]:
        assert self.head is not None
        self.begin_seen_before_send = any(isinstance(op, P.BeginWeightUpdate) for op in self.head.ops)
        if self.fail:
            raise RuntimeError("NCCL error: remote process exited")
        self.sent.set()
        return {"bytes": int(sum(sizes))}

    def close(self) -> None:
        self.closed = True


class ScriptedHead:
    """Answers control ops like the head would for one engine that waits in the
    begin until the broadcast lands (the vote), then commits."""

    def __init__(self, group: ScriptedNcclGroup) -> None:
        self.group = group
        self.ops: list[Any] = []

    async def health_view(self) -> P.HealthView:
        return P.HealthView(True, {"e0": P.EngineView("e0", healthy=True, dtype="float32", tp=1)})

    async def control(self, op: Any, targets: Any = None, timeout_s: float = 10.0, strict: bool = True) -> Any:
        self.ops.append(op)
        if isinstance(op, P.BeginWeightUpdate):
            assert op.prepare, "the begin carries the receive and the prepare"
            for _ in range(200):  # the engine blocks in the receive until the broadcast
                if self.group.sent.is_set():
                    return {"e0": P.WeightsPrepared(buckets=len(op.bucket_sizes))}
                if self.group.fail and self.group.begin_seen_before_send is not None:
                    from bus.errors import ControlError

                    raise ControlError("begin failed on e0: nccl receive broke")
                await asyncio.sleep(0.01)
            raise AssertionError("the broadcast never happened while the begin was in flight")
        if isinstance(op, P.FinishWeightUpdate):
            return {"e0": P.WeightsCommitted(weight_version=1)}
        if isinstance(op, P.AbortWeightUpdate):
            return {"e0": P.WeightsAborted()}
        raise AssertionError(f"unexpected op {type(op).__name__}")


def _install(monkeypatch: pytest.MonkeyPatch, group: ScriptedNcclGroup) -> ScriptedHead:
    head = ScriptedHead(group)
    group.head = head

    def nccl_sender(engines: Any, options: Any, tensors: Any, rank: Any = None) -> Any:
        nccl._NCCL_SENDERS[("scripted",)] = group  # type: ignore[assignment]
        return ("scripted",), group

    monkeypatch.setattr(nccl, "nccl_sender", nccl_sender)
    return head


def _push(head: ScriptedHead) -> dict[str, Any]:
    named = [("a", torch.ones(4)), ("b", torch.zeros(3))]
    return asyncio.run(
        push_weights(head, named, transport="nccl", bucket_bytes=None, targets=None, timeout_s=10.0, options={})  # type: ignore[arg-type]
    )


def test_an_nccl_update_is_two_round_trips_with_the_broadcast_inside_the_begin(monkeypatch: pytest.MonkeyPatch) -> None:
    group = ScriptedNcclGroup()
    head = _install(monkeypatch, group)
    res = _push(head)
    assert [type(op).__name__ for op in head.ops] == ["BeginWeightUpdate", "FinishWeightUpdate"]
    assert group.begin_seen_before_send is True, "the begin is published before the broadcast starts"
    assert res["e0"].weight_version == 1


def test_a_broken_broadcast_drops_the_group_and_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    group = ScriptedNcclGroup(fail=True)
    head = _install(monkeypatch, group)
    with pytest.raises(RuntimeError, match="remote process exited"):
        _push(head)
    assert [type(op).__name__ for op in head.ops] == ["BeginWeightUpdate", "AbortWeightUpdate"]
    assert group.closed and ("scripted",) not in nccl._NCCL_SENDERS, "a broken group is never reused"
