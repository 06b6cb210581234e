"""Token prompts in, engine-core requests out; engine-core batches in, StepOutputs out.

What vLLM's InputProcessor would do for a token prompt, done here without a
renderer, tokenizer pass or detokenizer (``build_request``), and the reverse
of OutputProcessor without RequestOutput objects (``OutputBuffer``).

`api` is the namespace from ``vllm/engine_core.load_vllm_api()`` (vLLM's
classes), or the CPU test's fake: nothing here imports vLLM.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from bus.frames import logprobs_wanted, top_k_of
from engine_node.backend import BackendError, PromptLogprobsOut, SeqRequest, StepOutput

# vllm.v1.engine.FinishReason (an IntEnum) -> the backend protocol's reasons.
# "repetition" (vLLM's repetitive-pattern detector) ended the sequence on the
# engine's own terms, like a stop token: the node must not re-submit it.
FINISH_REASONS: dict[int, str] = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "stop"}


def sampling_params(
    api: Any, seq: SeqRequest, *, max_model_len: int, generation_config: dict[str, Any], eos_token_id: int | None
) -> Any:
    """vLLM SamplingParams for one sequence, with InputProcessor's defaults:
    max_tokens capped by the room left in max_model_len, eos / stop ids from the
    model's generation config (update_from_generation_config), DELTA outputs,
    no detokenization. logprobs=0 is vLLM's "the sampled token's logprob only".

    Issue 10: min_tokens (the node already subtracted tokens of earlier
    submissions), min_p and the three penalties map 1:1; logprobs=k asks for
    the sampled token + top-k; prompt_logprobs comes from the SeqRequest (the
    node asks once per sample). Stop strings are NOT given to vLLM: the engine
    node matches them on its own detokenizer (engine_node/detokenize.py), so
    vLLM never detokenizes. After a re-submission vLLM counts the earlier output
    as prompt: repetition_penalty stays exact (prompt + output), presence /
    frequency penalties then see only the tokens generated since."""
    p = seq.params
    room = max_model_len - len(seq.prompt)
    if room < 1:
        raise BackendError(
            f"prompt of {len(seq.prompt)} tokens leaves no room in max_model_len={max_model_len}", field="prompt"
        )
    if not seq.prompt:
        raise BackendError("empty prompt", field="prompt")
    sp = api.SamplingParams(
        n=1,
        max_tokens=max(1, min(int(seq.max_new_tokens), room)),
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=max(0, int(p.top_k)),  # vLLM 0.24: 0 (or -1) disables top-k
        seed=seq.seed,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=bool(p.ignore_eos),
        logprobs=top_k_of(p.logprobs) if logprobs_wanted(p.logprobs) else None,
        prompt_logprobs=seq.prompt_logprobs,
        min_tokens=int(p.min_tokens),
        min_p=float(p.min_p),
        repetition_penalty=float(p.repetition_penalty),
        presence_penalty=float(p.presence_penalty),
        frequency_penalty=float(p.frequency_penalty),
        output_kind=api.RequestOutputKind.DELTA,
        detokenize=False,
    )
    if seq.routes_from is not None:
        # vLLM returns the prompt's routes from here at prefill, then each
        # step's input token's (issue 37); it must leave one prompt token.
        sp.routed_experts_prompt_start = routes_prompt_start(seq)
    sp.update_from_generation_config(generation_config, eos_token_id)
    return sp


def routes_prompt_start(seq: SeqRequest) -> int:
    """vLLM's routed_experts_prompt_start for a sequence whose routes are wanted
    from position routes_from on (< len(prompt) by vLLM's assert: rows before
    routes_from that this returns are dropped by the node)."""
    return max(0, min(int(seq.routes_from or 0), len(seq.prompt) - 1))


def prefix_salt(weights_epoch: int, cache_salt: str | None) -> str | None:
    """vLLM's cache_salt for a request: the backend's weight-version salt
    (weights changed: no block computed on older weights may be reused) and
    the caller's own salt (SamplingParams.cache_salt), both or either; None
    when neither is set (vLLM's unsalted hashes)."""
    parts = [f"w{weights_epoch}" if weights_epoch else "", f"u{cache_salt}" if cache_salt else ""]
    return "|".join(p for p in parts if p) or None


def build_request(
    api: Any, request_id: str, seq: SeqRequest, params: Any, lora_request: Any, cache_salt: str | None = None
) -> Any:
    return api.EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(seq.prompt),
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=lora_request,
        cache_salt=cache_salt,
        data_parallel_rank=None,
        external_req_id=request_id,
    )


