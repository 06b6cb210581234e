"""The torch backend, in process (no sockets): exactness against transformers'
own model, sampling, stops, freeze/thaw, weight transactions, sleep/wake, LoRA,
and the tiny-model builder it runs on."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from bus.protocol import SamplingParams, TensorMeta
from bus.tensors import pack_bucket, plan_buckets
from engine_node import tiny_model
from engine_node.backend import Backend, BackendError, SeqRequest
from engine_node.backends.torch.backend import TorchBackend, make_backend, sample_token
from engine_node.tiny_model import build_tiny_model, ensure_tiny_model, hf_quiet, make_random_lora
from tests.cluster import wait_until

PROMPTS = [
    [4, 38, 10, 20],
    [5, 6, 7],
    [100, 200, 300, 400, 500, 7, 8, 9, 10],
    [1, 42],
    [77] * 12,
]
TOL = 1e-5

# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "base"), seed=0)


@pytest.fixture(scope="session")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Same architecture, other weights: the target of weight updates."""
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "other"), seed=1)


def _load(path: str) -> Any:
    with hf_quiet():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def ref(model_dir: str) -> Any:
    return _load(model_dir)


@pytest.fixture(scope="session")
def ref_other(other_dir: str) -> Any:
    return _load(other_dir)


@pytest.fixture
def backend(model_dir: str) -> Iterator[TorchBackend]:
    b = make_backend(model_dir)
    yield b
    b.close()


# ------------------------------------------------------------------ helpers


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def seq(sid: str, prompt: list[int], params: SamplingParams, **kw: Any) -> SeqRequest:
    return SeqRequest(seq_id=sid, prompt=list(prompt), params=params, max_new_tokens=params.max_tokens, **kw)


class Result:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None


def drain(
    b: TorchBackend, schedule: dict[int, list[SeqRequest]] | None = None, max_steps: int = 1000
) -> dict[str, Result]:
    """Step until idle; `schedule[i]` is added before step i (continuous batching)."""
    schedule = dict(schedule or {})
    out: dict[str, Result] = {}
    for i in range(max_steps):
        for s in schedule.pop(i, []):
            b.add(s)
        if not b.has_work() and not schedule:
            return out
        for o in b.step():
            r = out.setdefault(o.seq_id, Result())
            assert r.finish is None, f"{o.seq_id} produced output after finishing"
            assert len(o.token_ids) == 1
            r.tokens += o.token_ids
            r.logprobs += o.logprobs or []
            r.finish = o.finish_reason
    raise AssertionError("backend did not drain")


