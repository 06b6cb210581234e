"""Control never blocks the engine loop: a weight update whose commit takes
12 s (the torch backend's test-only `fault_op_delay_s`), longer than the
head's stall_timeout_s (lowered to 5 s; the rule is the same at its 30 s
default, which would only make the test 30 s longer), with streams in flight.

While it runs: heartbeats keep coming, health shows every engine healthy and
busy (never stalled), no request fails over, and Ping / Stats / is_paused
answer at once. After: the update acks, the version moves, every stream
finishes complete."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bus import protocol as P
from tests.cluster import wait_until
from tests.test_control_plane import GREEDY, Streams, prompts

STALL_S = 5.0  # the head's --stall-timeout-s (router_node/config.py: 30 s by default)
COMMIT_S = 12.0  # > STALL_S, with room to probe the engines past the stall timeout
# "At once" while the commit runs: a loop blocked by the commit would leave
# heartbeats and answers COMMIT_S - 4 s late or more (the probe runs that
# long); LAG_S tells the two apart with slack a loaded 2-core CI cannot use up.
LAG_S = 4.0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_commit_past_the_stall_timeout_keeps_the_engine_healthy_busy_and_serving(cluster_factory, tiny_model):
    from transformers import AutoModelForCausalLM

    cl = cluster_factory(
        2,
        router_args=["--stall-timeout-s", str(STALL_S)],
        backend_options={"fault_op_delay_s": {"commit_weight_update": COMMIT_S}},
    )
    cl.wait_ready(2)
    trainer = cl.client(control_timeout_s=COMMIT_S + 60)
    probe = cl.client(control_timeout_s=10)

    new = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.01)
    ps = prompts(4, seed=11)
    max_tokens = 1000  # long enough to be running when the commit starts
    s = Streams(probe, ps, {**GREEDY, "max_tokens": max_tokens})
    wait_until(lambda: min(s.counts()) >= 3, 60, "every stream to start")
    outcome: dict = {}

    def update() -> None:
        t0 = time.monotonic()
        try:
            outcome["res"] = trainer.update_weights(new.named_parameters())
        except Exception as e:  # reported by the assertions below
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=update, daemon=True)
    t.start()

    def engines() -> dict:
        return probe.health()["engines"]

    wait_until(
        lambda: all(v.get("busy") == "finish_weights" for v in engines().values()),
        20,
        "both engines busy with the commit",
    )
    busy_since = time.monotonic()
    assert sum(v["running"] for v in engines().values()) > 0, "streams must be in flight during the commit"
    beats: dict[str, list[float]] = {}
    while time.monotonic() - busy_since < COMMIT_S - 4:
        h = engines()
        for eid, v in h.items():
            assert v["healthy"] and v["state"] == "healthy", (eid, v["state"], v["reason"])
            if v.get("busy"):
                assert v["busy"] == "finish_weights"
            assert v["heartbeat_age_s"] is not None and v["heartbeat_age_s"] < LAG_S, (eid, v["heartbeat_age_s"])
            beats.setdefault(eid, []).append(v["heartbeat_age_s"])
        for op in (P.Ping(), P.Stats(), P.IsPaused()):
            t0 = time.monotonic()
            res = probe.control(op, timeout_s=5)
            assert set(res) == {"e0", "e1"}
            assert time.monotonic() - t0 < LAG_S, (
                f"{type(op).__name__} took {time.monotonic() - t0:.2f}s during the commit"
            )
        assert probe.is_paused() is False
        assert probe.stats()["counters"]["failovers"] == 0
        assert "res" not in outcome and "error" not in outcome, outcome  # still committing
        time.sleep(2.0)
    assert time.monotonic() - busy_since > STALL_S  # past the stall timeout, never stalled

    t.join(COMMIT_S + 60)
    assert not t.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert outcome["seconds"] >= COMMIT_S - 1
    assert {e: r["weight_version"] for e, r in outcome["res"].items()} == {"e0": 1, "e1": 1}
    s.join(60)
    assert s.counts() == [max_tokens] * len(ps)  # complete: nothing lost, nothing failed over
    assert all(cs[-1].finish_reason == "length" for cs in s.chunks)
    assert probe.stats()["counters"]["failovers"] == 0
    assert all(v["healthy"] and not v.get("busy") for v in engines().values())
    assert {e["weight_version"] for e in probe.engines()} == {1}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_op_past_its_deadline_acks_a_timeout_naming_the_knob(cluster_factory, tiny_model, tmp_path):
    """The node's backstop: a BackendOp still running at its deadline is acked
    as a timeout naming the backend knob; the engine keeps serving and later
    commands run."""
    from bus.errors import ControlError
    from engine_node.tiny_model import make_random_lora

    lora = make_random_lora(tiny_model, str(tmp_path / "l"), seed=1)
    cl = cluster_factory(1, backend_options={"op_timeout_s": 1.0, "fault_op_delay_s": {"load_lora": 4.0}})
    cl.wait_ready(1)
    c = cl.client(control_timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(ControlError, match="op_timeout_s") as e:
        c.load_lora("slow", path=lora)
    # The deadline (1 s), not the op (4 s), ended the wait: the ack names the
    # knob (an op that finished would have loaded the LoRA); the only timing
    # bound is the one load cannot break, that it did not end early.
    assert time.monotonic() - t0 > 0.9
    failure = e.value.errors["e0"]  # the ack's code reaches the trainer, typed
    assert (failure.code, failure.field) == ("backend_timeout", "op_timeout_s")
    assert type(e.value.exception("e0")).__name__ == "BackendTimeout"
    out = c.generate([5, 6, 7], {**GREEDY, "max_tokens": 4})  # still serving
    assert len(out.token_ids) == 4
    assert set(c.control(P.Ping())) == {"e0"}
