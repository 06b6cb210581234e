"""Issue 34, "nothing can be replayed, rolled back or held" (rows 4, 5, 6, 7,
15): versions only move up, update ids are bound to the head, pauses are held
per holder, the head's own timeout bounds every phase of an update, and a
vanished trainer's lease converges the engines to the head's intent."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import protocol as P
from bus.auth import read_token
from bus.codec import Codec
from bus.errors import BadRequest, ControlError, StaleUpdate
from router_node.cluster_state import ClusterWeights
from tests.cluster import wait_until

NULL = {"backend": "null", "model": "null"}


def _warm(c: Any, n: int) -> int:
    """A null engine imports torch at its first prepare (bus/tensors.py,
    lazily): seconds on a loaded 2-core machine, during which it may miss
    heartbeats or outlast a short weight_txn_timeout_s. Update until one lands
    on every engine and they all serve; returns the cluster version then."""

    def landed() -> bool:
        try:
            c.update_weights([("warm", torch.zeros(1))], timeout_s=30)
        except Exception as e:  # warming up: the next try tells
            print("warm-up:", repr(e)[:200])
            return False
        h = c.health()
        return sum(e["healthy"] for e in h["engines"].values()) == n

    wait_until(landed, 90, "a first update to land on every engine", interval=0.5)
    return int(c.health()["weight_version"])


# ---------------------------------------------------------------- row 4: no replay, no I/O


def test_update_ids_are_bound_to_the_head_and_a_counter_not_to_a_bounded_memory() -> None:
    cw = ClusterWeights(incarnation="h1")
    assert cw.next_update_id == "h1.1"
    meta = [P.TensorMeta("w", "float32", [1], 0, 0, 4)]
    for n in range(1, 200):  # far more than any table of ended ids would keep
        uid = cw.next_update_id
        cw.begin(P.BeginWeightUpdate(uid, "zmq", meta, [4]), ["e0"], client=b"t", now=float(n))
        cw.decide_abort(cw.current, "done")  # type: ignore[arg-type]
    with pytest.raises(StaleUpdate, match=r"not newer than the last update this head began \(h1\.199\)") as e:
        cw.begin(P.BeginWeightUpdate("h1.2", "zmq", meta, [4]), ["e0"], client=b"t", now=1e3)  # update #2, replayed
    assert e.value.field == "update_id" and "next_update_id ('h1.200')" in e.value.message
    # A previous head's id (a replay across a head restart), or one no head minted.
    for uid in ("h0.500", "u1", "h1.x"):
        with pytest.raises(StaleUpdate, match="was not minted by this head"):
            cw.begin(P.BeginWeightUpdate(uid, "zmq", meta, [4]), ["e0"], client=b"t", now=1e3)
    assert cw.current is None and cw.update_seq == 199  # refusals change nothing
    cw.begin(P.BeginWeightUpdate("h1.250", "zmq", meta, [4]), ["e0"], client=b"t", now=1e3)  # any newer n
    assert cw.next_update_id == "h1.251"


def test_the_engine_refuses_a_commit_whose_version_is_not_above_its_own() -> None:
    from engine_node.core import RequestCore
    from engine_node.weight_update import WeightUpdates
    from tests.scripted_backend import ScriptedBackend

    b = ScriptedBackend()
    core = RequestCore(b, b.info(), "e0")
    up = WeightUpdates(b, core, "e0", "inproc://w")
    core.weight_version = 7
    meta = [P.TensorMeta("w", "float32", [2], 0, 0, 8)]
    for version in (7, 3):
        res = up.begin(P.BeginWeightUpdate(f"h.{version}", "zmq", meta, [8]))
        if hasattr(res, "then"):
            res.then(res.op.future.result())  # type: ignore[union-attr]
        up.on_bucket(f"h.{version}", 0, memoryview(bytes(8)))
        assert isinstance(up.prepare(P.PrepareWeights(f"h.{version}")), P.WeightsPrepared)
        with pytest.raises(BadRequest, match=f"names weight version {version}, not above e0's 7") as e:
            up.commit(P.FinishWeightUpdate(f"h.{version}", version=version))
        assert e.value.field == "version" and up.current is None  # aborted, nothing written
    assert b.commits == 0 and core.weight_version == 7


# ---------------------------------------------------------------- row 4: a replay on a real cluster


class RawTrainer:
    """A trainer speaking the wire protocol by hand (no trainer_bridge), so the
    exact frames it sends can be kept and replayed later, as a peer that
    captured them would."""

    def __init__(self, cl: Any, engine: dict[str, Any]) -> None:
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.token = read_token(cl.token_file)
        # Both sockets hold the client credential of the handshake (bus/roles.py): the
        # replay is by a peer that may connect (a token holder), the worst case for row 4.
        self.front = self.ctx.socket(zmq.DEALER)
        cl.credential().apply(self.front, None)
        self.front.connect(cl.frontend)
        self.weights = self.ctx.socket(zmq.DEALER)
        cl.credential().apply(self.weights, None)
        self.weights.connect(engine["weight_address"])
        self.sent: list[tuple[Any, list[Any]]] = []
        self.n = 0

    def close(self) -> None:
        for s in (self.front, self.weights):
            s.close(linger=0)
        self.ctx.term()

    def send(self, sock: Any, frames: list[Any]) -> Any:
        frames = [bytes(f) for f in frames]
        self.sent.append((sock, frames))
        return self.resend(sock, frames)

    def resend(self, sock: Any, frames: list[Any]) -> Any:
        sock.send_multipart(frames)
        assert sock.poll(15_000), "no answer within 15 s"
        return self.codec.decode(sock.recv_multipart())[0]

    def control(self, op: Any) -> Any:
        self.n += 1
        msg = P.Control(request_id=f"raw-{self.n}", op=op, timeout_s=10, token=self.token)
        return self.send(self.front, self.codec.encode(msg))

    def update(self, uid: str, value: float) -> list[Any]:
        data = torch.full((4,), value, dtype=torch.float32).numpy().tobytes()
        meta = [P.TensorMeta("w", "float32", [4], 0, 0, 16)]
        begin = self.control(P.BeginWeightUpdate(uid, "zmq", meta, [16]))
        secret = getattr(begin, "sender_secret", "")  # the opener's credential for its senders (row 3)
        return [
            begin,
            self.send(self.weights, self.codec.encode(P.WeightBucket(uid, 0, sender_secret=secret), [data])),
            self.send(self.weights, self.codec.encode(P.WeightSenderEnd(uid, 0, 1, sender_secret=secret))),
            self.control(P.FinishWeightUpdate(uid, version=None, sender_secret=secret)),
        ]


@pytest.mark.timeout(150)
def test_a_captured_update_replayed_after_many_more_is_refused(cluster_factory):
    """Row 4: update #2's Begin / bucket / end / Finish(version=None), captured
    and replayed verbatim after 65 more updates (more than the 64 ended ids
    the head remembered on fe0cb18, where the replay committed again)."""
    cl = cluster_factory(1, **NULL)
    c = cl.client()
    c.wait_ready(1, 60)
    _warm(c, 1)  # update #1 (or a few), through the client
    raw = RawTrainer(cl, c.engines()[0])
    try:
        uid = c.health().get("next_update_id") or "u-two"  # (fe0cb18 minted none: any id)
        replies = raw.update(uid, 2.0)  # update #2: its frames are kept
        assert isinstance(replies[0], P.ControlReply) and not replies[0].errors, replies
        assert isinstance(replies[3], P.ControlReply) and replies[3].results, replies
        captured = list(raw.sent)
        for i in range(65):
            c.update_weights([("w", torch.full((4,), 3.0 + i))])
        h0, e0 = c.health(), c.engines()[0]
        committed = h0["updates_committed"]
        assert committed >= 67
        begin, bucket, end, finish = (raw.resend(s, f) for s, f in captured)
        assert isinstance(begin, P.Error) and begin.code == "stale_update" and begin.field == "update_id", begin
        assert "not newer than the last update this head began" in begin.message
        assert isinstance(bucket, P.WeightBucketAck) and not bucket.ok  # no such update open on the engine
        assert isinstance(finish, P.Error) and finish.code == "stale_update", finish
        h1, e1 = c.health(), c.engines()[0]
        assert (h1["weight_version"], h1["updates_committed"]) == (h0["weight_version"], committed)
        assert e1["weight_version"] == e0["weight_version"] == h0["weight_version"]
        assert h1["weight_update"] is None  # nothing holds the cluster
        c.update_weights([("w", torch.ones(4))])  # and the next real update lands
        assert c.health()["weight_version"] == h0["weight_version"] + 1
    finally:
        raw.close()


# ---------------------------------------------------------------- row 5: adopt the highest version


@pytest.mark.timeout(150)
def test_a_restarted_head_adopts_the_highest_version_even_when_a_behind_engine_returns_first(cluster_factory):
    """Row 5: e0 at v2, e1 stale at v1; SIGSTOP e0, kill -9 the head, restart
    it, let e1 re-register first, SIGCONT e0. fe0cb18 took v1 (the first
    joiner's), marked e0 stale and served from e1 at v1."""
    cl = cluster_factory(2, **NULL, router_args=["--adopt-window-s", "4"])
    c = cl.client(head_timeout_s=2.0)
    c.wait_ready(2, 60)
    v1 = _warm(c, 2)  # v1 on both
    v2 = v1 + 1
    c.update_weights([("w", torch.ones(4))], targets=["e0"])  # v2 on e0 only: e1 is stale
    wait_until(lambda: c.health()["stale"] == ["e1"], 10, "e1 to be stale at v1")
    assert c.health()["weight_version"] == v2
    cl.kill("e0", signal.SIGSTOP)
    try:
        cl.kill("head")
        cl.restart_head()
        wait_until(lambda: "e1" in _engines(c), 20, "e1 to re-register with the new head first")
        assert "e0" not in _engines(c)
        served: list[int] = []
        stop = threading.Event()

        def load() -> None:  # requests all along: none may be served below v2
            while not stop.is_set():
                try:
                    served.extend(c.generate([1, 2, 3], {"max_tokens": 2}, timeout_s=3).token_versions)
                except Exception:  # the head is settling: a timeout is fine, a v1 token is not
                    time.sleep(0.05)

        t = threading.Thread(target=load, daemon=True)
        t.start()
        time.sleep(1.0)
    finally:
        cl.kill("e0", signal.SIGCONT)
    try:
        wait_until(lambda: _state(c) == (v2, {"e0": "healthy", "e1": "stale"}), 30, "v2 adopted, e1 stale")
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(10)
    assert served and set(served) == {v2}, served  # never a rollback
    assert set(c.generate([1, 2, 3], {"max_tokens": 2}).token_versions) == {v2}


def _engines(c: Any) -> dict[str, Any]:
    try:
        return c.health(timeout_s=2)["engines"]
    except Exception:  # the head is restarting
        return {}


def _state(c: Any) -> tuple[int, dict[str, str]]:
    try:
        h = c.health(timeout_s=2)
    except Exception:  # the head is restarting
        return -1, {}
    return h["weight_version"], {eid: e["state"] for eid, e in h["engines"].items()}


# ---------------------------------------------------------------- row 7: the head bounds every phase


@pytest.mark.timeout(120)
def test_the_heads_txn_timeout_bounds_a_finishing_update_whatever_the_client_asked(cluster_factory):
    """Row 7: head --weight-txn-timeout-s 3; a coordinator with a huge timeout
    whose second sender rank never sends. fe0cb18 held the cluster for good
    (`UpdateInProgress ... finishing`): expired() skipped finishing updates and
    the engines' prepare waited 0.75 x the client's timeout."""
    cl = cluster_factory(1, **NULL, router_args=["--weight-txn-timeout-s", "3"])
    c = cl.client(control_timeout_s=1e6)
    c.wait_ready(1, 60)
    v0 = _warm(c, 1)
    upd = c.weight_update(senders=2, timeout_s=1e6)
    upd.__enter__()
    t0 = time.monotonic()
    upd.sender(0).send(iter([("w", torch.ones(4))]))
    err: list[BaseException] = []

    def finish() -> None:
        try:
            upd.__exit__(None, None, None)  # commit: the head prepares; rank 1 never sends
        except BaseException as e:  # the test reads it below
            err.append(e)

    t = threading.Thread(target=finish, daemon=True)
    t.start()
    wait_until(lambda: c.health()["weight_update"] is None, 12, "the head to end the update by its own timeout")
    t.join(10)
    took = time.monotonic() - t0
    assert not t.is_alive() and err, "the commit must end, with an error"
    assert isinstance(err[0], (ControlError, StaleUpdate)), err
    assert took < 10, took
    assert c.health()["weight_version"] == v0
    c.update_weights([("w", torch.zeros(4))], timeout_s=30)  # the next trainer gets the cluster
    assert c.health()["weight_version"] == v0 + 1


# ---------------------------------------------------------------- row 6: pauses held per holder


def test_a_resume_releases_only_its_senders_hold_while_another_holder_keeps_the_pause() -> None:
    from router_node import leases as L
    from router_node.intended_state import IntendedState
    from router_node.lease_hooks import LEASE_HOOKS, resume_held
    from router_node.leases import Leases

    a, b, c = b"trainer-a", b"trainer-b", b"stranger"
    ls, it = Leases(lease_s=5.0), IntendedState()

    def op(client: bytes, o: Any, now: float = 1.0) -> list[P.Resume] | None:
        msg = P.Control(request_id="r", op=o)
        held = resume_held(ls, it, client, msg)
        if held is None:  # published as sent: the intent and the hooks follow it
            it.issued(o, None, 1, set())
            LEASE_HOOKS[type(o)](ls, it, client, msg, now)
        for r in held or []:  # the router publishes these cluster-wide (ClusterControl.release)
            it.issued(r, None, 2, set())
        return held

    assert op(a, P.Pause()) is None and op(b, P.Pause()) is None  # two holders of "*"
    assert op(b, P.Resume()) == []  # B's hold only: nothing to publish, "*" stays paused
    assert ls.holders(L.pause(None)) == [a] and sorted(it.cluster.paused) == ["*"]
    assert op(c, P.Resume()) == []  # a client holding nothing changes nothing either
    assert op(b, P.Pause(lora="x")) is None  # B pauses adapter x; A still holds "*"
    # A lets go of everything: B's "x" stays paused, "*" (nobody's now) is lifted.
    assert op(a, P.Resume()) == [P.Resume(lora="*")]
    assert ls.holders(L.pause(None)) == [] and ls.holders(L.pause("x")) == [b]
    assert sorted(it.cluster.paused) == ["x"]
    assert op(a, P.Resume(lora="x")) == []  # not A's to lift
    assert op(a, P.Resume(force=True)) is None  # forced: published, every holder's hold released
    assert ls.clients == {} and it.cluster.paused == {}


@pytest.mark.timeout(120)
def test_another_trainers_pause_and_resume_inside_paused_leave_the_cluster_paused(cluster_factory):
    """Row 6: trainer A inside `with client.paused():`, trainer B pause() then
    resume(). fe0cb18: is_paused() False, tokens generated inside A's block."""
    cl = cluster_factory(1, **NULL, router_args=["--lease-s", "5"])
    cl.wait_ready(1)
    a, b = cl.client(), cl.client()
    box: list[Any] = []
    with a.paused("keep"):
        b.pause("keep")
        assert b.resume() == {}  # B's own hold released; A's keeps the engines paused
        assert a.is_paused() and b.is_paused()
        t = threading.Thread(target=lambda: box.append(b.generate([1, 2, 3], {"max_tokens": 3})), daemon=True)
        t.start()
        t.join(1.5)
        assert not box, "a token was generated inside A's paused block"
        assert a.is_paused()
    t.join(30)  # A's resume lets it run
    assert box and box[0].token_ids and not a.is_paused()
    a.pause("keep")
    b.resume(force=True)  # the explicit override releases every holder
    assert not a.is_paused()


# ---------------------------------------------------------------- row 15: lease expiry converges


class _SimEngine:
    """An engine's pause gate as engine_node/pausing.py runs it (ops in
    publish order; acks and heartbeat snapshots reach the head later, in
    order per kind, interleaved as the test draws)."""

    def __init__(self) -> None:
        self.gate: set[str] = set()
        self.inbox: list[tuple[int, Any]] = []
        self.acks: list[tuple[int, Any]] = []
        self.hbs: list[tuple[list[str], int]] = []
        self.acked_seq = 0

    def step(self) -> None:
        seq, op = self.inbox.pop(0)
        if isinstance(op, P.Pause):
            scope = op.lora or "*"
            self.gate.add(scope)
            result: Any = P.PauseResult(mode=op.mode, scope=scope)
        else:
            scopes = sorted(self.gate) if op.lora is None else [s for s in [op.lora] if s in self.gate]
            self.gate -= set(scopes)
            result = P.ResumeResult(scopes=scopes, still_paused=sorted(self.gate))
        self.acked_seq = max(self.acked_seq, seq)
        self.acks.append((seq, result))


class _SimHead:
    """The head's I/O-free parts wired as router_node/router.py and control.py
    wire them: IntendedState, Leases (with the lease hooks and resume_held),
    the ack deadlines and the corrective ops of the health tick."""

    def __init__(self, engines: list[str], lease_s: float = 2.0, deadline_s: float = 1.0) -> None:
        from router_node.intended_state import IntendedState
        from router_node.leases import Leases

        self.it = IntendedState(converge_timeout_s=deadline_s, retry_s=0.3)
        self.ls = Leases(lease_s)
        self.deadline_s = deadline_s
        self.now, self.seq = 0.0, 0
        self.engines = {eid: _SimEngine() for eid in engines}
        self.pending: dict[int, tuple[set[str], float, set[str]]] = {}
        self.alive = {b"A": True, b"B": True}
        for eid in engines:
            self.it.add(eid)

    def publish(self, op: Any, targets: list[str] | None = None, *, corrective: bool = False) -> None:
        self.seq += 1
        tg = list(self.engines) if targets is None else targets
        for eid in tg:
            self.engines[eid].inbox.append((self.seq, op))
        self.pending[self.seq] = (set(tg), self.now + self.deadline_s, set())
        self.it.issued(op, targets, self.seq, set(tg), corrective=corrective)

    def control(self, client: bytes, op: Any) -> None:
        from router_node.lease_hooks import LEASE_HOOKS, resume_held

        if not self.alive[client]:
            return
        msg = P.Control(request_id="r", op=op)
        self.ls.seen(client, self.now)
        held = resume_held(self.ls, self.it, client, msg)
        if held is not None:
            for r in held:
                self.publish(r)  # ClusterControl.release
            return
        self.publish(op)
        LEASE_HOOKS[type(op)](self.ls, self.it, client, msg, self.now)

    def advance(self, dt: float) -> None:
        from router_node.lease_hooks import lease_release

        self.now += dt
        for c, alive in self.alive.items():
            if alive:
                self.ls.seen(c, self.now)
        for x in self.ls.tick(self.now):
            self.publish(lease_release(x))  # router._lease_expired
        for seq, (tg, deadline, acked) in list(self.pending.items()):
            if self.now >= deadline:
                self.it.expired(seq, sorted(tg - acked), self.now)
                del self.pending[seq]

    def deliver_ack(self, eid: str) -> None:
        seq, result = self.engines[eid].acks.pop(0)
        self.it.acked(eid, seq, ok=True, result=result, now=self.now)
        if seq in self.pending:
            self.pending[seq][2].add(eid)

    def snapshot(self, eid: str) -> None:
        e = self.engines[eid]
        e.hbs.append((sorted(e.gate), e.acked_seq))

    def deliver_hb(self, eid: str) -> None:
        paused, acked_seq = self.engines[eid].hbs.pop(0)
        self.it.heartbeat(eid, P.Heartbeat(eid, "inc", paused=paused, acked_seq=acked_seq))

    def evaluate(self, eid: str) -> None:
        fix = self.it.evaluate(eid, self.now)
        if fix is not None:
            self.publish(fix, [eid], corrective=True)  # ClusterControl.correct

    def settle(self) -> None:
        """Nothing new happens: every message arrives, every deadline passes,
        the health tick runs; until nothing is left to do."""
        until = self.now + self.ls.lease_s + 1.0  # a dead client's lease runs out first
        for _ in range(60):
            self.advance(0.5)
            for eid, e in self.engines.items():
                while e.inbox:
                    e.step()
                while e.acks:
                    self.deliver_ack(eid)
                self.snapshot(eid)
                while e.hbs:
                    self.deliver_hb(eid)
                self.evaluate(eid)
            if self.now > until and not self.pending and all(not e.inbox for e in self.engines.values()):
                if all(self.it.converging(eid) is None for eid in self.engines):
                    return


_ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "pause",
                "resume",
                "force",
                "pause_x",
                "resume_x",
                "kill",
                "tick",
                "step",
                "ack",
                "snap",
                "hb",
                "eval",
                "lose",
            ]
        ),
        st.sampled_from([b"A", b"B"]),
        st.sampled_from(["e0", "e1"]),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_ACTIONS)
