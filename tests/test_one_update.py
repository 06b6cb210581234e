"""Issue 22, "one update at a time, exactly": the head's weight-update
transaction state machine (router_node/cluster_state.py, no sockets), the
engine's finite check and keyed staging, then the failures of the issue on
real processes (a head, two torch engines, trainers over zmq).

- two trainers at once: one lands, the other gets UpdateInProgress naming the
  holder (no livelock; the cluster version counts the commits);
- A prepared, B begins: B refused, A commits;
- a commit that fails on every engine: the version does not move;
- a vanished trainer's update ends by weight_txn_timeout_s and its stale
  abort never touches the next update;
- NaN weights: refused before the vote, naming the tensor; old weights stay;
- a version not above the cluster's: refused, naming `version`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from bus import protocol as P
from bus.codec import Codec
from bus.control_bus import ControlBus
from bus.errors import BadRequest, ControlError, StaleUpdate, UpdateInProgress
from engine_node.core import Pending, RequestCore
from engine_node.weight_update import WeightUpdates
from router_node.cluster_state import ClusterWeights
from router_node.config import RouterConfig
from router_node.control import ClusterControl
from tests.cluster import ROOT, Cluster, child_env, leak_checked_cluster, wait_until
from tests.scripted_backend import ScriptedBackend

# ---------------------------------------------------------------- state machine (no I/O)


def _begin(cw: ClusterWeights, uid: str, client: bytes = b"trainer-a", now: float = 10.0) -> None:
    cw.on_control(P.BeginWeightUpdate(uid, "zmq", [], [8]), ["e0", "e1"], client=client, now=now, wall=1.7e9)


def test_a_second_begin_is_refused_naming_the_holder_and_changes_nothing() -> None:
    cw = ClusterWeights(txn_timeout_s=120)
    _begin(cw, "A")
    with pytest.raises(UpdateInProgress) as e:
        _begin(cw, "B", client=b"trainer-b", now=13.5)
    msg = str(e.value)
    assert "'A'" in msg and "trainer-a" in msg and "since" in msg and "3.5s ago" in msg, msg
    assert "weight_txn_timeout_s=120" in msg and e.value.field == "update_id"
    assert cw.current is not None and cw.current.update_id == "A" and cw.current.decision is None
    assert "B" not in cw.txns
    with pytest.raises(StaleUpdate, match="already began"):  # an id runs once
        cw.on_control(P.AbortWeightUpdate("A"), client=b"trainer-a")
        _begin(cw, "A")


def test_prepare_vote_commit_moves_the_version_only_when_an_engine_committed() -> None:
    cw = ClusterWeights()
    _begin(cw, "A")
    cw.on_control(P.PrepareWeights("A"), ["e0", "e1"], client=b"trainer-a")
    cw.on_votes("A", {"e0": P.WeightsPrepared(buckets=1), "e1": P.WeightsPrepared(buckets=1)})
    txn = cw.current
    assert txn is not None and txn.prepared == {"e0", "e1"}
    assert cw.decide_commit(txn, None, [0, 0]) == 1
    with pytest.raises(UpdateInProgress, match="committing"):  # still held during its commit round
        _begin(cw, "B", client=b"trainer-b")
    assert cw.commit_done(txn, {}) is False, "no engine committed"
    assert cw.version == 0 and cw.updates_committed == 0 and cw.current is None
    with pytest.raises(StaleUpdate, match="commit failed on every engine"):
        cw.require(P.FinishWeightUpdate("A"), "A")
    _begin(cw, "B", client=b"trainer-b")
    txn = cw.current
    assert txn is not None
    cw.decide_commit(txn, None, [0, 0])
    assert cw.commit_done(txn, {"e0": 1}) is True  # e1 failed: it is stale now, below the version
    assert cw.version == 1 and cw.updates_committed == 1 and cw.is_stale(0)


def test_a_frozen_engine_that_acks_the_commit_late_moves_the_version() -> None:
    cw = ClusterWeights()
    _begin(cw, "A")
    txn = cw.current
    assert txn is not None
    cw.decide_commit(txn, 4, [])
    assert cw.commit_done(txn, {}, missing=True) is False and cw.version == 0
    assert cw.late_commit(3) is False
    assert cw.late_commit(4) is True and cw.version == 4


def test_ops_naming_an_update_that_is_not_current_are_refused_and_change_nothing() -> None:
    cw = ClusterWeights()
    _begin(cw, "A")
    cw.on_control(P.AbortWeightUpdate("A"), client=b"trainer-a")  # the trainer's own abort ends it
    assert cw.current is None and cw.txns["A"].decision == "abort"
    _begin(cw, "B", client=b"trainer-b")
    for op in (P.AbortWeightUpdate("A"), P.PrepareWeights("A"), P.ReceiveWeights("A"), P.AbortWeightUpdate("Z")):
        with pytest.raises(StaleUpdate) as e:
            cw.on_control(op, ["e0"])
        assert e.value.field == "update_id" and "'B'" in str(e.value), str(e.value)
    with pytest.raises(StaleUpdate, match="ended"):
        cw.require(P.FinishWeightUpdate("A"), "A")
    assert cw.current is not None and cw.current.update_id == "B" and cw.current.decision is None
    # No update current and an id never seen (a head restarted mid-update): the caller relays.
    cw.on_control(P.AbortWeightUpdate("B"), client=b"trainer-b")
    assert cw.require(P.FinishWeightUpdate("Q"), "Q") is None


def test_an_undecided_update_expires_after_the_timeout_finishing_or_not() -> None:
    cw = ClusterWeights(txn_timeout_s=5)
    _begin(cw, "A", now=100.0)
    assert cw.expired(104.0) is None
    txn = cw.expired(105.5)
    assert txn is not None and txn.update_id == "A"
    # Its FinishWeightUpdate is in and its prepare runs: the head's bound still
    # applies (issue 34 row 7: the client's timeout_s never lengthens the hold).
    txn.finishing = True
    assert cw.expired(200.0) is txn
    assert cw.bounded(txn, 1e9, now=103.0) == pytest.approx(2.0)  # what is left of the head's 5 s
    assert cw.bounded(txn, 0.5, now=103.0) == 0.5  # a shorter client timeout wins
    assert cw.held_by(b"trainer-a") is txn and cw.held_by(b"trainer-b") is None
    cw.decide_commit(txn, None, [0])  # decided: its commit round has its own bound, no expiry
    assert cw.expired(300.0) is None and cw.bounded(txn, 1e9, now=300.0) == 5


def test_versions_are_monotonic_equal_only_to_sync_stale_engines() -> None:
    cw = ClusterWeights()
    cw.version = 5
    _begin(cw, "A")
    txn = cw.current
    assert txn is not None
    for version, targets in ((4, [5, 5]), (5, [5, 4]), (5, [])):
        with pytest.raises(BadRequest, match="not above the cluster weight version 5") as e:
            cw.check_version(txn, version, targets)
        assert e.value.field == "version"
    cw.check_version(txn, 5, [3, 4])  # sync_stale: every target below the cluster
    cw.check_version(txn, 6, [5, 5])
    cw.check_version(txn, None, [5])  # the head picks one above everything


def test_abort_held_by_ends_the_holders_update_the_lease_hook() -> None:
    """The hook client leases call (router_node/control.py): the holder's open
    update is aborted, another client's call changes nothing, the next begin
    is taken."""

    class Pub:
        def __init__(self) -> None:
            self.sent: list[list] = []

        def send_multipart(self, frames: list) -> None:
            self.sent.append(frames)

    replies: list = []
    cc = ClusterControl(
        RouterConfig(weight_txn_timeout_s=60),
        ControlBus(Pub(), Codec()),  # type: ignore[arg-type]
        {},
        reply=lambda client, msg: replies.append((client, msg)),
        forget=lambda e: None,
    )
    begin = P.Control(request_id="r1", op=P.BeginWeightUpdate("A", "zmq", [], [8]), timeout_s=5)
    cc.on_control(b"trainer-a", begin, [])
    assert cc.cluster.current is not None and cc.cluster.current.holder == b"trainer-a"
    assert cc.abort_held_by(b"trainer-b", "lease expired") == []
    assert cc.cluster.current is not None
    assert cc.abort_held_by(b"trainer-a", "lease of trainer-a expired (lease_s=2)") == ["A"]
    assert cc.cluster.current is None and cc.cluster.txns["A"].decision == "abort"
    assert "lease of trainer-a expired" in cc.cluster.txns["A"].reason
    assert cc.abort_held_by(b"trainer-a", "again") == []
    with pytest.raises(StaleUpdate):  # its trainer's late commit is refused
        cc.on_control(b"trainer-a", P.Control(request_id="r2", op=P.FinishWeightUpdate("A"), timeout_s=5), [])
    cc.on_control(
        b"trainer-b", P.Control(request_id="r3", op=P.BeginWeightUpdate("B", "zmq", [], [8]), timeout_s=5), []
    )
    assert cc.cluster.current is not None and cc.cluster.current.update_id == "B"


# ---------------------------------------------------------------- engine side (no sockets)


def _engine() -> tuple[ScriptedBackend, WeightUpdates]:
    b = ScriptedBackend()
    return b, WeightUpdates(b, RequestCore(b, b.info(), "e0"), "e0", "inproc://w")


def _f32(*values: float) -> memoryview:
    return memoryview(torch.tensor(values, dtype=torch.float32).numpy().tobytes())


@pytest.mark.parametrize("check", [True, False])
def test_the_engine_refuses_nan_at_the_prepare_naming_the_tensor_unless_opted_out(check: bool) -> None:
    b, up = _engine()
    metas = [P.TensorMeta("w.ok", "float32", [2], 0, 0, 8), P.TensorMeta("w.bad", "float32", [2], 1, 0, 8)]
    res = up.begin(P.BeginWeightUpdate("u1", "zmq", metas, [8, 8], check_finite=check))
    if isinstance(res, Pending):
        res.then(res.op.future.result())
    up.on_bucket("u1", 0, _f32(1.0, 2.0))
    up.on_bucket("u1", 1, _f32(float("nan"), float("inf")))
    if not check:
        assert isinstance(up.prepare(P.PrepareWeights("u1")), P.WeightsPrepared)
        return
    with pytest.raises(Exception, match="tensor 'w.bad' has NaN or inf values") as e:
        up.prepare(P.PrepareWeights("u1"))
    assert getattr(e.value, "field", None) == "tensors" and "check_finite=False" in str(e.value)
    assert up.current is None and b.commits == 0  # aborted before any vote


def test_a_stale_abort_queued_in_the_torch_backend_never_wipes_the_next_update(tiny_model: str) -> None:
    """The node aborts update A (its abort runs later, on the backend's worker)
    and begins B at once: the abort is keyed to A and leaves B's staging."""
    from bus.tensors import pack_bucket, plan_buckets
    from engine_node.backends.torch.backend import TorchBackend

    # The abort waits on the worker until B has begun: the order of the race that wiped B.
    be = TorchBackend(tiny_model, device="cpu", fault_op_delay_s={"abort_weight_update": 0.3})
    try:
        named = [(n, p.detach().clone()) for n, p in be.model.named_parameters()][:2]
        metas, sizes, tensors = plan_buckets(named, 1 << 20)
        assert be.begin_weight_update("A", "zmq", metas, {"bucket_sizes": sizes}).future.result(5)
        stale = be.abort_weight_update()  # A's abort, keyed to A
        assert be.begin_weight_update("B", "zmq", metas, {"bucket_sizes": sizes}).future.result(5)
        stale.future.result(10)
        for i in range(len(sizes)):
            be.stage_bucket(i, memoryview(pack_bucket(i, metas, sizes, tensors).numpy()).cast("B"))
        assert be.commit_weight_update().future.result(30)["tensors"] == len(named)
    finally:
        be.close()


# ---------------------------------------------------------------- real processes

T = 20.0
TTL = 1.5  # engines' --prepare-ttl-s: a prepared update with no decision is dropped after it
TXN_S = 6.0  # the head's --weight-txn-timeout-s

# A trainer process. "rounds": N updates, each printed as ok / busy (UpdateInProgress) / error.
# "vanish": open an update (the begin, no bytes), print its id, die without a word.
TRAINER = r"""
import json, os, sys, time, torch
from transformers import AutoModelForCausalLM
from bus.errors import UpdateInProgress
from trainer_bridge import Client
front, model, mode, rounds, seed, go = sys.argv[1:7]
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
g = torch.Generator().manual_seed(int(seed))
named = [(k, p.detach() + torch.randn(p.shape, generator=g) * 0.01) for k, p in m.named_parameters()]
with Client(front, control_timeout_s=30) as c:
    if mode == "vanish":
        upd = c.weight_update(timeout_s=30)
        upd._client._call(upd._upd.open(plan=named))
        print(json.dumps({"update_id": upd.update_id}), flush=True)
        os._exit(0)
    open(f"{go}.{seed}.ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    for r in range(int(rounds)):
        try:
            res = c.update_weights(named, timeout_s=30, bucket_bytes=1 << 15)
            print(json.dumps({"round": r, "ok": sorted(res)}), flush=True)
        except UpdateInProgress as e:
            print(json.dumps({"round": r, "busy": str(e)}), flush=True)
        except Exception as e:
            print(json.dumps({"round": r, "error": f"{type(e).__name__}: {e}"}), flush=True)
"""


def _trainer(cl: Cluster, tiny_model: str, mode: str, rounds: int, seed: int, go: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, cl.frontend, tiny_model, mode, str(rounds), str(seed), go],
        env=child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(p: subprocess.Popen) -> list[dict]:
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"trainer {p.pid} did not finish within 120s: {out} {err[-2000:]}") from None
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines, f"trainer {p.pid} rc={p.returncode} printed nothing: {err[-2000:]}"
    return lines


