"""Engine registry and health, owned by the router loop thread.

Health means something: an engine is healthy only when it has joined (acked
a publication), its heartbeats are fresh, and — when it has runnable work —
its step counter moves. A paused engine with frozen work is not "stalled", nor
is one whose heartbeat says it is busy with a control op. An engine whose
paused scopes / sleep differ from what the head intends for it (it missed a
control op: frozen, partitioned, restarted) is "converging"
(router_node/intended_state.py) until a corrective op brings it there.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable

import zmq

from bus import protocol as P


class EngineState(enum.Enum):
    JOINING = "joining"  # registered, join ping not acked yet
    HEALTHY = "healthy"
    STALLED = "stalled"  # heartbeats arrive, steps do not move while it has work
    SILENT = "silent"  # missed heartbeats: presumed dead
    # alive, but its weight version is below the cluster's (restarted from its
    # checkpoint, joined late, missed an update): no traffic until synced
    STALE = "stale"
    # alive, but its paused scopes / sleep differ from the cluster's intended
    # state: no traffic until the head's corrective op lands (intended_state.py)
    CONVERGING = "converging"


@dataclasses.dataclass(eq=False)
class EngineEntry:
    reg: P.Register
    sock: zmq.Socket  # router-side DEALER connected to the engine's data socket
    registered_at: float
    # sock's libzmq monitor, attached before its connect (router_node/data_links.py owns it)
    link_monitor: zmq.Socket | None = None
    state: EngineState = EngineState.JOINING
    reason: str = "waiting for the join ping ack"
    last_seen: float = 0.0
    hb: P.Heartbeat | None = None
    steps_changed_at: float = 0.0
    outstanding: int = 0  # sequences the router has in flight there
    loras: set[str] = dataclasses.field(default_factory=set)
    weight_version: int = 0
    epoch: int = 0  # config epoch of what loras/weight_version say
    silent_since: float | None = None
    # Its events connection's identity "engine_id/incarnation/NONCE" (the nonce
    # is the engine's secret: never logged or shown): heartbeats and acks
    # are believed only from it (and its ".../hb" twin).
    ident: bytes = b""
    # It registered with a weight version above the cluster's and is still on
    # it (a rogue, another cluster's checkpoint): STALE until an update brings
    # it to the cluster version. Sticky until then, so a version it moves by
    # itself (a level-2 wake reloads the checkpoint: +1) does not clear it.
    ahead: bool = False
    # Why the head's data connection to it takes no request (forwarding.py
    # _unreachable), "" while it does: SILENT until the engine registers anew.
    unreachable: str = ""

    @property
    def engine_id(self) -> str:
        return self.reg.engine_id

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.HEALTHY

    def on_heartbeat(self, hb: P.Heartbeat, now: float) -> None:
        # The stall clock measures time WITH work and without a step. It restarts
        # when the step counter moves, while a control op holds the model
        # (hb.busy: not a hung loop), and while the engine has nothing running:
        # otherwise an engine idle for longer than stall_timeout_s (waiting for a
        # peer's restart, a trainer step) would be declared stalled by the first
        # heartbeat that shows work, before its first step could finish.
        prev = self.hb
        if prev is None or hb.steps != prev.steps or hb.busy or prev.running == 0 or hb.running == 0:
            self.steps_changed_at = now
        self.hb = hb
        self.last_seen = now
        self.apply_config(hb.config_epoch, hb.weight_version, hb.loras)

    def apply_config(self, epoch: int, weight_version: int, loras: list[str]) -> None:
        """Heartbeats and acks race (different sockets): the newer epoch wins."""
        if epoch >= self.epoch:
            self.epoch = epoch
            self.weight_version = weight_version
            self.loras = set(loras)

    def evaluate(
        self,
        now: float,
        *,
        deadline_s: float,
        stall_timeout_s: float,
        cluster_version: int = 0,
        converging: str | None = None,
    ) -> tuple[EngineState, str]:
        """The state this engine should be in now (JOINING is left by the join ack).
        `converging`: why its control state differs from the intended one, if it does."""
        if self.state is EngineState.JOINING:
            return self.state, self.reason
        if self.unreachable:
            return EngineState.SILENT, self.unreachable
        if now - self.last_seen > deadline_s:
            return EngineState.SILENT, f"no heartbeat for {now - self.last_seen:.1f}s (> {deadline_s:.1f}s)"
        hb = self.hb
        if hb is not None and hb.running > 0 and not hb.busy and now - self.steps_changed_at > stall_timeout_s:
            return (
                EngineState.STALLED,
                f"step counter stuck at {hb.steps} for {now - self.steps_changed_at:.1f}s with {hb.running} running (stall_timeout_s={stall_timeout_s})",
            )
        if converging is not None:
            return EngineState.CONVERGING, converging
        if self.weight_version < cluster_version:
            return (
                EngineState.STALE,
                f"weight version {self.weight_version} < cluster weight version {cluster_version} "
                "(restarted from its checkpoint, joined late or missed an update): no traffic until "
                "the next update_weights or Client.sync_stale() brings it up to date",
            )
        # The cluster version moves only by the head's own commits (and the first
        # joiner): an engine that registered above it serves nothing until an
        # update brings it to the cluster version. Versions an engine reaches
        # after joining (commits, a level-2 wake) are not "ahead".
        if self.weight_version <= cluster_version:
            self.ahead = False
        elif self.weight_version == self.reg.weight_version:
            self.ahead = True
        if self.ahead:
            return (
                EngineState.STALE,
                f"weight version {self.weight_version} > cluster weight version {cluster_version}: the cluster "
                "version moves only by the head's own commits, so this engine serves nothing until the next "
                "update_weights or Client.sync_stale() brings it to the cluster version",
            )
        return EngineState.HEALTHY, "ok"

    def view(self, now: float) -> P.EngineView:
        """What the head reports about this engine (its intent and sessions are
        added by router_node/views.py)."""
        hb = self.hb
        r = self.reg
        return P.EngineView(
            engine_id=r.engine_id,
            healthy=self.healthy,
            stale=self.state is EngineState.STALE,
            state=self.state.value,
            reason=self.reason,
            data_address=r.data_address,
            weight_address=r.weight_address,
            backend=r.backend,
            model=r.model,
            dtype=r.dtype,
            host=r.host,
            pid=r.pid,
            tp=r.tp,
            pp=r.pp,
            dp=r.dp,
            capacity=r.capacity,
            vocab_size=r.vocab_size,
            max_model_len=r.max_model_len,
            incarnation=r.incarnation,
            curve_key=r.curve_key,
            outstanding=self.outstanding,
            heartbeat_age_s=round(now - self.last_seen, 3) if self.last_seen else None,
            running=hb.running if hb else 0,
            waiting=hb.waiting if hb else 0,
            held=hb.held if hb else 0,
            parked=hb.parked if hb else 0,
            kv_usage=hb.kv_usage if hb else 0.0,
            weight_version=self.weight_version,
            paused=list(hb.paused) if hb else [],
            sleeping=hb.sleeping if hb else 0,
            asleep=list(hb.asleep) if hb else [],
            steps=hb.steps if hb else 0,
            tokens_out=hb.tokens_out if hb else 0,
            busy=hb.busy if hb else "",
            loras=sorted(self.loras),
        )


class Admission(enum.Enum):
    NEW = "new"  # no engine under this id: register it
    REPEAT = "repeat"  # the same process re-sent its Register: answer again, change nothing
    REPLACE = "replace"  # a new process under the id of a dead one (restart): drop the old entry
    TAKEN = "taken"  # the id belongs to a live engine: refuse (an impostor, or a twin started by mistake)


def admit_register(old: EngineEntry | None, reg: P.Register, now: float, *, deadline_s: float) -> tuple[Admission, str]:
    """Who may hold an engine id: the first process to register it, for as long
    as it heartbeats. A second process (another incarnation) gets the id only
    once the holder missed its heartbeats (`deadline_s`, the same clock that
    marks it silent) - so an impostor cannot take over a live engine's
    traffic, while an engine restarted after a crash waits at most that long."""
    if old is None:
        return Admission.NEW, ""
    if old.reg.incarnation == reg.incarnation:
        return Admission.REPEAT, ""
    age = now - old.last_seen
    if old.state is EngineState.SILENT or age > deadline_s:
        return Admission.REPLACE, ""
    return (
        Admission.TAKEN,
        f"engine id {reg.engine_id!r} is held by a live engine (incarnation {old.reg.incarnation}, pid "
        f"{old.reg.pid}, heartbeat {age:.1f}s ago): a restarted engine gets it once that one missed its "
        f"heartbeats ({deadline_s:.1f}s = missed_heartbeats x heartbeat_interval_s); pick another --engine-id "
        "for a second engine",
    )


class LoopClock:
    """The head's own loop lag. A head that was itself stopped (SIGSTOP, a
    swapped-out or starved process) reads every peer's heartbeats late; blaming
    the peers would declare live engines dead on waking and lose their streams.
    `observe(now)` at fixed points of the loop returns by how much the time
    since the previous point exceeds `threshold_s` (0.0 when it does not): that
    time is credited to every peer (`credit_stall`) before anything is judged.
    Only the excess: a head that is merely slow (every turn a little over the
    threshold) still finds a dead engine, a little later."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.last: float | None = None
        self.stalls = 0
        self.stalled_s = 0.0

    def observe(self, now: float) -> float:
        last, self.last = self.last, now
        if last is None or now - last <= self.threshold_s:
            return 0.0
        away = now - last - self.threshold_s
        self.stalls += 1
        self.stalled_s += away
        return away


def credit_stall(entries: Iterable[EngineEntry], seconds: float) -> None:
    """The head was away `seconds`: no engine's heartbeat or stall clock ran
    meanwhile (a fresh grace period of what they had left)."""
    for e in entries:
        if e.last_seen:
            e.last_seen += seconds
        if e.steps_changed_at:
            e.steps_changed_at += seconds
        if e.silent_since is not None:
            e.silent_since += seconds


def now() -> float:
    return time.monotonic()
