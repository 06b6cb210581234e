"""Single hostile frames that used to kill or wedge a process (issue 13).

Each is sent alone over a raw socket to a real head / engine; afterwards the
cluster must still serve a request end to end and every process must be alive.
"""

from __future__ import annotations

import os
import secrets
import stat

import msgspec
import pytest
import zmq

from bus import protocol as P
from bus import roles
from bus.auth import KeyDir, read_token
from bus.codec import Codec
from bus.errors import BadRequest
from bus.sockets import check_endpoint

pytestmark = pytest.mark.timeout(90)

_ENC = msgspec.msgpack.encode
_DEEP = b"\x91" * 5000 + b"\xc0"  # 5,000 nested one-element arrays


def _raw_ack(result_body: bytes) -> bytes:
    """An Ack body [tag, seq, engine_id, ok, result] with a hand-made result."""
    return b"\x95" + _ENC("ack") + _ENC(1) + _ENC("e0") + _ENC(True) + result_body


def _bad_utf8_heartbeat() -> bytes:
    return _ENC(["heartbeat", "e0", "inc"]).replace(b"e0", b"\xff\xfe", 1)


HEAD_EVENT_FRAMES = {
    "heartbeat engine_id not UTF-8": [_bad_utf8_heartbeat()],
    "ack result without weight_version": [_raw_ack(_ENC({"epoch": 99, "loras": []}))],
    "ack result 5000 deep": [_raw_ack(b"\x81" + _ENC("epoch") + _DEEP)],
    "ack loras not a list": [_raw_ack(_ENC({"epoch": 99, "weight_version": "x", "loras": 3}))],
    "register data_address ABORT": [
        _ENC(
            P.Register(
                engine_id="evil",
                data_address="ABORT",
                weight_address="",
                backend="x",
                model="x",
                protocol_version=P.PROTOCOL_VERSION,
                incarnation="i",
            )
        ),
    ],
    "random bytes": [os.urandom(64)],
    "unknown kind": [_ENC(["no-such-kind", "e0"])],
    "empty array": [b"\x90"],
    "protocol 10 layout (kind frame)": [b"H", _ENC(["heartbeat", "e0", "inc"])],
}


@pytest.fixture
def cluster(torch_cluster):
    """The module-scoped two-engine cluster of conftest (torn down and leak-checked there)."""
    return torch_cluster


def _serves(cl) -> None:
    c = cl.client()
    r = c.generate([1, 2, 3], {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    assert len(r.token_ids) == 4
    assert all(p.poll() is None for p in cl.procs.values()), {k: p.poll() for k, p in cl.procs.items()}


@pytest.mark.parametrize("name", list(HEAD_EVENT_FRAMES))
def test_head_outlives_a_hostile_event_frame(cluster, name):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        cluster.credential(roles.ENGINE).apply(s, None)  # a token holder: past the handshake
        s.connect(cluster.events)
        frames = HEAD_EVENT_FRAMES[name]
        if name.startswith("register"):  # with the cluster's join token: the field check is what is tested
            reg = Codec().decode(frames)[0]
            frames = Codec().encode(msgspec.structs.replace(reg, token=read_token(cluster.token_file)))
        s.send_multipart(frames)
        if name.startswith("register"):
            assert s.poll(10_000), "the head must answer a bad Register with a refusal"
            reply = Codec().decode(s.recv_multipart()[:1])[0]
            assert isinstance(reply, P.RegisterReply) and not reply.ok and "data_address" in (reply.error or "")
    finally:
        s.close(linger=0)
    _serves(cluster)
    assert "evil" not in cluster.client().health()["engines"]


def test_engine_outlives_a_weight_bucket_with_a_non_utf8_update_id(cluster):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        cluster.credential().apply(s, None)  # a token holder: past the handshake
        s.connect(f"ipc://{cluster.dir}/e0.weights")
        body = _ENC(["wbucket", "u1", 0]).replace(b"u1", b"\xc3\x28", 1)
        s.send_multipart([body, b"\x00" * 64])
        assert s.poll(10_000), "the engine must answer a bad bucket with a typed ack"
        ack = Codec().decode(s.recv_multipart()[:1])[0]
        assert isinstance(ack, P.WeightBucketAck) and not ack.ok
    finally:
        s.close(linger=0)
    _serves(cluster)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": float("nan")}, "params.temperature"),
        ({"temperature": float("inf")}, "params.temperature"),
        ({"top_p": float("nan")}, "params.top_p"),
        ({"seed": -1}, "params.seed"),
    ],
)
def test_non_finite_sampling_params_are_refused_naming_the_field(cluster, params, field):
    c = cluster.client()
    with pytest.raises(BadRequest) as ei:
        c.generate([1, 2, 3], {"max_tokens": 2, **params})
    assert ei.value.field == field


def test_endpoint_check_names_the_field():
    assert check_endpoint("tcp://10.0.0.1:5555", field="f") == "tcp://10.0.0.1:5555"
    assert check_endpoint("ipc:///tmp/a/b", field="f") == "ipc:///tmp/a/b"
    for bad in ("ABORT", "tcp://*:1", "tcp://h:0", "tcp://h:70000", "inproc://x", ""):
        with pytest.raises(BadRequest) as ei:
            check_endpoint(bad, field="data_address")
        assert ei.value.field == "data_address"


def test_curve_secret_key_is_private(tmp_path):
    d = KeyDir(str(tmp_path / "keys")).init().root
    secret = os.path.join(d, "head.key_secret")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 0.0, -1.0])