def _weights(tiny_model: str, seed: int, scale: float = 0.01) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + torch.randn(p.shape, generator=g) * scale) for n, p in m.named_parameters()]


@pytest.fixture(scope="module")
def cl(tiny_model):
    with leak_checked_cluster(
        2,
        backend="torch",
        model=tiny_model,
        engine_args=["--prepare-ttl-s", str(TTL)],
        router_args=["--weight-txn-timeout-s", str(TXN_S)],
    ) as c:
        yield c


def _version(c) -> int:
    return int(c.health()["weight_version"])


def _in_sync(c) -> dict:
    """Every engine healthy on the cluster version; returns health."""

    def ok():
        h = c.health()
        es = h["engines"].values()
        return all(e["healthy"] and e["weight_version"] == h["weight_version"] for e in es) and len(es) == 2 and h

    return wait_until(ok, 30, "both engines healthy on the cluster version")


def _tokens(c) -> list[int]:
    return list(c.generate([1, 2, 3, 4], P.SamplingParams(max_tokens=8, temperature=0.0)).token_ids)


@pytest.mark.timeout(240)
def test_two_trainers_updating_at_once_land_one_update_each_time_no_livelock(cl, tiny_model, tmp_path):
    c = cl.client()
    before = _version(c)
    go = str(tmp_path / "go")
    procs = [_trainer(cl, tiny_model, "rounds", 3, seed, go) for seed in (1, 2)]
    wait_until(lambda: all(os.path.exists(f"{go}.{s}.ready") for s in (1, 2)), 90, "both trainers loaded")
    open(go, "w").close()  # both start their rounds together
    rounds = [line for p in procs for line in _lines(p)]
    assert len(rounds) == 6, rounds
    errors = [r for r in rounds if "error" in r]
    assert not errors, errors
    ok = [r for r in rounds if "ok" in r]
    busy = [r for r in rounds if "busy" in r]
    assert all(r["ok"] == ["e0", "e1"] for r in ok), ok
    for r in busy:
        assert "holds the cluster since" in r["busy"] and "of client" in r["busy"], r
    assert len(ok) >= 3, f"no progress: {rounds}"  # whenever one was refused, the holder landed
    h = _in_sync(c)
    assert h["weight_version"] == before + len(ok), (h["weight_version"], before, rounds)


