"""Framing: turn messages into multipart frames and back.

A `Codec` holds one msgspec Encoder and one Decoder per message type. Build one
per socket-owning thread (msgspec encoders reuse an internal buffer and are not
meant to be shared across threads).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from bus import protocol as P
from bus.errors import BadRequest, ProtocolError

_PATH_INDEX = re.compile(r"\[(\d+)\]")


def _field_path(cls: type, path: str) -> str | None:
    """Translate msgspec's array-like error path (`$[2][0]`) into field names
    (`params.max_tokens`). Tagged structs carry the tag at index 0."""
    names: list[str] = []
    cur: Any = cls
    for m in _PATH_INDEX.finditer(path):
        idx = int(m.group(1))
        if cur is None or not hasattr(cur, "__struct_fields__"):
            names.append(f"[{idx}]")
            cur = None
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
        name = fields[idx]
        names.append(name)
        ann = msgspec.structs.fields(cur)[idx].type
        cur = ann if isinstance(ann, type) and issubclass(ann, msgspec.Struct) else None
    return ".".join(names) if names else None


class Codec:
    """Encode/decode `[kind][body][buffers…]` (routing ids handled by the caller)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
            kind: msgspec.msgpack.Decoder(t) for kind, t in P.TYPE_OF.items()
        }

    def encode(self, msg: Any, buffers: Sequence[Any] = ()) -> list[Any]:
        return [P.KIND_OF[type(msg)], self._enc.encode(msg), *buffers]

    def decode(self, frames: Sequence[Any]) -> tuple[Any, list[Any]]:
        """Decode `[kind, body, *buffers]`. Raises ProtocolError (unknown kind,
        missing body) or BadRequest naming the offending field."""
        if len(frames) < 2:
            raise ProtocolError(f"expected [kind, body, …], got {len(frames)} frame(s)", field="frames")
        kind = bytes(frames[0])
        dec = self._dec.get(kind)
        if dec is None:
            raise ProtocolError(f"unknown message kind {kind!r}", field="kind")
        cls = P.TYPE_OF[kind]
        try:
            msg = dec.decode(frames[1])
        except msgspec.ValidationError as e:
            text = str(e)
            at = text.rsplit(" - at `$", 1)
            field = _field_path(cls, at[1]) if len(at) == 2 else None
            raise BadRequest(f"invalid {cls.__name__}: {at[0]}", field=field) from None
        except msgspec.DecodeError as e:
            raise ProtocolError(f"undecodable {cls.__name__} body: {e}", field="body") from None
        except (UnicodeDecodeError, RecursionError, MemoryError, ValueError, TypeError, OverflowError) as e:
            # Hostile bodies reach these, not ValidationError: a string that is
            # not UTF-8, thousands of nested arrays inside an `Any` field. The
            # decoder must be total: every frame becomes a message or a typed error.
            raise ProtocolError(f"undecodable {cls.__name__} body: {type(e).__name__}", field="body") from None
        return msg, list(frames[2:])


def split_chunks(msg: Any, buffers: list[Any]) -> list[tuple[Any, list[Any]]]:
    """[(Chunk, its buffers)] of a Chunk or a ChunkBatch."""
    if not isinstance(msg, P.ChunkBatch):
        return [(msg, buffers)]
    out, i = [], 0
    for ch, n in zip(msg.chunks, msg.nbufs, strict=False):
        out.append((ch, buffers[i : i + n]))
        i += n
    return out


class Outbox:
    """Chunks waiting to be sent, grouped by peer; `flush` sends one message
    per peer (a Chunk alone, or a ChunkBatch). Owned by one loop thread."""

    def __init__(self) -> None:
        self.by_peer: dict[bytes, list[tuple[Any, list[Any]]]] = {}

    def add(self, peer: bytes, chunk: Any, buffers: list[Any]) -> None:
        self.by_peer.setdefault(peer, []).append((chunk, buffers))

    def messages(self):
        """Yield (peer, msg, buffers) and empty the box."""
        box, self.by_peer = self.by_peer, {}
        for peer, items in box.items():
            if len(items) == 1:
                yield peer, items[0][0], items[0][1]
            else:
                bufs = [b for _, bs in items for b in bs]
                yield peer, P.ChunkBatch([c for c, _ in items], [len(bs) for _, bs in items]), bufs


def request_id_of(frames: Sequence[Any]) -> str:
    """Best effort: the request id of an undecodable request, for the error reply."""
    try:
        raw = msgspec.msgpack.decode(frames[1])
        if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str):
            return raw[1]
    except Exception:
        pass
    return ""
