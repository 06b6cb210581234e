"""Per-request stream state and chunk assembly, without sockets.

A request's queue is fed by the head link (`connection.HeadLink._drain`):
`(P.Chunk, token ids, logprob frames)` for a chunk, `(final, None, None)`
for anything that ends it (a wire `P.Error`, a typed error raised on our
side, `END` when the client closes, `TIMED_OUT` from its deadline timer).
This module turns those items into `StreamChunk`s, the error to raise, and
`GenerationResult`s; the queue and its timer are owned by the loop of the
`AsyncClient` that opened the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np

from bus import protocol as P
from bus.errors import (
    BadRequest,
    ClosedByUs,
    ErrorCode,
    ProtocolError,
    RequestTimeout,
    RolloutBusError,
    exception_from_wire,
)
from bus.frames import decode as decode_frames
from bus.frames import token_versions, unpack_logprobs
from trainer_bridge.types import GenerationResult, SampleOutput, StreamChunk

END = object()  # the client was closed: the request will get nothing more
TIMED_OUT = object()  # the request's own deadline timer fired
GRACE_S = 2.0  # the servers' own deadline errors should reach us before ours fires


@dataclasses.dataclass
class RequestStream:
    """One open generate request as its awaiting coroutine sees it."""

    request_id: str
    queue: asyncio.Queue
    timer: asyncio.TimerHandle
    open_samples: int  # samples still without their final chunk
    sent: bool = False  # the Generate left: a Cancel has something to end
    received: bool = False  # a chunk came: the request started (never sent again)


def check_num_samples(num_samples: Any) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        # Checked here, not only at the head: with 0 samples to wait for, a
        # stream would return an empty result without a word.
        raise BadRequest(f"num_samples must be an int >= 1, got {num_samples!r}", field="num_samples")


def is_batch(prompt: Any) -> bool:
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 2
    return bool(prompt) and isinstance(prompt[0], (list, tuple, np.ndarray))


def final_error(item: Any, rid: str, timeout: float) -> Exception:
    """The error a non-chunk queue item ends request `rid` with."""
    if item is TIMED_OUT:
        return RequestTimeout(f"request did not finish within timeout_s={timeout}", request_id=rid, field="timeout_s")
    if item is END:
        return ClosedByUs("the client was closed while streaming", request_id=rid)
    if isinstance(item, RolloutBusError):
        return item
    if isinstance(item, P.Error):
        return exception_from_wire(item.code, item.message, rid, item.field)
    return ProtocolError(f"unexpected {type(item).__name__} for a generate request", request_id=rid)


def at_client_cap(item: Any) -> bool:
    """The head refused the request at its per-client cap (LimitExceeded,
    field max_inflight_per_client): trainer_bridge/pacing.py sends it again."""
    return (
        isinstance(item, P.Error)
        and item.code == ErrorCode.LIMIT_EXCEEDED.value
        and (item.field == "max_inflight_per_client")
    )


def to_stream_chunk(rid: str, item: P.Chunk, toks: list[int], rest: list[Any]) -> StreamChunk:
    if item.top_logprobs or item.prompt_logprobs >= 0 or item.routed_experts is not None:
        return _rich_chunk(rid, item, toks, rest)
    # The common chunk (tokens, maybe their logprobs): no Decoded,
    # positional fields (StreamChunk's order), defaults for the rest.
    return StreamChunk(
        rid,
        item.sample_index,
        toks,
        unpack_logprobs(rest[0]) if rest else None,
        item.weight_version,
        item.finish_reason,
        item.emitted_at,
        time.time(),
        item.engine_id,
        item.num_prompt_tokens,
        stop_str=item.stop_reason,
        text=item.text,
        restarts=item.restarts,
    )


def _rich_chunk(rid: str, item: P.Chunk, toks: list[int], rest: list[Any]) -> StreamChunk:
    """A chunk with top-k, prompt logprobs or routed experts: the full frame layout."""
    try:
        dec = decode_frames(item, [b"", *rest], token_ids=toks)
    except (ValueError, IndexError) as e:  # a frame that lies about its shape
        raise ProtocolError(f"bad chunk frames: {e}", request_id=rid, field="routed_experts") from None
    routes = prompt_routes = None
    if dec.routes is not None:
        cut = item.routed_experts.prompt_rows if item.routed_experts is not None else 0
        routes, prompt_routes = dec.routes[cut:], (dec.routes[:cut] if cut else None)
    return StreamChunk(
        request_id=rid,
        sample_index=item.sample_index,
        token_ids=toks,
        logprobs=dec.logprobs,
        weight_version=item.weight_version,
        finish_reason=item.finish_reason,
        emitted_at=item.emitted_at,
        received_at=time.time(),
        engine_id=item.engine_id,
        num_prompt_tokens=item.num_prompt_tokens,
        top_ids=dec.top_ids,
        top_logprobs=dec.top_logprobs,
        prompt=dec.prompt,
        stop_str=item.stop_reason,
        text=item.text,
        restarts=item.restarts,
        routed_experts=routes,
        prompt_routed_experts=prompt_routes,
    )


class SampleAssembler:
    """A request's chunks → one GenerationResult (samples in index order)."""

    def __init__(self) -> None:
        self.samples: dict[int, SampleOutput] = {}
        self.num_prompt_tokens = 0
        # sample index -> [prompt rows, output rows] (numpy parts, joined at the end)
        self.routes: dict[int, tuple[list[Any], list[Any]]] = {}

    def add(self, ch: StreamChunk, changes: Any) -> None:
        s = self.samples.get(ch.sample_index)
        if s is None:
            s = self.samples[ch.sample_index] = SampleOutput(
                ch.sample_index, [], [] if ch.logprobs is not None else None, "", []
            )
        if ch.restarts > s.restarts:  # the staleness bound regenerated it: keep the new attempt only
            s.restarts = ch.restarts
            s.token_ids.clear()
            s.token_versions.clear()
            if s.logprobs is not None:
                s.logprobs.clear()
            s.top_ids = s.top_logprobs = None
            self.routes.pop(ch.sample_index, None)
        if ch.routed_experts is not None or ch.prompt_routed_experts is not None:
            parts = self.routes.setdefault(ch.sample_index, ([], []))
            if ch.prompt_routed_experts is not None:
                parts[0].append(ch.prompt_routed_experts)
            if ch.routed_experts is not None:
                parts[1].append(ch.routed_experts)
        s.token_ids.extend(ch.token_ids)
        if ch.logprobs is not None and s.logprobs is not None:
            s.logprobs.extend(ch.logprobs)
        if ch.top_ids is not None:
            s.top_ids = (s.top_ids or []) + ch.top_ids
            s.top_logprobs = (s.top_logprobs or []) + (ch.top_logprobs or [])
        s.token_versions.extend(token_versions(ch.weight_version, changes, len(ch.token_ids)))
        if ch.finish_reason is not None:
            self._finish(s, ch, ch.finish_reason)

    def _finish(self, s: SampleOutput, ch: StreamChunk, finish_reason: str) -> None:
        s.finish_reason = finish_reason
        s.engine_id = ch.engine_id
        s.stop_str = ch.stop_str
        if ch.text is not None:
            s.text = ch.text  # the engine's text (stop strings: truncated as vLLM does)
        if ch.prompt is not None:
            s.prompt_logprobs = ch.prompt.logprobs
            s.prompt_top_ids, s.prompt_top_logprobs = ch.prompt.top_ids, ch.prompt.top_logprobs
        self.num_prompt_tokens = ch.num_prompt_tokens
        parts = self.routes.pop(s.index, None)
        if parts is not None:
            if parts[0]:
                s.prompt_routed_experts = np.concatenate(parts[0], axis=0)
            if parts[1]:
                s.routed_experts = np.concatenate(parts[1], axis=0)

    def result(self, rid: str) -> GenerationResult:
        return GenerationResult(
            request_id=rid,
            samples=[self.samples[i] for i in sorted(self.samples)],
            num_prompt_tokens=self.num_prompt_tokens,
        )