def run_one(b: TorchBackend, prompt: list[int], params: SamplingParams, **kw: Any) -> Result:
    return drain(b, {0: [seq("x", prompt, params, **kw)]})["x"]


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """transformers' own greedy generation, stopping at the model's eos (and
    keeping it), like the backend without ignore_eos."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            pad_token_id=model.config.pad_token_id,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax of one full forward over prompt + output (no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def assert_close(a: list[float], b: list[float], tol: float = TOL) -> None:
    assert len(a) == len(b)
    worst = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert worst <= tol, f"max |Δlogprob| = {worst}"


def all_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def metas(named: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [
        TensorMeta(
            name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), bucket=0, offset=0, nbytes=t.nbytes
        )
        for n, t in named
    ]


def greedy_all(b: TorchBackend, n: int = 10, lora: str | None = None) -> dict[str, list[int]]:
    res = drain(b, {0: [seq(f"p{i}", p, greedy(n), lora=lora) for i, p in enumerate(PROMPTS)]})
    return {k: r.tokens for k, r in res.items()}


# ------------------------------------------------------------------ exactness


def test_protocol_and_info(backend: TorchBackend, model_dir: str) -> None:
    assert isinstance(backend, Backend)
    info = backend.info()
    assert (info.backend, info.model, info.vocab_size, info.eos_token_ids) == ("torch", model_dir, 512, [2])
    assert info.max_model_len == 2048  # clamped to max_position_embeddings
    assert backend.freeze_granularity == "seq" and backend.wake_fd() is None


def test_greedy_equals_generate(backend: TorchBackend, ref: Any) -> None:
    res = drain(backend, {0: [seq(f"p{i}", p, greedy(16)) for i, p in enumerate(PROMPTS)]})
    for i, p in enumerate(PROMPTS):
        r = res[f"p{i}"]
        assert r.tokens == hf_greedy(ref, p, 16)
        assert r.finish == ("stop" if r.tokens[-1] == 2 else "length")
    assert backend.num_running() == 0 and not backend.has_work()


def test_continuous_batching_staggered(backend: TorchBackend, ref: Any) -> None:
    """Sequences join at different steps, one leaves early (abort); the others
    still match generate() exactly."""
    schedule = {
        0: [seq("a", PROMPTS[0], greedy(20))],
        2: [seq("b", PROMPTS[1], greedy(5)), seq("c", PROMPTS[2], greedy(12))],
        3: [seq("gone", PROMPTS[3], greedy(20))],
        7: [seq("d", PROMPTS[4], greedy(9))],
    }
    got: dict[str, list[int]] = {}
    for i in range(200):
        for s in schedule.pop(i, []):
            backend.add(s)
        if i == 6:
            # nothing unreturned: only the generator state (kept for a re-submission)
            assert [(o.seq_id, o.token_ids, o.finish_reason) for o in backend.abort(["gone"])] == [("gone", [], None)]
        if not backend.has_work() and not schedule:
            break
        outs = backend.step()
        assert len({o.seq_id for o in outs}) == len(outs)
        for o in outs:
            got.setdefault(o.seq_id, []).extend(o.token_ids)
    assert len(got["gone"]) == 3
    for sid, p, n in [("a", PROMPTS[0], 20), ("b", PROMPTS[1], 5), ("c", PROMPTS[2], 12), ("d", PROMPTS[4], 9)]:
        assert got[sid] == hf_greedy(ref, p, n), sid


def test_logprobs_equal_model_log_softmax(backend: TorchBackend, ref: Any) -> None:
    """Raw-distribution logprobs (before temperature/top-k/top-p), greedy and sampled."""
    params = [
        greedy(14, logprobs=True),
        SamplingParams(max_tokens=14, temperature=0.7, top_k=50, top_p=0.9, seed=3, logprobs=True),
        SamplingParams(max_tokens=14, temperature=1.3, logprobs=True, ignore_eos=True),
    ]
    reqs = [seq(f"s{i}{j}", p, sp, seed=i * 10 + j) for i, p in enumerate(PROMPTS[:3]) for j, sp in enumerate(params)]
    res = drain(backend, {0: reqs})
    for i, p in enumerate(PROMPTS[:3]):
        for j in range(len(params)):
            r = res[f"s{i}{j}"]
            assert len(r.logprobs) == len(r.tokens)
            assert_close(r.logprobs, hf_logprobs(ref, p, r.tokens))


def test_no_logprobs_unless_asked(backend: TorchBackend) -> None:
    backend.add(seq("x", PROMPTS[0], greedy(2)))
    assert all(o.logprobs is None for o in backend.step())


def test_capacity_limits_sequences_per_step(model_dir: str, ref: Any) -> None:
    b = make_backend(model_dir, capacity=2)
    try:
        b.add(seq("a", PROMPTS[0], greedy(4)))
        b.add(seq("b", PROMPTS[1], greedy(4)))
        b.add(seq("c", PROMPTS[2], greedy(4)))
        assert [o.seq_id for o in b.step()] == ["a", "b"]  # oldest first
        res = drain(b)
        assert b.num_running() == 0
        assert len(res["c"].tokens) == 4
    finally:
        b.close()


# ------------------------------------------------------------------ sampling


def test_seed_determinism(backend: TorchBackend) -> None:
    sp = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    first = run_one(backend, PROMPTS[0], sp, seed=7).tokens
    # Same seed while batched with other sequences added at other steps.
    res = drain(
        backend,
        {
            0: [seq("n1", PROMPTS[1], sp, seed=1)],
            2: [seq("same", PROMPTS[0], sp, seed=7), seq("other", PROMPTS[0], sp, seed=8)],
        },
    )
    assert res["same"].tokens == first
    assert res["other"].tokens != first


def test_unseeded_sequences_differ(backend: TorchBackend) -> None:
    sp = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    res = drain(backend, {0: [seq("u1", PROMPTS[0], sp), seq("u2", PROMPTS[0], sp)]})
    assert res["u1"].tokens != res["u2"].tokens


def test_top_k_1_and_tiny_top_p_equal_greedy(backend: TorchBackend) -> None:
    want = run_one(backend, PROMPTS[2], greedy(16)).tokens
    assert run_one(backend, PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.5, top_k=1), seed=5).tokens == want
    assert (
        run_one(backend, PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.5, top_p=1e-6), seed=5).tokens == want
    )


def test_top_k_restricts_support(backend: TorchBackend, ref: Any) -> None:
    """Every sampled token is among the top-k of the model's distribution."""
    r = run_one(backend, PROMPTS[0], SamplingParams(max_tokens=20, temperature=2.0, top_k=3, ignore_eos=True), seed=1)
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPTS[0] + r.tokens])).logits[0]
    for i, t in enumerate(r.tokens):
        assert t in logits[len(PROMPTS[0]) - 1 + i].topk(3).indices.tolist()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(-1, 40),
    top_p=st.floats(0.01, 1.0),
)
def test_sample_token_stays_in_top_k_and_nucleus(seed: int, temperature: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, generator=g) * 3
    tok = sample_token(logits, temperature, top_k, top_p, g)
    order = torch.argsort(logits / temperature, descending=True).tolist()
    rank = order.index(tok)
    if top_k > 0:
        assert rank < top_k
    # The nucleus of the (top-k-filtered) tempered distribution: mass before
    # this token's rank must still be below top_p.
    scaled = logits / temperature
    if top_k > 0:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    probs = torch.softmax(scaled, -1)[order]
    assert float(probs[:rank].sum()) < top_p + 1e-6


