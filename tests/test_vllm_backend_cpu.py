"""CPU test of the vllm backend's plumbing against a FAKE engine-core client.

Runs in CI (no GPU, no vLLM): request building, batch -> StepOutputs, the wake
fd, abort leftovers and late-output dropping, utility futures and deadline
errors naming knobs, freeze/thaw, the weight transaction (shm staging for zmq
and its cleanup), LoRA folders, engine death. The fake mimics SyncMPClient's
surface the backend touches (outputs_queue, utility_results, _send_input,
add_request, abort_requests, resources.engine_dead, shutdown) with a thread in
the role of vLLM's output thread. The real engine is covered by
test_vllm_backend.py on the GPU machine. Skipped where the real vLLM is
importable (its test covers the real thing).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import queue
import select
import threading
import time
import types

import numpy as np
import pytest

from bus.protocol import SamplingParams
from bus.tensors import pack_bucket, plan_buckets, unpack_bucket
from engine_node.backend import Backend, BackendError, BackendTimeout, SeqRequest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="real vLLM installed: GPU tests cover it"),
]

EOS = 2
VOCAB = 100


# ---------------------------------------------------------------- fake vLLM pieces
class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.eos = None

    def update_from_generation_config(self, gen, eos):
        self.eos = None if self.ignore_eos else eos
        self.gen_eos = gen.get("eos_token_id")


@dataclasses.dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list
    mm_features: object
    sampling_params: FakeSamplingParams
    pooling_params: object
    arrival_time: float
    lora_request: object
    cache_salt: object
    data_parallel_rank: object
    external_req_id: str | None = None


@dataclasses.dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    load_inplace: bool = False


@dataclasses.dataclass
class FakeOut:  # EngineCoreOutput
    request_id: str
    new_token_ids: list
    new_logprobs: object = None
    finish_reason: int | None = None
    new_prompt_logprobs_tensors: object = None
    events: list | None = None  # EngineCoreEvent (type, timestamp), with log_stats
    routed_experts: object = None  # issue 37: [rows, layers, top_k] (enable_return_routed_experts)


@dataclasses.dataclass
class FakeBatch:  # EngineCoreOutputs
    outputs: list
    scheduler_stats: object = None
    timestamp: float = dataclasses.field(default_factory=time.monotonic)  # as vLLM's __post_init__


class FakeModel(__import__("torch").nn.Module):
    def __init__(self):
        super().__init__()
        self.weights = {}

    def load_weights(self, named):
        loaded = set()
        for n, t in named:
            self.weights[n] = t.clone()
            loaded.add(n)
        return loaded


def make_worker():
    """The REAL worker extension (shm commit path included) on a fake CPU worker."""
    from engine_node.backends.vllm.worker_ext import RolloutBusWorkerExtension

    class FakeWorker(RolloutBusWorkerExtension):
        def __init__(self):
            self.device = __import__("torch").device("cpu")
            self.model = FakeModel()
            self.model_runner = types.SimpleNamespace(get_model=lambda: self.model)
            self.weights = self.model.weights
            self.shm_seen = []

        _sleep_saved_buffers: dict = {}
        buffers_restored = 0
        reloads = 0

        def rollout_bus_reload_checkpoint(self):  # needs vLLM's model loader: counted here
            self.reloads += 1
            return 0

        def rollout_bus_restore_sleep_buffers(self):
            n = len(getattr(self, "_rb_held_buffers", None) or {})
            self.buffers_restored += bool(n)
            self._rb_held_buffers = {}
            return n

        def rollout_bus_info(self):
            return {"gpu_free": 1000 if not FAKE.sleeping else 5000}

        def rollout_bus_commit(self, uid, shm=None, opts=None):
            if shm is not None:
                self.shm_seen.append(shm["path"])
            return super().rollout_bus_commit(uid, shm, opts)

    return FakeWorker()


class FakeEngineCoreClient:
    """FAKE stand-in for vLLM's SyncMPClient; one thread plays the engine core
    and its output thread: every 2 ms each running request gets one token.
    As vLLM's scheduler does, it sends SchedulerStats only with log_stats on,
    with kv_cache_usage = the running requests' tokens over KV_TOKENS (measured
    after this step's finished requests are freed, so it moves both ways)."""

    KV_TOKENS = 256

    def __init__(self, log_stats=False):
        self.log_stats = log_stats
        self.outputs_queue = queue.Queue()
        self.utility_results = {}
        self.resources = types.SimpleNamespace(engine_dead=False)
        self.requests = {}  # rid -> [req, generated]
        self.salts = []  # cache_salt of every request added, in order
        self.paused = False
        self.sleeping = False
        self.sleeping_tags = set()
        self.wakes = []  # tags each wake_up woke
        self.skipped_wakes = []
        self.buffers_into_sleeping_weights = 0
        self.loras = {}
        self.worker = make_worker()
        self.calls = []  # utility method names, in order
        self.seen = []  # every request added
        self.aborted = []
        self.inbox = queue.Queue()
        self.hold_utilities = set()  # names never answered (deadline tests)
        self.routes = False  # enable_return_routed_experts (issue 37)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    # the surface the backend uses (called on the node's loop thread)
    def add_request(self, req):
        self.seen.append(req)
        self.salts.append(req.cache_salt)
        self.inbox.put(("add", req))

    def abort_requests(self, rids):
        self.inbox.put(("abort", list(rids)))

    def _send_input(self, kind, payload):
        assert kind == "UTILITY"
        if self.resources.engine_dead:
            raise RuntimeError("EngineDeadError")
        self.inbox.put(("utility", payload))

    def shutdown(self, timeout=None):
        self.stop.set()
        self.thread.join(5)

    # the engine core
    def _run(self):
        while not self.stop.is_set():
            try:
                while True:
                    self._handle(*self.inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.paused and self.requests:
                outs = []
                for rid, st in list(self.requests.items()):
                    req, gen = st
                    sp = req.sampling_params
                    plp = fake_prompt_logprobs(req, gen)
                    if plp is not None and plp[1]:
                        # chunked prefill: the first half of the prompt logprobs, no token yet
                        outs.append(FakeOut(rid, [], None, None, plp[0]))
                        continue
                    tok = (len(req.prompt_token_ids) + len(gen) + (7 if req.lora_request else 0)) % VOCAB
                    gen.append(tok)
                    fin = None
                    if tok in sp.stop_token_ids or (sp.eos is not None and tok == sp.eos):
                        fin = 0
                    elif len(gen) >= sp.max_tokens:
                        fin = 1
                    lps = None
                    if sp.logprobs is not None:
                        # sampled first, then the top-k, then one more column (another request's larger k)
                        k = sp.logprobs
                        lps = types.SimpleNamespace(
                            logprobs=[[-0.5] + [-1.0 - j for j in range(k + 1)]],
                            logprob_token_ids=[[tok] + [(tok + 1 + j) % VOCAB for j in range(k + 1)]],
                        )
                    outs.append(FakeOut(rid, [tok], lps, fin, plp[0] if plp is not None else None))
                    if self.routes:
                        outs[-1].routed_experts = fake_step_routes(req, len(gen))
                    if fin is not None:
                        del self.requests[rid]
                self.outputs_queue.put_nowait(FakeBatch(outs, self._stats()))
            time.sleep(0.002)

    def _stats(self):
        if not self.log_stats:
            return None
        used = sum(len(req.prompt_token_ids) + len(gen) for req, gen in self.requests.values())
        return types.SimpleNamespace(
            kv_cache_usage=min(1.0, used / self.KV_TOKENS), num_running_reqs=len(self.requests), num_waiting_reqs=0
        )

    def _handle(self, kind, payload):
        if kind == "add":
            self.requests[payload.request_id] = [payload, []]
        elif kind == "abort":
            self.aborted += payload
            for rid in payload:
                self.requests.pop(rid, None)
        else:
            _, call_id, method, args = payload
            self.calls.append(method)
            if method in self.hold_utilities or (method == "collective_rpc" and args[0] in self.hold_utilities):
                return
            try:
                res, err = getattr(self, "u_" + method)(*args), None
            except Exception as e:
                res, err = None, e
            fut = self.utility_results.pop(call_id)  # as vLLM's _process_utility_output
            if err is not None:
                fut.set_exception(Exception(str(err)))
            else:
                fut.set_result(res)

    def u_pause_scheduler(self, mode, clear_cache):
        assert mode == "keep" and clear_cache is False
        self.paused = True

    def u_resume_scheduler(self):
        self.paused = False

    def u_sleep(self, level, mode):
        if self.sleeping_tags:  # vLLM's executor: "already sleeping", nothing happens
            self.paused = True
            return
        self.sleeping, self.paused = True, True
        self.sleeping_tags = {"weights", "kv_cache"}
        if level == 2:  # vLLM's worker saves the model's buffers (in the weights pool)
            self.worker._sleep_saved_buffers = {"rope": "saved"}

    def u_wake_up(self, tags):
        # vLLM 0.24's executor + worker, as far as the backend can tell them apart
        if tags and any(t not in self.sleeping_tags for t in tags):
            self.skipped_wakes.append(tags)  # its warning: the WHOLE call is skipped
            return
        woken = set(self.sleeping_tags) if tags is None else set(tags)
        self.sleeping_tags -= woken
        if self.worker._sleep_saved_buffers:
            # restored at the next wake, whatever its tags (gpu_worker.wake_up)
            if "weights" in self.sleeping_tags:
                self.buffers_into_sleeping_weights += 1
            self.worker.buffers_restored += 1
            self.worker._sleep_saved_buffers = {}
        self.wakes.append(sorted(woken))
        if not self.sleeping_tags:
            self.sleeping, self.paused = False, False

    def u_reset_prefix_cache(self, a, b):
        return True

    def u_add_lora(self, req):
        self.loras[req.lora_int_id] = req
        return True

    def u_remove_lora(self, lid):
        return self.loras.pop(lid, None) is not None

    def u_collective_rpc(self, method, timeout, args, kwargs):
        return [getattr(self.worker, method)(*args)]


FAKE: FakeEngineCoreClient = None  # type: ignore[assignment]


def fake_prompt_logprobs(req, gen):
    """(LogprobsTensors-like piece, is_first_half) for a request that asked for
    prompt logprobs, in two pieces (positions 1..h, then h+1..P-1); else None.
    Row for position i: column 0 = prompt[i] with -i, then k more."""
    sp = req.sampling_params
    k = getattr(sp, "prompt_logprobs", None)
    if k is None or gen or getattr(req, "_plp_done", False):
        return None
    import torch

    p = req.prompt_token_ids
    h = (len(p) - 1) // 2
    first = not getattr(req, "_plp_half", False)
    rows = range(1, h + 1) if first else range(h + 1, len(p))
    if first:
        req._plp_half = True
    else:
        req._plp_done = True
    ids = torch.tensor([[p[i]] + [(p[i] + 1 + j) % VOCAB for j in range(k + 1)] for i in rows], dtype=torch.int32)
    lps = torch.tensor([[-float(i)] + [-float(i) - 0.1 * (j + 1) for j in range(k + 1)] for i in rows])
    return (ids, lps, torch.zeros(len(rows))), first


FAKE_MOE = types.SimpleNamespace(num_hidden_layers=3, num_experts_per_tok=2, num_experts=8)


def fake_routes(positions) -> np.ndarray:
    """FAKE routing, a function of the sequence position only (uint8, as
    vLLM's narrow slot buffer for <= 256 experts)."""
    return np.array(
        [[[(p * 7 + layer * 3 + j) % 8 for j in range(2)] for layer in range(3)] for p in positions], dtype=np.uint8
    ).reshape(-1, 3, 2)


def fake_step_routes(req, generated: int) -> np.ndarray:
    """What vLLM 0.24's scheduler attaches to an output (scheduler.py): at the
    prefill, the prompt's rows from routed_experts_prompt_start; then the row
    of the step's input token (the previous output)."""
    n = len(req.prompt_token_ids)
    if generated == 1:
        return fake_routes(range(getattr(req.sampling_params, "routed_experts_prompt_start", 0), n))
    return fake_routes([n + generated - 2])


def fake_compilation_config(kw):
    """As vLLM derives it: no graphs when eager, the given sizes, else LLM's (here 1..16)."""
    if kw.get("enforce_eager"):
        return types.SimpleNamespace(
            cudagraph_capture_sizes=[], max_cudagraph_capture_size=None, cudagraph_mode="CUDAGraphMode.NONE"
        )
    sizes = sorted((kw.get("compilation_config") or {}).get("cudagraph_capture_sizes") or [1, 2, 4, 8, 16])
    return types.SimpleNamespace(
        cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=sizes[-1], cudagraph_mode="FULL_AND_PIECEWISE"
    )


def fake_api(tmp_model: str):
    def build_config(kw):
        build_config.kw = kw
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(
                max_model_len=kw.get("max_model_len", 64),
                hf_config=types.SimpleNamespace(eos_token_id=EOS, tie_word_embeddings=False),
                hf_text_config=FAKE_MOE,
                try_get_generation_config=lambda: {"eos_token_id": [EOS, 3]},
                get_vocab_size=lambda: VOCAB,
                dtype="torch.float32",
            ),
            scheduler_config=types.SimpleNamespace(
                max_num_seqs=kw.get("max_num_seqs", 1024), max_num_batched_tokens=16384
            ),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            compilation_config=fake_compilation_config(kw),
        )

    def make_client(cfg, log_stats):
        global FAKE
        FAKE = FakeEngineCoreClient(log_stats)
        FAKE.routes = bool(build_config.kw.get("enable_return_routed_experts"))
        return FAKE

    return types.SimpleNamespace(
        SamplingParams=FakeSamplingParams,
        RequestOutputKind=types.SimpleNamespace(DELTA="delta"),
        EngineCoreRequest=FakeRequest,
        UTILITY="UTILITY",
        LoRARequest=FakeLoRARequest,
        build_config=build_config,
        make_client=make_client,
        tokenizer_eos=lambda cfg: EOS,
    )


