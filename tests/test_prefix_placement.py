"""Prefix-aware placement (`--policy prefix`, router_node/prefix.py): the
policy's properties without I/O, then once through a real head with two
null-backend engines (this test is about routing: no model needed)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.frames import pack_tokens
from router_node.prefix import PrefixPlacement

pytestmark = pytest.mark.timeout(120)

NULL = {"backend": "null", "model": "null"}


class _E:
    """An engine as placement sees it: id and outstanding sequences."""

    def __init__(self, eid: str, outstanding: int = 0) -> None:
        self.engine_id = eid
        self.outstanding = outstanding


def _prompt(system: int, question: int, n_system: int = 64, n_question: int = 40) -> bytes:
    """A shared 'system prompt' (by id) then a question (by id): token frame bytes."""
    return pack_tokens([1000 + system] * n_system + [5000 + (question * 7 + i) % 900 for i in range(n_question)])


def test_same_prefix_goes_to_the_same_engine_while_healthy():
    pp, rng = PrefixPlacement(), random.Random(0)
    es = [_E(f"e{i}") for i in range(4)]
    first = {q: pp.pick(es, _prompt(0, q), rng) for q in range(8)}
    for q in range(8):
        for _ in range(7):  # the group's other samples, each sent alone
            assert pp.pick(es, _prompt(0, q), rng) is first[q]
    assert pp.stats["hits"] == 7 + 56  # prompts 1-7 matched the system prompt on their first request


def test_without_a_match_the_least_loaded_engine_is_chosen_and_load_breaks_ties():
    pp, rng = PrefixPlacement(), random.Random(0)
    es = [_E("e0", 5), _E("e1", 1), _E("e2", 3)]
    assert pp.pick(es, _prompt(1, 1), rng).engine_id == "e1"
    # Both e0 and e2 hold the same prefix now: the less loaded of the two wins.
    pp.record("e0", pp.chain(_prompt(2, 2)))
    pp.record("e2", pp.chain(_prompt(2, 2)))
    assert pp.pick(es, _prompt(2, 2), rng).engine_id == "e2"
    # The longest match wins over load: e0 holds the whole prompt, e2 only the system part.
    pp.record("e0", pp.chain(_prompt(3, 9)))
    pp.record("e2", pp.chain(_prompt(3, 1)))
    assert pp.pick(es, _prompt(3, 9), rng).engine_id == "e0"


def test_a_prompt_shorter_than_one_block_is_placed_by_load():
    pp, rng = PrefixPlacement(block_tokens=16), random.Random(0)
    es = [_E("e0", 2), _E("e1", 0)]
    assert pp.chain(pack_tokens([1] * 15)) == []
    assert pp.pick(es, pack_tokens([1] * 15), rng).engine_id == "e1"


def test_an_unhealthy_or_forgotten_engines_prefixes_move():
    pp, rng = PrefixPlacement(), random.Random(0)
    e0, e1 = _E("e0"), _E("e1")
    home = pp.pick([e0, e1], _prompt(0, 1), rng)
    other = e1 if home is e0 else e0
    # Not a candidate (unhealthy, stale, converging): never matched; the prefix
    # is recorded on the engine that got it, so it stays there after.
    assert pp.pick([other], _prompt(0, 1), rng) is other
    other.outstanding, home.outstanding = 1, 0  # the old home is less loaded, holds it too:
    assert pp.pick([e0, e1], _prompt(0, 1), rng) is home  # both hold it; load breaks the tie
    pp.forget(home.engine_id)  # it went silent / restarted: its cache is not counted on
    assert home.engine_id not in pp.tables
    assert all(home.engine_id not in owners for owners in pp.index.values())
    home.outstanding = 0
    other.outstanding = 3  # within the imbalance bound: the prefix follows `other`
    assert pp.pick([e0, e1], _prompt(0, 1), rng) is other


def test_the_imbalance_bound_sends_a_hit_to_the_least_loaded_engine():
    pp, rng = PrefixPlacement(imbalance_abs=4, imbalance_rel=2.0), random.Random(0)
    e0, e1 = _E("e0"), _E("e1", 100)
    assert pp.pick([e0, e1], _prompt(0, 0), rng) is e0
    e0.outstanding, e1.outstanding = 10, 6  # 4 more (not > abs): the hit stands
    assert pp.pick([e0, e1], _prompt(0, 0), rng) is e0
    e0.outstanding, e1.outstanding = 11, 6  # 5 more but not 2x: the hit stands
    assert pp.pick([e0, e1], _prompt(0, 0), rng) is e0
    e0.outstanding, e1.outstanding = 13, 6  # 7 more and > 2x: least-loaded
    assert pp.pick([e0, e1], _prompt(0, 0), rng) is e1
    assert pp.stats["balanced"] == 1


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 8), st.booleans()), max_size=120),
    n_engines=st.integers(1, 4),
    abs_=st.integers(0, 6),
    rel=st.floats(1.0, 3.0),
)
def test_property_imbalance_bound_holds_under_any_sequence(seq, n_engines, abs_, rel):
    """Adversarial arrivals (the same few prefixes, samples of any size,
    completions at any time): a placement never lands on an engine whose load
    exceeds the least-loaded candidate's by more than both thresholds."""
    pp, rng = PrefixPlacement(imbalance_abs=abs_, imbalance_rel=rel, block_tokens=4), random.Random(1)
    es = [_E(f"e{i}") for i in range(n_engines)]
    for system, q, n, finish in seq:
        if finish:  # some engine finishes its work
            es[q % n_engines].outstanding = 0
        least = min(e.outstanding for e in es)
        chosen = pp.pick(es, _prompt(system, q, n_system=8, n_question=4), rng)
        assert not pp.too_busy(chosen.outstanding, least)
        assert not (chosen.outstanding - least > abs_ and chosen.outstanding > rel * least)
        chosen.outstanding += n  # n > 1 samples: one engine, as today


