"""The head's stall clock (router_node/registry.py) counts only time with work.

Found on the GPU (tests/gpu/test_vllm_rl_correctness.py, runs 12 and 24): an
engine left idle while its peer restarted (about 45 s) was declared stalled by
the first heartbeat that showed work, "step counter stuck at 0 for 46.2s with 8
running", before its first step could finish, and its requests failed.
"""

from __future__ import annotations

import json
import time

from bus import protocol as P
from router_node.registry import EngineEntry, EngineState
from tests.cluster import wait_until

STALL = dict(deadline_s=1e9, stall_timeout_s=5.0)


def _entry() -> EngineEntry:
    reg = P.Register("e0", "ipc://d", "ipc://w", "null", "m", P.PROTOCOL_VERSION, "inc")
    return EngineEntry(reg=reg, sock=None, registered_at=0.0, state=EngineState.HEALTHY)  # type: ignore[arg-type]


def _hb(running: int, steps: int, busy: str = "") -> P.Heartbeat:
    return P.Heartbeat("e0", "inc", running=running, steps=steps, busy=busy)


def test_idle_time_does_not_count_towards_a_stall():
    e = _entry()
    for t in range(0, 100):  # idle for 100 s, heartbeats every second
        e.on_heartbeat(_hb(0, 7), float(t))
    e.on_heartbeat(_hb(8, 7), 100.0)  # work appears; its first step is not done yet
    assert e.evaluate(100.0, **STALL)[0] is EngineState.HEALTHY
    e.on_heartbeat(_hb(8, 7), 104.0)
    assert e.evaluate(104.9, **STALL)[0] is EngineState.HEALTHY


def test_work_without_steps_is_still_a_stall():
    e = _entry()
    e.on_heartbeat(_hb(0, 7), 0.0)
    for t in range(10, 20):
        e.on_heartbeat(_hb(8, 7), float(t))
    state, reason = e.evaluate(19.0, **STALL)
    assert state is EngineState.STALLED and "stuck at 7 for 9.0s with 8 running" in reason


def test_steps_and_busy_restart_the_clock():
    e = _entry()
    e.on_heartbeat(_hb(8, 1), 0.0)
    e.on_heartbeat(_hb(8, 2), 4.0)
    assert e.evaluate(8.0, **STALL)[0] is EngineState.HEALTHY
    e.on_heartbeat(_hb(8, 2, busy="weights"), 20.0)  # a control op holds the model
    assert e.evaluate(20.0, **STALL)[0] is EngineState.HEALTHY
    e.on_heartbeat(_hb(8, 2), 21.0)
    assert e.evaluate(24.0, **STALL)[0] is EngineState.HEALTHY
    assert e.evaluate(26.0, **STALL)[0] is EngineState.STALLED


def test_an_engine_idle_past_the_stall_timeout_serves_its_next_request(cluster_factory):
    """Real processes: the null backend (fault injection: each step sleeps
    1.2 s) idles 3 s past a 2 s stall timeout, then gets one request. It must
    be served there, not failed over or failed as EngineDead."""
    cl = cluster_factory(
        0,
        backend="null",
        router_args=["--stall-timeout-s", "2.0"],
    )
    cl.start_engine("e0", extra=["--backend-options", json.dumps({"tokens_per_step": 1, "step_delay_s": 1.2})])
    cl.wait_ready(1)
    c = cl.client(timeout_s=30)
    time.sleep(3.5)  # idle, heartbeats flowing
    r = c.generate([4, 5, 6], {"max_tokens": 2, "ignore_eos": True})
    assert len(r.token_ids) == 2 and r.engine_id == "e0"
    h = c.health()["engines"]["e0"]
    assert h["state"] == "healthy", h
    assert c.stats()["counters"]["failovers"] == 0
    wait_until(lambda: c.health()["engines"]["e0"]["running"] == 0, 10, "e0 to report no work")
