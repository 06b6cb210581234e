"""Trust without --curve (issue 22): who may join the cluster and speak for an
engine when security is off (the default, loopback).

- the join token: engines present it in Register, clients in control ops that
  change the cluster; a stranger without it cannot take even a DEAD engine's id;
- events (heartbeats, acks) are believed only from the registered connection,
  whose identity carries a nonce secret to the engine process;
- rogue engines: another vocabulary is refused at Register (field vocab_size);
  a weight version far above the cluster's does not move the cluster version.

Real head and engine processes on IPC (tests/cluster.py, which gives the head
and its engines a token). Two peers here are FAKES on purpose, named for what
they fake: `ForgingStranger` (a process that reconnects under a dead engine's
identity and forges its heartbeats and acks) and `RogueEngine` (a token holder
that registers with weight_version=10**6); both speak the real wire protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time

import pytest
import zmq

from bus import protocol as P
from bus import roles
from bus.auth import KeyFileError, find_token, read_token, token_path_for, write_token
from bus.codec import Codec
from bus.errors import AuthRefused, ControlError, Unauthorized
from tests.cluster import wait_until

pytestmark = pytest.mark.timeout(90)

NULL = {"backend": "null", "model": "null"}


class ForgingStranger:
    """FAKE peer (fault injection): connects to the head's events socket under
    every identity it can guess for a dead engine, beats for it, and acks every
    command naming it (it listens on the control PUB). `plain`: the engine
    role's credential (a token holder); None: a stranger without the token,
    whose handshakes the head refuses (counted in `refused`, issue 34)."""

    def __init__(self, cl, engine_id: str, incarnation: str, plain=None) -> None:
        self.cl, self.engine_id, self.incarnation = cl, engine_id, incarnation
        self.plain = plain
        self.forged_acks = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        codec = Codec()
        base = f"{self.engine_id}/{self.incarnation}"
        # protocol 5's identities, and a guess at a nonce'd one
        idents = [base, base + "/hb", f"{base}/{secrets.token_hex(16)}"]
        socks = []
        for ident in idents:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, ident.encode())
            s.setsockopt(zmq.LINGER, 0)
            if self.plain is not None:
                self.plain.apply(s, None)
            socks.append(s)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if self.plain is not None:
            self.plain.apply(sub, None)
        for topic in (b"*\x00", self.engine_id.encode() + b"\x00"):
            sub.setsockopt(zmq.SUBSCRIBE, topic)
        # Which side reports a mechanism mismatch first is a race: libzmq says PROTOCOL when this
        # side sees it, NO_DETAIL when the head closed the connection first (over IPC, mostly).
        failed = (
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        monitors = [s.get_monitor_socket(failed) for s in [*socks, sub]]
        for s in socks:
            s.connect(self.cl.events)
        sub.connect(self.cl.control)
        steps = 0
        try:
            while not self._stop.is_set():
                steps += 1
                hb = P.Heartbeat(engine_id=self.engine_id, incarnation=self.incarnation, steps=steps)
                for m in monitors:
                    while m.poll(0):
                        m.recv_multipart()
                        self.refused += 1
                for s in socks:
                    with contextlib.suppress(zmq.Again):  # refused at the handshake: no pipe to send on
                        s.send_multipart(codec.encode(hb), zmq.NOBLOCK)
                while sub.poll(0):
                    frames = sub.recv_multipart()
                    cmd, _ = codec.decode(frames[1:])
                    if isinstance(cmd, P.Command) and (cmd.targets is None or self.engine_id in cmd.targets):
                        result = P.PauseResult(mode="keep", scope="*") if isinstance(cmd.op, P.Pause) else P.Done()
                        if isinstance(cmd.op, P.Ping):
                            result = P.PingResult(incarnation=self.incarnation)
                        ack = P.Ack(seq=cmd.seq, engine_id=self.engine_id, result=result)
                        for s in socks:
                            with contextlib.suppress(zmq.Again):
                                s.send_multipart(codec.encode(ack), zmq.NOBLOCK)
                        self.forged_acks += 1
                time.sleep(0.05)
        finally:
            for s in [*socks, sub]:
                s.disable_monitor()
                s.close(linger=0)
            for m in monitors:
                m.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("holds_token", [False, True], ids=["stranger", "token-holder"])
def test_a_dead_engines_events_count_only_from_its_own_connection(cluster_factory, holds_token):
    """Issue: after kill -9 of e0, a stranger connecting as e0/<incarnation> kept
    the dead incarnation healthy and its forged ack made pause() report e0 paused.
    Issue 34 row 17: a stranger without the token never gets past the handshake
    of the events and control sockets (fe0cb18 let it connect and send); one
    holding the token gets in, and what it sends for e0 is dropped (e0's NONCE)."""
    cl = cluster_factory(2, **NULL)
    c = cl.client()
    cl.wait_ready(2, 30)  # the harness's wait: the head may still be starting
    inc = c.health()["engines"]["e0"]["incarnation"]
    cl.kill("e0")
    token = read_token(cl.token_file)
    stranger = ForgingStranger(cl, "e0", inc, plain=roles.as_role(token, roles.ENGINE) if holds_token else None)
    try:
        if holds_token:
            wait_until(lambda: c.stats()["counters"]["spoofed_events"], 10, "forgeries to arrive")
        else:
            wait_until(lambda: stranger.refused >= 4, 10, "the head to refuse the stranger's handshakes")
        # 3 missed heartbeats of 0.2 s: the dead e0 is seen dead, whatever the stranger sends
        wait_until(lambda: not c.health()["engines"]["e0"]["healthy"], 10, "the dead e0 to be seen dead")
        time.sleep(1.0)  # ... and stays dead under the stranger's beats
        assert not c.health()["engines"]["e0"]["healthy"]
        with pytest.raises(ControlError) as ei:
            c.pause("keep", timeout_s=5)
        assert ei.value.missing == ["e0"] and set(ei.value.results) == {"e1"}  # no forged "paused"
        assert set(c.control(P.Resume(), strict=False)) == {"e1"}
        rs = c.generate([[4, 5, 6]] * 10, {"max_tokens": 3})
        assert [r.token_ids for r in rs] == [[7, 8, 9]] * 10 and {r.engine_id for r in rs} == {"e1"}
        if holds_token:
            assert c.stats()["counters"]["spoofed_events"] > 0
            assert "engine_event_from_another_connection" in cl.log("head")
        else:
            assert c.stats()["counters"]["spoofed_events"] == 0 and stranger.forged_acks == 0
    finally:
        stranger.stop()


def test_a_dead_engines_id_needs_the_token_and_its_restart_wins(cluster_factory, tmp_path):
    """Issue: a stranger registered the dead e0, took traffic, and the real
    restarted e0 was refused 8 times."""
    cl = cluster_factory(2, **NULL)
    c = cl.client()
    cl.wait_ready(2, 30)  # the harness's wait: the head may still be starting
    old = c.health()["engines"]["e0"]["incarnation"]
    cl.kill("e0")
    time.sleep(1.0)  # e0 is past its heartbeat deadline: its id is free for a restart
    stranger = cl.start_engine("stranger", engine_id="e0", token_file="", extra=["--register-timeout-s", "20"])
    assert stranger.wait(timeout=30) == 2  # refused at once, not retried
    assert "field=token" in cl.log("stranger") and "no join token" in cl.log("stranger")
    wrong = write_token(str(tmp_path / "wrong.token"), secrets.token_hex(32))
    liar = cl.start_engine("liar", engine_id="e0", token_file=wrong, extra=["--register-timeout-s", "20"])
    assert liar.wait(timeout=30) == 2
    assert "a wrong join token" in cl.log("liar")
    # issue 34: both are refused at the handshake (no Register reaches the head); the wrong token by ZAP
    wait_until(lambda: "zap_refused" in cl.log("head"), 5, "the head's log of the refusal")

    cl.start_engine("e0")  # the real restart, with the token
    wait_until(
        lambda: (e := c.health()["engines"].get("e0")) and e["healthy"] and e["incarnation"] != old,
        20,
        "the restarted e0 to take its id",
    )
    assert "register_refused" not in cl.log("e0")
    rs = c.generate([[4, 5, 6]] * 20, {"max_tokens": 3})
    assert [r.token_ids for r in rs] == [[7, 8, 9]] * 20


def test_control_ops_that_change_the_cluster_need_the_token(cluster_factory, tmp_path):
    cl = cluster_factory(1, **NULL)
    c = cl.client()  # finds the token the way a trainer on the launcher's host does: by address
    assert c._aclient.token_file == cl.token_file == token_path_for(cl.frontend)
    cl.wait_ready(1, 30)  # the harness's wait: the head may still be starting

    # Issue 34 (rows 3, 8): the frontend admits token holders only, at the handshake. Without the
    # token nothing gets through (fe0cb18 served generation and queries, `weight_updates` included,
    # which showed the open update's id and holder); the refusal is typed and immediate.
    anon = cl.client(token_file="")
    updates = lambda: anon._call(anon._aclient._query("weight_updates", P.WeightUpdatesView))
    for call in (lambda: anon.generate([4, 5, 6], {"max_tokens": 3}), anon.health, updates, lambda: anon.pause("keep")):
        t0 = time.monotonic()
        with pytest.raises(AuthRefused) as ei:
            call()
        assert ei.value.field == "token" and "needs the cluster's join token" in str(ei.value)
        assert time.monotonic() - t0 < 5
    wrong = cl.client(token_file=write_token(str(tmp_path / "wrong.token"), secrets.token_hex(32)))
    with pytest.raises(AuthRefused, match="refused this client's join token") as ei:
        wrong.pause("keep")
    assert ei.value.field == "token"
    assert c.is_paused() is False  # nothing of the refused ops happened
    assert set(c.pause("keep")) == {"e0"} and c.is_paused()
    c.resume()
    wait_until(lambda: "zap_refused" in cl.log("head"), 5, "the head's log of the wrong token")
    # a token holder still proves the token in each op that changes the cluster (defence in depth)
    real, c._aclient._token = c._aclient._token, "0" * 64
    try:
        with pytest.raises(Unauthorized, match="a wrong join token"):
            c.pause("keep")
    finally:
        c._aclient._token = real
    assert c.is_paused() is False


def test_token_files_must_be_private(cluster_factory, tmp_path):
    path = write_token(str(tmp_path / "t" / "cluster.token"), secrets.token_hex(32))
    assert os.stat(path).st_mode & 0o777 == 0o600 and read_token(path)
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError) as ei:
        read_token(path)
    assert path in str(ei.value) and "chmod 600" in str(ei.value)
    with pytest.raises(KeyFileError):
        find_token("tcp://127.0.0.1:1", path)
    # a head given such a file refuses to start, naming it
    cl = cluster_factory(0, router_args=["--token-file", path], **NULL)
    assert cl.head.wait(timeout=30) == 2
    assert path in cl.log("head") and "group/others" in cl.log("head")


