"""What a trainer imports: the rollout-bus client and its result types."""

from bus.errors import (
    AuthRefused,
    BadRequest,
    ClosedByUs,
    ControlError,
    EngineDead,
    HeadUnavailable,
    NoHealthyEngine,
    ProtocolError,
    RequestTimeout,
    RolloutBusError,
    StaleUpdate,
    Unauthorized,
    UpdateInProgress,
)
from bus.protocol import SamplingParams
from trainer_bridge.client import AsyncClient, Client
from trainer_bridge.sampling import UnsupportedParameter
from trainer_bridge.session import AsyncSession, Session
from trainer_bridge.types import GenerationResult, SampledSequence, SampleOutput, SampleResponse, StreamChunk

__all__ = [
    "AsyncClient",
    "Client",
    "Session",
    "AsyncSession",
    "SamplingParams",
    "GenerationResult",
    "SampleOutput",
    "StreamChunk",
    "SampleResponse",
    "SampledSequence",
    "RolloutBusError",
    "AuthRefused",
    "BadRequest",
    "ClosedByUs",
    "ControlError",
    "EngineDead",
    "HeadUnavailable",
    "NoHealthyEngine",
    "ProtocolError",
    "RequestTimeout",
    "StaleUpdate",
    "UpdateInProgress",
    "Unauthorized",
    "UnsupportedParameter",
]
