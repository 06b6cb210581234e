"""Issue 34: every socket authenticates its peer at the handshake, by role
(bus/roles.py). The attacks of the issue's rows, reproduced against real head
and engine processes (tests/cluster.py, which gives the cluster a join token):

- row 1 / 2: a peer that connects to an engine's data socket under the head's
  routing identity (`head/<incarnation>`, the incarnation from a HeadPong)
  stole what the engine sent the head and wedged the cluster; with --curve an
  ordinary client key did the same. Now that socket admits the head alone: a
  stranger, a token holder and a client key are all refused at the handshake;
- row 3: a token-less peer acked a bucket of the open update on an engine's
  weight socket, and the trainer's real bucket was then refused;
- row 8: a token-less raw ZMTP peer sending one-byte frames flagged "more",
  never the last, grew the head's RSS by 21x what it sent;
- row 14: Register addresses are validated (scheme, host, port; an IPC path
  absolute) with a typed refusal naming the field.

Row 17 (a dead engine's events identity worn by a stranger) is in
tests/test_trust.py; the frontend refusing token-less clients (row 3's
`weight_updates` query) too.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import psutil
import pytest
import zmq
from safetensors.torch import load_file

from bus import protocol as P
from bus import roles
from bus.auth import KeyDir, read_token
from bus.codec import Codec
from bus.errors import BadRequest
from bus.sockets import check_endpoint
from tests.cluster import wait_until

pytestmark = pytest.mark.timeout(120)

NULL = {"backend": "null", "model": "null"}
STREAM = {"max_tokens": 120, "temperature": 0.0, "ignore_eos": True}


def _thief(address: str, identity: bytes, setup) -> tuple[zmq.Context, zmq.Socket]:
    """The row-1 attacker: a DEALER under the head's routing identity on an
    engine's data socket; `setup(sock)` gives it whatever credential it holds."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, identity)
    setup(s)
    s.connect(address)
    return ctx, s


def _steal(address: str, identity: bytes, setup, seconds: float = 1.5) -> int:
    """Connect, send one ping, count what arrives, close (as the issue's probe did)."""
    ctx, s = _thief(address, identity, setup)
    stolen = 0
    try:
        s.send_multipart(Codec().encode(P.ClientPing()), zmq.NOBLOCK)
    except zmq.Again:
        pass  # refused at the handshake: no pipe to send on
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if s.poll(50):
            s.recv_multipart()
            stolen += 1
    s.close(linger=0)
    ctx.term()
    return stolen


@pytest.mark.parametrize("attacker", ["stranger", "token-holder", "client-key"])
def test_nobody_but_the_head_reaches_an_engine_data_socket(cluster_factory, tmp_path, attacker):
    """Rows 1 and 2: fe0cb18 handed the head's pipe over (ROUTER_HANDOVER) to
    whoever connected as head/<incarnation>: 52 messages stolen, every stream
    in flight ended RequestTimeout, the cluster wedged. Now the attacker
    receives nothing, the streams in flight all complete, later requests work."""
    args: list[str] = []
    if attacker == "client-key":
        keys = KeyDir(str(tmp_path / "keys")).init()
        args = ["--curve-dir", keys.root]
    slow = {**NULL, "backend_options": {"tokens_per_step": 1, "step_delay_s": 0.01}}
    cl = cluster_factory(2, tcp=True, router_args=args, engine_args=args, **slow)
    c = cl.client(curve_dir=args[1] if args else None)
    c.wait_ready(2, 30)
    # the head's incarnation, public: every HeadPong carries it (fe0cb18's identity on the data sockets)
    incarnation = wait_until(lambda: c._aclient._head_incarnation, 10, "a HeadPong")
    engines = c.engines()
    assert len(engines) == 2 and all(e["data_address"].startswith("tcp://") for e in engines)

    def credential(s: zmq.Socket, engine: dict) -> None:
        if attacker == "token-holder":
            cl.credential().apply(s, None)
        elif attacker == "client-key":
            mine = KeyDir(args[1]).client().connecting_to(engine["curve_key"].encode())
            mine.apply(s, server=False)

    results: dict[int, object] = {}

    def stream(i: int) -> None:
        try:
            results[i] = len(c.generate([4, 5, 6 + i], STREAM).token_ids)
        except Exception as e:  # the test reads it: a stream that did not complete
            results[i] = e

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the streams are running on both engines
    stolen = sum(
        _steal(e["data_address"], b"head/" + incarnation.encode(), lambda s, e=e: credential(s, e), 0.7)
        for e in engines
    )
    for t in threads:
        t.join(60)
    assert stolen == 0, f"{stolen} messages meant for the head reached the attacker"
    assert results == dict.fromkeys(range(6), 120), results
    assert c.generate([4, 5, 6], {"max_tokens": 3}).token_ids == [7, 8, 9]
    assert all(e["healthy"] for e in c.health()["engines"].values())