def test_an_engine_of_another_vocabulary_is_refused(cluster_factory):
    """Issue: a rogue engine with vocab_size=1 joined (here 2: the null backend needs two) and made valid requests fail."""
    cl = cluster_factory(1, **NULL)  # the null backend's vocabulary: 32000
    c = cl.client()
    cl.wait_ready(1, 30)  # the harness's wait: the head may still be starting
    assert c.health()["vocab_size"] == 32000
    rogue = cl.start_engine("rogue", extra=["--backend-options", json.dumps({"vocab": 2})])
    assert rogue.wait(timeout=30) == 2
    assert "field=vocab_size" in cl.log("rogue")
    wait_until(lambda: "register_refused" in cl.log("head"), 5, "the head's log of the refusal")
    assert set(c.health()["engines"]) == {"e0"}
    rs = c.generate([[30000, 5]] * 20, {"max_tokens": 2})
    assert [r.token_ids for r in rs] == [[6, 7]] * 20


class RogueEngine:
    """FAKE engine (fault injection) that holds the token and registers with
    weight_version=10**6: it joins (acks the Ping), heartbeats, serves nothing."""

    def __init__(self, cl, engine_id: str = "rogue", weight_version: int = 10**6) -> None:
        self.cl, self.engine_id, self.weight_version = cl, engine_id, weight_version
        self.incarnation = secrets.token_hex(6)
        self.reply: P.RegisterReply | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        codec = Codec()
        data = ctx.socket(zmq.ROUTER)
        # PLAIN like a real engine's data socket (no ZAP handler here: it takes
        # the head's credential as it comes). A NULL socket failed the head's
        # handshake, and when the head saw that first (a race; under load) it
        # marked the rogue unreachable, SILENT rather than the STALE judged here.
        data.plain_server = True
        data.bind(f"ipc://{self.cl.dir}/{self.engine_id}.data")
        ev = ctx.socket(zmq.DEALER)
        ev.setsockopt(zmq.IDENTITY, f"{self.engine_id}/{self.incarnation}/{secrets.token_hex(16)}".encode())
        as_engine = roles.as_role(read_token(self.cl.token_file), roles.ENGINE)  # a token holder
        assert as_engine is not None
        as_engine.apply(ev, None)
        ev.connect(self.cl.events)
        sub = ctx.socket(zmq.SUB)
        as_engine.apply(sub, None)
        for topic in (b"*\x00", self.engine_id.encode() + b"\x00"):
            sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(self.cl.control)
        reg = P.Register(
            engine_id=self.engine_id, data_address=f"ipc://{self.cl.dir}/{self.engine_id}.data", weight_address="",
            backend="null", model="null", protocol_version=P.PROTOCOL_VERSION, incarnation=self.incarnation,
            vocab_size=32000, weight_version=self.weight_version, token=read_token(self.cl.token_file),
        )  # fmt: skip
        steps = 0
        try:
            ev.send_multipart(codec.encode(reg))
            while not self._stop.is_set():
                while ev.poll(0):
                    msg, _ = codec.decode(ev.recv_multipart())
                    if isinstance(msg, P.RegisterReply):
                        self.reply = msg
                while sub.poll(0):
                    cmd, _ = codec.decode(sub.recv_multipart()[1:])
                    if isinstance(cmd, P.Command):
                        result = P.PingResult(weight_version=self.weight_version, incarnation=self.incarnation)
                        if not isinstance(cmd.op, P.Ping):
                            result = P.Done()
                        ev.send_multipart(codec.encode(P.Ack(seq=cmd.seq, engine_id=self.engine_id, result=result)))
                steps += 1
                hb = P.Heartbeat(self.engine_id, self.incarnation, weight_version=self.weight_version, steps=steps)
                ev.send_multipart(codec.encode(hb))
                time.sleep(0.05)
        finally:
            for s in (data, ev, sub):
                s.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_an_engine_far_ahead_does_not_move_the_cluster_version(cluster_factory):
    """Issue: a rogue engine with weight_version=10**6 raised the cluster version
    (every real engine became stale). The version moves only by the head's own
    commits; the rogue is STALE (ahead) and gets no traffic. Once the head's
    adoption window is over (issue 34: within it a head that committed nothing
    adopts the highest version engines bring; 0 here: the first joiner's only)."""
    cl = cluster_factory(1, **NULL, router_args=["--adopt-window-s", "0"])
    c = cl.client()
    cl.wait_ready(1, 30)  # the harness's wait: the head may still be starting
    rogue = RogueEngine(cl)
    try:
        wait_until(lambda: rogue.reply is not None, 10, "the rogue's RegisterReply")
        assert rogue.reply is not None and rogue.reply.ok  # it holds the token: it may join ...
        wait_until(
            lambda: (e := c.health()["engines"].get("rogue")) and e["state"] == "stale", 10, "the rogue to be judged"
        )
        h = c.health()
        assert h["weight_version"] == 0 and h["engines"]["e0"]["healthy"]  # ... but not move the cluster
        assert "> cluster weight version 0" in h["engines"]["rogue"]["reason"]
        rs = c.generate([[4, 5, 6]] * 20, {"max_tokens": 3})
        assert [r.token_ids for r in rs] == [[7, 8, 9]] * 20 and {r.engine_id for r in rs} == {"e0"}
        assert "engine_unreachable" not in cl.log("head")  # judged by its version, not by a failed link
    finally:
        rogue.stop()


