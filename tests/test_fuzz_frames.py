"""Fuzzing every socket a peer can write to (issue 13, item 1).

Hypothesis builds frames per message kind from the msgspec Struct fields of
bus/protocol.py (valid first, then mutated: wrong types, bad UTF-8, huge and
negative ints, missing/extra array elements, deep nesting, wrong tags,
truncation, extra or missing raw frames, lying frame sizes) plus raw byte
frames, and sends them in batches to a real head (frontend ROUTER, events
ROUTER) and a real engine node (data ROUTER, weights ROUTER, control SUB
through a relay of the head's PUB). After every batch: every process is alive,
every frame that must be refused got a typed refusal (an `Error`, or a
`WeightBucketAck(ok=False)`), every reply decodes, and a request still goes
round trip (through the head, and straight to the fuzzed engine).

Bounded: FUZZ_FRAMES frames in all (1,500 by default, < 40 s);
`ROLLOUT_BUS_FUZZ_FRAMES=20000 python -m pytest -q tests/test_fuzz_frames.py`
runs longer (the per-test timeout grows with it).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import struct
import threading
import time
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bus import auth, roles
from bus import protocol as P
from bus.auth import Gatekeeper, read_token
from bus.codec import Codec
from bus.errors import ErrorCode
from tests.cluster import Cluster, live_children, wait_until

FUZZ_FRAMES = int(os.environ.get("ROLLOUT_BUS_FUZZ_FRAMES", "1500"))
BATCH = 50
SOCKETS = ("frontend", "events", "data", "weights", "control")
PER_SOCKET = max(1, FUZZ_FRAMES // len(SOCKETS) // BATCH)  # batches per socket
REPLY_WAIT_S = 10.0  # a refusal that takes longer than this is a wedge

pytestmark = pytest.mark.timeout(max(120, FUZZ_FRAMES // 10))

# ---------------------------------------------------------------- msgpack by hand
#
# msgspec cannot write what a hostile peer writes (strings that are not UTF-8,
# array headers that lie about their length), so the fuzzer has its own
# msgpack writer over plain values plus the markers below.


@dataclasses.dataclass(frozen=True)
class BadStr:
    """A msgpack str whose bytes are not UTF-8."""

    raw: bytes


@dataclasses.dataclass(frozen=True)
class LyingArray:
    """An array header claiming `claimed` elements before `items`."""

    claimed: int
    items: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Deep:
    """`depth` nested one-element arrays around nil."""

    depth: int


def pack(v: Any) -> bytes:
    if v is None:
        return b"\xc0"
    if v is True:
        return b"\xc3"
    if v is False:
        return b"\xc2"
    if isinstance(v, int):
        if 0 <= v < 1 << 64:
            return msgspec.msgpack.encode(v)
        if -(1 << 63) <= v < 0:
            return msgspec.msgpack.encode(v)
        return b"\xcf" + struct.pack(">Q", v & ((1 << 64) - 1))  # out of range: wrapped
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        return msgspec.msgpack.encode(v)
    if isinstance(v, BadStr):
        return _hdr(len(v.raw), 0xA0, 31, 0xD9) + v.raw
    if isinstance(v, bytes):
        return msgspec.msgpack.encode(v)
    if isinstance(v, (list, tuple)):
        return _arr_hdr(len(v)) + b"".join(pack(x) for x in v)
    if isinstance(v, LyingArray):
        return _arr_hdr(v.claimed) + b"".join(pack(x) for x in v.items)
    if isinstance(v, Deep):
        return b"\x91" * v.depth + b"\xc0"
    if isinstance(v, dict):
        n = len(v)
        hdr = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)
        return hdr + b"".join(pack(k) + pack(x) for k, x in v.items())
    raise TypeError(type(v))


def _hdr(n: int, fix: int, fixmax: int, one_byte: int) -> bytes:
    if n <= fixmax:
        return bytes([fix | n])
    if n < 256:
        return bytes([one_byte, n])
    return bytes([one_byte + 1]) + struct.pack(">H", n) if n < 1 << 16 else bytes([one_byte + 2]) + struct.pack(">I", n)


def _arr_hdr(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    return b"\xdc" + struct.pack(">H", n) if n < 1 << 16 else b"\xdd" + struct.pack(">I", n & 0xFFFFFFFF)


# ---------------------------------------------------------------- valid values from the Struct fields

SMALL_INT = st.integers(-2, 12)
ANY_LEAF = st.none() | st.booleans() | SMALL_INT | st.floats(-2, 2) | st.text(max_size=6)
ANY = st.recursive(
    ANY_LEAF,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8,
)

# Ops the fuzzer may run for real: harmless ones only. A fuzzed Pause or Sleep
# would (correctly) stop the cluster serving, and the round-trip check after
# each batch would read that as a wedge.
SAFE_OPS = (P.Ping, P.IsPaused, P.Stats, P.ResetPrefixCache, P.AbortWeightUpdate, P.UnloadLora, P.FinishWeightUpdate)
# Tags a wrong_tag mutation writes: no message has them (protocol 11: the tag is
# the kind, so another message's tag would make another, valid, message).
NOT_A_KIND = sorted({t.__struct_config__.tag for t in SAFE_OPS} - set(P.TYPE_OF)) + ["", "\x00", "gen" * 50]
# Protocol 10's kind frames: sent ahead of the body, they are the body now.
OLD_KINDS = [b"G", b"C", b"\x00", b"?", b"GG", b""]


def value_of(t: mi.Type, field: str = "") -> st.SearchStrategy[Any]:
    """A wire value of msgspec type `t` (a Struct as its array-like list)."""
    if isinstance(t, mi.StructType):
        return struct_value(t.cls)
    if isinstance(t, mi.IntType):
        if field == "seq":  # far from the head's own sequence numbers (its ack cache is by seq)
            return st.integers(10**12, 2**62)
        # Small values inside the field's bounds (bus/protocol.py: Meta ge/le).
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -2)
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 12)
        return st.integers(max(-2, lo), min(12, hi))
    if isinstance(t, mi.FloatType):
        return st.floats(0.05, 5.0)
    if isinstance(t, mi.StrType):
        return st.text(max_size=10)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(value_of(t.item_type), max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(st.text(max_size=6), value_of(t.value_type), max_size=3)
    if isinstance(t, mi.UnionType):
        structs = [x for x in t.types if isinstance(x, mi.StructType)]
        if structs and field == "op":
            return st.one_of(*[struct_value(c) for c in SAFE_OPS])
        return st.one_of(*[value_of(x, field) for x in t.types])
    if isinstance(t, (mi.AnyType, mi.CustomType)):  # CustomType: `object` (P.Detail's free-form values)
        return ANY
    raise NotImplementedError(t)


# The fuzz cluster's join token (FuzzCluster sets it): half of the fuzzed
# Registers and Controls carry it, so they get past the token check to the
# fields behind it, as before the token existed.
_TOKEN = [""]
_TOKEN_OR_NOT = st.booleans().map(lambda carry: _TOKEN[0] if carry else "")

OVERRIDES: dict[tuple[type, str], st.SearchStrategy[Any]] = {
    (P.Register, "token"): _TOKEN_OR_NOT,
    (P.Control, "token"): _TOKEN_OR_NOT,
    # A fuzzed Register must not take over a real engine id, and its data
    # address leads nowhere (the head connects a DEALER to it).
    (P.Register, "engine_id"): st.text(max_size=6).map(lambda s: "fz-" + s),
    (P.Register, "data_address"): st.just("ipc:///tmp/rollout-bus-fuzz-nowhere"),
    (P.Register, "weight_address"): st.just(""),
    (P.Register, "protocol_version"): st.just(P.PROTOCOL_VERSION),
    (P.Control, "timeout_s"): st.floats(0.05, 1.0),
    (P.Generate, "timeout_s"): st.none() | st.floats(0.05, 5.0),
}


@st.composite
def struct_value(draw: st.DrawFn, cls: type) -> list[Any]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    out: list[Any] = [info.tag] if info.tag is not None else []
    fields = info.fields
    n_required = sum(f.required for f in fields)
    n = draw(st.integers(n_required, len(fields)))  # trailing defaults may be omitted
    for f in fields[:n]:
        strategy = OVERRIDES.get((cls, f.name))
        out.append(draw(strategy if strategy is not None else value_of(f.type, f.name)))
    return out


# ---------------------------------------------------------------- mutations

EDGE = [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**70, 1.5, float("nan"), float("inf"), "", "x" * 300, None, True,
        [], {}, b"\x00\xff", {"k": [1]}, [[[]]]]  # fmt: skip
BAD_UTF8 = [b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80", b"\xf8\x88\x80\x80\x80"]
# Mutations after which the frame is invalid, whatever else was drawn.
ALWAYS_BAD = {"bad_utf8", "wrong_tag", "truncate", "unknown_kind", "one_frame", "lying_array"}


def _paths(v: Any, at: tuple[int | str, ...] = ()) -> list[tuple[int | str, ...]]:
    out = [at]
    if isinstance(v, list):
        for i, x in enumerate(v):
            out += _paths(x, (*at, i))
    elif isinstance(v, dict):
        for k, x in v.items():
            out += _paths(x, (*at, k))
    return out


def _get(v: Any, path: tuple[int | str, ...]) -> Any:
    for p in path:
        v = v[p]
    return v


def _set(v: Any, path: tuple[int | str, ...], new: Any) -> Any:
    if not path:
        return new
    parent = _get(v, path[:-1])
    parent[path[-1]] = new
    return v


@dataclasses.dataclass
class Frame:
    socket: str
    kind: str
    mutation: str
    frames: list[bytes]
    expect_refusal: bool

    def __repr__(self) -> str:  # what hypothesis prints for a failing batch
        return f"Frame({self.socket}, {self.kind!r}, {self.mutation}, {[f[:80] for f in self.frames]!r})"


SERVED: dict[str, tuple[type, ...]] = {
    "frontend": (P.Generate, P.Cancel, P.Control, P.Query, P.EndSession),
    "events": (P.Register, P.Heartbeat, P.Ack),
    "data": (P.Generate, P.Cancel),
    "weights": (P.WeightBucket,),
    "control": (P.Command,),
}
REPLIES = {"frontend", "data", "weights"}  # sockets whose peers get an answer
MUTATIONS = ["none", "retype", "bad_utf8", "drop", "extra", "deep", "wrong_tag", "truncate", "lying_array",
             "frames", "unknown_kind", "one_frame", "raw"]  # fmt: skip


def _buffers(cls: type) -> st.SearchStrategy[list[bytes]]:
    if cls is P.Generate:  # prompt token ids, int32, inside the tiny model's 512-token vocabulary
        return st.lists(st.integers(0, 511), min_size=1, max_size=8).map(
            lambda ids: [struct.pack(f"<{len(ids)}i", *ids)]
        )
    if cls is P.WeightBucket:
        return st.binary(max_size=64).map(lambda b: [b])
    return st.just([])


LYING_FRAMES = st.sampled_from([b"", b"\x01", b"\x01\x02\x03", b"\xff\xff\xff\xff" * 3, b"\x00" * (1 << 20) + b"\x01"])


@st.composite
def frame(draw: st.DrawFn, socket: str) -> Frame:
    served = SERVED[socket]
    cls = draw(st.sampled_from(served) if draw(st.integers(0, 9)) else st.sampled_from(list(P.KIND_OF)))
    kind = P.KIND_OF[cls]
    old_kind = draw(st.sampled_from(OLD_KINDS))
    tree = draw(struct_value(cls))
    buffers = draw(_buffers(cls))
    mutation = draw(st.sampled_from(MUTATIONS))
    body: bytes | None = None
    paths = _paths(tree)[1:]  # every node under the root
    pick = paths[draw(st.integers(0, len(paths) - 1))] if paths else ()
    if mutation == "retype" and pick:
        tree = _set(tree, pick, draw(st.sampled_from(EDGE)))
    elif mutation == "bad_utf8":
        strs = [p for p in _paths(tree) if isinstance(_get(tree, p), str)]
        p = strs[draw(st.integers(0, len(strs) - 1))]  # the tag at least
        s = _get(tree, p).encode()
        cut = draw(st.integers(0, len(s)))
        tree = _set(tree, p, BadStr(s[:cut] + draw(st.sampled_from(BAD_UTF8)) + s[cut:]))
    elif mutation == "drop" and pick and isinstance(_get(tree, pick[:-1]), list):
        del _get(tree, pick[:-1])[pick[-1]]
    elif mutation == "extra":
        tree.append(draw(st.sampled_from(EDGE)))
    elif mutation == "deep" and pick:
        tree = _set(tree, pick, Deep(draw(st.sampled_from([64, 600, 5000, 100_000]))))
    elif mutation == "wrong_tag" and tree and isinstance(tree[0], str):
        tree[0] = draw(st.sampled_from(NOT_A_KIND))
    elif mutation == "lying_array":
        tree = LyingArray(len(tree) + draw(st.sampled_from([1, 7, 1 << 20, (1 << 32) - 1])), tuple(tree))
    elif mutation == "frames":
        choice = draw(st.integers(0, 2))
        if choice == 0:
            buffers = [draw(LYING_FRAMES)]
        elif choice == 1:
            buffers = buffers + draw(st.lists(LYING_FRAMES, min_size=1, max_size=3))
        else:
            buffers = []
    elif mutation == "raw":
        body = draw(st.binary(max_size=64))
    if body is None:
        body = pack(tree)
    if mutation == "truncate":
        body = body[: draw(st.integers(0, len(body) - 1))]
    if mutation == "unknown_kind":  # a kind frame ahead of the body (protocol 10's layout)
        frames = [old_kind, body, *buffers]
    elif mutation == "one_frame":  # a kind frame alone
        frames = [old_kind]
    else:
        frames = [body, *buffers]
    return Frame(socket, kind, mutation, frames, mutation in ALWAYS_BAD or cls not in served)


def refusal(msg: Any) -> bool:
    if isinstance(msg, P.Error):
        assert msg.code in ErrorCode._value2member_map_, msg
        return True
    return isinstance(msg, P.WeightBucketAck) and not msg.ok


def test_valid_frames_decode():
    """The generators' unmutated frames are what the protocol accepts."""

    @settings(max_examples=300, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(list(P.KIND_OF)).flatmap(lambda c: st.tuples(st.just(c), struct_value(c))))
    def check(case: tuple[type, list[Any]]) -> None:
        cls, tree = case
        msg, _ = Codec().decode([pack(tree)])
        assert type(msg) is cls

    check()


