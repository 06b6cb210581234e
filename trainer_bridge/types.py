"""Results handed to the trainer."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "cancelled"
    token_versions: list[int]  # weight version that produced each token
    engine_id: str = ""  # the engine that finished it
    text: str | None = None  # decoded token_ids, when the client has a tokenizer
    # Times the staleness bound (max_staleness) dropped the sample's tokens and
    # regenerated it on newer weights; token_ids are the last attempt's only.
    restarts: int = 0

    @property
    def stop_reason(self) -> str:
        return self.finish_reason


@dataclasses.dataclass
class GenerationResult:
    request_id: str
    samples: list[SampleOutput]
    num_prompt_tokens: int = 0

    # Convenience for the common num_samples == 1 case.
    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def logprobs(self) -> list[float] | None:
        return self.samples[0].logprobs

    @property
    def finish_reason(self) -> str:
        return self.samples[0].finish_reason

    @property
    def token_versions(self) -> list[int]:
        return self.samples[0].token_versions

    @property
    def engine_id(self) -> str:
        return self.samples[0].engine_id

    @property
    def text(self) -> str | None:
        return self.samples[0].text


@dataclasses.dataclass
class StreamChunk:
    request_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float] | None
    weight_version: int
    finish_reason: str | None
    emitted_at: float  # engine clock (time.time()) when produced
    received_at: float  # client clock (time.time()) when received
    engine_id: str = ""  # on the final chunk
    num_prompt_tokens: int = 0  # on the final chunk
    # Staleness restarts of this sample so far (max_staleness). When it is
    # higher than on the sample's previous chunk, discard every token received
    # for the sample before this chunk: this chunk's tokens begin the new
    # attempt (a restart chunk may carry no token). The final chunk has the total.
    restarts: int = 0


# Tinker-style sampling results: stop reason is only ever "stop" or "length".
@dataclasses.dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str


@dataclasses.dataclass
class SampleResponse:
    sequences: list[SampledSequence]
