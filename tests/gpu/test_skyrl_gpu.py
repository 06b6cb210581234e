"""SkyRL 0.3.0 on a GPU (issue 23): its own `SkyRLGymGenerator` against a
rollout-bus cluster with the vLLM backend, and its own CUDA IPC weight-sync
strategy (`get_transfer_strategy_cls("nccl", colocate_all=True)` →
`CudaIpcWeightTransferSender.send_chunks`), unmodified, through
`trainer_bridge.skyrl.RolloutBusEngine`: the colocated order sleep →
wake_up(["weights"]) → sync → wake_up(["kv_cache"]), then the served weights
checked against transformers. And its broadcast strategy
(`get_transfer_strategy_cls("nccl", colocate_all=False)` →
`BroadcastWeightTransferSender`, vLLM's NCCLWeightTransferEngine on the
trainer side), unmodified, with the trainer on GPU 0 and the engine on GPU 1
(2 GPUs; skipped with fewer; run it in ONE pytest process that sees both,
not under run_on_device.sh's TESTS_GPU1 split).

Both tests passed on nvidia-h200-x2 on 2026-11-27 (run 48 in RESULTS.md; Python 3.12, 2 passed in
109 s, one pytest process seeing both GPUs). Wheels it needs
there besides the vLLM bundle (no network on that machine; carry them in
.device/whl, see run_on_device.sh): skyrl-0.3.0 and skyrl_gym-0.4.0 (`pip
download --no-deps`), omegaconf 2.4.0, loguru 0.7.3 and pandas (their
imports), antlr4-python3-runtime if omegaconf asks for it, and ray (skyrl's
weight_sync package imports its broadcast strategy, which imports ray and asks
`ray._private.services.get_node_ip_address()` for the group's address).
The broadcast test only: `TESTS=tests/gpu/test_skyrl_gpu.py PYTEST_ARGS="-k broadcast"
bash tests/gpu/run_on_device.sh` on nvidia-h200-x2 / nvidia-h100-x2 (no TESTS_GPU1). Python 3.12 there
(skyrl 0.3.0's pydantic models need it). SkyRL's sender needs
torch.distributed: one gloo rank here.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import typing

import pytest

# As tests/test_skyrl_generator.py (skyrl's pydantic models), so that CPU CI's
# skip reason is the missing GPU, not this import; a no-op on the GPU's 3.12.
if sys.version_info < (3, 12):
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

try:
    import skyrl_gym
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.backends.skyrl_train.weight_sync import WeightChunk, get_transfer_strategy_cls
    from skyrl.train.config import GeneratorConfig, InferenceEngineConfig, SamplingParams, SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
except Exception as e:
    pytest.skip(f"skyrl / skyrl_gym not importable ({type(e).__name__}: {e})", allow_module_level=True)

from tests.gpu.common import ENGINE_OPTS, HF_GAP_TOL, PROMPTS, gpu_count, hf_check, record_timing
from tests.test_skyrl_adapter import CHAT_TEMPLATE
from trainer_bridge import AsyncClient
from trainer_bridge.skyrl import RolloutBusEngine

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
TURNS = 3


class TurnsEnv(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = TURNS

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= TURNS
        obs = [] if done else [{"role": "user", "content": "one two three"}]
        return BaseTextEnvStepOutput(observations=obs, reward=float(done), done=done, metadata={})


skyrl_gym.register(id="rollout_bus_gpu_turns", entry_point=TurnsEnv)


def _batch(cfg) -> dict:
    """8 one-prompt trajectories of the TurnsEnv, SkyRL's vLLM sampling params."""
    return {
        "prompts": [[{"role": "user", "content": f"hello {i}"}] for i in range(8)],
        "env_classes": ["rollout_bus_gpu_turns"] * 8,
        "env_extras": [{} for _ in range(8)],
        "sampling_params": get_sampling_params_for_backend("vllm", cfg.sampling_params),
    }


