"""CPU tests of what a repeated weight update reuses inside a vLLM worker
(engine_node/backends/vllm/worker_reuse.py): the validated layout, and, while
the buckets are kept (zero-copy IPC maps, nccl staging), the plan's cut source
views. Reused or not, the parameters must equal load_weights' bit for bit, and
anything that changes what the views point at must invalidate them.
Runs in CI (no GPU, no vLLM)."""

from __future__ import annotations

import pytest
import torch

from bus.tensors import pack_bucket, plan_buckets
from engine_node.backends.vllm.weight_plan import Replay, WeightPlan
from engine_node.backends.vllm.worker_reuse import Kept, Layout
from tests.test_vllm_weight_plan_cpu import _zero_copy_update
from tests.vllm_like import VllmLikeModel, checkpoint, same_bits, snapshot

pytestmark = pytest.mark.timeout(60)


def _metas():
    return [["a", "bfloat16", [4, 8], 0, 0, 64], ["b", "float32", [8], 1, 0, 32]], [64, 32]


@pytest.mark.parametrize(
    "change",
    [
        lambda m, s: m[0].__setitem__(0, "c"),  # a name
        lambda m, s: m[1].__setitem__(1, "bfloat16"),  # a dtype
        lambda m, s: m[0].__setitem__(2, [8, 4]),  # a shape
        lambda m, s: m[0].__setitem__(2, (4, 8)),  # the same shape as a tuple: a miss, never a wrong hit
        lambda m, s: m[1].__setitem__(4, 256),  # an offset
        lambda m, s: s.__setitem__(1, 64),  # a bucket size
        lambda m, s: m.pop(),  # a tensor fewer
    ],
)
def test_layout_is_found_again_only_when_every_meta_is_the_same(change):
    metas, sizes = _metas()
    lay = Layout.of(metas, sizes)
    m2, s2 = _metas()
    assert lay.same(m2, s2)
    change(m2, s2)
    assert not lay.same(m2, s2)
    change(metas, sizes)  # the caller's lists changing later does not change the record
    assert lay.same(*_metas())


def test_kept_serves_only_the_very_same_buckets_layout_and_plan():
    metas, sizes = _metas()
    lay = Layout.of(metas, sizes)
    plan = WeightPlan(lay.plan_key)
    bufs = [torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)]
    kept = Kept(lay, plan, list(bufs), Replay())
    assert kept.serves(lay, plan, dict(enumerate(bufs)))
    assert not kept.serves(lay, plan, {0: bufs[0], 1: bufs[1].clone()}), "equal bytes, new storage"
    assert not kept.serves(lay, plan, {0: bufs[0]})
    assert not kept.serves(Layout.of(metas, sizes), plan, dict(enumerate(bufs))), "another layout record"
    assert not kept.serves(lay, WeightPlan(lay.plan_key), dict(enumerate(bufs))), "another plan"


# ---------------------------------------------------------------- through the worker (zero-copy cuda_ipc)
class Trainer:
    """The trainer's parameters behind zero-copy handles: written in place
    between updates (an optimizer step); `realloc` moves one to new storage
    (a new handle, as share_in_place gives for a new storage)."""

    def __init__(self, vbe, monkeypatch):
        from engine_node.backends.vllm import worker_ipc as X  # open_ipc_handle lives there

        self.be, self.ref = vbe, vbe.test_ref
        self.params = {n: t.clone().contiguous() for n, t in checkpoint(self.ref, seed=1)}
        self.handle = {n: n.encode() for n in self.params}
        self.opened: list[bytes] = []
        by_handle = self.by_handle = {}

        def open_counting(h, dev):
            if h not in by_handle:  # a packed bucket (tests.test_vllm_weight_plan_cpu._ipc_update)
                return vbe.test_registry[h]
            self.opened.append(h)
            return by_handle[h].reshape(-1).view(torch.uint8)

        monkeypatch.setattr(X, "open_ipc_handle", open_counting)

    def realloc(self, name):
        self.params[name] = self.params[name].clone()
        self.handle[name] = f"{name}#{len(self.opened)}".encode()

    def update(self, tag, seed, names=None):
        new = dict(checkpoint(self.ref, seed=seed))
        for n, t in self.params.items():
            t.copy_(new[n])
        named = [(n, t) for n, t in self.params.items() if names is None or n in names]
        for n, t in named:
            self.by_handle[self.handle[n]] = t
        self.ref.load_weights(iter(named))
        r = _zero_copy_update(self.be, named, tag, lambda n, t: self.handle[n])["worker"]
        assert same_bits(snapshot(self.ref), snapshot(self.be.test_fake.worker.model)) == [], tag
        return r["path"], r.get("views_reused")


def test_reused_views_equal_load_weights_over_repeated_updates(vbe, monkeypatch):
    tr = Trainer(vbe, monkeypatch)
    got = [tr.update(f"r{k}", seed) for k, seed in enumerate((1, 2, 3, 4, 5, 6))]
    assert got == [("load_weights+record", None), ("plan", False)] + [("plan", True)] * 4
    assert len(tr.opened) == len(tr.params), "every map opened once"


