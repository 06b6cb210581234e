"""Validation of a Generate request, shared by the router and the engine node.

Raises BadRequest naming the offending field. The engine node checks again
what only it knows (the LoRA adapters it has, its max model length).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bus.errors import BadRequest
from bus.frames import TOKEN_BYTES, token_count, tokens_view
from bus.protocol import MAX_SAMPLE_INDEX, Generate

MAX_NUM_SAMPLES = 1024
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top-k (and prompt top-k) at most this
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
_SMALL_PROMPT = 256  # prompts up to this many ids are range-checked as a list (bench/profile_hop.py)


def prompt_from_frames(msg: Generate, buffers: list[Any], *, max_prompt_tokens: int) -> np.ndarray:
    """The prompt as an int32 array (a view of the frame, no copy)."""
    rid = msg.request_id
    if not buffers:
        raise BadRequest(
            "missing prompt frame (int32 token ids after the body)", request_id=rid, field="prompt_token_ids"
        )
    raw = buffers[0]
    n = len(raw)
    if n == 0:
        raise BadRequest("empty prompt", request_id=rid, field="prompt_token_ids")
    if n % TOKEN_BYTES:
        raise BadRequest(
            f"prompt frame is {n} bytes, not a multiple of {TOKEN_BYTES} (int32)",
            request_id=rid,
            field="prompt_token_ids",
        )
    if token_count(raw) > max_prompt_tokens:
        raise BadRequest(
            f"prompt has {token_count(raw)} tokens, more than max_prompt_tokens={max_prompt_tokens}",
            request_id=rid,
            field="prompt_token_ids",
        )
    return tokens_view(raw)


def check_generate(msg: Generate, prompt: np.ndarray, *, vocab_size: int = 0) -> None:
    rid = msg.request_id
    p = msg.params

    def bad(field: str, why: str) -> BadRequest:
        return BadRequest(why, request_id=rid, field=field)

    if not rid:
        raise bad("request_id", "request_id must be a non-empty string")
    if p.max_tokens <= 0:
        raise bad("params.max_tokens", f"max_tokens must be >= 1, got {p.max_tokens}")
    # NaN compares false with everything: test finiteness first, or a NaN
    # temperature reaches the model and fails every request in its step.
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise bad("params.temperature", f"temperature must be a finite number >= 0, got {p.temperature}")
    if not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
        raise bad("params.top_p", f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        raise bad("params.top_k", f"top_k must be >= -1 (0 or -1: off), got {p.top_k}")
    if p.seed is not None and not 0 <= p.seed < 1 << 63:
        raise bad("params.seed", f"seed must be in [0, 2**63), got {p.seed}")
    if not 1 <= msg.num_samples <= MAX_NUM_SAMPLES:
        raise bad("num_samples", f"num_samples must be in [1, {MAX_NUM_SAMPLES}], got {msg.num_samples}")
    if msg.sample_offset + msg.num_samples - 1 > MAX_SAMPLE_INDEX:
        # Sample indexes go on the wire in every Chunk: they must stay inside its bound.
        raise bad("sample_offset", f"sample_offset + num_samples - 1 must be <= {MAX_SAMPLE_INDEX}")
    if msg.timeout_s is not None and (not math.isfinite(msg.timeout_s) or msg.timeout_s <= 0):
        raise bad("timeout_s", f"timeout_s must be > 0, got {msg.timeout_s}")
    if not 0 <= msg.resume_len < len(prompt) or msg.resume_len >= p.max_tokens:
        if msg.resume_len:
            raise bad("resume_len", f"resume_len={msg.resume_len} must be < the prompt length and < max_tokens")
    if msg.max_staleness is not None and msg.max_staleness < 0:
        raise bad("max_staleness", f"max_staleness must be >= 0 (or None: no bound), got {msg.max_staleness}")
    if msg.resume_len and msg.num_samples != 1:
        raise bad("resume_len", "a resumed request carries exactly one sample")
    _check_issue10(p, bad)
    if len(prompt) <= _SMALL_PROMPT:
        # numpy's min / max cost more than a short prompt's ids (two ufunc
        # reductions were the largest item of a message's path in the head).
        ids = prompt.tolist()
        lo, hi = min(ids), max(ids)
    else:
        lo, hi = int(prompt.min()), (int(prompt.max()) if vocab_size else 0)
    if lo < 0:
        raise bad("prompt_token_ids", f"token id {lo} is negative")
    if vocab_size:
        if hi >= vocab_size:
            raise bad("prompt_token_ids", f"token id {hi} is outside the vocabulary (size {vocab_size})")
        for t in p.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise bad("params.stop_token_ids", f"stop token id {t} is outside the vocabulary (size {vocab_size})")


def check_control_timeout(msg: Any) -> None:
    """`Control.timeout_s` is the deadline of the op's fan-out: NaN never
    passes (the head would republish the command forever and never answer),
    nor does a deadline that is already over."""
    t = msg.timeout_s
    if not _finite(t) or t <= 0:
        raise BadRequest(
            f"timeout_s must be a finite number > 0, got {t}", request_id=msg.request_id, field="timeout_s"
        )


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_issue10(p: Any, bad: Any) -> None:
    """The issue-10 sampling fields, with vLLM's ranges (SamplingParams._verify_args)."""
    lp = p.logprobs
    if not isinstance(lp, bool) and not 0 <= lp <= MAX_LOGPROBS:
        raise bad("params.logprobs", f"logprobs must be a bool or an int in [0, {MAX_LOGPROBS}], got {lp}")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_LOGPROBS:
        raise bad(
            "params.prompt_logprobs",
            f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}",
        )
    if len(p.stop) > MAX_STOP_STRINGS:
        raise bad("params.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    for st in p.stop:
        if not st:
            raise bad("params.stop", "stop strings must be non-empty")
        if len(st) > MAX_STOP_STRING_CHARS:
            raise bad("params.stop", f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters")
    if p.min_tokens < 0:
        raise bad("params.min_tokens", f"min_tokens must be >= 0, got {p.min_tokens}")
    if p.min_tokens > p.max_tokens:
        raise bad("params.min_tokens", f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens})")
    if not _finite(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise bad("params.min_p", f"min_p must be in [0, 1], got {p.min_p}")
    if not _finite(p.repetition_penalty) or p.repetition_penalty <= 0.0:
        raise bad(
            "params.repetition_penalty", f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _finite(v) or not -2.0 <= v <= 2.0:
            raise bad(f"params.{name}", f"{name} must be in [-2, 2], got {v}")


# Issue 34: what one request may make a head or an engine hold. Both keep every
# sample's tokens so far (failover, park / re-submission), 4 bytes a token
# (8 with logprobs), so n x (prompt + max_tokens) is the request's memory.
DEFAULT_MAX_REQUEST_TOKENS = 1 << 23


def request_tokens(msg: Generate, prompt_len: int) -> int:
    """n x (the client's prompt + max_tokens): a resumed request's output
    (msg.resume_len) counts once, as the max_tokens it is part of."""
    return msg.num_samples * (prompt_len - msg.resume_len + msg.params.max_tokens)


def check_request_budget(msg: Generate, prompt_len: int, max_request_tokens: int, where: str) -> None:
    """BadRequest naming the knob (field "max_request_tokens") when the
    request's tokens pass `where`'s budget (0: no budget)."""
    if max_request_tokens <= 0:
        return
    total = request_tokens(msg, prompt_len)
    if total > max_request_tokens:
        raise BadRequest(
            f"n ({msg.num_samples}) x (prompt {prompt_len - msg.resume_len} + max_tokens {msg.params.max_tokens}) "
            f"= {total:,} tokens > {max_request_tokens:,}, the {where}'s --max-request-tokens: split it into "
            "smaller requests (fewer samples, a lower max_tokens), or raise --max-request-tokens on the head and "
            "every engine",
            request_id=msg.request_id,
            field="max_request_tokens",
        )
