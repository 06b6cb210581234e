"""The weight-update transaction (engine_node/weight_update.py) and the shell's
ack error mapping, without processes."""

from __future__ import annotations

import pytest
import torch

from bus import protocol as P
from bus.errors import BadRequest
from bus.tensors import pack_bucket, plan_buckets
from engine_node.backend import BackendError, BackendTimeout
from engine_node.control import ack_error_of
from engine_node.core import Pending, RequestCore
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
    assert up.current.phase is Phase.PREPARED
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
        up.commit(P.FinishWeightUpdate("u1"))
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
    res = _finish(up.commit(P.FinishWeightUpdate("l1")))
    assert "new" in res["loras"] and core.weight_version == 0 and core.config_epoch == 1
    with pytest.raises(BadRequest):
        up.begin(P.BeginWeightUpdate("l2", "cuda_ipc", metas, sizes, target="lora:new"))
    with pytest.raises(BadRequest):
        up.begin(P.BeginWeightUpdate("l3", "zmq", metas, sizes, target="nope"))


def test_ack_error_codes_are_typed() -> None:
    code, msg, field = ack_error_of(BackendTimeout("commit_weight_update", 600, "op_timeout_s"))
    assert code == "backend_timeout" and "op_timeout_s" in msg and field == "op_timeout_s"
    assert ack_error_of(BackendError("bad tensor", field="tensors")) == ("backend_refused", "bad tensor", "tensors")
    assert ack_error_of(BadRequest("bad mode", field="mode"))[::2] == ("bad_request", "mode")
    code, msg, field = ack_error_of(RuntimeError("boom"))
    assert code == "internal" and "boom" in msg and field is None
