"""Results handed to the trainer."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

# The typed control results and query answers the client API returns
# (bus/results.py, bus/views.py), importable from here for annotations.
from bus.results import ConfigResult as ConfigResult
from bus.results import EngineFailure as EngineFailure
from bus.results import IsPausedResult as IsPausedResult
from bus.results import LoraResult as LoraResult
from bus.results import PauseResult as PauseResult
from bus.results import ResetPrefixCacheResult as ResetPrefixCacheResult
from bus.results import Result as Result
from bus.results import ResumeResult as ResumeResult
from bus.results import SleepResult as SleepResult
from bus.results import StatsResult as StatsResult
from bus.results import WakeUpResult as WakeUpResult
from bus.results import WeightsCommitted as WeightsCommitted
from bus.results import WeightsPrepared as WeightsPrepared
from bus.views import EngineView as EngineView
from bus.views import HealthView as HealthView


@dataclasses.dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "cancelled"
    token_versions: list[int]  # weight version that produced each token
    engine_id: str = ""  # the engine that finished it
    text: str | None = None  # decoded token_ids, when the client has a tokenizer
    # -- issue 10 (None unless asked for)
    top_ids: list[list[int]] | None = None  # logprobs=k: the k best token ids per token, best first
    top_logprobs: list[list[float]] | None = None  # … and their logprobs (the chosen one is `logprobs`)
    prompt_logprobs: list[float | None] | None = None  # per prompt token (None for the first)
    prompt_top_ids: list[list[int]] | None = None  # prompt_logprobs=k: k best per prompt position
    prompt_top_logprobs: list[list[float]] | None = None
    stop_str: str | None = None  # the stop string that ended it (vLLM's stop_reason)
    # Times the staleness bound (max_staleness) dropped the sample's tokens and
    # regenerated it on newer weights; token_ids are the last attempt's only.
    restarts: int = 0
    # -- issue 37, MoE routing replay (params return_routed_experts /
    # routed_experts_prompt): uint8/16/32 [rows, moe_layers, top_k]. Row i of
    # `routed_experts` is token_ids[i]'s routing as the model's input, so it has
    # len(token_ids) - 1 rows (the last token was never an input); with
    # `prompt_routed_experts` (prompt positions from routed_experts_start on)
    # before it, it is the whole sequence's routing, as vLLM / SGLang return it.
    routed_experts: Any = None
    prompt_routed_experts: Any = None

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
    def prompt_logprobs(self) -> list[float | None] | None:
        return self.samples[0].prompt_logprobs

    @property
    def text(self) -> str | None:
        return self.samples[0].text


class StreamChunk(msgspec.Struct, gc=False):
    """One chunk of a stream. A msgspec Struct, not a dataclass: the client
    builds one per chunk received (tens of thousands a second), and a Struct's
    C constructor costs a fraction of a 16-field dataclass __init__. gc=False:
    it holds only lists/strings/numbers (no reference cycles)."""

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
    top_ids: list[list[int]] | None = None  # logprobs=k
    top_logprobs: list[list[float]] | None = None
    prompt: Any = None  # bus.frames.PromptLogprobs, on the final chunk (prompt_logprobs set)
    stop_str: str | None = None  # on the final chunk: the stop string that ended the sample
    text: str | None = None  # on the final chunk of a request with stop strings: the output text
    # Staleness restarts of this sample so far (max_staleness). When it is
    # higher than on the sample's previous chunk, discard every token received
    # for the sample before this chunk: this chunk's tokens begin the new
    # attempt (a restart chunk may carry no token). The final chunk has the total.
    restarts: int = 0
    # -- issue 37: this chunk's routed-expert rows (numpy [rows, layers, top_k]),
    # the prompt's (on the sample's first chunk) apart from the output's.
    routed_experts: Any = None
    prompt_routed_experts: Any = None


# Tinker-style sampling results: stop reason is only ever "stop" or "length".
@dataclasses.dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: str


@dataclasses.dataclass
class SampleResponse:
    sequences: list[SampledSequence]