def test_a_changed_layout_or_storage_invalidates_the_kept_views(vbe, monkeypatch):
    tr = Trainer(vbe, monkeypatch)
    worker = vbe.test_fake.worker
    for k in range(3):
        tr.update(f"a{k}", k + 1)
    # new storage for one trainer tensor: a new handle, a new map, the views cut again
    tr.realloc("model.layers.1.mlp.gate_proj.weight")
    assert tr.update("new-storage", 4) == ("plan", False)
    assert tr.update("new-storage-again", 5) == ("plan", True)
    # other names (a subset): another layout and plan key, learned again
    some = [n for n in tr.params if not n.startswith("model.layers.1.")]
    assert tr.update("subset", 6, some) == ("load_weights+record", None)
    assert tr.update("subset-again", 7, some) == ("plan", False)
    assert tr.update("subset-3", 8, some) == ("plan", True)
    assert tr.update("full", 9) == ("load_weights+record", None)
    # an engine parameter re-allocated: the plan (and its views) are learned again
    qkv = worker.model.model.layers[0].self_attn.qkv_proj.weight
    qkv.data = qkv.data.clone()
    assert tr.update("engine-realloc", 10) == ("load_weights+record", None)
    assert tr.update("engine-realloc-2", 11) == ("plan", False)
    assert tr.update("engine-realloc-3", 12) == ("plan", True)


def test_sleep_drops_the_kept_views_with_the_maps(vbe, monkeypatch):
    from tests.test_vllm_backend_cpu import wait

    tr = Trainer(vbe, monkeypatch)
    st = vbe.test_fake.worker._rb()
    for k in range(3):
        tr.update(f"s{k}", k + 1)
    assert st["kept"] is not None
    wait(vbe.sleep(1), be=vbe)
    assert st["kept"] is None and st["maps"] == {}, "sleep drops the maps and the views that pin them"
    wait(vbe.wake_up(None), be=vbe)
    opened = len(tr.opened)
    assert tr.update("after-wake", 4) == ("plan", False)
    assert len(tr.opened) == opened + len(tr.params), "the maps are opened again"
    assert tr.update("after-wake-2", 5) == ("plan", True)


def test_a_failed_update_and_an_update_without_kept_maps_drop_the_views(vbe, monkeypatch):
    from engine_node.backend import BackendError

    tr = Trainer(vbe, monkeypatch)
    st = vbe.test_fake.worker._rb()
    for k in range(3):
        tr.update(f"f{k}", k + 1)
    before = snapshot(vbe.test_fake.worker.model)
    short = "model.norm.weight"
    tr.handle[short] = b"short"
    tr.by_handle[b"short"] = torch.zeros(1, dtype=torch.bfloat16)  # a lie: the validation refuses it
    with pytest.raises(BackendError):
        _zero_copy_update(vbe, list(tr.params.items()), "bad", lambda n, t: tr.handle[n])
    assert st["kept"] is None and st["maps"] == {}
    assert same_bits(before, snapshot(vbe.test_fake.worker.model)) == [], "a refused update wrote parameters"
    tr.handle[short] = short.encode()
    tr.ref.load_weights(iter(checkpoint(tr.ref, seed=3)))  # (the reference as the engine still is)
    assert tr.update("ok", 4) == ("plan", False)
    # a packed update (maps not kept) drops the kept views: they would pin the old maps
    from tests.test_vllm_weight_plan_cpu import _ipc_update

    named = checkpoint(tr.ref, seed=5)
    tr.ref.load_weights(iter(named))
    r = _ipc_update(vbe, named, "packed")
    assert r["worker"]["path"] == "plan" and r["worker"]["views_reused"] is False
    assert st["kept"] is None
    assert same_bits(snapshot(tr.ref), snapshot(vbe.test_fake.worker.model)) == []


def test_nccl_staging_views_are_recut_when_the_bucket_layout_changes(vbe):
    from tests.test_vllm_backend_cpu import wait

    ref, worker = vbe.test_ref, vbe.test_fake.worker

    class Comm:
        rank = 1
        pending: list[torch.Tensor] = []

        def broadcast(self, buf, src):
            buf.copy_(self.pending.pop(0))

    st = worker._rb()
    worker._rb_nccl = lambda a: st.update(nccl=Comm(), nccl_key="g") or {"rank": 1, "reused": True}
    got = []
    for k, bucket_bytes in enumerate((2048, 2048, 2048, 4096, 4096)):
        named = checkpoint(ref, seed=k + 1)
        ref.load_weights(iter(named))
        metas, sizes, tensors = plan_buckets(named, bucket_bytes)
        Comm.pending = [pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))]
        wait(vbe.begin_weight_update(f"n{k}", "nccl", metas, {"bucket_sizes": sizes, "host": "x", "port": 1}))
        wait(vbe.receive_weights([]), timeout=10)
        c = wait(vbe.commit_weight_update(), timeout=10)["worker"]
        got.append((c["path"], c.get("views_reused")))
        assert same_bits(snapshot(ref), snapshot(worker.model)) == [], f"update {k}"
    # the same plan (names, dtypes, shapes) over another bucket layout: new staging, views cut again
    assert got == [("load_weights+record", None), ("plan", False), ("plan", True), ("plan", False), ("plan", True)]


def test_big_copies_launch_alone_and_the_rest_in_one_foreach():
    m = VllmLikeModel()
    named = checkpoint(m, seed=1)
    plan = WeightPlan.record(None, m, m.load_weights, named)
    m.load_weights(iter(named))
    plan.verify(dict(named))
    srcs = plan.sources(dict(named))
    big = max(c.dst.numel() * c.dst.element_size() for c in plan.copies)
    r = plan.replay(srcs, big_bytes=big)
    assert len(r.big) == sum(c.dst.numel() * c.dst.element_size() >= big for c in plan.copies) >= 1
    assert len(r.foreach) == 1 and len(r.foreach[0][0]) + len(r.big) + len(r.single) == len(plan.copies)
    named2 = checkpoint(m, seed=2)
    m.load_weights(iter(named2))
    truth = snapshot(m)
    m2 = VllmLikeModel()
    m2.load_weights(iter(named))
    plan2 = WeightPlan.record(None, m2, m2.load_weights, named)
    plan2.apply(dict(named2), big_bytes=big)
    m2.load_weights(iter([(n, t) for n, t in named2 if n in plan2.fallback]))
    assert same_bits(truth, snapshot(m2)) == []