# ------------------------------------------------------------------ stops


def test_max_tokens_gives_length(backend: TorchBackend) -> None:
    r = run_one(backend, PROMPTS[0], greedy(7, ignore_eos=True))
    assert len(r.tokens) == 7 and r.finish == "length"


def test_stop_token_ids_included_and_stop(backend: TorchBackend) -> None:
    full = run_one(backend, PROMPTS[2], greedy(16, ignore_eos=True)).tokens
    stop_tok = full[5]
    r = run_one(backend, PROMPTS[2], greedy(16, stop_token_ids=[stop_tok], ignore_eos=True))
    cut = full.index(stop_tok) + 1
    assert r.tokens == full[:cut] and r.finish == "stop"


@pytest.fixture(scope="session")
def eos_model(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int, list[int]]:
    """The base model with its eos id set to the 6th greedy token of PROMPTS[2]
    (random weights rarely emit the real eos)."""
    b = make_backend(model_dir)
    full = run_one(b, PROMPTS[2], greedy(16, ignore_eos=True)).tokens
    b.close()
    eos = full[5]
    out = str(tmp_path_factory.mktemp("eos") / "m")
    shutil.copytree(model_dir, out)
    for fname in ("config.json", "generation_config.json"):
        with open(os.path.join(out, fname)) as f:
            cfg = json.load(f)
        cfg["eos_token_id"] = eos
        with open(os.path.join(out, fname), "w") as f:
            json.dump(cfg, f)
    return out, eos, full


def test_eos_stops_unless_ignored(eos_model: tuple[str, int, list[int]]) -> None:
    path, eos, full = eos_model
    b = make_backend(path)
    try:
        assert b.info().eos_token_ids == [eos]
        r = run_one(b, PROMPTS[2], greedy(16))
        cut = full.index(eos) + 1
        assert r.tokens == full[:cut] and r.tokens[-1] == eos and r.finish == "stop"
        assert r.tokens == hf_greedy(_load(path), PROMPTS[2], 16)  # generate() stops there too
        r = run_one(b, PROMPTS[2], greedy(16, ignore_eos=True))
        assert r.tokens == full and r.finish == "length"
    finally:
        b.close()