@pytest.mark.timeout(120)
def test_a_prepared_update_keeps_the_cluster_while_another_trainer_begins(cl, tiny_model):
    a, b = cl.client(), cl.client()
    before = _version(a)
    mine, theirs = _weights(tiny_model, 3), _weights(tiny_model, 4)
    upd = a.weight_update(timeout_s=T, bucket_bytes=1 << 15)
    with upd:  # (within the engines' prepare_ttl_s between steps)
        upd.sender(0).send(mine)
        votes = upd.prepare()
        assert set(votes) == {"e0", "e1"}
        with pytest.raises(UpdateInProgress) as e:
            b.update_weights(theirs, timeout_s=T)
        assert repr(upd.update_id) in str(e.value) and e.value.field == "update_id", str(e.value)
    assert set(upd.results) == {"e0", "e1"}
    h = _in_sync(a)
    assert h["weight_version"] == before + 1


@pytest.mark.timeout(120)
def test_a_commit_that_fails_on_every_engine_leaves_the_cluster_version(cl, tiny_model):
    """Both engines voted, then dropped the prepared update (no decision within
    their prepare_ttl_s): the commit fails everywhere, so nothing moved."""
    c = cl.client()
    before = _version(c)
    named = _weights(tiny_model, 5)
    upd = c.weight_update(timeout_s=T, bucket_bytes=1 << 15)
    with pytest.raises(ControlError) as e:
        with upd:
            upd.sender(0).send(named)
            upd.prepare()
            time.sleep(TTL + 1.0)
    assert "e0" in str(e.value) and "e1" in str(e.value) and not e.value.results, str(e.value)
    h = _in_sync(c)
    assert h["weight_version"] == before and all(not x.get("stale") for x in h["engines"].values())
    assert set(c.update_weights(_weights(tiny_model, 6), timeout_s=T)) == {"e0", "e1"}  # the slot is free
    assert _in_sync(c)["weight_version"] == before + 1