def test_a_weight_socket_refuses_a_token_less_sender(cluster_factory):
    """Row 3: fe0cb18 acked a token-less 8-byte WeightBucket(update_id, 0) on
    each engine's weight socket; the trainer's real bucket 0 was then refused
    as a duplicate and its update aborted. Now the stranger never gets past
    the handshake and the trainer's update commits."""
    cl = cluster_factory(1)
    c = cl.client(control_timeout_s=30)
    c.wait_ready(1, 60)
    v0 = c.health()["weight_version"]
    # the engines' own checkpoint, as a trainer would send it (no transformers import: cheap)
    named = sorted(load_file(os.path.join(cl.model, "model.safetensors")).items())
    with c.weight_update(senders=1, bucket_bytes=1 << 15) as upd:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{cl.dir}/e0.weights")
        try:
            # queued on the DEALER's pipe, dropped with it when the handshake fails
            s.send_multipart(Codec().encode(P.WeightBucket(upd.update_id, 0), [b"\0" * 8]), zmq.NOBLOCK)
            assert not s.poll(1000), "the weight socket answered a token-less peer"
        finally:
            s.close(linger=0)
            ctx.term()
        upd.sender(0).send(iter(named))
    assert upd.results["e0"]["weight_version"] == v0 + 1


# ---------------------------------------------------------------- row 8: a frame flood


def _zmtp_null_peer(address: str) -> socket.socket:
    """A raw ZMTP 3.0 peer: NULL greeting and READY as a DEALER (nothing else)."""
    host, port = address[len("tcp://") :].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + prop
    sock.sendall(greeting + bytes([0x04, len(ready)]) + ready)
    return sock


def test_a_token_less_frame_flood_does_not_grow_the_head(cluster_factory):
    """Row 8: fe0cb18 buffered 8,000,000 one-byte frames flagged "more" from a
    token-less peer (RSS 48 -> 538 MB). libzmq holds a multipart message until
    its last frame and has no frame-count limit (MAXMSGSIZE caps one frame), so
    the bound is the handshake: a peer without the token never sends a frame."""
    cl = cluster_factory(0, tcp=True, **NULL)
    head = psutil.Process(cl.procs["head"].pid)
    cl.wait_ready(0, 30)
    c = cl.client()
    before = head.memory_info().rss
    peer = _zmtp_null_peer(cl.frontend)
    block = b"\x01\x01x" * 100_000  # 100,000 one-byte frames, each flagged "more"
    sent = 0
    try:
        for _ in range(30):  # 3,000,000 frames, 9 MB on the wire (fe0cb18: ~190 MB of head RSS)
            peer.sendall(block)
            sent += len(block)
    except OSError:
        pass  # the head closed the connection: the refused handshake
    time.sleep(0.5)
    grown = (head.memory_info().rss - before) / 2**20
    peer.close()
    assert grown < 32, f"the head grew {grown:.0f} MB for {sent / 2**20:.0f} MB of unauthenticated frames"
    assert c.health()["engines"] == {}  # still serving


# ---------------------------------------------------------------- row 14: addresses


@pytest.mark.parametrize(
    "address",
    [
        "ABORT",
        "ipc://ABORT",
        "ipc://relative/path",
        "tcp://h:0",
        "tcp://h:65536",
        "tcp://:5",
        "tcp://*:5",
        "inproc://x",
    ],
)
def test_a_register_address_is_validated_naming_the_field(address):
    """Row 14: `ipc://ABORT` (a path relative to wherever the head runs) was
    accepted at registration; every address a peer gives us is checked."""
    for field in ("data_address", "weight_address"):
        with pytest.raises(BadRequest) as ei:
            check_endpoint(address, field=field)
        assert ei.value.field == field and address in str(ei.value)
    assert check_endpoint("ipc:///tmp/x/e0.data", field="data_address") == "ipc:///tmp/x/e0.data"
    assert check_endpoint("tcp://[::1]:5", field="data_address") == "tcp://[::1]:5"
    assert check_endpoint("ipc://@abstract", field="data_address") == "ipc://@abstract"


def test_a_registered_relative_ipc_address_is_refused(cluster_factory):
    """Row 14 end to end: a token holder's Register with `ipc://ABORT` is
    refused with the field named, and the head keeps serving."""
    cl = cluster_factory(1, **NULL)
    c = cl.client()
    c.wait_ready(1, 30)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, b"ghost/i1/" + b"0" * 32)
    cl.credential(roles.ENGINE).apply(s, None)
    s.connect(cl.events)
    try:
        reg = P.Register(
            "ghost", "ipc://ABORT", "", "null", "m", P.PROTOCOL_VERSION, "i1", token=read_token(cl.token_file)
        )
        s.send_multipart(Codec().encode(reg))
        assert s.poll(10_000), "no RegisterReply"
        reply, _ = Codec().decode(s.recv_multipart())
        assert isinstance(reply, P.RegisterReply) and not reply.ok and reply.field == "data_address", reply
    finally:
        s.close(linger=0)
        ctx.term()
    assert set(c.health()["engines"]) == {"e0"}
    assert c.generate([4, 5, 6], {"max_tokens": 3}).token_ids == [7, 8, 9]
