"""What the vLLM backend (node side) reuses from one weight update to the next,
so that an RL loop pushing the same zero-copy layout every step pays for its
per-tensor Python once (issue 21 §2: the one-trip update at 7B, 339 tensors).

- `Validated`: the last tensor list that passed `vllm/weights.validate`, as
  the very TensorMeta objects it was given. The engine node's one-trip op
  rebuilds its begin from the begin it kept (engine_node/one_trip.py), so the
  next update hands the SAME objects again: one identity pass instead of 339
  meta conversions and checks (~1 ms of Python on a loaded host).
- `KeptIpc`: the zero-copy IPC layout the workers keep (metas, sizes and
  handles of the last committed keep_maps update, under a token). An update
  with the same metas, sizes and handles sends the workers ONLY the token
  (`rollout_bus_apply_kept`), not 339 metas and 339 pickled handles (~135 KB
  encoded by the node, decoded by the engine core, copied by the worker).

Hazards (ownership: the backend's loop thread sets and reads both; the commit's
result callback, on vLLM's output thread, only sets `_ipc_kept` after a
success the loop thread is waiting for):
- identity, never equality, decides a `Validated` hit: a new list with equal
  contents is validated again (cheap enough, and never wrong);
- a `KeptIpc` is only a claim about the workers: they check the token and
  refuse a call whose token they do not hold (a sleep dropped their maps, a
  failed update, a restart), naming "layout": the trainer then sends the
  update with its handles (trainer_bridge/transports/one_trip.py falls back).
  The backend forgets it at every commit it sends (set again on success), at
  a sleep, and at an abort the workers saw.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any


@dataclasses.dataclass(eq=False)
class Validated:
    """The last validated tensor list: its source objects, sizes and the
    checkpoint shapes it was checked against; `metas` as the workers take them."""

    sources: list[Any]
    sizes: list[int]
    shapes: Any
    metas: list[list[Any]]

    def serves(self, sources: list[Any], sizes: list[int], shapes: Any) -> bool:
        n = len(self.sources)
        return (
            n > 0
            and len(sources) == n
            and shapes is self.shapes
            and all(map(operator.is_, sources, self.sources))
            and sizes == self.sizes
        )


@dataclasses.dataclass(eq=False)
class KeptIpc:
    """The IPC layout every worker keeps (mapped, validated) under `token`."""

    token: str
    metas: list[list[Any]]
    sizes: list[int]
    handles: list[Any]

    def serves(self, metas: list[list[Any]], sizes: list[int], handles: list[Any]) -> bool:
        # list == compares each element by identity first: the node hands the
        # same meta lists and handle bytes again, so this is pointer compares.
        return self.handles == handles and self.sizes == sizes and self.metas == metas
