"""What the head answers to a `Query` (and an `EndSession`): one typed body
per question, a tagged union in `QueryReply.body`. Re-exported by
bus/protocol.py.

`EngineView` is the one description of an engine: trainers read its
addresses, CURVE key, dtype and topology from it (trainer_bridge/weights.py),
never from the human-facing dicts. `Client.health()` / `engines()` / `stats()`
keep returning plain dicts (`to_dict` of these views, the same keys as
before); `Client.health_view()` / `engine_views()` return the Structs.

Ownership: built by the head's router loop (router_node/views.py,
router_node/registry.py, router_node/cluster_state.py); decoded by clients.
Hazard: the head is the CLIENT's peer here, so every bound below must hold for
everything a head can legitimately report (a refused body = a health query
that always fails): counts are non-negative int64, texts are `Message`-long.

Compatibility rule (bus/protocol.py): add fields only at the END, with a default.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from bus.wire import I32, I64, MAX_LIST, U32, U63, Id, Ids, Message, Name, Short, Version


class ViewPart(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of the nested parts of a query answer."""


class Body(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Base of a query answer (a member of `QueryBody`)."""


class IntentView(ViewPart):
    """The state the head intends (for one engine, or the whole cluster)."""

    paused: Ids = []  # scopes: "*" for all, else LoRA names
    sleeping: I32 = 0  # sleep level while any tag should be asleep
    asleep: Ids = []  # the tags that should be asleep ("weights", "kv_cache")


class EngineView(ViewPart):
    """One engine as the head sees it: its registration, its last heartbeat,
    and (health) the head's intent for it. `paused` / `sleeping` / `asleep` are
    the ack-confirmed state when the head knows one newer than the heartbeat."""

    engine_id: Id
    healthy: bool = False
    stale: bool = False
    state: Short = ""  # router_node.registry.EngineState value
    reason: Message = ""
    data_address: Name = ""
    weight_address: Name = ""
    backend: Name = ""
    model: Name = ""
    dtype: Short = ""  # weight dtype the engine expects in updates ("": not said)
    host: Name = ""
    pid: I64 = 0
    tp: I32 = 1
    pp: I32 = 1
    dp: I32 = 1
    capacity: I32 = 0
    vocab_size: I32 = 0
    max_model_len: U32 = 0
    incarnation: Id = ""
    curve_key: Short = ""  # z85 server key of its data/weight sockets ("": not secured)
    outstanding: I64 = 0  # sequences the head has in flight there
    heartbeat_age_s: float | None = None  # None: no heartbeat yet
    running: U63 = 0
    waiting: U63 = 0
    held: U63 = 0
    parked: U63 = 0
    kv_usage: float = 0.0
    weight_version: Version = 0
    paused: Ids = []
    sleeping: I32 = 0
    asleep: Ids = []
    steps: U63 = 0
    tokens_out: U63 = 0
    busy: Short = ""  # the control op in progress
    loras: Ids = []
    sessions: U63 = 0  # open sessions placed on it
    intended: IntentView | None = None  # None: the head tracks no intent for it (yet)
    converging: Message | None = None  # why its state differs from the intended one
    corrections: U63 = 0  # corrective ops the head sent it


class WeightTxnView(ViewPart):
    """A weight-update transaction the head coordinates."""

    update_id: Id
    target: Name = "model"  # "model" | "lora:NAME"
    targets: Ids = []
    transport: Short = "zmq"
    senders: I32 = 1
    prepared: Ids = []  # engines that voted yes
    decision: Short | None = None  # None: open | "commit" | "abort"
    version: Version | None = None  # the decided version (model updates)
    check_finite: bool = True
    holder: Name = ""  # the client that began it (printable)
    began_wall: float = 0.0  # epoch seconds


class PrefixView(ViewPart):
    """The prefix-cache placement policy's counters (router_node/prefix.py)."""

    placed: U63 = 0
    hits: U63 = 0
    balanced: U63 = 0
    matched_blocks: U63 = 0
    blocks: Annotated[dict[Id, U63], Meta(max_length=MAX_LIST)] = {}  # engine -> block hashes indexed


class HealthView(Body, tag="health"):
    healthy: bool = False  # some engine is healthy
    engines: Annotated[dict[Id, EngineView], Meta(max_length=MAX_LIST)] = {}
    weight_version: Version = 0  # the cluster's
    source: Short = "none"  # where the cluster version came from: "none" | "registration" | "update"
    updates_committed: U63 = 0
    weight_update: WeightTxnView | None = None  # the update holding the cluster (one at a time)
    stale: Ids = []
    intended: IntentView = msgspec.field(default_factory=IntentView)  # the cluster's
    converging: Ids = []
    vocab_size: I32 = 0
    # -- appended (issue 34): the id the next weight update's begin takes
    # ("<head incarnation>.<n>"; a replayed or stale begin is refused). "": any.
    next_update_id: Id = ""


class EnginesView(Body, tag="engines"):
    engines: Annotated[list[EngineView], Meta(max_length=MAX_LIST)] = []


class StatsView(Body, tag="stats"):
    counters: Annotated[dict[Short, I64], Meta(max_length=MAX_LIST)] = {}
    in_flight: U63 = 0
    sessions: U63 = 0
    prefix: PrefixView | None = None  # None: another placement policy


class WeightUpdatesView(Body, tag="weight_updates"):
    """Weight updates begun and not decided yet (a sender rank joins one by id)."""

    updates: Annotated[dict[Id, WeightTxnView], Meta(max_length=MAX_LIST)] = {}


class DecisionsView(Body, tag="weight_update_decisions"):
    """Every tracked update's decision (None: open; "commit": its commit round
    is still running; "abort"). A committed update leaves the table when its
    commit round is over: cuda_ipc senders free their buckets then."""

    decisions: Annotated[dict[Id, Short | None], Meta(max_length=MAX_LIST)] = {}


class SessionEnded(Body, tag="end_session"):
    """The answer to an EndSession: whether the head knew the session."""

    ended: bool = False


QueryBody = HealthView | EnginesView | StatsView | WeightUpdatesView | DecisionsView | SessionEnded

# Query.what -> the body the head answers it with.
QUERY_BODIES: dict[str, type[Body]] = {
    "health": HealthView,
    "engines": EnginesView,
    "stats": StatsView,
    "weight_updates": WeightUpdatesView,
    "weight_update_decisions": DecisionsView,
}


def to_dict(v: object) -> object:
    """A view as the plain dicts / lists the human-facing client API returns
    (every field, by name; no tag)."""
    if isinstance(v, msgspec.Struct):
        return {f: to_dict(getattr(v, f)) for f in v.__struct_fields__}
    if isinstance(v, dict):
        return {k: to_dict(x) for k, x in v.items()}
    if isinstance(v, list):
        return [to_dict(x) for x in v]
    return v


def as_dict(v: msgspec.Struct) -> dict[str, Any]:
    """`to_dict` of one view, typed as the dict the client API returns."""
    out = to_dict(v)
    assert isinstance(out, dict)
    return out
