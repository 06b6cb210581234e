"""MoE routing replay (R3, issue 37): which routed-expert rows a sample owes
its client, and the frame a chunk carries them in. Pure functions: no I/O.

Positions index the sample's whole sequence (base prompt + output). Row p is
the expert ids position p's token was routed to as the model's INPUT, so a
sample whose sequence has L tokens has rows for positions < L - 1 only (its
last token was never an input: vLLM's and SGLang's convention).

Hazards this module owns:
- every row reaches the client exactly once, in order, with the token that
  made it available: a chunk carries the rows for positions below
  `len(base prompt) + len(tokens) - 1` (taken when its tokens are), so a
  re-submission of prompt + tokens so far (pause "abort", failover, whose
  Generate says resume_len) starts at the last token the client holds — its
  row was never sent — and rows a backend repeats (its re-prefill) are dropped;
- a backend that skips a position is an error, never a misaligned array;
- a staleness restart starts the rows again where the attempt started.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bus import frames as F
from bus import protocol as P
from bus.errors import BadRequest
from engine_node.requests import NodeRequest, Sample

FIELD = "params.return_routed_experts"


def wanted(p: P.SamplingParams) -> bool:
    return p.return_routed_experts or p.routed_experts_prompt


def check(p: P.SamplingParams, shape: tuple[int, int, int] | None, engine_id: str, rid: str) -> None:
    """Refuse a request for routes on an engine that does not return them."""
    if wanted(p) and shape is None:
        raise BadRequest(
            f"engine {engine_id} was not started with the backend option return_routed_experts "
            "(or its model has no MoE layers)",
            request_id=rid,
            field=FIELD,
        )


def start(req: NodeRequest, s: Sample) -> None:
    """Where a new sample's rows begin: a resumed sequence (resume_len > 0:
    the client holds its prompt's rows and every output row but the last
    token's) at its last resumed token; else at the prompt (from
    routed_experts_start) when asked, or at the first output position."""
    p = req.msg.params
    if not wanted(p):
        return
    base = len(req.base_prompt)
    g = req.msg.resume_len
    if g > 0:
        pos = base + g - 1
    elif p.routed_experts_prompt:
        pos = min(p.routed_experts_start, base)
    else:
        pos = base
    s.routes_pos = s.routes_init = pos


def restart(s: Sample) -> None:
    """A staleness restart: the new attempt's rows, from where the first began."""
    if s.routes_init >= 0:
        s.routes_pos = s.routes_init
        s.routes_rows.clear()
        s.routes_prompt = 0


def take(req: NodeRequest, s: Sample, rows: Any, first: int, shape: tuple[int, int, int] | None) -> str | None:
    """Keep the rows of `rows` (positions first, first + 1, ...) the client
    still lacks and may have now; the error to fail the request with, if any."""
    if s.routes_pos < 0 or shape is None:
        return None
    arr = np.asarray(rows)
    if arr.ndim != 3 or arr.shape[1:] != shape[:2]:
        return f"routed experts of shape {list(arr.shape)}, expected [rows, {shape[0]}, {shape[1]}]"
    if first > s.routes_pos:
        return f"routed experts skip positions {s.routes_pos}..{first - 1}"
    limit = len(req.base_prompt) + len(s.tokens) - 1
    lo, hi = s.routes_pos, min(first + len(arr), limit)
    if hi <= lo:
        return None
    s.routes_rows.append(arr[lo - first : hi - first])
    s.routes_prompt += max(0, min(hi, len(req.base_prompt)) - lo)
    s.routes_pos = hi
    return None


def frame(s: Sample, shape: tuple[int, int, int]) -> tuple[P.RoutedExperts, bytes] | None:
    """The waiting rows as a chunk's RoutedExperts + frame (None: no rows)."""
    if not s.routes_rows:
        return None
    layers, top_k, num_experts = shape
    rows = s.routes_rows[0] if len(s.routes_rows) == 1 else np.concatenate(s.routes_rows, axis=0)
    dtype = F.routes_dtype(num_experts)
    meta = P.RoutedExperts(len(rows), layers, top_k, dtype, s.routes_prompt)
    s.routes_rows = []
    s.routes_prompt = 0
    return meta, F.pack_routes(rows, dtype)
