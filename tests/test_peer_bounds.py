"""Issue 22, "bounded memory per peer" and the smaller items, on a real head
with real torch engines: per-client caps name their knob, a client that never
reads is cut off instead of growing the head, long fields are refused at the
decoder with small replies, num_samples < 1 is refused on every client path,
a prompt past max_model_len names the prompt, and a launcher killed with -9
leaves a run folder the next launch removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import msgspec
import psutil
import pytest
import zmq

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest, LimitExceeded
from bus.frames import pack_tokens
from tests.cluster import leak_checked_cluster, wait_until

pytestmark = pytest.mark.timeout(240)

HWM = 64  # the head's --client-hwm here
INFLIGHT = 48  # --max-inflight-per-client
SESSIONS = 4  # --max-sessions-per-client


@pytest.fixture(scope="module")
def module_cluster(tiny_model):
    router_args = [
        "--client-hwm", str(HWM), "--max-inflight-per-client", str(INFLIGHT),
        "--max-sessions-per-client", str(SESSIONS),
    ]  # fmt: skip
    with leak_checked_cluster(
        2, backend="torch", model=tiny_model, router_args=router_args, backend_options={"max_model_len": 2048}
    ) as cl:
        yield cl


def _raw_socket(cl, rcvhwm: int = 1000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    cl.credential().apply(s, None)  # a token holder: past the handshake
    s.connect(cl.frontend)
    return s


def _long(rid: str) -> list:
    msg = P.Generate(request_id=rid, params=P.SamplingParams(max_tokens=1500, ignore_eos=True, temperature=1.0))
    return Codec().encode(msg, [pack_tokens([1, 2, 3])])


def _serves(cl) -> None:
    r = cl.client().generate([1, 2, 3], {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    assert len(r.token_ids) == 3
    assert all(p.poll() is None for p in cl.procs.values())


def _log_events(text: str, event: str) -> list[dict]:
    """The head's JSON log lines (stderr is not a tty under the harness) of `event`."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("event") == event:
                out.append(rec)
    return out


def _idle(cl) -> bool:
    return all(e["running"] == 0 and e["waiting"] == 0 for e in cl.client().health()["engines"].values())


def test_num_samples_below_1_is_refused_on_every_path(module_cluster):
    c = module_cluster.client()
    for call in (
        lambda: c.generate([1, 2, 3], {"max_tokens": 2}, num_samples=0),
        lambda: c.sample([1, 2, 3], 0, {"max_tokens": 2}),
        lambda: list(c.stream([1, 2, 3], {"max_tokens": 2}, num_samples=-1)),
    ):
        with pytest.raises(BadRequest) as ei:
            call()
        assert ei.value.field == "num_samples", ei.value
    s = _raw_socket(module_cluster)  # and at the head, for a client that skips the check
    try:
        msg = P.Generate(request_id="n0", params=P.SamplingParams(max_tokens=2), num_samples=0)
        s.send_multipart(Codec().encode(msg, [pack_tokens([1, 2])]))
        assert s.poll(20_000)
        reply = Codec().decode(s.recv_multipart())[0]
        assert isinstance(reply, P.Error) and reply.field == "num_samples", reply
    finally:
        s.close(linger=0)


def test_a_prompt_longer_than_max_model_len_names_the_prompt(module_cluster):
    c = module_cluster.client()
    with pytest.raises(BadRequest) as ei:
        c.generate([5] * 3000, {"max_tokens": 4})
    assert ei.value.field == "prompt_token_ids", ei.value
    assert "3000" in ei.value.message and "max_model_len" in ei.value.message, ei.value.message
    with pytest.raises(BadRequest) as ei:  # a prompt that fits, with too many new tokens: max_tokens's fault
        c.generate([5] * 1000, {"max_tokens": 1500})
    assert ei.value.field == "params.max_tokens", ei.value


def test_long_strings_are_refused_at_the_decoder_with_a_small_reply(module_cluster):
    s = _raw_socket(module_cluster)
    try:
        for msg, field in (
            (P.Query(request_id="q", what="h" * (4 << 20)), "what"),
            (P.Generate(request_id="g", lora="l" * (4 << 20)), "lora"),
            (P.EndSession(request_id="e", session_id="s" * (4 << 20)), "session_id"),
            (P.Generate(request_id="x" * (4 << 20)), "request_id"),
        ):
            s.send_multipart(Codec().encode(msg, [pack_tokens([1, 2])]))
            assert s.poll(20_000)
            frames = s.recv_multipart()
            assert sum(len(f) for f in frames) < 2048, sum(len(f) for f in frames)
            reply = Codec().decode(frames)[0]
            assert isinstance(reply, P.Error) and reply.field == field and reply.code == "bad_request", reply
    finally:
        s.close(linger=0)
    log = module_cluster.log("head")
    assert max((len(line) for line in log.splitlines()), default=0) < 8192


