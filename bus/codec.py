"""Framing: turn messages into multipart frames and back.

A `Codec` holds one msgspec Encoder and one Decoder per message type. Build one
per socket-owning thread (msgspec encoders reuse an internal buffer and are not
meant to be shared across threads).
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import BadRequest, EncodeFailed, ProtocolError, truncate
from bus.frames import TOKEN_BYTES, token_bytes, token_count, unpack_tokens

# msgspec's error path: `[N]` a list / array-like index, `[...]` a dict's value.
_PATH_INDEX = re.compile(r"\[(\d+|\.\.\.)\]")


def _struct_of(ann: Any, raw: Any) -> Any:
    """The Struct type a value of annotation `ann` decodes to (None: not a
    Struct): Annotated is unwrapped, a union of tagged Structs is resolved by
    the raw value's tag (its first element)."""
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if isinstance(ann, type) and issubclass(ann, msgspec.Struct):
        return ann
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        structs = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        if len(structs) == 1:  # an optional Struct (Ack.failure)
            return structs[0]
        tag = raw[0] if isinstance(raw, list) and raw else None
        for t in structs:
            if t.__struct_config__.tag is not None and t.__struct_config__.tag == tag:
                return t
    return None


def _item_of(ann: Any) -> Any:
    """The element annotation of a list / dict annotation (None: neither)."""
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) is list:
        return typing.get_args(ann)[0]
    if typing.get_origin(ann) is dict:
        return typing.get_args(ann)[1]
    return None


def _value_of(item: Any, raw: Any) -> Any:
    """The raw dict value a `[...]` path step goes through. msgspec does not
    say which key: the first value whose tag names a member of `item` (or the
    only one) - the field named is right whenever the dict's values share a type."""
    if not isinstance(raw, dict):
        return None
    for v in raw.values():
        if _struct_of(item, v) is not None:
            return v
    return None


def _field_path(cls: type, path: str, raw: Any = None) -> str | None:
    """Translate msgspec's array-like error path (`$[2][0]`) into field names
    (`params.max_tokens`, `op.version`, `tensors[3].name`). Tagged structs
    carry the tag at index 0. `raw`: the body decoded untyped, to tell which
    member of a tagged union (Control.op) the path goes through."""
    names: list[str] = []
    cur: Any = cls
    item: Any = None  # the element annotation while the path is inside a list
    for m in _PATH_INDEX.finditer(path):
        if m.group(1) == "...":
            if cur is not None or item is None:
                return ".".join(names) if names else None
            names[-1] += "[...]"
            raw = _value_of(item, raw)
            cur, item = _struct_of(item, raw), None
            continue
        idx = int(m.group(1))
        raw_next = raw[idx] if isinstance(raw, list) and idx < len(raw) else None
        if cur is None:
            if names:
                names[-1] += f"[{idx}]"
            else:
                names.append(f"[{idx}]")
            cur = _struct_of(item, raw_next) if item is not None else None
            item = None
            raw = raw_next
            continue
        if cur.__struct_config__.tag is not None:
            idx -= 1
            if idx < 0:
                names.append("<tag>")
                cur = None
                continue
        fields = cur.__struct_fields__
        if idx >= len(fields):
            names.append(f"[{idx}]")
            cur = None
            continue
        names.append(fields[idx])
        ann = msgspec.structs.fields(cur)[idx].type
        cur = _struct_of(ann, raw_next)
        item = _item_of(ann) if cur is None else None
        raw = raw_next
    return ".".join(names) if names else None


# What msgspec's encoder raises for a value it cannot write (encode_failed
# turns each into the typed EncodeFailed).
ENCODE_ERRORS = (OverflowError, TypeError, ValueError, msgspec.EncodeError)


def encode_failed(msg: Any, e: BaseException) -> EncodeFailed:
    return EncodeFailed(
        f"cannot encode {type(msg).__name__}: {truncate(str(e))}", request_id=getattr(msg, "request_id", None)
    )


