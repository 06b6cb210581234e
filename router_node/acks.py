"""Tallying the acks of one control command (bus/control_bus.py
`PendingCommand`) into what the head answers and decides. Pure functions.

Hazard: an engine's error text can echo what it was sent (a tensor name, a
path): what reaches the client carries at most bus.errors.MAX_ECHO of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bus import protocol as P
from bus.control_bus import PendingCommand
from bus.errors import ErrorCode, truncate


def failure_of(ack: P.Ack) -> P.EngineFailure:
    f = ack.failure
    if f is None:
        return P.EngineFailure(code=ErrorCode.INTERNAL.value, message="failed")
    return P.EngineFailure(code=f.code, message=truncate(f.message), field=f.field)


@dataclasses.dataclass(frozen=True, slots=True)
class Tally:
    results: dict[str, Any]  # engine -> its typed result (P.Done when it had none)
    errors: dict[str, P.EngineFailure]
    missing: list[str]  # targets that did not ack in time (or were known dead)

    def reply(self, request_id: str) -> P.ControlReply:
        return P.ControlReply(request_id=request_id, results=self.results, errors=self.errors, missing=self.missing)


def tally(pc: PendingCommand) -> Tally:
    return Tally(
        results={eid: a.result or P.Done() for eid, a in pc.acks.items() if a.ok},
        errors={eid: failure_of(a) for eid, a in pc.acks.items() if not a.ok},
        missing=pc.missing,
    )


def refused_by_all(pc: PendingCommand, refused_codes: frozenset[str] | set[str]) -> bool:
    """Every engine that answered refused the op as one it cannot take (none took it)."""
    refused = [a for a in pc.acks.values() if a.failure is not None and a.failure.code in refused_codes]
    return bool(refused) and len(refused) == len(pc.acks)


def votes(pc: PendingCommand) -> dict[str, Any]:
    """The prepare votes (results) of the engines that acked ok."""
    return {eid: a.result or P.Done() for eid, a in pc.acks.items() if a.ok}


def landed(results: dict[str, Any]) -> dict[str, int]:
    """engine -> the weight version a commit left it on (engines that committed)."""
    return {eid: int(r.weight_version) for eid, r in results.items() if isinstance(r, P.WeightsCommitted)}
