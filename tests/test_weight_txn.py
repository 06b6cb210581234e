"""The weight-update transaction (engine_node/weight_update.py) and the typed
ack failures (engine_node/actions.py), without processes."""

from __future__ import annotations

import pytest
import torch

from bus import protocol as P
from bus.errors import BadRequest
from bus.tensors import BucketPacker, pack_bucket, plan_buckets, unpack_bucket
from bus.transport import NcclArgs
from engine_node.actions import DEFERRED, Pending, SendAck, failure_of
from engine_node.backend import BackendError, BackendOp, BackendTimeout
from engine_node.core import RequestCore
from engine_node.weight_update import Phase, WeightUpdates
from tests.scripted_backend import ScriptedBackend


def _txn() -> tuple[ScriptedBackend, RequestCore, WeightUpdates]:
    b = ScriptedBackend()
    core = RequestCore(b, b.info(), "e0")
    return b, core, WeightUpdates(b, core, "e0", "inproc://w")


def _finish(res: object) -> dict:
    assert isinstance(res, Pending) and res.op.future.done()
    try:
        return res.then(res.op.future.result())
    except BaseException as e:
        if res.on_error:
            res.on_error(e)
        raise


def _begin(up: WeightUpdates, uid: str, target: str = "model", sizes: tuple[int, ...] = (8, 8)) -> None:
    metas = [P.TensorMeta(f"t{i}", "float32", [2], i, 0, 8) for i in range(len(sizes))]
    res = up.begin(P.BeginWeightUpdate(uid, "zmq", metas, list(sizes), target=target))
    if isinstance(res, Pending):
        res = _finish(res)
    assert res["buckets"] == len(sizes)


def test_phases_begun_receiving_prepared_committed() -> None:
    b, core, up = _txn()
    _begin(up, "u1")
    assert up.current.phase is Phase.BEGUN
    up.on_bucket("u1", 0, memoryview(bytes(8)))
    assert up.current.phase is Phase.RECEIVING
    up.on_bucket("u1", 1, memoryview(bytes(8)))
    assert up.current.phase is Phase.RECEIVING  # only a prepare makes it PREPARED
    vote = up.prepare(P.PrepareWeights("u1"))
    assert isinstance(vote, P.WeightsPrepared) and vote.buckets == 2 and vote.bytes == 16
    assert up.current.phase is Phase.PREPARED
    assert b.commits == 0 and core.weight_version == 0  # nothing visible before the commit
    rec = up.current
    res = _finish(up.commit(P.FinishWeightUpdate("u1")))
    assert rec.phase is Phase.COMMITTED and up.current is None
    assert res["weight_version"] == core.weight_version == 1 and res["bytes"] == 16
    assert b.commits == 1


def test_commit_before_every_bucket_aborts_and_names_the_missing_ones() -> None:
    _b, core, up = _txn()
    _begin(up, "u1")
    up.on_bucket("u1", 0, memoryview(bytes(8)))
    rec = up.current
    with pytest.raises(BackendError, match=r"\[1\] never received") as e:
        up.commit(P.FinishWeightUpdate("u1"))  # a commit without a prepare is refused
    assert e.value.field == "update_id"
    assert rec.phase is Phase.ABORTED and up.current is None and core.weight_version == 0


def test_bad_buckets_are_refused() -> None:
    _b, _core, up = _txn()
    _begin(up, "u1")
    with pytest.raises(BackendError, match="expected 8"):
        up.on_bucket("u1", 0, memoryview(bytes(7)))
    with pytest.raises(BackendError, match="not part of"):
        up.on_bucket("u1", 5, memoryview(bytes(8)))
    with pytest.raises(BackendError, match="no weight update 'zz'"):
        up.on_bucket("zz", 0, memoryview(bytes(8)))


def test_a_new_begin_supersedes_the_open_update() -> None:
    _b, _core, up = _txn()
    _begin(up, "u1")
    first = up.current
    _begin(up, "u2")
    assert first.phase is Phase.ABORTED and up.current.update_id == "u2"
    with pytest.raises(BackendError):
        up.commit(P.FinishWeightUpdate("u1"))


