"""What one sample's chunk carries, built from the node's request bookkeeping
(engine_node/requests.py). Pure functions: no I/O, no clock reads.

Hazards this module owns:
- a chunk carries only the tokens after `Sample.sent`, and advances it: the
  caller sends every chunk it builds (a built and dropped chunk loses tokens);
- token ids, logprobs and top-k travel as raw frames (bus/frames.py), in the
  order bus.codec.split_chunks expects; prompt logprobs only on a final chunk;
- streamed chunks carry the current weight version; a non-streamed final
  carries the versions its tokens came from (version marks);
- the stop / length decision is the backends' order: a last token that is both
  the max_tokens-th and a stop token finished with "stop".
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from bus import frames as F
from bus import protocol as P
from bus.frames import chunk_versions
from engine_node.requests import NodeRequest, Sample

# One token id as bus.frames.pack_tokens packs it (array("i"): a native int32):
# a step of one token per sample is the common chunk, and the Struct costs
# about a third of slicing the array. (An id that does not fit int32 never
# gets here: the sample's array refused it when the step's tokens came in.)
_pack_one = struct.Struct("i").pack


def natural_finish(req: NodeRequest, s: Sample, eos: frozenset[int]) -> str | None:
    """ "stop" / "length" when the sample's tokens so far end it, else None."""
    p = req.msg.params
    if s.tokens and len(s.tokens) > req.msg.resume_len:
        last = s.tokens[-1]
        if last in p.stop_token_ids or (not p.ignore_eos and last in eos):
            return "stop"
    if len(s.tokens) >= p.max_tokens:
        return "length"
    return None


def sample_chunk(
    req: NodeRequest,
    s: Sample,
    finish: str | None,
    version: int,
    wall: float,
    engine_id: str,
    eos: frozenset[int],
) -> tuple[P.Chunk, list[Any]]:
    """The sample's next chunk (tokens since the last one) and its frames.
    Hot path (once per chunk): positional arguments."""
    sent = s.sent
    p = req.msg.params
    tokens = s.tokens
    n = len(tokens)
    # tokens: an int32 array (engine_node/requests.py), already the frame's layout
    tok = _pack_one(tokens[sent]) if n == sent + 1 else tokens[sent:].tobytes()
    buffers = [tok]
    top_k = prompt_k = -1
    lp = p.logprobs
    if lp is not None and lp is not False:  # bus.frames.logprobs_wanted, inlined
        buffers.append(s.logprobs[sent:].tobytes())
        top_k = F.top_k_of(lp)
        if top_k > 0:
            buffers.append(s.top_ids[sent * top_k : n * top_k].tobytes())
            buffers.append(s.top_logprobs[sent * top_k : n * top_k].tobytes())
    text = None
    if finish is not None:
        pl = s.prompt_logprobs
        if p.prompt_logprobs is not None and pl is not None:
            prompt_k = pl.k
            buffers += F.encode_prompt(pl.k, pl.logprobs, pl.top_ids, pl.top_logprobs)
        if s.matcher is not None:
            last = s.tokens[-1] if len(s.tokens) > req.msg.resume_len else None
            stop_id = last is not None and (last in p.stop_token_ids or (not p.ignore_eos and last in eos))
            text = s.matcher.final_text(finish == "stop" and stop_id)
    changes: list[list[int]]
    if req.msg.stream:
        changes = []
    else:
        version, changes = chunk_versions(s.version_marks, version)
    if top_k < 0:  # max(0, top_k) without the builtin's call (once per chunk)
        top_k = 0
    # Positional (once per chunk: msgspec matches no keyword names), in
    # P.Chunk's field order, which the wire fixes (fields are only appended).
    if finish is None:
        chunk = P.Chunk(
            req.msg.request_id, s.index, version, None, changes, wall, 0, "", top_k, -1, None, None, s.restarts
        )
    else:
        chunk = P.Chunk(
            req.msg.request_id,
            s.index,
            version,
            finish,
            changes,
            wall,
            len(req.base_prompt),
            engine_id,
            top_k,
            prompt_k,
            s.stop_reason,
            text,
            s.restarts,
        )
    s.sent = n
    return chunk, buffers


def base_prompt_logprobs(pl: Any, base_len: int) -> Any:
    """A submission's prompt logprobs cut to the client's prompt (a re-submitted
    prompt ends with output tokens)."""
    k = pl.k
    return dataclasses.replace(
        pl,
        logprobs=list(pl.logprobs[:base_len]),
        top_ids=list(pl.top_ids[: base_len * k]),
        top_logprobs=list(pl.top_logprobs[: base_len * k]),
    )
