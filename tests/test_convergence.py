"""Cluster control state converges (issue 13 item 4).

The head owns the intended state (paused scopes, sleep); an engine that missed
a control op — frozen through it, partitioned, restarted — is brought to it
before it gets traffic, and no engine that reports healthy differs from it.

First the reconciler alone (router_node/intended_state.py, no sockets: a
simulated engine with lossy commands and stale heartbeats), then real
processes: a head and two null-backend engines (no model: the control plane is
what is under test), frozen with SIGSTOP through pause / resume / sleep.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import protocol as P
from bus.errors import ControlError, RequestTimeout
from router_node.intended_state import ALL, SLEEP_SCOPE, SLEEP_TAGS, IntendedState
from tests.cluster import leak_checked_cluster, wait_until

NULL = "null"
NULL_OPTIONS = {"tokens_per_step": 1, "step_delay_s": 0.005}  # a few ms per token: requests run a while

# ---------------------------------------------------------------- the reconciler alone


class SimEngine:
    """engine_node/core.py's gate semantics (sleep tags woken one by one), and
    the node's ack / snapshot order. `legacy`: heartbeats of a peer from before
    tags (no `asleep` field)."""

    def __init__(self, legacy: bool = False) -> None:
        self.gate: set[str] = set()
        self.sleeping = 0
        self.asleep: set[str] = set()
        self.acked_seq = 0
        self.legacy = legacy

    def run(self, seq: int, op: Any) -> P.Ack:
        self.acked_seq = max(self.acked_seq, seq)
        if isinstance(op, P.Pause):
            if op.mode not in ("abort", "keep", "wait"):
                return P.Ack(seq=seq, engine_id="e", failure=P.EngineFailure("bad_request", "mode", "mode"))
            self.gate.add(op.lora or ALL)
            return P.Ack(seq=seq, engine_id="e", result=P.PauseResult(mode=op.mode, scope=op.lora or ALL))
        if isinstance(op, P.Resume):
            if op.lora is None:
                self.gate &= {SLEEP_SCOPE}
            else:
                self.gate.discard(op.lora)
            return P.Ack(seq=seq, engine_id="e", result=P.ResumeResult(still_paused=sorted(self.gate)))
        if isinstance(op, P.Sleep):
            self.gate.add(SLEEP_SCOPE)
            self.sleeping = op.level
            self.asleep = set(SLEEP_TAGS)
            return P.Ack(seq=seq, engine_id="e", result=P.SleepResult(level=op.level))
        assert isinstance(op, P.WakeUp)
        tags = set(SLEEP_TAGS) if op.tags is None else set(op.tags)
        if tags - SLEEP_TAGS:
            return P.Ack(seq=seq, engine_id="e", failure=P.EngineFailure("bad_request", "tags", "tags"))
        self.asleep -= tags
        if not self.asleep:
            self.gate.discard(SLEEP_SCOPE)
            self.sleeping = 0
        return P.Ack(seq=seq, engine_id="e", result=P.WakeUpResult())

    def snapshot(self) -> P.Heartbeat:
        return P.Heartbeat(
            engine_id="e",
            incarnation="i",
            paused=sorted(self.gate),
            sleeping=self.sleeping,
            acked_seq=self.acked_seq,
            asleep=[] if self.legacy else sorted(self.asleep),
        )


class Harness:
    """The head's side as router_node/control.py drives it, over a lossy channel."""

    def __init__(self, legacy: bool = False) -> None:
        self.st = IntendedState(retry_s=0.0)
        self.eng = SimEngine(legacy)
        self.st.add("e")
        self.seq = 0
        self.commands: list[tuple[int, Any]] = []  # published, not yet run by the engine
        self.acks: list[P.Ack] = []  # sent, not yet received
        self.snapshots: list[P.Heartbeat] = [self.eng.snapshot()]
        self.open: set[int] = set()  # published, neither acked nor expired
        self.corrections = 0

    def publish(self, op: Any, *, targets: list[str] | None, corrective: bool, lost: bool) -> None:
        self.seq += 1
        self.st.issued(op, targets, self.seq, {"e"}, corrective=corrective)
        self.open.add(self.seq)
        if not lost:
            self.commands.append((self.seq, op))

    def client(self, op: Any, targeted: bool, lost: bool) -> None:
        self.publish(op, targets=["e"] if targeted else None, corrective=False, lost=lost)

    def deliver_command(self) -> None:
        if self.commands:
            seq, op = self.commands.pop(0)  # in order: one PUB -> SUB connection
            self.acks.append(self.eng.run(seq, op))

    def deliver_ack(self) -> None:
        if self.acks:
            a = self.acks.pop(0)
            self.open.discard(a.seq)
            f = a.failure
            self.st.acked(
                "e", a.seq, ok=a.ok, result=a.result, code=f and f.code, error=f.message if f is not None else ""
            )
            self.tick()  # the router re-checks an engine on each ack / heartbeat / expiry

    def expire(self) -> None:
        if self.open:
            seq = min(self.open)
            self.open.discard(seq)
            self.st.expired(seq, ["e"], 0.0)
            self.tick()

    def snapshot(self) -> None:
        self.snapshots.append(self.eng.snapshot())

    def heartbeat(self, i: int) -> None:
        # any snapshot taken so far, possibly an old one (another socket, another thread)
        self.st.heartbeat("e", self.snapshots[i % len(self.snapshots)])
        self.tick()

    def tick(self) -> None:
        fix = self.st.evaluate("e", 0.0)
        if fix is not None:
            self.corrections += 1
            self.publish(fix, targets=["e"], corrective=True, lost=False)

    def settle(self) -> None:
        """No more losses: everything is delivered, the head ticks."""
        for _ in range(40):
            while self.commands or self.acks:
                self.deliver_command()
                self.deliver_ack()
            for seq in sorted(self.open):  # lost ones reach their deadline
                self.open.discard(seq)
                self.st.expired(seq, ["e"], 0.0)
            self.snapshot()
            self.st.heartbeat("e", self.snapshots[-1])
            self.tick()
            if self.st.converging("e") is None and not self.commands and not self.open:
                return
        raise AssertionError(f"never converged: {self.st.describe('e')}, engine {self.eng.snapshot()}")