class Codec:
    """Encode/decode `[body][buffers…]` (routing ids handled by the caller).

    The body's tag (its first msgpack item) names the message type: one
    msgspec Decoder over the union of every message reads any body (protocol
    11; a kind frame before the body said the same thing, one frame more per
    message on every hop)."""

    def __init__(self) -> None:
        # `encoder` is public for the hot send path (bus/endpoint.py), which
        # builds `[peer, body, *buffers]` itself; the same thread owns it
        # (msgspec encoders reuse an internal buffer).
        self.encoder = msgspec.msgpack.Encoder()
        self._dec: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
            typing.Union[P.MESSAGE_TYPES]  # noqa: UP007 (a runtime tuple of types)
        )

    def encode(self, msg: Any, buffers: Sequence[Any] = ()) -> list[Any]:
        """Raises EncodeFailed (typed, naming the message) instead of msgspec's
        OverflowError / TypeError: a value the decoder's bounds (bus/protocol.py)
        let through never gets here, but a bug of ours must end one request
        with a typed error, not the process (the callers catch it: bus/endpoint.py)."""
        try:
            body = self.encoder.encode(msg)
        except ENCODE_ERRORS as e:
            raise encode_failed(msg, e) from None
        return [body, *buffers]

    def decode(self, frames: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Decode `[body, *buffers]`. Raises ProtocolError (no body, a body that
        is not a message, an unknown kind) or BadRequest naming the offending field."""
        if not frames:
            raise ProtocolError("expected [body, …], got no frame", field="frames")
        try:
            msg = self._dec.decode(frames[0])
        except msgspec.ValidationError as e:
            raise _invalid(e, frames) from None
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable message body: {e}", field="body") from None
        except (UnicodeDecodeError, RecursionError, MemoryError, ValueError, TypeError, OverflowError) as e:
            # Hostile bodies reach these, not ValidationError: a string that is
            # not UTF-8, thousands of nested arrays inside an `Any` field. The
            # decoder must be total: every frame becomes a message or a typed error.
            raise ProtocolError(f"undecodable message body: {type(e).__name__}", field="body") from None
        return msg, list(frames[1:])


def _invalid(e: msgspec.ValidationError, frames: Sequence[Any]) -> ProtocolError | BadRequest:
    """The typed error of a body msgspec refused: not a message array or an
    unknown kind (ProtocolError), else a BadRequest naming the field."""
    raw = _raw(frames[0])
    if not isinstance(raw, list) or not raw:
        return ProtocolError("the body is not a message (a msgpack array that starts with its kind)", field="body")
    cls = P.TYPE_OF.get(raw[0]) if isinstance(raw[0], str) else None
    if cls is None:
        return ProtocolError(f"unknown message kind {truncate(repr(raw[0]))}", field="kind")
    text = str(e)
    # "... - at `$[2][0]`", or for a dict key "... - at `key` in `$[2][1]`"
    key = " - at `key` in `$" in text
    at = text.rsplit(" - at `key` in `$" if key else " - at `$", 1)
    field = _field_path(cls, at[1], raw) if len(at) == 2 else None
    if key and field is not None:
        field += "[<key>]"
    return BadRequest(f"invalid {cls.__name__}: {truncate(at[0])}", field=field, request_id=request_id_of(frames))


def _check_batch(msg: P.ChunkBatch, buffers: list[Any]) -> None:
    """A ChunkBatch's counts must describe its frames exactly: a hostile or
    garbled batch is a typed error, never a wrong slice or an IndexError."""
    n = len(msg.chunks)
    if len(msg.nbufs) != n or (msg.nbufs and min(msg.nbufs) < 0):
        raise ProtocolError(f"ChunkBatch.nbufs must be {n} counts >= 0", field="nbufs")
    if not msg.ntoks:
        if sum(msg.nbufs) != len(buffers):
            raise ProtocolError(f"ChunkBatch.nbufs sums to {sum(msg.nbufs)}, frames: {len(buffers)}", field="nbufs")
        return
    if len(msg.ntoks) != n or min(msg.ntoks) < 0:
        raise ProtocolError(f"ChunkBatch.ntoks must be {n} counts >= 0", field="ntoks")
    if not buffers or len(buffers[0]) != token_bytes(sum(msg.ntoks)):
        have = len(buffers[0]) if buffers else 0
        raise ProtocolError(f"packed token frame has {have} bytes, ntoks says {sum(msg.ntoks)} ids", field="ntoks")
    if sum(msg.nbufs) != len(buffers) - 1:
        raise ProtocolError(f"ChunkBatch.nbufs sums to {sum(msg.nbufs)}, frames: {len(buffers) - 1}", field="nbufs")


def split_chunks(msg: Any, buffers: list[Any]) -> list[tuple[Any, list[Any]]]:
    """[(Chunk, its buffers)] of a Chunk or a ChunkBatch (packed or not): a
    packed chunk's token frame is a memoryview slice of the batch's frame.
    Raises ProtocolError naming the field when the counts do not fit."""
    if not isinstance(msg, P.ChunkBatch):
        return [(msg, buffers)]
    _check_batch(msg, buffers)
    out: list[tuple[Any, list[Any]]] = []
    if not msg.ntoks:
        i = 0
        for ch, n in zip(msg.chunks, msg.nbufs, strict=True):
            out.append((ch, buffers[i : i + n]))
            i += n
        return out
    view = memoryview(buffers[0])
    off, i = 0, 1
    for ch, nt, n in zip(msg.chunks, msg.ntoks, msg.nbufs, strict=True):
        end = off + token_bytes(nt)
        out.append((ch, [view[off:end], *buffers[i : i + n]]))
        off, i = end, i + n
    return out


def split_packed(msg: Any, buffers: list[Any]) -> list[tuple[Any, list[int], list[Any]]]:
    """[(Chunk, its token ids, its other buffers)] of a Chunk or a ChunkBatch:
    the client's hot path. A packed batch's token frame is unpacked once for
    all its chunks (one array.frombytes, then list slices) instead of once per
    chunk. Raises ProtocolError naming the field on malformed frames."""
    # Every frame of a chunk holds int32 ids or float32 logprobs: a length
    # that is not a multiple of 4 would make array.frombytes raise later, in
    # the reader's stream; refuse it here, typed.
    for b in buffers:
        if len(b) % TOKEN_BYTES:
            raise ProtocolError(f"a chunk frame of {len(b)} bytes is not 4-byte ids / logprobs", field="frames")
    if not isinstance(msg, P.ChunkBatch):
        return [(msg, unpack_tokens(buffers[0]) if buffers else [], buffers[1:])]
    if not msg.ntoks:
        return [(ch, unpack_tokens(bufs[0]) if bufs else [], bufs[1:]) for ch, bufs in split_chunks(msg, buffers)]
    _check_batch(msg, buffers)
    toks = unpack_tokens(buffers[0])
    out: list[tuple[Any, list[int], list[Any]]] = []
    off, i = 0, 1
    for ch, nt, n in zip(msg.chunks, msg.ntoks, msg.nbufs, strict=True):
        out.append((ch, toks[off : off + nt], buffers[i : i + n]))
        off += nt
        i += n
    return out


class Outbox:
    """Chunks waiting to be sent, grouped by peer; `flush` sends one message
    per peer (a Chunk alone, or a packed ChunkBatch). Owned by one loop thread.
    Every chunk's first buffer is its token frame (bus/frames.py)."""

    def __init__(self) -> None:
        self.by_peer: dict[bytes, list[tuple[Any, list[Any]]]] = {}

    def add(self, peer: bytes, chunk: Any, buffers: list[Any]) -> None:
        self.by_peer.setdefault(peer, []).append((chunk, buffers))

    def messages(self) -> list[tuple[bytes, Any, list[Any]]]:
        """[(peer, msg, buffers)], one per peer, and empty the box."""
        box, self.by_peer = self.by_peer, {}
        return [(peer, *one_message(items)) for peer, items in box.items()]

    def flush(self, send: Callable[[bytes, Any, list[Any]], Any]) -> None:
        """`send(peer, msg, buffers)` each peer's message and empty the box:
        what `messages()` returns, without building it (the engine node's busy
        loop runs this once per chunk; a lone chunk goes out as it is)."""
        box = self.by_peer
        if len(box) == 1:
            # One peer (the common turn): popped, so the box is empty (and
            # kept: no new dict per chunk) before `send` runs; a send that
            # reports the peer gone may pop it again.
            peer, items = box.popitem()
            if len(items) == 1:
                chunk, bufs = items[0]
                send(peer, chunk, bufs)
            else:
                send(peer, *one_message(items))
            return
        self.by_peer = {}
        for peer, items in box.items():
            send(peer, *one_message(items))


def one_message(items: list[tuple[Any, list[Any]]]) -> tuple[Any, list[Any]]:
    """One peer's chunks as one message: a Chunk alone, else a ChunkBatch."""
    if len(items) == 1:
        return items[0]
    if all(bs for _, bs in items):
        # Packed: one token frame for the whole batch (b"".join takes
        # bytes, zmq Frames and memoryview slices alike).
        toks = b"".join([bs[0] for _, bs in items])
        rest = [b for _, bs in items for b in bs[1:]]
        batch = P.ChunkBatch(
            [c for c, _ in items],
            [len(bs) - 1 for _, bs in items],
            [token_count(bs[0]) for _, bs in items],
        )
        return batch, [toks, *rest]
    # a chunk without a token frame: the unpacked layout
    bufs = [b for _, bs in items for b in bs]
    return P.ChunkBatch([c for c, _ in items], [len(bs) for _, bs in items]), bufs


def _raw(body: Any) -> Any:
    try:
        return msgspec.msgpack.decode(body)
    except (
        msgspec.MsgspecError,
        TypeError,
        ValueError,
        RecursionError,
        MemoryError,
        OverflowError,
    ):  # garbage is expected here: the caller replies BadRequest
        return None


def request_id_of(frames: Sequence[Any]) -> str:
    """Best effort: the request id of an undecodable request (`[body, …]`), for the error
    reply. An id longer than the protocol allows is not echoed (a 32 MB id
    would come back in a 32 MB reply): "" instead."""
    try:
        raw = msgspec.msgpack.decode(frames[0])
        if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str) and len(raw[1]) <= P.MAX_ID_CHARS:
            return raw[1]
    # Hostile bodies: msgspec's decode errors, a missing frame, a frame that is
    # not bytes, nesting too deep; the caller's error reply goes out without an id.
    except (msgspec.DecodeError, IndexError, TypeError, ValueError, RecursionError, MemoryError, OverflowError):
        pass
    return ""
