"""CPU test of the vllm backend's plumbing against a fake ``AsyncLLM``.

Runs in CI (no GPU, no vLLM): the sync/async bridge, the output queue and
wake fd, abort's partial tokens, freeze/thaw bookkeeping, sleep refusal, the
weight-update RPC sequence, bucket sizes, LoRA folders. The real engine is
covered by test_vllm_backend.py on the GPU machine. Skipped where the real
vLLM is importable (the fake modules would shadow it).
"""

from __future__ import annotations

import importlib.util
import json
import select
import sys
import time
import types

import pytest

from bus.protocol import SamplingParams
from engine_node.backend import Backend, BackendError, SeqRequest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="real vLLM installed: GPU tests cover it"),
]

_FAKE_ASYNC_LLM = """
import asyncio, types, random

class Logprob:
    def __init__(self, lp): self.logprob = lp

class Comp:
    def __init__(self, toks, lps, fin):
        self.token_ids, self.logprobs, self.finish_reason = toks, lps, fin

class Out:
    def __init__(self, toks, lps, fin, finished):
        self.outputs = [Comp(toks, lps, fin)]
        self.finished = finished

class Collector:
    def __init__(self):
        self.output = None
        self.ready = asyncio.Event()
    def put(self, o):
        if self.output is None:
            self.output = o
        else:
            c = self.output.outputs[0]; n = o.outputs[0]
            c.token_ids = list(c.token_ids) + list(n.token_ids)
            if c.logprobs is not None: c.logprobs = list(c.logprobs) + list(n.logprobs or [])
            c.finish_reason = n.finish_reason; self.output.finished = o.finished
        self.ready.set()
    async def get(self):
        while self.output is None:
            await self.ready.wait()
        o, self.output = self.output, None
        self.ready.clear()
        return o
    def get_nowait(self):
        o, self.output = self.output, None
        if o is not None: self.ready.clear()
        return o
    def close(self): pass

class AsyncLLM:
    @classmethod
    def from_engine_args(cls, args, stat_loggers=None):
        e = cls()
        e.loggers = [f(None, 0) for f in (stat_loggers or [])]
        return e
    def __init__(self):
        self.reqs = {}
        self.paused = False
        self.sleeping = 0
        self.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(eos_token_id=2, tie_word_embeddings=False),
            get_vocab_size=lambda: 100, max_model_len=256, try_get_generation_config=lambda: {"eos_token_id": [2]})
        self.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=64),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
        self.tokenizer = None
        self.loras = {}
        self.rpcs = []
        self.task = asyncio.get_running_loop().create_task(self._sched())
    async def _sched(self):
        while True:
            await asyncio.sleep(0.002)
            if self.paused or self.sleeping: continue
            for rid, r in list(self.reqs.items()):
                sp = r["sp"]
                tok = (sum(r["prompt"]) * 31 + len(r["gen"]) * 7 + (sp.seed or 0)) % 97 + 3
                r["gen"].append(tok)
                fin = None
                if tok in (sp.stop_token_ids or []): fin = "stop"
                elif len(r["gen"]) >= sp.max_tokens: fin = "length"
                lps = [{tok: Logprob(-0.5)}] if sp.logprobs is not None else None
                r["q"].put(Out([tok], lps, fin, fin is not None))
                if fin: del self.reqs[rid]
            for l in self.loggers:
                l.record(types.SimpleNamespace(kv_cache_usage=0.1*len(self.reqs)/64, num_running_reqs=len(self.reqs), num_waiting_reqs=0), None)
    async def add_request(self, rid, prompt, sp, lora_request=None):
        await asyncio.sleep(0)
        q = Collector()
        self.reqs[rid] = dict(prompt=prompt["prompt_token_ids"], sp=sp, gen=[], q=q)
        return q
    async def abort(self, rids):
        if isinstance(rids, str): rids = [rids]
        for rid in rids:
            r = self.reqs.pop(rid, None)
            if r: r["q"].put(Out([], [] if r["sp"].logprobs is not None else None, "abort", True))
    async def pause_generation(self, mode="abort", clear_cache=True):
        self.paused = True; await asyncio.sleep(0.02)
    async def resume_generation(self): self.paused = False
    async def sleep(self, level=1, mode="abort"):
        self.sleeping = level
    async def wake_up(self, tags=None):
        self.sleeping = 0; self.paused = False
    async def reset_prefix_cache(self): return True
    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, args))
        if method == "rollout_bus_info": return [{"gpu_free": 100 if not self.sleeping else 200}]
        if method.startswith("rollout_bus_recv"): return [{"seconds": 0.01, "bytes": 1}]
        return [None]
    async def add_lora(self, req):
        self.loras[req.lora_int_id] = req; return True
    async def remove_lora(self, lid): return self.loras.pop(lid, None) is not None
    def shutdown(self): self.task.cancel()
"""