CLIENT_OPS = st.sampled_from(
    [
        P.Pause(mode="abort"),
        P.Pause(mode="keep"),
        P.Pause(mode="abort", lora="a"),
        P.Pause(mode="abort", lora="b"),
        P.Pause(mode="bogus"),  # refused by the engine: never the intent
        P.Resume(),
        P.Resume(lora="a"),
        P.Sleep(level=1),
        P.Sleep(level=2),
        P.WakeUp(),
        P.WakeUp(tags=["weights"]),
        P.WakeUp(tags=["kv_cache"]),
        P.WakeUp(tags=["kv_cache"]),
        P.WakeUp(tags=["weights", "kv_cache"]),
        P.WakeUp(tags=[]),
        P.WakeUp(tags=["bogus"]),  # refused by the engine: never the intent
    ]
)
STEPS = st.one_of(
    st.tuples(st.just("client"), CLIENT_OPS, st.booleans(), st.booleans()),
    st.tuples(st.sampled_from(["command", "ack", "expire", "snapshot", "tick"])),
    st.tuples(st.just("heartbeat"), st.integers(0, 50)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEPS, max_size=60))
def test_the_reconciler_converges_and_never_flaps(steps):
    _converges_and_never_flaps(Harness(), steps)


def test_a_heartbeat_without_tags_reads_sleeping_as_every_tag_asleep():
    """A peer from before tags sends no `asleep`: `sleeping` > 0 is every tag."""
    h = Harness(legacy=True)
    h.client(P.Sleep(level=1), targeted=False, lost=True)  # the engine missed it
    h.eng.gate.add(SLEEP_SCOPE)
    h.eng.sleeping = 1
    h.eng.asleep = set(SLEEP_TAGS)
    h.expire()
    h.snapshot()
    h.st.heartbeat("e", h.snapshots[-1])
    assert h.st.engines["e"].known.tags == SLEEP_TAGS
    assert h.st.correction(h.st.engines["e"].intent, h.st.engines["e"].known) is None


def _converges_and_never_flaps(h: Harness, steps: list) -> None:
    for step in steps:
        kind = step[0]
        if kind == "client":
            h.client(step[1], targeted=step[2], lost=step[3])
        elif kind == "heartbeat":
            h.heartbeat(step[1])
        else:
            {"command": h.deliver_command, "ack": h.deliver_ack, "expire": h.expire, "snapshot": h.snapshot}.get(
                kind, h.tick
            )()
        v = h.st.engines["e"]
        if v.converging is None and not v.in_flight:  # routable: what the head knows is the intent
            assert h.st.correction(v.intent, v.known) is None
    h.settle()
    v = h.st.engines["e"]
    # the engine is where the last client op put it (a refused op changes nothing)
    assert h.eng.gate - {SLEEP_SCOPE} == set(v.intent.paused)
    assert (h.eng.sleeping > 0 or SLEEP_SCOPE in h.eng.gate) == bool(v.intent.sleep)
    # per tag: the engine sleeps exactly the tags the head intends
    assert h.eng.asleep == set(v.intent.asleep)
    assert (SLEEP_SCOPE in h.eng.gate) == bool(v.intent.asleep)
    # converged: old snapshots, replayed in any order, never make it flap
    n = h.corrections
    for old in reversed(h.snapshots):
        h.st.heartbeat("e", old)
        h.tick()
        assert h.st.converging("e") is None
    assert h.corrections == n


