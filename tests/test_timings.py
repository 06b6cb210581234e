"""An engine's timing records (engine_node/timings.py): typed, bounded, read
through the Stats control op instead of parsed out of log lines.

The record keeping is tested without sockets; then a real head and a null
engine: streams paused (abort), a weight update, resume, and Stats carries
the commit of that update and where the resume's first output came from."""

from __future__ import annotations

import msgspec
import torch

from bus import protocol as P
from engine_node.timings import ResumeClock, TimingLog, Timings, read_timings
from tests.cluster import Streams, wait_until


def test_resume_clock_marks_relative_to_its_arming() -> None:
    c = ResumeClock()
    assert c.first_output(5.0) is None  # never armed: nothing to report
    c.arm(10.0)
    c.admitted(10.002)
    c.admitted(10.5)  # the first admission counts
    assert c.first_output(10.010) == (10.0, 2.0)
    assert not c.armed and c.first_output(11.0) is None


def test_log_is_bounded_numbered_and_round_trips() -> None:
    log = TimingLog(keep=3)
    for i in range(5):
        log.commit(f"u{i}", "zmq", 0.01 * i, {"backend_seconds": 0.5, "worker": {"path": "plan", "copy_s": 0.002}})
    log.receive("u4", "nccl", 0.2, {"nccl": {"reused": False, "setup_seconds": 0.1, "broadcast_s": 0.05}})
    log.resume.arm(1.0)
    log.resumed(1.5, running=7, backend_trace={"built_ms": 3.0, "sent": 4, "unknown_key": 1})
    log.resumed(2.0, running=1, backend_trace=None)  # not armed again: no record
    snap = log.snapshot()
    assert [c.n for c in snap.commits] == [3, 4, 5] and snap.commits[-1].update_id == "u4"
    assert snap.commits[-1].worker is not None and snap.commits[-1].worker.path == "plan"
    assert snap.receives[0].transport == "nccl" and snap.receives[0].reused is False
    (r,) = snap.resumes
    assert r.first_output_ms == 500.0 and r.running == 7 and r.backend is not None and r.backend.sent == 4
    # what Stats carries (msgpack on the wire) comes back as the same Structs
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode({"timings": log.to_builtins()}))
    assert read_timings(wire) == snap
    assert read_timings({}) == Timings()


def test_a_malformed_backend_report_is_left_out_not_raised() -> None:
    log = TimingLog()
    log.commit("u", "zmq", 0.1, {"worker": {"path": 3}, "backend_seconds": "x"})
    (c,) = log.snapshot().commits
    assert c.worker is None and c.backend_seconds is None


def test_stats_carry_the_update_and_the_resume(cluster_factory) -> None:
    # heartbeat 1 s: on a loaded 2-core machine a fresh engine's first requests
    # have been seen to silence it for > 3 x 0.2 s (the default here), which
    # the head rightly reads as a death; this test is about the records.
    cl = cluster_factory(
        1,
        backend="null",
        model="null",
        backend_options={"tokens_per_step": 1, "step_delay_s": 0.01},
        heartbeat_interval_s=1.0,
    )
    cl.wait_ready(1)
    c = cl.client()
    s = Streams(c, [[5], [9]], {"max_tokens": 400, "ignore_eos": True})
    wait_until(lambda: min(s.counts()) >= 3, 60, "streams under way")
    with c.paused("abort"):
        res = c.update_weights([("w", torch.zeros(4, 4))])
    version = next(iter(res.values()))["weight_version"]
    wait_until(lambda: min(s.counts()) >= 10 or any(s.errors), 60, "streams on after the resume")
    assert s.errors == [None, None], s.errors

    def timings() -> Timings:
        (r,) = c.control(P.Stats()).values()
        return read_timings(r.detail)

    wait_until(lambda: timings().resumes, 30, "a resume record")
    t = timings()
    (commit,) = t.commits
    assert commit.transport == "zmq" and commit.seconds >= 0 and commit.n == 1
    assert commit.update_id  # the trainer's id for that update
    (resume,) = t.resumes
    assert resume.first_output_ms > 0 and resume.admitted_ms is not None
    assert resume.admitted_ms <= resume.first_output_ms
    s.join(60)
    assert any(ch.weight_version == version for ch in s.chunks[0])
