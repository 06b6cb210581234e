"""Issue 21 §3 on a GPU: in-flight weight updates that keep the KV cache, with
the vllm backend. 32 greedy streams run; pause("keep") freezes them in vLLM
with their KV; a cuda_ipc update (model B) commits; resume. Every stream ends
at full length, its tokens' versions switch exactly once (old up to the pause,
new after), nothing is lost, and no stream is re-prefilled: the backend's
count of requests added to / aborted in vLLM does not move (a parked stream
would be aborted and added again with its whole prefix). The time from the
resume to every stream's first new token is recorded (a target, not asserted).

Not run on CPU CI (marked gpu; skipped without CUDA / vLLM).
"""

from __future__ import annotations

import threading
import time

import pytest

from bus import protocol as P
from tests.gpu.common import prompts, record_timing, vllm_cluster

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

N_STREAMS, MAX_TOKENS = 32, 400


@pytest.fixture(scope="module")
def engine(model_dirs):
    c = vllm_cluster(model_dirs["A"])
    yield c
    c.close()


def _stats(cl) -> dict:
    return list(cl.control(P.Stats()).values())[0].detail


@pytest.mark.parametrize("n_streams", [N_STREAMS, 64])
def test_keep_update_keeps_every_stream_and_its_kv(engine, model_dirs, n_streams):
    import torch
    from transformers import AutoModelForCausalLM

    cl = engine.client(timeout_s=300, control_timeout_s=300)
    v0 = cl.generate(prompts(1, 8, seed=5)[0], {"max_tokens": 2}).samples[0].token_versions[0]
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).cuda()
    named = list(mB.named_parameters())
    ps = prompts(n_streams, 12, seed=3000)
    res = [{"tokens": [], "versions": [], "finish": None, "error": None, "t": []} for _ in ps]

    def run(i: int) -> None:
        try:
            for ch in cl.stream(ps[i], {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}):
                res[i]["tokens"] += ch.token_ids
                res[i]["versions"] += [ch.weight_version] * len(ch.token_ids)
                if ch.token_ids:
                    res[i]["t"].append((time.monotonic(), ch.weight_version))
                if ch.finish_reason:
                    res[i]["finish"] = ch.finish_reason
        except Exception as e:
            res[i]["error"] = repr(e)

    ths = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n_streams)]
    for t in ths:
        t.start()
    deadline = time.monotonic() + 120
    while min(len(r["tokens"]) for r in res) < 20:
        assert time.monotonic() < deadline, "streams never started"
        time.sleep(0.005)
    before = _stats(cl)
    t0 = time.perf_counter()
    pr = list(cl.pause("keep").values())[0]
    try:
        assert pr["parked"] == 0 and pr["frozen"] == n_streams, pr
        up = list(cl.update_weights(named, transport="cuda_ipc").values())[0]
        assert up["weight_version"] == v0 + 1
    finally:
        t_resume = time.monotonic()
        cl.resume()
    t_total = time.perf_counter() - t0
    for t in ths:
        t.join(300)
    errors = [r["error"] for r in res if r["error"]]
    assert not errors, errors
    after = _stats(cl)
    assert after["requests_added"] == before["requests_added"], "a stream was re-submitted (re-prefilled)"
    assert after["requests_aborted"] == before["requests_aborted"], "a stream was aborted"
    firsts = []
    for i, r in enumerate(res):
        assert r["finish"] == "length" and len(r["tokens"]) == MAX_TOKENS, f"stream {i}: lost or truncated"
        k = r["versions"].count(v0)
        assert 20 <= k < MAX_TOKENS, f"stream {i}: {k} tokens before the update"
        assert r["versions"] == [v0] * k + [v0 + 1] * (MAX_TOKENS - k), f"stream {i}: versions not exact"
        firsts.append(min(t for t, v in r["t"] if v == v0 + 1) - t_resume)
    record_timing(
        "keep_update_cuda_ipc",
        streams=n_streams,
        pause_update_resume_s=round(t_total, 4),
        resume_to_first_new_token_s=round(min(firsts), 4),
        resume_to_every_stream_new_token_s=round(max(firsts), 4),
        requests_added=after["requests_added"],
    )
    del mB, named
    torch.cuda.empty_cache()
