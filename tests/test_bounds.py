"""Issue 22, "no poison pill", at the decoder: every integer and string field
of every wire Struct (bus/protocol.py) has a bound the decoder checks. For
each one: the decoder accepts the bound and refuses one past it with a
BadRequest naming the field, and whatever the decoder accepted the encoder
writes again (an OverflowError in an encode killed an engine / the head).

No sockets: the codec alone (the loopback tests are tests/test_poison.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest, EncodeFailed, truncate

# Lists longer than this are checked at their bound only for scalar items
# (a million-entry list of Structs costs seconds and hundreds of MB here).
_BIG_LIST = 1 << 16


def _minimal(t: mi.Type) -> Any:
    """The smallest valid wire value of type `t`."""
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
        return max(lo, 0) if lo is not None and lo > 0 else (0 if lo is None or lo <= 0 else lo)
    if isinstance(t, mi.FloatType):
        return 1.0
    if isinstance(t, mi.StrType):
        return ""
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.EnumType):
        return next(iter(t.cls)).value
    if isinstance(t, mi.BytesType):
        return b""
    if isinstance(t, (mi.NoneType, mi.AnyType, mi.CustomType)):
        return None
    if isinstance(t, mi.ListType):
        return []
    if isinstance(t, mi.DictType):
        return {}
    if isinstance(t, mi.StructType):
        return _raw(t.cls)
    if isinstance(t, mi.UnionType):
        if any(isinstance(x, mi.NoneType) for x in t.types):
            return None
        return _minimal(t.types[0])
    raise NotImplementedError(t)


def _raw(cls: type) -> list[Any]:
    """A Struct as its array-like wire list, every field at its minimal value."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return ([info.tag] if info.tag is not None else []) + [_minimal(f.type) for f in info.fields]


def _members(t: mi.Type) -> list[mi.Type]:
    if isinstance(t, mi.UnionType):
        return [x for x in t.types if not isinstance(x, mi.NoneType)]
    return [t]


def _edges(t: mi.Type, path: str) -> Iterator[tuple[str, Any, Any]]:
    """(field path, a value at the bound, a value one past it) of type `t`."""
    for m in _members(t):
        if isinstance(m, mi.IntType):
            hi = m.le if m.le is not None else (m.lt - 1 if m.lt is not None else None)
            lo = m.ge if m.ge is not None else (m.gt + 1 if m.gt is not None else None)
            assert hi is not None and lo is not None, f"{path}: an int field without both bounds"
            yield path, hi, hi + 1
            yield path, lo, lo - 1
        elif isinstance(m, mi.StrType):
            assert m.max_length is not None, f"{path}: a str field without max_length"
            yield path, "x" * m.max_length, "x" * (m.max_length + 1)
        elif isinstance(m, mi.ListType):
            item = m.item_type
            if m.max_length is not None and (
                m.max_length <= _BIG_LIST or not isinstance(item, (mi.StructType, mi.ListType))
            ):
                v = _minimal(item)
                yield path, [v] * m.max_length, [v] * (m.max_length + 1)
            for sub, ok, bad in _edges(item, f"{path}[0]"):
                yield sub, [ok], [bad]
        elif isinstance(m, mi.DictType):
            # Keys of the free-form dicts (Detail, transport_args) are not bounded:
            # only a bounded key type is checked at its bound.
            key, value = m.key_type, m.value_type
            v = _minimal(value)
            if isinstance(key, mi.StrType) and key.max_length is not None:
                yield f"{path}[<key>]", {"x" * key.max_length: v}, {"x" * (key.max_length + 1): v}
            if m.max_length is not None and m.max_length <= _BIG_LIST:
                yield path, {str(i): v for i in range(m.max_length)}, {str(i): v for i in range(m.max_length + 1)}
            for sub, ok, bad in _edges(value, f"{path}[...]"):
                yield sub, {"k": ok}, {"k": bad}
        elif isinstance(m, mi.StructType):
            # A nested part, or a member of a tagged union (Control.op,
            # Ack.result, QueryReply.body): the path names the member's field.
            base = _raw(m.cls)
            off = 1 if m.tag is not None else 0
            for i, f in enumerate(m.fields):
                j = i + off
                for sub, ok, bad in _edges(f.type, f"{path}.{f.name}"):
                    yield sub, base[:j] + [ok] + base[j + 1 :], base[:j] + [bad] + base[j + 1 :]


