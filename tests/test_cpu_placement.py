"""engine_node/cpu_placement.py: whole physical cores for the vLLM engine's
processes, per GPU slot, never shared between slots or with the node."""

from __future__ import annotations

import pytest

from engine_node.cpu_placement import gpu_slot, physical_cores, plan

pytestmark = pytest.mark.timeout(30)


def smt2(n_cores: int):
    """Linux numbering of an SMT-2 machine: cpu c and c + n_cores share a core."""

    def siblings(c: int) -> frozenset[int]:
        base = c % n_cores
        return frozenset({base, base + n_cores})

    return siblings


def test_cores_group_siblings_and_skip_half_allowed_ones():
    sib = smt2(4)  # cpus 0-7, cores {0,4} {1,5} {2,6} {3,7}
    assert physical_cores(range(8), sib) == [frozenset({0, 4}), frozenset({1, 5}), frozenset({2, 6}), frozenset({3, 7})]
    # cpu 7 not allowed: core {3,7} is shared with someone else, never dedicated
    assert frozenset({3, 7}) not in physical_cores(range(7), sib)


def test_slots_take_disjoint_cores_from_the_end_and_the_node_keeps_the_rest():
    sib = smt2(8)  # 16 cpus
    p0 = plan(range(16), 1, slot=0, siblings=sib)
    p1 = plan(range(16), 1, slot=1, siblings=sib)
    assert p0.why_not is None and p1.why_not is None
    assert p0.dedicated == [frozenset({7, 15})] and p1.dedicated == [frozenset({6, 14})]
    assert not (p0.dedicated[0] & p1.dedicated[0])
    assert not (p1.rest & (p0.dedicated[0] | p1.dedicated[0])), "slot 1's node avoids slot 0's cores too"
    assert p0.rest == frozenset(range(16)) - {7, 15}
    tp2 = plan(range(16), 2, slot=1, siblings=sib)  # TP=2: core + 2 workers... 2 dedicated per slot
    assert tp2.dedicated == [frozenset({4, 12}), frozenset({5, 13})]


def test_no_room_leaves_everything_unpinned_and_says_why():
    p = plan(range(2), 1, slot=0, siblings=lambda c: frozenset({c}))  # this CI machine: 2 cpus
    assert p.dedicated == [] and p.rest == frozenset({0, 1})
    assert "needs 1 + 2" in (p.why_not or "")
    assert plan(range(16), 1, slot=7, siblings=smt2(8)).why_not  # 8 cores: slot 7 needs 8 + 2


def test_slot_is_the_first_visible_gpu():
    assert gpu_slot({"CUDA_VISIBLE_DEVICES": "3,4"}) == 3
    assert gpu_slot({}) == 0
    assert gpu_slot({"CUDA_VISIBLE_DEVICES": "GPU-uuid"}) == 0
