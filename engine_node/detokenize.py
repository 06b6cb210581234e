"""Incremental detokenization and stop strings, in the engine node (issue 10).

Only requests that set `stop` pay for this: the core builds a `StopMatcher`
for such a sample when it first enters the backend, and never for token-only
traffic. vLLM is never asked to detokenize; this module does what vLLM 0.24's
`v1/engine/detokenizer.py` does for a request with stop strings:

- text is decoded incrementally with the tokenizer's `DecodeStream` primed with
  the prompt (FastIncrementalDetokenizer), honouring `skip_special_tokens`;
  a tokenizer without a Rust backend falls back to decoding the whole output;
- a stop string is looked for after every token once more than `min_tokens`
  tokens exist, in the window the newest text can complete
  (`check_stop_strings`); on a match the text is cut at the stop string's
  start, or its end with `include_stop_str_in_output`;
- the token that completed the stop string is the sample's last token (tokens
  after it in the same backend step are dropped); the sample ends with
  finish_reason "stop" and `stop_reason` = the stop string, as in vLLM;
- a sample that ends on an eos / stop token id without include_stop_str_in_output
  leaves that token's text out (vLLM's `stop_terminated` rule).

The state is rebuilt from prompt + tokens so far whenever a node first sees a
sample (a failover resubmission carries them as `resume_len`); a parked sample
keeps its matcher on the node, since its tokens never change.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import structlog

from bus.errors import BadRequest

log = structlog.get_logger("rollout_bus.detokenize")


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Any:
    """The engine model's tokenizer (AutoTokenizer from the model folder), once."""
    from transformers import AutoTokenizer

    from engine_node.tiny_model import hf_quiet  # lazy: tiny_model imports torch and transformers

    with hf_quiet():
        return AutoTokenizer.from_pretrained(model)


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """vLLM's check_stop_strings: (stop string, length to cut the text to, or -1)."""
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        n = len(stop_str)
        idx = output_text.find(stop_str, max(0, len(output_text) + 1 - new_char_count - n))
        if idx == -1:
            continue
        if include_in_output:
            idx += n
            if idx >= len(output_text):
                return stop_str, -1
        return stop_str, idx
    return None


class StopMatcher:
    """Detokenizes one sample's output and finds its stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt: Sequence[int],
        stop: Sequence[str],
        *,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        prior: Sequence[int] = (),
    ) -> None:
        self.stop = list(stop)
        self.include = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.skip = skip_special_tokens
        self.text = ""
        self.num_tokens = 0
        self.matched: str | None = None
        self._last_piece = ""
        self._tok = tokenizer
        self._fast = getattr(tokenizer, "_tokenizer", None)
        self._ids: list[int] = []
        self._stream: Any = None
        if self._fast is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(prompt), skip_special_tokens=self.skip)
        for t in prior:  # rebuild from the tokens so far (they matched nothing)
            self._append(int(t))

    def _decode_next(self, tok: int) -> str:
        if self._stream is not None:
            try:
                piece = self._stream.step(self._fast, tok)
            except Exception as exc:  # vLLM's recovery: restart the stream (invalid prefix)
                # the tokenizers binding raises a bare Exception; the restart is the handling
                log.debug("decode_stream_restart", error=str(exc))
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(skip_special_tokens=self.skip)
                piece = self._stream.step(self._fast, tok)
            return piece or ""
        self._ids.append(tok)
        full = self._tok.decode(self._ids, skip_special_tokens=self.skip)
        return full[len(self._full) :] if full.startswith(self._full) else ""

    @property
    def _full(self) -> str:
        return getattr(self, "_full_text", "")

    def _append(self, tok: int) -> str:
        piece = self._decode_next(tok)
        if self._stream is None:
            self._full_text = self._full + piece
        self.text += piece
        self.num_tokens += 1
        self._last_piece = piece
        return piece

    def feed(self, tok: int) -> str | None:
        """One new output token; the matched stop string, or None."""
        if self.matched is not None:
            return self.matched
        piece = self._append(int(tok))
        if self.num_tokens <= self.min_tokens:
            return None
        hit = check_stop_strings(self.text, len(piece), self.stop, self.include)
        if hit is None:
            return None
        self.matched, cut = hit
        if cut != -1:
            self.text = self.text[:cut]
        return self.matched

    def final_text(self, stop_terminated: bool) -> str:
        """The output text when the sample ends; an eos / stop-id finish leaves
        the last token's text out unless include_stop_str_in_output."""
        if stop_terminated and self.matched is None and not self.include and self._last_piece:
            return self.text[: len(self.text) - len(self._last_piece)]
        return self.text


def make_matcher(tokenizer_of: Any, prompt: Sequence[int], params: Any, prior: Sequence[int], rid: str) -> StopMatcher:
    try:
        tok = tokenizer_of()
    except Exception as e:
        raise BadRequest(
            f"stop strings need the engine model's tokenizer, which did not load: {type(e).__name__}: {e}",
            request_id=rid,
            field="params.stop",
        ) from None
    return StopMatcher(
        tok,
        prompt,
        params.stop,
        include_stop_str_in_output=params.include_stop_str_in_output,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens,
        prior=prior,
    )
