"""End to end on a GPU: a real head + one engine node with the vllm backend
(subprocesses, as `launch.py` starts them) driven by the trainer_bridge Client.

Covers issue 4's list: generate/stream/sample/logprobs equal to LLM.generate,
pause(abort|keep) with 32 concurrent streams, a colocated cuda_ipc weight
update (checked against transformers), versions, sleep/wake, LoRA, and on 2
GPUs the nccl transport through the client.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.cluster import wait_until
from tests.gpu.common import (
    ENGINE_OPTS,
    HF_GAP_TOL,
    N_NEW,
    PROMPTS,
    gpu_count,
    hf_check,
    match_frac,
    prompts,
    record_timing,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

GREEDY = {"max_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}


def _cluster(model: str, env: dict[str, str] | None = None, **opts):
    from tests.cluster import Cluster

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        t0 = time.perf_counter()
        c = Cluster(1, backend="vllm", model=model, backend_options={**ENGINE_OPTS, **opts})
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        c.wait_ready(1, timeout_s=240)
    except BaseException:
        print(c.log("e0")[-5000:])
        c.close()
        raise
    return c, time.perf_counter() - t0


@pytest.fixture(scope="module")
def e2e(model_dirs, llm_reference):
    c, dt = _cluster(model_dirs["A"])
    record_timing("e2e_engine_ready", seconds=round(dt, 2))
    cl = c.client(timeout_s=120, control_timeout_s=120)
    yield cl
    c.close()


def _greedy_tokens(cl, ps=PROMPTS, lora=None):
    res = cl.generate(ps, dict(GREEDY), lora=lora)
    return [r.samples[0].token_ids for r in res], res


def test_e2e_generate_stream_sample_logprobs(e2e, llm_reference):
    toks, res = _greedy_tokens(e2e)
    assert toks == llm_reference, "greedy through the runtime equals LLM.generate"
    assert all(r.samples[0].finish_reason == "length" for r in res)
    lp = e2e.generate(PROMPTS[0], {**GREEDY, "logprobs": True})
    assert lp.samples[0].token_ids == llm_reference[0]
    assert len(lp.samples[0].logprobs) == N_NEW and all(x <= 0 for x in lp.samples[0].logprobs)
    streamed = []
    n_chunks = 0
    for ch in e2e.stream(PROMPTS[1], dict(GREEDY)):
        streamed += ch.token_ids
        n_chunks += 1
    assert streamed == llm_reference[1] and n_chunks > 1
    s = e2e.sample(PROMPTS[2], 4, {"max_tokens": 16, "temperature": 1.0, "seed": 5})
    assert len(s.sequences) == 4
    assert all(len(q.tokens) <= 16 and q.stop_reason in ("stop", "length") for q in s.sequences)
    assert len({tuple(q.tokens) for q in s.sequences}) > 1, "4 samples differ"


def test_e2e_throughput(e2e):
    many = prompts(256, 32, seed=7)
    p = {"max_tokens": 128, "temperature": 1.0, "ignore_eos": True, "seed": 0}
    e2e.generate(many[:8], p)
    t0 = time.perf_counter()
    res = e2e.generate(many, p)
    dt = time.perf_counter() - t0
    ntok = sum(len(r.samples[0].token_ids) for r in res)
    assert ntok == 256 * 128
    record_timing("e2e_throughput_through_runtime", new_tokens=ntok, seconds=round(dt, 3), tok_per_s=round(ntok / dt))


def _streams(cl, n, max_tokens):
    """n concurrent greedy streams on threads; returns (threads, results, last_chunk_time)."""
    res = [{"tokens": [], "finish": None, "versions": [], "error": None} for _ in range(n)]
    last = [0.0]

    def run(i):
        try:
            p = prompts(1, 12, seed=2000 + i)[0]
            for ch in cl.stream(p, {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}):
                res[i]["tokens"] += ch.token_ids
                res[i]["versions"] += [ch.weight_version] * len(ch.token_ids)
                if ch.token_ids:
                    last[0] = time.monotonic()
                if ch.finish_reason:
                    res[i]["finish"] = ch.finish_reason
        except Exception as e:
            res[i]["error"] = repr(e)

    ths = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in ths:
        t.start()
    return ths, res, last


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_e2e_pause_32_streams(e2e, mode):
    n, mt = 32, 300
    ref_th, ref, _ = _streams(e2e, n, mt)
    for t in ref_th:
        t.join(120)
    ths, res, last = _streams(e2e, n, mt)
    deadline = time.monotonic() + 60
    while sum(len(r["tokens"]) for r in res) < 20 * n:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t0 = time.perf_counter()
    pr = e2e.pause(mode)
    t_pause = time.perf_counter() - t0
    time.sleep(0.3)  # chunks already in flight land
    counts = [len(r["tokens"]) for r in res]
    time.sleep(1.0)
    assert [len(r["tokens"]) for r in res] == counts, f"tokens arrived while paused ({mode})"
    assert e2e.is_paused()
    t0 = time.perf_counter()
    e2e.resume()
    while sum(len(r["tokens"]) for r in res) == sum(counts):
        assert time.perf_counter() - t0 < 30
        time.sleep(0.001)
    t_first = time.perf_counter() - t0
    for t in ths:
        t.join(120)
    errors = [r["error"] for r in res if r["error"]]
    assert not errors, errors
    assert all(r["finish"] == "length" and len(r["tokens"]) == mt for r in res), [
        (r["finish"], len(r["tokens"])) for r in res
    ]
    frac = match_frac([r["tokens"] for r in res], [r["tokens"] for r in ref])
    record_timing(
        f"e2e_pause_{mode}",
        streams=n,
        pause_to_quiescent_s=round(t_pause, 4),
        resume_to_first_token_s=round(t_first, 4),
        tokens_at_pause=sum(counts),
        result=list(pr.values())[0],
        same_tokens_as_unpaused=round(frac, 4),
    )
    assert frac > 0.97


def test_e2e_update_weights_cuda_ipc_then_zmq(e2e, model_dirs, llm_reference):
    import torch
    from transformers import AutoModelForCausalLM

    v0 = e2e.generate(PROMPTS[0], dict(GREEDY)).samples[0].token_versions[0]
    # the trainer: model B on this GPU
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).cuda()
    named = list(mB.named_parameters())
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    t0 = time.perf_counter()
    with e2e.paused("abort"):
        t1 = time.perf_counter()
        r = e2e.update_weights(named, transport="cuda_ipc")
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    res = list(r.values())[0]
    record_timing(
        "e2e_update_cuda_ipc",
        bytes=nbytes,
        update_s=round(t2 - t1, 4),
        GBps=round(nbytes / (t2 - t1) / 1e9, 3),
        pause_update_resume_s=round(t3 - t0, 4),
        engine_result=res,
    )
    assert res["weight_version"] == v0 + 1
    toks, out = _greedy_tokens(e2e)
    assert all(set(o.samples[0].token_versions) == {v0 + 1} for o in out), "tokens stamped with the new version"
    gap, agree = hf_check(model_dirs["B"], toks)
    record_timing("e2e_after_update_vs_hf_B", max_logprob_gap=round(gap, 4), argmax_agreement=round(agree, 3))
    assert gap < HF_GAP_TOL and agree > 0.9
    del mB, named
    torch.cuda.empty_cache()
    # back to A over zmq (CPU tensors): bit-identical to the start
    from safetensors.torch import load_file

    sdA = {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(model_dirs["A"], "model.safetensors")).items()}
    t0 = time.perf_counter()
    with e2e.paused("abort"):
        e2e.update_weights(list(sdA.items()), transport="zmq")
    record_timing(
        "e2e_update_zmq", bytes=sum(v.numel() * 2 for v in sdA.values()), seconds=round(time.perf_counter() - t0, 4)
    )
    toks, out = _greedy_tokens(e2e)
    assert toks == llm_reference
    assert out[0].samples[0].token_versions[0] == v0 + 2


def test_e2e_zero_copy_updates_keep_maps_across_steps_and_sleep(e2e, model_dirs, llm_reference):
    """update_weights(..., zero_copy=True): the engine copies straight from the
    trainer's parameters (bit for bit what load_weights writes: weight_check),
    keeps its maps while the parameters stay put (the trainer writes them in
    place between updates, as an optimizer does), and drops them at sleep.
    Once the engine holds the trainer's layout an update is ONE control op
    (path "one_trip": receive + validate + prepare + commit); after a sleep the
    trainer falls back to two round trips by itself, then one again; and the
    pipelined update_weights(pause="abort") takes the one-trip path too."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    v0 = e2e.generate(PROMPTS[0], dict(GREEDY)).samples[0].token_versions[0]
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).cuda()
    named = list(mB.named_parameters())
    sdA = load_file(os.path.join(model_dirs["A"], "model.safetensors"))
    sdB = {n: t.detach().clone() for n, t in named}
    opts = {"transport": "cuda_ipc", "zero_copy": True, "device": "cuda:0"}

    def step(sd: dict, path: str, pipelined: bool = False, **kw: object) -> int:
        with torch.no_grad():  # the optimizer step: same memory, new values
            for n, t in named:
                t.copy_(sd[n].to(t.dtype))
        t0 = time.perf_counter()
        if pipelined:
            r = e2e.update_weights(named, pause="abort", **opts, **kw)
        else:
            with e2e.paused("abort"):
                r = e2e.update_weights(named, **opts, **kw)
        res = list(r.values())[0]
        record_timing(
            "e2e_zero_copy_update",
            seconds=round(time.perf_counter() - t0, 4),
            path=res.get("path"),
            pipelined=pipelined,
            prepare_s=res.get("prepare_s"),
            commit_s=res.get("commit_s"),
            **kw,
        )
        assert res.get("path") == path, res
        if kw.get("weight_check"):
            assert not res["worker"].get("check_mismatch"), "the fast path wrote other bits than load_weights"
        return res["weight_version"]

    assert step(sdB, "two_trip", weight_check=True) == v0 + 1  # maps opened (and the plan checked bit for bit)
    toks, out = _greedy_tokens(e2e)
    gap, agree = hf_check(model_dirs["B"], toks)
    assert gap < HF_GAP_TOL and agree > 0.9
    assert step(sdA, "one_trip") == v0 + 2  # maps kept: the same handles, new values behind them; one op
    toks, out = _greedy_tokens(e2e)
    assert toks == llm_reference and set(out[0].samples[0].token_versions) == {v0 + 2}
    assert step(sdB, "one_trip", weight_check=True) == v0 + 3  # one op, still bit for bit
    e2e.sleep(1)  # drops the maps
    e2e.wake_up(["weights"])
    assert step(sdA, "two_trip") == v0 + 4  # the layout was dropped: handles again, maps opened again
    e2e.wake_up(["kv_cache"])
    toks, _ = _greedy_tokens(e2e)
    assert toks == llm_reference
    assert step(sdB, "one_trip", pipelined=True) == v0 + 5
    toks, _ = _greedy_tokens(e2e)
    gap, agree = hf_check(model_dirs["B"], toks)
    assert gap < HF_GAP_TOL and agree > 0.9
    assert step(sdA, "one_trip", pipelined=True) == v0 + 6
    toks, out = _greedy_tokens(e2e)
    assert toks == llm_reference and set(out[0].samples[0].token_versions) == {v0 + 6}
    assert not e2e.is_paused()
    named.clear()
    del mB
    torch.cuda.empty_cache()


