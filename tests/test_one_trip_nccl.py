"""The nccl one-trip weight update (issue 21 §4): once every engine holds the
trainer's layout, a steady-state nccl update is ONE op (the head decides the
version, each engine receives the broadcast into its kept staging, validates
and commits); its fallbacks; a failed receive keeps the old weights.

Without a GPU: real processes (a head, engine nodes, the trainer in this
process) with the broadcast over GLOO instead of NCCL: the engines run
tests/nccl_backend.py (the torch backend with the vLLM worker's receive
protocol: check-in, go, join once, kept staging), the trainer's NcclSender
gets a gloo group (`nccl_backend.gloo_connect`). Everything else (the
trainer's check-in wait and its send loop, the one-trip op, the head's
decision, the engine's chained commit) is the product's."""

from __future__ import annotations

import pytest
import torch

from bus.errors import BadRequest, ControlError
from tests.nccl_backend import gloo_connect
from tests.test_control_plane import _reference
from tests.test_one_trip import GREEDY, T, _params, _paths, _step, pipelined_updates_lose_no_stream, steady_state

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def gloo_nccl(monkeypatch):
    """The trainer's NcclSender over gloo, and fresh sender / layout caches."""
    from trainer_bridge.transports import nccl, one_trip

    monkeypatch.setattr(nccl.NcclSender, "connect", gloo_connect)
    for s in list(nccl._NCCL_SENDERS.values()):
        s.close()
    nccl._NCCL_SENDERS.clear()
    one_trip.CACHES.clear()
    yield nccl
    for s in list(nccl._NCCL_SENDERS.values()):
        s.close()
    nccl._NCCL_SENDERS.clear()
    one_trip.CACHES.clear()


def _update(c, params, **kw):
    kw.setdefault("nccl_timeout_s", 30.0)
    return c.update_weights(list(params.items()), transport="nccl", timeout_s=T, device="cpu", **kw)


def _cluster(cluster_factory, tiny_model, n=2):
    cl = cluster_factory(n, backend="tests.nccl_backend:factory", model=tiny_model)
    cl.wait_ready(n)
    return cl, cl.client()


def test_nccl_one_trip_steady_state_and_the_sleep_fallback(cluster_factory, tiny_model, gloo_nccl):
    cl, c = _cluster(cluster_factory, tiny_model)
    params = _params(tiny_model, 1)
    layout = steady_state(c, params, tiny_model, _update)
    assert len(gloo_nccl._NCCL_SENDERS) == 1, "one group for every update"
    # A sleep drops the layout at the head: the one-trip op is refused there,
    # NOTHING is broadcast (no engine checked in), the trainer falls back by
    # itself on the same group, then the steady state again.
    c.sleep(1)
    c.wake_up()
    _step(params, tiny_model, 4)
    res = _update(c, params)
    assert _paths(res) == {"two_trip"} and {r.weight_version for r in res.values()} == {4}
    _step(params, tiny_model, 5)
    assert _paths(_update(c, params)) == {"one_trip"}
    assert len(gloo_nccl._NCCL_SENDERS) == 1, "the refused op left the group usable"
    # The same tensors in another dtype: cast to the engines' dtype, the same plan.
    first = next(iter(params))
    params[first] = params[first].double()
    assert _paths(_update(c, params)) == {"one_trip"}
    # Another plan (smaller buckets): two round trips with the new layout, then one.
    res = _update(c, params, bucket_bytes=1 << 12)
    assert _paths(res) == {"two_trip"} and {r.layout for r in res.values()} != layout
    assert _paths(_update(c, params, bucket_bytes=1 << 12)) == {"one_trip"}
    h = c.health()
    assert h["weight_version"] == 8 and h["updates_committed"] == 8 and not h["stale"]