def test_in_flight_requests_per_client_are_capped_naming_the_knob(module_cluster):
    s = _raw_socket(module_cluster)
    try:
        for i in range(INFLIGHT + 1):
            s.send_multipart(_long(f"r{i}"))
        refused = None
        while refused is None:
            assert s.poll(30_000), "the head must refuse the request past the cap"
            reply = Codec().decode(s.recv_multipart())[0]
            if isinstance(reply, P.Error):
                refused = reply
        assert refused.request_id == f"r{INFLIGHT}" and refused.code == "limit_exceeded", refused
        assert refused.field == "max_inflight_per_client" and "--max-inflight-per-client" in refused.message
    finally:
        s.close(linger=0)  # the head cancels the rest when it cannot reach us
    wait_until(lambda: _idle(module_cluster), 60, "the gone client's requests to be cancelled")


def test_open_sessions_per_client_are_capped_and_end_session_frees_one(module_cluster):
    c = module_cluster.client()
    for i in range(SESSIONS):
        c.generate([1, 2, 3], {"max_tokens": 1}, session_id=f"s{i}")
    with pytest.raises(LimitExceeded) as ei:
        c.generate([1, 2, 3], {"max_tokens": 1}, session_id="one-too-many")
    assert ei.value.field == "max_sessions_per_client", ei.value
    c.generate([1, 2, 3], {"max_tokens": 1}, session_id="s0")  # a known session is not a new one
    assert c.end_session("s0")
    c.generate([1, 2, 3], {"max_tokens": 1}, session_id="one-too-many")
    other = module_cluster.client()  # the cap is per client
    other.generate([1, 2, 3], {"max_tokens": 1}, session_id="other-0")


def test_a_client_that_never_reads_is_cut_off_and_the_head_stays_bounded(module_cluster):
    cl = module_cluster
    head = psutil.Process(cl.procs["head"].pid)
    rss0 = head.memory_info().rss
    c = cl.client()
    before = c.stats()["counters"]["client_over_hwm"]
    s = _raw_socket(cl, rcvhwm=1)
    try:
        for i in range(INFLIGHT):  # 48 streams of 1,500 tokens, never read
            s.send_multipart(_long(f"slow{i}"))
        wait_until(lambda: c.stats()["counters"]["client_over_hwm"] > before, 120, "the head to cut the client off")
        wait_until(lambda: _idle(cl), 60, "its requests to be cancelled on the engines")
        grown = head.memory_info().rss - rss0
        assert grown < 150 << 20, f"head RSS grew {grown >> 20} MB"
        # The head counts the cut-off and logs it (WARNING, the tests' level) in one
        # handler, before it answers the stats() that saw the counter move: every
        # counted cut-off has its log line, naming the knob.
        cut = c.stats()["counters"]["client_over_hwm"]
        logged = _log_events(cl.log("head"), "client_over_hwm")
        assert len(logged) == cut > before, (cut, before, logged)
        assert all(e["client_hwm"] == HWM and e["level"] == "warning" for e in logged), logged
    finally:
        s.close(linger=0)
    _serves(cl)


def test_the_next_launch_removes_the_run_folder_of_a_killed_launcher():
    """The launcher's own function on real folders: one of a dead launcher
    (a process that exited), one of a live one (this test), one without a
    launcher.pid (not a launcher's): only the first goes."""
    import launcher.supervisor

    tmp = tempfile.mkdtemp(prefix="rbt-stale-")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ct = psutil.Process().create_time()
    folders = {}
    for name, owner in (("dead", f"{dead.pid} {ct}"), ("live", None), ("foreign", "")):
        d = folders[name] = os.path.join(tmp, f"rbus-{name}")
        os.makedirs(d)
        if owner is None:
            launcher.supervisor.mark_run_dir(d)
        elif owner:
            with open(os.path.join(d, "launcher.pid"), "w") as f:
                f.write(owner)
    try:
        removed = launcher.supervisor.remove_stale_run_dirs(tmp)
        assert removed == [folders["dead"]], removed
        assert not os.path.exists(folders["dead"])
        assert os.path.isdir(folders["live"]) and os.path.isdir(folders["foreign"])
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def test_query_answers_are_cached_under_a_flood(module_cluster):
    """4,000 health queries: every one answered, the head's RSS flat."""
    cl = module_cluster
    head = psutil.Process(cl.procs["head"].pid)
    rss0 = head.memory_info().rss
    s = _raw_socket(cl)
    try:
        body = msgspec.msgpack.encode(P.Query(request_id="h", what="health"))
        got = 0
        for _ in range(125):  # bursts of 32: below the head's client_hwm (64) here
            for _ in range(32):
                s.send_multipart([body])
            for _ in range(32):
                assert s.poll(20_000), f"no answer after {got}"
                s.recv_multipart()
                got += 1
        assert got == 4000
    finally:
        s.close(linger=0)
    assert head.memory_info().rss - rss0 < 50 << 20
