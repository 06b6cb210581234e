"""Property tests of the head's forwarding core (router_node/forwarding_core.py)
without sockets: random interleavings of requests, engine steps, deliveries,
deaths, hangs, recoveries, restarts, engine errors (timeouts), client cancels
and departures. Engines are simulated the way engine_node/core.py behaves on
the wire: a Generate's last `resume_len` prompt tokens are output it does not
send again; a Cancel ends every unfinished sample with a "cancelled" final; an
Error ends the whole request; a hung engine reads nothing until it recovers,
then answers what was queued.

Every sample's tokens are a function of (request, sample, position), so a
token that is lost, repeated, reordered or delivered to the wrong request is
seen. Properties:
- every accepted request ends with exactly one final per sample, or with
  exactly one Error after which nothing comes (a departed client gets nothing);
- a sample's tokens, in the order the client got them, are exactly the next
  ones of its sequence (after the client's own resumed tokens);
- an engine re-submitted to gets the original prompt + exactly the tokens so far;
- the ledger is empty at the end, every engine's `outstanding` is 0 (never
  negative on the way), and no engine owes finals the head waits for.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import protocol as P
from bus.errors import RolloutBusError
from bus.frames import pack_tokens, unpack_tokens
from router_node.actions import FailRequest, RelayToClient, SendToClient, SendToEngine
from router_node.config import RouterConfig
from router_node.counters import new_counters
from router_node.forwarding_core import ForwardingCore
from router_node.policies import POLICIES, SESSION_PLACEMENTS, Sessions
from router_node.registry import EngineEntry, EngineState

ENGINES = ["e0", "e1", "e2"]
CLIENTS = [b"c0", b"c1"]


def tok(req: int, sample: int, k: int) -> int:
    """The k-th output token of a sample (the same on every engine: a failover is exact)."""
    return req * 10000 + sample * 100 + k


# ------------------------------------------------------------ the simulated engines


@dataclasses.dataclass
class Leg:
    req: int
    max_tokens: int
    pos: dict[int, int]  # sample index -> output tokens so far (resumed ones included)
    base_len: int


@dataclasses.dataclass
class SimEngine:
    eid: str
    state: str = "up"  # up | hung | dead
    inbox: list[Any] = dataclasses.field(default_factory=list)
    outq: list[tuple[str, Any, list[bytes]]] = dataclasses.field(default_factory=list)
    legs: dict[str, Leg] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Request:
    req: int
    client: bytes
    rid: str
    base: list[int]
    resume: int
    samples: list[int]
    max_tokens: int
    stream: bool
    log: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    gone: bool = False
    cancelled: bool = False  # the client cancelled it (only then may a sample end "cancelled")


class Sim:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.engines: dict[str, EngineEntry] = {}
        self.sims: dict[str, SimEngine] = {}
        self.core = ForwardingCore(
            cfg,
            self.engines,
            Sessions(600.0),
            pick=POLICIES["random"],
            place_session=SESSION_PLACEMENTS["open_sessions"],
            counters=new_counters(),
        )
        self.requests: list[Request] = []
        self.current: dict[tuple[bytes, str], Request] = {}
        self.now = 0.0
        for eid in ENGINES:
            self.register(eid)

    def register(self, eid: str) -> None:
        reg = P.Register(eid, "tcp://127.0.0.1:1", "", "sim", "sim", P.PROTOCOL_VERSION, incarnation="i")
        self.engines[eid] = EngineEntry(reg=reg, sock=None, registered_at=0.0, state=EngineState.HEALTHY)  # type: ignore[arg-type]
        self.sims[eid] = SimEngine(eid)

    # ---------------------------------------------------- the shell's part

    def execute(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, SendToEngine):
                if a.engine_id in self.engines and isinstance(a.msg, P.Generate):
                    assert a.msg.request_id in self.core.parts, "a Generate for a leg the ledger does not hold"
                s = self.sims.get(a.engine_id)
                if s is not None and s.state != "dead":
                    s.inbox.append((a.msg, list(a.buffers)))
            elif isinstance(a, SendToClient):
                self.to_client(a.client, a.chunk, a.buffers)
            elif isinstance(a, RelayToClient):
                # the shell sends the frames alone, or the chunk batched with others: both say the same
                assert a.frames[0] == a.chunk and list(a.frames[1:]) == list(a.buffers), a
                self.to_client(a.client, a.frames[0], a.frames[1:])
            else:
                assert isinstance(a, FailRequest)
                r = self.current[(a.client, a.request_id)]
                r.log.append(("error", a.code))
        for e in self.engines.values():
            assert e.outstanding >= 0, f"{e.engine_id}: outstanding {e.outstanding}"

    def to_client(self, client: bytes, ch: P.Chunk, buffers: list[Any]) -> None:
        r = self.current[(client, ch.request_id)]
        r.log.append(("chunk", (ch, unpack_tokens(bytes(buffers[0])) if buffers else [])))

    # ---------------------------------------------------- client events

    def submit(self, client: bytes, rid_no: int, n: int, stream: bool, resume: int, max_tokens: int, sess: int) -> None:
        req = len(self.requests) + 1
        n = 1 if resume else n
        base = [req, 5, 6][: 1 + req % 3]
        resume = min(resume, max_tokens - 1)
        prompt = base + [tok(req, 0, k) for k in range(resume)]
        msg = P.Generate(
            request_id=f"r{rid_no}",
            params=P.SamplingParams(max_tokens=max_tokens),
            num_samples=n,
            stream=stream,
            resume_len=resume,
            session_id=f"s{sess}" if sess else None,
        )
        try:
            actions = self.core.generate(client, msg, [pack_tokens(prompt)], self.now)
        except RolloutBusError:
            return  # refused at once: not accepted, nothing owed
        r = Request(req, client, msg.request_id, base, resume, list(range(n)), max_tokens, stream)
        self.requests.append(r)
        self.current[(client, msg.request_id)] = r
        self.execute(actions)

    def live(self, r: Request) -> bool:
        return (r.client, r.rid) in self.core.flights and self.current[(r.client, r.rid)] is r

    def cancel(self, i: int) -> None:
        live = [r for r in self.requests if self.live(r)]
        if live:
            r = live[i % len(live)]
            r.cancelled = True
            self.execute(self.core.cancel(r.client, r.rid))

    def client_gone(self, client: bytes) -> None:
        for r in self.requests:
            if r.client == client and self.live(r):
                r.gone = True
                r.log.append(("gone", None))
        self.execute(self.core.client_gone(client))

    # ---------------------------------------------------- engine events

    def turn(self, eid: str) -> None:
        """The engine reads what the head sent it."""
        s = self.sims[eid]
        if s.state != "up":
            return
        for msg, buffers in s.inbox:
            if isinstance(msg, P.Cancel):
                leg = s.legs.pop(msg.request_id, None)
                for i in sorted(leg.pos if leg else {}):
                    ch = P.Chunk(request_id=msg.request_id, sample_index=i, finish_reason="cancelled", engine_id=eid)
                    ch.num_prompt_tokens = leg.base_len if leg else 0
                    s.outq.append(("chunk", ch, [b""]))
                continue
            assert msg.request_id not in s.legs, f"the head reused leg id {msg.request_id} on {eid}"
            assert msg.stream
            prompt = unpack_tokens(buffers[0])
            base_len = len(prompt) - msg.resume_len
            req = prompt[0]
            r = self.requests[req - 1]
            assert prompt[:base_len] == r.base, "a leg's prompt is not the request's"
            assert msg.params.max_tokens == r.max_tokens
            for i in range(msg.sample_offset, msg.sample_offset + msg.num_samples):
                assert prompt[base_len:] == [tok(req, i, k) for k in range(msg.resume_len)], "tokens so far"
            pos = {i: msg.resume_len for i in range(msg.sample_offset, msg.sample_offset + msg.num_samples)}
            s.legs[msg.request_id] = Leg(req, msg.params.max_tokens, pos, base_len)
        s.inbox.clear()

    def step(self, eid: str, pick: int, ntok: int, go_on: bool) -> None:
        s = self.sims[eid]
        if s.state != "up" or not s.legs:
            return
        rid = sorted(s.legs)[pick % len(s.legs)]
        leg = s.legs[rid]
        i = sorted(leg.pos)[pick % len(leg.pos)]
        pos = leg.pos[i]
        n = max(0, min(ntok, leg.max_tokens - pos))
        toks = [tok(leg.req, i, k) for k in range(pos, pos + n)]
        pos += n
        finish = "length" if pos >= leg.max_tokens else (None if go_on else "stop")
        ch = P.Chunk(request_id=rid, sample_index=i, finish_reason=finish, engine_id=eid)
        if finish:
            ch.num_prompt_tokens = leg.base_len
            del leg.pos[i]
            if not leg.pos:
                del s.legs[rid]
        else:
            leg.pos[i] = pos
        s.outq.append(("chunk", ch, [pack_tokens(toks)]))

    def fail_leg(self, eid: str, pick: int) -> None:
        """The engine ends a leg with an Error (its deadline passed)."""
        s = self.sims[eid]
        if s.state != "up" or not s.legs:
            return
        rid = sorted(s.legs)[pick % len(s.legs)]
        del s.legs[rid]
        s.outq.append(("error", P.Error(request_id=rid, code="timeout", message="deadline"), []))

    def deliver(self, eid: str, lone: bool) -> None:
        s = self.sims[eid]
        if not s.outq:
            return
        kind, msg, buffers = s.outq.pop(0)
        if kind == "error":
            self.execute(self.core.engine_error(eid, msg))
        else:
            self.execute(self.core.chunk(eid, msg, buffers, [msg, *buffers] if lone else None))

    def set_state(self, eid: str, state: EngineState, sim_state: str) -> None:
        e = self.engines[eid]
        e.state = state
        self.sims[eid].state = sim_state
        if state is not EngineState.HEALTHY:
            self.now += 0.01
            self.execute(self.core.evacuate(eid, f"{eid} {sim_state}", self.now))

    def die(self, eid: str) -> None:
        s = self.sims[eid]
        if s.state == "dead":
            return
        s.inbox.clear()
        s.legs.clear()
        self.set_state(eid, EngineState.SILENT, "dead")

    def hang(self, eid: str) -> None:
        if self.sims[eid].state == "up":
            self.set_state(eid, EngineState.STALLED, "hung")

    def recover(self, eid: str) -> None:
        if self.sims[eid].state == "hung":
            self.set_state(eid, EngineState.HEALTHY, "up")

    def restart(self, eid: str) -> None:
        """A dead engine's process comes back: it registers again (router.py)."""
        if self.sims[eid].state != "dead":
            return
        self.execute(self.core.evacuate(eid, "restarted", self.now))
        self.core.forget_engine(eid)
        self.register(eid)

    def busy(self, what: str, i: int) -> str:
        """The i-th engine with something to do for `what` (any engine when
        none has): interleavings that matter come much sooner."""
        has = {
            "turn": lambda s: s.inbox,
            "step": lambda s: s.legs,
            "fail_leg": lambda s: s.legs,
            "deliver": lambda s: s.outq,
            "die": lambda s: any(p.engine_id == s.eid for p in self.core.parts.values()),
            "hang": lambda s: any(p.engine_id == s.eid for p in self.core.parts.values()),
        }.get(what, lambda s: True)
        cands = [eid for eid in ENGINES if has(self.sims[eid])] or ENGINES
        return cands[i % len(cands)]

    # ---------------------------------------------------- the end

    def drain(self) -> None:
        for eid in ENGINES:
            self.recover(eid)
        for _ in range(10_000):
            busy = False
            for eid, s in self.sims.items():
                if s.inbox and s.state == "up":
                    self.turn(eid)
                    busy = True
                if s.legs and s.state == "up":
                    self.step(eid, 0, 3, True)
                    busy = True
                if s.outq:
                    self.deliver(eid, True)
                    busy = True
            if not busy:
                break
        for eid, s in self.sims.items():
            if s.state == "dead":
                self.restart(eid)

    def check(self) -> None:
        assert not self.core.flights and not self.core.parts, "requests left in the ledger"
        assert not self.core.ledger.retired, f"finals still owed: {self.core.ledger.retired}"
        for e in self.engines.values():
            assert e.outstanding == 0, f"{e.engine_id}: outstanding {e.outstanding}"
        for r in self.requests:
            check_request(r)


