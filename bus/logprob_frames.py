"""Frame layout of a Chunk's logprobs (issue 10): chosen, top-k, prompt.

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

The prompt frames are counted from the end, so the chosen-logprobs frame's
presence never shifts them. Readers only ever need `decode`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


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


def _rows(flat: np.ndarray, k: int) -> list[list[Any]]:
    return flat.reshape(-1, k).tolist() if k and flat.size else []


def encode_top(ids: list[int], lps: list[float]) -> list[bytes]:
    return [np.asarray(ids, dtype="<i4").tobytes(), np.asarray(lps, dtype="<f4").tobytes()]


def encode_prompt(k: int, lps: list[float], top_ids: list[int], top_lps: list[float]) -> list[bytes]:
    """Frames of the prompt logprobs: lps has P entries (NaN first); top_* P*k."""
    out = [np.asarray(lps, dtype="<f4").tobytes()]
    if k > 0:
        out += encode_top(top_ids, top_lps)
    return out


def prompt_frame_count(chunk: Any) -> int:
    j = getattr(chunk, "prompt_logprobs", -1)
    return 0 if j < 0 else (3 if j > 0 else 1)


def decode(chunk: Any, buffers: list[Any]) -> Decoded:
    """The token ids and every logprob a Chunk's frames carry."""
    npf = prompt_frame_count(chunk)
    head = buffers[: len(buffers) - npf] if npf else buffers
    toks = np.frombuffer(head[0], dtype="<i4").tolist() if head else []
    lps = np.frombuffer(head[1], dtype="<f4").tolist() if len(head) > 1 else None
    out = Decoded(toks, lps)
    k = getattr(chunk, "top_logprobs", 0)
    if k > 0 and len(head) >= 4:
        out.top_ids = _rows(np.frombuffer(head[2], dtype="<i4"), k)
        out.top_logprobs = _rows(np.frombuffer(head[3], dtype="<f4"), k)
    if npf:
        tail = buffers[len(buffers) - npf :]
        plp: list[float | None] = [None if math.isnan(x) else x for x in np.frombuffer(tail[0], dtype="<f4").tolist()]
        pr = PromptLogprobs(plp)
        j = chunk.prompt_logprobs
        if j > 0:
            pr.top_ids = _rows(np.frombuffer(tail[1], dtype="<i4"), j)
            pr.top_logprobs = _rows(np.frombuffer(tail[2], dtype="<f4"), j)
        out.prompt = pr
    return out
