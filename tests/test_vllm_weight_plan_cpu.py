"""CPU tests of the weight plan (engine_node.backends.vllm.weight_plan): learned
from a vLLM-shaped model's own load_weights, replayed as copies, and equal to
load_weights bit for bit. Runs in CI (no GPU, no vLLM)."""

from __future__ import annotations

import pytest
import torch

from bus.tensors import pack_bucket, plan_buckets, unpack_bucket
from engine_node.backends.vllm.weight_plan import WeightPlan, plannable
from tests.vllm_like import VllmLikeModel, checkpoint, same_bits, snapshot

pytestmark = pytest.mark.timeout(60)


def bucketed(named, bucket_bytes=4096):
    """The named tensors as views of packed buckets, as a worker sees them."""
    metas, sizes, tensors = plan_buckets(named, bucket_bytes)
    bufs = [pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))]
    return [nt for i, b in enumerate(bufs) for nt in unpack_bucket(i, metas, b)]


def key(named):
    return tuple((n, str(t.dtype), tuple(t.shape)) for n, t in named)


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2)])
def test_plan_equals_load_weights_bit_for_bit(tp_rank, tp_size):
    truth = VllmLikeModel(tp_rank, tp_size, odd=True)
    fast = VllmLikeModel(tp_rank, tp_size, odd=True)
    assert not same_bits(snapshot(truth), snapshot(fast))
    w1 = bucketed(checkpoint(truth, seed=1))
    before = snapshot(fast)
    plan = WeightPlan.record(key(w1), fast, fast.load_weights, w1)
    assert not same_bits(before, snapshot(fast)), "recording wrote to the parameters"
    # Every stacked/narrowed/padded write is planned; the odd loader is left to load_weights.
    assert plan.fallback == {"model.odd.weight"}, plan.why
    assert plan.skipped == {"lm_head.weight"}  # load_weights skips it (tied): nothing to do, ever
    assert "no planned write" in plan.why["model.odd.weight"]
    assert "derived from the input" in plan._tainted["model.odd.weight"]
    assert len(plan.fills) == 1 and plan.fills[0].name == "model.embed_tokens.weight"
    assert not plan.ordered
    truth.load_weights(iter(w1))
    fast.load_weights(iter(w1))  # the first update: load_weights is the truth...
    assert plan.verify(dict(w1)) == []  # ...and the plan reproduces it
    # Later updates: the plan's copies + load_weights for the fallback names only.
    for seed in (2, 3):
        w = bucketed(checkpoint(truth, seed=seed), bucket_bytes=1 << 20)  # another bucket layout: same plan
        truth.load_weights(iter(w))
        n = plan.apply(dict(w))
        fast.load_weights(iter([(k, t) for k, t in w if k in plan.fallback]))
        assert n == len(plan.copies) > 0
        assert same_bits(snapshot(truth), snapshot(fast)) == [], f"seed {seed}"
    # the TP>1 rank reads strided column shards of o_proj / down_proj
    if tp_size > 1:
        c = next(c for c in plan.copies if c.name.endswith("o_proj.weight"))
        assert c.src_offset > 0 and c.src_stride[0] != c.src_size[1]


def test_verify_catches_a_plan_that_disagrees():
    m = VllmLikeModel()
    w = bucketed(checkpoint(m, seed=1))
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    m.load_weights(iter(w))
    victim = next(c for c in plan.copies if c.name.endswith("k_proj.weight"))
    victim.src_offset += 1  # a wrong plan: must be caught, that name falls back
    assert plan.verify(dict(w)) == [victim.name]
    assert victim.name in plan.fallback and all(c.name != victim.name for c in plan.copies)


def test_loader_keeping_python_state_is_never_planned():
    class DictModel(torch.nn.Module):  # keeps tensors in a dict: no parameter write at all
        def __init__(self):
            super().__init__()
            self.w = {}

        def load_weights(self, named):
            for n, t in named:
                self.w[n] = t.clone()
            return set(self.w)

    m = DictModel()
    w = [("a", torch.ones(3)), ("b", torch.zeros(2))]
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    # (its Python state did see the recording pass: the hazard the module doc names)
    assert plan.fallback == {"a", "b"} and not plan.copies