def test_version_rules_without_sockets():
    """The rules behind the last test, as state machines: a head with no commit
    adopts the highest version joiners bring within adopt_window_s of the first
    join, and nothing after; an engine that registered above
    it is STALE until an update brings it to the cluster version, while a
    version an engine reaches after joining (a commit round still closing, a
    level-2 wake reloading its checkpoint) is not "ahead"."""
    from router_node.cluster_state import ClusterWeights
    from router_node.registry import EngineEntry, EngineState
    from router_node.trust import ident_ok as _ident_ok

    cw = ClusterWeights(adopt_window_s=2.0)
    assert cw.on_register(3, now=10.0)  # a restarted head learns where the cluster was
    assert cw.settling(11.0) and not cw.settling(12.5)  # routes nothing while versions may still come
    assert cw.on_register(5, now=11.0) and not cw.on_register(4, now=11.5)  # the highest within the window
    assert not cw.on_register(10**6, now=12.5)  # a later joiner cannot drag it along
    assert (cw.version, cw.source) == (5, "registration")

    def entry(version: int) -> EngineEntry:
        reg = P.Register("e0", "ipc://d", "", "null", "m", P.PROTOCOL_VERSION, "inc", weight_version=version)
        e = EngineEntry(reg=reg, sock=None, registered_at=0.0, state=EngineState.HEALTHY, last_seen=10.0)  # type: ignore[arg-type]
        e.weight_version = version
        return e

    def judge(e: EngineEntry, cluster_version: int) -> tuple[EngineState, str]:
        return e.evaluate(10.0, deadline_s=1.0, stall_timeout_s=5.0, cluster_version=cluster_version)

    rogue = entry(10**6)
    state, reason = judge(rogue, 3)
    assert state is EngineState.STALE and "> cluster weight version 3" in reason
    rogue.weight_version += 1  # it woke from a level-2 sleep: still ahead, still stale
    assert judge(rogue, 3)[0] is EngineState.STALE
    rogue.weight_version = 4  # an update brought it to the cluster version
    assert judge(rogue, 4)[0] is EngineState.HEALTHY
    real = entry(3)
    assert judge(real, 3)[0] is EngineState.HEALTHY
    real.weight_version = 4  # acked a commit (or reloaded its checkpoint) before the cluster version moved
    assert judge(real, 3)[0] is EngineState.HEALTHY

    nonce = secrets.token_hex(16)
    assert _ident_ok(f"e0/inc/{nonce}".encode(), "e0", "inc")
    for bad in ("e0/inc", "e0/inc/hb", f"e0/other/{nonce}", "e0/inc/" + "z" * 32, "e0/inc/abc"):
        assert not _ident_ok(bad.encode(), "e0", "inc"), bad