def _cases() -> Iterator[tuple[type, str, list[Any], list[Any]]]:
    for cls in P.KIND_OF:
        info = mi.type_info(cls)
        base = _raw(cls)
        off = 1 if info.tag is not None else 0
        for i, f in enumerate(info.fields):
            for path, ok, bad in _edges(f.type, f.name):
                j = i + off
                yield cls, path, base[:j] + [ok] + base[j + 1 :], base[:j] + [bad] + base[j + 1 :]


CASES = list(_cases())
# Through a tagged union (Control.op, Ack.result), written out (the table above derives them too).
_UNION_CASES = [
    (P.Control, "op.version", ["ctl", "r", ["finish_weights", "u", P.MAX_COMMIT_VERSION]], ["ctl", "r", ["finish_weights", "u", P.MAX_COMMIT_VERSION + 1]]),
    (P.Control, "op.senders", ["ctl", "r", ["begin_weights", "u", "zmq", [], [], "model", None, 1024]], ["ctl", "r", ["begin_weights", "u", "zmq", [], [], "model", None, 1025]]),
    (P.Command, "op.lora", ["cmd", 1, ["pause", "abort", "l" * 256]], ["cmd", 1, ["pause", "abort", "l" * 257]]),
    (P.Ack, "result.weight_version", ["ack", 1, "e0", ["config", P.MAX_VERSION]], ["ack", 1, "e0", ["config", P.MAX_VERSION + 1]]),
    (P.Ack, "failure.code", ["ack", 1, "e0", None, ["x" * 256, "m"]], ["ack", 1, "e0", None, ["x" * 257, "m"]]),
]  # fmt: skip


def _body(raw: list[Any]) -> bytes:
    return msgspec.msgpack.encode(raw)


def test_every_int_and_str_field_is_bounded():
    """The table covers every message (a new field without bounds fails _edges)."""
    # ClientPing carries nothing: no bound to test
    assert {c for c, *_ in CASES} == set(P.KIND_OF) - {P.ClientPing}
    assert len(CASES) > 150, len(CASES)
    paths = {(c, p) for c, p, *_ in CASES}
    # every member of the tagged unions is walked: each query body, each result, the failure
    for body in P.QueryBody.__args__:
        for f in mi.type_info(body).fields:  # type: ignore[attr-defined]
            if not isinstance(f.type, (mi.BoolType, mi.FloatType)):
                assert any(p.startswith(f"body.{f.name}") for c, p in paths if c is P.QueryReply), (body, f.name)
    for res in P.Result.__args__:
        for f in mi.type_info(res).fields:  # type: ignore[attr-defined]
            if not isinstance(f.type, (mi.BoolType, mi.FloatType, mi.DictType)) and f.name != "heartbeat":
                assert (P.Ack, f"result.{f.name}") in paths, (res, f.name)
    assert (P.Ack, "result.heartbeat.running") in paths
    assert (P.QueryReply, "body.engines[...].curve_key") in paths
    assert (P.ControlReply, "errors[...].field") in paths


@pytest.mark.parametrize(
    "cls, path, ok, bad",
    [*CASES, *_UNION_CASES],
    ids=lambda v: v.__name__ if isinstance(v, type) else (v if isinstance(v, str) else ""),
)
def test_the_decoder_accepts_the_bound_and_refuses_one_past_it_naming_the_field(cls, path, ok, bad):
    codec = Codec()
    msg, _ = codec.decode([_body(ok)])
    assert type(msg) is cls
    again, _ = codec.decode(codec.encode(msg))  # the encoder writes what the decoder accepted
    assert again == msg
    try:
        body = _body(bad)
    except OverflowError:
        return  # one past an int64 bound: msgpack itself cannot carry it
    with pytest.raises(BadRequest) as ei:
        codec.decode([body])
    assert ei.value.field == path, (ei.value.field, path, str(ei.value)[:200])
    assert len(ei.value.message) <= 2048


