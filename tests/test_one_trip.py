"""The one-trip weight update (issue 21 §2): a zero-copy cuda_ipc update whose
layout every engine holds is ONE op; its fallbacks; the pipelined pause →
update → resume.

Without a GPU: the head's decision (router_node/one_trip.py) and the engine's
kept layout (engine_node/one_trip.py) are tested as they are; the cuda_ipc
bytes go through tests/ipc_backend.py (the torch backend reading "handles"
that are files) and a trainer-side stand-in for the zero-copy share
(`cpu_zero_copy`: one file per trainer tensor, the same path every update),
in real processes."""

from __future__ import annotations

import pytest
import torch

from bus import protocol as P
from bus.errors import BackendRefused, BadRequest, ControlError
from bus.transport import CudaIpcArgs
from router_node.one_trip import Layouts, one_trip_targets
from router_node.registry import EngineState
from tests.cluster import Streams, wait_until
from tests.test_control_plane import _perturbed, _reference

pytestmark = pytest.mark.timeout(240)
H, S, C = EngineState.HEALTHY, EngineState.STALE, EngineState.CONVERGING
T = 60.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _fast(layout: str = "L", **kw) -> P.BeginWeightUpdate:
    return P.BeginWeightUpdate("u", "cuda_ipc", [], [], layout=layout, commit=True, **kw)


# ---------------------------------------------------------------- the head's decision (no I/O)


def test_one_trip_goes_out_only_when_every_target_holds_the_layout() -> None:
    held = {"e0": "L", "e1": "L", "e2": "L"}
    states = {"e0": H, "e1": S, "e2": C, "e3": EngineState.JOINING}
    assert one_trip_targets(_fast(), None, states, held) == ["e0", "e1", "e2"]  # joining: not a target
    assert one_trip_targets(_fast(), ["e1"], states, held) == ["e1"]
    with pytest.raises(BackendRefused, match=r"\['e1'\] do not hold") as e:
        one_trip_targets(_fast(), None, states, {**held, "e1": "OLD"})
    assert e.value.field == "layout"
    with pytest.raises(BackendRefused, match=r"\['e3'\]"):
        one_trip_targets(_fast(), ["e3"], states, {**held, "e3": "L"})  # joining: never
    with pytest.raises(BackendRefused, match="no engine holds"):
        one_trip_targets(_fast(), None, {}, {})
    silent = {**states, "e0": EngineState.SILENT}
    with pytest.raises(BackendRefused, match=r"\['e0'\]"):
        one_trip_targets(_fast(), ["e0", "e1"], silent, held)


@pytest.mark.parametrize(
    ("op", "why"),
    [
        (_fast(layout=""), "names no layout"),
        (P.BeginWeightUpdate("u", "zmq", [], [], layout="L", commit=True), "not cuda_ipc"),
        (_fast(handles=[b"h"]), "carries handles"),
        (_fast(target="lora:a"), "not a one-sender model update"),
        (_fast(senders=2, streamed=True), "not a one-sender model update"),
    ],
)
def test_a_malformed_one_trip_begin_is_refused_naming_commit(op, why) -> None:
    with pytest.raises(BadRequest, match=why) as e:
        one_trip_targets(op, None, {"e0": H}, {"e0": "L"})
    assert e.value.field == "commit"


def test_layouts_follow_commits_and_are_forgotten_by_sleep() -> None:
    lay = Layouts()
    lay.committed("e0", "L")
    lay.committed("e1", "L")
    lay.on_fan_out(P.Pause(), ["e0", "e1"])
    assert lay.held == {"e0": "L", "e1": "L"}
    lay.on_fan_out(P.Sleep(level=1), ["e0"])
    assert lay.held == {"e1": "L"}
    lay.committed("e1", "")  # an update without a layout
    assert lay.held == {}


# ---------------------------------------------------------------- the engine's kept layout (no I/O)


