"""The torch backend's issue-10 sampling math, with vLLM 0.24's definitions
(v1/sample/sampler.py, logits_processor/builtin.py, model_executor/layers/utils.py).

Per step, on the fp32 logits of one sequence, in vLLM's order:

1. raw logprobs = log_softmax(logits) — what `logprobs` (chosen + top-k) report;
2. min_tokens: while fewer than `min_tokens` tokens were generated, the stop ids
   (stop_token_ids, plus eos unless ignore_eos) are masked to -inf;
3. penalties: repetition (every token id in prompt + output: a positive logit is
   divided by it, a negative one multiplied), then frequency (minus
   penalty × count in the output) and presence (minus penalty if present in the
   output);
4. greedy: argmax here; else temperature → min_p (tokens whose probability is
   below min_p × the top probability are masked) → top-k → top-p → draw.

Prompt logprobs: logprob of prompt[i] given prompt[:i] from the prefill's
logits, NaN at position 0, plus the top-k at each position.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine_node.backend import PromptLogprobsOut


def has_penalties(p: Any) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_min_tokens(logits: torch.Tensor, generated: int, min_tokens: int, stop_ids: Iterable[int]) -> torch.Tensor:
    ids = list(stop_ids)
    if generated < min_tokens and ids:
        logits = logits.clone()
        logits[torch.tensor(ids, dtype=torch.long)] = float("-inf")
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt: Sequence[int],
    output: Sequence[int],
    repetition: float,
    presence: float,
    frequency: float,
) -> torch.Tensor:
    vocab = logits.numel()
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        if prompt:
            seen[torch.tensor(list(prompt), dtype=torch.long)] = True
        if output:
            seen[torch.tensor(list(output), dtype=torch.long)] = True
        pen = torch.where(seen, torch.tensor(repetition, dtype=logits.dtype), torch.tensor(1.0, dtype=logits.dtype))
        logits = logits * torch.where(logits > 0, 1.0 / pen, pen)
    if output and (presence != 0.0 or frequency != 0.0):
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=vocab)[:vocab].to(logits.dtype)
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    return scaled.masked_fill(probs < probs.max() * min_p, float("-inf"))


def top_logprobs(logp: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The k best (ids, logprobs) of a [vocab] or [n, vocab] logprob tensor, flat, best first."""
    v, i = torch.topk(logp, k, dim=-1)
    return i.reshape(-1).tolist(), v.reshape(-1).tolist()


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], k: int) -> PromptLogprobsOut:
    """From the prefill's logits [P, vocab] (fp32): per prompt token its logprob
    given the prefix (NaN at 0) and the top-k (row 0: zeros / NaN)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    ids = torch.tensor(list(prompt[1:]), dtype=torch.long)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist() if len(prompt) > 1 else []
    out = PromptLogprobsOut(k=k, logprobs=[math.nan, *chosen])
    if k > 0:
        out.top_ids = [0] * k
        out.top_logprobs = [math.nan] * k
        if len(prompt) > 1:
            ti, tv = top_logprobs(logp, k)
            out.top_ids += ti
            out.top_logprobs += tv
    return out
