"""The transport registry (bus/transport.py, trainer_bridge/transports/,
engine_node/transports/), without processes: every transport has its args on
the wire, one sender and one receiver, found by lookup; bad names and args
are typed errors naming the field."""

from __future__ import annotations

import msgspec
import pytest

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest
from bus.transport import ARGS_OF, CudaIpcArgs, NcclArgs, Transport, ZmqArgs, backend_args, check_args
from engine_node.backends.vllm.transports import VLLM_RECEIVERS
from engine_node.transports.registry import RECEIVERS, receiver_for
from trainer_bridge.transports.registry import SENDERS, sender_kind


def test_every_transport_has_args_a_sender_and_a_receiver() -> None:
    for t in Transport:
        assert t in ARGS_OF and t in SENDERS and t in RECEIVERS and t in VLLM_RECEIVERS, t
        assert RECEIVERS[t].transport is t and VLLM_RECEIVERS[t.value].transport is t
        assert ARGS_OF[t].__struct_config__.tag == t.value
    assert [t.value for t in Transport] == ["zmq", "cuda_ipc", "nccl", "vllm_nccl"], "the wire strings stay the same"


def test_only_the_transport_whose_bytes_pass_the_node_takes_lora_or_a_plan() -> None:
    assert [t for t in Transport if RECEIVERS[t].takes_lora] == [Transport.ZMQ]
    assert [t for t in Transport if not RECEIVERS[t].out_of_band] == [Transport.ZMQ]
    assert [t for t in Transport if SENDERS[t].takes_plan] == [Transport.ZMQ]


def test_unknown_transport_names_the_field() -> None:
    with pytest.raises(BadRequest) as e:
        receiver_for("carrier-pigeon")
    assert e.value.field == "transport" and "zmq, cuda_ipc, nccl, vllm_nccl" in str(e.value)
    with pytest.raises(ValueError, match="unknown transport 'carrier-pigeon'"):
        sender_kind("carrier-pigeon")


def test_args_of_another_transport_are_refused_naming_transport_args() -> None:
    with pytest.raises(BadRequest) as e:
        check_args("cuda_ipc", NcclArgs(host="h", port=1, world_size=2, group_id="g"))
    assert e.value.field == "transport_args"
    check_args("cuda_ipc", CudaIpcArgs(keep_maps=True))
    check_args("nccl", None)


def test_args_travel_typed_and_bad_ones_are_refused_at_decode_naming_the_field() -> None:
    codec = Codec()
    args = NcclArgs(host="10.0.0.1", port=29500, world_size=3, group_id="g1", timeout_s=5.0, sender_group=True)
    op = P.ReceiveWeights("u", [b"h0"], sender=1, transport_args=args)
    cmd = P.Command(seq=1, op=op)
    got, _ = codec.decode(codec.encode(cmd))
    assert got.op.transport_args == args and got.op.handles == [b"h0"]
    begin = P.BeginWeightUpdate("u", Transport.CUDA_IPC, [], [], transport_args=CudaIpcArgs(weight_check=True))
    got, _ = codec.decode(codec.encode(P.Command(seq=2, op=begin)))
    assert got.op.transport is Transport.CUDA_IPC and got.op.transport_args == CudaIpcArgs(weight_check=True)
    bad = msgspec.structs.replace(args, port=70000)
    with pytest.raises(BadRequest) as e:
        codec.decode(codec.encode(P.Command(seq=3, op=P.ReceiveWeights("u", transport_args=bad))))
    assert e.value.field is not None and e.value.field.endswith("transport_args.port"), e.value.field
    with pytest.raises(BadRequest) as e:
        codec.decode(codec.encode(P.Command(seq=4, op=P.BeginWeightUpdate("u", "pigeon", [], []))))  # type: ignore[arg-type]
    assert e.value.field is not None and e.value.field.endswith("transport"), e.value.field


def test_backends_take_the_args_as_builtins_with_the_bucket_sizes() -> None:
    a = NcclArgs(host="h", port=1, world_size=2, group_id="g")
    d = backend_args(a, [256, 512])
    assert d == {
        "host": "h",
        "port": 1,
        "world_size": 2,
        "group_id": "g",
        "weight_check": False,
        "sender_group": False,
        "check_in": "",
        "verdict": False,
        "bucket_sizes": [256, 512],
    }, "unset optional args (timeout_s, rank_offset) are left out: the engine's defaults apply"
    assert backend_args(None, []) == {"bucket_sizes": []}
    assert backend_args(ZmqArgs(), [8]) == {"bucket_sizes": [8]}