# ---------------------------------------------------------------- fixtures / helpers
@pytest.fixture
def model_dir(tmp_path):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "model"
    d.mkdir()
    save_file({"w.a": torch.zeros(4, 4), "w.b": torch.zeros(8)}, str(d / "model.safetensors"))
    return str(d)


@pytest.fixture
def be(model_dir):
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(
        model_dir, max_model_len=64, enable_lora=True, rpc_timeout_s=0.3, weight_timeout_s=0.3, _api=fake_api(model_dir)
    )
    yield b
    b.close()


def seq(sid, n=5, prompt=(10, 11, 12), **kw):
    p = SamplingParams(max_tokens=n, **kw)
    return SeqRequest(sid, list(prompt), p, n, seed=kw.get("seed"))


def drive(b, ids, timeout=5.0):
    res = {s: {"tokens": [], "lps": [], "finish": None} for s in ids}
    end = time.monotonic() + timeout
    while any(r["finish"] is None for r in res.values()):
        assert time.monotonic() < end, res
        for o in b.step():
            r = res[o.seq_id]
            r["tokens"] += o.token_ids
            r["lps"] += o.logprobs or []
            if o.finish_reason:
                r["finish"] = o.finish_reason
    return res


def wait(op, timeout=30.0, be=None):
    """An op's result; with `be`, keep its loop turning meanwhile (as the node does)."""
    end = time.monotonic() + timeout
    while be is not None and not op.future.done() and time.monotonic() < end:
        be.stats()
        time.sleep(0.002)
    return op.future.result(max(0.0, end - time.monotonic()))


