"""CPU tests of engine_node/backends/vllm/fp8.py (no vLLM, no GPU).

The model and the reload machinery are FAKES that mirror vLLM 0.24's
semantics as vllm/fp8 relies on them (model_executor/model_loader/reload):
checkpoint-format tensors recorded at construction; `initialize` keeps the
kernel tensors aside and re-creates checkpoint-format staging tensors (filled
with NaN here, so memory nobody loaded shows); a layer is processed as soon as
all its elements arrived and the result is copied INTO the old kernel tensors'
storage; `finalize` processes layers that stopped short (as vLLM does) and puts
back the kernel tensors of layers that got nothing. Quantization is real
(torch's float8_e4m3fn on CPU, one dynamic scale per tensor, fused shards
together, like Fp8PerTensorOnlineLinearMethod). The real thing runs in
tests/gpu/test_vllm_fp8.py.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from engine_node.backends.vllm import fp8
from engine_node.backends.vllm.fp8 import QuantizedLoadError, incomplete_groups, load_into_quantized, quant_kind

F8 = torch.float8_e4m3fn
FMAX = torch.finfo(F8).max
BF16 = torch.bfloat16
H, KV, LAYERS = 32, 16, 2


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().max() / FMAX).clamp(min=1e-12)
    return (w.float() / scale).clamp(-FMAX, FMAX).to(F8), scale.reshape(())


class Fp8PerTensorOnlineLinearMethod:  # the names matter: vllm/fp8 reads class names
    uses_meta_device = True

    def process_weights_after_loading(self, layer):
        q, s = quantize(layer.weight)
        layer.weight = torch.nn.Parameter(q.t(), requires_grad=False)  # kernel format [in, out]
        layer.weight_scale = torch.nn.Parameter(s, requires_grad=False)


class Fp8LinearMethod:  # serialized fp8 checkpoint
    def process_weights_after_loading(self, layer):
        pass


class UnquantizedLinearMethod:
    def process_weights_after_loading(self, layer):
        pass


class Fp8KVCacheMethod:
    pass


def default_loader(param, loaded):
    param.data.copy_(loaded)


class Linear(torch.nn.Module):
    def __init__(self, shards: dict[str, int], in_dim: int, method):
        super().__init__()
        self.shards, self.quant_method = shards, method
        self.orig_dtype = BF16  # vLLM's online fp8 method sets it (vllm/fp8's fallback model_config reads it)
        self.weight = torch.nn.Parameter(torch.zeros(sum(shards.values()), in_dim, dtype=BF16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            param.data.copy_(loaded)
            return
        off = 0
        for k, n in self.shards.items():
            if k == shard_id:
                param.data[off : off + n].copy_(loaded)
                return
            off += n
        raise KeyError(shard_id)

    def dense(self) -> torch.Tensor:
        if self.weight.dtype == F8:
            return (self.weight.float() * self.weight_scale).t()
        return self.weight.float()


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(H, dtype=BF16), requires_grad=False)


class FakeModel(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, method=Fp8PerTensorOnlineLinearMethod):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            layer = torch.nn.Module()
            layer.qkv_proj = Linear({"q": H, "k": KV, "v": KV}, H, method())
            layer.o_proj = Linear({"o": H}, H, method())
            self.model.layers.append(layer)
        self.model.norm = Norm()
        self.lm_head = Linear({"w": 64}, H, UnquantizedLinearMethod())

    def load_weights(self, named):
        loaded = set()
        for name, t in named:
            shard = None
            for ckpt, s in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
                if f".{ckpt}." in name:
                    name, shard = name.replace(ckpt, "qkv_proj"), s
            param = self.get_parameter(name)
            loader = getattr(param, "weight_loader", default_loader)
            loader(param, t) if shard is None else loader(param, t, shard)
            loaded.add(name)
        return loaded

    def forward(self, x):
        for layer in self.model.layers:
            x = x + x @ layer.qkv_proj.dense()[:H].t()
            x = x + x @ layer.o_proj.dense().t()
        return (x * self.model.norm.weight.float()) @ self.lm_head.dense().t()


class FakeReload:
    """vLLM's layerwise reload, as vllm/fp8 relies on it (see the module docstring)."""

    def __init__(self):
        self.meta: dict[torch.nn.Module, dict[str, tuple]] = {}
        self.open: dict[torch.nn.Module, dict] = {}
        self.calls: list[str] = []
        self.cfg = None

    def record(self, model):  # record_metadata_for_reloading, at construction
        for m in model.modules():
            self.meta[m] = {n: (tuple(p.shape), p.dtype, dict(p.__dict__)) for n, p in m._parameters.items()}

    def initialize(self, model):
        self.calls.append("initialize")
        for m in model.modules():
            rec = self.meta.get(m)
            if not rec:
                continue
            kernel = dict(m._parameters)
            for n in list(m._parameters):
                delattr(m, n)
            st = {"kernel": kernel, "loaded": 0, "total": 0}
            for n, (shape, dtype, attrs) in rec.items():
                p = torch.nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)
                p.__dict__.update(attrs)
                p.weight_loader = self._wrap(m, st, getattr(p, "weight_loader", default_loader), p)
                m.register_parameter(n, p)
                st["total"] += p.numel()
            self.open[m] = st

    def _wrap(self, m, st, loader, param):
        def online_process_loader(p, loaded, *a):
            loader(p, loaded, *a)
            st["loaded"] += min(loaded.numel(), param.numel())
            if st["loaded"] >= st["total"]:
                self._process(m)

        return online_process_loader

    def _process(self, m):
        st = self.open.pop(m)
        qm = getattr(m, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(m)
        for n, kt in st["kernel"].items():
            kt.data.copy_(getattr(m, n))  # into the old storage (CUDA graphs keep their pointers)
        self._place(m, st)

    def _place(self, m, st):
        for n in list(m._parameters):
            delattr(m, n)
        for n, kt in st["kernel"].items():
            m.register_parameter(n, kt)

    def finalize(self, model, cfg):
        self.calls.append("finalize")
        self.cfg = cfg
        for m in list(self.open):
            st = self.open[m]
            if st["loaded"] == 0:
                self._place(m, self.open.pop(m))
            else:
                self._process(m)  # vLLM's "delayed processing": whatever is in the staging memory

    def progress(self, m):
        st = self.open.get(m)
        return None if st is None else (st["loaded"], st["total"])

    def forget(self, m):
        self.open[m]["loaded"] = 0


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "q_proj.weight"] = torch.randn(H, H, generator=g)
        sd[p + "k_proj.weight"] = torch.randn(KV, H, generator=g)
        sd[p + "v_proj.weight"] = torch.randn(KV, H, generator=g)
        sd[p + "o_proj.weight"] = torch.randn(H, H, generator=g) * (1 + i)
    sd["model.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    sd["lm_head.weight"] = torch.randn(64, H, generator=g)
    return {k: v.to(BF16) for k, v in sd.items()}  # what a trainer sends


def fresh(sd, method=Fp8PerTensorOnlineLinearMethod):
    """An fp8 'engine' started on `sd`: built, loaded, processed once."""
    model, api = FakeModel(method), FakeReload()
    api.record(model)
    model.load_weights(sd.items())
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(m)
    return model, api


def kernel_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


X = torch.randn(3, H)


def test_update_equals_fresh_engine_bit_for_bit_in_the_same_storage():
    A, B = checkpoint(0), checkpoint(1)
    model, api = fresh(A)
    ref, _ = fresh(B)
    assert not same_bits(kernel_state(model), kernel_state(ref))  # the check below can fail
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    objs = {n: p for n, p in model.named_parameters()}
    cfg = types.SimpleNamespace(dtype=BF16)
    n = load_into_quantized(model, list(B.items()), cfg, api=api)
    assert n == len(B) - 2 * LAYERS  # q/k/v land in one qkv_proj param
    assert api.calls == ["initialize", "finalize"] and api.cfg is cfg and not api.open
    assert same_bits(kernel_state(model), kernel_state(ref)), "fp8 bytes and scales equal a fresh engine on B"
    assert model.model.layers[0].qkv_proj.weight.dtype == F8
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs, "kernel storage kept (CUDA graphs)"
    assert all(p is objs[n] for n, p in model.named_parameters())
    assert torch.equal(model(X), ref(X))
    # and back to A, streamed (the zmq path hands a generator over its buckets)
    load_into_quantized(model, iter(list(A.items())), api=api)
    assert same_bits(kernel_state(model), kernel_state(fresh(A)[0]))
    assert api.cfg.dtype == BF16, "no model_config given: finalize gets the layers' orig_dtype"


def test_incomplete_fused_layer_refused_before_anything_is_touched():
    A, B = checkpoint(0), checkpoint(1)
    model, api = fresh(A)
    before = kernel_state(model)
    partial = [(k, v) for k, v in B.items() if k != "model.layers.1.v_proj.weight"]
    with pytest.raises(QuantizedLoadError, match="v_proj") as e:
        load_into_quantized(model, partial, api=api)
    assert e.value.field == "model.layers.1.qkv_proj.weight"
    assert api.calls == [] and same_bits(kernel_state(model), before)
    # a partial update of WHOLE layers is fine: the rest keeps its weights
    only0 = [(k, v) for k, v in B.items() if k.startswith("model.layers.0.")]
    load_into_quantized(model, only0, api=api)
    got, refB = kernel_state(model), kernel_state(fresh(B)[0])
    for k in got:
        assert same_bits({k: got[k]}, {k: (refB if k.startswith("model.layers.0.") else before)[k]}), k


def test_streamed_partial_layer_keeps_old_weights_and_names_it():
    A, B = checkpoint(0), checkpoint(1)
    model, api = fresh(A)
    before = kernel_state(model)
    gen = ((k, v) for k, v in B.items() if k != "model.layers.1.k_proj.weight")
    with pytest.raises(QuantizedLoadError, match="model.layers.1.qkv_proj") as e:
        load_into_quantized(model, gen, api=api)
    assert e.value.field == "model.layers.1.qkv_proj"
    got, refB = kernel_state(model), kernel_state(fresh(B)[0])
    assert not any(t.float().isnan().any() for t in got.values()), "no uninitialized shard was quantized"
    assert same_bits({k: got[k] for k in got if ".1.qkv" in k}, {k: before[k] for k in got if ".1.qkv" in k})
    assert same_bits({k: got[k] for k in got if ".1.qkv" not in k}, {k: refB[k] for k in got if ".1.qkv" not in k})
    assert not api.open


def test_error_mid_load_leaves_no_layer_in_staging():
    A, B = checkpoint(0), checkpoint(1)
    model, api = fresh(A)
    objs = {n: p for n, p in model.named_parameters()}

    def boom():
        for i, (k, v) in enumerate(B.items()):
            if i == 5:  # after layer 0 and half of layer 1's qkv
                raise OSError("transport died")
            yield k, v

    with pytest.raises(OSError, match="transport died"):
        load_into_quantized(model, boom(), api=api)
    assert api.calls == ["initialize", "finalize"] and not api.open
    assert all(p is objs[n] for n, p in model.named_parameters()), "every layer back on its kernel tensors"
    assert not any(p.float().isnan().any() for p in model.parameters())


def test_dtype_refusals():
    A = checkpoint(0)
    model, api = fresh(A)
    before = kernel_state(model)
    bad = dict(A)
    bad["model.layers.0.o_proj.weight"] = A["model.layers.0.o_proj.weight"].to(F8)
    with pytest.raises(QuantizedLoadError, match="float8") as e:
        load_into_quantized(model, list(bad.items()), api=api)
    assert e.value.field == "model.layers.0.o_proj.weight" and api.calls == []
    assert same_bits(kernel_state(model), before)
    # streamed: refused as it arrives, rolled back like any error
    with pytest.raises(QuantizedLoadError, match="float8"):
        load_into_quantized(model, iter(list(bad.items())), api=api)
    assert not api.open and not any(p.float().isnan().any() for p in model.parameters())
    # a model started from an fp8 checkpoint does not take bf16
    ser, sapi = fresh(A, Fp8LinearMethod)
    assert quant_kind(ser) == "serialized"
    with pytest.raises(QuantizedLoadError, match="quantization='fp8'"):
        load_into_quantized(ser, list(A.items()), api=sapi)


def test_quant_kind():
    def with_methods(*methods):
        m = torch.nn.Module()
        for i, qm in enumerate(methods):
            sub = torch.nn.Module()
            sub.quant_method = qm
            m.add_module(f"l{i}", sub)
        return m

    assert quant_kind(fresh(checkpoint(0))[0]) == "online"
    assert quant_kind(with_methods(UnquantizedLinearMethod(), Fp8KVCacheMethod())) is None
    assert quant_kind(with_methods(UnquantizedLinearMethod(), None)) is None
    assert quant_kind(with_methods(Fp8LinearMethod(), Fp8PerTensorOnlineLinearMethod())) == "serialized"
    assert fp8.is_quantized(with_methods(Fp8LinearMethod()))


def test_incomplete_groups():
    packed = fp8.DEFAULT_PACKED
    full = [f"m.l.0.{a}.weight" for a in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj")]
    assert incomplete_groups(full, packed) == []
    assert incomplete_groups(["m.l.0.q_proj.weight", "m.l.0.k_proj.weight", "m.l.0.q_proj.bias"], packed) == [
        ("m.l.0.qkv_proj.bias", ["m.l.0.k_proj.bias", "m.l.0.v_proj.bias"]),
        ("m.l.0.qkv_proj.weight", ["m.l.0.v_proj.weight"]),
    ]
    assert incomplete_groups(["up_proj.weight", "norm.weight", "x"], packed) == [
        ("gate_up_proj.weight", ["gate_proj.weight"])
    ]


# ------------------------------------------------------------------ the worker extension's hook
def _worker(model, api, monkeypatch):
    from engine_node.backends.vllm.worker_ext import RolloutBusWorkerExtension

    calls = []
    real = fp8.load_into_quantized

    def spy(m, named, cfg=None, **kw):
        calls.append(type(named).__name__)
        return real(m, named, cfg, api=api)

    monkeypatch.setattr(fp8, "load_into_quantized", spy)

    class W(RolloutBusWorkerExtension):
        def __init__(self):
            self.device = torch.device("cpu")
            self.model_config = types.SimpleNamespace(dtype=BF16)
            self.model_runner = types.SimpleNamespace(get_model=lambda: model)

    return W(), calls


def test_worker_commit_shm_loads_all_buckets_in_one_call(monkeypatch):
    from bus.tensors import pack_bucket, plan_buckets
    from engine_node.backends.vllm import weights as W

    A, B = checkpoint(0), checkpoint(1)
    model, api = fresh(A)
    worker, calls = _worker(model, api, monkeypatch)
    metas, sizes, tensors = plan_buckets(list(B.items()), bucket_bytes=1024)  # q, k, v in different buckets
    lists = [W.meta_list(m) for m in metas]
    assert len({m[3] for m in lists if ".0.q_proj" in m[0] or ".0.v_proj" in m[0]}) == 2
    stage = W.ShmStage(sizes, f"fp8test{os.getpid()}")
    try:
        for i in range(len(sizes)):
            stage.write(i, memoryview(pack_bucket(i, metas, sizes, tensors).numpy()), lists)
        worker.rollout_bus_begin("u1", lists, sizes)
        r = worker.rollout_bus_commit("u1", stage.spec())
    finally:
        stage.close()
    assert calls == ["generator"] and api.calls == ["initialize", "finalize"] and api.cfg is worker.model_config
    assert r["params_loaded"] == len(B) - 2 * LAYERS
    assert same_bits(kernel_state(model), kernel_state(fresh(B)[0]))


def test_worker_commit_from_received_buckets_checks_the_whole_list(monkeypatch):
    from bus.tensors import pack_bucket, plan_buckets
    from engine_node.backends.vllm import weights as W

    A, B = checkpoint(0), checkpoint(1)
    model, api = fresh(A)
    worker, calls = _worker(model, api, monkeypatch)
    named = [(k, v) for k, v in B.items() if k != "model.layers.0.q_proj.weight"]
    metas, sizes, tensors = plan_buckets(named, bucket_bytes=1024)
    lists = [W.meta_list(m) for m in metas]
    worker.rollout_bus_begin("u2", lists, sizes)
    # what rollout_bus_recv_ipc / _nccl leave behind: one flat uint8 buffer per bucket
    worker._rb()["buckets"] = {i: pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))}
    with pytest.raises(QuantizedLoadError, match="q_proj"):
        worker.rollout_bus_commit("u2")
    assert calls == ["list"] and api.calls == [], "refused before anything was touched"
    assert worker._rb()["uid"] is None, "the staged views are dropped after a failed commit too"


