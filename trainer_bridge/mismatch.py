"""Rollout–trainer logprob mismatch: the per-step statistics RL frameworks log
(verl's `rollout_probs_diff_*` / `rollout_corr`, slime's and prime-rl's mismatch KL)
from the engine's logprob of every sampled token and the trainer's recomputed
logprob of the same token.

    stats = logprob_mismatch(
        [s.logprobs for s in samples],          # the engine's, one list per sample (ragged)
        [lp.detach() for lp in trainer_logps],  # the trainer's, same shapes (lists or tensors)
        versions=[s.token_versions for s in samples],
        trainer_version=version,                # the weight version the trainer holds
    )
    log(step=step, **stats.as_dict())

With Δ = trainer − rollout per token (log space):
- `mean_abs`, `max_abs`: mean and max |Δ| over every token of the step;
- `k3`: Schulman's k3 estimator of KL(rollout ‖ trainer), mean over tokens of
  exp(Δ) − 1 − Δ (unbiased for samples drawn from the rollout policy, and
  non-negative token by token);
- `frac_over`: fraction of tokens with |Δ| > `threshold` (0.1);
- `stale_frac`: fraction of tokens whose weight version is not `trainer_version`
  (None when no versions were given): a non-zero value means the rollout came
  from other weights than the trainer's, whatever the logprobs say.

Same weights and fp32 on both sides give Δ ≈ 1e-6 (different kernels, a KV
cache on the engine side); bf16 engines against a trainer give ~1e-2.

Which distribution the engine's logprobs are of: the torch backend and vLLM
(its default `logprobs_mode="raw_logprobs"`) both return log_softmax of the raw
model logits, BEFORE temperature, top-k, top-p, min-p and penalties. That is the
distribution the tokens were sampled from only with temperature 1 and none of
the others; `sampled_is_raw(params)` says whether a request's params are such
(and `require_sampled_is_raw` raises naming the first field that is not).
Otherwise the statistics compare the trainer with the raw model, not with the
sampler: scale the trainer's logits the same way before comparing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

DEFAULT_THRESHOLD = 0.1

# Sampling fields whose non-neutral value makes the sampled distribution differ
# from the raw log_softmax the engines report: (field, neutral test).
_NEUTRAL: tuple[tuple[str, Any], ...] = (
    ("temperature", lambda v: v is None or float(v) == 1.0),
    ("top_k", lambda v: v is None or int(v) in (0, -1)),
    ("top_p", lambda v: v is None or float(v) >= 1.0),
    ("min_p", lambda v: v is None or float(v) <= 0.0),
    ("repetition_penalty", lambda v: v is None or float(v) == 1.0),
    ("presence_penalty", lambda v: v is None or float(v) == 0.0),
    ("frequency_penalty", lambda v: v is None or float(v) == 0.0),
    ("min_tokens", lambda v: v is None or int(v) == 0),
)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One step's statistics over every token of every sample given."""

    tokens: int
    mean_abs: float
    max_abs: float
    k3: float
    frac_over: float
    threshold: float
    stale_frac: float | None = None

    def as_dict(self, prefix: str = "mismatch_") -> dict[str, float | int | None]:
        return {prefix + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _flat(rows: Sequence[Any], what: str) -> list[torch.Tensor]:
    out = []
    for i, r in enumerate(rows):
        if r is None:
            raise ValueError(f"{what}[{i}] is None: ask the engines for logprobs (params logprobs=True)")
        t = r.detach() if isinstance(r, torch.Tensor) else torch.as_tensor(r)
        out.append(t.to(device="cpu", dtype=torch.float64).reshape(-1))
    return out


def logprob_mismatch(
    rollout_logprobs: Sequence[Any],
    trainer_logprobs: Sequence[Any],
    *,
    versions: Sequence[Sequence[int]] | None = None,
    trainer_version: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> Mismatch:
    """Statistics of Δ = trainer − rollout over ragged samples: sample i's
    two rows (lists of floats or 1-D tensors, any device/dtype) must have the
    same length, else ValueError naming the sample. `versions` (per-token weight
    versions, e.g. SampleOutput.token_versions) with `trainer_version` adds the
    fraction of tokens from other weights. No token at all: zeros."""
    if len(rollout_logprobs) != len(trainer_logprobs):
        raise ValueError(
            f"trainer_logprobs: {len(trainer_logprobs)} samples, rollout_logprobs: {len(rollout_logprobs)}"
        )
    ro, tr = _flat(rollout_logprobs, "rollout_logprobs"), _flat(trainer_logprobs, "trainer_logprobs")
    for i, (a, b) in enumerate(zip(ro, tr, strict=True)):
        if a.numel() != b.numel():
            raise ValueError(f"trainer_logprobs[{i}]: {b.numel()} tokens, rollout_logprobs[{i}]: {a.numel()}")
    stale = _stale_frac(versions, trainer_version, [a.numel() for a in ro])
    n = sum(a.numel() for a in ro)
    if n == 0:
        return Mismatch(0, 0.0, 0.0, 0.0, 0.0, threshold, stale)
    d = torch.cat(tr) - torch.cat(ro)
    if not bool(torch.isfinite(d).all()):
        bad = int((~torch.isfinite(d)).nonzero()[0])
        raise ValueError(f"logprobs: a non-finite difference at flat token {bad} (a -inf logprob of a sampled token?)")
    a = d.abs()
    k3 = torch.expm1(d) - d  # exp(Δ) − 1 − Δ ≥ 0, computed without cancellation for small Δ
    return Mismatch(
        tokens=n,
        mean_abs=float(a.mean()),
        max_abs=float(a.max()),
        k3=float(k3.mean()),
        frac_over=float((a > threshold).double().mean()),
        threshold=threshold,
        stale_frac=stale,
    )


def _stale_frac(versions: Sequence[Sequence[int]] | None, trainer_version: int | None, lens: list[int]) -> float | None:
    if versions is None or trainer_version is None:
        return None
    if len(versions) != len(lens):
        raise ValueError(f"versions: {len(versions)} samples, rollout_logprobs: {len(lens)}")
    stale = total = 0
    for i, (v, n) in enumerate(zip(versions, lens, strict=True)):
        if len(v) != n:
            raise ValueError(f"versions[{i}]: {len(v)} tokens, rollout_logprobs[{i}]: {n}")
        stale += sum(1 for x in v if x != trainer_version)
        total += n
    return stale / total if total else 0.0


def sampled_is_raw(params: Mapping[str, Any] | Any) -> str | None:
    """None when tokens sampled with `params` (a dict or SamplingParams) come
    from the raw distribution the engines' logprobs describe; else the name of
    the first field that changes it (temperature ≠ 1, top_k, top_p, …)."""
    get = params.get if isinstance(params, Mapping) else lambda k, d=None: getattr(params, k, d)
    for field, neutral in _NEUTRAL:
        if not neutral(get(field, None)):
            return field
    t = get("temperature", None)
    if t is not None and not math.isfinite(float(t)):
        return "temperature"
    return None


def require_sampled_is_raw(params: Mapping[str, Any] | Any) -> None:
    """ValueError naming the field when the engines' logprobs are not of the
    distribution the tokens are sampled from (see the module docstring)."""
    field = sampled_is_raw(params)
    if field is not None:
        raise ValueError(
            f"params.{field}: the engines report logprobs of the raw model (before temperature, top-k/p, "
            f"min-p, penalties); with this {field} the sampled distribution differs, so a mismatch against "
            "the trainer measures the sampler, not the weights"
        )
