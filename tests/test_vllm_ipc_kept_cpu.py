"""CPU tests of what the vLLM backend reuses between zero-copy cuda_ipc
updates (engine_node/backends/vllm/weight_reuse.py, issue 21 §2): the same
tensor list is validated once, and once the workers keep an IPC layout the
commit sends them its token, not 339 metas and handles. Whatever is reused,
the parameters must equal load_weights' bit for bit, and a sleep, a changed
handle or a token the workers do not hold must fall back to (or be refused
before) a full write. Runs in CI (no GPU, no vLLM)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from bus.protocol import TensorMeta
from bus.tensors import dtype_name
from engine_node.backend import BackendError
from engine_node.backends.vllm import weights as W
from tests.test_vllm_backend_cpu import wait
from tests.vllm_like import checkpoint, same_bits, snapshot

pytestmark = pytest.mark.timeout(60)


class Trainer:
    """Zero-copy parameters behind handles that repeat, and the worker calls
    the backend made (method names, in order)."""

    def __init__(self, vbe, monkeypatch):
        from engine_node.backends.vllm import worker_ipc as X

        self.be, self.ref = vbe, vbe.test_ref
        self.params = {n: t.clone().contiguous() for n, t in checkpoint(self.ref, seed=1)}
        self.handle = {n: n.encode() for n in self.params}
        by_handle = self.by_handle = {}
        monkeypatch.setattr(X, "open_ipc_handle", lambda h, dev: by_handle[h].reshape(-1).view(torch.uint8))
        self.rpcs: list[str] = []
        fake = vbe.test_fake
        real = fake.u_collective_rpc

        def recording(method, timeout, args, kwargs):
            self.rpcs.append(method)
            return real(method, timeout, args, kwargs)

        fake.u_collective_rpc = recording
        # the node's one-trip op hands the kept begin's TensorMeta objects again
        self.metas = [
            TensorMeta(n, dtype_name(t), list(t.shape), i, 0, t.numel() * t.element_size())
            for i, (n, t) in enumerate(self.params.items())
        ]

    def update(self, tag, seed, fresh_metas=False):
        new = dict(checkpoint(self.ref, seed=seed))
        for n, t in self.params.items():
            t.copy_(new[n])
            self.by_handle[self.handle[n]] = t
        self.ref.load_weights(iter(self.params.items()))
        metas = [msgspec.structs.replace(m) for m in self.metas] if fresh_metas else self.metas
        sizes = [m.nbytes for m in metas]
        wait(self.be.begin_weight_update(tag, "cuda_ipc", metas, {"bucket_sizes": sizes, "keep_maps": True}))
        wait(self.be.receive_weights([self.handle[n] for n in self.params]))
        wait(self.be.commit_weight_update(), timeout=10)
        assert same_bits(snapshot(self.ref), snapshot(self.be.test_fake.worker.model)) == [], tag
        return self.rpcs[-1]


def test_the_kept_layout_goes_as_a_token_until_a_sleep_or_a_new_handle(vbe, monkeypatch):
    tr = Trainer(vbe, monkeypatch)
    got = [tr.update(f"k{i}", i + 1) for i in range(4)]
    assert got == ["rollout_bus_apply_ipc"] + ["rollout_bus_apply_kept"] * 3
    assert tr.update("fresh-metas", 5, fresh_metas=True) == "rollout_bus_apply_kept", "equal metas: still kept"
    wait(vbe.sleep(1), be=vbe)
    wait(vbe.wake_up(None), be=vbe)
    assert tr.update("after-sleep", 6) == "rollout_bus_apply_ipc", "a sleep drops the workers' maps"
    assert tr.update("after-sleep-2", 7) == "rollout_bus_apply_kept"
    tr.handle["model.norm.weight"] = b"moved"  # new storage on the trainer: a new handle
    assert tr.update("new-handle", 8) == "rollout_bus_apply_ipc"
    assert tr.update("new-handle-2", 9) == "rollout_bus_apply_kept"


def test_a_token_the_workers_do_not_hold_is_refused_before_any_write(vbe, monkeypatch):
    tr = Trainer(vbe, monkeypatch)
    for i in range(2):
        tr.update(f"t{i}", i + 1)
    worker = vbe.test_fake.worker
    before = snapshot(worker.model)
    worker.rollout_bus_drop_maps()  # behind the backend's back (as a worker restart would)
    for n, t in tr.params.items():
        t.copy_(dict(checkpoint(tr.ref, seed=9))[n])
    sizes = [m.nbytes for m in tr.metas]
    wait(vbe.begin_weight_update("lost", "cuda_ipc", tr.metas, {"bucket_sizes": sizes, "keep_maps": True}))
    wait(vbe.receive_weights([tr.handle[n] for n in tr.params]))
    with pytest.raises(BackendError, match="not kept here"):
        wait(vbe.commit_weight_update(), timeout=10)
    assert tr.rpcs[-1] == "rollout_bus_apply_kept"
    assert same_bits(before, snapshot(worker.model)) == [], "a refused update wrote parameters"
    tr.ref.load_weights(iter(checkpoint(tr.ref, seed=2)))  # (the reference as the engine still is)
    assert tr.update("resent", 3) == "rollout_bus_apply_ipc", "after a refusal the handles go again"


def test_the_same_tensor_list_is_validated_once_and_a_new_one_again(vbe, monkeypatch):
    calls = []
    real = W.validate
    monkeypatch.setattr(W, "validate", lambda *a: calls.append(1) or real(*a))
    tr = Trainer(vbe, monkeypatch)
    for i in range(3):
        tr.update(f"v{i}", i + 1)
    assert len(calls) == 1
    tr.update("fresh", 4, fresh_metas=True)
    assert len(calls) == 2, "equal but new objects: validated again (identity decides)"
    bad = list(tr.metas)
    bad[0] = TensorMeta(bad[0].name, bad[0].dtype, [7], 0, 0, 14)
    op = vbe.begin_weight_update("bad", "cuda_ipc", bad, {"bucket_sizes": [m.nbytes for m in bad]})
    with pytest.raises(BackendError, match="shape") as e:
        wait(op)
    assert e.value.field == bad[0].name