def test_engine_keeps_only_a_zero_copy_layout_and_forgets_it_after_a_sleep() -> None:
    from engine_node.one_trip import KeptLayout

    metas = [P.TensorMeta("w", "float32", [2], 0, 0, 8)]
    full = P.BeginWeightUpdate(
        "u1", "cuda_ipc", metas, [8], transport_args=CudaIpcArgs(keep_maps=True), prepare=True,
        handles=[b"h"], layout="L",
    )  # fmt: skip
    kept = KeptLayout()
    assert kept.committed(full, sleeps=0) == "L"
    got = kept.take(_fast(version=7), 0, "e0")
    assert got.update_id == "u" and got.handles == [b"h"] and got.tensors == metas
    assert got.prepare and not got.commit and got.version is None
    checked = kept.take(_fast(transport_args=CudaIpcArgs(keep_maps=True, weight_check=True)), 0, "e0")
    assert checked.transport_args.weight_check, "the op's own args (weight_check) win over the kept ones"
    with pytest.raises(BackendRefused, match="holds layout 'L'") as e:
        kept.take(_fast("OTHER"), 0, "e0")
    assert e.value.field == "layout" and kept.layout == "L"
    with pytest.raises(BackendRefused, match="slept since"):
        kept.take(_fast(), 1, "e0")
    assert kept.layout == ""  # gone for good
    # packed (not zero-copy) or without a layout id: nothing kept
    assert kept.committed(P.BeginWeightUpdate("u2", "cuda_ipc", metas, [8], handles=[b"h"], layout="L"), 0) == ""
    assert kept.committed(msgspec_replace(full, layout=""), 0) == ""


def msgspec_replace(op, **kw):
    import msgspec

    return msgspec.structs.replace(op, **kw)


# ---------------------------------------------------------------- real processes


@pytest.fixture
def cpu_zero_copy(monkeypatch, tmp_path):
    """The trainer's zero-copy share, on CPU: one file per tensor storage (the
    'handle' is its path, the same every update while the tensor stays where
    it is), rewritten at every share, read by tests/ipc_backend.py."""
    from bus.tensors import dtype_name
    from trainer_bridge.transports import cuda_ipc, one_trip

    def plan(named):
        metas = [
            P.TensorMeta(n, dtype_name(t), list(t.shape), i, 0, t.numel() * t.element_size())
            for i, (n, t) in enumerate(named)
        ]
        return metas, [m.nbytes for m in metas], [t for _, t in named]

    def share(tensors, written=None):
        out = []
        for t in tensors:
            path = tmp_path / f"{t.data_ptr():x}-{t.numel()}-{t.dtype}".replace("torch.", "")
            path.write_bytes(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
            out.append(str(path).encode())
        return out

    monkeypatch.setattr(cuda_ipc, "plan_zero_copy", plan)
    monkeypatch.setattr(cuda_ipc, "share_in_place", share)
    one_trip.CACHES.clear()
    yield tmp_path
    one_trip.CACHES.clear()


def _params(tiny_model, seed: int) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().contiguous() for n, p in _perturbed(tiny_model, seed).named_parameters()}


def _step(params: dict[str, torch.Tensor], tiny_model, seed: int):
    """The optimizer step: the same tensors, new values; the model they make."""
    new = _perturbed(tiny_model, seed)
    for n, p in new.named_parameters():
        params[n].copy_(p.detach())
    return new


def _paths(res) -> set[str]:
    return {r.detail.get("path") for r in res.values()}


def _update(c, params, **kw):
    return c.update_weights(list(params.items()), transport="cuda_ipc", zero_copy=True, timeout_s=T, **kw)


def steady_state(c, params, tiny_model, update, each=lambda res: None) -> set[str]:
    """The first update goes two round trips and leaves one layout on every
    engine; the next two are one op each, same layout, version +1, both
    engines greedy-equal to the reference on the new weights. Returns the
    layout (any transport: `update(c, params)` sends one)."""
    p = [21, 22, 23, 24]
    res = update(c, params)  # the first: the plan / handles in the begin, two round trips
    assert _paths(res) == {"two_trip"} and {r.weight_version for r in res.values()} == {1}
    layout = {r.layout for r in res.values()}
    assert len(layout) == 1 and "" not in layout
    for k, seed in enumerate((2, 3), start=2):  # the steady state: one op
        new = _step(params, tiny_model, seed)
        res = update(c, params)
        assert _paths(res) == {"one_trip"}, res
        assert {r.weight_version for r in res.values()} == {k} and c.health()["weight_version"] == k
        assert {r.layout for r in res.values()} == layout
        each(res)
        ref, _ = _reference(new, p, 8)
        for _ in range(2):  # both engines
            out = c.generate(p, {**GREEDY, "max_tokens": 8})
            assert out.token_ids == ref and set(out.token_versions) == {k}
    return layout