@pytest.fixture(scope="module")
def cluster(model_dirs):
    from tests.cluster import Cluster

    c = Cluster(1, backend="vllm", model=model_dirs["A"], backend_options=dict(ENGINE_OPTS))
    try:
        c.wait_ready(1, timeout_s=240)
        yield c
    finally:
        c.close()


@pytest.fixture
def rank0():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_skyrl_generator_then_its_cuda_ipc_strategy_colocated(cluster, model_dirs, rank0):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["A"])
    tok.chat_template = CHAT_TEMPLATE
    cfg = GeneratorConfig(
        sampling_params=SamplingParams(max_generate_length=16, temperature=1.0, logprobs=1),
        max_turns=TURNS,
        max_input_length=1024,
        use_conversation_multi_turn=True,
        batched=False,
    )
    ie = InferenceEngineConfig(model_dtype="bfloat16", weight_sync_backend="nccl")
    strategy = get_transfer_strategy_cls(ie.weight_sync_backend, colocate_all=True)
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).cuda()
    named = [(n, p.detach()) for n, p in mB.named_parameters()]
    chunks = [
        WeightChunk(
            names=[n for n, _ in part],
            dtypes=[str(t.dtype) for _, t in part],
            shapes=[list(t.shape) for _, t in part],
            tensors=[t for _, t in part],
        )
        for part in (named[: len(named) // 2], named[len(named) // 2 :])
    ]

    async def scenario():
        client = AsyncClient(cluster.frontend, timeout_s=120, control_timeout_s=120)
        try:
            engine = await RolloutBusEngine.connect(client, num_engines=1, tokenizer=tok)
            gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tok)
            batch = _batch(cfg)
            out = await gen.generate(batch, disable_tqdm=True)
            v0 = (await client.health())["weight_version"]
            info = strategy.create_init_info(ie)
            await engine.init_weight_update_communicator(info)  # CudaIpcInitInfo → rollout-bus's cuda_ipc
            sender = strategy.create_sender(info, engine)
            await engine.sleep()  # SkyRL's colocated loop (level 2)
            await engine.wake_up(tags=["weights"])
            await sender.send_chunks(chunks)  # SkyRL's sender, unmodified
            await engine.wake_up(tags=["kv_cache"])
            v1 = (await client.health())["weight_version"]
            greedy = await client.generate(PROMPTS, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
            return out, v0, v1, [r.samples[0].token_ids for r in greedy]
        finally:
            await client.close()  # a failed scenario must not leave it to the GC

    out, v0, v1, toks = asyncio.run(asyncio.wait_for(scenario(), 480))
    assert len(out["response_ids"]) == 8
    for ids, mask in zip(out["response_ids"], out["loss_masks"], strict=True):
        assert len(ids) == len(mask) and 0 in mask
    assert v1 == v0 + 1
    gap, agree = hf_check(model_dirs["B"], toks)
    record_timing("skyrl_cuda_ipc_vs_hf_B", max_logprob_gap=round(gap, 4), argmax_agreement=round(agree, 3))
    assert gap < HF_GAP_TOL and agree > 0.9


def _cluster_on(model: str, gpus: str):
    """One vllm engine on `gpus` (CUDA_VISIBLE_DEVICES of its processes only)."""
    from tests.cluster import Cluster

    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        c = Cluster(1, backend="vllm", model=model, backend_options={**ENGINE_OPTS, "enable_lora": False})
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    try:
        c.wait_ready(1, timeout_s=240)
    except BaseException:
        print(c.log("e0")[-5000:])
        c.close()
        raise
    return c


def test_skyrl_generator_then_its_broadcast_strategy_trainer_gpu0_engine_gpu1(model_dirs, rank0):
    """SkyRL's non-colocated weight sync, unmodified: create_sender (rank 0:
    vLLM's trainer_init) concurrently with init_weight_update_communicator
    (the engine's workers join that group), then send_chunks
    (start_weight_update, update_weights_nccl while vLLM's
    trainer_send_weights broadcasts packed, finish_weight_update)."""
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs (trainer on GPU 0, engine on GPU 1); {gpu_count()} visible at collection")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.cuda.set_device(0)
    tok = AutoTokenizer.from_pretrained(model_dirs["A"])
    tok.chat_template = CHAT_TEMPLATE
    cfg = GeneratorConfig(
        sampling_params=SamplingParams(max_generate_length=16, temperature=1.0, logprobs=1),
        max_turns=TURNS,
        max_input_length=1024,
        use_conversation_multi_turn=True,
        batched=False,
    )
    ie = InferenceEngineConfig(model_dtype="bfloat16", weight_sync_backend="nccl")
    strategy = get_transfer_strategy_cls(ie.weight_sync_backend, colocate_all=False)  # BroadcastTransferStrategy
    mB = AutoModelForCausalLM.from_pretrained(model_dirs["B"], dtype=torch.bfloat16).to("cuda:0")
    named = [(n, p.detach()) for n, p in mB.named_parameters()]
    chunks = [WeightChunk(names=[n], dtypes=[str(t.dtype)], shapes=[list(t.shape)], tensors=[t]) for n, t in named]
    # what SkyRL's weight extractor's get_weight_metadata gives
    meta = {
        "names": [n for n, _ in named],
        "dtype_names": ["bfloat16"] * len(named),
        "shapes": [list(t.shape) for _, t in named],
    }
    c = _cluster_on(model_dirs["A"], "1")

    async def scenario():
        client = AsyncClient(c.frontend, timeout_s=120, control_timeout_s=120)
        try:
            engine = await RolloutBusEngine.connect(client, num_engines=1, tokenizer=tok)
            gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tok)
            batch = _batch(cfg)
            out = await gen.generate(batch, disable_tqdm=True)
            v0 = (await client.health())["weight_version"]
            world, _ = await engine.get_world_size()
            info = strategy.create_init_info(ie, inference_world_size=world)
            t0 = time.perf_counter()
            # SkyRL's Worker.init_weight_sync_state: sender and receivers concurrently (one group)
            sender, joined = await asyncio.gather(
                asyncio.to_thread(strategy.create_sender, init_info=info, inference_client=engine),
                engine.init_weight_update_communicator(info),
            )
            t1 = time.perf_counter()
            await sender.send_chunks(chunks, weight_metadata=meta)  # SkyRL's sender, unmodified
            t2 = time.perf_counter()
            v1 = (await client.health())["weight_version"]
            greedy = await client.generate(PROMPTS, {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
            after = await gen.generate(batch, disable_tqdm=True)  # the generator on the new weights
            timing = {"init_s": round(t1 - t0, 4), "send_s": round(t2 - t1, 4), "joined": joined}
            return out, after, v0, v1, greedy, timing, info
        finally:
            await client.close()  # a failed scenario must not leave it to the GC

    try:
        out, after, v0, v1, greedy, timing, info = asyncio.run(asyncio.wait_for(scenario(), 480))
    finally:
        c.close()
    assert info.world_size == 2 and info.rank_offset == 1
    for o in (out, after):
        assert len(o["response_ids"]) == 8
        for ids, mask in zip(o["response_ids"], o["loss_masks"], strict=True):
            assert len(ids) == len(mask) and 0 in mask
    assert v1 == v0 + 1
    assert all(set(r.samples[0].token_versions) == {v1} for r in greedy)
    toks = [r.samples[0].token_ids for r in greedy]
    gap, agree = hf_check(model_dirs["B"], toks)
    record_timing("skyrl_broadcast_vs_hf_B", max_logprob_gap=round(gap, 4), argmax_agreement=round(agree, 3), **timing)
    assert gap < HF_GAP_TOL and agree > 0.9