def test_control_with_a_deadline_that_never_or_already_passed_is_refused(cluster, timeout_s):
    """A NaN Control.timeout_s used to be republished forever, never answered
    (the fuzzer's finding): now a BadRequest naming the field, at once."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        cluster.credential().apply(s, None)  # a token holder: past the handshake
        s.connect(cluster.frontend)
        s.send_multipart(Codec().encode(P.Control(request_id="c-nan", op=P.Ping(), timeout_s=timeout_s)))
        assert s.poll(10_000), "the head must refuse the Control at once"
        reply = Codec().decode(s.recv_multipart())[0]
        assert isinstance(reply, P.Error), reply
        assert (reply.code, reply.field, reply.request_id) == ("bad_request", "timeout_s", "c-nan")
    finally:
        s.close(linger=0)
    _serves(cluster)


def _register(cluster, engine_id: str, incarnation: str, weight_version: int = 0) -> list[bytes]:
    """A Register as a node holding the cluster's join token sends it."""
    reg = P.Register(
        engine_id=engine_id,
        data_address="ipc:///tmp/rollout-bus-nowhere",
        weight_address="",
        backend="x",
        model="x",
        protocol_version=P.PROTOCOL_VERSION,
        incarnation=incarnation,
        weight_version=weight_version,
        token=read_token(cluster.token_file),
    )
    return Codec().encode(reg)


def _node_ident(engine_id: str, incarnation: str) -> bytes:
    """As a node connects: engine_id/incarnation/NONCE (the nonce is its secret)."""
    return f"{engine_id}/{incarnation}/{secrets.token_hex(16)}".encode()


def test_a_register_that_never_joins_does_not_move_the_cluster_version(cluster):
    """The fuzzer's finding: a Register with weight_version=7 from a peer that
    never acks its join made every real engine stale (NoHealthyEngine)."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, _node_ident("ghost-v7", "i1"))
    try:
        cluster.credential(roles.ENGINE).apply(s, None)  # a token holder: past the handshake
        s.connect(cluster.events)
        s.send_multipart(_register(cluster, "ghost-v7", "i1", weight_version=7))
        assert s.poll(10_000) and Codec().decode(s.recv_multipart())[0].ok
    finally:
        s.close(linger=0)
    health = cluster.client().health()
    assert health["weight_version"] == 0 and health["stale"] == [], health
    _serves(cluster)


def test_re_registering_a_joining_engine_is_refused_and_the_head_serves(cluster):
    """The fuzzer's finding: a second Register of an engine still joining made
    the head forget the first entry twice (KeyError in the poller). Since the
    id check (issue 13: an id held by a live engine cannot be taken), the second
    one is refused with retry=True, the first entry stays, and the head serves."""
    ctx = zmq.Context.instance()
    replies = []
    for inc in ("first", "second"):  # two processes, each connecting as engine_id/incarnation/NONCE
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, _node_ident("ghost-twice", inc))
        try:
            cluster.credential(roles.ENGINE).apply(s, None)  # a token holder: past the handshake
            s.connect(cluster.events)
            s.send_multipart(_register(cluster, "ghost-twice", inc))
            assert s.poll(10_000), "the head must answer every Register"
            replies.append(Codec().decode(s.recv_multipart())[0])
        finally:
            s.close(linger=0)
    assert replies[0].ok
    assert not replies[1].ok and replies[1].retry and "held by a live engine" in replies[1].error
    engines = cluster.client().health()["engines"]
    if "ghost-twice" in engines:  # it never heartbeats: the head may already have dropped it
        assert engines["ghost-twice"]["incarnation"] == "first"
    _serves(cluster)


def test_heartbeats_and_acks_for_an_engine_count_only_from_its_own_connection(cluster):
    """Without --curve, a process that reaches the events socket used to speak
    for any engine: a heartbeat naming e0 (with its incarnation, which health()
    shows) could change e0's reported weight version, and a forged ack could
    answer a command for it. Now both are dropped and counted: e0's own
    identity carries a nonce only e0 knows (protocol 6), so the identities a
    stranger can build from health() are not e0's."""
    import time

    c = cluster.client()
    e0 = c.health()["engines"]["e0"]
    before = c.stats()["counters"]["spoofed_events"]
    codec = Codec()
    hb = codec.encode(P.Heartbeat(engine_id="e0", incarnation=e0["incarnation"], weight_version=999))
    ack = codec.encode(P.Ack(seq=1, engine_id="e0", failure=P.EngineFailure("internal", "forged")))
    ctx = zmq.Context.instance()
    socks = []
    try:
        for ident in (None, f"e0/{e0['incarnation']}".encode(), f"e0/{e0['incarnation']}/hb".encode()):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if ident is not None:
                s.setsockopt(zmq.IDENTITY, ident)
            cluster.credential(roles.ENGINE).apply(s, None)  # a token holder: past the handshake
            s.connect(cluster.events)
            socks.append(s)
        for _ in range(3):
            for s in socks:
                s.send_multipart(hb)
                s.send_multipart(ack)
        deadline = time.monotonic() + 10
        while c.stats()["counters"]["spoofed_events"] < before + 6:
            assert time.monotonic() < deadline, c.stats()["counters"]
            time.sleep(0.05)
        time.sleep(0.5)  # what the taken identities sent would have landed by now
    finally:
        for s in socks:
            s.close(linger=0)
    h = c.health()["engines"]["e0"]
    assert h["weight_version"] != 999 and h["healthy"], h
    _serves(cluster)