def test_one_trip_steady_state_and_every_fallback(cluster_factory, tiny_model, cpu_zero_copy):
    cl = cluster_factory(2, backend="tests.ipc_backend:factory", model=tiny_model)
    cl.wait_ready(2)
    c = cl.client()
    params = _params(tiny_model, 1)

    def maps_kept(res) -> None:
        assert all(r.detail["worker"]["maps_kept"] == len(params) for r in res.values())

    layout = steady_state(c, params, tiny_model, _update, maps_kept)
    # A sleep drops the kept maps: the head refuses the one-trip op, the trainer
    # falls back by itself (a fresh update id), then the steady state again.
    c.sleep(1)
    c.wake_up()
    _step(params, tiny_model, 4)
    res = _update(c, params)
    assert _paths(res) == {"two_trip"} and {r.weight_version for r in res.values()} == {4}
    _step(params, tiny_model, 5)
    assert _paths(_update(c, params)) == {"one_trip"}
    # The layout changed (a tensor moved): two round trips with the new one.
    first = next(iter(params))
    params[first] = params[first].clone()
    res = _update(c, params)
    assert _paths(res) == {"two_trip"} and {r.weight_version for r in res.values()} == {6}
    assert {r.layout for r in res.values()} != layout
    assert _paths(_update(c, params)) == {"one_trip"}
    h = c.health()
    assert h["weight_version"] == 7 and h["updates_committed"] == 7 and not h["stale"]


def test_an_engine_that_fails_the_one_trip_commits_nothing_and_the_version_holds(
    cluster_factory, tiny_model, cpu_zero_copy, monkeypatch
):
    from trainer_bridge.transports import cuda_ipc

    cl = cluster_factory(2, backend="tests.ipc_backend:factory", model=tiny_model)
    cl.wait_ready(2)
    c = cl.client()
    params = _params(tiny_model, 1)
    _update(c, params)
    assert _paths(_update(c, params)) == {"one_trip"}
    good = cuda_ipc.share_in_place

    def short(tensors, written=None):  # the bytes behind a handle are short: every engine refuses
        out = good(tensors, written)
        with open(out[0], "r+b") as f:
            f.truncate(4)
        return out

    monkeypatch.setattr(cuda_ipc, "share_in_place", short)
    with pytest.raises(ControlError, match="bytes behind its handle"):
        _update(c, params)  # the one-trip op fails everywhere, so does its fallback
    h = c.health()
    assert h["weight_version"] == 2 and not h["stale"] and h["weight_update"] is None
    assert {e["weight_version"] for e in c.engines()} == {2}
    monkeypatch.setattr(cuda_ipc, "share_in_place", good)
    res = _update(c, params)  # the layout is forgotten: two round trips, then one
    assert _paths(res) == {"two_trip"} and {r.weight_version for r in res.values()} == {3}
    assert _paths(_update(c, params)) == {"one_trip"}


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_pipelined_pause_update_resume_loses_no_stream(cluster_factory, tiny_model, cpu_zero_copy, mode):
    cl = cluster_factory(2, backend="tests.ipc_backend:factory", model=tiny_model)
    cl.wait_ready(2)
    c = cl.client()
    pipelined_updates_lose_no_stream(c, tiny_model, lambda c, params: _update(c, params, pause=mode))


def pipelined_updates_lose_no_stream(c, tiny_model, update) -> None:
    """Three pipelined updates (`update(c, params)` pauses, sends, resumes in
    one call) under 6 streams: two round trips, then one op each; every
    stream ends at full length, its tokens' versions in order."""
    params = _params(tiny_model, 1)
    n, max_tokens = 6, 120
    s = Streams(c, [[30 + i, 31, 32] for i in range(n)], {**GREEDY, "max_tokens": max_tokens})
    wait_until(lambda: min(s.counts()) >= 2, 60, "every stream to start")
    paths = []
    for seed in (2, 3, 4):
        _step(params, tiny_model, seed)
        paths.append(_paths(update(c, params)))
    assert paths == [{"two_trip"}, {"one_trip"}, {"one_trip"}]
    assert not c.is_paused(), "the resume went out"
    s.join(180)
    assert s.errors == [None] * n
    spans = []
    for i in range(n):
        kept, versions, _ = s.kept(i)
        assert len(kept) == max_tokens, f"stream {i} lost or truncated"
        assert versions == sorted(versions) and set(versions) <= {0, 1, 2, 3}, f"stream {i}: {versions}"
        spans.append(sorted(set(versions)))
    # The test is about streams crossing an update: one that finished before the
    # first update (or started after the last) would prove nothing.
    assert any(len(v) >= 2 for v in spans), f"no stream crossed an update: versions per stream {spans}"
    assert c.health()["weight_version"] == 3


def test_pipelined_resume_goes_out_when_the_update_fails(cluster_factory, tiny_model):
    cl = cluster_factory(1)
    cl.wait_ready(1)
    c = cl.client()
    with pytest.raises(ControlError):
        c.update_weights([("no.such.tensor", torch.zeros(2))], pause="abort", timeout_s=T)
    assert not c.is_paused()
    with pytest.raises(BadRequest, match="abort or keep") as e:
        c.update_weights([], pause="wait")
    assert e.value.field == "pause"
    assert not c.is_paused()


