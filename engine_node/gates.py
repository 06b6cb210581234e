"""The submission gate of an engine node: which scopes are paused and which
memory tags sleep. State only; the ops that open and close it live in
engine_node/pausing.py (pause / resume) and engine_node/sleeping.py (sleep /
wake_up), the samples it holds in engine_node/request_flow.py.

A scope is ALL ("*"), a LoRA adapter's name, or SLEEP_SCOPE. A request is gated
while ALL or SLEEP_SCOPE is closed, or its own adapter's scope is.

Hazard (sleep by tags): sleep() closes SLEEP_SCOPE and puts every tag in
SLEEP_TAGS to sleep; wake_up(tags) wakes some, in any order and split, and
SLEEP_SCOPE opens only once none sleeps. The head keeps the same tag rules
(router_node/intended_state.py): change both together.

Ownership: the node's loop thread.
"""

from __future__ import annotations

import dataclasses

from bus.errors import BadRequest

ALL = "*"
SLEEP_SCOPE = "__sleep__"  # the gate scope sleep() closes
# What sleep() puts to sleep and wake_up(tags) wakes, one by one (vLLM's tags).
SLEEP_TAGS: tuple[str, ...] = ("weights", "kv_cache")


def wake_tags(tags: list[str] | None) -> frozenset[str]:
    """The tags a wake_up names (None: all); unknown ones are a BadRequest
    naming `tags` (the head runs the same check: router_node/intended_state.py)."""
    if tags is None:
        return frozenset(SLEEP_TAGS)
    unknown = sorted(set(tags) - set(SLEEP_TAGS))
    if unknown:
        raise BadRequest(f"unknown wake_up tags {unknown}; choose from {list(SLEEP_TAGS)}", field="tags")
    return frozenset(tags)


@dataclasses.dataclass(eq=False)
class Gate:
    pauses: dict[str, str] = dataclasses.field(default_factory=dict)  # scope -> pause mode
    # Tags asleep (SLEEP_TAGS); the SLEEP_SCOPE gate stays closed until none is.
    asleep: set[str] = dataclasses.field(default_factory=set)
    sleep_level: int = 0  # the level of the last sleep while any tag is asleep, else 0
    # A level-2 sleep dropped the weights and no update has written them since.
    weights_discarded: bool = False
    # Sleeps begun so far: a sleep drops the workers' kept IPC maps, so a
    # zero-copy layout kept before it is gone (engine_node/one_trip.py).
    sleeps: int = 0

    def gated(self, lora: str | None) -> bool:
        p = self.pauses
        return bool(p) and (ALL in p or SLEEP_SCOPE in p or (lora is not None and lora in p))

    def weights_asleep(self) -> bool:
        """A weight update must not write into weights that sleep offloaded or
        discarded (vLLM unmaps that memory): wake_up(['weights']) first."""
        return "weights" in self.asleep