def chosen_logprobs(new_logprobs: Any, n: int) -> list[float] | None:
    """The sampled tokens' logprobs from an EngineCoreOutput's LogprobsLists:
    rows = this step's generated tokens, column 0 = the sampled token (vLLM's
    sampler puts it first, then the top-k)."""
    if new_logprobs is None:
        return None
    lp = new_logprobs.logprobs
    rows = [float(lp[i][0]) for i in range(min(n, len(lp)))]
    return rows


def top_logprobs(new_logprobs: Any, n: int, k: int) -> tuple[list[int], list[float]]:
    """Columns 1..k of the LogprobsLists rows (the batch may carry more
    columns, for another request's larger k), flat row-major."""
    ids: list[int] = []
    lps: list[float] = []
    tid, tlp = new_logprobs.logprob_token_ids, new_logprobs.logprobs
    for i in range(min(n, len(tlp))):
        ids.extend(int(x) for x in tid[i][1 : k + 1])
        lps.extend(float(x) for x in tlp[i][1 : k + 1])
    return ids, lps


class _PromptAcc:
    """Prompt logprobs of one request, gathered over chunked-prefill outputs:
    `new_prompt_logprobs_tensors` rows are prompt positions 1.. (column 0 =
    the prompt token, then the top-k)."""

    def __init__(self, prompt_len: int, k: int) -> None:
        self.out = PromptLogprobsOut(k=k, logprobs=[math.nan], top_ids=[0] * k, top_logprobs=[math.nan] * k)
        self.left = prompt_len - 1

    def add(self, tensors: Any) -> PromptLogprobsOut | None:
        _ids, lps = tensors[0], tensors[1]
        ids = _ids.tolist() if hasattr(_ids, "tolist") else list(_ids)
        vals = lps.tolist() if hasattr(lps, "tolist") else list(lps)
        k = self.out.k
        for row_ids, row_lps in zip(ids, vals, strict=True):
            self.out.logprobs.append(float(row_lps[0]))
            self.out.top_ids.extend(int(x) for x in row_ids[1 : k + 1])
            self.out.top_logprobs.extend(float(x) for x in row_lps[1 : k + 1])
        self.left -= len(vals)
        return self.out if self.left <= 0 else None


