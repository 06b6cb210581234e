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
    BACKEND_TIMEOUT = "backend_timeout"  # a backend op passed its deadline; the message names the knob
    BACKEND_REFUSED = "backend_refused"  # the backend refused the op or its input: `field` names it
    UPDATE_IN_PROGRESS = "update_in_progress"  # another client's weight update holds the cluster
    STALE_UPDATE = "stale_update"  # an op names a weight update that is not the current one
    LIMIT_EXCEEDED = "limit_exceeded"  # a per-client cap was hit: `field` names its knob
    UNAUTHORIZED = "unauthorized"  # no (or a wrong) join token, or a CURVE key taken off the allow-list
    HEAD_UNAVAILABLE = "head_unavailable"  # the client lost (or never reached) the head: the message names its address


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


class LimitExceeded(RolloutBusError):
    """A per-client cap of the head (in-flight requests, open sessions) was
    reached; `field` names the head's knob that sets it. Retry later."""

    code = ErrorCode.LIMIT_EXCEEDED


class NoHealthyEngine(RolloutBusError):
    code = ErrorCode.NO_HEALTHY_ENGINE


class RequestTimeout(RolloutBusError):
    code = ErrorCode.TIMEOUT


class Unsupported(RolloutBusError):
    code = ErrorCode.UNSUPPORTED


class InternalError(RolloutBusError):
    code = ErrorCode.INTERNAL


class EncodeFailed(InternalError):
    """A message could not be encoded (a value past what msgpack holds): a bug
    of ours the decoder's bounds should have made impossible. It ends the one
    request (bus/endpoint.py), never the process."""


# Error texts and log lines echo peer-supplied values (ids, names, messages):
# each echo is cut to this many characters, so a 32 MB field never becomes a
# 32 MB reply or log line.
MAX_ECHO = 1024


def truncate(text: str, limit: int = MAX_ECHO) -> str:
    """`text` cut to at most `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    keep = limit - 32  # room for the tail below (up to 10**15 cut characters)
    return text[:keep] + f"… [{len(text) - keep} more chars]"


class BackendTimeout(RequestTimeout):
    """A backend operation (weights, sleep, LoRA, an RPC into the engine) did
    not finish within its deadline; the message names the option that sets it."""

    code = ErrorCode.BACKEND_TIMEOUT


class BackendRefused(BadRequest):
    """The backend refused an operation or its input (a tensor name, a
    transport, a sequence it cannot run); `field` names what, when known."""

    code = ErrorCode.BACKEND_REFUSED


class UpdateInProgress(RolloutBusError):
    """A weight update was begun while another one holds the cluster (one at a
    time). The message names the holder: its update id, its client and since
    when. Retry after it ends (its commit or abort, its client's lease, or the
    head's `weight_txn_timeout_s`)."""

    code = ErrorCode.UPDATE_IN_PROGRESS


class StaleUpdate(BadRequest):
    """A weight-update op (prepare, commit, abort, a GPU part) names an update
    that is not the cluster's current one (it ended, or never began): refused,
    nothing changed. `field` is `update_id`."""

    code = ErrorCode.STALE_UPDATE


class AuthRefused(ProtocolError):
    """A secured peer's ZAP handler refused our CURVE key (it is not on that
    socket's allow-list); raised locally, never sent. `field`: the option that
    picks the key (`client_key`)."""


class Unauthorized(RolloutBusError):
    """The head refused a peer that is not (or no longer) part of the cluster:
    an engine's Register or a client's state-changing control op without the
    cluster's join token (`field` "token"), or frames of a CURVE key removed
    from the allow-list (`field` "client_key")."""

    code = ErrorCode.UNAUTHORIZED


class HeadUnavailable(RolloutBusError):
    """The client could not reach the head, or lost it: nothing came from the
    head at `address` for `head_timeout_s` (dead, frozen, restarting), or it was
    not reached within `connect_timeout_s`. Raised locally by the client, for
    every request open at that moment; `field` names the knob. The client
    reconnects on its own: a later request works once the head is back."""

    code = ErrorCode.HEAD_UNAVAILABLE

    def __init__(self, message: str, *, address: str = "", request_id: str | None = None, field: str | None = None):
        super().__init__(message, request_id=request_id, field=field)
        self.address = address


class ClosedByUs(RolloutBusError):
    """The client (or node) was closed locally while the call was waiting."""


class ControlError(RolloutBusError):
    """A control op failed or timed out on some engines.

    `results`: {engine id: result} of the engines where it worked; `errors`:
    {engine id: EngineFailure} with `.code`, `.message`, `.field` (the wire
    code, see ErrorCode); `missing`: engines that did not ack in time.
    `exception(engine_id)` is the typed error of one failed engine."""

    def __init__(self, message: str, *, results=None, errors=None, missing=None, request_id=None):
        super().__init__(message, request_id=request_id)
        self.results = results or {}
        self.errors = errors or {}
        self.missing = missing or []

    def exception(self, engine_id: str) -> RolloutBusError:
        f = self.errors[engine_id]
        return exception_from_wire(f.code, f.message, self.request_id, f.field)


EXCEPTION_OF: dict[str, type[RolloutBusError]] = {
    ErrorCode.BAD_REQUEST.value: BadRequest,
    ErrorCode.PROTOCOL.value: ProtocolError,
    ErrorCode.ENGINE_DEAD.value: EngineDead,
    ErrorCode.NO_HEALTHY_ENGINE.value: NoHealthyEngine,
    ErrorCode.TIMEOUT.value: RequestTimeout,
    ErrorCode.UNSUPPORTED.value: Unsupported,
    ErrorCode.INTERNAL.value: InternalError,
    ErrorCode.BACKEND_TIMEOUT.value: BackendTimeout,
    ErrorCode.BACKEND_REFUSED.value: BackendRefused,
    ErrorCode.UPDATE_IN_PROGRESS.value: UpdateInProgress,
    ErrorCode.STALE_UPDATE.value: StaleUpdate,
    ErrorCode.LIMIT_EXCEEDED.value: LimitExceeded,
    ErrorCode.UNAUTHORIZED.value: Unauthorized,
    ErrorCode.HEAD_UNAVAILABLE.value: HeadUnavailable,
}


def exception_from_wire(code: str, message: str, request_id: str | None, field: str | None) -> RolloutBusError:
    cls = EXCEPTION_OF.get(code, InternalError)
    return cls(message, request_id=request_id, field=field)
