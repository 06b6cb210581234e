"""The raw-frame layouts of the data plane, owned here and nowhere else.

A Generate carries its prompt and a Chunk its new tokens as int32
little-endian frames; a Chunk's logprobs (when asked) as float32 little-endian.
Weight-version marks are `[token offset, version]` pairs: a chunk's
`weight_version` stamps its first token and `version_changes` lists every later
change. Client, router, engine core, validation and bench read and write these
frames only through the helpers below — no byte arithmetic elsewhere.

A Chunk's raw frames, in order::

    [0] new token ids           int32[n]
    [1] their chosen logprobs   float32[n]        when the request asked for logprobs
    [2] top-k token ids         int32[n * k]      when chunk.top_logprobs = k > 0,
    [3] top-k logprobs          float32[n * k]      row-major, best first
    then, only when chunk.prompt_logprobs = j >= 0 (the sample's final chunk):
    [-1 or -3] prompt logprobs  float32[P]        P = prompt length; entry 0 is NaN
                                                  (no logprob for the first token)
    [-2, -1] prompt top-j ids   int32[P * j]      when j > 0, row 0 zeros / NaN
             + logprobs         float32[P * j]

    then, only when chunk.routed_experts is set (issue 37, MoE routing replay):
    [-1]        routed experts  uint8/16/32[rows * layers * top_k], row-major
                                (the chunk's RoutedExperts says shape and dtype)

The prompt frames are counted from the end (before the routed-experts frame,
which is always last), so the chosen-logprobs frame's presence never shifts
them. Readers only ever need `decode` (or `split_routes` first).
"""

from __future__ import annotations

import dataclasses
import math
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
    # array.frombytes, not numpy: a chunk frame holds a token or a few, and a
    # client decodes tens of thousands of them a second (0.19 vs 0.44 µs).
    a = array("i")
    a.frombytes(frame)
    return a.tolist()


def unpack_logprobs(frame: Any) -> list[float]:
    a = array("f")
    a.frombytes(frame)
    return a.tolist()


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


# ------------------------------------------------------------ logprobs: chosen, top-k, prompt


def logprobs_wanted(lp: Any) -> bool:
    """SamplingParams.logprobs: False/None = none; True, 0, k >= 1 = yes."""
    return lp is not None and lp is not False


def top_k_of(lp: Any) -> int:
    """Top-k alternatives per token that `SamplingParams.logprobs` asks for
    (True means the chosen token only: bool before int, True == 1 in Python)."""
    if lp is None or isinstance(lp, bool):
        return 0
    return max(0, int(lp))


@dataclasses.dataclass
class PromptLogprobs:
    """Per prompt token: its logprob given the prefix (None for the first) and
    the top-k alternatives (ids, logprobs) at that position."""

    logprobs: list[float | None]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclasses.dataclass
class Decoded:
    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt: PromptLogprobs | None = None
    routes: np.ndarray | None = None  # [rows, layers, top_k] (chunk.routed_experts)


def _rows(flat: np.ndarray, k: int) -> list[list[Any]]:
    return flat.reshape(-1, k).tolist() if k and flat.size else []


def encode_top(ids: list[int], lps: list[float]) -> list[bytes]:
    return [np.asarray(ids, dtype=TOKEN_DTYPE).tobytes(), np.asarray(lps, dtype=LOGPROB_DTYPE).tobytes()]


def encode_prompt(k: int, lps: list[float], top_ids: list[int], top_lps: list[float]) -> list[bytes]:
    """Frames of the prompt logprobs: lps has P entries (NaN first); top_* P*k."""
    out = [np.asarray(lps, dtype=LOGPROB_DTYPE).tobytes()]
    if k > 0:
        out += encode_top(top_ids, top_lps)
    return out


# ------------------------------------------------------------ routed experts (R3)

ROUTE_DTYPES = ("uint8", "uint16", "uint32")  # little-endian on the wire


def routes_dtype(num_experts: int) -> str:
    """The smallest unsigned dtype that holds expert ids 0..num_experts-1."""
    return "uint8" if num_experts <= 1 << 8 else "uint16" if num_experts <= 1 << 16 else "uint32"


def route_itemsize(dtype: str) -> int:
    return {"uint8": 1, "uint16": 2, "uint32": 4}.get(dtype, 1)


def pack_routes(rows: np.ndarray, dtype: str) -> bytes:
    """[rows, layers, top_k] expert ids -> the frame (C order, `dtype`)."""
    return np.ascontiguousarray(rows, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def split_routes(chunk: Any, buffers: list[Any]) -> tuple[list[Any], Any | None]:
    """(the chunk's other frames, its routed-experts frame or None)."""
    if getattr(chunk, "routed_experts", None) is None or not buffers:
        return buffers, None
    return buffers[:-1], buffers[-1]


def unpack_routes(meta: Any, frame: Any) -> np.ndarray:
    """The [rows, layers, top_k] array a RoutedExperts + frame describe (a
    copy: the frame may be a reused buffer). A lie is a ValueError naming it."""
    if meta.dtype not in ROUTE_DTYPES:
        raise ValueError(f"routed_experts.dtype {meta.dtype!r} is not one of {ROUTE_DTYPES}")
    dt = np.dtype(meta.dtype).newbyteorder("<")
    want = meta.rows * meta.layers * meta.top_k * dt.itemsize
    if len(frame) != want or meta.prompt_rows > meta.rows:
        raise ValueError(
            f"routed_experts frame has {len(frame)} bytes, its shape {[meta.rows, meta.layers, meta.top_k]} "
            f"x {meta.dtype} needs {want} (prompt_rows {meta.prompt_rows})"
        )
    return np.frombuffer(frame, dtype=dt).reshape(meta.rows, meta.layers, meta.top_k).astype(meta.dtype)


def prompt_frame_count(chunk: Any) -> int:
    j = getattr(chunk, "prompt_logprobs", -1)
    return 0 if j < 0 else (3 if j > 0 else 1)


def decode(chunk: Any, buffers: list[Any], token_ids: list[int] | None = None) -> Decoded:
    """The token ids and every logprob a Chunk's frames carry (`token_ids`:
    already unpacked, e.g. from a packed ChunkBatch; buffers[0] is then unread)."""
    buffers, routes = split_routes(chunk, buffers)
    npf = prompt_frame_count(chunk)
    head = buffers[: len(buffers) - npf] if npf else buffers
    if token_ids is not None:
        toks = token_ids
    else:
        toks = unpack_tokens(head[0]) if head else []
    lps = unpack_logprobs(head[1]) if len(head) > 1 else None
    out = Decoded(toks, lps)
    k = getattr(chunk, "top_logprobs", 0)
    if k > 0 and len(head) >= 4:
        out.top_ids = _rows(np.frombuffer(head[2], dtype=TOKEN_DTYPE), k)
        out.top_logprobs = _rows(np.frombuffer(head[3], dtype=LOGPROB_DTYPE), k)
    if npf:
        tail = buffers[len(buffers) - npf :]
        plp: list[float | None] = [
            None if math.isnan(x) else x for x in np.frombuffer(tail[0], dtype=LOGPROB_DTYPE).tolist()
        ]
        pr = PromptLogprobs(plp)
        j = chunk.prompt_logprobs
        if j > 0:
            pr.top_ids = _rows(np.frombuffer(tail[1], dtype=TOKEN_DTYPE), j)
            pr.top_logprobs = _rows(np.frombuffer(tail[2], dtype=LOGPROB_DTYPE), j)
        out.prompt = pr
    if routes is not None:
        out.routes = unpack_routes(chunk.routed_experts, routes)
    return out
