"""Faults: engines die or hang; every accepted request still ends in exactly
one final chunk or one error, and never hangs."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from bus.errors import EngineDead, NoHealthyEngine
from tests.cluster import wait_until

LONG = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
# Tests of routing and heartbeats only (which engine, when it is seen dead) run
# on the null backend: no model to import and load in each engine process. It
# streams a token per 50 ms step here, so a LONG request is still running when
# its engine is killed.
NULL = {"backend": "null", "backend_options": {"tokens_per_step": 1, "step_delay_s": 0.05}}


def _stream_in_thread(c, prompt, params, out: dict, **kw):
    def run():
        try:
            out["chunks"] = []
            for ch in c.stream(prompt, params, **kw):
                out["chunks"].append(ch)
        except Exception as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_killed_engine_gives_engine_dead_within_the_heartbeat_deadline(cluster_factory):
    cl = cluster_factory(1, router_args=["--no-failover"], **NULL)
    cl.wait_ready(1)
    c = cl.client()
    out: dict = {}
    t = _stream_in_thread(c, [5, 6, 7], LONG, out)
    wait_until(lambda: len(out.get("chunks", [])) >= 3, 30, "first tokens")
    t0 = time.monotonic()
    cl.kill("e0")
    t.join(30)
    took = time.monotonic() - t0
    assert isinstance(out.get("error"), EngineDead), out
    assert out["error"].request_id
    # 3 missed heartbeats of 0.2 s, plus the router's 50 ms tick: well under 5 s
    assert took < 5, took


def test_no_healthy_engine_answers_at_once(cluster_factory):
    cl = cluster_factory(1, **NULL)
    cl.wait_ready(1)
    cl.kill("e0")
    c = cl.client()
    wait_until(lambda: not c.health()["healthy"], 10, "the head to see the dead engine")
    t0 = time.monotonic()
    with pytest.raises(NoHealthyEngine) as e:
        c.generate([1, 2, 3], {"max_tokens": 2})
    assert time.monotonic() - t0 < 2
    assert e.value.request_id
    h = c.health()
    assert h["healthy"] is False and h["engines"]["e0"]["state"] == "silent"


def test_failover_resubmits_tokens_so_far_and_the_stream_is_unbroken(cluster_factory):
    cl = cluster_factory(2)
    cl.wait_ready(2)
    c = cl.client()
    prompt = [9, 8, 7, 6]
    params = {**LONG, "max_tokens": 120, "logprobs": True}
    reference = c.generate(prompt, params).token_ids  # greedy: failover must not change it
    out: dict = {}
    t = _stream_in_thread(c, prompt, params, out, session_id="pin")
    wait_until(lambda: len(out.get("chunks", [])) >= 5, 30, "first tokens")
    victim = c.generate([1], {"max_tokens": 1}, session_id="pin").engine_id
    cl.kill(victim)
    t.join(60)
    assert "error" not in out, out.get("error")
    chunks = out["chunks"]
    tokens = [x for ch in chunks for x in ch.token_ids]
    assert tokens == reference
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].engine_id != victim
    assert sum(1 for ch in chunks if ch.finish_reason) == 1
    assert c.stats()["counters"]["failovers"] >= 1


@pytest.mark.timeout(90)
def test_a_restart_on_the_same_address_never_freezes_the_head(cluster_factory):
    """An engine restarted on its old data address refuses the head's connection
    of its previous life at the handshake (the head's secret is per incarnation);
    libzmq then ends that DEALER's only pipe, and a blocking send to it waits
    forever. CI caught the head frozen that way (bench/gpu/scale_kill.py: a
    request placed on the dead engine before its heartbeats ran out): nothing
    answered again. Now the send fails, the engine is unreachable (SILENT), the
    request moves on, and the restarted engine takes the id at its next Register
    instead of after the heartbeat deadline (50 x 0.2 s here)."""
    cl = cluster_factory(2, router_args=["--missed-heartbeats", "50"], **NULL)
    cl.wait_ready(2)
    c = cl.client(timeout_s=30)
    old = c.health()["engines"]["e0"]
    cl.kill("e0")
    cl.start_engine("e0")  # the supervisor's restart: same id, same data address
    wait_until(lambda: "zap_refused" in cl.log("e0"), 30, "the restarted engine refusing the head's old connection")
    results = c.generate([[i, i + 1, i + 2] for i in range(8)], {"max_tokens": 4, "ignore_eos": True})
    assert [len(r.token_ids) for r in results] == [4] * 8
    assert c.stats()["counters"]["engine_unreachable"] == 1
    e0 = lambda: c.health()["engines"]["e0"]
    wait_until(lambda: e0()["healthy"] and e0()["incarnation"] != old["incarnation"], 8, "the restarted e0 registered")
    assert any(r.engine_id == "e0" for r in c.generate([[5, 6, 7]] * 8, {"max_tokens": 2}))


def test_session_is_replaced_when_its_engine_dies(cluster_factory):
    cl = cluster_factory(2, **NULL)
    cl.wait_ready(2)
    c = cl.client()
    first = c.generate([3, 4], {"max_tokens": 2}, session_id="s").engine_id
    cl.kill(first)
    wait_until(lambda: not c.health()["engines"][first]["healthy"], 10, "the head to mark the engine")
    again = c.generate([3, 4], {"max_tokens": 2}, session_id="s").engine_id
    assert again != first
    assert c.generate([3, 4], {"max_tokens": 2}, session_id="s").engine_id == again


def test_hung_engine_is_unhealthy_and_gets_no_traffic(cluster_factory):
    cl = cluster_factory(2, **NULL)
    cl.wait_ready(2)
    c = cl.client()
    cl.kill("e1", signal.SIGSTOP)  # frozen process: no heartbeats, no steps
    wait_until(lambda: c.health()["engines"]["e1"]["state"] == "silent", 10, "e1 to be marked silent")
    results = c.generate([[i + 4, 5] for i in range(10)], {"max_tokens": 3})
    assert {r.engine_id for r in results} == {"e0"}
    cl.kill("e1", signal.SIGCONT)
    wait_until(lambda: c.health()["engines"]["e1"]["healthy"], 10, "e1 to recover")


def test_stalled_engine_loop_is_unhealthy_and_its_requests_fail_over(cluster_factory):
    """The null backend (no model; fault injection) sleeps 8 s inside each
    step on e1: its heartbeat thread keeps beating, its step counter stops."""
    import json

    cl = cluster_factory(
        1,
        backend="null",
        router_args=["--stall-timeout-s", "1.0"],
        backend_options={"tokens_per_step": 1},
    )
    cl.start_engine("e1", extra=["--backend-options", json.dumps({"tokens_per_step": 1, "step_delay_s": 8})])
    cl.wait_ready(2)
    c = cl.client()
    t0 = time.monotonic()
    results = c.generate([[4 + i, 5, 6] for i in range(6)], {"max_tokens": 20, "ignore_eos": True})
    assert time.monotonic() - t0 < 6  # stall seen after 1 s, then served by e0
    assert all(len(r.token_ids) == 20 and r.engine_id == "e0" for r in results)
    h = c.health()["engines"]["e1"]
    assert h["state"] == "stalled" and "stall_timeout_s" in h["reason"]
    assert h["heartbeat_age_s"] < 1.0  # alive, just hung
    assert c.stats()["counters"]["failovers"] >= 1
    # Its SIGTERM would wait out the 8 s step it sleeps in; the teardown still
    # reaps the whole tree.
    cl.kill("e1")


def test_protocol_version_mismatch_is_refused_with_a_clear_error(cluster_factory):
    import zmq

    from bus import protocol as P
    from bus import roles
    from bus.codec import Codec

    # The head's registration check: a head and one null engine (no model to load).
    cl = cluster_factory(1, backend="null")
    cl.wait_ready(1)

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        cl.credential(roles.ENGINE).apply(s, None)  # a token holder: past the handshake
        s.connect(cl.events)
        reg = P.Register("old", "ipc:///nowhere", "ipc:///nowhere", "torch", "m", P.PROTOCOL_VERSION + 7, "inc")
        s.send_multipart(Codec().encode(reg))
        reply, _ = Codec().decode(s.recv_multipart())
        assert isinstance(reply, P.RegisterReply) and reply.ok is False
        assert "protocol version" in reply.error
        assert "old" not in cl.client().health()["engines"]
    finally:
        s.close(linger=0)
        ctx.term()
