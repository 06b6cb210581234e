"""Prefix-aware placement (`--policy prefix`): a request without a session goes
to the engine most likely to hold its prompt's prefix in its KV cache, as
SGLang's `cache_aware` and vllm-router's cache-aware policies do.

How: the prompt's first `max_blocks` blocks of `block_tokens` token ids (16,
vLLM's block size) become a chain of hashes (block i's hash covers blocks
0..i). Each engine has a bounded LRU table of the chains placed on it; the
request goes to the engine holding the LONGEST matching chain, ties to the
least outstanding load. Without a match: least-loaded. A hit is refused for
balance when the chosen engine's outstanding sequences exceed the
least-loaded candidate's by more than `imbalance_abs` AND more than
`imbalance_rel` times as many: then least-loaded wins (SGLang's two
thresholds). The chosen engine records the request's chain (its cache will
hold it next).

What it does not know: what an engine's cache really evicted. The table is
an estimate from placements alone (no I/O, no engine report), so an engine
restart or eviction is invisible to it; `forget` (an engine that went silent,
stalled or was removed) drops that engine's table, and an engine that is not
a candidate (unhealthy, stale, converging) is never matched.

Bounds: at most `table_blocks` hashes per engine (LRU), the index holds each
(engine, hash) pair once; hashing stops after `max_blocks` blocks.

Ownership: the router loop thread. Pure state: no sockets, no clocks.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from typing import Any

from bus import protocol as P
from bus.frames import TOKEN_BYTES
from router_node.registry import EngineEntry


class PrefixPlacement:
    def __init__(
        self,
        *,
        block_tokens: int = 16,
        max_blocks: int = 256,
        table_blocks: int = 65536,
        imbalance_abs: int = 32,
        imbalance_rel: float = 1.5,
    ) -> None:
        for name, v in (("block_tokens", block_tokens), ("max_blocks", max_blocks), ("table_blocks", table_blocks)):
            if v < 1:
                raise ValueError(f"--prefix-{name.replace('_', '-')} must be >= 1, got {v}")
        if imbalance_abs < 0 or imbalance_rel < 1.0:
            raise ValueError(
                f"--prefix-imbalance-abs must be >= 0 and --prefix-imbalance-rel >= 1.0, "
                f"got {imbalance_abs} and {imbalance_rel}"
            )
        self.block_bytes = block_tokens * TOKEN_BYTES
        self.max_blocks = max_blocks
        self.table_blocks = table_blocks
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.tables: dict[str, collections.OrderedDict[int, None]] = {}  # engine -> its chains (LRU order)
        self.index: dict[int, set[str]] = {}  # chain hash -> engines holding it
        self.stats = {"placed": 0, "hits": 0, "balanced": 0, "matched_blocks": 0}

    @classmethod
    def from_config(cls, cfg: Any) -> PrefixPlacement:
        return cls(
            block_tokens=cfg.prefix_block_tokens,
            max_blocks=cfg.prefix_max_blocks,
            table_blocks=cfg.prefix_table_blocks,
            imbalance_abs=cfg.prefix_imbalance_abs,
            imbalance_rel=cfg.prefix_imbalance_rel,
        )

    # ------------------------------------------------------------ placement

    def chain(self, prompt: bytes) -> list[int]:
        """Hashes of the prompt's first full blocks, each covering all before it."""
        step = self.block_bytes
        n = min(len(prompt) // step, self.max_blocks)
        out: list[int] = []
        h = 0
        for i in range(0, n * step, step):
            h = hash((h, prompt[i : i + step]))
            out.append(h)
        return out

    def pick(self, cands: Sequence[EngineEntry], prompt: bytes, rng: random.Random) -> EngineEntry:
        """The engine for a request with this prompt (token frame bytes); records it."""
        chain = self.chain(prompt)
        least = _least(cands, rng)
        chosen, matched = least, 0
        if chain and self.index:
            for i in range(len(chain) - 1, -1, -1):
                owners = self.index.get(chain[i])
                if not owners:
                    continue
                hit = [e for e in cands if e.engine_id in owners]
                if hit:
                    chosen, matched = _least(hit, rng), i + 1
                    break
        self.stats["placed"] += 1
        if matched:
            if self.too_busy(chosen.outstanding, least.outstanding):
                self.stats["balanced"] += 1
                chosen = least
            else:
                self.stats["hits"] += 1
                self.stats["matched_blocks"] += matched
        self.record(chosen.engine_id, chain)
        return chosen

    def too_busy(self, chosen_load: int, least_load: int) -> bool:
        """The imbalance bound: both thresholds exceeded (SGLang's rule)."""
        return chosen_load - least_load > self.imbalance_abs and chosen_load > self.imbalance_rel * least_load

    # ------------------------------------------------------------ the table

    def record(self, engine_id: str, chain: list[int]) -> None:
        table = self.tables.get(engine_id)
        if table is None:
            table = self.tables[engine_id] = collections.OrderedDict()
        index = self.index
        for h in chain:
            if h in table:
                table.move_to_end(h)
            else:
                table[h] = None
                owners = index.get(h)
                if owners is None:
                    index[h] = {engine_id}
                else:
                    owners.add(engine_id)
        while len(table) > self.table_blocks:
            old, _ = table.popitem(last=False)
            self._unindex(old, engine_id)

    def forget(self, engine_id: str) -> None:
        """Engine gone, restarted or hung: what it cached is not counted on."""
        table = self.tables.pop(engine_id, None)
        for h in table or ():
            self._unindex(h, engine_id)

    def size(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def view(self) -> P.PrefixView:
        return P.PrefixView(**self.stats, blocks={eid: len(t) for eid, t in self.tables.items()})

    def _unindex(self, h: int, engine_id: str) -> None:
        owners = self.index.get(h)
        if owners is not None:
            owners.discard(engine_id)
            if not owners:
                del self.index[h]


def _least(cands: Sequence[EngineEntry], rng: random.Random) -> EngineEntry:
    """Fewest outstanding sequences; ties at random."""
    if len(cands) == 1:
        return cands[0]
    best = min(e.outstanding for e in cands)
    ties = [e for e in cands if e.outstanding == best]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]