def test_default_reload_without_vllm_says_what_is_missing():
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(RuntimeError, match="0.24"):
        fp8.VllmReload()


def test_worker_repeated_updates_from_kept_buckets_stay_on_the_fp8_path(monkeypatch):
    """Buckets the worker keeps (nccl staging, zero-copy maps) let an unquantized
    model reuse the plan's views; an fp8 engine never takes the plan, so every
    update goes through vllm/fp8's load, equal to a fresh engine, nothing kept."""
    from bus.tensors import pack_bucket, plan_buckets
    from engine_node.backends.vllm import weights as W

    model, api = fresh(checkpoint(0))
    worker, calls = _worker(model, api, monkeypatch)
    staging = None
    for k, seed in enumerate((1, 2, 3)):
        sd = checkpoint(seed)
        metas, sizes, tensors = plan_buckets(list(sd.items()), bucket_bytes=1 << 20)
        lists = [W.meta_list(m) for m in metas]
        worker.rollout_bus_begin(f"k{k}", lists, sizes)
        st = worker._rb()
        if staging is None:
            staging = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        for i, buf in enumerate(staging):  # what rollout_bus_recv_nccl leaves: its kept staging
            buf.copy_(pack_bucket(i, metas, sizes, tensors))
            st["buckets"][i] = buf
        st["keep_views"] = True
        worker._rb_validate(st)
        r = worker.rollout_bus_commit(f"k{k}")
        assert r["path"] == "load_weights" and r["why"] == "quantized model (vllm/fp8.py)", r
        assert worker._rb()["kept"] is None
        assert same_bits(kernel_state(model), kernel_state(fresh(sd)[0])), f"update {k}"
    assert calls == ["list"] * 3
