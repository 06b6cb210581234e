"""Telling a refused handshake from a dropped one, on a connecting socket's
libzmq monitor: one rule for every side that connects (the client,
trainer_bridge/connection.py; the engine's link to the head,
engine_node/head_link.py).

Hazard: a peer that refuses our mechanism (no keys against CURVE, no token
against PLAIN) closes the connection; when it closes before this side read
its greeting, libzmq reports HANDSHAKE_FAILED_NO_DETAIL, not PROTOCOL (a race;
under load, often). One such event may be a peer dying mid-handshake; several
in a row, with no successful handshake between, are the refusal. Waiting for
the connect deadline instead turned a typed refusal into a timeout (CI, and
two workers of the suite at once).
"""

from __future__ import annotations

from typing import Any

import zmq

# Handshakes ended without a reason, in a row, that count as a refusal.
SILENT_REFUSALS = 3

# What a monitor must subscribe to for `judge`.
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


class RefusalJudge:
    """Feed it every monitor event; it returns the refusal (an AUTH or PROTOCOL
    event; a run of silent ones as PROTOCOL with `silent=True`), else None."""

    def __init__(self, silent_refusals: int = SILENT_REFUSALS) -> None:
        self.silent_refusals = silent_refusals
        self.silent_in_a_row = 0

    def judge(self, event: dict[str, Any]) -> dict[str, Any] | None:
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.silent_in_a_row = 0
            return None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self.silent_in_a_row += 1
            if self.silent_in_a_row < self.silent_refusals:
                return None
            return dict(event, event=zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, silent=True)
        if kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            return event
        return None


def silent_words(n: int = SILENT_REFUSALS) -> str:
    """How a refusal judged from silence is named in messages."""
    return f"it closed {n} handshakes in a row without a reason"