def test_lora_target_keeps_clones_and_commits_as_a_load() -> None:
    _b, core, up = _txn()
    a = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    metas, sizes, ts = plan_buckets([("x.lora_A.weight", a)])
    buf = bytearray(pack_bucket(0, metas, sizes, ts).numpy().tobytes())
    res = up.begin(P.BeginWeightUpdate("l1", "zmq", metas, sizes, target="lora:new"))
    assert res["buckets"] == 1
    up.on_bucket("l1", 0, memoryview(buf))
    buf[:] = bytes(len(buf))  # the frame is gone after the call
    assert torch.equal(up.current.lora_tensors[0][1], a)
    up.prepare(P.PrepareWeights("l1"))
    res = _finish(up.commit(P.FinishWeightUpdate("l1")))
    assert "new" in res["loras"] and core.weight_version == 0 and core.config_epoch == 1
    with pytest.raises(BadRequest):
        up.begin(P.BeginWeightUpdate("l2", "cuda_ipc", metas, sizes, target="lora:new"))
    with pytest.raises(BadRequest):
        up.begin(P.BeginWeightUpdate("l3", "zmq", metas, sizes, target="nope"))


def test_ack_error_codes_are_typed() -> None:
    f = failure_of(BackendTimeout("commit_weight_update", 600, "op_timeout_s"))
    assert f.code == "backend_timeout" and "op_timeout_s" in f.message and f.field == "op_timeout_s"
    assert failure_of(BackendError("bad tensor", field="tensors")) == P.EngineFailure(
        "backend_refused", "bad tensor", "tensors"
    )
    f = failure_of(BadRequest("bad mode", field="mode"))
    assert (f.code, f.field) == ("bad_request", "mode")
    f = failure_of(RuntimeError("boom"))
    assert f.code == "internal" and "boom" in f.message and f.field is None
    assert failure_of(ValueError("bad dtype")).code == "backend_refused"


def _only_ack(up: WeightUpdates) -> SendAck:
    """The one deferred ack the transaction produced (taken, as the shell does)."""
    [a] = up.take_actions()
    assert isinstance(a, SendAck) and a.ok == (a.failure is None) and (a.result is None) != a.ok
    return a


# ---------------------------------------------------------------- streamed, several senders, deadlines


def _streamed(up: WeightUpdates, uid: str, senders: int = 2) -> None:
    assert up.begin(P.BeginWeightUpdate(uid, "zmq", [], [], senders=senders, streamed=True))["buckets"] == 0


def _bucket(up: WeightUpdates, uid: str, sender: int, index: int, name: str, fill: int) -> None:
    meta = P.TensorMeta(name, "float32", [2], index, 0, 8)
    frame = bytes([fill]) * 8
    up.on_bucket(uid, index, memoryview(frame), sender=sender, metas=[meta], frame=frame)


def test_streamed_buckets_from_two_senders_reach_the_backend_only_at_prepare() -> None:
    b, core, up = _txn()
    b.begun = []
    _streamed(up, "s1")
    _bucket(up, "s1", 1, 0, "b0", 3)  # sender 1 first: order between senders is free
    _bucket(up, "s1", 0, 0, "a0", 1)
    _bucket(up, "s1", 0, 1, "a1", 2)
    up.on_sender_end("s1", 0, 2)
    assert b.staged == {} and up.current.phase is Phase.RECEIVING  # held, not staged yet
    assert up.prepare(P.PrepareWeights("s1", wait_s=5), seq=7) is DEFERRED  # sender 1 has not ended
    up.on_sender_end("s1", 1, 1)
    a = _only_ack(up)
    assert (a.seq, a.ok) == (7, True) and a.result.buckets == 3 and a.result.tensors == 3
    # global bucket order is (sender, index): a0, a1, then b0
    assert b.staged == {0: bytes([1]) * 8, 1: bytes([2]) * 8, 2: bytes([3]) * 8}
    res = _finish(up.commit(P.FinishWeightUpdate("s1", version=5)))
    assert res["weight_version"] == core.weight_version == 5 and b.commits == 1  # once, for both senders