class OutputBuffer:
    """Engine-core output not yet returned by step(), one StepOutput per
    request, in arrival order. Owned by the node's loop thread."""

    def __init__(self) -> None:
        self.items: dict[str, StepOutput] = {}  # request id -> merged output
        self.kv_stats: dict[str, Any] = {}
        # Cumulative, for benchmarks (stats()): one batch = one core step's output.
        self.counters: dict[str, int] = {"core_batches": 0, "core_outputs": 0, "core_max_outputs": 0}
        self.top_k: dict[str, int] = {}  # request id -> top-k logprobs it asked for (> 0)
        self.prompt: dict[str, _PromptAcc] = {}  # request id -> prompt logprobs being gathered
        # issue 37: request id -> the sequence position of its next routed-experts row
        self.route_pos: dict[str, int] = {}

    def expect(self, request_id: str, seq: SeqRequest) -> None:
        """Register what a new request's outputs will carry (issue 10)."""
        k = top_k_of(seq.params.logprobs) if logprobs_wanted(seq.params.logprobs) else 0
        if k:
            self.top_k[request_id] = k
        if seq.prompt_logprobs is not None:
            self.prompt[request_id] = _PromptAcc(len(seq.prompt), seq.prompt_logprobs)
        if seq.routes_from is not None:
            self.route_pos[request_id] = routes_prompt_start(seq)

    def forget(self, request_id: str) -> None:
        self.top_k.pop(request_id, None)
        self.prompt.pop(request_id, None)
        self.route_pos.pop(request_id, None)

    def _routes(self, so: StepOutput, request_id: str, rows: Any) -> None:
        """EngineCoreOutput.routed_experts ([rows, layers, top_k]: the prompt's
        from routed_experts_prompt_start at prefill, then one per step for its
        input token) -> positions on the StepOutput (merged outputs: appended)."""
        pos = self.route_pos.get(request_id)
        if pos is None:
            return
        arr = np.asarray(rows)
        if so.routed_experts is None:
            so.routed_experts, so.routes_start = arr, pos
        else:
            so.routed_experts = np.concatenate([so.routed_experts, arr], axis=0)
        self.route_pos[request_id] = pos + len(arr)

    def add_batch(self, batch: Any, seq_of: dict[str, str]) -> list[str]:
        """Merge one EngineCoreOutputs. Outputs of request ids not in `seq_of`
        (aborted: late arrivals) are dropped. Returns the request ids that finished."""
        finished: list[str] = []
        outs = batch.outputs or ()
        c = self.counters
        c["core_batches"] += 1
        c["core_outputs"] += len(outs)
        c["core_max_outputs"] = max(c["core_max_outputs"], len(outs))
        for o in outs:
            sid = seq_of.get(o.request_id)
            if sid is None:
                continue
            so = self.items.get(o.request_id)
            lps = chosen_logprobs(o.new_logprobs, len(o.new_token_ids))
            if so is None:
                so = self.items[o.request_id] = StepOutput(sid, [], [] if lps is not None else None)
            so.token_ids.extend(o.new_token_ids)
            if lps is not None:
                if so.logprobs is None:
                    so.logprobs = []
                so.logprobs.extend(lps)
                k = self.top_k.get(o.request_id, 0)
                if k:
                    ti, tl = top_logprobs(o.new_logprobs, len(o.new_token_ids), k)
                    so.top_ids = (so.top_ids or []) + ti
                    so.top_logprobs = (so.top_logprobs or []) + tl
            re = getattr(o, "routed_experts", None)
            if re is not None:
                self._routes(so, o.request_id, re)
            plt = getattr(o, "new_prompt_logprobs_tensors", None)
            acc = self.prompt.get(o.request_id)
            if plt is not None and acc is not None:
                done = acc.add(plt)
                if done is not None:
                    so.prompt_logprobs = done
                    del self.prompt[o.request_id]
            if o.finish_reason is not None:
                self.forget(o.request_id)
                so.finish_reason = FINISH_REASONS.get(int(o.finish_reason), "error")
                finished.append(o.request_id)
        st = getattr(batch, "scheduler_stats", None)
        if st is not None:
            self.kv_stats = {
                "kv_usage": float(getattr(st, "kv_cache_usage", 0.0) or 0.0),
                "engine_running": int(getattr(st, "num_running_reqs", 0) or 0),
                "engine_waiting": int(getattr(st, "num_waiting_reqs", 0) or 0),
            }
            # vLLM's PrefixCacheStats are per interval (reset on each report):
            # summed here into counters (prompt tokens looked up / found cached).
            pc = getattr(st, "prefix_cache_stats", None)
            if pc is not None:
                c["prefix_cache_queries"] = c.get("prefix_cache_queries", 0) + int(getattr(pc, "queries", 0) or 0)
                c["prefix_cache_hits"] = c.get("prefix_cache_hits", 0) + int(getattr(pc, "hits", 0) or 0)
        return finished

    def pop(self, request_id: str) -> StepOutput | None:
        return self.items.pop(request_id, None)

    def take(self) -> list[StepOutput]:
        out = list(self.items.values())
        self.items.clear()
        return out
