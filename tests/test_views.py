"""Typed cross-process data (issue 25.1), without sockets: the head's query
answers (bus/views.py, built by router_node/views.py) and the typed control
results (bus/results.py) — their attribute access, the key access kept for
callers of the dict results, and the plain dicts the client API returns.
The loopback tests of the same (health, pause, weight updates) are
tests/test_control_plane.py, tests/test_weight_txn.py and friends."""

from __future__ import annotations

import msgspec
import pytest

from bus import protocol as P
from bus.codec import Codec
from bus.errors import ProtocolError
from router_node.cluster_state import ClusterWeights
from router_node.intended_state import IntendedState
from router_node.policies import Sessions
from router_node.registry import EngineEntry, EngineState
from router_node.views import engines_view, health_view, stats_view

# The keys Client.health()["engines"][id] had before the views were typed:
# every one is still there (the views may add keys, never drop one).
OLD_ENGINE_KEYS = {
    "engine_id", "healthy", "stale", "state", "reason", "data_address", "weight_address", "backend", "model",
    "dtype", "host", "pid", "tp", "pp", "dp", "capacity", "vocab_size", "max_model_len", "incarnation",
    "curve_key", "outstanding", "heartbeat_age_s", "running", "waiting", "held", "parked", "kv_usage",
    "weight_version", "paused", "sleeping", "asleep", "steps", "tokens_out", "busy", "loras",
    "sessions", "intended", "converging", "corrections",
}  # fmt: skip
OLD_HEALTH_KEYS = {
    "healthy", "engines", "weight_version", "source", "updates_committed", "weight_update", "stale", "intended",
    "converging", "vocab_size", "next_update_id",
}  # fmt: skip


def _entry(eid: str, *, state: EngineState = EngineState.HEALTHY, version: int = 0) -> EngineEntry:
    reg = P.Register(
        eid, "tcp://h:1", "tcp://h:2", "torch", "m", P.PROTOCOL_VERSION, "inc", tp=2, dtype="bfloat16", curve_key="K"
    )
    e = EngineEntry(reg=reg, sock=None, registered_at=0.0, state=state, last_seen=9.0)  # type: ignore[arg-type]
    e.on_heartbeat(P.Heartbeat(eid, "inc", running=1, weight_version=version, paused=["*"], steps=4), 9.0)
    return e


def _head() -> tuple[dict[str, EngineEntry], IntendedState, Sessions, ClusterWeights]:
    engines = {"e0": _entry("e0"), "e1": _entry("e1", state=EngineState.STALE)}
    intended = IntendedState()
    intended.add("e0")
    sessions = Sessions(60.0)
    sessions.bind("s", "e0", 0.0)
    return engines, intended, sessions, ClusterWeights()


def test_health_is_typed_and_its_dict_keeps_every_key():
    engines, intended, sessions, cluster = _head()
    h = health_view(engines, intended, sessions, cluster, 32)
    e0 = h.engines["e0"]
    # what the trainer reads: typed fields, not dict keys
    assert (e0.weight_address, e0.curve_key, e0.dtype, e0.tp) == ("tcp://h:2", "K", "bfloat16", 2)
    assert e0.sessions == 1 and e0.intended == P.IntentView() and e0.converging is not None
    assert h.engines["e1"].stale and h.stale == ["e1"] and h.healthy and h.vocab_size == 32
    assert h.engines["e1"].intended is None  # the head tracks no intent for it
    d = P.as_dict(h)
    assert set(d) == OLD_HEALTH_KEYS
    assert set(d["engines"]["e0"]) == OLD_ENGINE_KEYS
    assert d["engines"]["e0"]["intended"] == {"paused": [], "sleeping": 0, "asleep": []}
    assert d["engines"]["e0"]["paused"] == ["*"] and d["intended"]["paused"] == []
    # and it crosses the wire as it is
    c = Codec()
    back, _ = c.decode(c.encode(P.QueryReply("r", h)))
    assert back.body == h


def test_engines_and_stats_views():
    engines, intended, sessions, _ = _head()
    ev = engines_view(engines, intended, sessions)
    assert [e.engine_id for e in ev.engines] == ["e0", "e1"]
    st = stats_view({"errors": 2}, 3, sessions, None)
    assert P.as_dict(st) == {"counters": {"errors": 2}, "in_flight": 3, "sessions": 1, "prefix": None}


def test_weight_update_views():
    cluster = ClusterWeights()
    begin = P.BeginWeightUpdate("u1", "zmq", [], [], senders=2)
    cluster.on_control(begin, ["e0", "e1"], client=b"trainer", now=1.0, wall=2.0)
    ups = cluster.open_updates()
    txn = ups.updates["u1"]
    assert (txn.senders, txn.targets, txn.transport, txn.holder, txn.decision) == (
        2,
        ["e0", "e1"],
        "zmq",
        "trainer",
        None,
    )
    assert cluster.decisions() == P.DecisionsView({"u1": None})
    assert cluster.current_view() == txn


def test_results_read_by_attribute_and_by_key():
    r = P.PauseResult(mode="abort", parked=2)
    assert r.parked == 2 and r["parked"] == 2 and "parked" in r and dict(r)["mode"] == "abort"
    with pytest.raises(KeyError):
        r["nope"]
    s = P.SleepResult(level=1, detail={"weights": "kept"})
    assert s["weights"] == "kept" and s.get("missing", 7) == 7 and "detail" not in s.keys()
    st = P.StatsResult(P.Heartbeat("e0", "inc", running=3), {"prefills": 5})
    assert st["running"] == 3 and st["prefills"] == 5 and st.heartbeat is not None and st.heartbeat.running == 3


def test_a_result_of_another_type_is_a_protocol_error_naming_the_engine():
    ok = {"e0": P.PauseResult()}
    assert P.expect(ok, P.PauseResult, "pause") == ok
    with pytest.raises(ProtocolError) as ei:
        P.expect({"e0": P.PauseResult(), "e1": P.Done()}, P.PauseResult, "pause")
    assert "e1" in str(ei.value) and "Done" in str(ei.value)


def test_one_error_shape():
    ack = P.Ack(1, "e0", failure=P.EngineFailure("backend_timeout", "slow", "op_timeout_s"))
    assert not ack.ok and P.Ack(2, "e0", P.Done()).ok
    # an Ack's failure and a ControlReply's errors are the same Struct
    rep = P.ControlReply("r", errors={"e0": ack.failure})  # type: ignore[dict-item]
    assert msgspec.msgpack.encode(rep.errors["e0"]) == msgspec.msgpack.encode(ack.failure)