def check_request(r: Request) -> None:
    got: dict[int, list[int]] = {i: [] for i in r.samples}
    finals: dict[int, P.Chunk] = {}
    errors = 0
    gone = False
    for kind, what in r.log:
        assert not gone, f"request {r.req}: {kind} after its client left"
        assert errors == 0, f"request {r.req}: {kind} after its error"
        if kind == "gone":
            gone = True
            continue
        if kind == "error":
            errors += 1
            continue
        ch, toks = what
        assert ch.request_id == r.rid
        i = ch.sample_index
        assert i not in finals, f"request {r.req} sample {i}: a chunk after its final"
        if not r.stream:
            assert ch.finish_reason is not None, "a non-streamed request gets only finals"
        got[i] += toks
        want = [tok(r.req, i, k) for k in range(r.resume, r.resume + len(got[i]))]
        assert got[i] == want, f"request {r.req} sample {i}: tokens {got[i]} != {want}"
        if ch.finish_reason is not None:
            finals[i] = ch
            assert ch.finish_reason != "cancelled" or r.cancelled, f"request {r.req}: cancelled by nobody"
            assert ch.num_prompt_tokens == len(r.base), "num_prompt_tokens"
            if ch.finish_reason == "length":
                assert r.resume + len(got[i]) == r.max_tokens
            assert r.resume + len(got[i]) <= r.max_tokens
    if gone:
        return
    assert errors == 1 or sorted(finals) == r.samples, f"request {r.req}: finals {sorted(finals)}, errors {errors}"


