"""OpenAI-shaped requests and replies for `RolloutBusEngine` (trainer_bridge/skyrl/engine.py),
without I/O: a request body → sampling params, generated samples → the
chat.completion / text_completion dicts vLLM's server returns (plus
`token_ids` / `prompt_token_ids`, as vLLM's `return_token_ids`). The engine
owns the awaits (tokenizer, lora lookup, generate); this module only shapes."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from bus.errors import Unsupported
from bus.frames import logprobs_wanted
from trainer_bridge.sampling import Translated, translate
from trainer_bridge.text import Text, output_text

# OpenAI request keys → vLLM-style sampling keys (None: not a sampling key).
OPENAI_KEYS: dict[str, str | None] = {
    "model": None,
    "messages": None,
    "prompt": None,
    "stream": None,
    "user": None,
    "max_completion_tokens": "max_tokens",
    "top_logprobs": None,  # folded into logprobs below
    "chat_template_kwargs": None,  # used by the chat template
    "add_generation_prompt": None,
}


def request_body(request_payload: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(session id, the request body) of `{"json": body}` or a bare body."""
    body = dict(request_payload.get("json", request_payload))
    return body.pop("session_id", None), body


def openai_params(body: Mapping[str, Any], chat: bool) -> Translated:
    sp: dict[str, Any] = {}
    for k, v in body.items():
        if k in OPENAI_KEYS:
            if name := OPENAI_KEYS[k]:
                sp[name] = v
        else:
            sp[k] = v
    if body.get("stream"):
        raise Unsupported("stream=true: use AsyncClient.stream for streaming", field="stream")
    if chat:  # chat: logprobs is a bool, top_logprobs the k
        sp["logprobs"] = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    elif body.get("echo"):
        raise Unsupported("echo needs prompt logprobs (issue 10, server-side)", field="echo")
    sp.pop("echo", None)
    return translate(sp)


def text_of(s: Any, text: Text, tr: Translated) -> str:
    """A sample's text, decoded from its ids and cut at its stop string as asked."""
    return output_text(
        text,
        s.token_ids,
        skip_special_tokens=tr.skip_special_tokens,
        stop_str=s.stop_str,
        include_stop_str_in_output=tr.params.include_stop_str_in_output,
    )


def chat_choices(samples: Sequence[Any], text: Text, tr: Translated) -> list[dict[str, Any]]:
    choices = []
    for s in samples:
        content = text_of(s, text, tr)
        lp = None
        if logprobs_wanted(tr.params.logprobs):

            def tops(i: int, s: Any = s) -> list[dict[str, Any]]:
                if s.top_ids is None or s.top_logprobs is None:
                    return []
                return [
                    {"token": text.decode([t], skip_special_tokens=False), "logprob": x, "bytes": None}
                    for t, x in zip(s.top_ids[i], s.top_logprobs[i], strict=True)
                ]

            lp = {"content": [
                {"token": text.decode([t], skip_special_tokens=False), "logprob": x, "bytes": None, "top_logprobs": tops(i)}
                for i, (t, x) in enumerate(zip(s.token_ids, s.logprobs or [], strict=False))
            ]}  # fmt: skip
        choices.append({
            "index": s.index, "message": {"role": "assistant", "content": content}, "finish_reason": s.finish_reason,
            "logprobs": lp, "token_ids": list(s.token_ids),
        })  # fmt: skip
    return choices


def completion_choices(results: Sequence[Any], text: Text, tr: Translated) -> list[dict[str, Any]]:
    choices: list[dict[str, Any]] = []
    for r in results:
        for s in r.samples:
            lp = None
            if logprobs_wanted(tr.params.logprobs):
                toks = [text.decode([t], skip_special_tokens=False) for t in s.token_ids]
                lp = {
                    "tokens": toks,
                    "token_logprobs": list(s.logprobs or []),
                    "top_logprobs": None,
                    "text_offset": None,
                }
            choices.append({
                "index": len(choices),
                "text": text_of(s, text, tr),
                "finish_reason": s.finish_reason, "logprobs": lp, "token_ids": list(s.token_ids),
            })  # fmt: skip
    return choices


def openai_reply(
    kind: str, body: Mapping[str, Any], res: Any, prompt_ids: list[int], choices: list[dict], model_name: str
) -> dict[str, Any]:
    n_out = sum(len(c["token_ids"]) for c in choices)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{res.request_id}",
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model") or model_name,
        "choices": choices,
        "prompt_token_ids": prompt_ids,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n_out,
            "total_tokens": len(prompt_ids) + n_out,
        },
    }
