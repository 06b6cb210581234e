"""`client.update_weights(named, pause="abort" | "keep")`: pause → update →
resume, pipelined.

`async with client.paused(mode): await client.update_weights(...)` costs a
round trip per step, one after the other. Here the Pause is SENT first
(`ControlPort._control_sent`: it leaves before the update's first message),
the update follows at once, and the Resume right behind the update's last op
(a one-trip update: right behind its one op, before its ack). The head fans
them out in that order and every engine runs its control ops in arrival
order, one at a time (engine_node/control.py), so each engine pauses, updates,
then resumes, exactly as with the awaited sequence; the trainer awaits all the
replies once.

Hazards:
- the Resume ALWAYS goes out, also when the update fails (as `paused()` does);
- a one-trip op refused with nothing committed falls back to the two-round-trip
  update (trainer_bridge/transports/one_trip.py): its Resume already went out,
  so the Pause is sent again before the fallback, and resumed after it;
- a pause that failed on an engine does not stop the update there (the ops
  are already on their way): its error is raised after the update, which may
  have committed (read the version with `health()`).
Only "abort" and "keep" pipeline (a "wait" pause acks once its scope drains,
and later ops do not queue behind it on the engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from bus import protocol as P
from bus.errors import BadRequest

log = structlog.get_logger("trainer_bridge.pipelined")

PIPELINED_PAUSES = ("abort", "keep")


class Pipeline:
    """The pause and resume sent around one update, and their replies."""

    def __init__(self, client: Any, mode: str, timeout_s: float) -> None:
        if mode not in PIPELINED_PAUSES:
            raise BadRequest(f"update_weights(pause={mode!r}): choose {' or '.join(PIPELINED_PAUSES)}", field="pause")
        self.client = client
        self.mode = mode
        self.timeout_s = timeout_s
        self.replies: list[Coroutine[Any, Any, Any]] = []
        self.paused = False

    def pause(self) -> None:
        t = self.timeout_s
        self.replies.append(self.client._control_sent(P.Pause(mode=self.mode, timeout_s=t), timeout_s=t))
        self.paused = True

    def resume(self) -> None:
        """Send the Resume now, once per pause."""
        if self.paused:
            self.replies.append(self.client._control_sent(P.Resume(), timeout_s=self.timeout_s))
            self.paused = False

    async def settle(self) -> list[BaseException]:
        """Await every reply sent so far; their failures, in order."""
        replies, self.replies = self.replies, []
        outs = await asyncio.gather(*replies, return_exceptions=True)
        return [o for o in outs if isinstance(o, BaseException)]


async def update_paused(
    client: Any, mode: str, timeout_s: float, push: Callable[[Pipeline], Awaitable[dict[str, P.WeightsCommitted]]]
) -> dict[str, P.WeightsCommitted]:
    """Pause, `push(pipeline)` (the update), resume: sent back to back, awaited once."""
    pipe = Pipeline(client, mode, timeout_s)
    pipe.pause()
    try:
        res = await push(pipe)
    except BaseException as e:
        pipe.resume()  # always
        for f in await pipe.settle():
            log.warning("pipelined_pause_failed", error=str(f)[:300], update_error=str(e)[:300])
        raise
    pipe.resume()
    failed = await pipe.settle()
    if failed:
        raise failed[0]
    return res
