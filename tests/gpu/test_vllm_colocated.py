"""Issue 21 §1 on a GPU: SkyRL's colocated order with the vllm backend, the
trainer in this process on the same GPU:

  sleep(level) -> the trainer takes 80 % of the GPU memory sleeping freed
  (torch.cuda.mem_get_info before/after) -> frees it -> wake_up(["weights"])
  -> cuda_ipc weight update (model B) -> wake_up(["kv_cache"]) -> generate,

greedy output teacher-forced against transformers on model B (tests/gpu/common.py
hf_check, as the e2e update test checks), every token on the new version.
Requests sent while any tag sleeps wait and then run on the new weights.
Level 2 too (weights discarded: the update replaces them, no checkpoint reload).

Not run on CPU CI (marked gpu; skipped without CUDA / vLLM).
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.cluster import wait_until
from tests.gpu.common import HF_GAP_TOL, N_NEW, PROMPTS, hf_check, record_timing, vllm_cluster

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

GREEDY = {"max_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def colo(model_dirs):
    """One vllm engine node behind a head, model A (0.3 of the GPU)."""
    c = vllm_cluster(model_dirs["A"])
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _awake_after(colo):
    """A failed test must not leave the module's engine asleep: the next
    test's generate would wait out its timeout behind the sleep."""
    yield
    colo.client(control_timeout_s=120).wake_up()


def _asleep(cl, tags: list[str]) -> None:
    wait_until(lambda: cl.health()["engines"]["e0"]["asleep"] == tags, 10, f"health to show asleep={tags}")


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_sleep_wake_by_tags_with_cuda_ipc_update(colo, model_dirs, level):
    import torch
    from transformers import AutoModelForCausalLM

    cl = colo.client(timeout_s=300, control_timeout_s=300)
    v0 = cl.generate(PROMPTS[0], dict(GREEDY)).samples[0].token_versions[0]
    # the trainer: model B on this GPU (its weights stay resident, as a trainer's do)
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).cuda()
    named = list(mB.named_parameters())
    torch.cuda.synchronize()

    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    r_sleep = list(cl.sleep(level).values())[0]
    t_sleep = time.perf_counter() - t0
    free1 = torch.cuda.mem_get_info()[0]
    freed = free1 - free0
    assert freed > 256 << 20, f"sleep({level}) freed only {freed} bytes"
    _asleep(cl, ["kv_cache", "weights"])

    # requests sent while asleep wait (they run once every tag is awake)
    held: list = []
    th = threading.Thread(target=lambda: held.append(cl.generate(PROMPTS, dict(GREEDY))), daemon=True)
    th.start()

    # the trainer step: 80 % of what sleeping freed, touched, then given back
    take = int(freed * 0.8)
    block = torch.empty(take, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    assert int(block[-1].item()) == 1
    del block
    torch.cuda.empty_cache()

    t0 = time.perf_counter()
    r_w = list(cl.wake_up(["weights"]).values())[0]
    t_wake_w = time.perf_counter() - t0
    _asleep(cl, ["kv_cache"])
    assert r_w["detail"]["asleep"] == ["kv_cache"]

    t0 = time.perf_counter()
    up = list(cl.update_weights(named, transport="cuda_ipc").values())[0]
    t_update = time.perf_counter() - t0
    # SkyRL's order: one version per step at both levels (a level-2 wake of
    # the weights serves nothing before this update overwrites the checkpoint,
    # so it takes no version of its own; tests/test_sleep_tags.py, 7cf47c3)
    version = v0 + 1
    assert up["weight_version"] == version
    time.sleep(0.3)
    assert not held, "served before the KV cache woke"

    t0 = time.perf_counter()
    r_kv = list(cl.wake_up(["kv_cache"]).values())[0]
    t_wake_kv = time.perf_counter() - t0
    _asleep(cl, [])
    assert r_kv["detail"].get("reloaded_from_checkpoint") is False, "the update's weights were overwritten"
    th.join(120)
    assert held, "requests held through the sleep never finished"

    toks = [r.samples[0].token_ids for r in held[0]]
    assert all(set(r.samples[0].token_versions) == {version} for r in held[0])
    out = cl.generate(PROMPTS, dict(GREEDY))
    assert [r.samples[0].token_ids for r in out] == toks
    gap, agree = hf_check(model_dirs["B"], toks)
    record_timing(
        f"colocated_sleep{level}_tags",
        gpu_freed_bytes=freed,
        engine_gpu_freed_bytes=r_sleep["detail"].get("gpu_freed_bytes"),
        trainer_took_bytes=take,
        sleep_s=round(t_sleep, 4),
        wake_weights_s=round(t_wake_w, 4),
        update_cuda_ipc_s=round(t_update, 4),
        wake_kv_cache_s=round(t_wake_kv, 4),
        max_logprob_gap=round(gap, 4),
        argmax_agreement=round(agree, 3),
    )
    assert gap < HF_GAP_TOL and agree > 0.9
    del mB, named
    torch.cuda.empty_cache()


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_update_refused_while_the_weights_sleep_then_kv_first(colo, model_dirs, level):
    """An update while the weights sleep is refused and changes nothing; the
    other wake order (KV cache first) serves the same tokens. Level 2 also
    covers vllm/worker_ext holding vLLM's saved buffers across the KV-first
    wake, and the checkpoint reload when no update wrote the woken weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from bus.errors import ControlError

    cl = colo.client(timeout_s=300, control_timeout_s=300)
    # back on A first (the checkpoint): the level-2 reload must give these tokens
    mA = AutoModelForCausalLM.from_pretrained(model_dirs["A"], dtype=torch.bfloat16).cuda()
    cl.update_weights(list(mA.named_parameters()), transport="cuda_ipc")
    before = cl.generate(PROMPTS[0], dict(GREEDY)).samples[0]
    cl.sleep(level)
    with pytest.raises(ControlError, match="asleep"):
        cl.update_weights(list(mA.named_parameters()), transport="cuda_ipc")
    cl.wake_up(["kv_cache"])  # the other order: KV first
    _asleep(cl, ["weights"])
    r = list(cl.wake_up(["weights"]).values())[0]
    assert r["detail"]["reloaded_from_checkpoint"] is (level == 2)
    after = cl.generate(PROMPTS[0], dict(GREEDY)).samples[0]
    assert after.token_ids == before.token_ids
    v = before.token_versions[0] + (1 if level == 2 else 0)  # level 2: the checkpoint is a new weight state
    assert set(after.token_versions) == {v}
    del mA
    torch.cuda.empty_cache()
