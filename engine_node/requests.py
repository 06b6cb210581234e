"""Request bookkeeping of the engine node (owned by the node's loop thread).

A client request (Generate) becomes one `NodeRequest` with `num_samples`
`Sample`s. A sample is what a backend runs as one sequence. The node — not the
backend — remembers every token it streamed, so a sample can be parked (pause
abort, sleep) and re-submitted later as prompt + tokens so far, and the client
sees one unbroken stream.
"""

from __future__ import annotations

import dataclasses
import enum
from array import array
from typing import Any

from bus.frames import top_k_of
from bus.protocol import Generate


class SampleState(enum.Enum):
    PENDING = "pending"  # not in the backend: queued, held by the gate, or parked
    RUNNING = "running"  # in the backend, scheduled
    FROZEN = "frozen"  # in the backend, keep-mode paused (state kept)
    DONE = "done"


class IllegalTransition(RuntimeError):
    """A sample state change the lifecycle does not allow: a bug in the core
    (e.g. a second final chunk for one sample). Raised, never ignored."""


_S = SampleState
# The only sample state changes there are. DONE is terminal: that is what makes
# "exactly one final chunk per sample" a checked property rather than a hope.
ALLOWED: frozenset[tuple[SampleState, SampleState]] = frozenset(
    {
        (_S.PENDING, _S.RUNNING),  # submitted to the backend
        (_S.PENDING, _S.DONE),  # cancelled / failed / timed out while held or parked
        (_S.RUNNING, _S.PENDING),  # parked (pause abort, sleep) or backend-side abort
        (_S.RUNNING, _S.FROZEN),  # keep-mode pause
        (_S.RUNNING, _S.DONE),  # finished, cancelled or failed
        (_S.FROZEN, _S.RUNNING),  # resume (thaw)
        (_S.FROZEN, _S.PENDING),  # parked while frozen (sleep, abort pause on top of keep)
        (_S.FROZEN, _S.DONE),  # cancelled / failed while frozen
    }
)


def transition(s: Sample, new: SampleState) -> None:
    """THE way a sample changes state (the core never assigns `state` itself)."""
    if (s.state, new) not in ALLOWED:
        raise IllegalTransition(f"sample {s.index}: {s.state.value} -> {new.value} is not allowed")
    s.state = new


def _ids() -> array[int]:
    return array("i")


def _floats() -> array[float]:
    return array("f")


@dataclasses.dataclass(slots=True, eq=False)
class Sample:
    """Output so far as packed arrays (int32 ids, float32 logprobs: what the
    wire carries), 4 bytes a token each instead of a list's ~36: a request
    holds its tokens for park / re-submission, and the admission budget
    (--max-request-tokens) bounds how many; the arrays keep that figure small."""

    index: int  # absolute sample index (Generate.sample_offset + i)
    tokens: array[int]  # output so far, including the client's resume prefix
    logprobs: array[float]
    sent: int  # tokens already sent to the client
    state: SampleState = SampleState.PENDING
    seq_id: str | None = None  # current backend sequence id
    submissions: int = 0  # how many times it entered the backend
    # Non-streamed requests: [token offset, weight version] at each change.
    version_marks: list[list[int]] = dataclasses.field(default_factory=list)
    # -- issue 10
    top_ids: array[int] = dataclasses.field(default_factory=_ids)  # k per token, row-major
    top_logprobs: array[float] = dataclasses.field(default_factory=_floats)
    prompt_logprobs: Any = None  # backend.PromptLogprobsOut of the base prompt, once computed
    matcher: Any = None  # detokenize.StopMatcher, for requests with stop strings
    stop_reason: str | None = None  # the stop string that ended it
    # Sampling: the sequence seed, fixed at the first submission and kept across
    # every park / re-submission (request seed + index, or one drawn from the
    # node's stream); the backend's generator state at the last park (torch:
    # a re-submitted sample continues its random stream exactly), None if none.
    seed: int | None = None
    rng_state: object = None
    # Staleness bound: weight version of the oldest token the node generated
    # for this attempt (None: none yet), and how many attempts were dropped.
    first_version: int | None = None
    restarts: int = 0
    # -- issue 37 (R3), engine_node/routes.py: the next sequence position whose
    # routed experts the client lacks (-1: the request asked for none), where an
    # attempt starts, and the rows waiting for the next chunk (+ how many of
    # them are prompt positions).
    routes_pos: int = -1
    routes_init: int = -1
    routes_rows: list[Any] = dataclasses.field(default_factory=list)
    routes_prompt: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class NodeRequest:
    client: bytes  # routing id of the peer that sent it (router or direct client)
    msg: Generate
    base_prompt: list[int]  # the prompt without any resumed output
    samples: list[Sample]
    deadline: float | None
    received_at: float
    open_samples: int = 0

    @property
    def key(self) -> tuple[bytes, str]:
        return (self.client, self.msg.request_id)

    @property
    def lora(self) -> str | None:
        return self.msg.lora

    @property
    def was_started(self) -> bool:
        return any(s.submissions for s in self.samples)


def new_request(client: bytes, msg: Generate, prompt: list[int], now: float) -> NodeRequest:
    resumed = prompt[len(prompt) - msg.resume_len :] if msg.resume_len else []
    base = prompt[: len(prompt) - msg.resume_len] if msg.resume_len else prompt
    k = top_k_of(msg.params.logprobs) * len(resumed)  # placeholders, never sent
    samples = [
        Sample(
            index=msg.sample_offset + i,
            tokens=array("i", resumed),
            logprobs=array("f", bytes(4 * len(resumed))),
            sent=len(resumed),
            top_ids=array("i", bytes(4 * k)),
            top_logprobs=array("f", bytes(4 * k)),
        )
        for i in range(msg.num_samples)
    ]
    deadline = now + msg.timeout_s if msg.timeout_s else None
    return NodeRequest(
        client=client,
        msg=msg,
        base_prompt=base,
        samples=samples,
        deadline=deadline,
        received_at=now,
        open_samples=len(samples),
    )
