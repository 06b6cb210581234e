"""The RL control plane on real torch engines: pause modes (per LoRA too), the
submission gate, weight updates over zmq with versions, sleep/wake, LoRA."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bus.errors import BadRequest, ControlError, RequestTimeout
from tests.cluster import Streams, wait_until

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, 500, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@pytest.fixture(scope="module")
def lora_dirs(tiny_model, tmp_path_factory):
    from engine_node.tiny_model import make_random_lora

    root = tmp_path_factory.mktemp("loras")
    return {
        name: make_random_lora(tiny_model, str(root / name), seed=seed)
        for name, seed in (("a", 1), ("b", 2), ("a2", 3))
    }


# ---------------------------------------------------------------- pause modes


def test_abort_mode_mid_generation_loses_and_truncates_nothing(torch_cluster):
    c = torch_cluster.client()
    ps = prompts(16)
    params = {**GREEDY, "max_tokens": 150}
    reference = [r.token_ids for r in c.generate(ps, params)]
    s = Streams(c, ps, params)
    wait_until(lambda: min(s.counts()) >= 3, 60, "every stream to start")
    res = c.pause("abort")
    assert set(res) == {"e0", "e1"}
    assert sum(r["parked"] for r in res.values()) >= 1
    time.sleep(0.2)  # chunks emitted before the pause may still be on the wire
    frozen_at = s.counts()
    time.sleep(0.6)
    assert s.counts() == frozen_at  # parked: nothing is produced while paused
    assert c.is_paused()
    assert any(c.health()["engines"][e]["paused"] for e in ("e0", "e1"))
    c.resume()
    s.join()
    for i in range(len(ps)):
        assert s.tokens(i) == reference[i]  # one unbroken stream: same tokens as uninterrupted greedy
        reasons = [ch.finish_reason for ch in s.chunks[i]]
        assert reasons[-1] == "length" and reasons.count(None) == len(reasons) - 1
        assert "abort" not in reasons


def test_abort_mode_sampled_requests_complete_with_exactly_max_tokens(torch_cluster):
    """Seeded sampled streams parked by a pause(abort) mid-generation and
    re-submitted on resume: each ends with exactly max_tokens and "length"
    (ignore_eos: nothing else may end it), the same tokens as without the
    pause (the torch backend keeps a parked sample's generator state)."""
    c = torch_cluster.client()
    ps = prompts(16, seed=1)
    params = {"max_tokens": 120, "temperature": 1.0, "seed": 5, "logprobs": True, "ignore_eos": True}
    reference = [r.token_ids for r in c.generate(ps, params)]
    s = Streams(c, ps, params)
    wait_until(lambda: min(s.counts()) >= 2, 60, "every stream to start")
    res = c.pause("abort")
    parked = sum(r["parked"] for r in res.values())
    counts = s.counts()
    c.resume()
    s.join()
    # What the name claims needs a park: a sample aborted mid-generation.
    assert parked >= 1, f"the pause parked nothing (streams had {counts} tokens): {res}"
    for i in range(len(ps)):
        n = len(s.tokens(i))
        reasons = [ch.finish_reason for ch in s.chunks[i]]
        assert reasons[-1] == "length" and reasons.count(None) == len(reasons) - 1, reasons
        assert n == 120, f"stream {i}: {n} tokens"
        assert s.tokens(i) == reference[i], f"stream {i} lost, repeated or re-sampled tokens across the park"
        assert sum(len(ch.logprobs) for ch in s.chunks[i]) == n


def test_keep_mode_freezes_and_continues(torch_cluster):
    c = torch_cluster.client()
    ps = prompts(4, seed=2)
    params = {**GREEDY, "max_tokens": 200}
    reference = [r.token_ids for r in c.generate(ps, params)]
    s = Streams(c, ps, params)
    wait_until(lambda: min(s.counts()) >= 3, 60, "every stream to start")
    res = c.pause("keep")
    assert sum(r["frozen"] for r in res.values()) >= 1
    time.sleep(0.5)  # chunks and heartbeats from before the pause may still be on the wire
    frozen_at = s.counts()
    steps = {e: v["steps"] for e, v in c.health()["engines"].items()}
    time.sleep(0.6)
    assert s.counts() == frozen_at
    assert {e: v["steps"] for e, v in c.health()["engines"].items()} == steps  # observed: no steps
    assert all(v["healthy"] for v in c.health()["engines"].values())  # frozen is not "stalled"
    c.resume()
    s.join()
    for i in range(len(ps)):
        assert s.tokens(i) == reference[i]


def test_wait_mode_drains_and_the_gate_holds_new_requests(torch_cluster):
    c = torch_cluster.client()
    ps = prompts(4, seed=3)
    s = Streams(c, ps, {**GREEDY, "max_tokens": 60})
    wait_until(lambda: min(s.counts()) >= 1, 60, "every stream to start")
    c.pause("wait")
    # pause(wait) returned: every running request already finished
    assert all(ch and ch[-1].finish_reason == "length" for ch in s.chunks)
    s.join(5)
    late = Streams(c, [ps[0]], {**GREEDY, "max_tokens": 5})
    time.sleep(0.5)
    assert late.counts() == [0]  # held by the submission gate
    held = sum(v["held"] for v in c.health()["engines"].values())
    assert held == 1
    c.resume()
    late.join()
    assert len(late.tokens(0)) == 5


def test_held_request_past_its_deadline_gets_a_timeout_error(torch_cluster):
    c = torch_cluster.client()
    c.pause("abort")
    try:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout) as e:
            c.generate([4, 5, 6], {"max_tokens": 3}, timeout_s=0.7)
        assert e.value.field == "timeout_s" and e.value.request_id
        assert time.monotonic() - t0 < 5
    finally:
        c.resume()
    assert c.generate([4, 5, 6], {"max_tokens": 3}).token_ids