# ---------------------------------------------------------------- tests
def test_info_defaults_and_protocol(be):
    assert isinstance(be, Backend)
    info = be.info()
    assert info.backend == "vllm" and info.capacity == 1024 and info.vocab_size == VOCAB
    assert info.eos_token_ids == [EOS, 3] and info.dtype == "float32"
    assert be.freeze_granularity == "all"
    kw = be._api.build_config.kw
    assert "max_num_seqs" not in kw and "max_num_batched_tokens" not in kw, "vLLM's LLM defaults, not ours"
    assert kw["worker_extension_cls"].endswith("RolloutBusWorkerExtension")
    assert os.environ["ROLLOUT_BUS_NODE_PID"] == str(os.getpid())


def test_options_override_engine_defaults(model_dir):
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(model_dir, max_num_seqs=7, max_num_batched_tokens=4096, _api=fake_api(model_dir))
    try:
        assert b.info().capacity == 7
        assert b._api.build_config.kw["max_num_batched_tokens"] == 4096
    finally:
        b.close()


def test_request_building(be):
    from engine_node.backends.vllm.requests import build_request, sampling_params

    FAKE.paused = True  # keep the request in the fake to inspect it
    be.add(seq("a", 5, temperature=0.0, top_k=-1, seed=3, stop_token_ids=[99], logprobs=True))
    time.sleep(0.02)
    req = FAKE.requests["a#1"][0]
    assert req.request_id == "a#1" and req.prompt_token_ids == [10, 11, 12] and req.lora_request is None
    assert req.cache_salt is None  # no weights change yet, no caller salt: vLLM's unsalted hashes
    assert req.sampling_params.max_tokens == 5 and req.sampling_params.temperature == 0.0
    be.abort(["a"])

    s = seq("x", 500, temperature=0.5, top_k=-1, seed=3, stop_token_ids=[99], logprobs=True)
    sp = sampling_params(be._api, s, max_model_len=64, generation_config={"eos_token_id": [EOS]}, eos_token_id=EOS)
    assert sp.max_tokens == 64 - 3, "capped by the room in max_model_len"
    assert sp.top_k == 0 and sp.seed == 3 and sp.logprobs == 0 and sp.detokenize is False and sp.n == 1
    assert sp.output_kind == "delta" and sp.eos == EOS and sp.stop_token_ids == [99]
    req = build_request(be._api, "x#9", s, sp, None)
    assert req.prompt_token_ids == [10, 11, 12] and req.arrival_time > 0 and req.external_req_id == "x#9"
    with pytest.raises(BackendError, match="max_model_len"):
        be.add(SeqRequest("long", list(range(64)), SamplingParams(), 4))
    with pytest.raises(BackendError, match="not loaded"):
        be.add(SeqRequest("l", [1, 2], SamplingParams(), 4, lora="nope"))


def test_batches_become_step_outputs_with_logprobs_and_finish(be):
    be.add(seq("a", 5, logprobs=True))
    be.add(seq("b", 3, prompt=(1,)))
    res = drive(be, ["a", "b"])
    assert res["a"]["finish"] == "length" and res["a"]["tokens"] == [3, 4, 5, 6, 7]
    assert res["a"]["lps"] == [-0.5] * 5, "column 0: the sampled token's logprob"
    # b: prompt len 1 -> tokens 1, 2 = EOS -> stop
    assert res["b"]["finish"] == "stop" and res["b"]["tokens"] == [1, 2]
    assert be.num_running() == 0 and not be.has_work()
    assert be.stats()["kv_usage"] == 0.0  # every request freed: the last step's stats say so


def test_kv_usage_follows_the_cache_both_ways_with_the_default_options(be):
    """Issue 36 row 2: vLLM sends scheduler_stats only with log_stats on; with
    fe0cb18's default (off) kv_usage stayed 0.0 whatever the cache held. Now it
    rises with long running requests and falls back when they finish."""
    ids = [f"k{i}" for i in range(6)]
    for sid in ids:
        be.add(seq(sid, 30, prompt=tuple(range(10, 30))))
    seen = []
    res = {s: None for s in ids}
    end = time.monotonic() + 5
    while any(v is None for v in res.values()):
        assert time.monotonic() < end, res
        for o in be.step():
            if o.finish_reason:
                res[o.seq_id] = o.finish_reason
        seen.append(be.stats()["kv_usage"])
    assert max(seen) > 0.5, seen  # 6 × (20 prompt + up to 30 generated) tokens of 256
    assert be.stats()["kv_usage"] == 0.0
    assert be.stats()["engine_running"] == 0


def test_wake_fd_readable_when_output_waits(be):
    fd = be.wake_fd()
    be.add(seq("a", 50))
    # step() never waits: the node polls the wake fd until output_ready()
    outs: list = []
    deadline = time.monotonic() + 2.0
    while not outs and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.5)
        assert r == [fd], "the wake fd turns readable when the core queues output"
        outs = be.step()
    assert outs and not be.output_ready()
    be.abort(["a"])


def test_abort_returns_leftovers_and_drops_late_output(be):
    be.add(seq("a", 1000))
    time.sleep(0.05)  # tokens queue up unreturned
    left = be.abort(["a"])
    assert len(left) == 1 and left[0].finish_reason is None and len(left[0].token_ids) > 3
    assert be.num_running() == 0
    time.sleep(0.05)
    assert not [o for o in be.step() if o.seq_id == "a"], "late outputs of an aborted id are dropped"
    assert FAKE.aborted == ["a#1"]
    # the same seq id again: a new request id, no crosstalk
    be.add(seq("a", 3))
    assert drive(be, ["a"])["a"]["tokens"] == [3, 4, 5]


def test_freeze_thaw_keep(be):
    be.add(seq("a", 400))
    time.sleep(0.02)
    r = wait(be.freeze(["a"]))
    assert r == {} and FAKE.paused
    be.step()
    time.sleep(0.05)
    assert not be.step() and not be.has_work(), "frozen: no output"
    assert be.stats()["frozen"]
    wait(be.thaw(["a"]))
    assert not FAKE.paused
    assert drive(be, ["a"])["a"]["finish"] == "length"
    assert FAKE.calls == ["pause_scheduler", "resume_scheduler"]