def test_e2e_bad_update_keeps_weights(e2e, model_dirs, llm_reference):
    import torch
    from transformers import AutoModelForCausalLM

    from bus.errors import BadRequest, ControlError

    v = e2e.generate(PROMPTS[0], dict(GREEDY)).samples[0].token_versions[0]
    with pytest.raises(ControlError, match="nope"):
        e2e.update_weights([("model.nope.weight", torch.zeros(4, device="cuda"))], transport="cuda_ipc")
    # A NaN, zero-copy and packed: the trainer's check (overlapped with the
    # begin) refuses before the commit, naming the tensor.
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).cuda()
    named = list(mB.named_parameters())
    with torch.no_grad():
        named[3][1].view(-1)[5] = float("nan")
    for zero_copy in (True, False):
        with pytest.raises(BadRequest, match=f"tensor {named[3][0]!r} has NaN or inf values"):
            e2e.update_weights(named, transport="cuda_ipc", zero_copy=zero_copy)
    named.clear()
    del mB
    torch.cuda.empty_cache()
    toks, out = _greedy_tokens(e2e)
    assert toks == llm_reference and out[0].samples[0].token_versions[0] == v


def test_e2e_sleep_wake(e2e, llm_reference):
    r1 = list(e2e.sleep(1).values())[0]
    r2 = list(e2e.wake_up().values())[0]
    record_timing("e2e_sleep_wake", sleep=r1, wake=r2)
    assert (r1.get("gpu_freed_bytes") or 0) > 64 << 20
    toks, _ = _greedy_tokens(e2e)
    assert toks == llm_reference