# ------------------------------------------------------------------ validation


def test_add_validation(backend: TorchBackend) -> None:
    with pytest.raises(BackendError, match="max_tokens"):
        backend.add(seq("long", [5] * 2000, greedy(100)))
    with pytest.raises(BackendError, match="prompt_token_ids"):
        backend.add(seq("oov", [5, 512], greedy(3)))
    with pytest.raises(BackendError, match="prompt_token_ids"):
        backend.add(seq("neg", [5, -1], greedy(3)))
    with pytest.raises(BackendError, match="prompt_token_ids"):
        backend.add(seq("empty", [], greedy(3)))
    with pytest.raises(BackendError, match="lora 'nope'"):
        backend.add(seq("l", [5], greedy(3), lora="nope"))
    with pytest.raises(BackendError, match="top_p"):
        backend.add(seq("p", [5], SamplingParams(top_p=0.0)))
    backend.add(seq("ok", [5], greedy(3)))
    with pytest.raises(BackendError, match="already"):
        backend.add(seq("ok", [5], greedy(3)))
    assert backend.num_running() == 1


def test_make_backend_rejects_unknown_option(model_dir: str) -> None:
    with pytest.raises(BackendError, match="unknown option"):
        make_backend(model_dir, gpu_memory_utilization=0.5)


# ------------------------------------------------------------------ freeze / abort


def test_freeze_thaw(backend: TorchBackend, ref: Any) -> None:
    backend.add(seq("f", PROMPTS[0], greedy(12)))
    backend.add(seq("g", PROMPTS[1], greedy(12)))
    got: dict[str, list[int]] = {"f": [], "g": []}

    def step() -> None:
        for o in backend.step():
            got[o.seq_id] += o.token_ids

    for _ in range(3):
        step()
    backend.freeze(["f"])
    for _ in range(4):
        step()
    assert len(got["f"]) == 3 and len(got["g"]) == 7
    backend.freeze(["g"])
    assert not backend.has_work() and backend.step() == []
    assert backend.num_running() == 2 and backend.stats()["frozen"] == 2
    backend.thaw(["f", "g", "unknown"])
    while backend.has_work():
        step()
    assert got["f"] == hf_greedy(ref, PROMPTS[0], 12)
    assert got["g"] == hf_greedy(ref, PROMPTS[1], 12)


def test_abort_drops_and_reports_nothing(backend: TorchBackend) -> None:
    backend.add(seq("a", PROMPTS[0], greedy(10)))
    backend.add(seq("b", PROMPTS[1], greedy(10)))
    backend.step()
    left = backend.abort(["a", "never-added"])
    assert [(o.seq_id, o.token_ids, o.finish_reason) for o in left] == [("a", [], None)]
    assert isinstance(left[0].rng_state, bytes)
    assert backend.num_running() == 1
    assert {o.seq_id for o in backend.step()} == {"b"}


def test_stats(backend: TorchBackend) -> None:
    backend.add(seq("a", PROMPTS[0], greedy(10)))
    backend.step()
    backend.step()
    st = backend.stats()
    assert st["kv_tokens"] == len(PROMPTS[0]) + 1  # prompt + first token
    assert 0.0 < st["kv_usage"] <= 1.0 and st["kv_bytes"] > 0
    assert st["params"] > 0 and st["device"] == "cpu"


# ------------------------------------------------------------------ weights


def done(op: Any) -> dict[str, Any]:
    """The result of a BackendOp (raises its error)."""
    return op.future.result(timeout=60)


