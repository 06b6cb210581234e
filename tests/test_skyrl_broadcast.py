"""SkyRL's broadcast weight sync (BroadcastTransferStrategy) on rollout-bus,
the parts that run without CUDA (the NCCL run is tests/gpu/test_skyrl_gpu.py):
- the vllm_nccl plan: vLLM's packed chunks as buckets (the cut after the
  tensor that goes PAST the buffer); checked against vLLM's own pack_tensors
  in tests/gpu/test_vllm_packed_plan.py, where vLLM imports;
- the rank arithmetic against SkyRL's own `BroadcastInitInfo.for_servers`;
- typed errors (field names) at the trainer and at the engine's receiver;
- the adapter's flow and ordering with SkyRL's REAL BroadcastTransferStrategy
  and BroadcastWeightTransferSender: a FAKE head (the engines' acks) and a FAKE
  vLLM trainer half (trainer_init / trainer_send_weights) that each wait for
  the other side like NCCL does, so a sequential flow deadlocks and fails.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import types
import typing

import pytest

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest, Unsupported
from bus.transport import Transport, VllmNcclArgs
from engine_node.transports.vllm_nccl import engine_args
from trainer_bridge.skyrl.broadcast import check_backends, group_of
from trainer_bridge.transports.registry import sender_kind
from trainer_bridge.transports.vllm_nccl import packed_plan, rank_offsets

if sys.version_info < (3, 12):  # as tests/test_skyrl_generator.py: skyrl's pydantic models
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


def _skyrl():
    try:
        from skyrl.backends.skyrl_train.weight_sync import (
            BroadcastInitInfo,
            BroadcastTransferStrategy,
            WeightChunk,
            get_transfer_strategy_cls,
        )
    except Exception as e:
        pytest.skip(f"skyrl not importable ({type(e).__name__}: {e})")
    return BroadcastInitInfo, BroadcastTransferStrategy, WeightChunk, get_transfer_strategy_cls


def view(eid: str, tp: int = 1, backend: str = "vllm") -> P.EngineView:
    return P.EngineView(eid, healthy=True, backend=backend, tp=tp)


# ---------------------------------------------------------------- the plan


def test_packed_plan_cuts_after_the_tensor_that_goes_past_the_buffer() -> None:
    names = ["a", "b", "c", "d", "e"]
    # float32 [10] = 40 bytes each; buffer 100: a+b = 80, +c = 120 > 100 → cut after c
    metas, sizes = packed_plan(names, ["float32"] * 5, [[10]] * 5, buffer_size_bytes=100)
    assert sizes == [120, 80]
    assert [(m.name, m.bucket, m.offset, m.nbytes) for m in metas] == [
        ("a", 0, 0, 40),
        ("b", 0, 40, 40),
        ("c", 0, 80, 40),
        ("d", 1, 0, 40),
        ("e", 1, 40, 40),
    ]
    # exactly the buffer is not past it; one tensor larger than the buffer is a chunk of its own
    _, sizes = packed_plan(["a", "b", "c"], ["bfloat16", "torch.bfloat16", "float32"], [[25], [25], [40]], 100)
    assert sizes == [100 + 160]
    _, sizes = packed_plan(["big", "x"], ["float32", "float32"], [[100], [1]], 100)
    assert sizes == [400, 4]
    assert packed_plan([], [], [], 100) == ([], [])


def test_packed_plan_refuses_bad_metadata_naming_the_field() -> None:
    with pytest.raises(BadRequest) as e:
        packed_plan(["a", "b"], ["float32"], [[1], [1]])
    assert e.value.field == "update_info.names"
    with pytest.raises(BadRequest) as e:
        packed_plan(["a"], ["complex-ish"], [[1]])
    assert e.value.field == "update_info.dtype_names"
    with pytest.raises(BadRequest) as e:
        packed_plan(["a"], ["float32"], [[-1]])
    assert e.value.field == "update_info.shapes"


# ---------------------------------------------------------------- ranks and args


def test_rank_offsets_are_skyrls_for_servers() -> None:
    BroadcastInitInfo, *_ = _skyrl()
    engines = [view("e2", tp=2), view("e0", tp=2), view("e1", tp=2)]
    info = BroadcastInitInfo(
        override_existing_receiver=True, master_addr="h", master_port=1, rank_offset=1, world_size=7
    )
    theirs = [x.rank_offset for x in info.for_servers(world_size_per_server=2, num_servers=3)]
    assert list(rank_offsets(engines, 1).values()) == theirs == [1, 3, 5]
    assert rank_offsets(engines, 1) == {"e0": 1, "e1": 3, "e2": 5}  # engine-id order
    assert rank_offsets([view("a", tp=1), view("b", tp=4), view("c")], 1) == {"a": 1, "b": 2, "c": 6}


def test_group_args_travel_typed_and_each_engine_takes_its_own_offset() -> None:
    info = types.SimpleNamespace(master_addr="10.0.0.7", master_port=29511, rank_offset=1, world_size=5)
    g = group_of(info, [view("e0", tp=2), view("e1", tp=2)], 30.0)
    assert g.args.rank_offsets == {"e0": 1, "e1": 3} and g.args.group_id == "vllm:10.0.0.7:29511"
    begin = P.BeginWeightUpdate("u", Transport.VLLM_NCCL, [], [], transport_args=g.args, prepare=True)
    codec = Codec()
    got, _ = codec.decode(codec.encode(P.Command(seq=1, op=begin)))
    assert got.op.transport is Transport.VLLM_NCCL and got.op.transport_args == g.args
    a = engine_args(got.op, "e1")
    assert a["rank_offset"] == 3 and "rank_offsets" not in a and a["world_size"] == 5 and a["timeout_s"] == 30.0
    with pytest.raises(BadRequest) as e:
        engine_args(got.op, "e9")
    assert e.value.field == "transport_args.rank_offsets"
    with pytest.raises(BadRequest) as e:  # SkyRL counted other engines: world_size names it
        group_of(types.SimpleNamespace(**{**vars(info), "world_size": 4}), g.engines, 30.0)
    assert e.value.field == "world_size"
    bad = VllmNcclArgs(host="h", port=1, world_size=2, rank_offsets={"e": 1}, group_id="g", packed_num_buffers=0)
    with pytest.raises(BadRequest) as e:
        codec.decode(codec.encode(P.Command(seq=2, op=P.ReceiveWeights("u", transport_args=bad))))
    assert e.value.field is not None and e.value.field.endswith("packed_num_buffers")


def test_engines_off_the_vllm_backend_are_refused_naming_weight_sync_backend() -> None:
    with pytest.raises(Unsupported) as e:
        check_backends([view("e0"), view("e1", backend="torch")])
    assert e.value.field == "weight_sync_backend" and "e1" in str(e.value) and "torch" in str(e.value)
    assert "skyrl.weights" in str(e.value)  # what to use instead
    check_backends([view("e0")])


def test_the_trainer_side_sends_nothing_itself() -> None:
    kind = sender_kind("vllm_nccl")
    assert kind.takes_plan is False
    with pytest.raises(Unsupported) as e:
        kind.part_sender(None, "u", 0, [])
    assert e.value.field == "transport" and "transport='nccl'" in str(e.value)


# ---------------------------------------------------------------- SkyRL's real sender, fake head


class FakeHead:
    """FAKE head + engines: records every control op and answers as engines
    would. The engines' receive waits for the trainer's rank 0 (as a NCCL
    collective does): the join for trainer_init, the update for the broadcast."""

    _loop = None
    _closed = False
    address = "tcp://fake"

    def __init__(self, engines: list[P.EngineView]) -> None:
        self.engines = {e.engine_id: e for e in engines}
        self.ops: list[P.Op] = []
        self.version = 4
        self.trainer_joined = threading.Event()
        self.engines_joined = threading.Event()
        self.receiving = threading.Event()
        self.broadcast_done = threading.Event()

    async def health_view(self, timeout_s: float | None = None) -> P.HealthView:
        return P.HealthView(healthy=True, engines=self.engines, weight_version=self.version)

    async def control(self, op: P.Op, targets=None, timeout_s=None, strict=True):
        self.ops.append(op)
        eids = list(targets or self.engines)
        if isinstance(op, P.ReceiveWeights):  # the join: every worker meets rank 0
            self.engines_joined.set()
            assert await asyncio.to_thread(self.trainer_joined.wait, 10), "rank 0 never joined: deadlock"
            return {e: P.ReceiveWeightsResult(detail={"rank": 1}) for e in eids}
        if isinstance(op, P.BeginWeightUpdate) and op.prepare:
            self.receiving.set()
            assert await asyncio.to_thread(self.broadcast_done.wait, 10), "no broadcast arrived: deadlock"
            return {e: P.WeightsPrepared(tensors=len(op.tensors)) for e in eids}
        if isinstance(op, P.BeginWeightUpdate):
            return {e: P.BeginWeightsResult() for e in eids}
        if isinstance(op, P.AbortWeightUpdate):
            return {e: P.WeightsAborted(weight_version=self.version) for e in eids}
        if isinstance(op, P.FinishWeightUpdate):
            self.version += 1
            return {e: P.WeightsCommitted(weight_version=self.version) for e in eids}
        raise AssertionError(f"unexpected op {op!r}")


def fake_vllm_trainer(monkeypatch, head: FakeHead) -> list[tuple[str, typing.Any]]:
    """FAKE vLLM trainer half (vllm.distributed.weight_transfer.nccl_engine):
    each call waits for the engines like the NCCL collective it stands for."""
    calls: list[tuple[str, typing.Any]] = []

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_init(init_info):
            calls.append(("trainer_init", dict(init_info)))
            head.trainer_joined.set()
            assert head.engines_joined.wait(10), "the engines never joined: deadlock"
            return "group"

        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            assert head.receiving.wait(10), "no engine is receiving: the broadcast would hang"
            calls.append(("trainer_send_weights", ([n for n, _ in iterator], dict(trainer_args))))
            head.broadcast_done.set()

    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    mod = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    mod.NCCLWeightTransferEngine = NCCLWeightTransferEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return calls


@pytest.fixture
def gloo_rank0():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_skyrls_real_broadcast_strategy_drives_one_update_in_its_order(monkeypatch, gloo_rank0) -> None:
    _, BroadcastTransferStrategy, WeightChunk, get_transfer_strategy_cls = _skyrl()
    import torch

    import trainer_bridge.skyrl.engine as S  # has_cuda is looked up there
    from trainer_bridge.skyrl import RolloutBusEngine

    monkeypatch.setattr(S, "has_cuda", lambda: True)  # this flow's CUDA is faked below
    engines = [view("e0", tp=2), view("e1", tp=2)]
    head = FakeHead(engines)
    calls = fake_vllm_trainer(monkeypatch, head)
    strategy = get_transfer_strategy_cls("nccl", colocate_all=False)
    assert strategy is BroadcastTransferStrategy
    named = [("w.a", torch.ones(4, 4)), ("w.b", torch.zeros(8)), ("w.c", torch.ones(3, dtype=torch.bfloat16))]
    chunks = [WeightChunk(names=[n], dtypes=[str(t.dtype)], shapes=[list(t.shape)], tensors=[t]) for n, t in named]
    meta = {
        "names": [n for n, _ in named],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
    }

    async def scenario():
        engine = RolloutBusEngine(head, engines=[P.as_dict(e) for e in engines])  # type: ignore[arg-type]
        world, _ = await engine.get_world_size()
        info = strategy.create_init_info(types.SimpleNamespace(run_engines_locally=False), inference_world_size=world)
        # SkyRL's Worker.init_weight_sync_state: sender and receivers CONCURRENTLY
        sender, joined = await asyncio.gather(
            asyncio.to_thread(strategy.create_sender, init_info=info, inference_client=engine),
            engine.init_weight_update_communicator(info),
        )
        await sender.send_chunks(chunks, weight_metadata=meta)  # SkyRL's sender, unmodified
        return info, joined

    info, joined = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert info.world_size == 5 and joined["transport"] == "vllm_nccl"
    assert [c[0] for c in calls] == ["trainer_init", "trainer_send_weights"]
    assert calls[0][1]["world_size"] == 5 and calls[1][1] == (meta["names"], {"group": "group", "packed": True})
    kinds = [(type(op).__name__, getattr(op, "prepare", None)) for op in head.ops]
    assert kinds == [
        ("BeginWeightUpdate", False),  # the join: an empty transaction...
        ("ReceiveWeights", None),  # ...whose receive meets trainer_init
        ("AbortWeightUpdate", None),  # ...and ends without a version
        ("BeginWeightUpdate", True),  # the update: received and voted while SkyRL broadcasts
        ("FinishWeightUpdate", None),  # finish_weight_update: the head commits
    ]
    join, update = head.ops[0], head.ops[3]
    assert isinstance(join, P.BeginWeightUpdate) and isinstance(update, P.BeginWeightUpdate)
    assert join.transport_args == update.transport_args
    args = update.transport_args
    assert isinstance(args, VllmNcclArgs) and args.rank_offsets == {"e0": 1, "e1": 3}
    assert (args.host, args.port, args.world_size) == (info.master_addr, info.master_port, 5)
    assert [m.name for m in update.tensors] == meta["names"] and update.bucket_sizes == [64 + 32 + 6]
    assert head.version == 5  # one commit: version + 1


def test_update_weights_nccl_out_of_order_is_a_typed_error(monkeypatch) -> None:
    from trainer_bridge.skyrl import RolloutBusEngine

    head = FakeHead([view("e0")])
    meta = {"names": ["w.a"], "dtype_names": ["float32"], "shapes": [[4]], "packed": True}

    async def scenario():
        engine = RolloutBusEngine(head, engines=[P.as_dict(view("e0"))])  # type: ignore[arg-type]
        with pytest.raises(BadRequest) as e:
            await engine.update_weights_nccl(meta)
        assert e.value.field == "weight_update"
        await engine.start_weight_update()
        with pytest.raises(BadRequest) as e:
            await engine.update_weights_nccl(meta)
        assert e.value.field == "init_info"
        assert await engine.finish_weight_update() == {"updated": 0}

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert head.ops == []


def test_skyrls_broadcast_init_on_a_trainer_without_cuda_is_a_typed_error(monkeypatch) -> None:
    BroadcastInitInfo, *_ = _skyrl()
    import trainer_bridge.skyrl.engine as S  # has_cuda is looked up there
    from trainer_bridge.skyrl import RolloutBusEngine

    monkeypatch.setattr(S, "has_cuda", lambda: False)
    head = FakeHead([view("e0")])
    info = BroadcastInitInfo(
        override_existing_receiver=True, master_addr="h", master_port=1, rank_offset=1, world_size=2
    )

    async def scenario():
        engine = RolloutBusEngine(head, engines=[P.as_dict(view("e0"))])  # type: ignore[arg-type]
        await engine.init_weight_update_communicator(info)

    with pytest.raises(Unsupported) as e:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    assert e.value.field == "weight_sync_backend" and "no CUDA device" in str(e.value)
    assert "weight_sync_backend to anything but 'nccl'" in str(e.value) and head.ops == []
