"""Issue 22, head death and restart: clients see a dead head within their
head_timeout_s (HeadUnavailable naming the address, not their own timeout_s),
a head restarted on the same addresses is found by the live engines (they
re-register on its Rejoin), and a head that was itself stopped never blames
the engines for its own stall (router_node/registry.py LoopClock)."""

from __future__ import annotations

import signal
import time

import pytest

from bus import protocol as P
from bus.errors import HeadUnavailable
from router_node.registry import EngineEntry, EngineState, LoopClock, credit_stall
from tests.cluster import Streams, wait_until

LONG = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}

# ---------------------------------------------------------------- no I/O


def _entry(last_seen: float) -> EngineEntry:
    reg = P.Register("e0", "ipc://d", "ipc://w", "null", "m", P.PROTOCOL_VERSION, "inc")
    return EngineEntry(
        reg=reg,
        sock=None,
        registered_at=0.0,
        state=EngineState.HEALTHY,
        last_seen=last_seen,
        steps_changed_at=last_seen,
    )  # type: ignore[arg-type]


def test_loop_clock_reports_only_stalls_longer_than_its_threshold():
    clock = LoopClock(threshold_s=0.5)
    assert clock.observe(10.0) == 0.0  # first observation: nothing to compare
    assert clock.observe(10.05) == 0.0
    assert clock.observe(10.5) == 0.0  # 0.45 s: a slow turn, not a stall
    assert clock.observe(15.5) == pytest.approx(4.5)  # SIGSTOP for 5 s: all but the threshold
    assert clock.stalls == 1 and clock.stalled_s == pytest.approx(4.5)


def test_a_stall_of_the_head_is_credited_to_the_engines_not_blamed_on_them():
    e = _entry(last_seen=100.0)
    deadline = dict(deadline_s=0.6, stall_timeout_s=5.0)
    # The head was stopped from 100.1 to 105.1; the engine's heartbeats wait unread.
    assert e.evaluate(105.1, **deadline)[0] is EngineState.SILENT  # what today's head concluded
    clock = LoopClock(threshold_s=0.2)
    clock.observe(100.1)
    away = clock.observe(105.1)
    credit_stall([e], away)
    assert e.evaluate(105.1, **deadline)[0] is EngineState.HEALTHY
    # ...and a fresh grace only: an engine that stays silent is still found out.
    assert e.evaluate(105.8, **deadline)[0] is EngineState.SILENT


# ---------------------------------------------------------------- real processes


@pytest.mark.timeout(120)
def test_killed_head_ends_open_streams_with_head_unavailable(cluster_factory):
    cl = cluster_factory(1)
    cl.wait_ready(1)
    c = cl.client(timeout_s=300)  # the old failure: nothing until timeout_s (+30)
    streams = Streams(c, [[5, 6, 7, i] for i in range(4)], LONG)
    wait_until(lambda: all(n >= 2 for n in streams.counts()), 60, "every stream's first tokens")
    cl.kill("head")
    t0 = time.monotonic()
    for t in streams.threads:
        t.join(30)
    took = time.monotonic() - t0
    assert not any(t.is_alive() for t in streams.threads), "a stream outlived its dead head by 30 s"
    assert all(isinstance(e, HeadUnavailable) for e in streams.errors), streams.errors
    for e in streams.errors:
        assert isinstance(e, HeadUnavailable)
        assert e.address == cl.frontend and cl.frontend in str(e) and e.field == "head_timeout_s"
        assert e.request_id
    print(f"streams ended {took:.2f}s after the head's kill -9 (head_timeout_s=2)")


@pytest.mark.timeout(180)
def test_restarted_head_finds_the_live_engines_and_clients_reconnect(cluster_factory):
    cl = cluster_factory(2, backend="null")  # registration and routing only: no model to load
    cl.wait_ready(2)
    c = cl.client()
    assert c.generate([1, 2, 3], {"max_tokens": 2}).samples[0].token_ids
    before = {e["engine_id"]: e["incarnation"] for e in c.engines()}
    cl.kill("head")
    with pytest.raises(HeadUnavailable):
        c.generate([1, 2, 3], {"max_tokens": 2})  # no head: a typed error, at once
    cl.restart_head()
    t0 = time.monotonic()
    # The old failure: the new head knew no engine (NoHealthyEngine for good).
    h = c.wait_ready(2, timeout_s=60)
    took = time.monotonic() - t0
    assert {eid: e["incarnation"] for eid, e in h["engines"].items()} == before  # the same processes re-registered
    out = c.generate([[4, 5, 6], [7, 8, 9]], {"max_tokens": 3})  # the same client, reconnected
    assert all(len(r.samples[0].token_ids) == 3 for r in out)
    assert "engine_rejoining" in cl.log("e0") + cl.log("e1")
    print(f"restarted head served both engines {took:.2f}s after it started")


@pytest.mark.timeout(180)
def test_a_stopped_head_does_not_declare_the_engines_dead(cluster_factory):
    # heartbeat 0.2 s x 3 missed = 0.6 s deadline; the head stops for 3 s.
    cl = cluster_factory(2)
    cl.wait_ready(2)
    c = cl.client(timeout_s=120, head_timeout_s=60)  # this test is about the head's judgement
    streams = Streams(c, [[3, 1, 4, i] for i in range(4)], {**LONG, "max_tokens": 200})
    wait_until(lambda: all(n >= 2 for n in streams.counts()), 60, "every stream's first tokens")
    cl.kill("head", signal.SIGSTOP)
    time.sleep(3.0)
    cl.kill("head", signal.SIGCONT)
    streams.join(120)  # 0 streams lost
    assert all(n == 200 for n in streams.counts()), streams.counts()
    counters = c.stats()["counters"]
    # The old failure: "no heartbeat for 5.2s", every stream failed over or lost.
    assert counters["failovers"] == 0 and counters["engine_dead"] == 0, counters
    assert counters["head_stalls"] >= 1, counters
    assert all(e["healthy"] for e in c.engines())