def test_codec_decode_is_total():
    """In process: every fuzzed frame decodes or raises a RolloutBusError."""
    from bus.errors import RolloutBusError

    codec = Codec()

    @settings(max_examples=1000, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(SOCKETS).flatmap(frame))
    def check(f: Frame) -> None:
        try:
            codec.decode(f.frames)
        except RolloutBusError:
            pass

    check()


# ---------------------------------------------------------------- against real processes


class ControlRelay:
    """Stands between the head's control PUB and one engine's SUB: relays every
    head command and injects fuzzed frames. Its thread owns both sockets."""

    def __init__(self, ctx: zmq.Context, head_control: str, address: str, token: str) -> None:
        self.address = address
        # Both ends authenticate engines (bus/roles.py): the relay presents the
        # engine role to the head, and admits only it (its own ZAP handler).
        self.as_engine = roles.as_role(token, roles.ENGINE)
        self.gate = Gatekeeper(ctx, None, (), {auth.ENGINES: {roles.ENGINE: roles.role_secret(token, roles.ENGINE)}})
        self.gate.start()
        self.inject: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ctx, head_control), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "control relay did not start"

    def _run(self, ctx: zmq.Context, head_control: str) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert self.as_engine is not None
        self.as_engine.apply(sub, None)
        sub.connect(head_control)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        roles.SERVER.apply(pub, auth.ENGINES)
        pub.bind(self.address)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(20):
                    while True:
                        try:
                            pub.send_multipart(sub.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                while not self.inject.empty():
                    pub.send_multipart(self.inject.get_nowait())
        finally:
            sub.close(linger=0)
            pub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.gate.stop()


class FuzzCluster:
    """A head, engine e0, and engine `fz` whose control SUB listens to a relay."""

    def __init__(self, tiny_model: str) -> None:
        self.ctx = zmq.Context()
        self.cl = Cluster(1, backend="torch", model=tiny_model)
        _TOKEN[0] = read_token(self.cl.token_file)
        self.relay = ControlRelay(self.ctx, self.cl.control, f"ipc://{self.cl.dir}/fuzz-control", _TOKEN[0])
        # --direct-clients: round_trip and the fuzzer send straight to fz's data socket
        self.cl.start_engine("fz", extra=["--head-control", self.relay.address, "--direct-clients"])
        self.cl.wait_ready(2)
        self.client = self.cl.client()

    def address(self, socket: str) -> str:
        return {
            "frontend": self.cl.frontend,
            "events": self.cl.events,
            "data": self.cl.data_address("fz"),
            "weights": f"ipc://{self.cl.dir}/fz.weights",
        }[socket]

    def alive(self) -> None:
        dead = {k: p.poll() for k, p in self.cl.procs.items() if p.poll() is not None}
        assert not dead, f"processes died (exit codes {dead}); see their logs in {self.cl.dir}"

    def round_trip(self) -> None:
        """A request through the head, and one straight to the fuzzed engine."""
        r = self.client.generate([1, 2, 3], {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        assert len(r.token_ids) == 3
        s = self.dealer("data")
        try:
            gen = P.Generate(request_id="fuzz-check", params=P.SamplingParams(max_tokens=3, ignore_eos=True))
            s.send_multipart(Codec().encode(gen, [struct.pack("<3i", 1, 2, 3)]))
            deadline = time.monotonic() + REPLY_WAIT_S
            while True:
                assert s.poll(max(1, int((deadline - time.monotonic()) * 1000))), "engine fz wedged: no reply"
                msg, _ = Codec().decode(s.recv_multipart())
                if isinstance(msg, P.ChunkBatch):
                    msg = msg.chunks[-1]
                assert isinstance(msg, P.Chunk) and msg.request_id == "fuzz-check", msg
                if msg.finish_reason is not None:
                    break
        finally:
            s.close(linger=0)
        health = self.client.health()["engines"]
        assert health["fz"]["healthy"] and health["e0"]["healthy"], health

    def dealer(self, socket: str) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        # a token holder, in the role the socket admits (past the handshake: the fuzz is about frames)
        self.cl.credential(roles.ENGINE if socket == "events" else roles.CLIENT).apply(s, None)
        s.connect(self.address(socket))
        return s

    def close(self) -> None:
        self.relay.close()
        self.cl.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def fuzz_cluster(tiny_model):
    before = {p.pid for p in live_children()}
    fc = FuzzCluster(tiny_model)
    try:
        yield fc
    finally:
        fc.close()
        leaked = [p for p in live_children() if p.pid not in before]
        for p in leaked:
            p.kill()
        assert not leaked, f"fuzz cluster leaked processes: {[p.pid for p in leaked]}"


SENT: dict[str, int] = dict.fromkeys(SOCKETS, 0)
REFUSED: dict[str, int] = dict.fromkeys(SOCKETS, 0)  # typed refusals received


def send_batch(fc: FuzzCluster, socket: str, batch: list[Frame]) -> None:
    if socket == "control":
        for f in batch:  # "*\0": every engine's subscription; a random topic is filtered out
            fc.relay.inject.put([b"*\x00", *f.frames])
        wait_until(lambda: fc.relay.inject.empty(), 10, "the relay to publish the batch")
        time.sleep(0.05)  # the engine reads them before the checks
    else:
        s = fc.dealer(socket)
        try:
            for f in batch:
                s.send_multipart(f.frames)
            if socket in REPLIES:
                want = sum(f.expect_refusal for f in batch)
                got = 0
                deadline = time.monotonic() + REPLY_WAIT_S
                while got < want:
                    left = deadline - time.monotonic()
                    assert left > 0 and s.poll(int(left * 1000)), (
                        f"{socket}: {got} refusals within {REPLY_WAIT_S}s for {want} frames that must be refused"
                    )
                    msg, _ = Codec().decode(s.recv_multipart())  # every reply decodes
                    got += refusal(msg)
                REFUSED[socket] += got
        finally:
            s.close(linger=0)  # the peer is gone: whatever it started is dropped
    SENT[socket] += len(batch)
    fc.alive()
    fc.round_trip()


@pytest.mark.parametrize("socket", SOCKETS)
def test_fuzz_socket(fuzz_cluster, socket):
    fuzz_cluster.round_trip()

    @settings(
        max_examples=PER_SOCKET,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # no shrinking: a dead process stays dead
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(frame(socket), min_size=BATCH, max_size=BATCH))
    def fuzz(batch: list[Frame]) -> None:
        send_batch(fuzz_cluster, socket, batch)

    t0 = time.monotonic()
    fuzz()
    assert SENT[socket] >= PER_SOCKET * BATCH
    print(f"FUZZ socket={socket} frames={SENT[socket]} refusals={REFUSED[socket]} seconds={time.monotonic() - t0:.1f}")