def test_a_refused_update_never_blocks_the_trainer_and_a_broken_broadcast_keeps_the_old_weights(
    cluster_factory, tiny_model, gloo_nccl, monkeypatch
):
    import time

    from trainer_bridge.transports import nccl_broadcast

    cl, c = _cluster(cluster_factory, tiny_model, n=1)
    params = _params(tiny_model, 1)
    small = {"bucket_bytes": 1 << 12, "nccl_timeout_s": 5.0}  # several buckets; a quick gloo timeout
    _update(c, params, **small)
    # The engine refuses the begin (an unknown tensor): no worker checks in, so
    # nothing is broadcast; the error comes back at once, naming the tensor,
    # and the group stays usable.
    t0 = time.monotonic()
    with pytest.raises(ControlError, match="no.such.tensor"):
        _update(c, {"no.such.tensor": torch.zeros(2)})
    assert time.monotonic() - t0 < 4, "the trainer did not wait for a broadcast nobody receives"
    assert len(gloo_nccl._NCCL_SENDERS) == 1, "nothing was sent: the group is kept"
    assert _paths(_update(c, params, **small)) == {"two_trip"}, "a failed update: the trainer forgot the layout"
    assert _paths(_update(c, params, **small)) == {"one_trip"}
    nan = dict(params)
    nan[next(iter(nan))] = torch.full_like(next(iter(nan.values())), float("nan"))
    with pytest.raises(BadRequest, match="NaN or inf") as e:
        _update(c, nan, **small)  # the check rides beside the broadcast: the engine refuses, nothing written
    assert e.value.field == "tensors" and repr(next(iter(nan))) in str(e.value)
    h = c.health()
    assert h["weight_version"] == 3 and not h["stale"] and h["weight_update"] is None
    assert len(gloo_nccl._NCCL_SENDERS) == 1, "the broadcast itself went fine: the group is kept"
    assert _paths(_update(c, params, **small)) == {"two_trip"}, "the failed one-trip op dropped the layout"
    ref_before, _ = _reference(_step(params, tiny_model, 7), [5, 6, 7], 6)
    _update(c, params, **small)  # version 5: the weights the failed update must leave
    good_run = nccl_broadcast.Broadcast.run

    def broken(self, comm):  # the first bucket goes, then the trainer's side breaks
        assert len(self.sizes) > 2
        comm.broadcast(self.source(0), src=0)
        raise RuntimeError("NCCL error: the trainer's side broke")

    monkeypatch.setattr(nccl_broadcast.Broadcast, "run", broken)
    _step(params, tiny_model, 8)
    with pytest.raises(RuntimeError, match="trainer's side broke"):
        _update(c, params, **small)  # returns once the engine's receive failed (its group timed out)
    assert not gloo_nccl._NCCL_SENDERS, "a broken group is never reused"
    h = c.health()
    assert h["weight_version"] == 5 and not h["stale"] and h["weight_update"] is None
    out = c.generate([5, 6, 7], {**GREEDY, "max_tokens": 6})
    assert out.token_ids == ref_before and set(out.token_versions) == {5}, "the old weights stay"
    monkeypatch.setattr(nccl_broadcast.Broadcast, "run", good_run)
    res = _update(c, params, **small)  # a new group; the layout was forgotten: two round trips, then one
    assert _paths(res) == {"two_trip"} and {r.weight_version for r in res.values()} == {6}
    assert _paths(_update(c, params, **small)) == {"one_trip"}


def test_pipelined_nccl_updates_lose_no_stream_and_stamp_every_token(cluster_factory, tiny_model, gloo_nccl):
    """pause("keep") (the KV stays; abort's re-prefill is tests/test_one_trip.py's, the same pipeline)."""
    mode = "keep"
    cl, c = _cluster(cluster_factory, tiny_model)
    pipelined_updates_lose_no_stream(c, tiny_model, lambda c, params: _update(c, params, pause=mode))


def test_one_trainer_to_three_engines_is_one_group_and_one_broadcast_per_bucket(
    cluster_factory, tiny_model, gloo_nccl, monkeypatch
):
    """Issue 33 §3's shape (trainer GPU 0, engines GPUs 1–3): ONE group of 1 +
    3 ranks, and each bucket is broadcast ONCE to the three receivers (not
    once per engine), first update and one-trip steady state alike; every
    engine commits the same version or none (here: all)."""
    calls: list[int] = []

    def counting_connect(sender):  # called before every send: wrap the group's comm once
        if sender.comm is not None:
            return
        gloo_connect(sender)
        inner = sender.comm.broadcast

        def broadcast(t, src=0):
            calls.append(int(t.numel()))
            inner(t, src)

        sender.comm.broadcast = broadcast

    monkeypatch.setattr(gloo_nccl.NcclSender, "connect", counting_connect)
    cl = cluster_factory(3, backend="tests.nccl_backend:factory", model=tiny_model)
    cl.wait_ready(3, timeout_s=240)  # three torch engines starting on a 2-core CI box
    c = cl.client()
    small = {"bucket_bytes": 1 << 14}  # several buckets
    for k, path in enumerate(("two_trip", "one_trip", "one_trip")):
        before = len(calls)
        res = _update(c, _params(tiny_model, 1 + k), **small)
        assert _paths(res) == {path} and len(res) == 3
        assert len({r.weight_version for r in res.values()}) == 1, "every engine on the same new version"
        ((s),) = gloo_nccl._NCCL_SENDERS.values()
        assert s.world_size == 4, "the trainer + the three engines' workers, one group"
        assert int(s.store.add(f"rollout_bus/{s.group_id}/next_rank", 0)) == 3, "three receivers joined it"
        sent = calls[before:]
        assert len(sent) == s.last_send_info["buckets"] > 1, "one broadcast per bucket, whatever the engine count"
    h = c.health()
    assert {e["weight_version"] for e in c.engines()} == {h["weight_version"]} and not h["stale"]
