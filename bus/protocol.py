"""Wire types of rollout-bus.

Every message is a ``msgspec.Struct`` (tagged, array-like, defaults omitted).
On the wire a message is the multipart frame list::

    [routing ids…][kind: 1 byte][msgpack body][raw buffers…]

The kind byte names the Struct (``KIND_OF``/``TYPE_OF``); large payloads
(prompt token ids as int32, logprobs as float32, weight buckets) travel as raw
frames after the body, never inside it.

Compatibility rule: add fields only at the END of a Struct, always with a
default. Removing or reordering fields is a protocol-version bump.

Version 2: control results are typed (one `*Result` Struct per op, a tagged
union in `Ack.result` and `ControlReply.results`); `ControlReply.errors` maps
an engine to its `EngineFailure` {code, message, field} instead of a string.

Version 3: weight updates are an explicit two-phase commit (`PrepareWeights`
→ `WeightsPrepared`, then `FinishWeightUpdate` = the commit, decided by the
head); buckets may carry their own tensor metas (streamed updates) and come
from several sender ranks, each closing its part with `WeightSenderEnd`.

Version 4: a `ChunkBatch` may be packed (`ntoks` set): the token ids of all
its chunks travel in ONE frame, so a batch of k chunks is 3 frames, not k + 2
(see ChunkBatch).
"""

from __future__ import annotations

from typing import Any

import msgspec

# 5: the head believes an engine's heartbeats / acks only from its own events
# connections (identity "engine_id/incarnation", heartbeats ".../hb"); GPU
# weight parts of several senders (ReceiveWeights.sender/tensors/...).
PROTOCOL_VERSION = 5