def test_a_client_pause_issued_while_a_resume_corrects_wins():
    h = Harness()
    h.client(P.Pause(mode="abort"), targeted=False, lost=False)
    h.deliver_command()
    h.deliver_ack()
    h.client(P.Resume(), targeted=False, lost=True)  # the engine missed the resume
    h.expire()
    h.snapshot()
    h.heartbeat(-1)
    h.tick()  # paused, intends unpaused: a corrective resume goes out
    assert isinstance(h.commands[-1][1], P.Resume) and h.st.converging("e")
    h.client(P.Pause(mode="keep"), targeted=False, lost=False)  # the trainer pauses again meanwhile
    h.tick()
    assert len(h.commands) == 2  # nothing computed from the old intent goes out after the pause
    h.settle()
    assert h.eng.gate == {ALL} and h.st.converging("e") is None


def test_a_stale_heartbeat_after_an_ack_is_ignored():
    h = Harness()
    h.settle()
    before = h.eng.snapshot()  # unpaused, taken before the pause ran
    h.client(P.Pause(mode="abort"), targeted=False, lost=False)
    h.deliver_command()
    h.deliver_ack()
    h.st.heartbeat("e", before)  # arrives after the ack
    h.tick()
    assert h.st.converging("e") is None and h.corrections == 0
    assert h.st.describe("e")["paused"] == [ALL]


def test_an_op_in_flight_leaves_a_converged_engine_routable():
    h = Harness()
    h.settle()
    h.client(P.Pause(mode="abort"), targeted=False, lost=False)  # published, not run yet
    h.snapshot()
    h.heartbeat(-1)  # fresh, and unpaused: the pause is on its way, not missed
    h.tick()
    assert h.st.converging("e") is None and h.corrections == 0
    h.deliver_command()
    h.deliver_ack()
    h.tick()
    assert h.st.converging("e") is None and h.st.describe("e")["paused"] == [ALL]


def test_a_failed_correction_keeps_it_unroutable_and_says_why():
    st_ = IntendedState(converge_timeout_s=7.0, retry_s=5.0)
    st_.add("e")
    st_.heartbeat("e", P.Heartbeat(engine_id="e", incarnation="i", paused=[ALL]))
    fix = st_.evaluate("e", 0.0)
    assert fix == P.Resume()
    st_.issued(fix, ["e"], 1, {"e"}, corrective=True)
    st_.expired(1, ["e"], 0.0)
    assert st_.evaluate("e", 1.0) is None  # backing off
    reason = st_.converging("e")
    assert reason and "converge_timeout_s=7.0" in reason and "paused=['*']" in reason
    assert st_.evaluate("e", 5.0) == P.Resume()  # and retried


# ---------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def cl():
    with leak_checked_cluster(2, backend=NULL, model="null", backend_options=NULL_OPTIONS, ready_timeout_s=60) as c:
        yield c


