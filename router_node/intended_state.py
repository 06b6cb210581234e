"""The cluster's intended control state and its reconciliation — no I/O.

The head owns what every engine *should* be: its paused scopes ("*" or LoRA
names), its sleep level and which sleep tags ("weights", "kv_cache") are
asleep (sleep() puts both to sleep; wake_up(tags) wakes them one by one, in
any order). Control ops change it when they are issued (a cluster-wide op
changes the cluster default and every engine; a targeted op only its
targets); acks and heartbeats tell what each engine *is*. An engine whose
known state differs from its intended state, with no op on its way that would
settle it, is *converging*: not routable, not healthy, and the head sends
it one corrective op (Resume / Pause(scope) / Sleep / WakeUp) at a time, under
`converge_timeout_s`, re-checking after each. That is how an engine that
missed an op (frozen, partitioned, restarted) is brought back before it gets
traffic, and why no engine that reports healthy can be stuck paused.

Races, and how they are closed:
- A heartbeat is a snapshot taken on the engine every ~50 ms and sent by
  another thread, so it can be older than an ack the head already has. Every
  heartbeat carries `acked_seq` (the highest command seq the engine had acked
  when the snapshot was taken); its paused/sleeping fields are used only when
  `acked_seq >= ` the highest seq the head got an ack for from that engine.
  Acks of pause/resume/sleep/wake_up update the known state themselves, so the
  head's view never goes back to a state from before an ack (no flapping).
- While an op that changes the state is in flight to an engine (published, not
  acked, not expired), the engine is not judged: that op is already the
  convergence path, and the engine stays routable (a request sent there is
  held or parked by the engine's own gate, as always).
- A client's op issued while an engine converges wins: it updates the intended
  state at once, and corrections are computed from the intended state only
  when nothing is in flight to the engine, so a correction computed before the
  client's op can never be published after it.
- An op the engine refused before acting (bad_request / unsupported /
  backend_refused) reverts that engine's intended value (if no later op set
  it), so a refused op is never retried forever.

Ownership: the router loop thread (router_node/control.py drives it).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from bus import protocol as P
from bus.errors import BadRequest

ALL = "*"
# engine_node/core.py's gate scope for sleep(): heartbeats list it in `paused`
# from the moment a sleep starts until no tag is asleep (a failed sleep leaves it
# closed with no tag asleep: any wake_up opens it).
SLEEP_SCOPE = "__sleep__"
SLEEP_TAGS = frozenset({"weights", "kv_cache"})  # engine_node/core.py's SLEEP_TAGS
# Ack codes of an op refused before it changed anything on the engine.
REFUSED = frozenset({"bad_request", "unsupported", "backend_refused"})
STATE_OPS = (P.Pause, P.Resume, P.Sleep, P.WakeUp)
PAUSE_MODES = ("abort", "keep", "wait")
_RECENT_OPS = 256  # state ops remembered by seq, so an ack after the op's deadline still informs


def check(op: Any, request_id: str | None = None) -> None:
    """Refuse, at the head, a state op no engine would take (engine_node/core.py's
    own checks), so it never becomes the intended state."""
    if isinstance(op, P.Pause) and op.mode not in PAUSE_MODES:
        raise BadRequest(
            f"unknown pause mode {op.mode!r} ({', '.join(PAUSE_MODES)})", request_id=request_id, field="mode"
        )
    if isinstance(op, P.Sleep) and op.level not in (1, 2):
        raise BadRequest(f"sleep level must be 1 or 2, got {op.level}", request_id=request_id, field="level")
    if isinstance(op, P.WakeUp) and op.tags is not None:
        unknown = sorted(set(op.tags) - SLEEP_TAGS)
        if unknown:
            raise BadRequest(
                f"unknown wake_up tags {unknown}; choose from {sorted(SLEEP_TAGS)}", request_id=request_id, field="tags"
            )


def woken(op: P.WakeUp) -> frozenset[str]:
    """The tags a wake_up wakes (None: all), as engine_node/core.py reads it."""
    return SLEEP_TAGS if op.tags is None else frozenset(op.tags) & SLEEP_TAGS


@dataclasses.dataclass
class Intent:
    paused: dict[str, P.Pause] = dataclasses.field(default_factory=dict)  # scope -> the op that paused it
    sleep: int = 0  # level of the last sleep while any tag is asleep, 0 awake
    asleep: frozenset[str] = frozenset()  # the tags that should be asleep

    def copy(self) -> Intent:
        return Intent(dict(self.paused), self.sleep, self.asleep)

    def apply(self, op: Any) -> None:
        if isinstance(op, P.Pause):
            self.paused[op.lora or ALL] = op
        elif isinstance(op, P.Resume):
            if op.lora is None:
                self.paused.clear()
            else:
                self.paused.pop(op.lora, None)
        elif isinstance(op, P.Sleep):
            self.sleep, self.asleep = op.level, SLEEP_TAGS
        elif isinstance(op, P.WakeUp):
            self.asleep = self.asleep - woken(op)
            if not self.asleep:
                self.sleep = 0

    def describe(self) -> dict[str, Any]:
        return {"paused": sorted(self.paused), "sleeping": self.sleep, "asleep": sorted(self.asleep)}


@dataclasses.dataclass
class Known:
    """What the head knows an engine is, as new as ack seq `seq`."""

    gate: frozenset[str] = frozenset()  # the engine's closed gate scopes (Heartbeat.paused)
    sleeping: int = 0  # sleep level (Heartbeat.sleeping)
    valid: bool = False  # False: wait for a heartbeat newer than `seq`
    seq: int = 0
    tags: frozenset[str] = frozenset()  # sleep tags asleep (Heartbeat.asleep)

    @property
    def paused(self) -> frozenset[str]:
        return self.gate - {SLEEP_SCOPE}

    @property
    def asleep(self) -> bool:
        """Gated by sleep: some tag asleep, or a failed sleep's gate left closed."""
        return self.sleeping > 0 or SLEEP_SCOPE in self.gate or bool(self.tags)