def test_a_sender_that_never_ends_fails_the_prepare_naming_it() -> None:
    b, core, up = _txn()
    _streamed(up, "s2")
    _bucket(up, "s2", 0, 0, "a0", 1)
    up.on_sender_end("s2", 0, 1)
    core.now = 10.0
    assert up.prepare(P.PrepareWeights("s2", wait_s=1.0), seq=3) is DEFERRED
    up.tick(10.5)
    assert not up.actions
    up.tick(11.5)
    a = _only_ack(up)
    assert a.seq == 3 and not a.ok and "sender(s) [1] never finished" in a.failure.message
    assert "wait_s=1.0" in a.failure.message and a.failure.field == "senders"
    assert a.failure.code == "backend_refused"
    assert up.current is None and b.commits == 0 and core.weight_version == 0


def test_a_declared_bucket_that_never_came_fails_the_prepare() -> None:
    _b, _core, up = _txn()
    _streamed(up, "s3", senders=1)
    _bucket(up, "s3", 0, 1, "a1", 1)
    up.on_sender_end("s3", 0, 2)  # says 2 buckets; bucket 0 was lost
    assert up.prepare(P.PrepareWeights("s3", wait_s=0.0), seq=1) is DEFERRED
    up.tick(1.0)
    assert "(0, 0)" in _only_ack(up).failure.message and up.current is None


def test_bad_streamed_input_is_refused() -> None:
    _b, _core, up = _txn()
    _streamed(up, "s4")
    with pytest.raises(BackendError, match="not one of the 2 sender"):
        _bucket(up, "s4", 2, 0, "x", 1)
    with pytest.raises(BackendError, match="claims bytes"):
        up.on_bucket("s4", 0, memoryview(bytes(4)), metas=[P.TensorMeta("x", "float32", [2], 0, 0, 8)])
    _bucket(up, "s4", 0, 0, "a0", 1)
    with pytest.raises(BackendError, match="duplicate"):
        _bucket(up, "s4", 0, 0, "a0", 1)
    with pytest.raises(BackendError, match="declared 0 bucket"):
        up.on_sender_end("s4", 0, 0)


def test_a_prepared_update_without_a_decision_is_discarded_after_the_ttl() -> None:
    b, core, up = _txn()
    up.prepare_ttl_s = 2.0
    _begin(up, "u1")
    up.on_bucket("u1", 0, memoryview(bytes(8)))
    up.on_bucket("u1", 1, memoryview(bytes(8)))
    core.now = 100.0
    up.prepare(P.PrepareWeights("u1"))
    up.tick(101.0)
    assert up.current is not None
    up.tick(102.5)  # e.g. this process was frozen (SIGSTOP) past the decision
    assert up.current is None and b.staged == {} and core.weight_version == 0
    with pytest.raises(BackendError, match="no weight update 'u1'"):
        up.commit(P.FinishWeightUpdate("u1"))  # a commit that arrives later cannot apply it


def test_an_open_update_that_stops_receiving_is_dropped_after_the_ttl() -> None:
    _b, core, up = _txn()
    up.prepare_ttl_s = 2.0
    core.now = 5.0
    _begin(up, "u1")
    up.on_bucket("u1", 0, memoryview(bytes(8)))
    up.tick(6.0)
    assert up.current is not None
    up.tick(7.5)
    assert up.current is None


def test_an_abort_fails_a_waiting_prepare() -> None:
    _b, _core, up = _txn()
    _streamed(up, "s5")
    assert up.prepare(P.PrepareWeights("s5"), seq=9) is DEFERRED
    up.abort(P.AbortWeightUpdate("s5"))
    a = _only_ack(up)
    assert a.seq == 9 and not a.ok and "aborted" in a.failure.message and up.current is None


def test_streamed_tensors_the_backend_refuses_abort_at_prepare() -> None:
    b, _core, up = _txn()

    def refuse(uid, transport, tensors, args):
        return BackendOp.failed("begin_weight_update", BackendError("tensor 'a0': no such parameter", field="tensors"))

    b.begin_weight_update = refuse
    _streamed(up, "s6", senders=1)
    _bucket(up, "s6", 0, 0, "a0", 1)
    up.on_sender_end("s6", 0, 1)
    with pytest.raises(BackendError, match="'a0'"):
        up.prepare(P.PrepareWeights("s6"))
    assert up.current is None


