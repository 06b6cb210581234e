"""Fault injection for the poison-request tests: the torch backend, except
that a sequence whose prompt starts with POISON_PREFIX kills the engine
process (os._exit) the moment it is added: a request that kills every
engine it reaches, whatever its fields say.

`--backend tests.poison_backend:factory` (backend options: option `inner` names
the backend it wraps, "torch" by default; the rest are that backend's).
"""

from __future__ import annotations

import os
from typing import Any

POISON_PREFIX = [7, 7, 7, 7]


class _Poisoned:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def add(self, seq: Any) -> None:
        if list(seq.prompt[: len(POISON_PREFIX)]) == POISON_PREFIX:
            os._exit(17)  # what a segfault in the model would look like to the head
        self._inner.add(seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def factory(model: str, inner: str = "torch", **options: Any) -> Any:
    from engine_node.backend import load_backend

    return _Poisoned(load_backend(inner, model, **options))