@pytest.fixture
def fake_vllm(monkeypatch):
    def mod(name, code=""):
        m = types.ModuleType(name)
        exec(code, m.__dict__)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    mod("vllm", "class SamplingParams:\n    def __init__(self, **kw):\n        self.__dict__.update(kw)\n")
    mod("vllm.sampling_params", "import enum\nclass RequestOutputKind(enum.Enum):\n    CUMULATIVE = 0\n    DELTA = 1\n")
    mod("vllm.inputs", "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    mod("vllm.lora")
    mod("vllm.lora.request", "class LoRARequest:\n    def __init__(self, lora_name, lora_int_id, lora_path='', load_inplace=False):\n"
        "        self.lora_name, self.lora_int_id, self.lora_path, self.load_inplace = lora_name, lora_int_id, lora_path, load_inplace\n")
    mod("vllm.engine")
    mod("vllm.engine.arg_utils", "class AsyncEngineArgs:\n    def __init__(self, **kw):\n        self.kw = kw\n")
    mod("vllm.v1")
    mod("vllm.v1.engine")
    mod("vllm.v1.engine.async_llm", _FAKE_ASYNC_LLM)


@pytest.fixture
def be(fake_vllm):
    from engine_node.backends.vllm_backend import make_backend

    b = make_backend("/nonexistent-model", enable_lora=True)
    yield b
    b.close()


def drive(be, ids, t=5.0):
    res = {s: [] for s in ids}
    fin = {}
    deadline = time.time() + t
    while len(fin) < len(ids):
        assert time.time() < deadline, (res, fin)
        for o in be.step():
            res[o.seq_id] += o.token_ids
            if o.finish_reason:
                fin[o.seq_id] = o.finish_reason
    return res, fin


def test_generate_and_wake_fd(be):
    assert isinstance(be, Backend)
    info = be.info()
    assert info.backend == "vllm" and info.vocab_size == 100 and info.eos_token_ids == [2]
    sp = SamplingParams(max_tokens=20, temperature=0, logprobs=True)
    for i in range(5):
        be.add(SeqRequest(f"s{i}", [i, 2, 3], sp, 20))
    res, fin = drive(be, [f"s{i}" for i in range(5)])
    assert all(len(v) == 20 for v in res.values()) and set(fin.values()) == {"length"}
    be.add(SeqRequest("w", [1], sp, 5))
    assert select.select([be.wake_fd()], [], [], 1.0)[0], "wake fd readable when output is pending"
    drive(be, ["w"])
    assert not be.has_work()
    assert not select.select([be.wake_fd()], [], [], 0.05)[0], "step() drains the wake fd"


def test_abort_returns_unread_tokens(be):
    long = SamplingParams(max_tokens=1000)
    for i in range(4):
        be.add(SeqRequest(f"a{i}", [i], long, 1000))
    time.sleep(0.05)  # tokens pile up unread
    outs = be.abort([f"a{i}" for i in range(4)])
    assert outs and all(o.finish_reason is None and o.token_ids for o in outs)
    assert be.num_running() == 0 and not be.has_work()
    time.sleep(0.02)
    assert be.step() == []
    be.add(SeqRequest("early", [1], long, 10))
    assert all(o.finish_reason is None for o in be.abort(["early"]))
    assert be.num_running() == 0


def test_freeze_thaw_and_abort_of_frozen(be):
    ids = [f"k{i}" for i in range(3)]
    for s in ids:
        be.add(SeqRequest(s, [1], SamplingParams(max_tokens=200), 200))
    got = {s: [] for s in ids}
    while sum(map(len, got.values())) < 15:
        for o in be.step():
            got[o.seq_id] += o.token_ids
    be.freeze(ids)
    while be.has_work():
        for o in be.step():
            got[o.seq_id] += o.token_ids
    n = sum(map(len, got.values()))
    time.sleep(0.05)
    assert not be.has_work() and be.step() == [] and be.stats()["frozen"]
    be.thaw(ids)
    assert not be.stats()["frozen"]
    res, _ = drive(be, ids)
    assert all(len(got[s]) + len(res[s]) == 200 for s in ids) and n < 600
    for s in ("f0", "f1"):
        be.add(SeqRequest(s, [2], SamplingParams(max_tokens=500), 500))
    time.sleep(0.01)
    be.step()
    be.freeze(["f0", "f1"])
    be.abort(["f0", "f1"])
    assert not be.stats()["frozen"], "aborting every frozen sequence resumes the engine"


def test_sleep_refuses_live_sequences(be):
    be.add(SeqRequest("z", [1], SamplingParams(max_tokens=500), 500))
    with pytest.raises(BackendError, match="pause"):
        be.sleep(1)
    be.abort(["z"])
    r = be.sleep(1)
    assert r["gpu_freed_bytes"] == 100
    be.wake_up(None)


def test_weight_updates_rpc_sequence(be):
    import torch

    from bus.protocol import TensorMeta
    from bus.tensors import pack_bucket, plan_buckets, unpack_bucket

    named = [("a.weight", torch.randn(3, 4)), ("b.weight", torch.randn(5)), ("c.weight", torch.randn(70))]
    metas, sizes, tensors = plan_buckets(named, 64)
    be.begin_weight_update("zmq", metas, {})
    for i in range(len(sizes)):
        be.stage_weights(unpack_bucket(i, metas, pack_bucket(i, metas, sizes, tensors).numpy().tobytes()))
    be.finish_weight_update()
    assert [m for m, _ in be.engine.rpcs] == ["rollout_bus_begin", "rollout_bus_finish"]
    be.engine.rpcs.clear()
    be.begin_weight_update("cuda_ipc", metas, {})
    assert be._update.bucket_sizes == sizes, "bucket sizes derived as bus.tensors plans them"
    with pytest.raises(BackendError, match="handle"):
        be.receive_weights("x", [b"h"])
    be.receive_weights("x", [b"h"] * len(sizes))
    be.finish_weight_update()
    assert [m for m, _ in be.engine.rpcs] == ["rollout_bus_begin", "rollout_bus_recv_ipc", "rollout_bus_finish"]
    with pytest.raises(ValueError, match="nbytes"):
        be.begin_weight_update("cuda_ipc", [TensorMeta("x", "float32", [2], 0, 0, 4)], {})
    with pytest.raises(BackendError, match="transport"):
        be.begin_weight_update("carrier-pigeon", metas, {})


def test_lora_from_tensors_and_inplace(be, tmp_path):
    import torch

    be.load_lora("l", path=str(tmp_path))
    t = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(4, 8)),
         ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.randn(8, 4))]
    be.load_lora("l", tensors=t, config={"lora_alpha": 8})
    assert be.loras() == ["l"]
    req = be.engine.loras[1]
    assert req.load_inplace and req.lora_path != str(tmp_path)
    with open(req.lora_path + "/adapter_config.json") as f:
        cfg = json.load(f)
    assert cfg["r"] == 4 and cfg["target_modules"] == ["q_proj"] and cfg["lora_alpha"] == 8
    be.add(SeqRequest("lr", [1], SamplingParams(max_tokens=3), 3, lora="l"))
    drive(be, ["lr"])
    with pytest.raises(BackendError, match="not loaded"):
        be.add(SeqRequest("x", [1], SamplingParams(max_tokens=3), 3, lora="other"))
    be.unload_lora("l")
    assert be.loras() == []