class Watch:
    """Polls health in a thread: an engine reported healthy must report its
    intended state (paused scopes, sleep). Not while a client's op is on its
    way (`during`): an engine the op has not reached yet stays routable by
    design (its own gate holds what it gets), and the op's acks settle it."""

    def __init__(self, cl) -> None:
        self.client = cl.client()
        self.violations: list[dict[str, Any]] = []
        self.polls = 0
        self.stop = threading.Event()
        self._gen = 0  # bumped by each client op, before and after
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    @contextlib.contextmanager
    def during(self):
        self._gen += 1
        try:
            yield
        finally:
            self._gen += 1

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.poll()

    def poll(self) -> None:
        gen = self._gen
        engines = self.client.health()["engines"]
        if gen % 2 or gen != self._gen:
            return  # a client op overlapped this poll
        self.polls += 1
        for eid, e in engines.items():
            want = e["intended"]
            have = [s for s in e["paused"] if s != SLEEP_SCOPE]
            asleep = e["sleeping"] > 0 or SLEEP_SCOPE in e["paused"]
            tags_off = e["asleep"] != want["asleep"]
            if e["healthy"] and (have != want["paused"] or asleep != bool(want["sleeping"]) or tags_off):
                self.violations.append({"engine": eid, **e})

    def summary(self) -> list[tuple[Any, ...]]:
        return [(v["engine"], v["paused"], v["sleeping"], v["intended"], v["reason"]) for v in self.violations]

    def close(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.t.join(5)
        self.poll()  # at least this one
        assert self.polls > 0, "the watch never looked"
        return self.violations


def converged(c, eid: str, paused: list[str], sleeping: bool = False) -> bool:
    e = c.health()["engines"][eid]
    have = [s for s in e["paused"] if s != SLEEP_SCOPE]
    asleep = e["sleeping"] > 0 or SLEEP_SCOPE in e["paused"]
    return e["healthy"] and have == paused and asleep == sleeping and e["intended"]["paused"] == paused


def serves(c, eid: str) -> None:
    """Six requests complete, and `eid` served some of them."""
    before = c.health()["engines"][eid]["tokens_out"]
    res = c.generate([[4 + i, 5, 6] for i in range(6)], {"max_tokens": 8, "ignore_eos": True}, timeout_s=10)
    assert all(len(r.token_ids) == 8 for r in res)
    wait_until(lambda: c.health()["engines"][eid]["tokens_out"] > before, 5, f"{eid} to have served")


def frozen_through(cl, w: Watch, eid: str, call, *, silent_first: bool = True) -> None:
    """`call` (a cluster-wide op) fails naming `eid`, frozen (SIGSTOP) through
    it. silent_first: the head has declared it silent before the op, so the op
    is never even published to it (only a correction can bring it there);
    else the op may wait in its socket buffer and run when it thaws."""
    cl.kill(eid, signal.SIGSTOP)
    try:
        if silent_first:
            wait_until(lambda: w.client.health()["engines"][eid]["state"] == "silent", 10, f"{eid} to be silent")
        with w.during(), pytest.raises(ControlError) as e:
            call()
        assert eid in str(e.value)
    except BaseException:
        cl.kill(eid, signal.SIGCONT)
        raise


def test_an_engine_frozen_through_pause_and_resume_resumes_with_the_cluster(cl):
    c = cl.client(control_timeout_s=1.0, timeout_s=10)
    w = Watch(cl)
    frozen_through(cl, w, "e1", lambda: c.pause("abort"), silent_first=False)  # buffered: runs on SIGCONT
    with w.during(), pytest.raises(ControlError):
        c.resume()  # e1 is silent by now: reported missing at once, never sent
    cl.kill("e1", signal.SIGCONT)
    wait_until(lambda: converged(c, "e1", []), 10, "e1 to resume with the cluster")
    serves(c, "e1")
    assert w.close() == [], w.summary()
    assert c.health()["engines"]["e1"]["corrections"] >= 1


def test_an_engine_frozen_through_resume_resumes(cl):
    c = cl.client(control_timeout_s=1.0, timeout_s=10)
    w = Watch(cl)
    with w.during():
        c.pause("abort")
    frozen_through(cl, w, "e0", c.resume)
    cl.kill("e0", signal.SIGCONT)
    wait_until(lambda: converged(c, "e0", []), 10, "e0 to resume")
    serves(c, "e0")
    assert w.close() == [], w.summary()


def test_an_engine_frozen_through_a_pause_is_paused_when_it_returns(cl):
    c = cl.client(control_timeout_s=1.0, timeout_s=10)
    w = Watch(cl)
    frozen_through(cl, w, "e1", lambda: c.pause("keep"))
    cl.kill("e1", signal.SIGCONT)
    wait_until(lambda: converged(c, "e1", [ALL]), 10, "e1 to be paused like the cluster")
    with w.during():
        c.resume()
    wait_until(lambda: converged(c, "e1", []), 10, "e1 to resume")
    serves(c, "e1")
    assert w.close() == [], w.summary()


def test_sleep_and_wake_up_missed(cl):
    c = cl.client(control_timeout_s=1.0, timeout_s=10)
    w = Watch(cl)
    frozen_through(cl, w, "e0", lambda: c.sleep(1))
    with w.during(), pytest.raises(ControlError):
        c.wake_up()  # e0 misses the wake_up too (silent)
    cl.kill("e0", signal.SIGCONT)
    wait_until(lambda: converged(c, "e0", []), 10, "e0 awake with the cluster")
    frozen_through(cl, w, "e1", lambda: c.sleep(1))  # a missed sleep: asleep when it returns
    cl.kill("e1", signal.SIGCONT)
    wait_until(lambda: converged(c, "e1", [], sleeping=True), 10, "e1 asleep like the cluster")
    assert converged(c, "e0", [], sleeping=True)
    with w.during():
        c.wake_up()
    wait_until(lambda: converged(c, "e1", []), 10, "e1 awake")
    serves(c, "e1")
    assert w.close() == [], w.summary()


def test_a_missed_partial_wake_converges_per_tag(cl):
    """SkyRL's order with an engine frozen through wake_up(['weights']): it
    comes back fully asleep and is brought to the cluster's tags (weights
    awake, KV cache asleep), then wakes with the cluster's last wake."""
    c = cl.client(control_timeout_s=1.0, timeout_s=10)
    w = Watch(cl)
    with w.during():
        c.sleep(1)
    frozen_through(cl, w, "e1", lambda: c.wake_up(tags=["weights"]))
    cl.kill("e1", signal.SIGCONT)

    wait_until(lambda: c.health()["engines"]["e1"]["asleep"] == ["kv_cache"], 10, "e1 to wake its weights")
    assert c.health()["engines"]["e0"]["asleep"] == ["kv_cache"]
    assert c.health()["engines"]["e1"]["corrections"] >= 1
    with w.during():
        c.wake_up(tags=["kv_cache"])
    wait_until(lambda: converged(c, "e1", []) and converged(c, "e0", []), 10, "both awake")
    serves(c, "e1")
    assert w.close() == [], w.summary()


def test_a_lora_scoped_pause_missed(cl):
    c = cl.client(control_timeout_s=1.0, timeout_s=10)
    w = Watch(cl)
    c.load_lora("a", path="/null-backend/keeps/only/the/name")
    frozen_through(cl, w, "e1", lambda: c.pause("abort", lora="a"))
    cl.kill("e1", signal.SIGCONT)
    wait_until(lambda: converged(c, "e1", ["a"]), 10, "e1 paused for adapter a")
    assert c.health()["intended"]["paused"] == ["a"]
    with w.during():
        c.resume(lora="a")
    wait_until(lambda: converged(c, "e1", []), 10, "e1 resumed for adapter a")
    res = c.generate([[7, 8, 9]] * 4, {"max_tokens": 4}, lora="a", timeout_s=10)
    assert all(len(r.token_ids) == 4 for r in res)
    assert w.close() == [], w.summary()


def test_an_engine_restarted_while_the_cluster_is_paused_comes_up_paused(cluster_factory):
    cl = cluster_factory(2, backend=NULL, model="null", backend_options=NULL_OPTIONS)
    cl.wait_ready(2, timeout_s=60)
    c = cl.client(control_timeout_s=5.0, timeout_s=10)
    w = Watch(cl)
    with w.during():
        c.pause("abort")
    try:
        old = c.health()["engines"]["e1"]["incarnation"]
        cl.kill("e1")  # SIGKILL, then a new process under the same id
        cl.start_engine("e1")
        wait_until(lambda: c.health()["engines"]["e1"]["incarnation"] != old, 30, "the new e1 to register")
        wait_until(lambda: converged(c, "e1", [ALL]), 30, "the new e1 to join, paused")
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):  # held on the paused engines: nobody serves it
            c.generate([4, 5, 6], {"max_tokens": 4}, timeout_s=0.5)
        assert time.monotonic() - t0 >= 0.4
    finally:
        with w.during():
            c.resume()
    wait_until(lambda: converged(c, "e1", []) and converged(c, "e0", []), 10, "both engines to resume")
    serves(c, "e1")
    assert w.close() == [], w.summary()