@pytest.mark.timeout(180)
def test_a_vanished_trainers_update_times_out_and_its_stale_abort_spares_the_next(cl, tiny_model, tmp_path):
    c = cl.client()
    named = _weights(tiny_model, 7)
    for _ in range(1):  # one round: the old race failed 10 of 10
        before = _version(c)
        p = _trainer(cl, tiny_model, "vanish", 0, 8, str(tmp_path / "unused"))
        gone = _lines(p)[0]["update_id"]
        # Right behind the head's timeout abort of the vanished update: retry while refused.
        t0 = time.monotonic()
        while True:
            try:
                res = c.update_weights(named, timeout_s=T, bucket_bytes=1 << 15)
                break
            except UpdateInProgress as e:
                assert repr(gone) in str(e), str(e)
                assert time.monotonic() - t0 < TXN_S + 20, "the vanished update was never ended"
                time.sleep(0.01)
        assert set(res) == {"e0", "e1"}, res
        assert _in_sync(c)["weight_version"] == before + 1
        # Its trainer's abort, arriving late, is refused and changes nothing.
        with pytest.raises(StaleUpdate) as e:
            c.control(P.AbortWeightUpdate(gone))
        assert "ended" in str(e.value) and "weight_txn_timeout_s" in str(e.value), str(e.value)
    # A stale abort in the middle of a live update: refused, the live one commits.
    before = _version(c)
    upd = c.weight_update(timeout_s=T, bucket_bytes=1 << 15)
    with upd:
        with pytest.raises(StaleUpdate, match=f"the current one is {upd.update_id!r}"):
            c.control(P.AbortWeightUpdate(gone))
        upd.sender(0).send(named)
    assert set(upd.results) == {"e0", "e1"} and _in_sync(c)["weight_version"] == before + 1


