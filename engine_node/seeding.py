"""Where an engine's random numbers come from.

Every engine node draws the seeds of its unseeded sequences from ONE stream
whose seed is derived from three things:

    sample_seed = blake2b("{cluster_seed}/{engine_id}/{incarnation}")[:8] & (2**63 - 1)

- `cluster_seed`: `launch.py --seed` (default 0), the same on every engine;
- `engine_id`: so two engines of one cluster never share a stream;
- `incarnation`: a random id the node picks at every start, so an engine that
  restarts (crash, supervisor) never replays the sequences of its last life.

So unseeded samples are independent across engines, requests and restarts (and
a cluster is not replayable run to run: the incarnation is random). The
backend's own engine seed (torch backend generator, vLLM's `seed` engine
option) is derived the same way, so nothing draws from a generator that two
engines share.

Seeded requests (`SamplingParams.seed`) never touch this stream: sample i of
a request uses seed + i on whichever engine serves it.
"""

from __future__ import annotations

import hashlib
import random

SEED_MASK = (1 << 63) - 1


def derive_seed(cluster_seed: int, engine_id: str, incarnation: str) -> int:
    """The 63-bit seed of an engine incarnation's stream."""
    h = hashlib.blake2b(f"{int(cluster_seed)}/{engine_id}/{incarnation}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & SEED_MASK


def backend_seed(backend: str, seed: int) -> int:
    """The engine-level seed a backend takes: vLLM seeds Python's and numpy's
    generators with it too, and numpy takes 32 bits only."""
    return seed & 0xFFFFFFFF if backend == "vllm" else seed


class SeedStream:
    """Per-sequence seeds for unseeded samples (the node's loop thread only)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def next(self) -> int:
        return self._rng.getrandbits(63)


def request_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a seeded request: the same on every engine and
    across every park / re-submission of the sample."""
    return (seed + index) & SEED_MASK
