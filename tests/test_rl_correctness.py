"""RL correctness on real processes (issue 9): independent samples on every
engine and across restarts, seeded requests reproducible on any engine and
across a pause(abort), no stale weights served, and the staleness bound.

The tiny model has a 512-token vocabulary and random weights: at temperature
1.0 its next-token distributions are broad, so two independent 24-token
samples collide with a probability far below 1e-30.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time

import pytest
import torch

from tests.cluster import Streams, leak_checked_cluster, wait_until

PROMPT = [11, 12, 13, 14]
UNSEEDED = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _perturbed(tiny_model: str, seed: int):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, prm in m.named_parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.05)
    return m.eval()


def _reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The oracle: transformers' own greedy generation of `n` tokens in this
    process, eos not stopping it (ignore_eos), independent of the cluster
    under test. One intra-op thread: the engines' setting for the tiny model
    (torch/backend._SMALL_MODEL_PARAMS), and two threads on a busy 2-core
    machine cost minutes here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )
    finally:
        torch.set_num_threads(threads)
    toks = out[0, len(prompt) :].tolist()
    assert len(toks) == n
    return toks


def _sixty_four(c) -> list[tuple[int, ...]]:
    """64 unseeded samples of one prompt: a batch, streams and one `sample`."""
    batch = c.generate([PROMPT] * 24, UNSEEDED)
    s = Streams(c, [PROMPT] * 20, UNSEEDED)
    tinker = c.sample(PROMPT, 20, UNSEEDED)
    s.join()
    out = [tuple(r.token_ids) for r in batch]
    out += [tuple(s.kept(i)[0]) for i in range(20)]
    out += [tuple(q.tokens) for q in tinker.sequences]
    assert len(out) == 64 and all(len(x) == 24 for x in out)
    return out


def _direct(cl, eid: str, n: int, params: dict) -> list[tuple[int, ...]]:
    """n requests straight to one engine (no router): its own stream only."""
    d = cl.client(cl.data_address(eid))
    return [tuple(d.generate(PROMPT, params).token_ids) for _ in range(n)]


@pytest.fixture(scope="module")
def module_cluster(tiny_model):
    """Two torch engines shared by the tests below that leave both healthy and
    in sync (they restart an engine and bring it back; each reads the version
    it starts from)."""
    # --direct-clients: a test below sends straight to each engine
    with leak_checked_cluster(2, backend="torch", model=tiny_model, engine_args=["--direct-clients"]) as cl:
        yield cl


@pytest.mark.timeout(240)
def test_unseeded_samples_are_independent_across_engines_requests_and_restarts(cluster_factory):
    cl = cluster_factory(3, engine_args=["--direct-clients"])  # _direct: straight to each engine
    cl.wait_ready(3)
    c = cl.client()
    first = _sixty_four(c)
    assert len(set(first)) == 64, "two unseeded samples were identical"
    # Engine by engine, the k-th request of each: the bug this guards against
    # made them equal (every engine started its stream from the same seed).
    per_engine = {eid: _direct(cl, eid, 6, UNSEEDED) for eid in ("e0", "e1", "e2")}
    every = list(itertools.chain(first, *per_engine.values()))
    assert len(set(every)) == len(every)

    # kill -9 an engine and start it again under the same id: a new incarnation,
    # so a new stream (not a replay of its last life).
    inc = {e["engine_id"]: e["incarnation"] for e in c.engines()}
    cl.kill("e1", signal.SIGKILL)
    wait_until(lambda: not c.health()["engines"].get("e1", {}).get("healthy", False), 10, "e1 to be seen dead")
    cl.start_engine("e1")
    wait_until(
        lambda: (e := c.health()["engines"].get("e1")) and e["healthy"] and e["incarnation"] != inc["e1"],
        90,
        "e1 to come back",
    )
    again = _direct(cl, "e1", 6, UNSEEDED)
    second = _sixty_four(c)
    every += again + second
    assert len(set(every)) == len(every), "a restarted engine replayed samples of its earlier life"


@pytest.mark.timeout(240)
def test_seeded_requests_are_identical_on_every_engine_and_across_a_pause(module_cluster):
    cl = module_cluster
    c = cl.client()
    seeded = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True, "seed": 1234}
    on = {eid: cl.client(cl.data_address(eid)) for eid in ("e0", "e1")}
    r0 = on["e0"].generate(PROMPT, seeded, num_samples=3)
    r1 = on["e1"].generate(PROMPT, seeded, num_samples=3)
    assert [s.token_ids for s in r0.samples] == [s.token_ids for s in r1.samples]
    assert len({tuple(s.token_ids) for s in r0.samples}) == 3  # sample i uses seed + i
    assert c.generate(PROMPT, seeded).token_ids == r0.samples[0].token_ids  # through the router too

    # A long seeded stream, once straight through and once parked by a
    # pause(abort) in the middle: the torch backend keeps the sequence's
    # generator state across the park, so the tokens are the same.
    long = {"max_tokens": 1200, "temperature": 1.0, "ignore_eos": True, "seed": 99}
    ref = c.generate(PROMPT, long, num_samples=2)
    s = Streams(c, [PROMPT], long, num_samples=2)
    wait_until(lambda: s.count(0) >= 40, 60, "the stream to start")
    res = c.pause("abort")
    parked = sum(r["parked"] for r in res.values())
    time.sleep(0.2)
    c.resume()
    s.join()
    assert parked >= 1, f"the pause parked nothing (the stream had {s.count(0)} tokens): {res}"
    for i in range(2):
        got, _, restarts = s.kept(0, sample=i)
        assert restarts == 0
        assert got == ref.samples[i].token_ids, f"sample {i} differs after the pause(abort)"


@pytest.mark.timeout(240)
def test_a_restarted_engine_is_stale_gets_no_traffic_until_synced(module_cluster, tiny_model):
    cl = module_cluster
    c = cl.client()
    v0 = c.health()["weight_version"]
    policy = None
    for v in (1, 2, 3):
        policy = _perturbed(tiny_model, seed=v)
        res = c.update_weights(policy.named_parameters())
        assert {r["weight_version"] for r in res.values()} == {v0 + v}
    v3 = v0 + 3
    assert c.health()["weight_version"] == v3
    inc = c.health()["engines"]["e1"]["incarnation"]
    cl.kill("e1", signal.SIGKILL)
    cl.start_engine("e1")  # back on its checkpoint: version 0

    def e1_back():
        e = c.health()["engines"].get("e1")
        return e if e and e["incarnation"] != inc and e["state"] == "stale" else None

    e1 = wait_until(e1_back, 90, "the restarted e1 to report stale")
    assert not e1["healthy"] and e1["stale"] and e1["weight_version"] == 0
    assert f"cluster weight version {v3}" in e1["reason"]
    h = c.health()
    assert h["stale"] == ["e1"] and sum(e["healthy"] for e in h["engines"].values()) == 1
    p = [21, 22, 23, 24]
    rs = c.generate([p] * 12, {**GREEDY, "max_tokens": 8})
    assert {r.engine_id for r in rs} == {"e0"}, "a stale engine got traffic"
    assert {v for r in rs for v in r.token_versions} == {v3}

    res = c.sync_stale(policy.named_parameters())
    assert set(res) == {"e1"} and res["e1"]["weight_version"] == v3
    wait_until(lambda: c.health()["engines"]["e1"]["healthy"], 10, "e1 to serve again")
    assert c.health()["stale"] == [] and c.health()["weight_version"] == v3
    assert c.sync_stale(policy.named_parameters()) == {}  # nothing left to sync
    rs = c.generate([p] * 12, {**GREEDY, "max_tokens": 8})
    assert {r.engine_id for r in rs} == {"e0", "e1"}
    assert {v for r in rs for v in r.token_versions} == {v3}
    assert len({tuple(r.token_ids) for r in rs}) == 1  # the same (current) weights on both


@pytest.mark.timeout(240)
def test_an_update_brings_a_stale_engine_up_to_the_new_version(module_cluster, tiny_model):
    cl = module_cluster
    c = cl.client()
    v0 = c.health()["weight_version"]
    c.update_weights(_perturbed(tiny_model, seed=1).named_parameters())
    cl.kill("e0", signal.SIGKILL)
    cl.start_engine("e0")
    wait_until(lambda: c.health()["stale"] == ["e0"], 90, "e0 to come back stale")
    res = c.update_weights(_perturbed(tiny_model, seed=2).named_parameters())
    assert {e: r["weight_version"] for e, r in res.items()} == {"e0": v0 + 2, "e1": v0 + 2}
    wait_until(lambda: all(e["healthy"] for e in c.health()["engines"].values()), 10, "both engines to serve")


@pytest.mark.timeout(240)
def test_max_staleness_regenerates_on_the_new_weights_and_reports_restarts(cluster_factory, tiny_model):
    cl = cluster_factory(1)
    cl.wait_ready(1)
    c = cl.client()
    p = [31, 32, 33]
    n = 600  # each update waits for the requests' first tokens, and lands long before the n-th
    params = {**GREEDY, "max_tokens": n}
    # Weights (and the oracle) are built before any stream starts: building
    # one takes longer than the tiny model needs for n tokens, and the update
    # must land while the requests are still running.
    new, newer, newest = (_perturbed(tiny_model, seed=k) for k in (7, 8, 9))
    # The oracle, from transformers in this process (not the cluster under
    # test): greedy on each new policy; the old weights' output differs, so a
    # sample that kept old tokens (or was never regenerated) cannot match.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    on_new, on_newer = (_reference_greedy(m, p, n) for m in (new, newer))
    on_base = _reference_greedy(base, p, 64)
    assert on_new[:64] != on_base and on_newer[:64] != on_base and on_new != on_newer, "the updates change nothing"

    # Streamed, max_staleness=0, an update in the middle.
    s = Streams(c, [p, p], params, max_staleness=0)
    wait_until(lambda: min(s.count(0), s.count(1)) >= 10, 60, "the streams to start")
    assert all(ch.weight_version == 0 for i in range(2) for ch in s.chunks[i])
    with c.paused("abort"):
        res = c.update_weights(new.named_parameters())
    assert res["e0"]["restarted"] >= 2
    s.join()
    for i in range(2):
        toks, vers, restarts = s.kept(i)
        assert restarts == 1 and s.chunks[i][-1].restarts == 1
        assert any(ch.restarts == 1 and not ch.token_ids for ch in s.chunks[i])  # told at once
        assert set(vers) == {1} and len(toks) == n
        assert toks == on_new, f"stream {i} is not greedy on the new weights from the prompt"

    # Not streamed: the result holds only the last attempt, and says so. The
    # update goes in once the engine has produced tokens of the request (its
    # heartbeat's tokens_out moved), so there is an attempt to throw away.
    out = [None]
    tokens_out = c.health()["engines"]["e0"]["tokens_out"]
    t = threading.Thread(target=lambda: out.__setitem__(0, c.generate(p, params, max_staleness=0)))
    t.start()
    wait_until(lambda: c.health()["engines"]["e0"]["tokens_out"] >= tokens_out + 10, 30, "the request's first tokens")
    with c.paused("abort"):
        c.update_weights(newer.named_parameters())
    t.join(120)
    r = out[0]
    assert r.samples[0].restarts == 1 and set(r.token_versions) == {2} and len(r.token_ids) == n
    assert r.token_ids == on_newer, "the result is not greedy on the newer weights from the prompt"

    # Without a bound the tokens of both versions are kept, each stamped.
    s = Streams(c, [p], params)
    wait_until(lambda: s.count(0) >= 10, 60, "the stream to start")
    with c.paused("abort"):
        c.update_weights(newest.named_parameters())
    s.join()
    toks, vers, restarts = s.kept(0)
    assert restarts == 0 and len(toks) == n
    assert vers[0] == 2 and vers[-1] == 3 and vers == sorted(vers)


# ---------------------------------------------------------------- no processes


class _Recorder:
    """A backend stub that records the seeds the core hands it."""

    freeze_granularity = "seq"

    def __init__(self, seeds_unseeded: bool = True) -> None:
        from engine_node.backend import BackendInfo

        self.seeds_unseeded = seeds_unseeded
        self._info = BackendInfo("rec", "rec", 64, [2], capacity=64)
        self.added: list = []

    def info(self):
        return self._info

    def loras(self):
        return []

    def num_running(self):
        return 0

    def add(self, seq):
        self.added.append(seq)


def _core(sample_seed: int, **kw):
    from engine_node.core import RequestCore

    b = _Recorder(**kw)
    return RequestCore(b, b.info(), "e0", sample_seed), b


def _submit(core, rid: str, seed: int | None, n: int = 2) -> None:
    from bus import protocol as P

    core.generate(b"c", P.Generate(request_id=rid, params=P.SamplingParams(seed=seed), num_samples=n), [5, 6])
    core.admit()


def test_seed_derivation_differs_by_engine_incarnation_and_cluster_seed():
    from engine_node.seeding import SEED_MASK, backend_seed, derive_seed

    seeds = {derive_seed(cs, eid, inc) for cs in (0, 1) for eid in ("e0", "e1") for inc in ("a", "b")}
    assert len(seeds) == 8 and all(0 <= s <= SEED_MASK for s in seeds)
    assert derive_seed(0, "e0", "a") == derive_seed(0, "e0", "a")
    assert backend_seed("vllm", 1 << 40 | 7) == 7 and backend_seed("torch", 1 << 40) == 1 << 40


def test_core_seeds_unseeded_samples_from_its_stream_and_keeps_request_seeds():
    from engine_node.seeding import derive_seed

    a, ba = _core(derive_seed(0, "e0", "x"))
    b, bb = _core(derive_seed(0, "e1", "y"))
    for core in (a, b):
        _submit(core, "u", None)
        _submit(core, "s", 40)
    ua, ub = [s.seed for s in ba.added[:2]], [s.seed for s in bb.added[:2]]
    assert len(set(ua + ub)) == 4  # unseeded: never the same on two engines
    assert [s.seed for s in ba.added[2:]] == [s.seed for s in bb.added[2:]] == [40, 41]  # seed + index
    # vLLM-style backends keep unseeded sequences unseeded (their engine seed differs).
    v, bv = _core(1, seeds_unseeded=False)
    _submit(v, "u", None)
    _submit(v, "s", 3, n=1)
    assert [s.seed for s in bv.added] == [None, None, 3]


def test_cluster_weights_follow_model_finishes_only():
    from bus import protocol as P
    from router_node.cluster_state import ClusterWeights

    cw = ClusterWeights()
    cw.on_register(2)  # a fresh head adopts what engines registered with
    assert cw.version == 2 and cw.source == "registration"
    meta = [P.TensorMeta("w", "float32", [1], 0, 0, 4)]
    cw.on_control(P.BeginWeightUpdate("u1", "zmq", meta, [4]))
    done = {"e0": P.WeightsCommitted(weight_version=3), "e1": P.Done()}
    assert cw.on_control_done(P.FinishWeightUpdate("u1", version=3), done)
    assert cw.version == 3 and cw.is_stale(2) and not cw.is_stale(3)
    cw.on_register(9)  # after an update, a registration never moves it
    assert cw.version == 3
    cw.on_control(P.BeginWeightUpdate("l1", "zmq", meta, [4], target="lora:a"))
    assert not cw.on_control_done(P.FinishWeightUpdate("l1"), {"e0": P.LoraResult(weight_version=0)})
    assert cw.version == 3


def test_registry_reports_stale_below_the_cluster_version():
    from bus import protocol as P
    from router_node.registry import EngineEntry, EngineState

    reg = P.Register("e0", "ipc://d", "ipc://w", "torch", "m", P.PROTOCOL_VERSION, "inc")
    e = EngineEntry(reg=reg, sock=None, registered_at=0.0, state=EngineState.HEALTHY, last_seen=10.0)  # type: ignore[arg-type]
    state, reason = e.evaluate(10.0, deadline_s=1.0, stall_timeout_s=5.0, cluster_version=3)
    assert state is EngineState.STALE and "cluster weight version 3" in reason
    e.weight_version = 3
    assert e.evaluate(10.0, deadline_s=1.0, stall_timeout_s=5.0, cluster_version=3)[0] is EngineState.HEALTHY
    assert e.evaluate(20.0, deadline_s=1.0, stall_timeout_s=5.0, cluster_version=4)[0] is EngineState.SILENT
