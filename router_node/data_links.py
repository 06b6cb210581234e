"""The head's watch on its data connection to each engine (a libzmq monitor
of the DEALER that carries requests there and chunks back).

- DISCONNECTED: the connection dropped (a network blip, a proxy cut, the
  engine died). zmq does not resend across a reconnect: chunks in flight on
  the old connection are gone, and the engine ends what it could not send
  (engine_node/node.py `_data_peer_gone`). So every leg there moves at once
  (failover from the tokens the head relayed: the client's stream stays
  whole); the engine's health is still its heartbeats' to judge.
- HANDSHAKE_FAILED (AUTH / PROTOCOL): the engine's socket refused the head (a
  restarted engine on the same address refuses the head's secret of its
  previous life). libzmq then ends the pipe for good: the engine is
  unreachable (SILENT) until it registers anew (forwarding.py `_unreachable`
  does the same when a send finds no pipe).
- NO_DETAIL (a handshake the engine closed without a reason) is NOT judged
  here, unlike the client and the engine's link (bus/handshake_refusal.py):
  a restarted engine's refusal is its ZAP handler's (AUTH, stated), and its
  Register replaces the entry anyway; reading a run of network resets as a
  refusal would take a live engine out until forget_after_s.

Ownership: the head's loop thread (the monitor socket is polled with the
others; `drain` is what the loop calls for a readable socket).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from router_node.registry import EngineEntry

log = structlog.get_logger("router_node")

_REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
# What the engine DEALER's monitor reports (attached before its connect: router_node/registration.py).
WATCHED_EVENTS = zmq.EVENT_DISCONNECTED | _REFUSED[0] | _REFUSED[1]


class DataLinkWatch:
    def __init__(
        self,
        e: EngineEntry,
        *,
        dropped: Callable[[EngineEntry, str], None],
        refused: Callable[[EngineEntry, str], None],
    ) -> None:
        self.e = e
        # Attached before the connect when the registrar made it: a refusal's one event is never missed.
        self.sock = e.link_monitor if e.link_monitor is not None else e.sock.get_monitor_socket(WATCHED_EVENTS)
        self._on: dict[int, Callable[[Any], None]] = {
            zmq.EVENT_DISCONNECTED: lambda ev: dropped(
                e, f"the head's data connection to {e.engine_id} dropped: what was in flight there may be lost"
            ),
            **{
                kind: lambda ev: refused(
                    e,
                    f"its data socket refused the head at the handshake (status {ev['value']}): a restarted "
                    "engine on the same address; it serves again once it registers anew",
                )
                for kind in _REFUSED
            },
        }

    def drain(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            handler = self._on.get(event["event"])
            if handler is not None:
                handler(event)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # its socket is closed already: the monitor ended with it
            self.e.sock.disable_monitor()
        self.sock.close(linger=0)