# ---------------------------------------------------------------- the head's commit round (no sockets)


class _Pub:
    def send_multipart(self, frames: list) -> None:
        pass


def _head(n: int = 2):
    from bus.codec import Codec
    from bus.control_bus import ControlBus
    from router_node.config import RouterConfig
    from router_node.control import ClusterControl
    from router_node.registry import EngineEntry

    engines = {
        f"e{i}": EngineEntry(
            P.Register(f"e{i}", "ipc:///x", "ipc:///y", "torch", "m", P.PROTOCOL_VERSION, "inc"),
            None,  # type: ignore[arg-type]
            0.0,
            state=H,
        )
        for i in range(n)
    }
    replies: list = []
    cc = ClusterControl(
        RouterConfig(weight_txn_timeout_s=60),
        ControlBus(_Pub(), Codec()),  # type: ignore[arg-type]
        engines,
        reply=lambda client, msg: replies.append(msg),
        forget=lambda e: None,
    )
    return cc, replies


def _ack(cc, eid: str, *, version: int | None = None, layout: str = "L", fail: str = "") -> None:
    (pc,) = [p for p in cc.bus.pending.values() if not p.done]
    if fail:
        failure = P.EngineFailure(code="backend_refused", message=fail, field="layout")
        cc.on_ack(b"", P.Ack(pc.seq, eid, failure=failure), [])
    else:
        res = P.WeightsCommitted(weight_version=version or 0, layout=layout, detail={"path": "one_trip"})
        cc.on_ack(b"", P.Ack(pc.seq, eid, result=res), [])


def _one_trip(cc, rid: str, uid: str) -> P.BeginWeightUpdate:
    import msgspec

    cc.on_control(b"t", P.Control(request_id=rid, op=msgspec.structs.replace(_fast(), update_id=uid), timeout_s=5), [])
    (pc,) = [p for p in cc.bus.pending.values() if not p.done]
    return pc.op


def test_the_head_decides_the_version_before_the_one_op_and_an_engine_that_fails_is_stale() -> None:
    cc, replies = _head()
    for eid in ("e0", "e1"):
        cc.layouts.committed(eid, "L")
    with pytest.raises(BackendRefused, match="do not hold"):  # one engine lacks it: nothing begins
        cc.layouts.committed("e1", "")
        _one_trip(cc, "r0", "u0")
    assert cc.cluster.current is None and cc.cluster.version == 0
    cc.layouts.committed("e1", "L")
    sent = _one_trip(cc, "r1", "u1")
    assert sent.commit and sent.version == 1, "the version is decided before the op goes out"
    assert cc.cluster.current.decision == "commit"
    _ack(cc, "e0", version=1)
    _ack(cc, "e1", fail="e1 slept since it kept it")
    rep = replies[-1]
    assert set(rep.results) == {"e0"} and set(rep.errors) == {"e1"}
    assert cc.cluster.version == 1 and cc.cluster.current is None
    assert cc.layouts.held == {"e0": "L"}, "the engine that failed is not known to hold it any more"
    assert cc.cluster.is_stale(cc.engines["e1"].weight_version) and cc.engines["e0"].weight_version == 1


def test_a_one_trip_every_engine_refuses_ends_with_nothing_moved() -> None:
    cc, replies = _head()
    for eid in ("e0", "e1"):
        cc.layouts.committed(eid, "L")
    _one_trip(cc, "r1", "u1")
    _ack(cc, "e0", fail="holds no layout")
    _ack(cc, "e1", fail="holds no layout")
    assert not replies[-1].results and set(replies[-1].errors) == {"e0", "e1"}
    assert cc.cluster.version == 0 and cc.cluster.current is None and cc.layouts.held == {}
    assert cc.cluster.ended["u1"] == "commit failed on every engine"
    cc.on_control(b"t", P.Control(request_id="r2", op=P.BeginWeightUpdate("u2", "zmq", [], [8]), timeout_s=5), [])
    assert cc.cluster.current.update_id == "u2", "the cluster is free for the next update"


def test_a_one_trip_below_the_cluster_version_is_refused_and_frees_the_cluster() -> None:
    import msgspec

    cc, _ = _head(1)
    cc.layouts.committed("e0", "L")
    cc.cluster.version = 5
    op = msgspec.structs.replace(_fast(), version=3)
    with pytest.raises(BadRequest, match="not above the cluster weight version") as e:
        cc.on_control(b"t", P.Control(request_id="r1", op=op, timeout_s=5), [])
    assert e.value.field == "version" and cc.cluster.current is None and not cc.bus.pending
