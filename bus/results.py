"""The typed result of one control op on one engine (`Ack.result`,
`ControlReply.results`) and the one shape of a failure (`EngineFailure`, in
`Ack.failure` and `ControlReply.errors`). Re-exported by bus/protocol.py.

Read a result by attribute (`r.parked`, `r.weight_version`). Key access
(`r["parked"]`, `dict(r)`, `"parked" in r`) is kept for callers written
against the dict results of protocol version 1: a key is a field, else a key
of `detail` (what the backend reported beyond the typed fields). Keys read as
`object`: typed code reads attributes.

Compatibility rule (bus/protocol.py): add fields only at the END, with a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec

from bus.errors import ProtocolError
from bus.events import Heartbeat
from bus.wire import I32, U63, Id, Ids, Message, Name, Part, Short, Version

# The backend's own report beyond the typed fields: free-form (it differs per
# backend), values read as `object`.
Detail = dict[str, object]


class ResultBase(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Base of the typed result of one control op on one engine."""

    def __getitem__(self, key: str) -> object:
        if key in self.__struct_fields__:
            return getattr(self, key)
        detail = getattr(self, "detail", None)
        if detail is not None and key in detail:
            return detail[key]
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def keys(self) -> list[str]:
        detail = getattr(self, "detail", None) or {}
        return [f for f in self.__struct_fields__ if f != "detail"] + [
            k for k in detail if k not in self.__struct_fields__
        ]

    def to_dict(self) -> dict[str, object]:
        return {k: self[k] for k in self.keys()}


class Done(ResultBase, tag="done"):
    """An op that finished with nothing to report."""


class ConfigResult(ResultBase, tag="config"):
    """The engine's weight/LoRA configuration after an op that may change it.
    The head applies it to its registry unless a newer `epoch` is known."""

    weight_version: Version = 0
    loras: Ids = []
    epoch: U63 = 0


class PingResult(ResultBase, tag="ping"):
    weight_version: Version = 0
    incarnation: Id = ""


class PauseResult(ResultBase, tag="pause"):
    mode: Short = ""
    scope: Short = ""
    held: U63 = 0  # new requests behind the gate
    parked: U63 = 0  # aborted, tokens kept, re-submitted on resume
    frozen: U63 = 0  # keep mode: frozen with their KV
    draining: U63 = 0  # wait mode: running when the pause began
    resumed_before_drained: bool = False


class ResumeResult(ResultBase, tag="resume"):
    resumed: U63 = 0
    scopes: Ids = []
    still_paused: Ids = []


class IsPausedResult(ResultBase, tag="is_paused"):
    paused: bool = False
    scopes: Ids = []


class SleepResult(ResultBase, tag="sleep"):
    level: I32 = 0
    parked: U63 = 0
    seconds: float = 0.0
    detail: Detail = {}  # the backend's own report (e.g. weights kept/discarded)


class WakeUpResult(ConfigResult, tag="wake_up"):
    resumed: U63 = 0
    seconds: float = 0.0
    weights_reloaded_from_checkpoint: bool = False
    detail: Detail = {}  # "asleep": the tags still asleep


class ResetPrefixCacheResult(ResultBase, tag="reset_prefix_cache"):
    detail: Detail = {}


class BeginWeightsResult(ResultBase, tag="begin_weights"):
    buckets: U63 = 0
    weight_address: Name = ""
    detail: Detail = {}


class ReceiveWeightsResult(ResultBase, tag="receive_weights"):
    seconds: float = 0.0
    detail: Detail = {}


class WeightsPrepared(ResultBase, tag="prepare_weights"):
    """An engine's yes vote: every declared bucket is in and validated."""

    buckets: U63 = 0
    tensors: U63 = 0
    bytes: U63 = 0
    seconds: float = 0.0
    detail: Detail = {}


class WeightsCommitted(ConfigResult, tag="finish_weights"):
    bytes: U63 = 0
    seconds: float = 0.0
    restarted: U63 = 0  # samples the staleness bound (Generate.max_staleness) restarted
    # -- protocol 9: the zero-copy layout the engine holds after this commit
    # ("" none) and how the update ran ("path": "one_trip" | "two_trip", timings)
    layout: Id = ""
    detail: Detail = {}


class WeightsAborted(ResultBase, tag="abort_weights"):
    weight_version: Version = 0


class LoraResult(ConfigResult, tag="lora"):
    """load_lora / unload_lora: the adapter set after the op."""


class StatsResult(ResultBase, tag="stats"):
    """The engine's Heartbeat as of now and the backend's stats. By key, the
    heartbeat's fields come first (`r["running"]`), then `detail`'s keys."""

    heartbeat: Heartbeat | None = None
    detail: Detail = {}

    def __getitem__(self, key: str) -> object:
        hb = self.heartbeat
        if hb is not None and key in hb.__struct_fields__:
            return getattr(hb, key)
        return super().__getitem__(key)

    def keys(self) -> list[str]:
        hb = list(self.heartbeat.__struct_fields__) if self.heartbeat is not None else []
        return [*hb, *(k for k in self.detail if k not in hb)]


Result = (
    Done
    | ConfigResult
    | PingResult
    | PauseResult
    | ResumeResult
    | IsPausedResult
    | SleepResult
    | WakeUpResult
    | ResetPrefixCacheResult
    | BeginWeightsResult
    | ReceiveWeightsResult
    | WeightsPrepared
    | WeightsCommitted
    | WeightsAborted
    | LoraResult
    | StatsResult
)


class EngineFailure(Part):
    """Why a control op failed on one engine (`code`: bus.errors.ErrorCode)."""

    code: Short
    message: Message
    field: Short | None = None


R = TypeVar("R", bound=ResultBase)


def expect(results: Mapping[str, ResultBase], cls: type[R], op: str) -> dict[str, R]:
    """`results` as {engine_id: cls}: what the client API returns for an op
    whose result type is known. An engine that answered with another result
    type is a protocol error naming it (a peer of another version)."""
    out: dict[str, R] = {}
    for eid, r in results.items():
        if not isinstance(r, cls):
            raise ProtocolError(f"{op}: engine {eid} answered {type(r).__name__}, expected {cls.__name__}")
        out[eid] = r
    return out
