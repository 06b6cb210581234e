"""The raw-frame layouts of the data plane, owned here and nowhere else.

A Generate carries its prompt and a Chunk its new tokens as int32
little-endian frames; a Chunk's logprobs (when asked) as float32 little-endian.
Weight-version marks are `[token offset, version]` pairs: a chunk's
`weight_version` stamps its first token and `version_changes` lists every later
change. Client, router, engine core, validation and bench read and write these
frames only through the helpers below — no byte arithmetic elsewhere.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

assert sys.byteorder == "little", "token frames are little-endian: array('i'/'f') must match"
assert array("i").itemsize == 4 and array("f").itemsize == 4

TOKEN_DTYPE = "<i4"
LOGPROB_DTYPE = "<f4"
TOKEN_BYTES = 4  # one token id, and one logprob, per 4 bytes

Marks = list[list[int]]  # [[token offset, weight version], …]


# ------------------------------------------------------------ tokens / logprobs


def pack_tokens(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids → an int32 frame."""
    if isinstance(ids, list):  # the hot path (engine core): no numpy round trip
        return array("i", ids).tobytes()
    return np.asarray(ids, dtype=TOKEN_DTYPE).tobytes()  # tuples, arrays, tensors


def pack_logprobs(lps: Sequence[float]) -> bytes:
    """Logprobs → a float32 frame."""
    return array("f", lps).tobytes()


def token_count(frame: Any) -> int:
    """How many token ids (or logprobs) a frame holds."""
    return len(frame) // TOKEN_BYTES


def token_bytes(n: int) -> int:
    """The byte length of `n` token ids (or logprobs): for slicing a frame."""
    return n * TOKEN_BYTES


def tokens_view(frame: Any) -> np.ndarray:
    """An int32 array over the frame (no copy); the frame must stay alive."""
    return np.frombuffer(frame, dtype=TOKEN_DTYPE)


def unpack_tokens(frame: Any) -> list[int]:
    return np.frombuffer(frame, dtype=TOKEN_DTYPE).tolist()


def unpack_logprobs(frame: Any) -> list[float]:
    return np.frombuffer(frame, dtype=LOGPROB_DTYPE).tolist()


def chunk_payload(buffers: Sequence[Any]) -> tuple[Any, Any | None]:
    """(token frame, logprob frame or None) of a Chunk's buffers."""
    return (buffers[0] if buffers else b""), (buffers[1] if len(buffers) > 1 else None)


# ------------------------------------------------------------ version marks


def note_version(marks: Marks, offset: int, version: int) -> None:
    """Tokens from `offset` on were produced by `version`: record a change only."""
    if not marks or marks[-1][1] != version:
        marks.append([offset, version])


def shift_marks(marks: Marks, skip: int) -> Marks:
    """Marks of a sequence whose first `skip` tokens are dropped."""
    return [[max(0, offset - skip), version] for offset, version in marks]


def chunk_versions(marks: Marks, default: int) -> tuple[int, Marks]:
    """(Chunk.weight_version, Chunk.version_changes) of a chunk carrying `marks`."""
    if not marks:
        return default, []
    return marks[0][1], marks[1:]


def token_versions(first: int, changes: Marks, n: int) -> list[int]:
    """Per-token weight versions of a chunk of `n` tokens."""
    out = [first] * n
    for offset, version in changes:
        for i in range(offset, n):
            out[i] = version
    return out
