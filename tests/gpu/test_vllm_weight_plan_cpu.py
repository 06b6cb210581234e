"""CPU tests of the weight plan (engine_node.backends.vllm_weight_plan): learned
from a vLLM-shaped model's own load_weights, replayed as copies, and equal to
load_weights bit for bit. Runs in CI (no GPU, no vLLM)."""

from __future__ import annotations

import pytest
import torch

from bus.tensors import pack_bucket, plan_buckets, unpack_bucket
from engine_node.backends.vllm_weight_plan import WeightPlan, plannable
from tests.gpu.vllm_like import VllmLikeModel, checkpoint, same_bits, snapshot

pytestmark = pytest.mark.timeout(60)


def bucketed(named, bucket_bytes=4096):
    """The named tensors as views of packed buckets, as a worker sees them."""
    metas, sizes, tensors = plan_buckets(named, bucket_bytes)
    bufs = [pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))]
    return [nt for i, b in enumerate(bufs) for nt in unpack_bucket(i, metas, b)]


def key(named):
    return tuple((n, str(t.dtype), tuple(t.shape)) for n, t in named)


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_plan_equals_load_weights_bit_for_bit(tp_rank, tp_size):
    truth = VllmLikeModel(tp_rank, tp_size, odd=True)
    fast = VllmLikeModel(tp_rank, tp_size, odd=True)
    assert not same_bits(snapshot(truth), snapshot(fast))
    w1 = bucketed(checkpoint(truth, seed=1))
    before = snapshot(fast)
    plan = WeightPlan.record(key(w1), fast, fast.load_weights, w1)
    assert not same_bits(before, snapshot(fast)), "recording wrote to the parameters"
    # Every stacked/narrowed/padded write is planned; the odd loader and the
    # tied lm_head (skipped by the model) are left to load_weights.
    assert plan.fallback == {"model.odd.weight", "lm_head.weight"}, plan.why
    assert "no planned write" in plan.why["model.odd.weight"]
    assert "derived from the input" in plan._tainted["model.odd.weight"]
    assert len(plan.fills) == 1 and plan.fills[0].name == "model.embed_tokens.weight"
    assert not plan.ordered
    truth.load_weights(iter(w1))
    fast.load_weights(iter(w1))  # the first update: load_weights is the truth...
    assert plan.verify(dict(w1)) == []  # ...and the plan reproduces it
    # Later updates: the plan's copies + load_weights for the fallback names only.
    for seed in (2, 3):
        w = bucketed(checkpoint(truth, seed=seed), bucket_bytes=1 << 20)  # another bucket layout: same plan
        truth.load_weights(iter(w))
        n = plan.apply(dict(w))
        fast.load_weights(iter([(k, t) for k, t in w if k in plan.fallback]))
        assert n == len(plan.copies) > 0
        assert same_bits(snapshot(truth), snapshot(fast)) == [], f"seed {seed}"
    # the TP>1 rank reads strided column shards of o_proj / down_proj
    if tp_size > 1:
        c = next(c for c in plan.copies if c.name.endswith("o_proj.weight"))
        assert c.src_offset > 0 and c.src_stride[0] != c.src_size[1]


def test_verify_catches_a_plan_that_disagrees():
    m = VllmLikeModel()
    w = bucketed(checkpoint(m, seed=1))
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    m.load_weights(iter(w))
    victim = next(c for c in plan.copies if c.name.endswith("k_proj.weight"))
    victim.src_offset += 1  # a wrong plan: must be caught, that name falls back
    assert plan.verify(dict(w)) == [victim.name]
    assert victim.name in plan.fallback and all(c.name != victim.name for c in plan.copies)


def test_loader_keeping_python_state_is_never_planned():
    class DictModel(torch.nn.Module):  # keeps tensors in a dict: no parameter write at all
        def __init__(self):
            super().__init__()
            self.w = {}

        def load_weights(self, named):
            for n, t in named:
                self.w[n] = t.clone()
            return set(self.w)

    m = DictModel()
    w = [("a", torch.ones(3)), ("b", torch.zeros(2))]
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    # (its Python state did see the recording pass: the hazard the module doc names)
    assert plan.fallback == {"a", "b"} and not plan.copies


def test_arithmetic_write_taints_the_parameter():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, named):
            for _, t in named:
                self.p.data.copy_(t)
                self.p.data.mul_(2)  # e.g. a scale folded in after the copy
            return {"p"}

    m = Scaled()
    w = [("p", torch.ones(4))]
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    assert plan.fallback == {"p"} and "mul_" in plan.why["p"] and not plan.copies
    assert torch.equal(m.p, torch.zeros(4))


def test_still_valid_and_plannable():
    m = VllmLikeModel()
    w = bucketed(checkpoint(m, seed=1))
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    assert plan.still_valid(m)
    m.model.norm.weight = torch.nn.Parameter(torch.zeros(m.cfg.hidden, dtype=torch.bfloat16), requires_grad=False)
    assert not plan.still_valid(m)
    assert plannable(m) is None
    m.quant_config = object()
    assert plannable(m) == "quantized model"
