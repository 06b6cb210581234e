"""Tinker's sample request and SampleResponse for `RolloutBusEngine.sample`
(trainer_bridge/skyrl/engine.py), without I/O: SkyRL 0.3.0's RemoteInferenceClient
sends `{"json": body}` with body = {model, prompt: {chunks: [...]},
num_samples, sampling_params (Tinker's), session_id, include_prompt_logprobs,
topk_prompt_logprobs}."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bus.errors import BadRequest, Unsupported
from trainer_bridge.sampling import Translated, translate

# Tinker SamplingParams keys → vLLM-style keys (SkyRL's _TINKER_SAMPLE_TO_VLLM_PARAM_MAP).
TINKER_PARAMS = {
    "temperature": "temperature",
    "max_tokens": "max_tokens",
    "seed": "seed",
    "top_k": "top_k",
    "top_p": "top_p",
    "stop_strings": "stop",
    "stop_tokens": "stop_token_ids",
}


@dataclasses.dataclass
class TinkerRequest:
    ids: list[int]
    tr: Translated
    with_prompt: bool  # include_prompt_logprobs
    topk: int  # topk_prompt_logprobs


def tinker_request(body: Mapping[str, Any]) -> TinkerRequest:
    prompt = body.get("prompt") or {}
    ids: list[int] = []
    for i, c in enumerate(prompt.get("chunks") or []):
        kind = c.get("type", "encoded_text")
        if kind != "encoded_text":
            raise Unsupported(f"{kind} chunks (multi-modal) are not served", field=f"prompt.chunks[{i}].type")
        ids.extend(int(t) for t in c.get("tokens") or ())
    if not ids:
        raise BadRequest("the prompt has no tokens (prompt.chunks[].tokens)", field="prompt")
    tp = dict(body.get("sampling_params") or {})
    unknown = set(tp) - set(TINKER_PARAMS)
    if unknown:
        raise BadRequest(f"unknown Tinker sampling parameter {sorted(unknown)[0]!r}", field="sampling_params")
    sp = {TINKER_PARAMS[k]: v for k, v in tp.items() if v is not None}
    topk = int(body.get("topk_prompt_logprobs") or 0)
    with_prompt = bool(body.get("include_prompt_logprobs", body.get("prompt_logprobs", False)))
    if with_prompt:
        sp["prompt_logprobs"] = topk
    sp["logprobs"] = 0  # Tinker: every sequence has its tokens' logprobs
    tr = translate(sp, prefix="sampling_params.")
    tr.num_samples = int(body.get("num_samples", 1))
    if tr.num_samples < 1:
        raise BadRequest(f"num_samples must be >= 1, got {tr.num_samples}", field="num_samples")
    return TinkerRequest(ids, tr, with_prompt, topk)


def tinker_reply(req: TinkerRequest, res: Any) -> dict[str, Any]:
    with_prompt, topk = req.with_prompt, req.topk
    first = res.samples[0] if res.samples else None
    plp = first.prompt_logprobs if (with_prompt and first is not None) else None
    top = None
    if with_prompt and topk > 0 and first is not None and first.prompt_top_ids is not None:
        top = [
            None if i == 0 else sorted(zip(tid, tlp, strict=True), key=lambda x: -x[1])[:topk]
            for i, (tid, tlp) in enumerate(zip(first.prompt_top_ids, first.prompt_top_logprobs or [], strict=False))
        ]
    return {
        "type": "sample",
        "sequences": [
            {"tokens": list(s.token_ids), "logprobs": list(s.logprobs or []), "stop_reason": s.finish_reason}
            for s in res.samples
        ],
        "prompt_logprobs": plp,
        "topk_prompt_logprobs": top,
    }