def test_lease_expiry_in_any_interleaving_converges_engines_to_the_heads_intent(actions: list[Any]) -> None:
    """Row 15 (I/O-free): clients pause, resume and die at any point, acks and
    heartbeats arrive late, an op may be lost on its way (a PUB drop): once
    things settle, every engine's gate is what the head intends, the head
    intends paused only what a live client holds, and every pause a live client
    has not let go of (its own resume, or someone's resume(force=True)) holds."""
    h = _SimHead(["e0", "e1"])
    inside: dict[bytes, set[str]] = {b"A": set(), b"B": set()}  # what each live client holds paused
    for what, client, eid in actions:
        e = h.engines[eid]
        if what in ("pause", "pause_x") and h.alive[client]:
            h.control(client, P.Pause(mode="abort", lora="x" if what == "pause_x" else None))
            inside[client].add("x" if what == "pause_x" else "*")
        elif what in ("resume", "resume_x") and h.alive[client]:
            h.control(client, P.Resume(lora="x" if what == "resume_x" else None))
            inside[client] -= {"x"} if what == "resume_x" else {"*", "x"}
        elif what == "force" and h.alive[client]:
            h.control(client, P.Resume(force=True))
            inside = {c: set() for c in inside}  # the explicit release of every holder
        elif what == "kill":
            h.alive[client] = False  # kill -9: no more pings, no more ops
            inside[client] = set()
        elif what == "tick":
            h.advance(0.7)
        elif what == "step" and e.inbox:
            e.step()
        elif what == "ack" and e.acks:
            h.deliver_ack(eid)
        elif what == "snap":
            h.snapshot(eid)
        elif what == "hb" and e.hbs:
            h.deliver_hb(eid)
        elif what == "eval":
            h.evaluate(eid)
        elif what == "lose" and e.inbox:
            e.inbox.pop(0)  # never reaches the engine
    h.settle()
    live = {r[1] for c, lease in h.ls.clients.items() if h.alive[c] for r in lease.holds if r[0] == "pause"}
    assert set(h.it.cluster.paused) <= live, (sorted(h.it.cluster.paused), sorted(live))
    held = set().union(*inside.values())  # a pause a live client did not let go of stays (row 6)
    assert held <= set(h.it.cluster.paused), (sorted(held), sorted(h.it.cluster.paused))
    for eid, e in h.engines.items():
        assert e.gate == set(h.it.engines[eid].intent.paused) == set(h.it.cluster.paused), (eid, e.gate)


