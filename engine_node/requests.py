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

from bus.protocol import Generate


class SampleState(enum.Enum):
    PENDING = "pending"  # not in the backend: queued, held by the gate, or parked
    RUNNING = "running"  # in the backend, scheduled
    FROZEN = "frozen"  # in the backend, keep-mode paused (state kept)
    DONE = "done"


@dataclasses.dataclass(slots=True, eq=False)
class Sample:
    index: int  # absolute sample index (Generate.sample_offset + i)
    tokens: list[int]  # output so far, including the client's resume prefix
    logprobs: list[float]
    sent: int  # tokens already sent to the client
    state: SampleState = SampleState.PENDING
    seq_id: str | None = None  # current backend sequence id
    submissions: int = 0  # how many times it entered the backend
    # Non-streamed requests: [token offset, weight version] at each change.
    version_marks: list[list[int]] = dataclasses.field(default_factory=list)


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
    samples = [
        Sample(index=msg.sample_offset + i, tokens=list(resumed), logprobs=[0.0] * len(resumed), sent=len(resumed))
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
