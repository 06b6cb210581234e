"""The client's requests in flight, kept under the head's per-client cap.

The head refuses a client's request past its `--max-inflight-per-client`
(LimitExceeded, field max_inflight_per_client), which bounds what one client
makes the head hold. A caller should not have to know that number: as vLLM's
`LLM.generate` takes any batch, `Client.generate` of 10,000 prompts must
complete. So every generate request (generate, stream, sample) takes a slot
here before its Generate is sent and gives it back when its stream closes; a
request waits for a slot while the client is at the cap.

The cap is what the head says in each `HeadPong` (every ping interval);
until the first pong a conservative `UNKNOWN_CAP`. A refusal all the same
(another client of the same head identity, cancelled requests whose finals
are still on their way, a head restarted with a lower cap) is not the
caller's error: the request waits for the next slot and is sent again
(`AsyncClient._chunks`).

Deadline: a wait for a slot ends with RequestTimeout naming `timeout_s` when
no slot came free for a whole request timeout (every request in flight has
that deadline, so a slot frees within it unless something is wrong).

Ownership: the client's asyncio loop (no locking).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Iterable
from typing import Any

from bus.errors import RequestTimeout

UNKNOWN_CAP = 256  # before the first pong (0.5 s) says the head's (its default: 4096)
# After a refusal at the head's cap: how long before the request queues again.
REFUSED_RETRY_S = 0.05


class InflightGate:
    """Slots up to `cap`, granted first come first served (one waiter woken
    per freed slot: a batch of 10,000 waits without a stampede per release)."""

    def __init__(self) -> None:
        self.cap = UNKNOWN_CAP
        self.learned = False  # a head said its cap
        self.inflight = 0
        self.waits = 0  # requests that waited for a slot (for stats and tests)
        self.refusals = 0  # LimitExceeded refusals the client absorbed
        self._waiters: deque[asyncio.Future] = deque()
        self._freed_at = time.monotonic()  # the last release: a wait's progress

    def learn(self, cap: int) -> None:
        """The head's cap (a HeadPong's max_inflight_per_client; 0: not said)."""
        if cap > 0:
            self.learned = True
            if cap != self.cap:
                self.cap = cap
                self._grant()

    def _grant(self) -> None:
        while self._waiters and self.inflight < self.cap:
            fut = self._waiters.popleft()
            if not fut.done():
                self.inflight += 1
                fut.set_result(None)

    async def acquire(self, timeout_s: float, request_id: str) -> None:
        """A slot for one request (waits while the client is at the cap)."""
        if self.inflight < self.cap and not self._waiters:
            self.inflight += 1
            return
        self.waits += 1
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout_s)
                    return
                except asyncio.TimeoutError:
                    if time.monotonic() - self._freed_at > timeout_s:
                        raise RequestTimeout(
                            f"no request of this client finished within timeout_s={timeout_s} while it waited "
                            f"for one of the head's {self.cap} in-flight slots (max_inflight_per_client)",
                            request_id=request_id,
                            field="timeout_s",
                        ) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # granted as it gave up: the slot goes to the next
            else:
                fut.cancel()
            raise

    def release(self) -> None:
        self.inflight -= 1
        self._freed_at = time.monotonic()
        self._grant()

    async def refused(self) -> None:
        """The head refused a request of ours at its cap (its slot already
        released): the head counts more of ours than we do (requests let go
        of whose finals are on their way) or its cap is lower than we
        thought; stay at what it holds until its next pong says the cap."""
        self.refusals += 1
        self.cap = max(1, min(self.cap, self.inflight))
        await asyncio.sleep(REFUSED_RETRY_S)


async def gather_or_cancel(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """Every result in order; at the first failure the others are cancelled
    (a sent request's stream sends its Cancel: nothing runs on behind a
    failed batch) and that failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