def test_bucket_packer_matches_plan_buckets_and_holds_one_bucket() -> None:
    named = [(f"t{i}", torch.randn(n)) for i, n in enumerate([10, 300, 5, 2000, 1, 64])]
    metas, sizes, ts = plan_buckets(named, 1024)
    packer = BucketPacker(1024)
    got = []
    for n, t in named:
        got += packer.add(n, t)
    got += packer.flush()
    assert [m for _i, ms, _b in got for m in ms] == metas
    assert [b.numel() for _i, _m, b in got] == sizes
    for i, ms, b in got:  # same tensors at the same offsets (padding is not compared)
        for (n, x), (_n, y) in zip(
            unpack_bucket(i, ms, b), unpack_bucket(i, metas, pack_bucket(i, metas, sizes, ts)), strict=True
        ):
            assert torch.equal(x, y) and torch.equal(x, dict(named)[n])


# ---------------------------------------------------------------- several GPU senders


def _gpu_parts(up: WeightUpdates, uid: str, senders: int = 2, transport: str = "nccl") -> None:
    res = up.begin(P.BeginWeightUpdate(uid, transport, [], [], senders=senders, streamed=True))
    if isinstance(res, Pending):
        _finish(res)


def _group(sender: int) -> NcclArgs:
    return NcclArgs(host="127.0.0.1", port=1000 + sender, world_size=2, group_id=f"g{sender}", sender_group=True)


def _part(up: WeightUpdates, uid: str, sender: int, names: tuple[str, ...]) -> object:
    metas = [P.TensorMeta(n, "float32", [2], 0, 8 * i, 8) for i, n in enumerate(names)]
    return up.receive(
        P.ReceiveWeights(
            uid, sender=sender, tensors=metas, bucket_sizes=[8 * len(names)], transport_args=_group(sender)
        )
    )


def test_gpu_parts_of_two_senders_commit_once_after_both() -> None:
    b, core, up = _txn()
    _gpu_parts(up, "g1")
    ack = _finish(_part(up, "g1", 1, ("b0", "b1")))
    assert isinstance(ack, P.ReceiveWeightsResult)
    assert up.current.phase is Phase.RECEIVING, "a part is not a vote"
    assert up.prepare(P.PrepareWeights("g1", wait_s=5.0)) is DEFERRED  # sender 0 is still missing
    _finish(_part(up, "g1", 0, ("a0",)))
    a = _only_ack(up)  # the deferred prepare completed with the last part
    assert a.ok and a.result.buckets == 2 and a.result.tensors == 3 and a.result.bytes == 24
    assert b.parts == [(1, ["b0", "b1"], [16]), (0, ["a0"], [8])]
    res = _finish(up.commit(P.FinishWeightUpdate("g1")))
    assert b.commits == 1 and res["weight_version"] == core.weight_version == 1


def test_gpu_part_refusals_name_the_sender_and_a_silent_sender_fails_the_prepare() -> None:
    b, core, up = _txn()
    _gpu_parts(up, "g2")
    with pytest.raises(BadRequest, match="sender 2 is not one of the 2") as e:
        _part(up, "g2", 2, ("x",))
    assert e.value.field == "sender"
    _finish(_part(up, "g2", 0, ("a0",)))
    with pytest.raises(BadRequest, match="sender 0 already sent its part") as e:
        _part(up, "g2", 0, ("a1",))
    assert e.value.field == "sender"
    assert up.prepare(P.PrepareWeights("g2", wait_s=1.0)) is DEFERRED
    core.set_time(core.now + 2.0, 0.0)
    up.tick(core.now)
    a = _only_ack(up)
    assert not a.ok and "sender(s) [1] never finished sending" in a.failure.message
    assert b.commits == 0 and core.weight_version == 0