def test_utility_deadline_names_knob(be):
    FAKE.hold_utilities.add("pause_scheduler")
    be.add(seq("a", 1000))
    op = be.freeze(["a"])
    assert op.knob == "rpc_timeout_s" and not op.future.done()
    t0 = time.monotonic()
    while not op.future.done():
        be.step()  # the backend fails it itself by the deadline
        assert time.monotonic() - t0 < 3
    with pytest.raises(BackendTimeout, match="rpc_timeout_s"):
        op.future.result()
    be.abort(["a"])


def test_sleep_refused_with_live_sequences_then_sleep_wake(be):
    be.add(seq("a", 1000))
    with pytest.raises(BackendError, match="live sequence"):
        wait(be.sleep(1))
    be.abort(["a"])
    r = wait(be.sleep(1), be=be)
    assert r["gpu_freed_bytes"] == 4000 and be.stats()["sleep_level"] == 1
    wait(be.wake_up(None))
    assert be.stats()["sleep_level"] == 0
    # drop kept IPC maps, measure, sleep, measure again, wake
    assert FAKE.calls == ["collective_rpc", "collective_rpc", "sleep", "collective_rpc", "wake_up"]


def test_wake_up_keeps_a_keep_pause(be):
    wait(be.freeze([]))
    wait(be.sleep(1), be=be)
    wait(be.wake_up(None))
    assert FAKE.calls[-2:] == ["wake_up", "pause_scheduler"] and FAKE.paused
    wait(be.thaw([]))
    assert not FAKE.paused


def test_zmq_weights_staged_once_in_shm_and_cleaned(be):
    import torch

    named = [("w.a", torch.arange(16, dtype=torch.float32).reshape(4, 4)), ("w.b", torch.ones(8))]
    metas, sizes, tensors = plan_buckets(named, bucket_bytes=64)
    assert len(sizes) == 2
    r = wait(be.begin_weight_update("u1", "zmq", metas, {"bucket_sizes": sizes}))
    path = r["staging"]
    assert os.path.exists(path) and os.path.getsize(path) == sum(sizes)
    with pytest.raises(BackendError, match="never staged"):
        wait(be.commit_weight_update())
    # commit failed before touching anything: begin again, stage both buckets
    wait(be.begin_weight_update("u1", "zmq", metas, {"bucket_sizes": sizes}))
    path = be._update.stage.path
    for b in range(len(sizes)):
        be.stage_bucket(b, memoryview(pack_bucket(b, metas, sizes, tensors).numpy()))
    assert not FAKE.worker.weights, "nothing visible before commit"
    r = wait(be.commit_weight_update())
    assert r["prefix_cache_reset"] is True
    assert torch.equal(FAKE.worker.weights["w.a"], named[0][1]) and torch.equal(FAKE.worker.weights["w.b"], named[1][1])
    # No walk over every KV block on the critical path: a new cache salt makes
    # every block cached under the old weights unreachable.
    assert FAKE.calls[-2:] == ["collective_rpc", "collective_rpc"] and "reset_prefix_cache" not in FAKE.calls
    assert r["prefix_cache_salt"] == "w1"
    be.add(SeqRequest("after-update", [1, 2, 3], SamplingParams(), 2))
    assert FAKE.salts[-1] == "w1", FAKE.salts
    # issue 23: the caller's cache_salt (SkyRL's per-trajectory salt) joins the weight-version salt
    be.add(SeqRequest("salted", [1, 2, 3], SamplingParams(cache_salt="traj-7"), 2))
    assert FAKE.salts[-1] == "w1|utraj-7", FAKE.salts
    assert FAKE.worker.shm_seen == [path] and not os.path.exists(path), "shm file removed after commit"


def test_zmq_abort_and_bad_bucket(be):
    import torch

    named = [("w.a", torch.ones(4, 4))]
    metas, sizes, tensors = plan_buckets(named)
    wait(be.begin_weight_update("u2", "zmq", metas, {"bucket_sizes": sizes}))
    path = be._update.stage.path
    with pytest.raises(BackendError, match="bucket 0"):
        be.stage_bucket(0, memoryview(b"\x00" * 8))
    wait(be.abort_weight_update())
    assert not os.path.exists(path)
    with pytest.raises(BackendError, match="no weight update"):
        be.stage_bucket(0, memoryview(b""))


@pytest.mark.parametrize(
    "bad,match",
    [
        (("w.a", "float32", [3, 3], 0, 0, 36), "w.a"),
        (("w.nope", "float32", [2], 0, 0, 8), "not a weight"),
        (("w.b", "float32", [8], 0, 0, 31), "nbytes"),
        (("w.b", "complex999", [8], 0, 0, 32), "dtype"),
    ],
)
def test_bad_tensor_refused_naming_it(be, bad, match):
    from bus.protocol import TensorMeta

    op = be.begin_weight_update("u3", "cuda_ipc", [TensorMeta(*bad)], {"bucket_sizes": [256]})
    with pytest.raises(BackendError, match=match) as ei:
        wait(op)
    assert ei.value.field == bad[0]
    assert "rollout_bus_begin" not in str(FAKE.calls)


def test_unknown_transport_and_ipc_handle_count(be):
    from bus.protocol import TensorMeta

    with pytest.raises(BackendError, match="transport"):
        wait(be.begin_weight_update("u", "carrier-pigeon", [], {}))
    FAKE.worker.rollout_bus_apply_ipc = lambda uid, metas, sizes, h, opts: {"seconds": 0.0}
    wait(
        be.begin_weight_update("u", "cuda_ipc", [TensorMeta("w.b", "float32", [8], 0, 0, 32)], {"bucket_sizes": [256]})
    )
    with pytest.raises(BackendError, match="handle"):
        wait(be.receive_weights([b"a", b"b"]))
    with pytest.raises(BackendError, match="before receive"):
        wait(be.commit_weight_update())
    wait(be.receive_weights([b"h"]))
    wait(be.commit_weight_update())


def test_weight_deadline_names_weight_timeout(be):
    from bus.protocol import TensorMeta

    FAKE.hold_utilities.add("rollout_bus_recv_nccl")
    wait(be.begin_weight_update("u", "nccl", [TensorMeta("w.b", "float32", [8], 0, 0, 32)], {"bucket_sizes": [256]}))
    op = be.receive_weights([])
    time.sleep(0.35)
    be.step()
    with pytest.raises(BackendTimeout, match="weight_timeout_s"):
        op.future.result(1)


def test_lora_folders_and_inplace_reload(be):
    import torch

    t = [
        ("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 16)),
        ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(16, 4)),
    ]
    r = wait(be.load_lora("l1", tensors=t))
    assert r == {"lora_id": 1, "in_place": False} and be.loras() == ["l1"]
    d1 = FAKE.loras[1].lora_path
    assert os.path.exists(os.path.join(d1, "adapter_config.json"))
    r = wait(be.load_lora("l1", tensors=t))
    assert r == {"lora_id": 1, "in_place": True} and FAKE.loras[1].load_inplace
    assert not os.path.exists(d1), "the replaced folder is removed"
    be.add(SeqRequest("x", [1], SamplingParams(max_tokens=2), 2, lora="l1"))
    assert drive(be, ["x"])["x"]["tokens"] == [8, 9]
    d2 = FAKE.loras[1].lora_path
    wait(be.unload_lora("l1"))
    assert be.loras() == [] and not os.path.exists(d2)
    with pytest.raises(BackendError, match="exactly one"):
        wait(be.load_lora("l2"))


