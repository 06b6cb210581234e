"""Engine → head events: registration (and the head's answer), heartbeats,
and the head's request to register again. Re-exported by bus/protocol.py.

Compatibility rule (bus/protocol.py): add fields only at the END, with a default.
"""

from __future__ import annotations

from bus.wire import I32, I64, U32, U63, Id, Ids, Message, Msg, Name, Short, Version


class Register(Msg, tag="register"):
    engine_id: Id
    data_address: Name
    weight_address: Name
    backend: Name
    model: Name
    protocol_version: I32
    incarnation: Id  # changes when the process restarts
    tp: I32 = 1
    pp: I32 = 1
    dp: I32 = 1
    capacity: I32 = 64  # sequences it batches at once
    vocab_size: I32 = 0
    pid: I64 = 0
    weight_version: Version = 0
    loras: Ids = []
    host: Name = ""
    dtype: Short = ""  # weight dtype the engine expects in updates
    # z85 CURVE public key of its data/weight sockets ("" when not secured):
    # the head and trainers connect with it as the server key.
    curve_key: Short = ""
    # The cluster's join token ("" without one; a CURVE-authenticated
    # connection needs none).
    token: Short = ""
    # -- issue 23 (appended): prompt + output token limit (0: not reported).
    # OpenAI-shaped clients default max_tokens to it minus the prompt, as vLLM's server does.
    max_model_len: U32 = 0


class RegisterReply(Msg, tag="register_reply"):
    ok: bool
    error: Message | None = None
    heartbeat_interval_s: float = 0.5
    # A refusal that may pass (the id is held by a live engine that may be
    # dying): the engine keeps re-registering until register_timeout_s.
    retry: bool = False
    code: Short | None = None  # bus.errors.ErrorCode of a refusal
    field: Short | None = None  # the Register field (or option) it was refused for
    # -- appended (issue 22): the identity of the head's DEALER on the engine's
    # data socket. The engine sends its acks THERE (after the chunks it produced
    # before them), so a pause's ack can never overtake those chunks; "" (an
    # older head): acks go over the events socket.
    data_peer: Short = ""


class Rejoin(Msg, tag="rejoin"):
    """Head → engine (events socket): a heartbeat came from an engine this head
    does not know (the head restarted): register again, now."""

    reason: Short = ""


class Heartbeat(Msg, tag="heartbeat"):
    engine_id: Id
    incarnation: Id
    running: U63 = 0
    waiting: U63 = 0
    held: U63 = 0  # behind the submission gate
    parked: U63 = 0  # aborted by a pause, re-submitted on resume
    kv_usage: float = 0.0
    weight_version: Version = 0
    paused: Ids = []  # "*" for all, else LoRA names
    steps: U63 = 0
    loras: Ids = []
    sleeping: I32 = 0  # sleep level, 0 awake
    tokens_out: U63 = 0
    # Bumped by every weight/LoRA change. Acks carry it too, so the head never
    # lets an older heartbeat overwrite what a newer ack told it.
    config_epoch: U63 = 0
    # The control op in progress ("" when none): a busy engine is not stalled.
    busy: Short = ""
    # The highest Command seq the engine had acked when this snapshot was taken.
    # Heartbeats travel on another socket than acks: the head trusts `paused` /
    # `sleeping` only from a heartbeat at least as new as the last ack it got
    # (router_node/intended_state.py), so an old snapshot cannot undo an ack.
    acked_seq: U63 = 0
    # The sleep tags ("weights", "kv_cache") asleep: sleep() puts both to sleep,
    # wake_up(tags) wakes them one by one; `sleeping` stays the level until none
    # is asleep. A peer from before tags leaves it empty: the head then reads
    # `sleeping` > 0 as every tag asleep.
    asleep: Ids = []