@dataclasses.dataclass
class EngineView:
    intent: Intent
    known: Known = dataclasses.field(default_factory=Known)
    # seq -> (op, this engine's intent before the op, corrective?)
    in_flight: dict[int, tuple[Any, Intent, bool]] = dataclasses.field(default_factory=dict)
    retry_at: float = 0.0
    last_error: str | None = None
    converging: str | None = None  # why it is not routable; None: converged
    corrections: int = 0


class IntendedState:
    def __init__(self, *, converge_timeout_s: float = 30.0, retry_s: float = 1.0) -> None:
        self.cluster = Intent()  # what an engine that joins gets
        self.engines: dict[str, EngineView] = {}
        self.converge_timeout_s = converge_timeout_s
        self.retry_s = retry_s
        # seq -> state op, for acks that come after their op expired (an engine
        # frozen through an op runs it when it thaws: its ack still tells)
        self.recent: collections.OrderedDict[int, Any] = collections.OrderedDict()

    # ------------------------------------------------------------ membership

    def add(self, engine_id: str) -> EngineView:
        """A (re)registered engine: the cluster's intent, state unknown."""
        v = self.engines[engine_id] = EngineView(self.cluster.copy())
        v.converging = "converging: its state is not known yet"  # never routable unconfirmed
        return v

    def remove(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)

    def join_ops(self, engine_id: str) -> list[Any]:
        """What a new engine is brought to before it first serves."""
        it = self.engines[engine_id].intent
        ops: list[Any] = list(it.paused.values())
        if it.sleep:
            ops.append(P.Sleep(level=it.sleep))
            if it.asleep != SLEEP_TAGS:  # the cluster is half-awake: wake what it woke
                ops.append(P.WakeUp(tags=sorted(SLEEP_TAGS - it.asleep)))
        return ops

    # ------------------------------------------------------------ ops

    def issued(
        self, op: Any, targets: list[str] | None, seq: int, waiting: set[str], *, corrective: bool = False
    ) -> None:
        """`op` was published as `seq` to `targets` (None: cluster-wide);
        `waiting`: the targets an ack is still expected from. A corrective or
        join op does not change the intent, it carries it out."""
        if not isinstance(op, STATE_OPS):
            return
        self.recent[seq] = op
        while len(self.recent) > _RECENT_OPS:
            self.recent.popitem(last=False)
        if not corrective and targets is None:
            self.cluster.apply(op)
        for eid in self.engines if targets is None else targets:
            v = self.engines.get(eid)
            if v is None:
                continue
            before = v.intent.copy()
            if not corrective:
                v.intent.apply(op)
            if eid in waiting:
                v.in_flight[seq] = (op, before, corrective)

    def acked(
        self,
        engine_id: str,
        seq: int,
        *,
        ok: bool,
        result: Any = None,
        code: str | None = None,
        error: str = "",
        now: float = 0.0,
    ) -> None:
        v = self.engines.get(engine_id)
        if v is None:
            return
        entry = v.in_flight.pop(seq, None)
        op = entry[0] if entry is not None else self.recent.get(seq)
        k = v.known
        if seq >= k.seq:
            k.seq = seq
            if ok and op is not None:
                self._learn(k, op, result)
            elif not ok and op is not None:
                k.valid = False  # it may have acted in part: a fresh heartbeat tells
        if entry is None:
            return
        op, before, corrective = entry
        if ok:
            if corrective:
                v.last_error = None
            return
        if code in REFUSED and not corrective:
            self._revert(v.intent, op, before)
        elif code in REFUSED:  # the engine will never take it: not a state to converge to
            self._abandon(v.intent, op)
        if corrective:
            v.last_error = f"corrective {P.OP_NAMES[type(op)]} failed: [{code}] {error}"
            v.retry_at = now + self.retry_s

    def expired(self, seq: int, missing: list[str], now: float) -> None:
        """The op's deadline passed without these engines' acks."""
        for eid in missing:
            v = self.engines.get(eid)
            entry = v.in_flight.pop(seq, None) if v is not None else None
            if v is not None and entry is not None and entry[2]:
                v.last_error = f"corrective {P.OP_NAMES[type(entry[0])]} not acked within converge_timeout_s={self.converge_timeout_s}"
                v.retry_at = now + self.retry_s

    def cluster_refused(self, op: Any, before: Intent) -> None:
        """Every target refused a cluster-wide op: the cluster default reverts too."""
        self._revert(self.cluster, op, before)

    @staticmethod
    def _revert(intent: Intent, op: Any, before: Intent) -> None:
        """Undo `op`'s change to `intent` unless a later op changed the same thing."""
        after = before.copy()
        after.apply(op)
        if isinstance(op, (P.Sleep, P.WakeUp)):
            if (intent.sleep, intent.asleep) == (after.sleep, after.asleep):
                intent.sleep, intent.asleep = before.sleep, before.asleep
        elif intent.paused == after.paused:
            intent.paused = dict(before.paused)

    @staticmethod
    def _abandon(intent: Intent, op: Any) -> None:
        if isinstance(op, P.Pause) and intent.paused.get(op.lora or ALL) is op:
            del intent.paused[op.lora or ALL]
        elif isinstance(op, P.Sleep) and intent.sleep == op.level:
            intent.sleep, intent.asleep = 0, frozenset()

    @staticmethod
    def _learn(k: Known, op: Any, result: Any) -> None:
        """An ok ack of a state op: what the engine is right after it."""
        if isinstance(op, P.Resume) and isinstance(result, P.ResumeResult):
            # the whole gate after it: sleep's scope stays closed while asleep
            k.gate = frozenset(result.still_paused)
            if SLEEP_SCOPE not in k.gate:  # awake: the whole state is known now
                k.sleeping, k.tags, k.valid = 0, frozenset(), True
            return
        if not k.valid:
            return  # the rest are deltas on a state we do not know
        if isinstance(op, P.Pause) and isinstance(result, P.PauseResult):
            k.gate = k.gate | {result.scope or op.lora or ALL}
        elif isinstance(op, P.Sleep):
            k.gate, k.sleeping, k.tags = k.gate | {SLEEP_SCOPE}, op.level, SLEEP_TAGS
        elif isinstance(op, P.WakeUp):
            k.tags = k.tags - woken(op)
            if not k.tags:  # the engine's gate opens once no tag is asleep (core.wake_up)
                k.gate, k.sleeping = k.gate - {SLEEP_SCOPE}, 0

    def heartbeat(self, engine_id: str, hb: P.Heartbeat) -> None:
        v = self.engines.get(engine_id)
        if v is None or hb.acked_seq < v.known.seq:
            return  # a snapshot from before an ack the head already has
        # A peer from before tags sends no `asleep`: sleeping > 0 means every tag.
        tags = frozenset(hb.asleep) & SLEEP_TAGS if hb.asleep else (SLEEP_TAGS if hb.sleeping else frozenset())
        v.known = Known(gate=frozenset(hb.paused), sleeping=hb.sleeping, valid=True, seq=v.known.seq, tags=tags)

    # ------------------------------------------------------------ reconcile

    def converging(self, engine_id: str) -> str | None:
        v = self.engines.get(engine_id)
        return v.converging if v is not None else None

    def evaluate(self, engine_id: str, now: float, *, send: bool = True) -> Any | None:
        """Update the engine's `converging` reason; returns the corrective op
        to publish now (the caller publishes it and calls `issued(...,
        corrective=True)`), or None."""
        v = self.engines.get(engine_id)
        if v is None:
            return None
        if v.in_flight:
            if v.converging is not None:  # still not routable; say what it waits for
                names = sorted({P.OP_NAMES[type(op)] for op, _, _ in v.in_flight.values()})
                v.converging = f"converging: waiting for the ack of {', '.join(names)}"
            return None
        k = v.known
        if not k.valid:
            v.converging = "converging: waiting for a heartbeat newer than its last control ack"
            return None
        op = self.correction(v.intent, k)
        if op is None:
            v.converging = None
            v.last_error = None
            return None
        want, have = v.intent, k
        v.converging = (
            f"converging: reports paused={sorted(have.paused)} asleep={sorted(have.tags)}"
            + (" (sleep gate closed)" if have.asleep and not have.tags else "")
            + f", the cluster intends paused={sorted(want.paused)} asleep={sorted(want.asleep)}"
            + (f"; last try: {v.last_error}" if v.last_error else "")
            + f"; sending {P.OP_NAMES[type(op)]}"
        )
        if now < v.retry_at or not send:
            return None
        v.corrections += 1
        return op

    @staticmethod
    def correction(want: Intent, have: Known) -> Any | None:
        """One op that moves `have` toward `want` (resumes, then pauses, then
        sleep tags: a tag that should sleep but is awake needs a Sleep, which
        puts every tag to sleep; tags asleep that should be awake get a WakeUp
        of just those, or a plain WakeUp when nothing should sleep, which also
        opens a gate a failed sleep left closed)."""
        extra = sorted(have.paused - set(want.paused))
        if extra:
            if not want.paused:
                return P.Resume()
            # Resume(lora="*") lifts only the "*" scope on the engine (core.resume).
            return P.Resume(lora=extra[0])
        for scope in sorted(set(want.paused) - have.paused):
            return want.paused[scope]
        if want.asleep - have.tags:
            return P.Sleep(level=want.sleep or 1)
        if not want.asleep and have.asleep:
            return P.WakeUp()
        if have.tags - want.asleep:
            return P.WakeUp(tags=sorted(have.tags - want.asleep))
        return None

    def describe(self, engine_id: str) -> dict[str, Any]:
        v = self.engines.get(engine_id)
        if v is None:
            return {}
        out: dict[str, Any] = {
            "intended": v.intent.describe(),
            "converging": v.converging,
            "corrections": v.corrections,
        }
        if v.known.valid:  # newer than the last heartbeat when an ack told it
            out["paused"], out["sleeping"] = sorted(v.known.gate), v.known.sleeping
            out["asleep"] = sorted(v.known.tags)
        return out