def test_arithmetic_write_taints_the_parameter():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, named):
            for _, t in named:
                self.p.data.copy_(t)
                self.p.data.mul_(2)  # e.g. a scale folded in after the copy
            return {"p"}

    m = Scaled()
    w = [("p", torch.ones(4))]
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    assert plan.fallback == {"p"} and "mul_" in plan.why["p"] and not plan.copies
    assert torch.equal(m.p, torch.zeros(4))


def test_still_valid_and_plannable():
    m = VllmLikeModel()
    w = bucketed(checkpoint(m, seed=1))
    plan = WeightPlan.record(key(w), m, m.load_weights, w)
    assert plan.still_valid(m)
    m.model.norm.weight = torch.nn.Parameter(torch.zeros(m.cfg.hidden, dtype=torch.bfloat16), requires_grad=False)
    assert not plan.still_valid(m)
    assert plannable(m) is None
    m.quant_config = object()
    assert plannable(m) == "quantized model"


# ---------------------------------------------------------------- through the backend (fake engine core)
# The real worker extension on a fake CPU worker whose model is the vLLM-shaped
# one: cuda_ipc handles resolve from a registry (no CUDA here), the nccl
# communicator is a stand-in that "broadcasts" from a list of buckets.


def vllm_like_backend(tmp_path, monkeypatch):
    """The vLLM backend on the fake engine core, its worker's model VllmLikeModel
    (tests/test_vllm_worker_reuse_cpu.py's fixture too); the caller closes it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("real vLLM installed: GPU tests cover it")
    from safetensors.torch import save_file

    from engine_node.backends.vllm import worker_ipc as X  # open_ipc_handle lives there
    from engine_node.backends.vllm.backend import make_backend
    from tests import test_vllm_backend_cpu as T

    ref = VllmLikeModel(seed=5)
    d = tmp_path / "model"
    d.mkdir()
    save_file({n: t.contiguous() for n, t in checkpoint(ref, seed=0)}, str(d / "model.safetensors"))
    registry: dict[bytes, torch.Tensor] = {}
    monkeypatch.setattr(X, "open_ipc_handle", lambda h, dev: registry[h])
    b = make_backend(str(d), max_model_len=64, weight_timeout_s=5.0, _api=T.fake_api(str(d)))
    T.FAKE.worker.model = VllmLikeModel(seed=5)  # same start as `ref`
    b.test_ref, b.test_registry, b.test_fake = ref, registry, T.FAKE
    return b


def _ipc_update(be, named, tag, **args):
    from tests.test_vllm_backend_cpu import wait

    metas, sizes, tensors = plan_buckets(named, 2048)
    handles = []
    for i in range(len(sizes)):
        h = f"{tag}/{i}".encode()
        be.test_registry[h] = pack_bucket(i, metas, sizes, tensors)
        handles.append(h)
    calls0 = len(be.test_fake.calls)
    wait(be.begin_weight_update(tag, "cuda_ipc", metas, {"bucket_sizes": sizes, **args}))
    wait(be.receive_weights(handles))
    assert len(be.test_fake.calls) == calls0, "begin and receive need no worker call for cuda_ipc"
    r = wait(be.commit_weight_update(), timeout=10)
    assert be.test_fake.calls[calls0:] == ["collective_rpc"], "one worker call per cuda_ipc update"
    return r


def test_cuda_ipc_update_is_one_call_and_equals_load_weights(vbe):
    ref, worker = vbe.test_ref, vbe.test_fake.worker
    paths = []
    for k, seed in enumerate((1, 2, 3)):
        named = checkpoint(ref, seed=seed)
        ref.load_weights(iter(named))
        r = _ipc_update(vbe, named, f"u{k}")
        paths.append(r["worker"]["path"])
        assert same_bits(snapshot(ref), snapshot(worker.model)) == [], f"update {k}"
    # first: load_weights (the truth) + the plan recorded and verified; then the plan
    assert paths == ["load_weights+record", "plan", "plan"], paths
    assert r["worker"]["fallback"] == 0  # the tied lm_head is skipped, as load_weights skips it


def test_bad_ipc_handle_fails_the_commit_and_keeps_the_weights(vbe):
    from engine_node.backend import BackendError
    from tests.test_vllm_backend_cpu import wait

    ref, worker = vbe.test_ref, vbe.test_fake.worker
    _ipc_update(vbe, checkpoint(ref, seed=1), "good")  # learn the plan
    before = snapshot(worker.model)
    named = checkpoint(ref, seed=2)
    metas, sizes, tensors = plan_buckets(named, 2048)
    for i in range(len(sizes)):
        vbe.test_registry[f"bad/{i}".encode()] = pack_bucket(i, metas, sizes, tensors)
    vbe.test_registry[f"bad/{len(sizes) - 1}".encode()] = torch.zeros(8, dtype=torch.uint8)  # a short last bucket
    wait(vbe.begin_weight_update("bad", "cuda_ipc", metas, {"bucket_sizes": sizes}))
    wait(vbe.receive_weights([f"bad/{i}".encode() for i in range(len(sizes))]))
    with pytest.raises(BackendError, match="bucket"):
        wait(vbe.commit_weight_update(), timeout=10)
    assert same_bits(before, snapshot(worker.model)) == [], "a refused update wrote parameters"


def test_nccl_receive_stages_once_and_commit_uses_the_plan(vbe):
    from tests.test_vllm_backend_cpu import wait

    ref, worker = vbe.test_ref, vbe.test_fake.worker

    class Comm:  # stands in for PyNcclCommunicator: broadcast() fills from `pending`
        rank = 1
        pending: list[torch.Tensor] = []

        def broadcast(self, buf, src):
            buf.copy_(self.pending.pop(0))

    st = worker._rb()
    worker._rb_nccl = lambda a: st.update(nccl=Comm(), nccl_key="g") or {"rank": 1, "reused": True}
    staging_ids = []
    for k, seed in enumerate((1, 2, 3)):
        named = checkpoint(ref, seed=seed)
        ref.load_weights(iter(named))
        before = snapshot(worker.model)
        metas, sizes, tensors = plan_buckets(named, 2048)
        Comm.pending = [pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))]
        calls0 = len(vbe.test_fake.calls)
        wait(vbe.begin_weight_update(f"n{k}", "nccl", metas, {"bucket_sizes": sizes, "host": "x", "port": 1}))
        r = wait(vbe.receive_weights([]), timeout=10)
        assert r["nccl"]["broadcast_s"] is not None
        assert same_bits(before, snapshot(worker.model)) == [], "nothing visible before commit"
        c = wait(vbe.commit_weight_update(), timeout=10)
        assert vbe.test_fake.calls[calls0:] == ["collective_rpc", "collective_rpc"], "receive + commit"
        assert same_bits(snapshot(ref), snapshot(worker.model)) == [], f"update {k}"
        assert c["worker"]["path"] == ("load_weights+record" if k == 0 else "plan")
        assert c["worker"].get("views_reused") == (None, False, True)[k], "the staging's views are cut once"
        staging_ids.append([b.data_ptr() for b in st["staging"][1]])
    assert staging_ids[0] == staging_ids[1] == staging_ids[2], "staging buffers are reused"
    worker.rollout_bus_nccl_close()
    assert st["kept"] is None, "the views go with the staging"


def test_plan_off_uses_load_weights(vbe):
    vbe.weight_plan = False
    ref, worker = vbe.test_ref, vbe.test_fake.worker
    for k, seed in enumerate((1, 2)):
        named = checkpoint(ref, seed=seed)
        ref.load_weights(iter(named))
        r = _ipc_update(vbe, named, f"off{k}")
        assert r["worker"]["path"] == "load_weights" and r["worker"]["why"] == "off"
        assert same_bits(snapshot(ref), snapshot(worker.model)) == []


def test_weight_check_compares_every_parameter_with_load_weights(vbe):
    ref, worker = vbe.test_ref, vbe.test_fake.worker
    _ipc_update(vbe, checkpoint(ref, seed=1), "c0")
    r = _ipc_update(vbe, checkpoint(ref, seed=2), "c1", weight_check=True)
    assert r["worker"]["path"] == "plan" and r["worker"]["check_mismatch"] == []
    assert r["worker"]["check_params"] == len(dict(worker.model.named_parameters()))
    # a plan gone wrong is caught by the check (and load_weights' result is what stays)
    plan = next(iter(worker._rb()["plans"].values()))
    next(c for c in plan.copies if c.name.endswith("k_proj.weight")).src_offset += 1
    plan._bound = {}  # (the bucket offsets were bound from the right plan)
    named = checkpoint(ref, seed=3)
    ref.load_weights(iter(named))
    r = _ipc_update(vbe, named, "c2", weight_check=True)
    assert r["worker"]["check_mismatch"] == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert same_bits(snapshot(ref), snapshot(worker.model)) == []


def test_plan_through_lora_wrappers(vbe):
    """vLLM's LoRA wrappers keep the layer as .base_layer: the plan is learned and
    replayed with them swapped out (checkpoint names), and they are back after."""
    ref, worker = vbe.test_ref, vbe.test_fake.worker

    class WithLoRA(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.lora_a = torch.nn.Parameter(torch.zeros(2, 2), requires_grad=False)

    attn = worker.model.model.layers[0].self_attn
    wrapper = attn.qkv_proj = WithLoRA(attn.qkv_proj)
    for k, seed in enumerate((1, 2, 3)):
        named = checkpoint(ref, seed=seed)
        ref.load_weights(iter(named))
        r = _ipc_update(vbe, named, f"l{k}")
        assert r["worker"]["path"] == ("load_weights+record" if k == 0 else "plan"), r["worker"]
        assert attn.qkv_proj is wrapper, "the wrapper is back after the update"
        attn.qkv_proj = wrapper.base_layer  # compare with the reference's names
        assert same_bits(snapshot(ref), snapshot(worker.model)) == [], f"update {k}"
        attn.qkv_proj = wrapper
    from engine_node.backends.vllm.worker_apply import _LORA_SWAPS

    assert [m for _, _, m in _LORA_SWAPS[worker.model]] == [wrapper], "nested unwraps must not forget the wrappers"


# ---------------------------------------------------------------- zero-copy cuda_ipc (kept maps)


def _zero_copy_update(be, named, tag, handle_of):
    """One tensor per bucket (trainer_bridge.transports.cuda_ipc.plan_zero_copy's
    layout), handles that repeat for a tensor that did not move."""
    from bus.protocol import TensorMeta
    from bus.tensors import dtype_name
    from tests.test_vllm_backend_cpu import wait

    metas = [
        TensorMeta(n, dtype_name(t), list(t.shape), i, 0, t.numel() * t.element_size())
        for i, (n, t) in enumerate(named)
    ]
    sizes = [m.nbytes for m in metas]
    handles = [handle_of(n, t) for n, t in named]
    wait(be.begin_weight_update(tag, "cuda_ipc", metas, {"bucket_sizes": sizes, "keep_maps": True}))
    wait(be.receive_weights(handles))
    return wait(be.commit_weight_update(), timeout=10)


def test_zero_copy_keeps_maps_and_views_across_updates(vbe, monkeypatch):
    from engine_node.backends.vllm import worker_ipc as X  # open_ipc_handle lives there

    ref, worker = vbe.test_ref, vbe.test_fake.worker
    opened: list[bytes] = []
    params: dict[str, torch.Tensor] = {}  # the trainer's parameters: written in place between updates

    def open_counting(h, dev):
        opened.append(h)
        return params[h.decode()].reshape(-1).view(torch.uint8)

    monkeypatch.setattr(X, "open_ipc_handle", open_counting)
    for name, t in checkpoint(ref, seed=1):
        params[name] = t.clone().contiguous()
    paths, reused = [], []
    for k, seed in enumerate((1, 2, 3, 4)):
        new = dict(checkpoint(ref, seed=seed))
        for name, t in params.items():
            t.copy_(new[name])  # the optimizer step: same memory, new values
        named = list(params.items())
        ref.load_weights(iter(named))
        r = _zero_copy_update(vbe, named, f"z{k}", lambda n, t: n.encode())
        paths.append(r["worker"]["path"])
        reused.append(r["worker"].get("views_reused"))
        assert r["worker"]["maps_kept"] == len(named)
        assert same_bits(snapshot(ref), snapshot(worker.model)) == [], f"update {k}"
    assert paths == ["load_weights+record", "plan", "plan", "plan"]
    assert reused == [None, False, True, True]  # the plan's source views were cut once
    assert len(opened) == len(params), "a kept map was opened again"
    assert worker._rb()["kept"] is not None
    # A failed update keeps no map; a sleep drops them (the colocated trainer's memory).
    bad = dict(params)
    first = next(iter(bad))
    params[first] = torch.zeros(1)  # a short tensor behind the handle: the validation refuses it
    opened.clear()
    monkeypatch.setattr(
        X,
        "open_ipc_handle",
        lambda h, dev: (
            params[h.decode()].reshape(-1).view(torch.uint8)
            if h.decode() != first
            else torch.zeros(1, dtype=torch.uint8)
        ),
    )
    worker.rollout_bus_drop_maps()
    from engine_node.backend import BackendError

    with pytest.raises(BackendError):
        _zero_copy_update(vbe, list(bad.items()), "zbad", lambda n, t: n.encode())
    assert worker._rb()["maps"] == {}
    assert same_bits(snapshot(ref), snapshot(worker.model)) == [], "a refused update wrote parameters"


def test_drop_maps_forgets_kept_maps(vbe):
    worker = vbe.test_fake.worker
    st = worker._rb()
    st["maps"] = {b"x": torch.zeros(4, dtype=torch.uint8)}
    st["kept"] = object()  # (its views pin the maps)
    assert worker.rollout_bus_drop_maps() == 1
    assert st["maps"] == {} and st["kept"] is None


def test_plan_zero_copy_refuses_what_cannot_be_shared_in_place():
    from trainer_bridge.transports.cuda_ipc import plan_zero_copy

    assert plan_zero_copy([("w", torch.zeros(4))]) is None  # not on a GPU: packed buckets instead
    assert plan_zero_copy([]) is None


def test_one_trip_through_the_engine_txn_is_one_worker_call_and_writes_like_load_weights(vbe, monkeypatch):
    """engine_node/one_trip.py on the vLLM backend's cuda_ipc path: the first
    update brings its handles and a layout id; the next names the layout only
    and commits in the same op (one worker call, kept maps, the head's version)."""
    from bus.errors import BackendRefused
    from bus.protocol import BeginWeightUpdate, FinishWeightUpdate, TensorMeta
    from bus.tensors import dtype_name
    from bus.transport import CudaIpcArgs
    from engine_node.backends.vllm import worker_ipc as X
    from engine_node.core import RequestCore
    from engine_node.weight_update import WeightUpdates

    ref, worker, fake = vbe.test_ref, vbe.test_fake.worker, vbe.test_fake
    params = {n: t.clone().contiguous() for n, t in checkpoint(ref, seed=1)}
    opened: list[bytes] = []

    def open_counting(h, dev):
        opened.append(h)
        return params[h.decode()].reshape(-1).view(torch.uint8)

    monkeypatch.setattr(X, "open_ipc_handle", open_counting)
    core = RequestCore(vbe, vbe.info(), "e0")
    txn = WeightUpdates(vbe, core, "e0", "inproc://w")

    def run(res):
        return res.then(res.op.future.result(timeout=10))

    named = list(params.items())
    metas = [
        TensorMeta(n, dtype_name(t), list(t.shape), i, 0, t.numel() * t.element_size())
        for i, (n, t) in enumerate(named)
    ]
    args = CudaIpcArgs(keep_maps=True)
    first = BeginWeightUpdate(
        "u1", "cuda_ipc", metas, [m.nbytes for m in metas], transport_args=args, prepare=True,
        handles=[n.encode() for n, _ in named], layout="L",
    )  # fmt: skip
    run(txn.begin(first))
    done = run(txn.commit(FinishWeightUpdate("u1")))
    assert done.layout == "L" and done.detail["path"] == "two_trip"
    for seed in (2, 3):
        new = dict(checkpoint(ref, seed=seed))
        for n, t in params.items():
            t.copy_(new[n])  # the optimizer step: same memory
        ref.load_weights(iter(list(params.items())))
        calls0 = len(fake.calls)
        op = BeginWeightUpdate(
            f"u{seed}", "cuda_ipc", [], [], transport_args=args, layout="L", commit=True, version=10 + seed
        )
        done = run(txn.begin(op))
        assert fake.calls[calls0:] == ["collective_rpc"], "one worker call per one-trip update"
        assert done.weight_version == core.weight_version == 10 + seed
        assert done.detail["path"] == "one_trip" and done.detail["worker"]["maps_kept"] == len(params)
        assert done.layout == "L" and txn.current is None
        assert same_bits(snapshot(ref), snapshot(worker.model)) == [], f"update {seed}"
    assert len(opened) == len(params), "a kept map was opened again"
    core.gate.sleeps += 1  # a sleep began (it drops the kept maps)
    with pytest.raises(BackendRefused, match="slept since") as e:
        txn.begin(BeginWeightUpdate("u9", "cuda_ipc", [], [], transport_args=args, layout="L", commit=True))
    assert e.value.field == "layout" and core.weight_version == 13 and txn.current is None
