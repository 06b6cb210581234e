"""Refusals logged at a bounded rate: one line per interval per kind.

A peer that sends 1M bad frames must not make the head write 1M log lines
(about 400 MB at the default level). Every refusal is still counted (the
caller's counters: `stats()`, /metrics); the log gets, per kind, the first
refusal of an interval with its details and how many of that kind came
since the last line (`repeats`), so an operator sees each kind of trouble at
once and its volume, and the log grows by at most one line per kind per
`interval_s` however hard a peer pushes.

Kinds are few and fixed by the code (an event name, a socket and code): the
table of kinds is bounded by the call sites, never by what a peer sends.
Ownership: one per logger per thread (the owner loop); no locking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    """`refused(kind, **fields)`: counted always, logged when the kind's last
    line is at least `interval_s` old (then with `repeats`, the refusals of
    that kind not logged since)."""

    def __init__(
        self,
        logger: Any,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}  # kind -> when its last line was written
        self._held: dict[str, int] = {}  # kind -> refusals since that line, not logged
        self.counts: dict[str, int] = {}  # kind -> every refusal (also the unlogged)

    def refused(self, event: str, level: str = "warning", *, kind: str | None = None, **fields: Any) -> bool:
        """Count one refusal of `kind` (default: the log event's name); True
        when it was written to the log (as `event`, at `level`)."""
        kind = kind or event
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        self._last[kind] = now
        repeats = self._held.pop(kind, 0)
        if repeats:
            fields["repeats"] = repeats
            fields["interval_s"] = self.interval_s
        getattr(self.logger, level)(event, **fields)
        return True

    def flush(self) -> None:
        """One summary line per kind with refusals not yet logged (at exit, or
        from a tick: a burst that stopped is still reported)."""
        now = self.clock()
        for kind, n in list(self._held.items()):
            if now - self._last.get(kind, 0.0) >= self.interval_s:
                self._last[kind] = now
                del self._held[kind]
                self.logger.warning("refusals_repeated", kind=kind, repeats=n, interval_s=self.interval_s)