def _bounded(t: mi.Type) -> st.SearchStrategy[Any]:
    """Any wire value of `t` inside its bounds (ints over their whole range)."""
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else t.gt + 1  # type: ignore[operator]
        hi = t.le if t.le is not None else t.lt - 1  # type: ignore[operator]
        return st.integers(lo, hi) | st.sampled_from([lo, hi])
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=True)
    if isinstance(t, mi.StrType):
        return st.text(max_size=min(t.max_length or 8, 8))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.EnumType):
        return st.sampled_from([m.value for m in t.cls])
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=8)
    if isinstance(t, (mi.NoneType, mi.AnyType, mi.CustomType)):
        return st.none()
    if isinstance(t, mi.ListType):
        return st.lists(_bounded(t.item_type), max_size=3)
    if isinstance(t, mi.DictType):
        return st.dictionaries(st.text(max_size=4), _bounded(t.value_type), max_size=2)
    if isinstance(t, mi.StructType):
        info = t
        return st.tuples(*[_bounded(f.type) for f in info.fields]).map(
            lambda vs, tag=info.tag: ([tag] if tag is not None else []) + list(vs)
        )
    if isinstance(t, mi.UnionType):
        return st.one_of(*[_bounded(x) for x in t.types])
    raise NotImplementedError(t)


@settings(max_examples=400, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(list(P.KIND_OF)).flatmap(lambda c: st.tuples(st.just(c), _bounded(mi.type_info(c)))))
def test_whatever_the_decoder_accepts_the_encoder_writes_again(case):
    cls, raw = case
    codec = Codec()
    try:
        msg, _ = codec.decode([_body(raw)])
    except BadRequest:
        return  # a cross-field rule (none today) or a union member mismatch: refused, typed
    again, _ = codec.decode(codec.encode(msg))
    assert msgspec.msgpack.encode(again) == msgspec.msgpack.encode(msg)


def test_an_unencodable_message_is_a_typed_error_not_an_overflow():
    with pytest.raises(EncodeFailed) as ei:
        Codec().encode(P.Chunk(request_id="r", sample_index=2**64))
    assert ei.value.request_id == "r"


def test_undecodable_request_ids_are_not_echoed():
    from bus.codec import request_id_of

    assert request_id_of([msgspec.msgpack.encode(["gen", "x" * 300])]) == ""
    assert request_id_of([msgspec.msgpack.encode(["gen", "abc"])]) == "abc"


def test_truncate_keeps_echoes_under_1kb():
    assert truncate("short") == "short"
    t = truncate("y" * 10_000_000)
    assert len(t) <= 1024 and t.startswith("y") and "more chars" in t


def test_an_encode_failure_at_the_endpoint_ends_the_requests_typed_not_the_process():
    """The bus layer's net under the bounds: a message that cannot be encoded
    (a bug of ours) becomes one typed Error per request it carried."""
    import zmq

    from bus.endpoint import Endpoint

    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://enc")
        dealer.setsockopt(zmq.IDENTITY, b"peer")
        dealer.connect("inproc://enc")
        dealer.send_multipart([b"hello"])
        peer = router.recv_multipart()[0]
        ep = Endpoint(router, Codec(), {}, name="t", routed=True)
        bad = P.ChunkBatch(
            [P.Chunk("a", sample_index=2**64), P.Chunk("b"), P.Chunk("a")], [0, 0, 0]
        )  # a ChunkBatch whose first chunk overflows
        assert ep.send(peer, bad) is False
        got = []
        while dealer.poll(1000):
            got.append(Codec().decode(dealer.recv_multipart())[0])
        assert [(e.request_id, e.code) for e in got] == [("a", "internal"), ("b", "internal")], got
        assert "cannot encode ChunkBatch" in got[0].message
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