# ------------------------------------------------------------ the interleavings

engine_ix = st.integers(0, len(ENGINES) - 1)
SUBMIT = st.tuples(
    st.just("submit"),
    st.integers(0, 1),  # client
    st.integers(0, 2),  # request id (reused once the last one with it ended)
    st.integers(1, 3),  # samples
    st.booleans(),  # stream
    st.integers(0, 2),  # the client's own resumed tokens
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # session (0: none)
)
ARGS = {
    "submit": SUBMIT,
    "step": st.tuples(st.just("step"), engine_ix, st.integers(0, 7), st.integers(0, 3), st.integers(0, 5).map(bool)),
    "deliver": st.tuples(st.just("deliver"), engine_ix, st.booleans()),
    "turn": st.tuples(st.just("turn"), engine_ix),
    "die": st.tuples(st.just("die"), engine_ix),
    "hang": st.tuples(st.just("hang"), engine_ix),
    "recover": st.tuples(st.just("recover"), engine_ix),
    "restart": st.tuples(st.just("restart"), engine_ix),
    "fail_leg": st.tuples(st.just("fail_leg"), engine_ix, st.integers(0, 7)),
    "cancel": st.tuples(st.just("cancel"), st.integers(0, 7)),
    "client_gone": st.tuples(st.just("client_gone"), st.integers(0, 1)),
}
# Weighted by repetition: engine steps and deliveries are most of what happens.
NAMES = ["submit"] * 4 + ["step"] * 8 + ["deliver"] * 8 + ["turn"] * 5 + [
    "die", "die", "hang", "recover", "restart", "restart", "fail_leg", "cancel", "client_gone",
]  # fmt: skip
WEIGHTED = st.lists(st.sampled_from(NAMES).flatmap(ARGS.__getitem__), min_size=20, max_size=150)


