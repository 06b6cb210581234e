"""Session placement counts open sessions (issue 9): idle multi-turn sessions
spread evenly instead of piling onto whichever engine is idle right now."""

from __future__ import annotations

import collections
import random

import pytest

from router_node.policies import Sessions, pick_for_new_session

pytestmark = pytest.mark.timeout(120)

PARAMS = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def test_open_idle_sessions_spread_evenly_and_release(cluster_factory):
    # Placement only: the null backend (no model to load in each engine)
    cl = cluster_factory(3, backend="null")
    cl.wait_ready(3)
    c = cl.client()
    placed = {}
    # One turn each, strictly one after another: every engine is idle (0
    # outstanding) whenever a new session arrives, so only the open-session
    # count can tell them apart.
    for s in range(12):
        placed[s] = c.generate([1, 2, 3 + s], PARAMS, session_id=f"s{s}").engine_id
    assert sorted(collections.Counter(placed.values()).values()) == [4, 4, 4], placed
    per_engine = {eid: e["sessions"] for eid, e in c.health()["engines"].items()}
    assert per_engine == {"e0": 4, "e1": 4, "e2": 4}
    # Second turns stay where their session lives.
    for s in range(12):
        assert c.generate([1, 2, 3 + s, 9], PARAMS, session_id=f"s{s}").engine_id == placed[s]
    # Ending e0's sessions frees room there: the next 4 new sessions go to e0.
    for s, eid in placed.items():
        if eid == "e0":
            assert c.end_session(f"s{s}") is True
    assert c.health()["engines"]["e0"]["sessions"] == 0
    fresh = [c.generate([4, 5], PARAMS, session_id=f"n{s}").engine_id for s in range(4)]
    assert fresh == ["e0"] * 4


class _E:
    def __init__(self, eid: str, outstanding: int = 0, capacity: int = 64) -> None:
        self.engine_id = eid
        self.outstanding = outstanding
        self.reg = type("R", (), {"capacity": capacity})()


def test_session_counts_follow_bind_rebind_end_and_ttl():
    s = Sessions(ttl_s=10)
    s.bind("a", "e0", 0)
    s.bind("b", "e0", 0)
    s.bind("a", "e1", 1)  # re-placed: moves its count
    assert (s.count("e0"), s.count("e1"), s.count()) == (1, 1, 2)
    assert s.end("b") and not s.end("b")
    assert s.count("e0") == 0
    assert s.expire(100) == 1 and s.count("e1") == 0 and s.per_engine() == {}


def test_new_session_placement_weighs_sessions_and_requests_by_capacity():
    rng = random.Random(0)
    s = Sessions(ttl_s=10)
    e0, e1 = _E("e0", capacity=64), _E("e1", capacity=128)
    for i in range(3):
        s.bind(f"x{i}", "e0", 0)
    e1.outstanding = 5  # 5/128 < 3/64
    assert pick_for_new_session([e0, e1], s, rng) is e1
    e1.outstanding = 7  # 7/128 > 3/64
    assert pick_for_new_session([e0, e1], s, rng) is e0
