"""trainer_bridge/mismatch.py: the rollout -> trainer logprob statistics on known
inputs (ragged samples, lists and tensors), their errors, and which sampling
params leave the engines' (raw) logprobs equal to the sampled distribution.
That the torch backend's logprobs are the raw log_softmax (before temperature,
top-k, top-p) is tests/test_torch_backend.py's test_logprobs_match_hf."""

from __future__ import annotations

import math

import pytest
import torch

from bus.protocol import SamplingParams
from trainer_bridge.mismatch import logprob_mismatch, require_sampled_is_raw, sampled_is_raw


def test_known_inputs_over_ragged_samples():
    rollout = [[-1.0, -2.0, -0.5], [-3.0], []]
    deltas = [[0.0, 0.2, -0.05], [-0.3], []]
    trainer = [
        torch.tensor([r + d for r, d in zip(rs, ds, strict=True)], dtype=torch.float64)
        for rs, ds in zip(rollout, deltas, strict=True)
    ]
    m = logprob_mismatch(rollout, trainer)
    flat = [0.0, 0.2, -0.05, -0.3]
    assert m.tokens == 4
    assert m.mean_abs == pytest.approx(sum(abs(d) for d in flat) / 4, abs=1e-12)
    assert m.max_abs == pytest.approx(0.3, abs=1e-12)
    assert m.k3 == pytest.approx(sum(math.exp(d) - 1 - d for d in flat) / 4, rel=1e-9)
    assert m.frac_over == 0.5  # 0.2 and 0.3 are over 0.1
    assert m.stale_frac is None
    assert m.as_dict()["mismatch_tokens"] == 4 and set(m.as_dict()) >= {"mismatch_k3", "mismatch_frac_over"}


def test_k3_estimates_the_kl_of_the_rollout_policy_against_the_trainers():
    """Tokens drawn from the rollout distribution p: the mean of k3 over them
    converges on KL(p || q), computed exactly."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(16, generator=g), 0)
    q = torch.softmax(torch.randn(16, generator=g) * 0.5 + p.log(), 0)
    toks = torch.multinomial(p, 200_000, replacement=True, generator=g)
    m = logprob_mismatch([p.log()[toks]], [q.log()[toks]])
    kl = float((p * (p.log() - q.log())).sum())
    assert m.k3 == pytest.approx(kl, rel=0.03) and m.k3 > 0


def test_identical_logprobs_give_zeros_and_versions_give_the_stale_fraction():
    lp = [[-0.125, -2.5], [-1.25, -0.75, -3.0]]
    m = logprob_mismatch(lp, [torch.tensor(x, dtype=torch.bfloat16).float() for x in lp])  # exact in bf16
    assert (m.mean_abs, m.max_abs, m.k3, m.frac_over) == (0.0, 0.0, 0.0, 0.0)
    m = logprob_mismatch(lp, lp, versions=[[3, 3], [2, 3, 3]], trainer_version=3)
    assert m.stale_frac == pytest.approx(1 / 5)
    assert logprob_mismatch([], []).tokens == 0


@pytest.mark.parametrize(
    "rollout,trainer,kw,field",
    [
        ([[-1.0]], [[-1.0], [-2.0]], {}, "trainer_logprobs: 2 samples"),
        ([[-1.0, -2.0]], [[-1.0]], {}, r"trainer_logprobs\[0\]: 1 tokens"),
        ([None], [[-1.0]], {}, r"rollout_logprobs\[0\] is None"),
        ([[-1.0]], [[-1.0]], {"versions": [[1, 1]], "trainer_version": 1}, r"versions\[0\]: 2 tokens"),
        ([[float("-inf")]], [[-1.0]], {}, "non-finite"),
    ],
)
def test_bad_input_names_the_field(rollout, trainer, kw, field):
    with pytest.raises(ValueError, match=field):
        logprob_mismatch(rollout, trainer, **kw)


def test_which_params_keep_the_sampled_distribution_raw():
    assert sampled_is_raw({"temperature": 1.0, "max_tokens": 8, "logprobs": True}) is None
    assert sampled_is_raw({"top_k": -1, "top_p": 1.0}) is None
    assert sampled_is_raw(SamplingParams(max_tokens=4)) is None  # the wire defaults are neutral
    assert sampled_is_raw({"temperature": 0.7}) == "temperature"
    assert sampled_is_raw(SamplingParams(max_tokens=4, top_p=0.9)) == "top_p"
    assert sampled_is_raw({"top_k": 20}) == "top_k"
    assert sampled_is_raw({"repetition_penalty": 1.1}) == "repetition_penalty"
    with pytest.raises(ValueError, match=r"params\.min_p"):
        require_sampled_is_raw({"min_p": 0.05})
