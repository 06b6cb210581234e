"""Wire types of rollout-bus.

Every message is a ``msgspec.Struct`` (tagged, array-like, defaults omitted).
On the wire a message is the multipart frame list::

    [routing ids…][msgpack body][raw buffers…]

The body is the Struct as a msgpack array whose first item is its tag (the
message's kind: ``KIND_OF``/``TYPE_OF``), so one decoder over the union of
every message type reads any body (bus/codec.py); large payloads (prompt token
ids as int32, logprobs as float32, weight buckets) travel as raw frames after
the body, never inside it.

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

Version 7: one error shape (`Ack.failure` is an `EngineFailure`, as in
`ControlReply.errors`; `Ack.ok` is `failure is None`); query answers are typed
(`QueryReply.body` is a tagged union of bus/views.py's bodies: `HealthView`,
`EnginesView` of `EngineView`s, ...); `StatsResult.heartbeat` is a `Heartbeat`.

Where things live (all re-exported here, so `from bus import protocol as P`
names every wire type): bus/wire.py (field bounds, Struct bases),
bus/results.py (control results, `EngineFailure`), bus/views.py (query
answers), bus/events.py (Register, Heartbeat, ...); this file: the data
plane, the control ops and messages and the kind table; bus/protocol_weights.py:
TensorMeta and the weight socket's messages.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from bus.events import Heartbeat as Heartbeat
from bus.events import Register as Register
from bus.events import RegisterReply as RegisterReply
from bus.events import Rejoin as Rejoin
from bus.protocol_weights import SENDER_SECRET_BYTES as SENDER_SECRET_BYTES
from bus.protocol_weights import TensorMeta as TensorMeta
from bus.protocol_weights import WeightBucket as WeightBucket
from bus.protocol_weights import WeightBucketAck as WeightBucketAck
from bus.protocol_weights import WeightSenderEnd as WeightSenderEnd
from bus.results import BeginWeightsResult as BeginWeightsResult
from bus.results import ConfigResult as ConfigResult
from bus.results import Detail as Detail
from bus.results import Done as Done
from bus.results import EngineFailure as EngineFailure
from bus.results import IsPausedResult as IsPausedResult
from bus.results import LoraResult as LoraResult
from bus.results import PauseResult as PauseResult
from bus.results import PingResult as PingResult
from bus.results import ReceiveWeightsResult as ReceiveWeightsResult
from bus.results import ResetPrefixCacheResult as ResetPrefixCacheResult
from bus.results import Result as Result
from bus.results import ResultBase as ResultBase
from bus.results import ResumeResult as ResumeResult
from bus.results import SleepResult as SleepResult
from bus.results import StatsResult as StatsResult
from bus.results import WakeUpResult as WakeUpResult
from bus.results import WeightsAborted as WeightsAborted
from bus.results import WeightsCommitted as WeightsCommitted
from bus.results import WeightsPrepared as WeightsPrepared
from bus.results import expect as expect
from bus.transport import Transport, TransportArgs
from bus.views import QUERY_BODIES as QUERY_BODIES
from bus.views import Body as Body
from bus.views import DecisionsView as DecisionsView
from bus.views import EnginesView as EnginesView
from bus.views import EngineView as EngineView
from bus.views import HealthView as HealthView
from bus.views import IntentView as IntentView
from bus.views import PrefixView as PrefixView
from bus.views import QueryBody as QueryBody
from bus.views import SessionEnded as SessionEnded
from bus.views import StatsView as StatsView
from bus.views import WeightTxnView as WeightTxnView
from bus.views import WeightUpdatesView as WeightUpdatesView
from bus.views import as_dict as as_dict
from bus.views import to_dict as to_dict
from bus.wire import I32 as I32
from bus.wire import I64 as I64
from bus.wire import MAX_COMMIT_VERSION as MAX_COMMIT_VERSION
from bus.wire import MAX_ID_CHARS as MAX_ID_CHARS
from bus.wire import MAX_LIST as MAX_LIST
from bus.wire import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from bus.wire import MAX_NAME_CHARS as MAX_NAME_CHARS
from bus.wire import MAX_SAMPLE_INDEX as MAX_SAMPLE_INDEX
from bus.wire import MAX_SENDERS as MAX_SENDERS
from bus.wire import MAX_SHORT_CHARS as MAX_SHORT_CHARS
from bus.wire import MAX_TEXT_CHARS as MAX_TEXT_CHARS
from bus.wire import MAX_VERSION as MAX_VERSION
from bus.wire import U32 as U32
from bus.wire import U63 as U63
from bus.wire import Id as Id
from bus.wire import Ids as Ids
from bus.wire import Message as Message
from bus.wire import Msg as _Msg
from bus.wire import Name as Name
from bus.wire import Part as _Part
from bus.wire import SampleIndex as SampleIndex
from bus.wire import Sender as Sender
from bus.wire import Short as Short
from bus.wire import StopStr as StopStr
from bus.wire import Text as Text
from bus.wire import Version as Version

# 5: the head believes an engine's heartbeats / acks only from its own events
# connections (identity "engine_id/incarnation", heartbeats ".../hb"); GPU
# weight parts of several senders (ReceiveWeights.sender/tensors/...).
# 6: the join token (Register.token, Control.token; refusals carry
# RegisterReply.code/field); an engine's events identity carries a secret
# per-process nonce ("engine_id/incarnation/NONCE"), so a stranger cannot
# reconnect under a dead engine's identity and speak for it.
# 7: weight transports are typed: `transport` is a bus.transport.Transport,
# `transport_args` one tagged args Struct per transport (was a free dict),
# IPC handles are bytes, and a LoRA begin carries `lora_config` in its own field.
# Also 7 (one version: both landed together): Ack.failure (an EngineFailure)
# instead of flat error/code/field; typed QueryReply.body (bus/views.py);
# StatsResult.heartbeat is a Heartbeat.
# 8: the "vllm_nccl" transport (Transport.VLLM_NCCL, VllmNcclArgs): engines join
# a trainer's vLLM NCCL weight-transfer group (SkyRL's broadcast strategy).
# 9: the one-trip weight update (BeginWeightUpdate.layout/commit/version,
# WeightsCommitted.layout/detail): a steady-state zero-copy cuda_ipc update
# names a layout the engines already hold and commits in the same op.
# 10: the nccl one-trip (a one-trip begin over "nccl": the engines keep the
# layout's metas and staging) and NcclArgs.check_in (each engine worker checks
# in at the trainer's store before it joins the broadcast; the trainer
# broadcasts only once all did, so a refused op never leaves it blocked), and
# NcclArgs.verdict (the trainer's NaN/inf check rides beside the broadcast).
# 11: no kind frame: a message is [body, *buffers], the body's tag (its first
# msgpack item) names the type (one frame less per message on every hop).
# 12: a weight update's sender secret (bus/protocol_weights.py): minted by the
# head per update, in the opener's Begin reply and the published begin; every
# WeightBucket / WeightSenderEnd / ReceiveWeights carries it (a sender of 11
# is refused); WeightBucketAck.field names a refused field.
PROTOCOL_VERSION = 12

# ---------------------------------------------------------------- data plane


class SamplingParams(_Part):
    max_tokens: I32 = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: I32 = 0  # 0 or -1: disabled
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] | None = None  # sample i of a request uses seed + i
    stop_token_ids: Annotated[list[I32], Meta(max_length=MAX_LIST)] = []
    ignore_eos: bool = False
    # False: none. True or 0: the chosen token's logprob per token. k >= 1: the
    # chosen token's logprob, then the top-k alternatives per token (frames in
    # bus/frames.py).
    logprobs: bool | I32 = False
    # -- issue 10 (appended: compatibility rule) ---------------------------
    # stop strings, matched on the engine node's detokenized text
    stop: Annotated[list[StopStr], Meta(max_length=64)] = []
    include_stop_str_in_output: bool = False
    min_tokens: I32 = 0  # eos / stop_token_ids masked until this many tokens exist
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output (vLLM's definition)
    presence_penalty: float = 0.0  # over the output
    frequency_penalty: float = 0.0  # over the output
    # None: off. k >= 0: each prompt token's logprob (+ top-k alternatives),
    # once per sample, on its final chunk.
    prompt_logprobs: I32 | None = None
    skip_special_tokens: bool = True  # text only (stop-string matching, Chunk.text)
    # -- issue 23 (appended). Prefix-cache scope (vLLM's cache_salt): requests
    # share cached prefix blocks only with requests of the same salt. The vLLM
    # backend combines it with its own weight-version salt; outputs do not
    # depend on it (the torch backend has no prefix cache and ignores it).
    cache_salt: Name | None = None
    # -- issue 37 (appended). MoE routing replay (R3): chunks carry the expert ids of their
    # tokens (one raw frame; Chunk.routed_experts its shape), only on an engine started with
    # the `return_routed_experts` option. `routed_experts_prompt`: the prompt's routes too.
    return_routed_experts: bool = False
    routed_experts_prompt: bool = False
    # Prompt routes skip this many first positions (vLLM's routed_experts_prompt_start,
    # SGLang's routed_experts_start_len): a session asks only for what it lacks.
    routed_experts_start: U32 = 0


class Generate(_Msg, tag="gen"):
    """Frames after the body: [prompt token ids, int32 little-endian]."""

    request_id: Id
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    num_samples: I32 = 1
    session_id: Id | None = None
    lora: Id | None = None
    stream: bool = True
    # Client deadline in seconds from submission; a request held past it (paused
    # engine, no healthy engine) ends with Error(code="timeout").
    timeout_s: float | None = None
    # Resumption: the last `resume_len` prompt tokens are output generated
    # earlier (by a parked or failed-over request). They count against
    # max_tokens and are not re-sent to the client.
    resume_len: I32 = 0
    # Sample indexes of this request start here (a resumed single sample of a
    # multi-sample request keeps its index).
    sample_offset: SampleIndex = 0
    # Staleness bound: when a weight update lands and a sample's oldest token
    # (of the tokens the engine generated for it) comes from a version older
    # than current - max_staleness, the engine drops that sample's tokens and
    # regenerates it from the prompt on the new weights (Chunk.restarts counts
    # it). None: no bound (tokens of several versions, each stamped).
    max_staleness: Version | None = None


class Cancel(_Msg, tag="cancel"):
    request_id: Id


class Chunk(_Msg, tag="chunk"):
    """New tokens of one sample. Frames: [token ids int32][logprobs float32, if asked].

    `weight_version` stamps the first token; `version_changes` lists
    [token offset, version] for every change inside the chunk (only an
    aggregated, non-streamed chunk spans versions).
    """

    request_id: Id
    sample_index: SampleIndex = 0
    weight_version: Version = 0
    finish_reason: Short | None = None  # "stop" | "length" | "cancelled" on the last chunk
    version_changes: list[list[I64]] = []
    emitted_at: float = 0.0  # engine wall clock when the tokens were produced
    num_prompt_tokens: U32 = 0  # set on the final chunk
    engine_id: Id = ""  # set on the final chunk: the engine that finished the sample
    # -- issue 10 (appended) ---------------------------------------------
    top_logprobs: I32 = 0  # k > 0: frames carry top-k ids + logprobs (bus/frames.py)
    prompt_logprobs: I32 = -1  # >= 0: the LAST frames carry prompt logprobs (+ top-k if > 0)
    stop_reason: StopStr | None = None  # final chunk: the stop string that ended the sample
    text: Text | None = None  # final chunk of a stop-string request: the output text, truncated as vLLM does
    # How many times this sample was restarted by the staleness bound so far
    # (Generate.max_staleness). A chunk whose `restarts` is higher than the
    # previous chunk's of the same sample says: discard every token of this
    # sample received before it (the request's own resume prefix excepted);
    # its tokens begin the new attempt. The final chunk carries the total.
    restarts: U32 = 0
    # -- issue 37 (appended): the chunk's LAST frame holds routed expert ids; None costs nothing.
    routed_experts: RoutedExperts | None = None


class RoutedExperts(_Part):
    """The shape of a Chunk's routed-experts frame (bus/frames.py): `rows`
    sequence positions x `layers` MoE layers x `top_k` expert ids, row-major,
    little-endian `dtype` ("uint8" / "uint16" / "uint32": the smallest that
    holds the engine's expert count). Row i is the routing of the token at the
    sample's next position when it was the model's INPUT (vLLM's and SGLang's
    convention: a sample's last token is never an input, so it has no row);
    the first `prompt_rows` rows are prompt positions."""

    rows: U32
    layers: U32
    top_k: U32
    dtype: Short
    prompt_rows: U32 = 0


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
    nbufs: list[I32]
    ntoks: list[I32] = []


class Error(_Msg, tag="error"):
    request_id: Id
    code: Short  # see bus.errors.ErrorCode
    message: Message
    field: Short | None = None


# ------------------------------------------------------------- control ops


class Ping(_Msg, tag="ping"):
    pass


class Pause(_Msg, tag="pause"):
    mode: Short = "abort"  # "abort" | "keep" | "wait"
    lora: Id | None = None
    timeout_s: float = 60.0  # wait mode: drain deadline


class Resume(_Msg, tag="resume"):
    lora: Id | None = None
    # -- appended (issue 34): pauses are held per holder; a cluster-wide resume releases the
    # sender's own hold (engines resume once no live holder is left). True: every holder's.
    force: bool = False


class IsPaused(_Msg, tag="is_paused"):
    lora: Id | None = None


class Sleep(_Msg, tag="sleep"):
    level: I32 = 1


class WakeUp(_Msg, tag="wake_up"):
    tags: Annotated[list[Short], Meta(max_length=64)] | None = None


class ResetPrefixCache(_Msg, tag="reset_prefix_cache"):
    pass


class BeginWeightUpdate(_Msg, tag="begin_weights"):
    update_id: Id
    transport: Transport
    tensors: Annotated[list[TensorMeta], Meta(max_length=MAX_LIST)]
    bucket_sizes: Annotated[list[U63], Meta(max_length=MAX_LIST)]  # bytes per bucket
    # "model" or "lora:NAME" (stage a LoRA adapter's tensors).
    target: Name = "model"
    # The transport's own args (its tag must be `transport`); None: its defaults.
    transport_args: TransportArgs | None = None
    # -- protocol 3 ---------------------------------------------------------
    # Sender ranks contributing buckets (0..senders-1), each ending its part
    # with a WeightSenderEnd on every engine's weight socket.
    senders: Annotated[int, Meta(ge=1, le=MAX_SENDERS)] = 1
    # True: `tensors`/`bucket_sizes` are empty; every WeightBucket carries the
    # metas of its own tensors (names, dtypes and shapes arrive per sender).
    streamed: bool = False
    # GPU transports: begin + receive (these cuda_ipc handles, or the NCCL
    # broadcast) + prepare in ONE op; its ack is the engine's prepare vote.
    prepare: bool = False
    handles: Annotated[list[bytes], Meta(max_length=MAX_LIST)] = []
    # -- appended (issue 22) -------------------------------------------------
    # Engines refuse, at the prepare (before their vote), an update carrying a
    # NaN or inf value, naming the tensor. False: the trainer opted out.
    check_finite: bool = True
    # -- protocol 7 ---------------------------------------------------------
    # target "lora:NAME": r, lora_alpha, target_modules of the staged adapter.
    lora_config: dict[str, Any] = {}
    # -- protocol 9 (the one-trip update, trainer_bridge/transports/one_trip.py)
    # A layout id named by the trainer for its zero-copy cuda_ipc layout. With
    # handles: an engine that commits the update keeps (metas, sizes, handles,
    # args) under it. With commit=True and no handles: the engine takes the
    # layout it keeps under this id (refused, field "layout", if it has none).
    layout: Id = ""
    # One op: receive + validate + prepare + COMMIT at `version`, which the
    # head decides (and sets here) before it publishes the op.
    commit: bool = False
    version: Annotated[int, Meta(ge=0, le=MAX_COMMIT_VERSION)] | None = None
    # -- protocol 12: set by the HEAD when it publishes the begin (a client's
    # value is replaced): the update's sender secret (bus/protocol_weights.py).
    sender_secret: Short = ""


class ReceiveWeights(_Msg, tag="receive_weights"):
    """GPU transports: pull the buckets (NCCL broadcast / IPC handles) now.

    Several senders (a BeginWeightUpdate with senders > 1 and streamed=True
    over cuda_ipc / nccl): each sender rank sends ONE ReceiveWeights with its
    own part: its tensors' metas (buckets numbered 0.. within the part), its
    bucket sizes, and its handles (cuda_ipc) or its own NCCL group's
    transport_args (host, port, group_id, world_size). The engine takes the
    part, appends it to the update, and counts the sender as ended."""

    update_id: Id
    # cuda_ipc: one handle per bucket (per engine device)
    handles: Annotated[list[bytes], Meta(max_length=MAX_LIST)] = []
    # -- appended (multi-sender GPU parts) ----------------------------------
    sender: Sender = 0
    tensors: Annotated[list[TensorMeta], Meta(max_length=MAX_LIST)] = []
    bucket_sizes: Annotated[list[U63], Meta(max_length=MAX_LIST)] = []
    transport_args: TransportArgs | None = None
    # -- protocol 12: the update's sender secret; the head refuses a part without it
    sender_secret: Short = ""


class PrepareWeights(_Msg, tag="prepare_weights"):
    """Phase one: the engine checks it holds every bucket every sender declared
    and that the backend validated them (names, dtypes, shapes), then votes by
    acking `WeightsPrepared`. It waits up to `wait_s` for senders still sending.
    A prepared engine keeps its old weights until the commit, and discards the
    update if no commit or abort comes within its `prepare_ttl_s`."""

    update_id: Id
    wait_s: float = 30.0
    # -- appended (issue 34): the update's sender secret; a client other than the
    # one that began the update must bring it (router_node/cluster_state.py).
    sender_secret: Short = ""


class FinishWeightUpdate(_Msg, tag="finish_weights"):
    """Phase two, the commit. Clients send it to the head, which prepares any
    engine that has not voted yet, records the decision and the new cluster
    version, and only then publishes it (engines that miss it are stale)."""

    update_id: Id
    # The weight version the engine takes when the update commits (the
    # trainer's cluster-wide version: a stale engine jumps to it). None: the
    # engine's own version + 1.
    version: Annotated[int, Meta(ge=0, le=MAX_COMMIT_VERSION)] | None = None
    sender_secret: Short = ""  # appended (issue 34): as PrepareWeights'


class AbortWeightUpdate(_Msg, tag="abort_weights"):
    update_id: Id
    sender_secret: Short = ""  # appended (issue 34): as PrepareWeights'


class LoadLora(_Msg, tag="load_lora"):
    name: Id
    path: Name | None = None  # a PEFT adapter folder, or…
    update_id: Id | None = None  # …tensors staged by a BeginWeightUpdate(target="lora:NAME")
    config: dict[str, Any] = {}  # r, lora_alpha, target_modules (when staged)


class UnloadLora(_Msg, tag="unload_lora"):
    name: Id


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


class Command(_Msg, tag="cmd"):
    """Head → engines over the control PUB. Idempotent by seq: a republished
    command is acked again from the engine's ack cache, never re-run."""

    seq: U63
    op: Op
    targets: Ids | None = None  # None: every engine


class Ack(_Msg, tag="ack"):
    """One engine's answer to a Command: its typed result, or why it failed
    (the same `EngineFailure` the head forwards in ControlReply.errors)."""

    seq: U63
    engine_id: Id
    result: Result | None = None
    failure: EngineFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


# --------------------------------------------------- client ↔ head control


class Control(_Msg, tag="ctl"):
    request_id: Id
    op: Op
    targets: Ids | None = None
    timeout_s: float = 60.0
    # The cluster's join token (launch.py makes it): ops that change cluster
    # state need it unless the connection is CURVE-authenticated (docs/security.md).
    token: Short = ""


class ControlReply(_Msg, tag="ctl_reply"):
    request_id: Id
    results: dict[Id, Result] = {}  # engine id -> result (ok engines)
    errors: dict[Id, EngineFailure] = {}  # engine id -> why it failed
    missing: Ids = []  # targeted engines that did not ack in time
    # -- protocol 12: a BeginWeightUpdate's reply, to the client that opened it only
    sender_secret: Short = ""


class Query(_Msg, tag="query"):
    request_id: Id
    what: Short  # a key of QUERY_BODIES (bus/views.py): "health", "engines", "stats", ...


class QueryReply(_Msg, tag="query_reply"):
    """The answer to a Query (the body named by `QUERY_BODIES[what]`) or an EndSession."""

    request_id: Id
    body: QueryBody


class ClientPing(_Msg, tag="client_ping"):
    """Client → head heartbeat, every ~0.5 s while connected (idle too): renews
    the client's lease (the pauses, sleep and weight update it holds,
    router_node/leases.py) and asks for a `HeadPong`, so a client sees a dead or
    frozen head within its `head_timeout_s`."""


class HeadPong(_Msg, tag="head_pong"):
    """Head → client: the answer to a `ClientPing`. `lease_s`: how long the
    head keeps this client's holdings without hearing from it. `incarnation`:
    the head process's id; a new one means the head restarted (faster than
    the client's `head_timeout_s`), so what was open on the old head is lost
    ("": a head that does not say)."""

    lease_s: float = 0.0
    incarnation: Id = ""
    # -- issue 34 (appended): the head's --max-inflight-per-client (0: not
    # said); the client keeps its requests in flight under it (trainer_bridge/pacing.py).
    max_inflight_per_client: I64 = 0


class EndSession(_Msg, tag="end_session"):
    request_id: Id
    session_id: Id


# weight socket (zmq) and TensorMeta: bus/protocol_weights.py (re-exported above)


# ------------------------------------------------------------ kind table

# Every message type: its kind on the wire is its tag, the body's first item
# (protocol 11; before, a one-byte frame ahead of the body said the same).
# Tags are never reused.
MESSAGE_TYPES: tuple[type[msgspec.Struct], ...] = (
    Generate,
    Cancel,
    Chunk,
    ChunkBatch,
    Error,
    Command,
    Ack,
    Control,
    ControlReply,
    Query,
    QueryReply,
    EndSession,
    Register,
    RegisterReply,
    Heartbeat,
    WeightBucket,
    WeightBucketAck,
    WeightSenderEnd,
    ClientPing,
    HeadPong,
    Rejoin,
)
KIND_OF: dict[type, str] = {t: str(t.__struct_config__.tag) for t in MESSAGE_TYPES}
TYPE_OF: dict[str, type] = {v: k for k, v in KIND_OF.items()}
assert len(TYPE_OF) == len(KIND_OF), "duplicate message tag"

OP_NAMES: dict[type, str] = {t: t.__struct_config__.tag for t in Op.__args__}