def test_engine_death_surfaces_as_backend_error(be):
    be.add(seq("a", 1000))
    FAKE.hold_utilities.add("reset_prefix_cache")
    op = be.reset_prefix_cache()
    FAKE.resources.engine_dead = True
    with pytest.raises(BackendError, match="died"):
        be.step()
    with pytest.raises(BackendError, match="died"):
        op.future.result(1)
    with pytest.raises(BackendError):
        be.add(seq("b"))
    with pytest.raises(BackendError):
        wait(be.reset_prefix_cache())


def test_close_stops_the_client(model_dir):
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(model_dir, _api=fake_api(model_dir))
    fake = FAKE
    b.close()
    assert fake.stop.is_set()
    b.close()  # idempotent


@pytest.mark.parametrize(
    "meta,match",
    [
        (("x", "float32", [4], 0, 10**6, 16), "needs bytes"),
        (("x", "float32", [4], 0, -8, 16), "needs bytes"),
        (("x", "nope", [4], 0, 0, 16), "dtype"),
        (("x", "float32", [4], 0, 0, 15), "nbytes"),
        (("x", "float32", [-4], 0, 0, 16), "shape"),
    ],
)
def test_unpack_bucket_is_total(meta, match):
    """The one unpacker (torch backend, vLLM workers, tests): a lying meta is a
    ValueError naming the tensor, for bytes, memoryviews and uint8 tensors."""
    import torch

    from bus.protocol import TensorMeta

    buf = torch.zeros(512, dtype=torch.uint8)
    for b in (buf, memoryview(buf.numpy()), bytes(buf.numpy())):
        with pytest.raises(ValueError, match=match) as ei:
            unpack_bucket(0, [TensorMeta(*meta)], b)
        assert "x" in str(ei.value)
        with pytest.raises(ValueError, match=match):
            unpack_bucket(0, [list(meta)], b)
    # a misaligned offset is copied, not a torch RuntimeError
    assert unpack_bucket(0, [TensorMeta("y", "float32", [1], 0, 2, 4)], buf)[0][1].shape == (1,)


def test_output_thread_error_is_fatal_and_abort_survives_it(be):
    be.add(seq("a", 1000))
    FAKE.outputs_queue.put_nowait(RuntimeError("decode failed"))
    be.abort(["a"])  # never raises for a dead core
    with pytest.raises(BackendError, match="died"):
        be.step()
    assert be.has_work() and be.stats()["engine_dead"]


def test_start_failure_is_a_backend_error(model_dir):
    from engine_node.backends.vllm.backend import make_backend

    api = fake_api(model_dir)

    def boom(cfg, log_stats):
        raise TimeoutError("no engine")

    api.make_client = boom
    with pytest.raises(BackendTimeout, match="start_timeout_s"):
        make_backend(model_dir, _api=api)
    api.make_client = lambda cfg, ls: (_ for _ in ()).throw(RuntimeError("CUDA OOM"))
    with pytest.raises(BackendError, match="failed to start: RuntimeError: CUDA OOM"):
        make_backend(model_dir, _api=api)


def test_issue10_params_map_to_vllm(be):
    p = SamplingParams(
        max_tokens=4,
        min_tokens=2,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.3,
        logprobs=3,
        stop=["never"],
        skip_special_tokens=False,
    )
    be.add(SeqRequest("a", [10, 11, 12], p, 4, prompt_logprobs=2))
    drive(be, ["a"])
    sp = FAKE.seen[0].sampling_params
    assert (sp.min_tokens, sp.min_p, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (
        2,
        0.05,
        1.2,
        0.5,
        -0.3,
    )
    assert sp.logprobs == 3 and sp.prompt_logprobs == 2 and sp.detokenize is False
    assert not hasattr(sp, "stop")  # stop strings stay in the engine node


def test_issue10_logprobs_bool_true_is_sampled_only(be):
    be.add(SeqRequest("a", [10, 11], SamplingParams(max_tokens=2, logprobs=True), 2))
    be.add(SeqRequest("b", [10, 11], SamplingParams(max_tokens=2, logprobs=0), 2))
    be.add(SeqRequest("c", [10, 11], SamplingParams(max_tokens=2), 2))
    drive(be, ["a", "b", "c"])
    sps = {r.request_id.split("#")[0]: r.sampling_params for r in FAKE.seen}
    assert sps["a"].logprobs == 0 and sps["b"].logprobs == 0 and sps["c"].logprobs is None


def test_issue10_top_k_and_prompt_logprobs_to_step_outputs(be):
    p = SamplingParams(max_tokens=3, logprobs=2)
    be.add(SeqRequest("a", [10, 11, 12, 13, 14], p, 3, prompt_logprobs=1))
    outs = []
    end = time.monotonic() + 5
    while not any(o.finish_reason for o in outs):
        assert time.monotonic() < end
        outs += be.step()
    toks = [t for o in outs for t in o.token_ids]
    assert len(toks) == 3
    top_ids = [t for o in outs for t in (o.top_ids or [])]
    top_lps = [x for o in outs for x in (o.top_logprobs or [])]
    # columns 1..k only (the fake sends k + 1 alternatives): sampled first is column 0
    assert top_ids == [x for t in toks for x in ((t + 1) % VOCAB, (t + 2) % VOCAB)]
    assert top_lps == [-1.0, -2.0] * 3
    assert [x for o in outs for x in (o.logprobs or [])] == [-0.5] * 3
    plps = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(plps) == 1  # gathered over the two chunked-prefill pieces, reported once
    pl = plps[0]
    import math

    assert math.isnan(pl.logprobs[0]) and pl.logprobs[1:] == [-1.0, -2.0, -3.0, -4.0]
    assert pl.k == 1 and pl.top_ids[1:] == [12, 13, 14, 15]
    assert pl.top_logprobs[1:] == pytest.approx([-1.1, -2.1, -3.1, -4.1])


def test_resume_ramp_sends_the_shortest_first_then_the_rest(model_dir):
    """A burst into an empty engine is held until the node's next step(); then
    the shortest sequences go first, up to the budget; the rest when their
    first output arrives."""
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(
        model_dir, max_model_len=64, resume_ramp_tokens=10, resume_ramp_wait_s=5.0, _api=fake_api(model_dir)
    )
    try:
        lens = {"r0": 9, "r1": 4, "r2": 7, "r3": 5, "r4": 3}
        for sid, n in lens.items():  # a resume re-submitting parked streams of different lengths
            b.add(seq(sid, n=4, prompt=tuple(range(10, 10 + n))))
        assert FAKE.seen == [], "held until the burst is complete"
        assert b.output_ready(), "the node must not wait in poll before picking"
        FAKE.paused = True  # the fake core steps nothing yet
        assert b.step() == []
        assert [r.request_id.split("#")[0] for r in FAKE.seen] == ["r4", "r1"], "3 + 4 tokens; 5 more would pass 10"
        assert not b.output_ready()
        b.abort(["r0"])  # a held one is dropped without reaching the core
        FAKE.paused = False
        ids = ["r1", "r2", "r3", "r4"]
        res = drive(b, ids)
        assert all(r["finish"] == "length" and len(r["tokens"]) == 4 for r in res.values())
        assert len(FAKE.seen) == 4 and not any(r.request_id.startswith("r0#") for r in FAKE.seen)
        assert not any(rid.startswith("r0#") for rid in FAKE.aborted)
        # the engine was empty again: the next burst ramps again, and one sequence
        # over the whole budget still goes first (alone)
        b.add(seq("s0", n=2, prompt=tuple(range(12))))
        b.add(seq("s1", n=2, prompt=tuple(range(11))))
        FAKE.paused = True
        b.step()
        assert [r.request_id.split("#")[0] for r in FAKE.seen[4:]] == ["s1"]
        FAKE.paused = False
        drive(b, ["s0", "s1"])
        assert len(FAKE.seen) == 6
        # not empty: an add while a sequence runs goes straight to the core
        b.add(seq("t0", n=50))
        b.step()
        b.add(seq("t1", n=2))
        assert FAKE.seen[-1].request_id.startswith("t1#")
        b.abort(["t0"])
        drive(b, ["t1"])
    finally:
        b.close()


def test_resume_ramp_auto_is_the_largest_cuda_graph(model_dir):
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(model_dir, max_model_len=64, resume_ramp_tokens="auto", _api=fake_api(model_dir))
    try:
        assert b.resume_ramp_tokens == 16  # the fake config's capture sizes end at 16
    finally:
        b.close()
    b = make_backend(
        model_dir, max_model_len=64, resume_ramp_tokens="auto", enforce_eager=True, _api=fake_api(model_dir)
    )
    try:
        assert b.resume_ramp_tokens == 0, "no graphs: no ramp"
    finally:
        b.close()
    for bad in (-1, "fast", 1.5j):
        with pytest.raises(BackendError) as ei:
            make_backend(model_dir, max_model_len=64, resume_ramp_tokens=bad, _api=fake_api(model_dir))
        assert ei.value.field == "resume_ramp_tokens"


def test_extra_graph_tokens_extends_llms_capture_sizes(model_dir):
    """LLM's sizes (the fake's 1..16) plus a few up to the option (capped at
    max_num_batched_tokens), the user's other compilation fields kept; the
    ramp's "auto" then follows the largest graph."""
    from engine_node.backends.vllm.backend import make_backend

    api = fake_api(model_dir)
    b = make_backend(
        model_dir,
        max_model_len=64,
        extra_graph_tokens=1100,
        resume_ramp_tokens="auto",
        compilation_config={"mode": 3},
        _api=api,
    )
    try:
        cc = api.build_config.kw["compilation_config"]
        assert cc == {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 640, 768, 1024, 1100]}
        assert b.resume_ramp_tokens == 1100
    finally:
        b.close()
    b = make_backend(model_dir, max_model_len=64, extra_graph_tokens=10**6, _api=api)
    try:
        assert api.build_config.kw["compilation_config"]["cudagraph_capture_sizes"][-1] == 16384  # the step budget
    finally:
        b.close()
    b = make_backend(model_dir, max_model_len=64, extra_graph_tokens=8, _api=api)  # below LLM's largest: unchanged
    try:
        assert "compilation_config" not in api.build_config.kw
    finally:
        b.close()
    for bad in ({"enforce_eager": True}, {"extra_graph_tokens": "lots"}, {"extra_graph_tokens": -5}):
        with pytest.raises(BackendError) as ei:
            make_backend(model_dir, max_model_len=64, **{"extra_graph_tokens": 2048, **bad}, _api=api)
        assert ei.value.field == "extra_graph_tokens"


