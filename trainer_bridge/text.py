"""Text and chat on top of token-in/token-out: the model's tokenizer on the
client side (the engines only ever see token ids).

`Text` wraps a Hugging Face tokenizer: `encode`, `decode`, `chat` (the
model's chat template → ids) and `prompt_ids`, which turns any prompt form
the client accepts into token ids:

    [1, 2, 3]                                   token ids (unchanged)
    "some text"                                 tokenized (special tokens added)
    [{"role": "user", "content": "hi"}, ...]    the chat template, with the generation prompt

`load_text(spec)` takes a tokenizer object, a local model folder, or a `Text`.
Only local folders are read (no hub download).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from bus.errors import BadRequest


class Text:
    def __init__(self, tokenizer: Any, name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", "") or ""

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None) and "chat_template" not in template_kwargs:
            raise BadRequest(
                f"the tokenizer of {self.name or 'this model'} has no chat template; pass token ids or text",
                field="messages",
            )
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
        return list(ids)

    def render(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
        )

    def prompt_ids(self, prompt: Any) -> list[int]:
        kind = prompt_kind(prompt)
        if kind == "text":
            return self.encode(prompt)
        if kind == "chat":
            return self.chat(prompt)
        return [int(t) for t in prompt]


def prompt_kind(prompt: Any) -> str:
    """ "ids" | "text" | "chat" for one prompt."""
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, np.ndarray):
        return "ids"
    if prompt and isinstance(prompt[0], dict):
        return "chat"
    return "ids"


def is_text_prompt(prompt: Any) -> bool:
    """True for a string, a chat, or a batch of those (the forms that need a tokenizer)."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, np.ndarray) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, (str, dict)) or (
        isinstance(first, (list, tuple)) and bool(first) and isinstance(first[0], dict)
    )


def is_text_batch(prompt: Any) -> bool:
    """A list of strings or a list of chats (one chat is one prompt)."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, str) or (isinstance(first, (list, tuple)) and bool(first) and isinstance(first[0], dict))


def to_ids(text: Text, prompt: Any) -> Any:
    """One prompt or a batch, in any accepted form → token ids (same shape)."""
    if isinstance(prompt, np.ndarray):
        return prompt
    if is_text_batch(prompt) or (
        isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple, np.ndarray))
    ):
        return [text.prompt_ids(p) for p in prompt]
    return text.prompt_ids(prompt)


def output_text(
    text: Text,
    token_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    stop_str: str | None = None,
    include_stop_str_in_output: bool = False,
) -> str:
    """A sample's text, always derived from its own token ids:
    `decode(token_ids, skip_special_tokens=...)`, and when the sample ended on
    a stop string, cut at it (after it with include_stop_str_in_output, before
    it without), as vLLM cuts its text. So the text is a prefix of the decoded
    ids (equal to them when no stop string ended the sample), never the
    engine's incremental text, which can differ by a leading space (the first
    output token decoded after the prompt; issue 23).

    The match is the occurrence the *last* token completed (the engine stops
    at that token), found in the window the engine searched: not simply the
    first occurrence, because an occurrence inside the first `min_tokens`
    tokens is never checked (vLLM's rule; SkyRL sends min_tokens=1), so the
    sample goes on and may stop on a later one."""
    out = text.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if stop_str:
        before = len(text.decode(token_ids[:-1], skip_special_tokens=skip_special_tokens)) if token_ids else 0
        i = out.find(stop_str, max(0, before + 1 - len(stop_str)))
        if i < 0:  # a tokenizer whose decode is not prefix-stable: the last occurrence
            i = out.rfind(stop_str)
        if i >= 0:
            out = out[: i + (len(stop_str) if include_stop_str_in_output else 0)]
    return out


def attach_text(
    results: Any, text: Text, *, skip_special_tokens: bool = True, include_stop_str_in_output: bool = False
) -> Any:
    """Fill `text` on every sample of a GenerationResult or a list of them (see output_text)."""
    for r in results if isinstance(results, list) else [results]:
        for s in r.samples:
            s.text = output_text(
                text,
                s.token_ids,
                skip_special_tokens=skip_special_tokens,
                stop_str=s.stop_str,
                include_stop_str_in_output=include_stop_str_in_output,
            )
    return results


def load_text(spec: Any) -> Text:
    """A `Text` from a Text, a tokenizer object or a local model folder."""
    if isinstance(spec, Text):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if not os.path.isdir(path):
            raise BadRequest(
                f"tokenizer path {path!r} is not a local folder (rollout-bus never downloads)", field="tokenizer"
            )
        from transformers import AutoTokenizer

        return Text(AutoTokenizer.from_pretrained(path, local_files_only=True), name=path)
    if hasattr(spec, "encode") and hasattr(spec, "decode"):
        return Text(spec)
    raise BadRequest(
        f"tokenizer must be a tokenizer object or a local model folder, got {type(spec).__name__}", field="tokenizer"
    )