def test_a_refused_gpu_part_aborts_the_update() -> None:
    b, core, up = _txn()
    _gpu_parts(up, "g3")
    with pytest.raises(BackendError, match="sender 1: bad refused"):
        _finish(_part(up, "g3", 1, ("bad",)))
    assert up.current is None or up.current.phase is Phase.ABORTED
    assert b.commits == 0


def test_the_head_counts_a_part_ack_as_no_vote() -> None:
    from router_node.cluster_state import ClusterWeights

    cw = ClusterWeights()
    for uid, senders in (("one", 1), ("two", 2)):
        cw.on_control(
            P.BeginWeightUpdate(uid, "nccl", [], [], senders=senders, streamed=senders > 1), ["e0"], client=b"t"
        )
        cw.on_votes(uid, {"e0": P.ReceiveWeightsResult(seconds=0.1)})
        if uid == "one":
            cw.on_control(
                P.AbortWeightUpdate("one"), client=b"t"
            )  # one update at a time: end it before the next begins
    assert cw.txns["one"].prepared == {"e0"}, "one sender: its receive is the vote"
    assert cw.txns["two"].prepared == set(), "two senders: a part ack is not a vote"
    cw.on_votes("two", {"e0": P.WeightsPrepared(buckets=2)})
    assert cw.txns["two"].prepared == {"e0"}


def test_gpu_parts_need_a_backend_that_takes_them() -> None:
    class ZmqOnly(ScriptedBackend):
        receive_part = None  # type: ignore[assignment]

    b = ZmqOnly()
    core = RequestCore(b, b.info(), "e0")
    up = WeightUpdates(b, core, "e0", "inproc://w")
    with pytest.raises(BadRequest, match="several GPU senders' parts only over zmq") as e:
        up.begin(P.BeginWeightUpdate("g4", "cuda_ipc", [], [], senders=2, streamed=True))
    assert e.value.field == "transport" and up.current is None


def _nccl_begin(up: WeightUpdates, uid: str) -> Pending:
    metas = [P.TensorMeta("t0", "float32", [2], 0, 0, 8)]
    res = up.begin(P.BeginWeightUpdate(uid, "nccl", metas, [8], prepare=True))
    assert isinstance(res, Pending)
    return res


def test_nccl_begin_receives_and_votes_in_one_op_when_the_broadcast_lands() -> None:
    """Two round trips over NCCL: the begin carries prepare=True, the engine
    waits in the receive (the trainer broadcasts meanwhile), and the begin's
    ack is the vote; the commit is the second round trip."""
    import concurrent.futures

    b, core, up = _txn()
    b.receive_gate = concurrent.futures.Future()
    res = _nccl_begin(up, "n1")
    assert not res.op.future.done(), "the engine waits for the broadcast inside the begin"
    assert up.current.phase is not Phase.PREPARED
    b.receive_gate.set_result({"bytes": 8})
    vote = _finish(res)
    assert isinstance(vote, P.WeightsPrepared) and vote.buckets == 1 and vote.bytes == 8
    assert up.current.phase is Phase.PREPARED and b.commits == 0

    from router_node.cluster_state import ClusterWeights

    cw = ClusterWeights()
    cw.on_control(P.BeginWeightUpdate("n1", "nccl", [], [8], prepare=True), ["e0"])
    cw.on_votes("n1", {"e0": vote})
    assert cw.txns["n1"].prepared == {"e0"}, "the head takes the begin's ack as the vote: no prepare round"

    res2 = _finish(up.commit(P.FinishWeightUpdate("n1")))
    assert b.commits == 1 and res2["weight_version"] == core.weight_version == 1


def test_a_broken_broadcast_inside_the_begin_aborts_the_update() -> None:
    import concurrent.futures

    b, core, up = _txn()
    b.receive_gate = concurrent.futures.Future()
    res = _nccl_begin(up, "n2")
    b.receive_gate.set_exception(BackendError("nccl: the trainer's group broke mid-broadcast"))
    with pytest.raises(BackendError, match="group broke"):
        _finish(res)
    assert up.current is None or up.current.phase is Phase.ABORTED
    assert b.commits == 0 and core.weight_version == 0