def test_resume_ramp_ignores_late_outputs_of_aborted_requests(model_dir):
    """After a pause(abort) the core may still deliver outputs of the aborted
    requests (or stats-only batches): those must not end the ramp."""
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(
        model_dir, max_model_len=64, resume_ramp_tokens=10, resume_ramp_wait_s=5.0, _api=fake_api(model_dir)
    )
    try:
        FAKE.paused = True  # the fake core steps nothing: only the batches below arrive
        ids = [f"r{i}" for i in range(5)]
        for sid in ids:
            b.add(seq(sid, n=4, prompt=(10, 11, 12, 13, 14, 15)))
        assert b.step() == [] and len(FAKE.seen) == 1
        stale = types.SimpleNamespace(kv_cache_usage=0.0, num_running_reqs=0, num_waiting_reqs=0)
        FAKE.outputs_queue.put_nowait(FakeBatch([FakeOut("gone#1", [5], None, 1, None)], stale))
        FAKE.outputs_queue.put_nowait(FakeBatch([], stale))
        time.sleep(0.05)
        assert b.step() == []
        assert len(FAKE.seen) == 1, "a late output of an aborted request does not release the held ones"
        FAKE.paused = False  # the ramped requests produce output: the rest go
        deadline = time.monotonic() + 2.0
        while len(FAKE.seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
            b.step()
        assert len(FAKE.seen) == 5
        drive(b, ids)
    finally:
        b.close()


def test_output_trace_says_where_the_first_live_output_came_from(model_dir):
    """The node arms the trace at a Resume; the first batch with output of a
    live request closes it: late batches before it are counted, the ramp's
    sends and its release are recorded, times are ms after the arming."""
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(
        model_dir, max_model_len=64, resume_ramp_tokens=10, resume_ramp_wait_s=5.0, _api=fake_api(model_dir)
    )
    try:
        assert b.take_output_trace() is None  # not armed
        FAKE.paused = True
        b.trace_outputs()
        ids = [f"t{i}" for i in range(5)]
        for sid in ids:
            b.add(seq(sid, n=4, prompt=(10, 11, 12, 13, 14, 15)))
        stale = types.SimpleNamespace(kv_cache_usage=0.0, num_running_reqs=0, num_waiting_reqs=0)
        FAKE.outputs_queue.put_nowait(FakeBatch([FakeOut("gone#1", [5], None, 1, None)], stale))
        time.sleep(0.02)
        assert b.step() == []
        FAKE.paused = False
        deadline = time.monotonic() + 2.0
        tr = None
        while tr is None and time.monotonic() < deadline:
            time.sleep(0.005)
            if b.step():
                tr = b.take_output_trace()
        assert tr is not None
        assert tr["live"] >= 1 and tr["batches_before"] == 1  # the aborted request's late batch
        assert (tr["sent"], tr["sent_tokens"]) == (1, 6)  # the ramp's first pick (6 of 10 tokens; 12 would pass)
        assert "ramp_released_ms" not in tr  # released by that very output, after it was traced
        assert 0 <= tr["built_ms"] <= tr["drained_ms"] < 2000
        assert b.take_output_trace() is None  # taken once
        b.abort(ids)  # (the loop above consumed the first outputs: no drive() to the end)
    finally:
        b.close()


def test_no_ramp_by_default(be):
    for i in range(5):
        be.add(seq(f"q{i}", n=2))
    assert len(FAKE.seen) == 5
    drive(be, [f"q{i}" for i in range(5)])


class FakeSenderComm:
    """FAKE NCCL communicator (one per sender group): broadcast() fills the
    engine's buffer with the next bucket that sender packed. The test is about
    the engine's part bookkeeping, not NCCL (the device test runs NCCL)."""

    def __init__(self, buckets):
        self.buckets = list(buckets)
        self.rank = 1

    def broadcast(self, buf, src=0):
        assert src == 0
        buf.copy_(self.buckets.pop(0))

    def destroy(self):
        pass


@pytest.fixture
def be_slow(model_dir):
    """weight_timeout_s 10: the commit may record a copy plan (seconds on a cold CPU)."""
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(model_dir, max_model_len=64, rpc_timeout_s=5, weight_timeout_s=10, _api=fake_api(model_dir))
    yield b
    b.close()


def test_nccl_parts_of_two_senders_commit_as_one_update(be_slow, monkeypatch):
    be = be_slow
    """Two sender ranks, each its own group and its own metas (buckets
    numbered within its part): the real worker extension appends the parts and
    the one commit writes both; a name sent twice is refused naming it."""
    import torch

    from engine_node.backends.vllm import worker_ext as X

    parts = {
        0: [("w.a", torch.arange(16, dtype=torch.float32).reshape(4, 4))],
        1: [("w.b", torch.full((8,), 7.0))],
    }
    packed = {}
    for r, named in parts.items():
        metas, sizes, tensors = plan_buckets(named, bucket_bytes=64)
        packed[r] = (metas, sizes, [pack_bucket(i, metas, sizes, tensors) for i in range(len(sizes))])

    def fake_nccl(self, a):
        st = self._rb()
        st["nccl"], st["nccl_key"] = FakeSenderComm(packed[a["group_id"]][2]), a["group_id"]
        return {"rank": 1, "reused": False}

    monkeypatch.setattr(X.RolloutBusWorkerExtension, "_rb_nccl", fake_nccl)
    wait(be.begin_weight_update("m1", "nccl", [], {"bucket_sizes": []}))
    for r in (1, 0):  # any order
        metas, sizes, _ = packed[r]
        res = wait(be.receive_part(r, metas, sizes, [], {"group_id": r}), be=be)
        assert res["bytes"] == sum(sizes)
    assert not FAKE.worker.weights, "nothing visible before the commit"
    wait(be.commit_weight_update(), be=be)
    for named in parts.values():
        for n, t in named:
            assert torch.equal(FAKE.worker.weights[n], t), n
    # the same name from two senders: refused, naming it
    wait(be.begin_weight_update("m2", "nccl", [], {"bucket_sizes": []}))
    metas, sizes, _ = packed[0]
    packed[0] = (metas, sizes, list(packed[0][2]))
    wait(be.receive_part(0, metas, sizes, [], {"group_id": 0}), be=be)
    with pytest.raises(BackendError, match="w.a was sent by another sender") as e:
        wait(be.receive_part(1, metas, sizes, [], {"group_id": 0}), be=be)
    assert e.value.field == "w.a"
    wait(be.abort_weight_update(), be=be)


def test_cuda_ipc_parts_append_handles_for_the_one_commit_call(be):
    import torch

    wait(be.begin_weight_update("i1", "cuda_ipc", [], {"bucket_sizes": []}))
    m0, s0, _ = plan_buckets([("w.a", torch.ones(4, 4))], bucket_bytes=64)
    m1, s1, _ = plan_buckets([("w.b", torch.ones(8))], bucket_bytes=64)
    wait(be.receive_part(0, m0, s0, [b"h0"], {}))
    with pytest.raises(BackendError, match="2 handle\\(s\\) for 1 bucket") as e:
        wait(be.receive_part(1, m1, s1, [b"h1", b"h2"], {}))
    assert e.value.field == "handles"
    wait(be.abort_weight_update())
    wait(be.begin_weight_update("i2", "cuda_ipc", [], {"bucket_sizes": []}))
    wait(be.receive_part(0, m0, s0, [b"h0"], {}))
    wait(be.receive_part(1, m1, s1, [b"h1"], {}))
    up = be._update
    assert up.handles == [b"h0", b"h1"] and up.sizes == s0 + s1
    assert [m[3] for m in up.metas] == [0, 1], "sender 1's bucket follows sender 0's"
    wait(be.abort_weight_update())


# ---------------------------------------------------------------- sleep tags (issue 21 §1)
def test_wake_by_tags_any_order_vllm_calls_and_bookkeeping(be):
    """Each wake sends only the tags still asleep (vLLM's executor skips the
    whole call when one is awake); the scheduler resumes only once none is."""
    for order in ([["weights"], ["kv_cache"]], [["kv_cache"], ["weights"]], [None], [["kv_cache", "weights"]]):
        wait(be.sleep(1), be=be)
        assert be.stats()["sleeping"] == ["kv_cache", "weights"]
        for tags in order:
            r = wait(be.wake_up(tags), be=be)
            assert r["woken"] == sorted(tags or ["weights", "kv_cache"])
        assert be.stats()["sleeping"] == [] and be.stats()["sleep_level"] == 0
        assert not FAKE.sleeping_tags and not FAKE.paused
    assert not FAKE.skipped_wakes
    n = len(FAKE.calls)
    r = wait(be.wake_up(["weights"]))  # awake already: no call at all
    assert r["woken"] == [] and len(FAKE.calls) == n


def test_partial_wake_keeps_the_scheduler_paused_and_a_keep_pause(be):
    wait(be.freeze([]))
    wait(be.sleep(1), be=be)
    wait(be.wake_up(["weights"]), be=be)
    assert be.stats()["sleep_level"] == 1 and FAKE.paused
    assert wait(be.thaw([]))["asleep"] is True  # half awake: still the core's sleep pause
    wait(be.freeze([]))
    wait(be.wake_up(["weights", "kv_cache"]), be=be)  # weights awake already: only kv_cache is sent
    assert FAKE.wakes[-1] == ["kv_cache"] and FAKE.calls[-2:] == ["wake_up", "pause_scheduler"] and FAKE.paused
    assert not FAKE.skipped_wakes


def test_sleep_of_a_half_awake_engine_sleeps_every_tag(be):
    wait(be.sleep(1), be=be)
    wait(be.wake_up(["weights"]), be=be)
    wait(be.sleep(1), be=be)  # vLLM alone would leave the weights resident
    assert FAKE.wakes[-1] == ["kv_cache"] and FAKE.sleeping_tags == {"weights", "kv_cache"}
    assert be.stats()["sleeping"] == ["kv_cache", "weights"]
    wait(be.wake_up(None), be=be)
    assert not FAKE.sleeping_tags


def test_level2_kv_first_holds_the_saved_buffers_until_the_weights_wake(be):
    r = wait(be.sleep(2), be=be)
    assert r["weights"] == "discarded"
    wait(be.wake_up(["kv_cache"]), be=be)
    assert FAKE.buffers_into_sleeping_weights == 0, "buffers written into the sleeping weights pool"
    assert FAKE.worker._rb_held_buffers == {"rope": "saved"}
    r = wait(be.wake_up(["weights"]), be=be)
    assert FAKE.worker.buffers_restored == 1 and not FAKE.worker._rb_held_buffers
    # no update wrote the woken weights: the checkpoint's are reloaded before serving
    assert r["reloaded_from_checkpoint"] is True and FAKE.worker.reloads == 1


def test_level2_weights_then_full_update_then_kv_needs_no_reload(be):
    """SkyRL's order after a level-2 sleep: the update writes every checkpoint
    tensor, so waking the KV cache serves those weights (no disk reload)."""
    import torch

    wait(be.sleep(2), be=be)
    r = wait(be.wake_up(["weights"]), be=be)
    assert r["reloaded_from_checkpoint"] is False and be.stats()["weights_stale"] is True
    named = [("w.a", torch.full((4, 4), 2.0)), ("w.b", torch.full((8,), 3.0))]
    metas, sizes, tensors = plan_buckets(named, bucket_bytes=1 << 10)
    wait(be.begin_weight_update("u1", "zmq", metas, {"bucket_sizes": sizes}))
    for b in range(len(sizes)):
        be.stage_bucket(b, memoryview(pack_bucket(b, metas, sizes, tensors).numpy()))
    wait(be.commit_weight_update(), be=be)
    assert be.stats()["weights_stale"] is False
    r = wait(be.wake_up(["kv_cache"]), be=be)
    assert r["reloaded_from_checkpoint"] is False and FAKE.worker.reloads == 0
    assert torch.equal(FAKE.worker.weights["w.a"], named[0][1])
    assert not FAKE.sleeping_tags and not FAKE.paused


def test_level2_partial_update_reloads_the_rest_first(be):
    """After a level-2 sleep, an update of some tensors: the checkpoint is
    reloaded BEFORE the update writes (after it, it would overwrite it)."""
    import torch

    wait(be.sleep(2), be=be)
    wait(be.wake_up(["weights"]), be=be)
    named = [("w.a", torch.full((4, 4), 2.0))]  # w.b never written: still undefined
    metas, sizes, tensors = plan_buckets(named, bucket_bytes=1 << 10)
    wait(be.begin_weight_update("u1", "zmq", metas, {"bucket_sizes": sizes}))
    be.stage_bucket(0, memoryview(pack_bucket(0, metas, sizes, tensors).numpy()))
    wait(be.commit_weight_update(), be=be)
    assert FAKE.worker.reloads == 1 and be.stats()["weights_stale"] is False
    assert torch.equal(FAKE.worker.weights["w.a"], named[0][1])
    r = wait(be.wake_up(["kv_cache"]), be=be)
    assert r["reloaded_from_checkpoint"] is False and FAKE.worker.reloads == 1


def test_nccl_worker_checks_in_and_a_cancelled_or_failed_receive_leaves_nothing_to_commit():
    """The real worker extension (engine_node/backends/vllm/worker_nccl.py):
    with NcclArgs.check_in it adds itself under the trainer's store key and
    waits for the go before anything collective; told not to go (the op
    failed elsewhere) or failing mid-broadcast, its update is dropped, so a
    commit behind it writes nothing: the old weights stay."""
    import socket
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    from engine_node.backends.vllm import worker_nccl as WN

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    w = make_worker()
    named = [("w.b", torch.full((8,), 3.0))]
    tmetas, sizes, tensors = plan_buckets(named, bucket_bytes=64)
    bucket = pack_bucket(0, tmetas, sizes, tensors)
    metas = [[m.name, m.dtype, list(m.shape), m.bucket, m.offset, m.nbytes] for m in tmetas]  # as the backend sends
    comm = FakeSenderComm([bucket])
    joined: list[str] = []

    def fake_nccl(self, a, make=None):
        joined.append(a["check_in"])
        self._rb()["nccl"] = comm
        return {"rank": 1, "reused": False}

    args = {"host": "127.0.0.1", "port": port, "world_size": 2, "group_id": "g", "timeout_s": 5.0}
    orig = WN.NcclReceive._rb_nccl
    WN.NcclReceive._rb_nccl = fake_nccl
    try:
        store.set("rollout_bus/go/ok", b"1")
        r = w.rollout_bus_recv_nccl("u1", {**args, "check_in": "ok"}, metas, sizes)
        assert r["bytes"] == sum(sizes) and int(store.add("rollout_bus/in/ok", 0)) == 1 and joined == ["ok"]
        w.rollout_bus_commit("u1")
        assert torch.equal(w.weights["w.b"], torch.full((8,), 3.0))
        store.set("rollout_bus/go/no", b"0")  # the trainer will not broadcast: the op failed elsewhere
        with pytest.raises(RuntimeError, match="will not broadcast"):
            w.rollout_bus_recv_nccl("u2", {**args, "check_in": "no"}, metas, sizes)
        assert joined == ["ok"], "nothing collective before the go"
        with pytest.raises(RuntimeError, match="no weight update 'u2' begun"):
            w.rollout_bus_commit("u2")
        comm.buckets = []  # the broadcast breaks midway (nothing left to receive)
        store.set("rollout_bus/go/broken", b"1")
        with pytest.raises(IndexError):
            w.rollout_bus_recv_nccl("u3", {**args, "check_in": "broken"}, metas, sizes)
        with pytest.raises(RuntimeError, match="no weight update 'u3' begun"):
            w.rollout_bus_commit("u3")
        comm.buckets = [bucket]  # every byte arrives, but the trainer's check found a NaN beside it
        store.set("rollout_bus/go/nan", b"1")
        store.set("rollout_bus/ok/nan", b"w.b")
        with pytest.raises(ValueError, match="'w.b' has NaN or inf"):
            w.rollout_bus_recv_nccl("u4", {**args, "check_in": "nan", "verdict": True}, metas, sizes)
        with pytest.raises(RuntimeError, match="no weight update 'u4' begun"):
            w.rollout_bus_commit("u4")
        assert torch.equal(w.weights["w.b"], torch.full((8,), 3.0)), "the old weights stay"
        # The trainer's go never comes: the wait ends at the store's deadline, naming the knob.
        short = {**args, "group_id": "g-short", "timeout_s": 0.3, "check_in": "never"}
        with pytest.raises(TimeoutError, match=r"nccl_timeout_s=0\.3"):
            w.rollout_bus_recv_nccl("u5", short, metas, sizes)
        assert joined == ["ok", "broken", "nan"], "nothing collective without the go"
    finally:
        WN.NcclReceive._rb_nccl = orig


def test_issue37_routed_experts_map_to_sequence_positions(model_dir):
    """vLLM's per-output routes (the prompt's at prefill, then one per step)
    become StepOutput rows at the right positions; a re-submission asks vLLM
    to start at its last token (routed_experts_prompt_start); off costs nothing."""
    from engine_node.backends.vllm.backend import make_backend

    b = make_backend(model_dir, max_model_len=64, return_routed_experts=True, _api=fake_api(model_dir))
    try:
        assert b.info().routed_experts == (3, 2, 8)
        assert b._api.build_config.kw["enable_return_routed_experts"] is True
        b.add(SeqRequest("a", [10, 11, 12], SamplingParams(max_tokens=5), 5, routes_from=0))
        b.add(SeqRequest("b", [10, 11, 12, 3, 4], SamplingParams(max_tokens=3), 3, output_prefix=2, routes_from=4))
        b.add(seq("c", 3))
        got: dict = {}
        end = time.monotonic() + 5
        while len([k for k, v in got.items() if v[2]]) < 3:
            assert time.monotonic() < end, got
            for o in b.step():
                start, rows, _ = got.get(o.seq_id, (None, [], False))
                if o.routed_experts is not None:
                    start = o.routes_start if start is None else start
                    rows.append(o.routed_experts)
                got[o.seq_id] = (start, rows, o.finish_reason is not None)
        assert got["a"][0] == 0
        np.testing.assert_array_equal(np.concatenate(got["a"][1]), fake_routes(range(0, 3 + 5 - 1)))
        assert got["b"][0] == 4
        np.testing.assert_array_equal(np.concatenate(got["b"][1]), fake_routes(range(4, 5 + 3 - 1)))
        assert got["c"][1] == [] and not hasattr(FAKE.seen[2].sampling_params, "routed_experts_prompt_start")
        assert [r.sampling_params.routed_experts_prompt_start for r in FAKE.seen[:2]] == [0, 4]
    finally:
        b.close()
