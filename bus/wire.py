"""The ground every wire type stands on: the field bounds the decoder checks
and the two Struct bases (messages: tagged; parts: nested, untagged).

bus/protocol.py (messages), bus/results.py (control results) and
bus/views.py (query answers) build on it; `from bus import protocol as P`
re-exports all of it, so users name `P.Id`, `P.MAX_VERSION`, ... as before.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

# ------------------------------------------------------------- field bounds
# Issue 22, "no poison pill": every integer and string field has a range or a
# maximum length, checked by the DECODER (msgspec.Meta), so a value that the
# decoder accepted can always be encoded again (msgpack ints stop at 64 bits)
# and every value derived from it stays inside the bounds of the next hop
# (sample_offset + num_samples fits Chunk.sample_index; a version bumped by a
# commit stays below MAX_VERSION). A refused field is a BadRequest naming it
# (bus/codec.py). Constraints do not change the wire shape: no version bump.
# Hazard: a bound on a message a PEER of ours produces must hold for everything
# that peer can legitimately send, or its message is dropped at decode (an
# engine's Error dropped = a request that never ends); keep those generous.
MAX_ID_CHARS = 256  # request / session / engine / update ids, LoRA names
MAX_NAME_CHARS = 4096  # addresses, paths, model and tensor names
MAX_SHORT_CHARS = 256  # codes, modes, dtypes, field names, query names
MAX_MESSAGE_CHARS = 64 * 1024  # error texts (ours are cut to bus.errors.MAX_ECHO first)
MAX_TEXT_CHARS = 1 << 24  # Chunk.text (a whole output, detokenized)
MAX_SENDERS = 1024  # sender ranks of one weight update
MAX_SAMPLE_INDEX = (1 << 31) - 1  # sample_offset + num_samples - 1 stays below this
MAX_VERSION = (1 << 53) - 1  # weight versions: exact in a float64 too (JSON, metrics)
MAX_COMMIT_VERSION = 1 << 52  # a trainer's version: leaves room for +1 commits below MAX_VERSION
MAX_LIST = 1 << 20  # list fields of control messages (tensors, buckets, targets)

Id = Annotated[str, Meta(max_length=MAX_ID_CHARS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Short = Annotated[str, Meta(max_length=MAX_SHORT_CHARS)]
Message = Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS)]
I32 = Annotated[int, Meta(ge=-(1 << 31), le=(1 << 31) - 1)]
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]
I64 = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]  # counts, sizes, seqs, epochs: non-negative int64
Version = Annotated[int, Meta(ge=0, le=MAX_VERSION)]
SampleIndex = Annotated[int, Meta(ge=0, le=MAX_SAMPLE_INDEX)]
Sender = Annotated[int, Meta(ge=0, lt=MAX_SENDERS)]
Ids = Annotated[list[Id], Meta(max_length=MAX_LIST)]
StopStr = Annotated[str, Meta(max_length=1024)]  # bus.validate.MAX_STOP_STRING_CHARS
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]


class Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire message."""


class Part(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of nested (non-message) parts."""
