"""What a repeated weight update reuses inside a vLLM worker, so that an RL
loop pushing the same layout every step pays for its Python bookkeeping once.

At 7B (339 checkpoint tensors, one bucket each in the trainer's zero-copy mode)
the per-update Python of the worker was ~1 ms on top of the copy: keys built
over every meta (twice), the bucket lengths, ~200 parameters' validity, 339
source views cut with `as_strided`, the names list. Two records in the worker's
update state (vllm/worker_apply's `_rb`) take that off the steady path:

- `Layout` (st["validated"]): the last layout whose metas passed validation
  against their buckets, with what is derived from it (the hashable layout
  key, the plan key, the names in order). A new update finds it again with ONE
  list compare of its metas and sizes as received (C-level, no tuple building).
  It holds no tensors.
- `Kept` (st["kept"]): the buckets of the last update, the plan, and the
  `Replay` (the plan's source views cut from those buckets, grouped for
  launch). Used again when the layout is the same object, the plan the same,
  and the buckets the very same tensor objects (identity, C-level), which is
  what the trainer's kept IPC maps (keep_maps) and NCCL's reused staging give.
  With kept maps the handles are compared too, and equal handles skip the
  per-handle map lookups.

Hazard (ownership): a `Kept` holds views of its buckets, so it pins whatever
they pin: the trainer's memory for kept IPC maps, the staging buffers for NCCL.
It lives exactly as long as those may: it is dropped with the kept maps
(rollout_bus_drop_maps before a sleep, a failed update, an update without
keep_maps), at nccl_close, and at a checkpoint reload. Only buckets the worker
keeps anyway are ever put in one (st["keep_views"]); a packed IPC update's maps
are new every time and are never kept.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

import torch

from engine_node.backends.vllm.weight_plan import Replay, WeightPlan


def layout_key(metas: list[list[Any]], sizes: list[int]) -> tuple[Any, ...]:
    """The whole bucket layout (names, dtypes, shapes, places, bucket sizes), hashable."""
    return (tuple(int(x) for x in sizes), tuple((str(m[0]), str(m[1]), tuple(m[2]), *m[3:6]) for m in metas))


def plan_key(metas: list[list[Any]]) -> tuple[Any, ...]:
    """What a plan depends on: names, dtypes, shapes (not the bucket layout:
    a plan's sources are relative to each named tensor)."""
    return tuple((str(m[0]), str(m[1]), tuple(int(d) for d in m[2])) for m in metas)


@dataclasses.dataclass(eq=False)
class Layout:
    """One update layout and its derived keys (see the module doc)."""

    metas: list[list[Any]]
    sizes: list[int]
    key: tuple[Any, ...]
    plan_key: tuple[Any, ...]
    names: list[str]

    @classmethod
    def of(cls, metas: list[list[Any]], sizes: list[int]) -> Layout:
        # Deep copies (types kept, so that `same` compares like with like): the
        # caller's lists may change after (a multi-sender nccl update appends
        # its parts to the update's metas; an in-process caller owns its own).
        # Paid once per layout, on a miss.
        return cls(
            copy.deepcopy(metas), list(sizes), layout_key(metas, sizes), plan_key(metas), [str(m[0]) for m in metas]
        )

    def same(self, metas: list[list[Any]], sizes: list[int]) -> bool:
        """Equal metas and sizes (one list compare each; a tuple where a list
        was, as a shape, compares unequal: a miss, never a wrong hit)."""
        return self.sizes == sizes and self.metas == metas


@dataclasses.dataclass(eq=False)
class Kept:
    """The last update's buckets and the plan's replay cut from them."""

    layout: Layout
    plan: WeightPlan
    buckets: list[torch.Tensor]  # bucket i at index i
    replay: Replay
    handles: list[Any] | None = None  # the IPC handles they were mapped from (kept maps)

    def serves(self, layout: Layout, plan: WeightPlan, buckets: dict[int, torch.Tensor]) -> bool:
        """Same layout, same plan, and bucket i is the very tensor kept."""
        return layout is self.layout and plan is self.plan and self.same_buckets(buckets)

    def same_buckets(self, buckets: dict[int, torch.Tensor]) -> bool:
        """Bucket i is the very tensor kept, for every i (identity, C-level)."""
        n = len(self.buckets)
        return len(buckets) == n and all(map(operator.is_, map(buckets.get, range(n)), self.buckets))


def buckets_list(buckets: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [buckets[i] for i in range(len(buckets))]
