"""What a soak checks of every answer it gets (issue 36 row 1): each sample of a
request sent with ``ignore_eos`` and ``max_tokens=N`` must come back with
exactly N tokens and finish "length"; a stream's chunks must name samples the
request has, never follow a sample's final chunk, and never go back in weight
version. No I/O: the soak feeds it what the client returned.

Faults counted (each fails the soak):
  truncated     a sample with fewer than N tokens, or a stream that ended
                without a sample's final chunk
  duplicated    a sample with more than N tokens, a token repeated against
                the expected series, or a second final chunk for one sample
  out_of_order  a chunk for a sample index the request does not have, a chunk
                after its sample's final chunk, a weight version lower than the
                sample's previous one, or the expected tokens in another order
  wrong_finish  a finish reason other than the one asked for ("length")
  wrong_tokens  tokens that are not the expected series (only where one is
                known: the null backend's, see `null_series`)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

FAULTS = ("truncated", "duplicated", "out_of_order", "wrong_finish", "wrong_tokens")
KEEP_SAMPLES = 20

Expect = Callable[[Sequence[int], int], list[int]]


def null_series(vocab: int) -> Expect:
    """The null backend's tokens (engine_node/backends/null_backend.py): token i
    of a sample is (prompt[-1] + 1 + i) % vocab, a resumed sample continuing it."""

    def expect(prompt: Sequence[int], n: int) -> list[int]:
        return [(prompt[-1] + 1 + i) % vocab for i in range(n)]

    return expect


def classify(got: Sequence[int], n: int, finish: str | None, expected: Sequence[int] | None = None) -> list[str]:
    """The faults of one finished sample asked for exactly n tokens ("length")."""
    faults = []
    if len(got) < n:
        faults.append("truncated")
    elif len(got) > n:
        faults.append("duplicated")
    elif expected is not None and list(got) != list(expected):
        if sorted(got) == sorted(expected):
            faults.append("out_of_order")
        elif len(set(got)) < len(got) and len(set(expected)) == len(expected):
            faults.append("duplicated")
        else:
            faults.append("wrong_tokens")
    if finish != "length":
        faults.append("wrong_finish")
    return faults


@dataclass
class _Sample:
    tokens: list[int] = field(default_factory=list)
    version: int = -1
    restarts: int = 0
    finish: str | None = None


class StreamCheck:
    """One stream's chunks, in arrival order; `done()` gives its faults."""

    def __init__(self, num_samples: int) -> None:
        self.samples = [_Sample() for _ in range(num_samples)]
        self.faults: list[str] = []

    def feed(self, ch: Any) -> None:
        """`ch`: a trainer_bridge StreamChunk (sample_index, token_ids,
        weight_version, finish_reason, restarts)."""
        if not 0 <= ch.sample_index < len(self.samples):
            self.faults.append("out_of_order")
            return
        s = self.samples[ch.sample_index]
        if s.finish is not None:
            self.faults.append("duplicated" if ch.finish_reason else "out_of_order")
            return
        if ch.restarts > s.restarts:  # the staleness bound restarted the sample: its tokens begin again
            s.tokens, s.restarts, s.version = [], ch.restarts, -1
        if ch.token_ids and ch.weight_version < s.version:
            self.faults.append("out_of_order")
        if ch.token_ids:
            s.version = ch.weight_version
        s.tokens.extend(ch.token_ids)
        s.finish = ch.finish_reason

    def done(self, n: int, expected: Sequence[int] | None = None) -> list[str]:
        """Faults of the whole stream, every sample asked for n tokens."""
        out = list(self.faults)
        for s in self.samples:
            if s.finish is None:
                out.append("truncated")
            else:
                out += classify(s.tokens, n, s.finish, expected)
        return out


class Tally:
    """Checked samples and faults per request kind, with a few examples."""

    def __init__(self) -> None:
        self.checked: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.by_kind: dict[str, Counter[str]] = {}
        self.samples: list[str] = []

    def add(self, kind: str, faults: list[str], what: str = "") -> None:
        self.checked[kind] += 1
        for f in faults:
            self.faults[f] += 1
            self.by_kind.setdefault(kind, Counter())[f] += 1
        if faults and len(self.samples) < KEEP_SAMPLES:
            self.samples.append(f"{kind}: {','.join(faults)} {what}".rstrip())

    def total(self) -> int:
        return sum(self.faults.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "checked": dict(self.checked),
            **{f: self.faults[f] for f in FAULTS},
            "by_kind": {k: dict(v) for k, v in self.by_kind.items()},
            "examples": self.samples,
        }