@settings(max_examples=30, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 50), min_size=0, max_size=80), max_size=60), cap=st.integers(1, 12))
def test_property_table_memory_is_bounded_and_index_consistent(prompts, cap):
    pp, rng = PrefixPlacement(block_tokens=2, max_blocks=8, table_blocks=cap), random.Random(0)
    es = [_E("e0"), _E("e1"), _E("e2")]
    for i, p in enumerate(prompts):
        pp.pick(es, pack_tokens(p), rng)
        if i % 17 == 16:
            pp.forget("e1")
        for t in pp.tables.values():
            assert len(t) <= cap
        assert pp.size() <= cap * len(es)
        # The index holds exactly the (hash, engine) pairs the tables hold.
        pairs = {(h, eid) for eid, t in pp.tables.items() for h in t}
        assert pairs == {(h, eid) for h, owners in pp.index.items() for eid in owners}


@settings(max_examples=40, deadline=None)
@given(a=st.lists(st.integers(0, 99), min_size=16, max_size=64), b=st.lists(st.integers(0, 99), max_size=64))
def test_property_chain_hashes_depend_on_every_earlier_block(a, b):
    pp = PrefixPlacement(block_tokens=4)
    ca, cb = pp.chain(pack_tokens(a)), pp.chain(pack_tokens(b))
    assert len(ca) == len(a) // 4
    for i in range(min(len(ca), len(cb))):
        assert (ca[i] == cb[i]) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


def test_bad_knobs_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--prefix-block-tokens"):
        PrefixPlacement(block_tokens=0)
    with pytest.raises(ValueError, match="--prefix-imbalance-rel"):
        PrefixPlacement(imbalance_rel=0.5)


def test_head_with_policy_prefix_keeps_a_prompts_samples_on_one_engine(cluster_factory):
    """Through a real head: the 8 samples of each of 6 prompts (a shared
    system prompt, then a question), sent as separate requests, each land on
    one engine, and the head's stats count the hits."""
    # The head also spins between its messages here (--busy-poll-us): same answers, same guarantees.
    cl = cluster_factory(2, router_args=["--policy", "prefix", "--busy-poll-us", "200"], **NULL)
    cl.wait_ready(2)
    c = cl.client()
    params = {"max_tokens": 2, "temperature": 1.0, "ignore_eos": True}
    homes: dict[int, set[str]] = {}
    for q in range(6):
        prompt = [7] * 64 + [100 + q] * 40
        for _ in range(8):
            homes.setdefault(q, set()).add(c.generate(prompt, params).engine_id)
    assert all(len(h) == 1 for h in homes.values()), homes
    stats = c.stats()["prefix"]
    assert stats["placed"] == 48 and stats["hits"] >= 42, stats


def test_vllm_output_buffer_sums_the_prefix_cache_stats_of_each_report():
    """vLLM reports prefix-cache queries / hits per interval (log_stats=True);
    the backend's stats() counters are their sums (what the GPU bench reads)."""
    from types import SimpleNamespace as NS

    from engine_node.backends.vllm.requests import OutputBuffer

    buf = OutputBuffer()
    for queries, hits in ((1000, 0), (1100, 1000), (0, 0)):
        pc = NS(requests=1, queries=queries, hits=hits)
        buf.add_batch(NS(outputs=[], scheduler_stats=NS(kv_cache_usage=0.1, prefix_cache_stats=pc)), {})
    buf.add_batch(NS(outputs=[], scheduler_stats=None), {})  # log_stats off: no stats, no change
    assert (buf.counters["prefix_cache_queries"], buf.counters["prefix_cache_hits"]) == (2100, 1000)