def test_a_half_awake_cluster_brings_a_new_or_awake_engine_to_the_same_tags():
    """SkyRL's order leaves the cluster with weights awake and the KV cache
    asleep: an engine that joins then (or reports itself fully awake) is put
    to sleep and its weights woken, never left gated or serving."""
    st_ = IntendedState(retry_s=0.0)
    st_.issued(P.Sleep(level=2), None, 1, set())
    st_.issued(P.WakeUp(tags=["weights"]), None, 2, set())
    assert st_.cluster.asleep == {"kv_cache"} and st_.cluster.sleep == 2
    st_.add("new")
    assert st_.join_ops("new") == [P.Sleep(level=2), P.WakeUp(tags=["weights"])]
    # an engine that reports itself awake converges in two corrections
    h = Harness()
    h.client(P.Sleep(level=1), targeted=False, lost=True)
    h.client(P.WakeUp(tags=["weights"]), targeted=False, lost=True)
    h.settle()
    assert h.eng.asleep == {"kv_cache"} and SLEEP_SCOPE in h.eng.gate
    assert h.st.describe("e")["asleep"] == ["kv_cache"]
    h.client(P.WakeUp(tags=["kv_cache"]), targeted=False, lost=False)
    h.settle()
    assert not h.eng.asleep and not h.eng.gate