def test_paused_context_manager_resumes_when_the_body_raises(torch_cluster):
    c = torch_cluster.client()
    with pytest.raises(RuntimeError):
        with c.paused("abort"):
            assert c.is_paused()
            raise RuntimeError("train step failed")
    assert not c.is_paused()


# ---------------------------------------------------------------- LoRA


def test_per_lora_pause_holds_only_that_adapter(torch_cluster, lora_dirs):
    c = torch_cluster.client()
    c.load_lora("a", path=lora_dirs["a"])
    c.load_lora("b", path=lora_dirs["b"])
    p = [7, 8, 9, 10]
    params = {**GREEDY, "max_tokens": 150}
    ref_a = c.generate(p, params, lora="a").token_ids
    base = c.generate(p, params).token_ids
    assert ref_a != base  # the adapter changes the output
    s_a = Streams(c, [p, p], params, lora="a")
    wait_until(lambda: min(s_a.counts()) >= 3, 60, "adapter a streams to start")
    res = c.pause("abort", lora="a")
    assert all(r["scope"] == "a" for r in res.values())
    time.sleep(0.2)  # chunks emitted before the pause may still be on the wire
    frozen_at = s_a.counts()
    s_b = Streams(c, [p], {**GREEDY, "max_tokens": 40}, lora="b")
    s_b.join()  # the other adapter keeps streaming
    assert len(s_b.tokens(0)) == 40
    new_a = Streams(c, [p], {**GREEDY, "max_tokens": 5}, lora="a")
    time.sleep(0.3)
    assert s_a.counts() == frozen_at and new_a.counts() == [0]
    assert c.is_paused(lora="a") and not c.is_paused(lora="b")
    c.resume(lora="a")
    s_a.join()
    new_a.join()
    assert s_a.tokens(0) == ref_a and s_a.tokens(1) == ref_a


