"""An engine node's heartbeats: the snapshot the loop publishes and the
thread that sends it to the head.

Threads and ownership:
- the loop thread builds `Heartbeat` snapshots (`refresh`, every tick and
  whenever control's busy state changes) and swaps `snapshot` (an atomic
  attribute assignment);
- the heartbeat thread owns its own events DEALER and only reads `snapshot`.
  So a loop stuck in a long step keeps heartbeating but its step counter
  stalls — which is how the head tells a hung engine from a dead one.

Hazards:
- the thread's socket identity is the events identity + b"/hb": the head's
  proof that these heartbeats are ours (router_node/router.py _engine_of);
- the heartbeat must show work before the loop enters a step that may hang
  (`work_appeared`): a stale `running=0` would hide the stall from the head;
- backend stats are best effort: a failing `stats()` reports kv_usage 0 and is
  logged once, never kills the loop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import structlog
import zmq

from bus import protocol as P
from bus.codec import Codec
from bus.endpoint import open_socket
from bus.roles import Plain
from bus.sockets import CurveKeys
from engine_node.control import ControlRunner
from engine_node.core import RequestCore

log = structlog.get_logger("engine_node.heartbeat")


class HeartbeatSource:
    """What a Heartbeat says, read on the loop thread."""

    def __init__(self, engine_id: str, incarnation: str, backend: Any, core: RequestCore) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.backend = backend
        self.core = core
        self.control: ControlRunner | None = None  # set once the node built it
        self._stats_failed = False

    def make(self) -> P.Heartbeat:
        control = self.control
        return P.Heartbeat(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            kv_usage=self._kv_usage(),
            loras=self.backend.loras(),
            busy=control.busy_name if control is not None else "",
            acked_seq=control.acked_seq if control is not None else 0,
            **self.core.counters(),
        )

    def _kv_usage(self) -> float:
        try:
            return float(self.backend.stats().get("kv_usage", 0.0))
        except Exception as e:  # stats are best effort; never kill the loop for them
            if not self._stats_failed:
                self._stats_failed = True
                log.warning("backend_stats_failed", engine_id=self.engine_id, error=f"{type(e).__name__}: {e}")
            return 0.0


class Heartbeats:
    def __init__(
        self,
        make: Callable[[], P.Heartbeat],
        ctx: zmq.Context,
        head_events: str,
        *,
        identity: bytes,
        curve: CurveKeys | None,
        plain: Plain | None = None,
        interval_s: float,
    ) -> None:
        self.make = make
        self.ctx = ctx
        self.head_events = head_events
        self.identity = identity + b"/hb"
        self.curve = curve
        self.plain = plain  # our PLAIN credential at the head (no CURVE there)
        self.interval_s = interval_s
        self.snapshot: P.Heartbeat = make()
        self.snapshot_at = 0.0  # monotonic time of the last tick's refresh
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def refresh(self, now: float | None = None) -> None:
        self.snapshot = self.make()
        if now is not None:
            self.snapshot_at = now

    def work_appeared(self) -> None:
        """The core submitted work: show it before the loop steps into it."""
        if self.snapshot.running == 0:
            self.snapshot = self.make()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        # Own socket: sockets are not thread-safe, and this one must keep
        # beating while the loop is inside a long step.
        sock = open_socket(
            self.ctx, zmq.DEALER, connect=self.head_events, hwm=16, curve=self.curve, identity=self.identity,
            plain=self.plain,
        )  # fmt: skip
        codec = Codec()
        try:
            while not self._stop.wait(self.interval_s):
                # Head gone or slow (Again): a lost heartbeat is what it is.
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(codec.encode(self.snapshot), zmq.NOBLOCK)
        finally:
            sock.close(linger=0)