# CI: a fixed set of examples (derandomized); ROLLOUT_BUS_HYPOTHESIS_PROFILE=long
# explores new ones (ROLLOUT_BUS_HYPOTHESIS_EXAMPLES of them).
LONG = os.environ.get("ROLLOUT_BUS_HYPOTHESIS_PROFILE") == "long"
SETTINGS = settings(
    max_examples=int(os.environ.get("ROLLOUT_BUS_HYPOTHESIS_EXAMPLES", "20000" if LONG else "300")),
    derandomize=not LONG,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)


def run(sim: Sim, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        name, *args = op
        if name == "submit":
            c, rid_no, n, stream, resume, max_tokens, sess = args
            sim.submit(CLIENTS[c], rid_no, n, stream, resume, max_tokens, sess)
        elif name == "cancel":
            sim.cancel(args[0])
        elif name == "client_gone":
            sim.client_gone(CLIENTS[args[0]])
        else:
            getattr(sim, name)(sim.busy(name, args[0]), *args[1:])
    sim.drain()
    sim.check()


@pytest.mark.timeout(600)  # a failure's shrinking takes minutes; a pass, seconds
@SETTINGS
@given(
    ops=WEIGHTED,
    failover=st.booleans(),
    max_failovers=st.integers(0, 4),
    max_engine_deaths=st.integers(1, 4),
)
def test_every_request_ends_once_with_every_token_in_order(
    ops: list[tuple[Any, ...]], failover: bool, max_failovers: int, max_engine_deaths: int
) -> None:
    cfg = RouterConfig(failover=failover, max_failovers=max_failovers, max_engine_deaths=max_engine_deaths)
    run(Sim(cfg), ops)


@pytest.mark.timeout(600)
@SETTINGS
@given(ops=WEIGHTED)
def test_failover_never_gives_up_while_an_engine_is_left(ops: list[tuple[Any, ...]]) -> None:
    """Failover unbounded: a request ends in an error only when no engine was
    left to take it, or it was in flight on 8 engines that died."""
    cfg = RouterConfig(failover=True, max_failovers=1000, max_engine_deaths=8)
    sim = Sim(cfg)
    run(sim, ops)
    assert sim.core.counters["engine_dead"] <= sim.core.counters["no_healthy_engine"]


def test_stalled_engine_recovers_and_the_request_comes_back_to_it() -> None:
    """A hung engine's leg is failed over; the engine recovers and the request
    comes back to it under the same id while its "cancelled" final of the old
    leg is still on the way: that final belongs to no live leg."""
    sim = Sim(RouterConfig(max_failovers=5, max_engine_deaths=5))
    sim.die("e2")
    sim.submit(CLIENTS[0], 0, 1, True, 0, 4, 0)
    first = next(e for e, s in sim.sims.items() if s.inbox)
    other = next(e for e in ("e0", "e1") if e != first)
    sim.turn(first)
    sim.hang(first)  # evacuated to `other`, its Cancel queued at `first`
    sim.recover(first)
    sim.turn(first)  # the old leg ends "cancelled": its final is in transit
    sim.die(other)  # back to `first`, no token yet: the whole request again
    sim.turn(first)
    sim.drain()
    sim.check()


def test_resumed_request_keeps_the_clients_tokens_out_of_its_answer() -> None:
    """A client's own resumed tokens (resume_len) are in its prompt: the
    aggregated answer carries only new tokens, and a failover re-submits them
    as output (counted against max_tokens), after the client's."""
    for stream in (False, True):
        sim = Sim(RouterConfig())
        sim.submit(CLIENTS[0], 0, 1, stream, 2, 6, 0)
        first = next(e for e, s in sim.sims.items() if s.inbox)
        sim.turn(first)
        sim.step(first, 0, 1, True)
        sim.deliver(first, True)
        sim.die(first)
        sim.drain()
        sim.check()
        (r,) = sim.requests
        toks = [t for kind, what in r.log if kind == "chunk" for t in what[1]]
        assert toks == [tok(1, 0, k) for k in range(2, 6)]


@pytest.mark.parametrize("lone", [True, False])
def test_chunks_of_a_dead_engine_read_after_its_evacuation_are_dropped(lone: bool) -> None:
    sim = Sim(RouterConfig())
    sim.submit(CLIENTS[0], 0, 2, True, 0, 3, 0)
    first = next(e for e, s in sim.sims.items() if s.inbox)
    sim.turn(first)
    sim.step(first, 0, 2, True)
    outq = list(sim.sims[first].outq)
    sim.die(first)
    sim.sims[first].outq = outq  # read from its socket after the evacuation
    sim.deliver(first, lone)
    sim.drain()
    sim.check()
