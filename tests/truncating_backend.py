"""Fault injection for the soak's token check (bench/soak.py, issue 36): a
backend that ends some requests SHORT. Every `every`-th sequence added is
handed to the wrapped backend with half its max_new_tokens, so the engine
finishes it with "length" and fewer tokens than the request asked for, the
way a lost chunk or a wrong re-submission length would look to a trainer.

`--backend tests.truncating_backend:factory` (backend options: `inner` names
the backend it wraps, "null" by default; `every`, 3 by default; the rest are
the inner backend's).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class _Truncating:
    def __init__(self, inner: Any, every: int) -> None:
        self._inner = inner
        self._every = every
        self._added = 0
        self.truncated = 0

    def add(self, seq: Any) -> None:
        self._added += 1
        if self._added % self._every == 0 and seq.max_new_tokens > 1:
            seq = dataclasses.replace(seq, max_new_tokens=seq.max_new_tokens // 2)
            self.truncated += 1
        self._inner.add(seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def factory(model: str, inner: str = "null", every: Any = 3, **options: Any) -> Any:
    from engine_node.backend import load_backend

    return _Truncating(load_backend(inner, model, **options), int(every))