@pytest.mark.timeout(120)
def test_nan_weights_are_refused_before_the_vote_and_the_cluster_keeps_its_weights(cl, tiny_model):
    c = cl.client()
    h0 = _in_sync(c)
    tokens = _tokens(c)
    named = _weights(tiny_model, 9)
    name, t = named[3]
    t = t.clone()
    t.view(-1)[7] = float("nan")
    named[3] = (name, t)
    with pytest.raises(ControlError) as e:
        c.update_weights(named, timeout_s=T, bucket_bytes=1 << 15)
    assert f"tensor {name!r} has NaN or inf values" in str(e.value) and "field=tensors" in str(e.value), str(e.value)
    assert not e.value.results
    h = _in_sync(c)
    assert h["weight_version"] == h0["weight_version"]
    assert [x["weight_version"] for x in h["engines"].values()] == [h0["weight_version"]] * 2
    assert _tokens(c) == tokens, "the cluster serves the old weights"
    # GPU transports: the bytes never pass the engine node, the trainer checks before the begin.
    with pytest.raises(BadRequest, match=f"tensor {name!r} has NaN or inf values") as e2:
        c.update_weights(named, transport="nccl", timeout_s=T)
    assert e2.value.field == "tensors"
    assert _in_sync(c)["weight_version"] == h0["weight_version"]


def test_a_gpu_sender_rank_refuses_nan_before_sending() -> None:
    import asyncio

    from trainer_bridge.transports.registry import sender_kind

    bad = [("w.ok", torch.ones(3)), ("w.inf", torch.tensor([1.0, float("inf")]))]
    kw = dict(bucket_bytes=1 << 20, timeout_s=5.0, cast=lambda t: t, options={})
    g = sender_kind("cuda_ipc").part_sender(None, "u1", 1, [], **kw)
    with pytest.raises(BadRequest, match="sender 1: tensor 'w.inf' has NaN or inf values") as e:
        asyncio.run(g.send(bad))
    assert e.value.field == "tensors"


@pytest.mark.timeout(120)
def test_a_version_not_above_the_clusters_is_refused_naming_version(cl, tiny_model):
    c = cl.client()
    named = _weights(tiny_model, 10)
    v = _in_sync(c)["weight_version"]
    for version in (v, v - 1):
        upd = c.weight_update(timeout_s=T, version=version, bucket_bytes=1 << 15)
        with pytest.raises(BadRequest) as e:
            with upd:
                upd.sender(0).send(named)
        assert e.value.field == "version" and f"version {version} is not above" in str(e.value), str(e.value)
        assert _in_sync(c)["weight_version"] == v
    upd = c.weight_update(timeout_s=T, version=v + 5, bucket_bytes=1 << 15)
    with upd:
        upd.sender(0).send(named)
    assert _in_sync(c)["weight_version"] == v + 5