def test_e2e_lora(e2e, model_dirs, llm_reference, tmp_path):
    from safetensors.torch import load_file

    from engine_node.tiny_model import make_random_lora

    d1 = make_random_lora(model_dirs["A"], str(tmp_path / "l1"), r=8, seed=1, b_std=0.5)
    e2e.load_lora("l1", path=d1)
    # The router learns an engine's adapters from its heartbeats: wait for one.
    wait_until(lambda: all("l1" in e.get("loras", []) for e in e2e.engines()), 10, "the router to see adapter l1")
    out1, _ = _greedy_tokens(e2e, lora="l1")
    assert out1 != llm_reference
    d2 = make_random_lora(model_dirs["A"], str(tmp_path / "l2"), r=8, seed=2, b_std=0.5)
    tensors = list(load_file(os.path.join(d2, "adapter_model.safetensors")).items())
    e2e.load_lora(
        "l1",
        tensors=tensors,
        config={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    )
    out2, _ = _greedy_tokens(e2e, lora="l1")
    assert out2 != out1 and out2 != llm_reference
    base, _ = _greedy_tokens(e2e)
    assert base == llm_reference
    e2e.unload_lora("l1")


@pytest.mark.parametrize("gpus,tp", [("1", 1), ("1,2", 2)], ids=["tp1_gpu1", "tp2_gpus12"])
def test_e2e_nccl_trainer_gpu0(model_dirs, gpus, tp):
    """Client.update_weights(transport="nccl"): the trainer (this process, GPU 0)
    broadcasts to a vllm engine node on other GPUs (TP=2: every worker gets the
    full tensors; NCCL needs one GPU per rank, so TP=2 needs 3 GPUs)."""
    if gpu_count() < 1 + tp:
        pytest.skip(f"needs {1 + tp} GPUs (trainer + TP={tp} engine); {gpu_count()} visible at collection")
    import torch
    from transformers import AutoModelForCausalLM

    torch.cuda.set_device(0)
    c, dt = _cluster(model_dirs["A"], env={"CUDA_VISIBLE_DEVICES": gpus}, enable_lora=False, tp=tp)
    try:
        cl = c.client(timeout_s=120, control_timeout_s=120)
        assert [e["tp"] for e in cl.engines()] == [tp]
        mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).to("cuda:0")
        named = list(mB.named_parameters())
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        # the group set up ahead of the updates (SkyRL's init_weight_update_communicator
        # does this): an empty begin/receive/abort; no weights, no version change
        from trainer_bridge.transports.nccl import warm_up_nccl

        t0 = time.perf_counter()
        init = cl._call(warm_up_nccl(cl._aclient, {"device": "cuda:0"}), 120)
        record_timing(f"e2e_nccl_tp{tp}_warm_up", seconds=round(time.perf_counter() - t0, 4), detail=init)
        assert init["trainer"]["comm_init_s"] >= 0 and "reused" not in init
        assert cl._call(warm_up_nccl(cl._aclient, {"device": "cuda:0"}), 120)["reused"] is True
        times, paths = [], []
        for _ in range(2):  # the group is up: both updates reuse it
            t0 = time.perf_counter()
            with cl.paused("abort"):
                r = cl.update_weights(named, transport="nccl")
            times.append(time.perf_counter() - t0)
            paths.append({v.detail.get("path") for v in r.values()})
        # the second update names the plan every engine kept: one op (issue 21 §4)
        assert paths == [{"two_trip"}, {"one_trip"}], paths
        record_timing(
            f"e2e_update_nccl_tp{tp}",
            bytes=nbytes,
            engine_start_s=round(dt, 1),
            first_s=round(times[0], 4),
            second_s=round(times[1], 4),
            engine_result=list(r.values())[0],
        )
        toks, out = _greedy_tokens(cl)
        assert all(set(o.samples[0].token_versions) == {2} for o in out)
        gap, agree = hf_check(model_dirs["B"], toks)
        record_timing(f"e2e_nccl_tp{tp}_vs_hf_B", max_logprob_gap=round(gap, 4), argmax_agreement=round(agree, 3))
        assert gap < HF_GAP_TOL and agree > 0.9
    finally:
        c.close()