_TRAINER = """
import sys, time
from trainer_bridge import Client
c = Client(sys.argv[1], control_timeout_s=30)
with c.paused():
    print("PAUSED", flush=True)
    time.sleep(600)  # killed -9 here
"""


@pytest.mark.timeout(150)
def test_trainer_killed_inside_paused_under_load_converges_every_engine(cluster_factory):
    """Row 15 (real processes): a trainer kill -9'd inside paused() while other
    clients stream requests at the cluster (parked by the pause), and a live
    client holds an adapter's pause: the lease resumes the trainer's scope on
    every engine (and only its own: fe0cb18 sent a plain Resume() that lifted
    the live client's adapter pause too), the head's intent and every
    engine's gate agree, and the parked requests complete."""
    import os
    import subprocess
    import sys

    from tests.cluster import ROOT, child_env

    lease_s = 1.5
    cl = cluster_factory(2, **NULL, router_args=["--lease-s", str(lease_s)])
    cl.wait_ready(2)
    other = cl.client(timeout_s=120)
    other.pause("keep", lora="x")  # a live holder of another scope
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, cl.frontend], env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    results: list[Any] = []
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "PAUSED"
        load = [
            threading.Thread(
                target=lambda: results.append(other.generate([[1, 2, 3]] * 32, {"max_tokens": 64, "ignore_eos": True})),
                daemon=True,
            )
            for _ in range(4)
        ]
        for t in load:
            t.start()
        time.sleep(0.5)
        assert not results and other.is_paused()
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)

        def converged() -> bool:
            h = other.health()
            gates = [e.get("paused") for e in h["engines"].values()]
            return h["intended"]["paused"] == ["x"] and gates == [["x"], ["x"]] and not h["converging"]

        wait_until(converged, lease_s + 20, "the lease to resume the trainer's scope and the intent to agree")
        assert other.is_paused(lora="x")
        for t in load:
            t.join(60)
        other.resume(lora="x")
        assert not other.is_paused(lora="x")
        assert len(results) == 4 and all(len(r) == 32 and all(len(x.token_ids) == 64 for x in r) for r in results)
    finally:
        if trainer.poll() is None:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(10)
        if trainer.stdout is not None:
            trainer.stdout.close()