def test_a_client_made_before_the_token_is_published_finds_it_later(cluster_factory, tmp_path):
    """A script that starts the launcher and its client together makes the
    Client before launch.py published the token: it was refused for good
    (no token, and it never looked again). Now a refusal for want of the token
    looks again, and wait_ready(timeout_s=...) waits for it to appear."""
    from trainer_bridge import Client

    cl = cluster_factory(1, **NULL)
    cl.wait_ready(1, 30)
    hidden = str(tmp_path / "not-yet-published")
    os.rename(cl.token_file, hidden)  # as if the launcher had not published it yet
    c = Client(cl.frontend, connect_timeout_s=30)
    cl.clients.append(c)
    publish = threading.Timer(1.0, os.rename, (hidden, cl.token_file))
    try:
        assert c._aclient.token_file is None
        with pytest.raises(AuthRefused) as ei:
            c.generate([4, 5, 6], {"max_tokens": 3})
        assert ei.value.field == "token"
        publish.start()
        assert c.wait_ready(1, timeout_s=30)["healthy"]  # refused until the token appears, then served
    finally:
        publish.cancel()
        if publish.is_alive():
            publish.join()
        if not os.path.exists(cl.token_file):
            os.rename(hidden, cl.token_file)
    assert c._aclient.token_file == cl.token_file
    assert c.generate([4, 5, 6], {"max_tokens": 3}).finish_reason == "length"
    assert set(c.pause("keep")) == {"e0"}  # the token proves it in control ops too
    c.resume()
