"""Issue 34 row 10: refusals are counted and logged at a bounded rate.

2,000 each of a token-less Pause, a garbage frame on the events socket and a
Register with a wrong token, sent to a real head (null engine, IPC) by raw
DEALERs that passed the handshake (each holds its socket's role credential),
and 200 handshakes with a wrong credential (refused by ZAP before any frame):
every one is counted (the head's `stats()` counters, what /metrics
exports) and the head's log (at INFO, the launcher's default) grows by one
line per interval per kind (bus/ratelog.py), not one per message. On fe0cb18
the log had one line per message (6,000 here, ~400 MB per million).
"""

from __future__ import annotations

import time

import pytest
import zmq

from bus import protocol as P
from bus import roles
from bus.codec import Codec
from bus.ratelog import RateLimitedLog
from bus.roles import Plain
from tests.cluster import Cluster, wait_until

pytestmark = pytest.mark.timeout(90)

N = 2000
HANDSHAKES = 200


def _flood(address: str, frames: list[list[bytes]], expect_replies: bool, cred: Plain | None = None) -> int:
    """Send every message from one DEALER; read back the replies (the frontend
    answers each refused Control) so the peer is not cut for not reading."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    if cred is not None:
        cred.apply(s, None)
    s.connect(address)
    got = 0
    try:
        for f in frames:
            s.send_multipart(f)
            while s.poll(0):
                s.recv_multipart()
                got += 1
        deadline = time.monotonic() + 30
        while expect_replies and got < len(frames) and time.monotonic() < deadline:
            if s.poll(200):
                s.recv_multipart()
                got += 1
    finally:
        # Without replies to wait for, what is still queued must go out before
        # the socket closes (linger 0 would drop it on a loaded machine).
        s.close(linger=0 if expect_replies else 20_000)
        ctx.term()
    return got


def test_two_thousand_refusals_of_each_kind_are_counted_and_logged_a_few_times(monkeypatch):
    monkeypatch.setenv("ROLLOUT_BUS_LOG_LEVEL", "INFO")
    codec = Codec()
    with Cluster(1, backend="null", model="null") as cl:
        c = cl.client()
        c.wait_ready(1, 60)
        lines_before = len(cl.log("head").splitlines())

        pauses = [codec.encode(P.Control(request_id=f"p{i}", op=P.Pause(mode="keep"))) for i in range(N)]
        client, engine = cl.credential(roles.CLIENT), cl.credential(roles.ENGINE)
        assert _flood(cl.frontend, pauses, expect_replies=True, cred=client) == N  # each refusal is answered
        garbage = [[b"\xc1garbage" + i.to_bytes(4, "little")] for i in range(N)]
        _flood(cl.events, garbage, expect_replies=False, cred=engine)
        reg = P.Register(
            engine_id="intruder", data_address="ipc:///nowhere", weight_address="ipc:///nowhere",
            backend="null", model="null", protocol_version=P.PROTOCOL_VERSION, incarnation="x", token="0" * 64,
        )  # fmt: skip
        _flood(cl.events, [codec.encode(reg)] * N, expect_replies=False, cred=engine)
        # Peers with a wrong credential: each connection is refused at the handshake (ZAP),
        # before any frame; libzmq retries, so the count only grows while they stay.
        wrong = Plain(username=client.username, password="not-the-token")
        ctx = zmq.Context()
        strangers = []
        for _ in range(HANDSHAKES):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            wrong.apply(s, None)
            s.connect(cl.frontend)
            strangers.append(s)

        def counted() -> bool:
            k = c.stats()["counters"]
            return (
                k["unauthorized"] >= N
                and k["bad_messages"] >= N
                and k["register_refused_token"] >= N
                and k["handshakes_refused"] >= HANDSHAKES
            )

        try:
            wait_until(counted, 30, "the head to count every refusal")
        finally:
            for s in strangers:
                s.close(linger=0)
            ctx.term()
        k = c.stats()["counters"]
        assert (k["unauthorized"], k["bad_messages"], k["register_refused_token"]) == (N, N, N)
        assert k["request_errors"] >= N  # each refused Control was answered with an Error
        assert c.health()["healthy"] and c.generate([4, 5, 6], {"max_tokens": 3}).token_ids == [7, 8, 9]

        new = cl.log("head").splitlines()[lines_before:]
        per_kind = {
            kind: sum(1 for line in new if kind in line)
            for kind in (
                "control_refused_token",
                "bad_message",
                "register_refused_token",
                "request_error",
                "zap_refused",
            )
        }
        # One line per kind per 10 s interval (the test runs well under a
        # minute: a few lines at most), against 2,000 each before.
        assert all(1 <= n <= 6 for n in per_kind.values()), per_kind
        assert len(new) < 60, new[-20:]


class _Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.lines.append((event, kw))

    info = error = warning


def test_rate_limited_log_keeps_one_line_per_interval_per_kind_and_counts_all():
    now = [0.0]
    out = _Lines()
    rl = RateLimitedLog(out, interval_s=10.0, clock=lambda: now[0])
    for i in range(1000):
        now[0] = i * 0.05  # 50 s of refusals of two kinds
        rl.refused("bad_message", socket="events")
        rl.refused("request_error", "info", kind="request_error.bad_request")
    assert rl.counts == {"bad_message": 1000, "request_error.bad_request": 1000}
    assert len(out.lines) == 10  # 5 intervals x 2 kinds
    assert sum(kw.get("repeats", 0) for _, kw in out.lines) == 2000 - 10 - sum(rl._held.values())
    now[0] = 100.0
    rl.flush()  # what the last interval held is still reported
    assert [e for e, _ in out.lines[-2:]] == ["refusals_repeated"] * 2
    assert sum(kw.get("repeats", 0) for _, kw in out.lines) == 2000 - 10
