"""The control bus, head side: publish a Command, gather one Ack per target
engine under a deadline, republish to engines that have not acked.

PUB/SUB drops messages to peers that are not connected yet (the "slow joiner"
problem) and on HWM overflow. So a command is republished every
`republish_s` until each target acked or the deadline passed; engines dedupe by
`seq` and answer a republication from their ack cache, never re-running it.
An engine only counts as joined once it has acked a publication (the head
pings every new registrant), so no command is sent into the void.

Ownership: the router loop thread owns this object and the PUB socket.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from bus import protocol as P
from bus.codec import Codec
from bus.errors import EncodeFailed


@dataclasses.dataclass(eq=False)
class PendingCommand:
    seq: int
    op: Any
    targets: set[str]
    deadline: float
    on_done: Callable[[PendingCommand], None]
    acks: dict[str, P.Ack] = dataclasses.field(default_factory=dict)
    gone: set[str] = dataclasses.field(default_factory=set)  # targets known dead: not waited on
    published_at: float = 0.0
    done: bool = False

    @property
    def missing(self) -> list[str]:
        return sorted(self.targets - set(self.acks))


class ControlBus:
    def __init__(self, pub: zmq.Socket, codec: Codec, *, republish_s: float = 0.25) -> None:
        self.pub = pub
        self.codec = codec
        self.republish_s = republish_s
        self.pending: dict[int, PendingCommand] = {}
        self._seq = itertools.count(int(time.time() * 1000) % 1_000_000_000)

    def publish(
        self,
        op: Any,
        targets: list[str],
        timeout_s: float,
        on_done: Callable[[PendingCommand], None],
        *,
        gone: Iterable[str] = (),
    ) -> PendingCommand:
        """`gone`: targets known dead — reported missing at once, not waited on."""
        now = time.monotonic()
        pc = PendingCommand(next(self._seq), op, set(targets), now + timeout_s, on_done, gone=set(gone))
        self.pending[pc.seq] = pc
        if not pc.targets - pc.gone:
            self._complete(pc)
            return pc
        self._send(pc, now)
        return pc

    def _send(self, pc: PendingCommand, now: float) -> None:
        waiting = sorted(pc.targets - set(pc.acks) - pc.gone)
        cmd = P.Command(seq=pc.seq, op=pc.op, targets=waiting)
        try:
            frames = self.codec.encode(cmd)
        except EncodeFailed:
            # Never a crash of the head (here inside its tick): an op that
            # cannot be written ends now, every target missing.
            self._complete(pc)
            return
        if len(waiting) == 1:
            self.pub.send_multipart([waiting[0].encode() + b"\x00", *frames])
        else:
            self.pub.send_multipart([b"*\x00", *frames])
        pc.published_at = now

    def on_ack(self, ack: P.Ack) -> PendingCommand | None:
        pc = self.pending.get(ack.seq)
        if pc is None or ack.engine_id not in pc.targets or ack.engine_id in pc.acks:
            return None
        pc.acks[ack.engine_id] = ack
        if not pc.targets - set(pc.acks) - pc.gone:
            self._complete(pc)
        return pc

    def engine_gone(self, engine_id: str) -> None:
        """A target died: report it missing now instead of at the deadline."""
        for pc in list(self.pending.values()):
            if engine_id in pc.targets and engine_id not in pc.acks:
                pc.gone.add(engine_id)
                if not pc.targets - set(pc.acks) - pc.gone:
                    self._complete(pc)

    def tick(self, now: float) -> None:
        for pc in list(self.pending.values()):
            if now >= pc.deadline:
                self._complete(pc)
            elif now - pc.published_at >= self.republish_s:
                self._send(pc, now)

    def _complete(self, pc: PendingCommand) -> None:
        if pc.done:
            return
        pc.done = True
        self.pending.pop(pc.seq, None)
        pc.on_done(pc)