def test_lora_load_from_tensors_in_place_reload_unload_and_routing(torch_cluster, lora_dirs):
    from engine_node.lora_local import read_peft_folder

    c = torch_cluster.client()
    p = [11, 12, 13]
    params = {**GREEDY, "max_tokens": 20}
    c.load_lora("x", path=lora_dirs["a"], targets=["e0"])  # only e0 has it
    by_path = c.generate(p, params, lora="x")
    assert by_path.engine_id == "e0"
    assert {c.generate(p, params, lora="x").engine_id for _ in range(6)} == {"e0"}  # routing prefers it
    tensors, config = read_peft_folder(lora_dirs["a"])
    c.load_lora("x", tensors=tensors, config=config, targets=["e1"])
    assert c.generate(p, params, lora="x").token_ids == by_path.token_ids
    tensors2, config2 = read_peft_folder(lora_dirs["a2"])
    c.load_lora("x", tensors=tensors2, config=config2)  # in place, everywhere, no pause
    reloaded = c.generate(p, params, lora="x").token_ids
    assert reloaded != by_path.token_ids
    c.unload_lora("x")
    with pytest.raises(BadRequest) as e:
        c.generate(p, params, lora="x")
    assert e.value.field == "lora"


# ---------------------------------------------------------------- weights, versions, sleep


@pytest.fixture
def fresh(cluster_factory):
    cl = cluster_factory(2)
    cl.wait_ready(2)
    return cl


def _perturbed(tiny_model, seed: int):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, prm in m.named_parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.05)
    return m.eval()


def _reference(model, p: list[int], n: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[0]
        logits = model(out.unsqueeze(0)).logits[0].float()
    toks = out[len(p) :].tolist()
    lp = torch.log_softmax(logits, -1)
    return toks, [lp[len(p) - 1 + i, t].item() for i, t in enumerate(toks)]


def test_weight_update_over_zmq_matches_a_reference_model(fresh, tiny_model):
    c = fresh.client()
    p = [21, 22, 23, 24]
    params = {**GREEDY, "max_tokens": 12, "logprobs": True}
    before = c.generate(p, params)
    assert set(before.token_versions) == {0}
    new = _perturbed(tiny_model, seed=1)
    with c.paused("abort"):
        res = c.update_weights(new.named_parameters(), bucket_bytes=1 << 16)  # many buckets
    assert {e: r["weight_version"] for e, r in res.items()} == {"e0": 1, "e1": 1}
    ref_toks, ref_lps = _reference(new, p, 12)
    for _ in range(2):  # both engines
        after = c.generate(p, params)
        assert after.token_ids == ref_toks
        assert max(abs(a - b) for a, b in zip(after.logprobs, ref_lps, strict=True)) <= 1e-5
        assert set(after.token_versions) == {1}
    assert before.token_ids != ref_toks
    assert {e["weight_version"] for e in c.engines()} == {1}


def test_a_request_spanning_an_update_reports_versions_per_token(fresh, tiny_model):
    c = fresh.client()
    p = [31, 32, 33]
    # Built before the stream starts: building a model can outlast the 300 tokens.
    new, newer = _perturbed(tiny_model, seed=2), _perturbed(tiny_model, seed=3)
    s = Streams(c, [p], {**GREEDY, "max_tokens": 300})
    wait_until(lambda: s.counts()[0] >= 5, 60, "the stream to start")
    with c.paused("abort"):
        c.update_weights(new.named_parameters())
    s.join()
    versions = [ch.weight_version for ch in s.chunks[0] for _ in ch.token_ids]
    assert versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions)  # 0…0 then 1…1
    assert len(s.tokens(0)) == 300
    # the non-streamed form carries the same per-token versions
    s2 = [None]

    def run():
        s2[0] = c.generate(p, {**GREEDY, "max_tokens": 1500})

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: sum(v["running"] for v in c.health()["engines"].values()) == 1, 30, "the request to run")
    with c.paused("abort"):
        c.update_weights(newer.named_parameters())
    t.join(60)
    vs = s2[0].token_versions
    assert len(vs) == 1500 and vs == sorted(vs) and vs[0] == 1 and vs[-1] == 2