class _Msg(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Base of every wire message."""


class _Part(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base of nested (non-message) parts."""


# ---------------------------------------------------------------- data plane


class SamplingParams(_Part):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None  # sample i of a request uses seed + i
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # False: none. True or 0: the chosen token's logprob per token. k >= 1: the
    # chosen token's logprob, then the top-k alternatives per token (frames in
    # bus/frames.py).
    logprobs: bool | int = False
    # -- issue 10 (appended: compatibility rule) ---------------------------
    stop: list[str] = []  # stop strings, matched on the engine node's detokenized text
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # eos / stop_token_ids masked until this many tokens exist
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output (vLLM's definition)
    presence_penalty: float = 0.0  # over the output
    frequency_penalty: float = 0.0  # over the output
    # None: off. k >= 0: each prompt token's logprob (+ top-k alternatives),
    # once per sample, on its final chunk.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # text only (stop-string matching, Chunk.text)


class Generate(_Msg, tag="gen"):
    """Frames after the body: [prompt token ids, int32 little-endian]."""

    request_id: str
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    num_samples: int = 1
    session_id: str | None = None
    lora: str | None = None
    stream: bool = True
    # Client deadline in seconds from submission; a request held past it (paused
    # engine, no healthy engine) ends with Error(code="timeout").
    timeout_s: float | None = None
    # Resumption: the last `resume_len` prompt tokens are output generated
    # earlier (by a parked or failed-over request). They count against
    # max_tokens and are not re-sent to the client.
    resume_len: int = 0
    # Sample indexes of this request start here (a resumed single sample of a
    # multi-sample request keeps its index).
    sample_offset: int = 0
    # Staleness bound: when a weight update lands and a sample's oldest token
    # (of the tokens the engine generated for it) comes from a version older
    # than current - max_staleness, the engine drops that sample's tokens and
    # regenerates it from the prompt on the new weights (Chunk.restarts counts
    # it). None: no bound (tokens of several versions, each stamped).
    max_staleness: int | None = None


class Cancel(_Msg, tag="cancel"):
    request_id: str


class Chunk(_Msg, tag="chunk"):
    """New tokens of one sample. Frames: [token ids int32][logprobs float32, if asked].

    `weight_version` stamps the first token; `version_changes` lists
    [token offset, version] for every change inside the chunk (only an
    aggregated, non-streamed chunk spans versions).
    """

    request_id: str
    sample_index: int = 0
    weight_version: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" on the last chunk
    version_changes: list[list[int]] = []
    emitted_at: float = 0.0  # engine wall clock when the tokens were produced
    num_prompt_tokens: int = 0  # set on the final chunk
    engine_id: str = ""  # set on the final chunk: the engine that finished the sample
    # -- issue 10 (appended) ---------------------------------------------
    top_logprobs: int = 0  # k > 0: frames carry top-k ids + logprobs (bus/frames.py)
    prompt_logprobs: int = -1  # >= 0: the LAST frames carry prompt logprobs (+ top-k if > 0)
    stop_reason: str | None = None  # final chunk: the stop string that ended the sample
    text: str | None = None  # final chunk of a stop-string request: the output text, truncated as vLLM does
    # How many times this sample was restarted by the staleness bound so far
    # (Generate.max_staleness). A chunk whose `restarts` is higher than the
    # previous chunk's of the same sample says: discard every token of this
    # sample received before it (the request's own resume prefix excepted);
    # its tokens begin the new attempt. The final chunk carries the total.
    restarts: int = 0


class ChunkBatch(_Msg, tag="chunks"):
    """Several Chunks in one message: what one engine step produced for one
    peer (engine → router, router → client). Read it with
    `bus.codec.split_chunks` (or `bus.codec.split_packed`), which also accept
    a plain Chunk.

    Unpacked (`ntoks` empty): every chunk's buffers in order; `nbufs[i]` says
    how many belong to chunk i.
    Packed (`ntoks` set, what `Outbox` sends): frame 0 holds the token ids of
    every chunk, concatenated (int32; chunk i has `ntoks[i]`), then each
    chunk's OTHER buffers (logprobs, top-k, prompt logprobs) in order;
    `nbufs[i]` counts those, without the token frame. Per-frame costs (a zmq
    message part, a Frame object, a memoryview) are paid once per batch
    instead of once per chunk: the streaming hot path."""

    chunks: list[Chunk]
    nbufs: list[int]
    ntoks: list[int] = []


class Error(_Msg, tag="error"):
    request_id: str
    code: str  # see bus.errors.ErrorCode
    message: str
    field: str | None = None


# ------------------------------------------------------------- control ops


class Ping(_Msg, tag="ping"):
    pass


class Pause(_Msg, tag="pause"):
    mode: str = "abort"  # "abort" | "keep" | "wait"
    lora: str | None = None
    timeout_s: float = 60.0  # wait mode: drain deadline


class Resume(_Msg, tag="resume"):
    lora: str | None = None


class IsPaused(_Msg, tag="is_paused"):
    lora: str | None = None


class Sleep(_Msg, tag="sleep"):
    level: int = 1


class WakeUp(_Msg, tag="wake_up"):
    tags: list[str] | None = None


class ResetPrefixCache(_Msg, tag="reset_prefix_cache"):
    pass


class TensorMeta(_Part):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: list[int]
    bucket: int  # index of the bucket holding it
    offset: int  # byte offset inside the bucket
    nbytes: int


class BeginWeightUpdate(_Msg, tag="begin_weights"):
    update_id: str
    transport: str  # "zmq" | "cuda_ipc" | "nccl"
    tensors: list[TensorMeta]
    bucket_sizes: list[int]  # bytes per bucket
    # "model" or "lora:NAME" (stage a LoRA adapter's tensors).
    target: str = "model"
    transport_args: dict[str, Any] = {}
    # -- protocol 3 ---------------------------------------------------------
    # Sender ranks contributing buckets (0..senders-1), each ending its part
    # with a WeightSenderEnd on every engine's weight socket.
    senders: int = 1
    # True: `tensors`/`bucket_sizes` are empty; every WeightBucket carries the
    # metas of its own tensors (names, dtypes and shapes arrive per sender).
    streamed: bool = False
    # GPU transports: begin + receive (these cuda_ipc handles, or the NCCL
    # broadcast) + prepare in ONE op; its ack is the engine's prepare vote.
    prepare: bool = False
    handles: list[Any] = []


class ReceiveWeights(_Msg, tag="receive_weights"):
    """GPU transports: pull the buckets (NCCL broadcast / IPC handles) now.

    Several senders (a BeginWeightUpdate with senders > 1 and streamed=True
    over cuda_ipc / nccl): each sender rank sends ONE ReceiveWeights with its
    own part: its tensors' metas (buckets numbered 0.. within the part), its
    bucket sizes, and its handles (cuda_ipc) or its own NCCL group's
    transport_args (host, port, group_id, world_size). The engine takes the
    part, appends it to the update, and counts the sender as ended."""

    update_id: str
    handles: list[Any] = []  # cuda_ipc: one handle per bucket (per engine device)
    # -- appended (multi-sender GPU parts) ----------------------------------
    sender: int = 0
    tensors: list[TensorMeta] = []
    bucket_sizes: list[int] = []
    transport_args: dict[str, Any] = {}


class PrepareWeights(_Msg, tag="prepare_weights"):
    """Phase one: the engine checks it holds every bucket every sender declared
    and that the backend validated them (names, dtypes, shapes), then votes by
    acking `WeightsPrepared`. It waits up to `wait_s` for senders still sending.
    A prepared engine keeps its old weights until the commit, and discards the
    update if no commit or abort comes within its `prepare_ttl_s`."""

    update_id: str
    wait_s: float = 30.0


class FinishWeightUpdate(_Msg, tag="finish_weights"):
    """Phase two, the commit. Clients send it to the head, which prepares any
    engine that has not voted yet, records the decision and the new cluster
    version, and only then publishes it (engines that miss it are stale)."""

    update_id: str
    # The weight version the engine takes when the update commits (the
    # trainer's cluster-wide version: a stale engine jumps to it). None: the
    # engine's own version + 1.
    version: int | None = None


class AbortWeightUpdate(_Msg, tag="abort_weights"):
    update_id: str


class LoadLora(_Msg, tag="load_lora"):
    name: str
    path: str | None = None  # a PEFT adapter folder, or…
    update_id: str | None = None  # …tensors staged by a BeginWeightUpdate(target="lora:NAME")
    config: dict[str, Any] = {}  # r, lora_alpha, target_modules (when staged)


class UnloadLora(_Msg, tag="unload_lora"):
    name: str


class Stats(_Msg, tag="stats"):
    pass


Op = (
    Ping
    | Pause
    | Resume
    | IsPaused
    | Sleep
    | WakeUp
    | ResetPrefixCache
    | BeginWeightUpdate
    | ReceiveWeights
    | PrepareWeights
    | FinishWeightUpdate
    | AbortWeightUpdate
    | LoadLora
    | UnloadLora
    | Stats
)


# --------------------------------------------------------- control results


class _Result(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Base of the typed result of one control op on one engine.

    Read access by key (`r["parked"]`, `dict(r)`) is kept for callers written
    against the dict results of protocol version 1: a key is a field, else a
    key of `detail` (what the backend reported beyond the typed fields)."""

    def __getitem__(self, key: str) -> Any:
        if key in self.__struct_fields__:
            return getattr(self, key)
        detail = getattr(self, "detail", None)
        if detail is not None and key in detail:
            return detail[key]
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
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

    def to_dict(self) -> dict[str, Any]:
        return {k: self[k] for k in self.keys()}


class Done(_Result, tag="done"):
    """An op that finished with nothing to report."""


class ConfigResult(_Result, tag="config"):
    """The engine's weight/LoRA configuration after an op that may change it.
    The head applies it to its registry unless a newer `epoch` is known."""

    weight_version: int = 0
    loras: list[str] = []
    epoch: int = 0


class PingResult(_Result, tag="ping"):
    weight_version: int = 0
    incarnation: str = ""


class PauseResult(_Result, tag="pause"):
    mode: str = ""
    scope: str = ""
    held: int = 0  # new requests behind the gate
    parked: int = 0  # aborted, tokens kept, re-submitted on resume
    frozen: int = 0  # keep mode: frozen with their KV
    draining: int = 0  # wait mode: running when the pause began
    resumed_before_drained: bool = False


class ResumeResult(_Result, tag="resume"):
    resumed: int = 0
    scopes: list[str] = []
    still_paused: list[str] = []


class IsPausedResult(_Result, tag="is_paused"):
    paused: bool = False
    scopes: list[str] = []


class SleepResult(_Result, tag="sleep"):
    level: int = 0
    parked: int = 0
    seconds: float = 0.0
    detail: dict[str, Any] = {}  # the backend's own report (e.g. weights kept/discarded)


class WakeUpResult(ConfigResult, tag="wake_up"):
    resumed: int = 0
    seconds: float = 0.0
    weights_reloaded_from_checkpoint: bool = False
    detail: dict[str, Any] = {}


class ResetPrefixCacheResult(_Result, tag="reset_prefix_cache"):
    detail: dict[str, Any] = {}


class BeginWeightsResult(_Result, tag="begin_weights"):
    buckets: int = 0
    weight_address: str = ""
    detail: dict[str, Any] = {}


class ReceiveWeightsResult(_Result, tag="receive_weights"):
    seconds: float = 0.0
    detail: dict[str, Any] = {}


class WeightsPrepared(_Result, tag="prepare_weights"):
    """An engine's yes vote: every declared bucket is in and validated."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    detail: dict[str, Any] = {}


class WeightsCommitted(ConfigResult, tag="finish_weights"):
    bytes: int = 0
    seconds: float = 0.0
    restarted: int = 0  # samples the staleness bound (Generate.max_staleness) restarted


class WeightsAborted(_Result, tag="abort_weights"):
    weight_version: int = 0


class LoraResult(ConfigResult, tag="lora"):
    """load_lora / unload_lora: the adapter set after the op."""


class StatsResult(_Result, tag="stats"):
    heartbeat: dict[str, Any] = {}  # the engine's Heartbeat fields now
    detail: dict[str, Any] = {}  # the backend's stats

    def __getitem__(self, key: str) -> Any:
        if key in self.heartbeat:
            return self.heartbeat[key]
        return super().__getitem__(key)

    def keys(self) -> list[str]:
        return [*self.heartbeat, *(k for k in self.detail if k not in self.heartbeat)]


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


class EngineFailure(_Part):
    """Why a control op failed on one engine (`code`: bus.errors.ErrorCode)."""

    code: str
    message: str
    field: str | None = None


class Command(_Msg, tag="cmd"):
    """Head → engines over the control PUB. Idempotent by seq: a republished
    command is acked again from the engine's ack cache, never re-run."""

    seq: int
    op: Op
    targets: list[str] | None = None  # None: every engine


class Ack(_Msg, tag="ack"):
    seq: int
    engine_id: str
    ok: bool = True
    result: Result | None = None
    error: str | None = None
    code: str | None = None  # bus.errors.ErrorCode of a failure
    field: str | None = None  # the offending field of a refused op, when known


# --------------------------------------------------- client ↔ head control


class Control(_Msg, tag="ctl"):
    request_id: str
    op: Op
    targets: list[str] | None = None
    timeout_s: float = 60.0


class ControlReply(_Msg, tag="ctl_reply"):
    request_id: str
    results: dict[str, Result] = {}  # engine id -> result (ok engines)
    errors: dict[str, EngineFailure] = {}  # engine id -> why it failed
    missing: list[str] = []  # targeted engines that did not ack in time


class Query(_Msg, tag="query"):
    request_id: str
    what: str  # "health" | "engines"


class QueryReply(_Msg, tag="query_reply"):
    request_id: str
    body: dict[str, Any] = {}


class ClientPing(_Msg, tag="client_ping"):
    """Client → head heartbeat, every ~0.5 s while connected (idle too): renews
    the client's lease (the pauses, sleep and weight update it holds,
    router_node/leases.py) and asks for a `HeadPong`, so a client sees a dead or
    frozen head within its `head_timeout_s`."""


class HeadPong(_Msg, tag="head_pong"):
    """Head → client: the answer to a `ClientPing`. `lease_s`: how long the
    head keeps this client's holdings without hearing from it."""

    lease_s: float = 0.0


class EndSession(_Msg, tag="end_session"):
    request_id: str
    session_id: str


# ------------------------------------------------------------------ events


class Register(_Msg, tag="register"):
    engine_id: str
    data_address: str
    weight_address: str
    backend: str
    model: str
    protocol_version: int
    incarnation: str  # changes when the process restarts
    tp: int = 1
    pp: int = 1
    dp: int = 1
    capacity: int = 64  # sequences it batches at once
    vocab_size: int = 0
    pid: int = 0
    weight_version: int = 0
    loras: list[str] = []
    host: str = ""
    dtype: str = ""  # weight dtype the engine expects in updates
    # z85 CURVE public key of its data/weight sockets ("" when not secured):
    # the head and trainers connect with it as the server key.
    curve_key: str = ""


class RegisterReply(_Msg, tag="register_reply"):
    ok: bool
    error: str | None = None
    heartbeat_interval_s: float = 0.5
    # A refusal that may pass (the id is held by a live engine that may be
    # dying): the engine keeps re-registering until register_timeout_s.
    retry: bool = False
    # -- appended (issue 22): the identity of the head's DEALER on the engine's
    # data socket. The engine sends its acks THERE (after the chunks it produced
    # before them), so a pause's ack can never overtake those chunks; "" (an
    # older head): acks go over the events socket.
    data_peer: str = ""


class Rejoin(_Msg, tag="rejoin"):
    """Head → engine (events socket): a heartbeat came from an engine this head
    does not know (the head restarted): register again, now."""

    reason: str = ""


class Heartbeat(_Msg, tag="heartbeat"):
    engine_id: str
    incarnation: str
    running: int = 0
    waiting: int = 0
    held: int = 0  # behind the submission gate
    parked: int = 0  # aborted by a pause, re-submitted on resume
    kv_usage: float = 0.0
    weight_version: int = 0
    paused: list[str] = []  # "*" for all, else LoRA names
    steps: int = 0
    loras: list[str] = []
    sleeping: int = 0  # sleep level, 0 awake
    tokens_out: int = 0
    # Bumped by every weight/LoRA change. Acks carry it too, so the head never
    # lets an older heartbeat overwrite what a newer ack told it.
    config_epoch: int = 0
    # The control op in progress ("" when none): a busy engine is not stalled.
    busy: str = ""
    # The highest Command seq the engine had acked when this snapshot was taken.
    # Heartbeats travel on another socket than acks: the head trusts `paused` /
    # `sleeping` only from a heartbeat at least as new as the last ack it got
    # (router_node/intended_state.py), so an old snapshot cannot undo an ack.
    acked_seq: int = 0


# ------------------------------------------------------ weight socket (zmq)


class WeightBucket(_Msg, tag="wbucket"):
    """Frames: [bucket bytes]."""

    update_id: str
    bucket: int  # the sender's own bucket index (0, 1, … per sender)
    # -- protocol 3
    sender: int = 0
    metas: list[TensorMeta] = []  # streamed updates: this bucket's tensors (bucket = this index)


class WeightSenderEnd(_Msg, tag="wsender_end"):
    """A sender rank is done: it sent `buckets` buckets (0..buckets-1).
    Acked with a WeightBucketAck whose bucket is -1."""

    update_id: str
    sender: int
    buckets: int


class WeightBucketAck(_Msg, tag="wbucket_ack"):
    update_id: str
    bucket: int
    ok: bool = True
    error: str | None = None


# ------------------------------------------------------------ kind table

# One byte per message type. Never reuse a code.
KIND_OF: dict[type, bytes] = {
    Generate: b"G",
    Cancel: b"X",
    Chunk: b"C",
    ChunkBatch: b"B",
    Error: b"E",
    Command: b"M",
    Ack: b"A",
    Control: b"K",
    ControlReply: b"k",
    Query: b"Q",
    QueryReply: b"q",
    EndSession: b"S",
    Register: b"R",
    RegisterReply: b"r",
    Heartbeat: b"H",
    WeightBucket: b"W",
    WeightBucketAck: b"w",
    WeightSenderEnd: b"N",
    ClientPing: b"P",
    HeadPong: b"p",
    Rejoin: b"J",
}
TYPE_OF: dict[bytes, type] = {v: k for k, v in KIND_OF.items()}
assert len(TYPE_OF) == len(KIND_OF), "duplicate kind byte"

OP_NAMES: dict[type, str] = {t: t.__struct_config__.tag for t in Op.__args__}
