"""Error codes on the wire and the exceptions raised from them.

Names say what happened: the request was bad, the engine died, no engine is
healthy, a deadline passed (and which knob sets it), the peer broke the
protocol, or we closed the socket ourselves.
"""

from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"  # a field failed validation: `field` names it
    PROTOCOL = "protocol"  # undecodable frame, unknown kind, version mismatch
    ENGINE_DEAD = "engine_dead"  # the engine serving the request died
    NO_HEALTHY_ENGINE = "no_healthy_engine"
    TIMEOUT = "timeout"  # a deadline passed; the message names the knob
    INTERNAL = "internal"  # a bug on our side; the node keeps serving
    UNSUPPORTED = "unsupported"  # the backend or transport cannot do this op


class RolloutBusError(Exception):
    """Base of every error rollout-bus raises."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, request_id: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.field = field

    def __str__(self) -> str:
        extra = []
        if self.request_id:
            extra.append(f"request_id={self.request_id}")
        if self.field:
            extra.append(f"field={self.field}")
        return self.message + (f" ({', '.join(extra)})" if extra else "")


class BadRequest(RolloutBusError):
    code = ErrorCode.BAD_REQUEST


class ProtocolError(RolloutBusError):
    code = ErrorCode.PROTOCOL


class EngineDead(RolloutBusError):
    code = ErrorCode.ENGINE_DEAD


class NoHealthyEngine(RolloutBusError):
    code = ErrorCode.NO_HEALTHY_ENGINE


class RequestTimeout(RolloutBusError):
    code = ErrorCode.TIMEOUT


class Unsupported(RolloutBusError):
    code = ErrorCode.UNSUPPORTED


class InternalError(RolloutBusError):
    code = ErrorCode.INTERNAL


class ClosedByUs(RolloutBusError):
    """The client (or node) was closed locally while the call was waiting."""


class ControlError(RolloutBusError):
    """A control op failed or timed out on some engines; `results`/`errors`/`missing` say which."""

    def __init__(self, message: str, *, results=None, errors=None, missing=None, request_id=None):
        super().__init__(message, request_id=request_id)
        self.results = results or {}
        self.errors = errors or {}
        self.missing = missing or []


EXCEPTION_OF: dict[str, type[RolloutBusError]] = {
    ErrorCode.BAD_REQUEST.value: BadRequest,
    ErrorCode.PROTOCOL.value: ProtocolError,
    ErrorCode.ENGINE_DEAD.value: EngineDead,
    ErrorCode.NO_HEALTHY_ENGINE.value: NoHealthyEngine,
    ErrorCode.TIMEOUT.value: RequestTimeout,
    ErrorCode.UNSUPPORTED.value: Unsupported,
    ErrorCode.INTERNAL.value: InternalError,
}


def exception_from_wire(code: str, message: str, request_id: str | None, field: str | None) -> RolloutBusError:
    cls = EXCEPTION_OF.get(code, InternalError)
    return cls(message, request_id=request_id, field=field)