def test_failed_transfers_leave_old_weights_and_version(fresh, tiny_model):
    c = fresh.client()
    p = [41, 42, 43]
    params = {**GREEDY, "max_tokens": 10, "logprobs": True}
    before = c.generate(p, params)
    new = _perturbed(tiny_model, seed=4)
    named = list(new.named_parameters())
    bad_name = named[:3] + [("model.layers.0.no_such.weight", named[3][1])] + named[4:]
    with pytest.raises(ControlError) as e:
        c.update_weights(bad_name)
    assert "model.layers.0.no_such.weight" in str(e.value)
    bad_shape = [(n, t[:-1] if i == 5 else t) for i, (n, t) in enumerate(named)]
    with pytest.raises(ControlError) as e:
        c.update_weights(bad_shape)
    assert named[5][0] in str(e.value)
    assert {x["weight_version"] for x in c.engines()} == {0}
    after = c.generate(p, params)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert not c.is_paused()


def test_sleep_wake_up_gives_identical_generation(fresh):
    c = fresh.client()
    p = [51, 52, 53]
    params = {**GREEDY, "max_tokens": 16, "logprobs": True}
    before = c.generate(p, params)
    res = c.sleep(1)
    assert set(res) == {"e0", "e1"}
    assert all(v["sleeping"] == 1 for v in c.health()["engines"].values()) or wait_until(
        lambda: all(v["sleeping"] == 1 for v in c.health()["engines"].values()), 5, "sleep to show in heartbeats"
    )
    held = Streams(c, [p], params)
    time.sleep(0.3)
    assert held.counts() == [0]  # asleep: requests wait for wake_up
    c.wake_up()
    held.join()
    assert held.tokens(0) == before.token_ids
    after = c.generate(p, params)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    c.sleep(2)
    c.wake_up()
    assert c.generate(p, params).token_ids == before.token_ids
    c.reset_prefix_cache()


def test_an_engine_dying_during_an_update_leaves_every_engine_on_old_weights(fresh, tiny_model):
    import signal

    c = fresh.client()
    p = [61, 62, 63]
    params = {**GREEDY, "max_tokens": 10}
    before = c.generate(p, params).token_ids
    new = _perturbed(tiny_model, seed=5)
    named = list(new.named_parameters())
    fresh.kill("e1", signal.SIGSTOP)  # hung now; the head still thinks it healthy for ~0.6 s
    try:
        with pytest.raises(ControlError) as e:
            c.update_weights(named)
        assert "e1" in str(e.value)
    finally:
        fresh.kill("e1", signal.SIGCONT)
    wait_until(lambda: c.health()["engines"]["e1"]["healthy"], 10, "e1 to come back")
    assert {x["engine_id"]: x["weight_version"] for x in c.engines()} == {"e0": 0, "e1": 0}
    for _ in range(4):  # both engines still serve the old weights
        assert c.generate(p, params).token_ids == before


def test_an_engine_joining_a_paused_cluster_comes_up_paused(cluster_factory):
    # The head hands a joining engine the cluster's pause, whatever its
    # backend: null engines here, no model to load in each.
    cl = cluster_factory(1, backend="null")
    cl.wait_ready(1)
    c = cl.client()
    c.pause("abort")
    cl.start_engine("e1")
    wait_until(lambda: c.health()["engines"].get("e1", {}).get("healthy"), 60, "e1 to join")
    wait_until(lambda: c.health()["engines"]["e1"]["paused"] == ["*"], 5, "e1's heartbeat to show the pause")
    assert c.is_paused()
    held = Streams(c, [[4, 5, 6]] * 4, {**GREEDY, "max_tokens": 4})
    time.sleep(0.4)
    assert held.counts() == [0, 0, 0, 0]  # nobody serves while the cluster is paused
    c.resume()
    held.join()
    assert not c.is_paused()


def test_wait_mode_past_its_deadline_names_the_knob(torch_cluster):
    c = torch_cluster.client()
    s = Streams(c, [[4, 5, 6]], {**GREEDY, "max_tokens": 1800})
    wait_until(lambda: s.counts()[0] >= 2, 30, "the stream to start")
    try:
        with pytest.raises(ControlError) as e:
            c.pause("wait", timeout_s=0.3)
        assert "timeout_s" in str(e.value)
    finally:
        c.resume()
    s.join()
    assert len(s.tokens(0)) == 1800