def _plan(named: list[tuple[str, torch.Tensor]], buckets: int) -> tuple[list[TensorMeta], list[bytes]]:
    """Bucket plan and the raw bucket bytes, as the bridge sends them over zmq."""
    total = sum(t.nbytes for _, t in named)
    ms, sizes, ts = plan_buckets(named, bucket_bytes=max(1, total // buckets))
    return ms, [pack_bucket(i, ms, sizes, ts).numpy().tobytes() for i in range(len(sizes))]


def _update(b: TorchBackend, named: list[tuple[str, torch.Tensor]], buckets: int = 3) -> None:
    ms, bufs = _plan(named, buckets)
    done(b.begin_weight_update("u", "zmq", ms, {}))
    for i, buf in enumerate(bufs):
        b.stage_bucket(i, memoryview(buf))
    done(b.commit_weight_update())


def test_weight_update_matches_reference(backend: TorchBackend, ref_other: Any) -> None:
    _update(backend, all_tensors(ref_other))
    res = drain(backend, {0: [seq(f"p{i}", p, greedy(12, logprobs=True)) for i, p in enumerate(PROMPTS)]})
    for i, p in enumerate(PROMPTS):
        assert res[f"p{i}"].tokens == hf_greedy(ref_other, p, 12)
        assert_close(res[f"p{i}"].logprobs, hf_logprobs(ref_other, p, res[f"p{i}"].tokens))


def test_weight_update_staging_is_a_copy(backend: TorchBackend, ref_other: Any) -> None:
    """The frame dies after stage_bucket returns: the backend keeps a copy."""
    named = all_tensors(ref_other)
    ms, bufs = _plan(named, 1)
    done(backend.begin_weight_update("u", "zmq", ms, {}))
    frame = bytearray(bufs[0])
    backend.stage_bucket(0, memoryview(frame))
    frame[:] = bytes(len(frame))
    done(backend.commit_weight_update())
    assert greedy_all(backend, 6)["p0"] == hf_greedy(ref_other, PROMPTS[0], 6)


@pytest.mark.parametrize("bad", ["name", "shape", "dtype"])
def test_weight_update_bad_meta_refused(backend: TorchBackend, ref_other: Any, bad: str) -> None:
    before = greedy_all(backend)
    named = all_tensors(ref_other)
    m = metas(named)
    victim = "model.layers.1.mlp.up_proj.weight"
    i = next(k for k, x in enumerate(m) if x.name == victim)
    if bad == "name":
        m[i].name = "model.layers.9.mlp.up_proj.weight"
    elif bad == "shape":
        m[i].shape = [1, 2]
    else:
        m[i].dtype = "bfloat16"
    with pytest.raises(BackendError, match=r"model\.layers\.[19]\.mlp\.up_proj\.weight") as ei:
        done(backend.begin_weight_update("u", "zmq", m, {}))
    assert isinstance(ei.value, ValueError) and ei.value.field == "tensors"
    with pytest.raises(BackendError):
        backend.stage_bucket(0, memoryview(b"\0" * 64))  # nothing was opened
    assert greedy_all(backend) == before


def test_weight_update_bad_stage_or_missing_leaves_old_weights(backend: TorchBackend, ref_other: Any) -> None:
    before = greedy_all(backend)
    named = all_tensors(ref_other)
    ms, bufs = _plan(named, 3)
    done(backend.begin_weight_update("u", "zmq", ms, {}))
    last = ms[-1]
    with pytest.raises(BackendError, match=last.name.replace(".", r"\.")):
        backend.stage_bucket(last.bucket, memoryview(bufs[last.bucket][: last.offset + 1]))  # truncated
    for i in range(len(bufs) - 1):
        backend.stage_bucket(i, memoryview(bufs[i]))
    with pytest.raises(BackendError, match=last.name.replace(".", r"\.")):
        done(backend.commit_weight_update())
    assert greedy_all(backend) == before
    done(backend.abort_weight_update())
    with pytest.raises(BackendError):
        done(backend.commit_weight_update())
    assert greedy_all(backend) == before


def test_weight_update_abort_keeps_old_weights(backend: TorchBackend, ref_other: Any) -> None:
    before = greedy_all(backend)
    named = all_tensors(ref_other)
    ms, bufs = _plan(named, 1)
    done(backend.begin_weight_update("u", "zmq", ms, {}))
    backend.stage_bucket(0, memoryview(bufs[0]))
    done(backend.abort_weight_update())
    assert greedy_all(backend) == before


def test_weight_update_transports(backend: TorchBackend) -> None:
    with pytest.raises(BackendError, match="transport 'nccl' not supported by torch backend"):
        done(backend.begin_weight_update("u", "nccl", [], {}))
    with pytest.raises(BackendError, match="not supported"):
        done(backend.receive_weights([]))


def test_weight_update_accepts_tied_alias(tmp_path: Any) -> None:
    path = build_tiny_model(str(tmp_path / "tied"), seed=2, tie_embeddings=True, layers=1)
    b = make_backend(path)
    try:
        emb = b.model.get_input_embeddings().weight
        new = torch.randn(emb.shape, generator=torch.Generator().manual_seed(0))
        _update(b, [("lm_head.weight", new)], buckets=1)
        assert torch.equal(emb.detach(), new)
        assert b.model.get_output_embeddings().weight is emb
    finally:
        b.close()


def test_long_op_runs_on_the_worker_and_never_blocks_step(model_dir: str, ref_other: Any) -> None:
    """While a commit holds the model, step() returns [] at once (it does not
    wait for the op) and add() still queues; the op's future resolves when it
    is done. No wall-clock bound: the op holds the model for hold_s (1.5 s)
    and each call must return while it still does (a call that waited for the
    op would return after it); only a stall of this thread longer than
    hold_s, not plausible load, could fail it spuriously."""
    import time

    hold_s = 1.5
    b = make_backend(model_dir, fault_op_delay_s={"commit_weight_update": hold_s})
    try:
        b.add(seq("a", PROMPTS[0], greedy(5)))
        ms, bufs = _plan(all_tensors(ref_other), 1)
        done(b.begin_weight_update("u", "zmq", ms, {}))
        b.stage_bucket(0, memoryview(bufs[0]))
        op = b.commit_weight_update()
        assert not op.future.done(), "commit_weight_update ran the op on the caller's thread"
        assert op.knob == "op_timeout_s" and op.deadline > time.monotonic()
        wait_until(b._model_lock.locked, 10, "the worker to take the model")
        assert b.step() == []
        assert not op.future.done(), "step() waited for the op that holds the model"
        b.add(seq("b", PROMPTS[1], greedy(5)))  # queues while the op runs
        assert not op.future.done()
        assert done(op)["tensors"] == len(ms)
        res = drain(b, {})
        assert res["a"].tokens and res["b"].tokens == hf_greedy(ref_other, PROMPTS[1], 5)
    finally:
        b.close()


# ------------------------------------------------------------------ sleep / wake


def test_sleep1_wake_identical(backend: TorchBackend) -> None:
    before = greedy_all(backend)
    res = done(backend.sleep(1))
    assert res["level"] == 1 and res["weights"] == "kept"  # CPU: weights stay
    with pytest.raises(BackendError, match="sleeping"):
        backend.add(seq("x", PROMPTS[0], greedy(3)))
    woke = done(backend.wake_up(["kv_cache"]))
    assert woke["sleeping"] == ["weights"]
    done(backend.wake_up(None))
    assert backend.stats()["sleeping"] == []
    assert greedy_all(backend) == before


def test_sleep2_discards_updates_and_reloads_checkpoint(backend: TorchBackend, ref_other: Any) -> None:
    before = greedy_all(backend)
    _update(backend, all_tensors(ref_other))
    assert greedy_all(backend) != before
    nbytes = sum(p.nbytes for p in backend.model.parameters())
    res = done(backend.sleep(2))
    assert res["weights"] == "discarded" and res["freed_bytes"] >= nbytes
    assert sum(p.nbytes for p in backend.model.parameters()) == 0
    with pytest.raises(BackendError, match="discarded"):
        done(backend.begin_weight_update("u", "zmq", metas(all_tensors(ref_other))[:1], {}))
    woke = done(backend.wake_up(["weights", "kv_cache"]))
    assert woke["restored_bytes"] == nbytes
    assert greedy_all(backend) == before


def test_sleep_refused_with_sequences(backend: TorchBackend) -> None:
    backend.add(seq("x", PROMPTS[0], greedy(3)))
    with pytest.raises(BackendError, match="1 sequences"):
        done(backend.sleep(1))
    backend.abort(["x"])
    with pytest.raises(BackendError, match="level"):
        done(backend.sleep(3))
    with pytest.raises(BackendError, match="unknown wake_up tags"):
        done(backend.wake_up(["everything"]))


# ------------------------------------------------------------------ LoRA


def _merged_reference(model_dir: str, adapter_dir: str) -> Any:
    """The base model with W += scaling * B @ A folded in: what the adapter
    should compute."""
    model = _load(model_dir)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    scaling = cfg["lora_alpha"] / cfg["r"]
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            params[module + ".weight"] += scaling * (b @ a)
    return model


@pytest.fixture(scope="session")
def lora_dirs(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("lora")
    return [
        make_random_lora(model_dir, str(root / "l0"), seed=0),
        make_random_lora(model_dir, str(root / "l1"), seed=1, r=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")),
    ]


def test_make_random_lora_is_peft_format(lora_dirs: list[str]) -> None:
    with open(os.path.join(lora_dirs[0], "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    tensors = load_file(os.path.join(lora_dirs[0], "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert len(tensors) == 2 * 4 * 2  # A+B × 4 targets × 2 layers
    assert all(t.abs().sum() > 0 for t in tensors.values())


def test_lora_applies_per_sequence(backend: TorchBackend, model_dir: str, ref: Any, lora_dirs: list[str]) -> None:
    done(backend.load_lora("l0", path=lora_dirs[0]))
    assert backend.loras() == ["l0"]
    merged = _merged_reference(model_dir, lora_dirs[0])
    p = PROMPTS[2]
    # Same step mixes an adapter sequence and a base sequence.
    res = drain(
        backend, {0: [seq("lora", p, greedy(12, logprobs=True), lora="l0"), seq("base", p, greedy(12, logprobs=True))]}
    )
    assert res["base"].tokens == hf_greedy(ref, p, 12)
    assert res["lora"].tokens != res["base"].tokens
    assert res["lora"].tokens == hf_greedy(merged, p, 12)
    # Merging reorders fp32 sums: close, not bit-equal.
    assert_close(res["lora"].logprobs, hf_logprobs(merged, p, res["lora"].tokens), tol=1e-4)


def test_lora_reload_in_place_and_unload(backend: TorchBackend, model_dir: str, lora_dirs: list[str]) -> None:
    base = greedy_all(backend)
    done(backend.load_lora("a", path=lora_dirs[0]))
    first = greedy_all(backend, lora="a")
    assert first != base
    # Replace "a" in place with other tensors, given as named tensors without
    # the PEFT prefix (as a trainer would stage them), while a sequence runs.
    backend.add(seq("running", PROMPTS[0], greedy(20), lora="a"))
    backend.step()
    tensors = load_file(os.path.join(lora_dirs[1], "adapter_model.safetensors"))
    named = [(n.removeprefix("base_model.model."), t) for n, t in tensors.items()]
    done(backend.load_lora("a", tensors=named, config={"r": 4, "lora_alpha": 8}))
    with pytest.raises(BackendError, match="used by 1 running"):
        done(backend.unload_lora("a"))
    backend.abort(["running"])
    second = greedy_all(backend, lora="a")
    assert second != first and second != base
    assert second["p3"] == hf_greedy(_merged_reference(model_dir, lora_dirs[1]), PROMPTS[3], 10)
    done(backend.unload_lora("a"))
    assert backend.loras() == []
    assert greedy_all(backend) == base
    with pytest.raises(BackendError, match="not loaded"):
        done(backend.unload_lora("a"))
    with pytest.raises(BackendError, match="lora 'a'"):
        backend.add(seq("x", PROMPTS[0], greedy(3), lora="a"))


def test_lora_bad_tensors_refused(backend: TorchBackend, lora_dirs: list[str]) -> None:
    done(backend.load_lora("good", path=lora_dirs[0]))
    before = greedy_all(backend, lora="good")
    tensors = load_file(os.path.join(lora_dirs[0], "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"
    bad_shape = [(n, t[:, :3] if n == key else t) for n, t in tensors.items()]
    with pytest.raises(BackendError, match=r"layers\.1\.self_attn\.o_proj\.lora_B"):
        done(backend.load_lora("good", tensors=bad_shape, config={"r": 8, "lora_alpha": 16}))
    with pytest.raises(BackendError, match="no Linear module"):
        done(backend.load_lora("good", tensors=[("model.layers.7.self_attn.q_proj.lora_A.weight", torch.zeros(8, 64))]))
    missing_b = [(n, t) for n, t in tensors.items() if n != key]
    with pytest.raises(BackendError, match="no lora_B"):
        done(backend.load_lora("good", tensors=missing_b))
    with pytest.raises(BackendError, match="target_modules"):
        done(backend.load_lora("good", tensors=list(tensors.items()), config={"target_modules": ["q_proj"]}))
    # The loaded adapter was never touched.
    assert greedy_all(backend, lora="good") == before


# ------------------------------------------------------------------ tiny model


def test_tiny_model_is_deterministic(model_dir: str, tmp_path: Any) -> None:
    again = build_tiny_model(str(tmp_path / "again"), seed=0)
    a = load_file(os.path.join(model_dir, "model.safetensors"))
    b = load_file(os.path.join(again, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(again)
    assert len(tok) == 512 and tok.eos_token_id == 2
    assert tok.decode(tok("the quick brown fox").input_ids) == "the quick brown fox"


def test_ensure_tiny_model_builds_once_and_survives_a_race(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_BUS_CACHE", str(tmp_path))
    kw = dict(layers=1, vocab=128)
    final = tiny_model.default_model_dir(**kw)
    assert final.startswith(str(tmp_path)) and "tiny-llama-" in final
    assert tiny_model.default_model_dir(**kw) != tiny_model.default_model_dir(layers=1, vocab=256)

    real_build = tiny_model.build_tiny_model
    calls: list[str] = []

    def racing_build(out_dir: str, **params: Any) -> str:
        # A competitor finishes first: the final dir appears while we build.
        if not calls:
            real_build(final, **params)
        calls.append(out_dir)
        return real_build(out_dir, **params)

    monkeypatch.setattr(tiny_model, "build_tiny_model", racing_build)
    assert ensure_tiny_model(**kw) == final
    assert os.listdir(tmp_path) == [os.path.basename(final)]  # loser's temp dir removed
    assert ensure_tiny_model(**kw) == final and len(calls) == 1  # cached: no rebuild


def test_resubmission_with_rng_state_continues_the_stream_exactly(backend: TorchBackend) -> None:
    """A parked sample (abort → re-submit prompt + tokens so far with the
    generator state abort returned) draws exactly what it would have drawn."""
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)

    def run(s: SeqRequest, steps: int | None = None) -> list[int]:
        backend.add(s)
        out: list[int] = []
        n = 0
        while backend.has_work() and (steps is None or n < steps):
            for o in backend.step():
                out += o.token_ids
            n += 1
        return out

    whole = run(SeqRequest("w", list(PROMPTS[0]), p, 24, seed=11))
    head = run(SeqRequest("h", list(PROMPTS[0]), p, 24, seed=11), steps=9)
    (left,) = backend.abort(["h"])
    tail = run(SeqRequest("t", list(PROMPTS[0]) + head, p, 24 - len(head), seed=11, rng_state=left.rng_state))
    assert head + tail == whole
    # Without the state the stream restarts from the seed: not the same continuation.
    again = run(SeqRequest("r", list(PROMPTS[0]) + head, p, 24 - len(head), seed=11))
    assert head + again != whole
